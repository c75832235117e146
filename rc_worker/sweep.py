"""The RC_JOB_ID sweep: remove what a job left behind outside its process group.

A job runs in its own session, and tearing down its process group catches
everything that stayed in it. A child that called ``setsid(2)`` left both, so
the sweep finds it the other way: by the ``RC_JOB_ID=<id>`` it inherited in
its environment (``/proc/<pid>/environ``), and signals it the same way the
group was (SIGTERM, the grace window, SIGKILL).

This is the sweep for a job WITHOUT a cgroup; with one, ``cgroup.py`` ends
what is left through the cgroup instead, exactly. Only processes that started
at or after the job are inspected (a process older than the job cannot be
its descendant), so a sweep costs one table walk plus the environments of
what started since; with a pid mark taken before the job
(``core/pid_window.py``) not even the walk: only the rows of pids handed out
since are read. Every signal goes through a pin (a pidfd) taken at scan time,
its start time checked, so a pid recycled in between is never signalled.

Residuals, accepted and documented rather than hidden: a process that
rewrote its own environment block or exec'd with a cleared environment
carries no id and is invisible here (a session leader found by id has its
whole group signalled too, which catches its env-less children), as is one a
job gave a pid of its choosing (``clone3`` with ``set_tid``, or a write to
``/proc/sys/kernel/ns_last_pid``: both need ``CAP_CHECKPOINT_RESTORE`` or
``CAP_SYS_ADMIN`` in the pid namespace's user namespace) or one it started
before making a whole cycle of clones fail after taking their pids (see
``core/pid_window.py``); a process
whose environment cannot be read (a worker that is not root) makes the
sweep blind, and :func:`unproven` then refuses to call the job's end clean.

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

from rc_worker.core.pid_window import PidMark

# The report and the rule that reads it are pure (sweep_report.py); they are
# re-exported here, where every caller has always imported them from.
from rc_worker.core.sweep_report import (
    METHOD_CGROUP as METHOD_CGROUP,
)
from rc_worker.core.sweep_report import (
    METHOD_ENVIRON as METHOD_ENVIRON,
)
from rc_worker.core.sweep_report import (
    NOT_SWEPT as NOT_SWEPT,
)
from rc_worker.core.sweep_report import (
    NOTHING_STARTED as NOTHING_STARTED,
)
from rc_worker.core.sweep_report import (
    SweepReport as SweepReport,
)
from rc_worker.core.sweep_report import (
    unproven as unproven,
)
from rc_worker.host import Host, LinuxHost, ProcessInfo, ProcessPin

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
class ScanResult:
    """One pass over the process table, decided without I/O from what the host returned."""

    matches: tuple[ProcessInfo, ...]  # live processes carrying exactly the job's id
    blind_pids: tuple[int, ...] = ()  # live candidates that could not be inspected

    @property
    def blind(self) -> bool:
        return bool(self.blind_pids)


def candidate(p: ProcessInfo, since: int | None) -> bool:
    """Whether ``p`` could be one of a job whose first process started at ``since``.

    A process that started before the job's first process cannot descend
    from it, so it is never inspected: an unreadable daemon older than the
    job does not make the sweep blind, and its environment is never read.
    Zombies have exited and hold nothing but a pid. ``since`` ``None``: no
    bound known, every live process is a candidate.
    """
    return p.alive and (since is None or p.start_time >= since)


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
    since: int | None = None,
) -> ScanResult:
    """Decide which processes of ``table`` belong to ``job_id``.

    ``job_ids`` maps a pid to the RC_JOB_ID in its environment (``None``
    when unset); ``unreadable`` holds the pids whose environment could not be
    read. A pid in neither vanished during the scan or was not a candidate
    (see :func:`candidate`).
    """
    live = [p for p in table if candidate(p, since)]
    matches = tuple(p for p in live if job_ids.get(p.pid) == job_id)
    blind = tuple(p.pid for p in live if p.pid in unreadable)
    return ScanResult(matches, blind)


async def scan(
    host: Host, job_id: str, since: int | None = None, mark: PidMark | None = None
) -> ScanResult:
    """Walk the process table once. Raises ``OSError`` when it cannot be listed.

    Only candidates (see :func:`candidate`) have their environment read: the
    start time comes with the row, so a sweep after a job reads the
    environments of the processes started since, not of the whole machine.
    With ``mark`` (taken before the job's first process), only the rows of
    pids handed out since are read at all (``core/pid_window.py``), when the
    host can prove that covers everything started since; else every row.
    """
    table = host.processes_since(mark) if mark is not None else None
    if table is None:
        table = host.processes()
    excluded = never_survivors(table, host.own_pid())
    job_ids: dict[int, str | None] = {}
    unreadable: set[int] = set()
    empty: list[int] = []
    for p in table:
        if p.pid in excluded or not candidate(p, since):
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
    return classify(table, job_ids, unreadable, job_id, since)


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
    def __init__(self, host: Host, job_id: str, since: int | None, mark: PidMark | None) -> None:
        self.host = host
        self.job_id = job_id
        self.since = since
        self.mark = mark
        self.found: dict[int, None] = {}  # an insertion-ordered set
        self.signalled: dict[tuple[int, int], set[int]] = {}
        self.pins: dict[tuple[int, int], ProcessPin | None] = {}
        self.blind_pids: dict[int, None] = {}
        self.broken = False
        self.matches: tuple[ProcessInfo, ...] = ()
        self.live: tuple[int, ...] = ()

    async def look(self) -> bool:
        """Scan and remember; whether any carrier of the id is still alive."""
        result = await scan(self.host, self.job_id, self.since, self.mark)
        for pid in result.blind_pids:
            self.blind_pids.setdefault(pid)
        self.matches = result.matches
        self.live = tuple(p.pid for p in result.matches)
        for p in result.matches:
            self.found.setdefault(p.pid)
            key = (p.pid, p.start_time)
            if key not in self.pins:
                # Pinned at scan time: whatever happens to the pid later,
                # a signal through the pin reaches this process or nothing.
                self.pins[key] = self.host.pin(p.pid, p.start_time)
        return bool(self.matches)

    def signal_new(self, sig: int) -> None:
        """Send ``sig`` to every live match that has not had it yet."""
        for p in self.matches:
            key = (p.pid, p.start_time)
            sent = self.signalled.setdefault(key, set())
            if sig in sent:
                continue
            sent.add(sig)
            pin = self.pins.get(key)
            if pin is None or not pin.send_signal(sig):
                continue  # gone since the scan (its pid may be someone else's now)
            if p.sid == p.pid:
                # A session leader's group holds only its own descendants
                # (nothing can join a session from outside), so its group
                # is the job's too, even members that dropped the id. The
                # pin just reached the leader, so the group id is still its.
                self.host.signal_group(p.pid, sig)

    async def drive(self, sig: int) -> None:
        """Signal and re-scan until no carrier of the id is alive (callers bound it)."""
        delay = 0.005
        while await self.look():
            self.signal_new(sig)
            await trio.sleep(delay)
            delay = min(delay * 2, _POLL_MAX)

    def close(self) -> None:
        for pin in self.pins.values():
            if pin is not None:
                pin.close()
        self.pins.clear()

    def report(self) -> SweepReport:
        blind = tuple(self.blind_pids)
        return SweepReport(
            scanned=True,
            found=tuple(self.found),
            remaining=self.live,
            blind=bool(blind) or self.broken,
            blind_pids=blind,
        )


async def sweep_job_survivors(
    job_id: str,
    *,
    grace: float,
    host: Host | None = None,
    since: int | None = None,
    mark: PidMark | None = None,
) -> SweepReport:
    """Signal out of existence every process carrying exactly ``RC_JOB_ID=<job_id>``.

    SIGTERM, up to ``grace`` seconds, SIGKILL, up to :data:`KILL_WAIT`
    seconds, then one last look: what is still alive is ``remaining``. Zombies
    are not survivors (they have exited; only their pid is left), and neither
    are the worker itself, init or the worker's ancestors (see
    :func:`never_survivors`), nor, when ``since`` is given (the job's first
    process's start time, in :meth:`Host.boot_ticks`), anything older than
    the job; with ``mark`` too (:meth:`Host.pid_mark`, taken before the job's
    first process), only the rows of pids handed out since are read, where
    the host can prove that is enough. Processes forked by a survivor while
    this runs are picked up by the re-scans. Every signal goes through a pin taken at scan time
    (:meth:`Host.pin`), so a pid recycled in between is never signalled.
    Bounded: it never waits longer than ``grace + KILL_WAIT`` plus the scans.
    """
    if not job_id:
        raise ValueError("job_id must be a non-empty string; an empty id would match nothing")
    if not (grace >= 0 and math.isfinite(grace)):
        raise ValueError(f"grace must be a finite number of seconds >= 0, got {grace!r}")
    host = host if host is not None else LinuxHost()
    sweep = _Sweep(host, job_id, since, mark)
    await trio.lowlevel.checkpoint()
    try:
        try:
            if not await sweep.look():
                return sweep.report()
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
            sweep.broken = True
        return sweep.report()
    finally:
        sweep.close()
