"""One probe pass: built-in host facts, nvidia-smi, and the drop-ins of ``probe_dir``.

The Trio shell around ``core/labels.py``, ``core/gpu_query.py`` and
``core/dropin_output.py``: it runs the sources, times them on
Trio's clock, and hands their outcomes to ``merge_sources``. A ``Prober``
lives as long as the worker process, because what a failure means depends
on it: a drop-in unconfirms the devices it named the last time it worked in
THIS process, and nvidia-smi missing from PATH matters only if it was there
on this Prober's first pass (the seed's ``ProbeResult`` comment).

Every probe runs through ``scripts.run_script``, as hooks and verify scripts
do: its own process group, killed (SIGTERM, a short grace, SIGKILL) at
``probe_timeout`` or when the pass's ``probe_pass_budget`` runs out, whichever
comes first; drop-ins are found by the one listing rule (``list_scripts``).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Mapping

import attrs
import trio

from rc_worker.core.config import Config, probe_environ
from rc_worker.core.dropin_output import DROPIN_PREFIX, DROPIN_STDOUT_CAP, parse_dropin_output
from rc_worker.core.durations import coarse_bytes
from rc_worker.core.gpu_query import NVIDIA_SMI, NVIDIA_SMI_ARGS, gpu_scope, nvidia_smi_facts
from rc_worker.core.labels import BUILTIN, History, ProbeResult, SourceFacts, merge_sources
from rc_worker.host import Host, LinuxHost
from rc_worker.scripts import (
    Budget,
    Limit,
    Script,
    ScriptRun,
    describe,
    list_scripts,
    log_skipped,
    run_script,
    tail_text,
)

log = logging.getLogger("rc_worker.probe")

PROBE_GRACE = 1.0
"""SIGTERM -> SIGKILL window for a probe: it is read-only work, nothing to save."""

NVIDIA_SMI_OUTPUT_CAP = 1024 * 1024
"""Far above any real listing; only there so a broken binary cannot fill memory."""

EXIT_LABEL = "exit status"
"""How a probe's ``why`` words a non-zero exit (``exit status 3: <stderr tail>``)."""


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
            budget = Budget(self._config.probe_timeout, self._config.probe_pass_budget)
            facts: list[SourceFacts] = []
            outcomes: list[SourceOutcome] = []
            builtin = self._builtin()
            facts.append(builtin[0])
            outcomes.append(builtin[1])
            smi_path = self._host.store.which(NVIDIA_SMI, self._environ.get("PATH", os.defpath))
            smi = await self._nvidia_smi(smi_path, budget)
            if smi is not None:
                facts.append(smi[0])
                outcomes.append(smi[1])
            for source, outcome in await self._dropins(budget):
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
            # Three significant digits: exact to the byte, it changed at every pass.
            "disk_free_bytes": lambda: coarse_bytes(host.disk_free_bytes(self._config.state_dir)),
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
        self, path: str | None, budget: Budget
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
        limit = budget.next()
        if limit is None:
            return SourceFacts.failed(NVIDIA_SMI, scope_set), SourceOutcome(
                NVIDIA_SMI, False, "skipped for budget"
            )
        # Both streams merged into one, in order: an error line may come on
        # either and stands in its GPU's place.
        run = await self._run(
            (path, *NVIDIA_SMI_ARGS),
            limit,
            env=probe_environ(self._environ),
            output_cap=NVIDIA_SMI_OUTPUT_CAP,
            merge_stderr=True,
        )
        result = run.result
        # A non-zero exit is still an answer: the listing says which GPU is lost.
        failure = describe(run, exit_ok=True)
        if failure or result.exit_code is None:
            return SourceFacts.failed(NVIDIA_SMI, scope_set), SourceOutcome(
                NVIDIA_SMI, False, failure, run.seconds
            )
        reading = nvidia_smi_facts(
            run.output.decode("utf-8", "replace"),
            result.exit_code,
            self._config.device_names,
            known_bus_ids=self._bus_ids,
        )
        # Remember where each index sits, so a later "lost" line that names
        # only a bus id can still be attributed; drop what moved.
        moved = set(reading.bus_ids.values())
        self._bus_ids = {b: i for b, i in self._bus_ids.items() if i not in moved}
        self._bus_ids.update(reading.bus_ids)
        ok = reading.facts.ok and not reading.why
        return reading.facts, SourceOutcome(NVIDIA_SMI, ok, reading.why, run.seconds)

    # -- drop-ins --

    async def _dropins(self, budget: Budget) -> list[tuple[SourceFacts, SourceOutcome]]:
        try:
            listing = list_scripts(self._config.probe_dir, self._host.store)
        except OSError as e:
            # The directory exists but cannot be read: every drop-in that
            # has worked before is failing to run, not gone.
            why = f"could not list {self._config.probe_dir}: {e.strerror or e}"
            return [
                (SourceFacts.failed(name), SourceOutcome(name, False, why))
                for name in sorted(self._history)
                if name.startswith(DROPIN_PREFIX)
            ]
        log_skipped(listing.skipped, self._skips_reported)
        done = []
        for script in listing.scripts:
            name = DROPIN_PREFIX + script.name
            if script.problem:
                done.append((SourceFacts.failed(name), SourceOutcome(name, False, script.problem)))
                continue
            done.append(await self._run_dropin(name, script, budget))
        return done

    async def _run_dropin(
        self, name: str, script: Script, budget: Budget
    ) -> tuple[SourceFacts, SourceOutcome]:
        limit = budget.next()
        if limit is None:
            return SourceFacts.failed(name), SourceOutcome(name, False, "skipped for budget")
        env = probe_environ(self._environ)
        env["RC_HOST"] = self._config.host
        env["RC_DEVICES"] = ",".join(self._config.device_names)
        run = await self._run(
            (script.path,),
            limit,
            env=env,
            output_cap=DROPIN_STDOUT_CAP,
            cwd=self._config.probe_dir,
        )
        why = describe(run, exit_label=EXIT_LABEL)
        if why:
            return SourceFacts.failed(name), SourceOutcome(name, False, why, run.seconds)
        if run.stderr:
            log.info("probe %s said on stderr: %s", name, tail_text(run.stderr))
        try:
            host, device = parse_dropin_output(run.output, self._declared)
        except ValueError as e:
            return SourceFacts.failed(name), SourceOutcome(name, False, str(e), run.seconds)
        facts = SourceFacts(name=name, ok=True, host=host, device=device)
        return facts, SourceOutcome(name, True, "", run.seconds)

    # -- shared --

    async def _run(
        self,
        command: tuple[str, ...],
        limit: Limit,
        *,
        env: dict[str, str],
        output_cap: int,
        merge_stderr: bool = False,
        cwd: str | None = None,
    ) -> ScriptRun:
        return await run_script(
            command,
            env=env,
            limit=limit,
            grace=PROBE_GRACE,
            host=self._host,
            cwd=cwd,
            output_cap=output_cap,
            merge_stderr=merge_stderr,
        )
