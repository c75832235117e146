"""Reading /proc: the process table's rows, environments, start times, and pins.

Sans-IO parsers (``parse_proc_stat``, ``parse_environ``) and the few reads the
real host makes of ``/proc``; :mod:`rc_worker.host` builds ``LinuxHost`` on them.
"""

from __future__ import annotations

import errno
import os
import signal
import time
from typing import Protocol

import attrs

from rc_worker.core.pid_window import PidMark, parse_forks, parse_tasks

# /proc/<pid>/stat states that mean "exited, not yet (or being) reaped".
_DEAD_STATES = frozenset({"Z", "X", "x"})


@attrs.frozen
class ProcessInfo:
    """One row of the process table (from ``/proc/<pid>/stat``).

    ``start_time``: when it started, in clock ticks since boot (field 22 of
    ``/proc/<pid>/stat``, the clock of :meth:`Host.boot_ticks`). With the pid
    it names one process for good: a recycled pid has a later start time.
    ``uid``: its owner (the owner of its ``/proc/<pid>/stat``), or -1 unknown.
    ``threads``: how many of its threads have not exited (field 20). The row's
    state is its first thread's: a process whose first thread exited while
    others run on reads ``Z`` and is alive all the same.
    """

    pid: int
    ppid: int
    pgid: int
    sid: int
    state: str  # the one-letter state: R, S, D, T, Z, ...
    start_time: int = 0
    uid: int = -1
    threads: int = 1

    @property
    def alive(self) -> bool:
        """Whether it still runs; a zombie has exited and holds nothing but its pid.

        Not a zombie: a process whose first thread is one (``pthread_exit`` in
        ``main``, an ``exit(2)`` of that thread alone) while others still run.
        It can go on holding a device, and must be found and ended as any other.
        """
        return self.state not in _DEAD_STATES or self.threads > 1


def read_proc_stat(pid: int) -> ProcessInfo | None:
    """One row of the process table, or ``None`` when ``pid`` is gone or hidden."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            # The file belongs to the process's owner: one fstat on the
            # open descriptor gives its uid without another path walk.
            uid = os.fstat(f.fileno()).st_uid
            raw = f.read()
    except OSError:
        # Gone between listdir and open (ENOENT/ESRCH), or hidden from us
        # by hidepid: either way not a row we can report.
        return None
    return parse_proc_stat(raw, uid)


def boot_ticks() -> int:
    """Now, in the clock of ``ProcessInfo.start_time`` (clock ticks since boot).

    A process's start time counts CLOCK_BOOTTIME, truncated to a tick, as this
    is: a process started after this call never shows an earlier start time.
    Read from the clock itself (a vDSO call), not from ``/proc/uptime``: that
    was an open, read and close on the event loop twice per job.
    """
    return time.clock_gettime_ns(time.CLOCK_BOOTTIME) * _CLK_TCK // 1_000_000_000


_CLK_TCK = os.sysconf("SC_CLK_TCK")


def _read(path: str) -> bytes:
    fd = os.open(path, os.O_RDONLY)
    try:
        return os.read(fd, 1 << 20)
    finally:
        os.close(fd)


def read_pid_mark(*, closing: bool = False) -> PidMark | None:
    """Where pid allocation stands now (see ``core/pid_window.py``); ``None`` unreadable.

    The order is the proof's. A mark that opens a window (before a job) reads
    the fork count first, so that it counts every task created after the last
    pid it then reads; a mark that closes one (after listing ``/proc``) reads
    the last pid first, so that the fork count read after it covers every
    task created up to it.
    """
    try:
        pid_ns = os.stat("/proc/self/ns/pid").st_ino
        last = b""
        if closing:
            last = _read("/proc/sys/kernel/ns_last_pid").strip()
        forks = parse_forks(_read("/proc/stat"))
        tasks = parse_tasks(_read("/proc/loadavg"))
        if not closing:
            last = _read("/proc/sys/kernel/ns_last_pid").strip()
        pid_max = _read("/proc/sys/kernel/pid_max").strip()
    except OSError:
        return None
    if forks is None or tasks is None or not last.isdigit() or not pid_max.isdigit():
        return None
    return PidMark(int(last), forks, tasks, int(pid_max), pid_ns)


class ProcessPin(Protocol):
    """One process, held by identity (pid *and* start time), to signal later.

    ``send_signal`` returns ``False`` once that process has gone: never does a
    signal reach another process that got its pid since.
    """

    def send_signal(self, sig: int) -> bool: ...

    def close(self) -> None: ...


class PidfdPin:
    def __init__(self, fd: int) -> None:
        self._fd: int | None = fd

    def send_signal(self, sig: int) -> bool:
        if self._fd is None:
            return False
        try:
            signal.pidfd_send_signal(self._fd, sig)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


@attrs.define
class StatPin:
    pid: int
    start_time: int

    def send_signal(self, sig: int) -> bool:
        now = read_proc_stat(self.pid)
        if now is None or now.start_time != self.start_time:
            return False
        try:
            os.kill(self.pid, sig)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True

    def close(self) -> None:
        pass


def parse_proc_stat(raw: bytes, uid: int = -1) -> ProcessInfo | None:
    """Parse ``/proc/<pid>/stat``; ``None`` when it is not in the expected shape."""
    # The command name sits in parentheses and may itself contain spaces
    # and ")", so split at the last ")".
    head, sep, tail = raw.rpartition(b")")
    if not sep:
        return None
    fields = tail.split()
    try:
        pid = int(head.split(b"(", 1)[0])
        return ProcessInfo(
            pid=pid,
            ppid=int(fields[1]),
            pgid=int(fields[2]),
            sid=int(fields[3]),
            state=fields[0].decode("ascii", "replace"),
            # Field 22 of the whole line; the tail starts at field 3.
            start_time=int(fields[19]),
            uid=uid,
            threads=int(fields[17]),
        )
    except (ValueError, IndexError):
        return None


def read_environ(pid: int) -> bytes:
    """The raw environment of process ``pid``; ``ProcessLookupError`` when it has gone.

    A process whose first thread has exited while others run on (see
    :attr:`ProcessInfo.alive`) has no environment under its own pid: the kernel
    answers ESRCH (Linux 6.x) or nothing (older). Its threads share one address
    space, so any of them that still runs answers for the process instead.
    """
    try:
        raw = _read_environ(f"/proc/{pid}/environ")
    except ProcessLookupError:
        raw = None
    if raw:
        return raw
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except FileNotFoundError:
        raise ProcessLookupError(errno.ESRCH, f"process {pid} has exited") from None
    for tid in tids:
        if tid == str(pid):
            continue
        try:
            return _read_environ(f"/proc/{pid}/task/{tid}/environ")
        except ProcessLookupError:
            continue  # that thread exited meanwhile: ask the next
    if raw is None:
        raise ProcessLookupError(errno.ESRCH, f"process {pid} has exited")
    return raw  # empty: a kernel thread, an `env -i` process


def _read_environ(path: str) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as e:
        if e.errno in (errno.ENOENT, errno.ESRCH):
            raise ProcessLookupError(e.errno, f"{path}: the process has exited") from e
        raise


def parse_environ(raw: bytes) -> dict[str, str]:
    """Parse ``/proc/<pid>/environ`` (NUL-separated ``KEY=VALUE``)."""
    env: dict[str, str] = {}
    for entry in raw.split(b"\0"):
        key, sep, value = entry.partition(b"=")
        if sep and key:
            # With duplicate keys getenv(3) answers with the first one.
            env.setdefault(os.fsdecode(key), os.fsdecode(value))
    return env
