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
Two marks from different pid namespaces (a worker restarted in another
container, reading a journalled mark) give no window.

The residual, accepted as the RC_JOB_ID sweep's others are: a clone that
fails *after* its pid was allocated (``CLONE_PIDFD`` with a full descriptor
table, ``pids.max`` / ``TasksMax``, a fatal signal) moves the cursor without
being counted (``processes`` counts successful clones only). A job that makes
a whole cycle of them (``pid_max`` failed clones: seconds with a 32,768
``pid_max``, minutes with 4,194,304) can leave a process, started before,
with a pid outside the window. It could as well clear its environment and
leave its session, which hides it from any RC_JOB_ID sweep. A job in a
cgroup is swept through the cgroup, exactly, and neither applies.

Pure: the host reads the numbers (``LinuxHost.pid_mark``), this decides.
"""

from __future__ import annotations

import attrs

# The kernel's RESERVED_PIDS: after the first wrap, numbering starts again here.
RESERVED_PIDS = 300


@attrs.frozen
class PidMark:
    """Where the kernel's pid allocation stood at a moment.

    A mark that opens a window reads ``forks`` first and ``last_pid`` after
    (``/proc/stat``, ``/proc/loadavg``, ``/proc/sys/kernel/ns_last_pid``); one
    that closes it, the other way round (``procfs.read_pid_mark``).
    """

    last_pid: int  # the last pid handed out in this pid namespace
    forks: int  # tasks created since boot (all namespaces, threads too)
    tasks: int  # tasks that exist (zombies included)
    pid_max: int  # /proc/sys/kernel/pid_max
    pid_ns: int  # which pid namespace (the inode of /proc/self/ns/pid)

    def to_json(self) -> list[int]:
        return [self.last_pid, self.forks, self.tasks, self.pid_max, self.pid_ns]

    @classmethod
    def from_json(cls, raw: object) -> PidMark | None:
        """A mark written by :meth:`to_json`; ``None`` for anything else (a damaged file)."""
        if not isinstance(raw, list) or len(raw) != 5:
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
    cannot be from one boot (fewer forks now than then) or one pid namespace,
    or when they make no sense; the caller then looks at every process.
    """
    created = now.forks - then.forks
    cycle = min(then.pid_max, now.pid_max) - RESERVED_PIDS
    if created < 0 or cycle <= 0 or then.tasks < 0 or then.pid_ns != now.pid_ns:
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
