"""The RC_JOB_ID sweep: remove what a job left behind outside its process group.

A job runs in its own session, and tearing down its process group catches
everything that stayed in it. A child that called ``setsid(2)`` left both, so
the sweep finds it the other way: by the ``RC_JOB_ID=<id>`` it inherited in
its environment (``/proc/<pid>/environ``), and signals it the same way the
group was (SIGTERM, the grace window, SIGKILL).

Residuals, accepted and documented rather than hidden: a process that
rewrote its own environment block or exec'd with a cleared environment
carries no id and is invisible here (a session leader found by id has its
whole group signalled too, which catches its env-less children); a pid can
in principle be reused between the scan and the signal.

REAPING A SURVIVOR MUST NEVER RELABEL A SUCCESSFUL JOB AS KILLED. The sweep
produces a :class:`SweepReport` and nothing else; it never sees, let alone
writes, a job's exit code, ``killed`` flag or reason (see the 2026-08-17
incident in the Go worker's sweep.go: 40 of 40 successful jobs reported
themselves killed because a straggler sweep was allowed to).
"""

from __future__ import annotations

import math
import signal
from collections.abc import Mapping

import attrs
import trio

from rc_worker.host import Host, LinuxHost, ProcessInfo

JOB_ID_VAR = "RC_JOB_ID"

# How long to wait for SIGKILL to take effect before reporting what is left.
# SIGKILL cannot be caught, so anything still there after this is stuck in
# the kernel (uninterruptible sleep), not slow.
KILL_WAIT = 1.0

# The poll that watches for survivors to vanish backs off to this. Nothing
# notifies us when an unrelated (non-child) process exits, so a bounded poll
# inside a deadline is the honest mechanism here.
_POLL_MAX = 0.1

# See scan(): how long to give a process that was caught mid-exec.
EXEC_SETTLE = 0.005


@attrs.frozen
class SweepReport:
    """What the RC_JOB_ID sweep saw and did. A report, never an outcome.

    ``scanned``: the process table could be walked at all ("found nothing"
    and "could not look" are opposite answers). ``found``: every live process
    that carried the job's exact RC_JOB_ID after its group was torn down.
    ``remaining``: what was still alive after SIGTERM, the grace window,
    SIGKILL and a short wait (non-empty means the host is still dirty).
    ``blind``: at least one process could not be inspected (EACCES on its
    environment: a worker not running as root), so the answer is incomplete.
    """

    scanned: bool
    found: tuple[int, ...] = ()
    remaining: tuple[int, ...] = ()
    blind: bool = False

    @property
    def clean(self) -> bool:
        """Whether the sweep *proved* nothing of the job is left running.

        It looked, it could see everything it looked at, and it either found
        nothing or removed everything it found. An empty ``found`` alone is
        not this claim.
        """
        return self.scanned and not self.blind and not self.remaining


NOT_SWEPT = SweepReport(scanned=False)
"""The report of a job that asked for no sweep: nothing looked, nothing proved."""


@attrs.frozen
class ScanResult:
    """One pass over the process table, decided without I/O from what the host returned."""

    matches: tuple[ProcessInfo, ...]  # live processes carrying exactly the job's id
    blind: bool  # some process that might have been one could not be inspected


def never_survivors(table: list[ProcessInfo], own_pid: int) -> set[int]:
    """Pids that cannot be a job's survivors, whatever their environment says.

    The worker itself, init, and the worker's ancestors: a job is the
    worker's child, so nothing descended from it is the worker's ancestor.
    They are not even inspected, so a worker run inside a job that carries
    the same RC_JOB_ID (``rc-worker exec`` as a job's command) never sweeps
    its own parents, and an init whose environment is unreadable (as in
    some VMs and containers) does not make every sweep blind.
    """
    parents = {p.pid: p.ppid for p in table}
    excluded = {own_pid, 1}
    pid = parents.get(own_pid, 0)
    while pid > 0 and pid not in excluded:
        excluded.add(pid)
        pid = parents.get(pid, 0)
    return excluded


def classify(
    table: list[ProcessInfo],
    job_ids: dict[int, str | None],
    unreadable: set[int],
    job_id: str,
) -> ScanResult:
    """Decide which processes of ``table`` belong to ``job_id``.

    ``job_ids`` maps a pid to the RC_JOB_ID in its environment (``None``
    when unset); ``unreadable`` holds the pids whose environment could not be
    read. A pid in neither vanished during the scan or was not a candidate.
    Zombies are never matches: they have exited and hold nothing but a pid.
    """
    matches = tuple(p for p in table if p.alive and job_ids.get(p.pid) == job_id)
    blind = any(p.alive and p.pid in unreadable for p in table)
    return ScanResult(matches, blind)


