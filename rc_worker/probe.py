"""One probe pass: built-in host facts, nvidia-smi, and the drop-ins of ``probe_dir``.

The Trio shell around ``labels.py``: it runs the sources, times them on
Trio's clock, and hands their outcomes to ``merge_sources``. A ``Prober``
lives as long as the worker process, because what a failure means depends
on it: a drop-in unconfirms the devices it named the last time it worked in
THIS process, and nvidia-smi missing from PATH matters only if it was there
on this Prober's first pass (the seed's ``ProbeResult`` comment).

Every probe runs through ``supervise.run_job``: its own process group, killed
(SIGTERM, a short grace, SIGKILL) at ``probe_timeout`` or when the pass's
``probe_pass_budget`` runs out, whichever comes first.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Mapping
from pathlib import Path

import attrs
import trio

from rc_worker.config import Config, probe_environ
from rc_worker.host import Host, LinuxHost
from rc_worker.labels import (
    BUILTIN,
    DROPIN_PREFIX,
    DROPIN_STDOUT_CAP,
    NVIDIA_SMI,
    NVIDIA_SMI_ARGS,
    History,
    ProbeResult,
    SourceFacts,
    gpu_scope,
    merge_sources,
    nvidia_smi_facts,
    parse_dropin_output,
    text_tail,
)
from rc_worker.supervise import REASON_MAX_RUNTIME, JobHandle, JobSpec, Result, run_job

log = logging.getLogger("rc_worker.probe")

PROBE_GRACE = 1.0
"""SIGTERM -> SIGKILL window for a probe: it is read-only work, nothing to save."""

NVIDIA_SMI_OUTPUT_CAP = 1024 * 1024
"""Far above any real listing; only there so a broken binary cannot fill memory."""

STDERR_KEEP = 4096
"""Bytes of a probe's stderr kept for the log and the reason; the rest is dropped."""

_STOP_CAP = "output cap"


@attrs.frozen
class SourceOutcome:
    """How one source fared this pass, for logs, ``rc-worker probe`` and status.

    ``why`` is empty when ``ok``, else a short reason ("timed out after 10s",
    "exit status 3: <stderr tail>", "skipped for budget", ...).
    """

    name: str
    ok: bool
    why: str = ""
    seconds: float = 0.0


@attrs.frozen
class ProbePass:
    """One pass: the merged result, every source's outcome, and where nvidia-smi was."""

    result: ProbeResult
    sources: tuple[SourceOutcome, ...] = ()
    nvidia_smi: str | None = None


class _Capture:
    """A sink keeping at most ``cap`` bytes; past it, it calls ``overflow`` once."""

    def __init__(self, cap: int, overflow: Callable[[], None] | None = None) -> None:
        self._cap = cap
        self._overflow = overflow
        self.data = bytearray()
        self.overflowed = False

    async def __call__(self, chunk: bytes) -> None:
        if self.overflowed:
            return
        if len(self.data) + len(chunk) > self._cap:
            self.overflowed = True
            if self._overflow is not None:
                self._overflow()
            return
        self.data += chunk


Capture = _Capture
"""Public name for the GPU health checks, which run their tools as probes do."""


class _Tail:
    """A sink keeping only the last ``limit`` bytes: stderr is logged, never parsed."""

    def __init__(self, limit: int = STDERR_KEEP) -> None:
        self._limit = limit
        self.data = bytearray()

    async def __call__(self, chunk: bytes) -> None:
        self.data += chunk
        if len(self.data) > self._limit:
            del self.data[: len(self.data) - self._limit]

    def text(self) -> str:
        return text_tail(self.data.decode("utf-8", "replace"))


@attrs.frozen
class _DropIn:
    name: str
    path: str
    problem: str = ""  # set when it could not even be looked at


