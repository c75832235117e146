"""Which pids can a process started after a moment have? The sweep's window.

The sweep without a cgroup looks for what a job left behind among the
processes that started after the job. Reading every ``/proc/<pid>/stat`` to
learn start times costs as much as the bare scan it is meant to beat (5,000
unrelated processes: 5,000 reads). The kernel hands pids out in a cycle
instead: each new task gets the next free number above the last one handed
out, and only past ``pid_max`` does the count start again low (at
``RESERVED_PIDS``). So while the cycle has not come round, everything
created after a :class:`PidMark` has a pid in ``(then.last_pid,
now.last_pid]`` (wrapping past ``pid_max`` at most once), and only those pids
need a look.

What proves the cycle has not come round: the cursor moves one number per
task created, plus one per number it skips because it is in use. A number is
in use while some task has it as its pid, its process group or its session
(a group outlives its leader), so at most three per task that existed during
the interval: those that existed at the mark and those created since. With
``f`` tasks created (``/proc/stat``'s ``processes``, every clone since boot,
threads included, in every namespace) and ``t`` tasks at the mark
(``/proc/loadavg``'s count, zombies included), the cursor moved at most
``f + 3 * (t + f)`` numbers. Below one cycle (``pid_max - RESERVED_PIDS``),
it did not come round; otherwise :func:`pid_window` says ``None`` and the
sweep reads the whole table as before. Every input overcounts (other
namespaces' tasks and clones), which only makes the answer more cautious.

Pure: the host reads the numbers (``LinuxHost.pid_mark``), this decides.
"""

from __future__ import annotations

import attrs

# The kernel's RESERVED_PIDS: after the first wrap, numbering starts again here.
RESERVED_PIDS = 300


@attrs.frozen
class PidMark:
    """Where the kernel's pid allocation stood at a moment.

    Read in this order, so each figure covers what the next one saw: ``forks``
    first, then ``tasks`` and ``last_pid`` (one read of ``/proc/loadavg``
    gives both), ``pid_max`` any time.
    """

    last_pid: int  # the last pid handed out in this pid namespace
    forks: int  # tasks created since boot (all namespaces, threads too)
    tasks: int  # tasks that exist (zombies included)
    pid_max: int  # /proc/sys/kernel/pid_max

    def to_json(self) -> list[int]:
        return [self.last_pid, self.forks, self.tasks, self.pid_max]

    @classmethod
    def from_json(cls, raw: object) -> PidMark | None:
        """A mark written by :meth:`to_json`; ``None`` for anything else (a damaged file)."""
        if not isinstance(raw, list) or len(raw) != 4:
            return None
        if not all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in raw):
            return None
        return cls(*raw)


@attrs.frozen
class PidWindow:
    """The pids handed out after one mark and up to another: ``(after, upto]``, cyclically."""

    after: int
    upto: int

    def holds(self, pid: int) -> bool:
        if self.after <= self.upto:
            return self.after < pid <= self.upto
        return pid > self.after or pid <= self.upto  # came past pid_max once


def pid_window(then: PidMark, now: PidMark) -> PidWindow | None:
    """The window of pids handed out between ``then`` and ``now``, or ``None`` unproven.

    ``now`` must be read after whatever it is to cover (the listing of
    ``/proc``). ``None`` when the cycle may have come round, when the figures
    cannot be from one boot (fewer forks now than then), or when they make
    no sense; the caller then looks at every process.
    """
    created = now.forks - then.forks
    cycle = min(then.pid_max, now.pid_max) - RESERVED_PIDS
    if created < 0 or cycle <= 0 or then.tasks < 0:
        return None
    if not (0 <= then.last_pid < then.pid_max and 0 <= now.last_pid < now.pid_max):
        return None
    moved = created + 3 * (then.tasks + created)
    if moved >= cycle:
        return None
    return PidWindow(then.last_pid, now.last_pid)


def parse_forks(proc_stat: bytes) -> int | None:
    """The ``processes`` line of ``/proc/stat``: tasks created since boot."""
    at = proc_stat.find(b"\nprocesses ")
    if at < 0:
        return None
    field = proc_stat[at + len(b"\nprocesses ") :].split(b"\n", 1)[0]
    return int(field) if field.strip().isdigit() else None


def parse_tasks(loadavg: bytes) -> int | None:
    """The task count of ``/proc/loadavg`` (the ``4/321`` field's second number)."""
    fields = loadavg.split()
    if len(fields) < 4 or b"/" not in fields[3]:
        return None
    total = fields[3].split(b"/", 1)[1]
    return int(total) if total.isdigit() else None