async def scan(host: Host, job_id: str) -> ScanResult:
    """Walk the process table once. Raises ``OSError`` when it cannot be listed."""
    table = host.processes()
    excluded = never_survivors(table, host.own_pid())
    job_ids: dict[int, str | None] = {}
    unreadable: set[int] = set()
    empty: list[int] = []
    for p in table:
        if p.pid in excluded or not p.alive:
            continue
        env = _environ(host, p.pid, unreadable)
        if env is not None:
            job_ids[p.pid] = env.get(JOB_ID_VAR)
            if not env:
                empty.append(p.pid)
    if empty:
        # A process caught between execve(2) and the setup of its new image
        # shows an empty environment for a moment: look at those once more.
        # (Kernel threads and `env -i` processes cost this one short sleep.)
        await trio.sleep(EXEC_SETTLE)
        for pid in empty:
            env = _environ(host, pid, unreadable)
            if env is not None:
                job_ids[pid] = env.get(JOB_ID_VAR)
    else:
        await trio.lowlevel.checkpoint()
    return classify(table, job_ids, unreadable, job_id)


def _environ(host: Host, pid: int, unreadable: set[int]) -> Mapping[str, str] | None:
    try:
        return host.environ(pid)
    except ProcessLookupError:
        return None  # exited mid-scan: not a survivor, and not blindness
    except OSError:
        # EACCES (not root) above all, but any failure to read is the same
        # answer: we could not look.
        unreadable.add(pid)
        return None


class _Sweep:
    def __init__(self, host: Host, job_id: str) -> None:
        self.host = host
        self.job_id = job_id
        self.found: dict[int, None] = {}  # an insertion-ordered set
        self.signalled: dict[int, set[int]] = {}
        self.blind = False
        self.matches: tuple[ProcessInfo, ...] = ()
        self.live: tuple[int, ...] = ()

    async def look(self) -> bool:
        """Scan and remember; whether any carrier of the id is still alive."""
        result = await scan(self.host, self.job_id)
        self.blind = self.blind or result.blind
        self.matches = result.matches
        self.live = tuple(p.pid for p in result.matches)
        for pid in self.live:
            self.found.setdefault(pid)
        return bool(self.matches)

    def signal_new(self, sig: int) -> None:
        """Send ``sig`` to every live match that has not had it yet."""
        for p in self.matches:
            sent = self.signalled.setdefault(p.pid, set())
            if sig in sent:
                continue
            sent.add(sig)
            self.host.signal_pid(p.pid, sig)
            if p.sid == p.pid:
                # A session leader's group holds only its own descendants
                # (nothing can join a session from outside), so its group
                # is the job's too, even members that dropped the id.
                self.host.signal_group(p.pid, sig)

    async def drive(self, sig: int) -> None:
        """Signal and re-scan until no carrier of the id is alive (callers bound it)."""
        delay = 0.005
        while await self.look():
            self.signal_new(sig)
            await trio.sleep(delay)
            delay = min(delay * 2, _POLL_MAX)


async def sweep_job_survivors(
    job_id: str, *, grace: float, host: Host | None = None
) -> SweepReport:
    """Signal out of existence every process carrying exactly ``RC_JOB_ID=<job_id>``.

    SIGTERM, up to ``grace`` seconds, SIGKILL, up to :data:`KILL_WAIT`
    seconds, then one last look: what is still alive is ``remaining``. Zombies
    are not survivors (they have exited; only their pid is left), and neither
    are the worker itself, init or the worker's ancestors (see
    :func:`never_survivors`). Processes forked by a survivor while this runs
    are picked up by the re-scans. Bounded: it never waits longer than
    ``grace + KILL_WAIT`` plus the scans themselves.
    """
    if not job_id:
        raise ValueError("job_id must be a non-empty string; an empty id would match nothing")
    if not (grace >= 0 and math.isfinite(grace)):
        raise ValueError(f"grace must be a finite number of seconds >= 0, got {grace!r}")
    host = host if host is not None else LinuxHost()
    sweep = _Sweep(host, job_id)
    await trio.lowlevel.checkpoint()
    try:
        if not await sweep.look():
            return SweepReport(scanned=True, blind=sweep.blind)
    except OSError:
        return NOT_SWEPT
    try:
        with trio.move_on_after(grace):
            await sweep.drive(signal.SIGTERM)
        with trio.move_on_after(KILL_WAIT):
            await sweep.drive(signal.SIGKILL)
        await sweep.look()
    except OSError:
        # The table could be listed a moment ago and now cannot: what we
        # last saw alive stays reported, and the answer is incomplete.
        sweep.blind = True
    return SweepReport(
        scanned=True,
        found=tuple(sweep.found),
        remaining=sweep.live,
        blind=sweep.blind,
    )