class Prober:
    """Runs probe passes for one worker process and remembers what a failure means.

    ``environ`` (default ``os.environ``, read at each pass) is where the PATH
    that finds nvidia-smi comes from, and what every probe's environment is
    built from (less the worker's own RC_* settings). ``host`` supplies the
    built-in facts and spawns the probes.
    """

    def __init__(
        self,
        config: Config,
        *,
        host: Host | None = None,
        environ: Mapping[str, str] | None = None,
    ) -> None:
        self._config = config
        self._host: Host = host if host is not None else LinuxHost()
        self._environ: Mapping[str, str] = os.environ if environ is None else environ
        self._declared = {dev.name: dict(dev.labels) for dev in config.devices}
        self._history: History = {}
        self._smi_seen_at_start: bool | None = None
        self._bus_ids: dict[str, int] = {}
        self._skips_reported: set[str] = set()
        self._lock = trio.Lock()

    @property
    def history(self) -> History:
        """Each drop-in's devices on its last success in this Prober."""
        return self._history

    async def gather(self) -> ProbePass:
        """Run one pass and return what it found; never raises for a failing source."""
        async with self._lock:
            deadline = trio.current_time() + self._config.probe_pass_budget
            facts: list[SourceFacts] = []
            outcomes: list[SourceOutcome] = []
            builtin = self._builtin()
            facts.append(builtin[0])
            outcomes.append(builtin[1])
            smi_path = self._host.store.which(NVIDIA_SMI, self._environ.get("PATH", os.defpath))
            smi = await self._nvidia_smi(smi_path, deadline)
            if smi is not None:
                facts.append(smi[0])
                outcomes.append(smi[1])
            for source, outcome in await self._dropins(deadline):
                facts.append(source)
                outcomes.append(outcome)
            merged = merge_sources(self._declared, facts, self._history)
            self._history = merged.history
            for outcome in outcomes:
                if not outcome.ok:
                    log.warning("probe %s failed: %s", outcome.name, outcome.why)
            if merged.result.unconfirmed:
                log.info(
                    "probe pass left %s unconfirmed: their previous labels stay",
                    ", ".join(d for d in self._declared if d in merged.result.unconfirmed),
                )
            return ProbePass(result=merged.result, sources=tuple(outcomes), nvidia_smi=smi_path)

    # -- built-ins --

    def _builtin(self) -> tuple[SourceFacts, SourceOutcome]:
        # Called inline rather than in a thread: they are /proc reads and one
        # statvfs, and a thread would let a virtual clock jump past them.
        start = trio.current_time()
        host = self._host
        readers: dict[str, Callable[[], object]] = {
            "hostname": host.hostname,
            "kernel": host.kernel,
            "cpu_count": host.cpu_count,
            "mem_total_bytes": host.mem_total_bytes,
            "disk_free_bytes": lambda: host.disk_free_bytes(self._config.state_dir),
        }
        found: dict[str, str] = {}
        problems: list[str] = []
        for label, read in readers.items():
            try:
                found[label] = str(read())
            except Exception as e:
                # One unreadable fact is left out; it must not cost the others.
                log.warning("built-in fact %s left out: %s", label, e)
                problems.append(f"{label}: {e}")
        # Built-ins speak for no device, so they never unconfirm one.
        facts = SourceFacts(name=BUILTIN, ok=True, host=found, scope=frozenset())
        outcome = SourceOutcome(
            BUILTIN, not problems, "; ".join(problems), trio.current_time() - start
        )
        return facts, outcome

    # -- nvidia-smi --

    async def _nvidia_smi(
        self, path: str | None, deadline: float
    ) -> tuple[SourceFacts, SourceOutcome] | None:
        if self._smi_seen_at_start is None:
            self._smi_seen_at_start = path is not None
        scope = gpu_scope(self._config.device_names)
        scope_set = frozenset(scope.values())
        if not scope:
            return None  # no declared gpu<N>: nothing it could speak for
        if path is None:
            if not self._smi_seen_at_start:
                # Never seen by this process: a GPU-less host, whose device
                # labels must stay clearable.
                return None
            return (
                SourceFacts.failed(NVIDIA_SMI, scope_set),
                SourceOutcome(NVIDIA_SMI, False, "not found on PATH (it was at startup)"),
            )
        start = trio.current_time()
        limit = self._limit(deadline)
        if limit is None:
            return SourceFacts.failed(NVIDIA_SMI, scope_set), SourceOutcome(
                NVIDIA_SMI, False, "skipped for budget"
            )
        handle = JobHandle()
        out = _Capture(NVIDIA_SMI_OUTPUT_CAP, lambda: handle.stop(_STOP_CAP))
        spec = JobSpec(
            command=(path, *NVIDIA_SMI_ARGS),
            env=probe_environ(self._environ),
            grace_ceiling=PROBE_GRACE,
            max_runtime=limit,
        )
        # stderr=None merges both streams into one pipe, in order: an error
        # line may come on either and stands in its GPU's place.
        result = await run_job(spec, out, host=self._host, handle=handle)
        seconds = trio.current_time() - start
        text = out.data.decode("utf-8", "replace")
        failure = self._failure(result, limit, out.overflowed, NVIDIA_SMI_OUTPUT_CAP)
        if failure or result.exit_code is None:
            return SourceFacts.failed(NVIDIA_SMI, scope_set), SourceOutcome(
                NVIDIA_SMI, False, failure, seconds
            )
        reading = nvidia_smi_facts(
            text, result.exit_code, self._config.device_names, known_bus_ids=self._bus_ids
        )
        # Remember where each index sits, so a later "lost" line that names
        # only a bus id can still be attributed; drop what moved.
        moved = set(reading.bus_ids.values())
        self._bus_ids = {b: i for b, i in self._bus_ids.items() if i not in moved}
        self._bus_ids.update(reading.bus_ids)
        ok = reading.facts.ok and not reading.why
        return reading.facts, SourceOutcome(NVIDIA_SMI, ok, reading.why, seconds)

    # -- drop-ins --

    async def _dropins(self, deadline: float) -> list[tuple[SourceFacts, SourceOutcome]]:
        try:
            entries = self._list_probe_dir()
        except OSError as e:
            # The directory exists but cannot be read: every drop-in that
            # has worked before is failing to run, not gone.
            why = f"could not list {self._config.probe_dir}: {e.strerror or e}"
            return [
                (SourceFacts.failed(name), SourceOutcome(name, False, why))
                for name in sorted(self._history)
                if name.startswith(DROPIN_PREFIX)
            ]
        done = []
        for entry in entries:
            if entry.problem:
                done.append(
                    (
                        SourceFacts.failed(entry.name),
                        SourceOutcome(entry.name, False, entry.problem),
                    )
                )
                continue
            done.append(await self._run_dropin(entry, deadline))
        return done

    def _list_probe_dir(self) -> list[_DropIn]:
        directory = self._config.probe_dir
        store = self._host.store
        try:
            names = store.listdir(Path(directory))
        except FileNotFoundError:
            return []  # no probe_dir: no drop-ins, and nothing wrong
        entries = []
        for name in names:
            if name.startswith("."):
                continue
            path = os.path.join(directory, name)
            source = DROPIN_PREFIX + name
            try:
                entry = store.entry(Path(path))
            except OSError as e:
                entries.append(_DropIn(source, path, f"could not stat: {e.strerror or e}"))
                continue
            if entry is None:
                entries.append(_DropIn(source, path, "could not stat: No such file or directory"))
                continue
            if entry.kind == "dir":
                self._skip(path, "it is a directory")
            elif entry.kind != "file":
                self._skip(path, "it is not a regular file")
            elif not entry.executable:
                self._skip(path, "it is not executable (chmod +x to enable it)")
            else:
                entries.append(_DropIn(source, path))
        return entries

    def _skip(self, path: str, why: str) -> None:
        # Loud once, quiet after: a README in probe.d is not news every pass.
        level = logging.DEBUG if path in self._skips_reported else logging.WARNING
        self._skips_reported.add(path)
        log.log(level, "skipping %s: %s", path, why)

    async def _run_dropin(
        self, entry: _DropIn, deadline: float
    ) -> tuple[SourceFacts, SourceOutcome]:
        limit = self._limit(deadline)
        if limit is None:
            return SourceFacts.failed(entry.name), SourceOutcome(
                entry.name, False, "skipped for budget"
            )
        start = trio.current_time()
        handle = JobHandle()
        out = _Capture(DROPIN_STDOUT_CAP, lambda: handle.stop(_STOP_CAP))
        err = _Tail()
        env = probe_environ(self._environ)
        env["RC_HOST"] = self._config.host
        env["RC_DEVICES"] = ",".join(self._config.device_names)
        spec = JobSpec(
            command=(entry.path,),
            cwd=self._config.probe_dir,
            env=env,
            grace_ceiling=PROBE_GRACE,
            max_runtime=limit,
            stderr=err,
        )
        result = await run_job(spec, out, host=self._host, handle=handle)
        seconds = trio.current_time() - start
        why = self._failure(result, limit, out.overflowed, DROPIN_STDOUT_CAP)
        if not why and result.exit_code != 0:
            why = f"exit status {result.exit_code}"
        if why:
            stderr = err.text()
            if stderr and not why.startswith(("could not", "output over")):
                why = f"{why}: {stderr}"
            return SourceFacts.failed(entry.name), SourceOutcome(entry.name, False, why, seconds)
        if err.data:
            log.info("probe %s said on stderr: %s", entry.name, err.text())
        try:
            host, device = parse_dropin_output(bytes(out.data), self._declared)
        except ValueError as e:
            return SourceFacts.failed(entry.name), SourceOutcome(entry.name, False, str(e), seconds)
        facts = SourceFacts(name=entry.name, ok=True, host=host, device=device)
        return facts, SourceOutcome(entry.name, True, "", seconds)

    # -- shared --

    def _limit(self, deadline: float) -> float | None:
        """This probe's time limit: its timeout, or what is left of the pass budget."""
        remaining = deadline - trio.current_time()
        if remaining <= 0:
            return None
        return min(self._config.probe_timeout, remaining)

    def _failure(self, result: Result, limit: float, overflowed: bool, cap: int) -> str:
        """Why a run is unusable whatever it printed, or ``""``."""
        if overflowed:
            return f"output over the {cap}-byte cap"
        if result.killed and result.reason == REASON_MAX_RUNTIME:
            if limit < self._config.probe_timeout:
                return (
                    f"stopped when the pass budget of {self._config.probe_pass_budget:g}s ran out"
                )
            return f"timed out after {self._config.probe_timeout:g}s"
        if result.exit_code is None:
            return f"could not run: {result.error}"
        if result.signal is not None:
            return f"killed by signal {result.signal}"
        return ""
