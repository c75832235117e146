"""One way to list and run an operator's scripts.

Lease hooks, verify scripts, drop-in probes (and the tools the probe pass
and the GPU health checks run: nvidia-smi, lspci) all go through here, so
they share:

- **one listing rule** for a script directory (``probe_dir``, ``verify_dir``):
  its entries in name order; a name starting with ``.`` is skipped silently
  (``.keep``, editor swap files); a directory, anything that is not a
  regular file (a FIFO, a socket, a device) and a file without the execute
  bit are skipped and logged; an entry that cannot be ``stat``-ed (a dangling
  symlink) is listed with its problem, because a script that is meant to run
  and cannot is a failure, not an absence. Symlinks are followed. A missing
  directory has no scripts; one that exists but cannot be listed raises
  ``OSError`` for the caller to report.
- **one limit**: each run gets the script's own timeout or what is left of
  its pass's budget, whichever is smaller (:class:`Budget`), enforced by
  ``supervise.run_job``'s deadline and kill path (own process group,
  SIGTERM, a grace no longer than the limit itself, SIGKILL, reaped).
- **one capture**: stdout kept whole up to a cap (past it the script is
  stopped and the run fails) or, for a script whose stdout nobody parses,
  only its tail; stderr always as a bounded tail (:data:`TAIL_KEEP` bytes).
- **one failure description** (:func:`describe`).
"""

from __future__ import annotations

import errno
import logging
import os
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path

import attrs
import trio

from rc_worker.core.gpu_query import text_tail
from rc_worker.host import Host, RunAs
from rc_worker.statestore import LINUX_STORE, StateStore
from rc_worker.supervise import REASON_MAX_RUNTIME, JobHandle, JobSpec, Result, run_job

log = logging.getLogger("rc_worker.scripts")

TAIL_KEEP = 4096
"""Bytes of a script's stderr (or uncaptured stdout) kept; the rest is dropped, never held."""

REASON_OUTPUT_CAP = "output cap"
"""The stop reason of a script stopped for printing more than its cap."""


# -- listing -------------------------------------------------------------------


@attrs.frozen
class Script:
    """One entry of a script directory that is to run.

    ``problem`` is set (``"could not stat: ..."``) when it could not even be
    looked at: the caller decides what that costs (a probe fails, a verify
    pass fails).
    """

    name: str
    path: str
    problem: str = ""


@attrs.frozen
class Skipped:
    """An entry the listing rule leaves out on purpose, and why (for the log)."""

    path: str
    why: str


@attrs.frozen
class Listing:
    scripts: tuple[Script, ...] = ()
    skipped: tuple[Skipped, ...] = ()


def list_scripts(directory: str | os.PathLike[str], store: StateStore = LINUX_STORE) -> Listing:
    """The scripts of ``directory`` by the one listing rule (see the module docstring),
    as the host's ``store`` shows them (the real disk by default).

    A missing directory is an empty listing; any other failure to list it
    (not a directory, no permission) raises ``OSError``.
    """
    root = os.fspath(directory)
    try:
        names = store.listdir(Path(root))
    except FileNotFoundError:
        return Listing()
    scripts: list[Script] = []
    skipped: list[Skipped] = []
    for name in names:
        if name.startswith("."):
            continue
        path = os.path.join(root, name)
        try:
            entry = store.entry(Path(path))
            if entry is None:  # gone since it was listed, or a dangling link
                raise FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), path)
        except OSError as e:
            scripts.append(Script(name, path, f"could not stat: {e.strerror or e}"))
            continue
        if entry.kind == "dir":
            skipped.append(Skipped(path, "it is a directory"))
        elif entry.kind != "file":
            skipped.append(Skipped(path, "it is not a regular file"))
        elif not entry.executable:
            skipped.append(Skipped(path, "it is not executable (chmod +x to enable it)"))
        else:
            scripts.append(Script(name, path))
    return Listing(tuple(scripts), tuple(skipped))


def log_skipped(skipped: Iterable[Skipped], reported: set[str] | None = None) -> None:
    """Log each skipped entry: a warning the first time ``reported`` sees it, debug after.

    Loud once, quiet after, for a caller that lists the same directory every
    pass (a README in probe.d is not news every five minutes). Without
    ``reported`` every call warns.
    """
    for skip in skipped:
        seen = reported is not None and skip.path in reported
        if reported is not None:
            reported.add(skip.path)
        log.log(logging.DEBUG if seen else logging.WARNING, "skipping %s: %s", skip.path, skip.why)


# -- the limit -------------------------------------------------------------------


@attrs.frozen
class Limit:
    """The time one run gets: ``seconds``, from its own ``timeout`` or its pass's ``budget``."""

    seconds: float
    timeout: float
    budget: float | None = None

    @property
    def from_budget(self) -> bool:
        """Whether the pass's budget, not the script's own timeout, sets this limit."""
        return self.budget is not None and self.seconds < self.timeout


class Budget:
    """Per-run limits for a pass of scripts: each its ``timeout``, all of them ``budget``.

    Created when the pass starts (it reads Trio's clock). ``budget=None`` is
    a pass of one run with no budget of its own (a hook).
    """

    def __init__(self, timeout: float, budget: float | None = None) -> None:
        self.timeout = timeout
        self.budget = budget
        self._deadline = None if budget is None else trio.current_time() + budget

    def next(self) -> Limit | None:
        """The next run's limit, or ``None`` when the budget is spent (do not start it)."""
        if self._deadline is None:
            return Limit(self.timeout, self.timeout)
        left = self._deadline - trio.current_time()
        if left <= 0:
            return None
        return Limit(min(self.timeout, left), self.timeout, self.budget)


# -- capture -----------------------------------------------------------------------


class TailBuffer:
    """A sink that keeps only the last ``limit`` bytes written to it."""

    def __init__(self, limit: int = TAIL_KEEP) -> None:
        self._limit = limit
        self.data = bytearray()

    async def __call__(self, chunk: bytes) -> None:
        self.data += chunk
        if len(self.data) > self._limit:
            del self.data[: len(self.data) - self._limit]


class _Capped:
    """A sink keeping at most ``cap`` bytes; past it, it calls ``overflow`` once."""

    def __init__(self, cap: int, overflow: Callable[[], None]) -> None:
        self._cap = cap
        self._overflow = overflow
        self.data = bytearray()
        self.overflowed = False

    async def __call__(self, chunk: bytes) -> None:
        if self.overflowed:
            return
        if len(self.data) + len(chunk) > self._cap:
            self.overflowed = True
            self._overflow()
            return
        self.data += chunk


def tail_text(data: bytes | bytearray) -> str:
    """Bytes a script printed as one short line, for a log line or a reason."""
    return text_tail(bytes(data).decode("utf-8", "replace"))


# -- running -----------------------------------------------------------------------


@attrs.frozen
class ScriptRun:
    """How one script run went.

    ``output``: its stdout (with ``merge_stderr``, both streams in order), all
    of it up to the cap, or its tail when run without one. ``stderr``: the
    tail of its stderr (empty with ``merge_stderr``).
    """

    result: Result
    limit: Limit
    output: bytes = b""
    stderr: bytes = b""
    cap: int | None = None
    overflowed: bool = False
    merged: bool = False
    seconds: float = 0.0

    @property
    def tail(self) -> str:
        """What it said, as one line: its stderr's tail, or its one stream's when merged."""
        return tail_text(self.output if self.merged else self.stderr)

    @property
    def ok(self) -> bool:
        """Started, ran to its end on its own within its limit and cap, and exited 0."""
        r = self.result
        return not self.overflowed and not r.killed and r.error is None and r.exit_code == 0


async def run_script(
    command: Sequence[str],
    *,
    env: Mapping[str, str],
    limit: Limit,
    grace: float,
    host: Host | None = None,
    cwd: str | None = None,
    run_as: RunAs | None = None,
    output_cap: int | None = None,
    merge_stderr: bool = False,
) -> ScriptRun:
    """Run ``command`` as a script: its own process group, killed at ``limit``.

    ``env`` is its whole environment. ``grace`` is its SIGTERM → SIGKILL
    window, never more than the limit itself. With ``output_cap`` its stdout
    is kept whole and it is stopped once it prints more; without, only the
    tail is kept. Never raises for a script that fails; cancellation of the
    surrounding scope kills it and propagates (``run_job``'s contract).
    """
    start = trio.current_time()
    handle = JobHandle()
    out: TailBuffer | _Capped
    if output_cap is None:
        out = TailBuffer()
    else:
        out = _Capped(output_cap, lambda: handle.stop(REASON_OUTPUT_CAP))
    err = None if merge_stderr else TailBuffer()
    spec = JobSpec(
        command=tuple(command),
        cwd=cwd,
        env=env,
        grace_ceiling=min(grace, limit.seconds),
        max_runtime=limit.seconds,
        stderr=err,
        run_as=run_as,
    )
    result = await run_job(spec, out, host=host, handle=handle)
    return ScriptRun(
        result=result,
        limit=limit,
        output=bytes(out.data),
        stderr=b"" if err is None else bytes(err.data),
        cap=output_cap,
        overflowed=isinstance(out, _Capped) and out.overflowed,
        merged=merge_stderr,
        seconds=trio.current_time() - start,
    )


# -- the failure description ----------------------------------------------------------


def describe(
    run: ScriptRun, what: str = "", *, exit_label: str = "exited", exit_ok: bool = False
) -> str:
    """Why ``run`` failed, as one line (``""`` when it did not).

    ``what`` names the script (``"on_acquire hook /etc/rc/acquire"``,
    ``"20-ecc"``); without it the reason stands alone (a probe's ``why``).
    ``exit_label`` is the words before a non-zero exit status (``exited 3``,
    ``exit status 3``). With ``exit_ok`` a plain non-zero exit is not a
    failure here: the caller reads the output for what it means. The tail of
    what the script said follows, except where it could not run at all or its
    output was cut off.
    """
    r = run.result
    sentence = True  # "20-bad exited 2" reads on from the name; a budget note does not
    tail = True
    if run.overflowed:
        why, tail = f"output over the {run.cap}-byte cap", False
    elif r.killed and r.reason == REASON_MAX_RUNTIME and run.limit.from_budget:
        why, sentence = f"stopped when the pass budget of {run.limit.budget:g}s ran out", False
    elif r.killed and r.reason == REASON_MAX_RUNTIME:
        why = f"timed out after {run.limit.timeout:g}s"
    elif r.killed:
        why = f"killed ({r.reason})"
    elif r.exit_code is None:
        why, tail = f"could not run: {r.error}", False
    elif r.signal is not None:
        why = f"killed by signal {r.signal}"
    elif r.exit_code != 0 and not exit_ok:
        why = f"{exit_label} {r.exit_code}"
    else:
        return ""
    said = run.tail if tail else ""
    if said:
        why = f"{why}: {said}"
    if not what:
        return why
    return f"{what} {why}" if sentence else f"{what}: {why}"
