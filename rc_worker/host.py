"""The Host seam: everything the worker does to the operating system.

``LinuxHost`` is the real one. The simulated host in ``rc_worker.testing``
implements the same protocol so the worker's logic runs unchanged in
virtual time.

The process part of the protocol is deliberately small: spawn one process
(in its own session, optionally on a pseudo-terminal), send a signal to a
process group or a pid, list the process table, read one process's
environment, and say which pid is the worker itself. Everything built on top
(grace windows, group teardown, the RC_JOB_ID sweep) lives in
``supervise.py`` and ``sweep.py`` and is written against this protocol only.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import platform
import pwd
import random
import socket
import struct
import subprocess
import termios
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

import attrs
import trio

from rc_worker.core.cgroup_parse import parse_mountinfo, parse_proc_cgroup
from rc_worker.core.pid_window import PidMark, pid_window
from rc_worker.procfs import (
    PidfdPin,
    StatPin,
    boot_ticks,
    parse_environ,
    read_environ,
    read_pid_mark,
    read_proc_stat,
)
from rc_worker.procfs import ProcessInfo as ProcessInfo
from rc_worker.procfs import ProcessPin as ProcessPin
from rc_worker.procfs import parse_proc_stat as parse_proc_stat
from rc_worker.statestore import LINUX_STORE, StateStore

if TYPE_CHECKING:
    from rc_worker.cgroup import Containment

log = logging.getLogger("rc_worker.host")

T = TypeVar("T")

BOOT_ID_PATH = Path("/proc/sys/kernel/random/boot_id")
PROC = Path("/proc")

# A terminal with no size makes full-screen and progress-bar programs draw
# garbage or refuse to run; give PTY jobs the classic default.
PTY_ROWS, PTY_COLS = 24, 80

# 1 MiB is the unprivileged ceiling (/proc/sys/fs/pipe-max-size) by default;
# past it the kernel refuses and the pipe keeps its 64 KiB.
OUTPUT_PIPE_BYTES = 1 << 20


@attrs.frozen
class RunAs:
    """Who a child runs as: ``user`` (for messages), its uid, gid and supplementary groups."""

    user: str
    uid: int
    gid: int
    groups: tuple[int, ...] = ()


def resolve_user(name: str) -> RunAs:
    """The uid, primary gid and every group of user ``name`` (``KeyError`` if unknown)."""
    entry = pwd.getpwnam(name)
    groups = tuple(g for g in os.getgrouplist(name, entry.pw_gid) if g != entry.pw_gid)
    return RunAs(name, entry.pw_uid, entry.pw_gid, groups)


class HostProcess(Protocol):
    """A process started by :meth:`Host.spawn`.

    ``stdout`` is always a stream: the pipe (or, with a PTY, the terminal's
    master side) that carries the job's output, stderr included unless it was
    asked for separately. ``stdin`` is ``None`` when the job's input is
    ``/dev/null``. Closing ``stdin`` delivers end-of-input (on a PTY it types
    the terminal's EOF character, since closing the master would hang up the
    job instead).
    """

    @property
    def pid(self) -> int: ...

    @property
    def stdin(self) -> trio.abc.SendStream | None: ...

    @property
    def stdout(self) -> trio.abc.ReceiveStream: ...

    @property
    def stderr(self) -> trio.abc.ReceiveStream | None: ...

    @property
    def returncode(self) -> int | None:
        """``None`` while running; else the status, or ``-N`` after death by signal N."""
        ...

    async def wait(self) -> int:
        """Wait for the process to exit, reap it, and return :attr:`returncode`."""
        ...


class Host(Protocol):
    """What the worker needs from the machine it runs on."""

    def hostname(self) -> str: ...

    def boot_id(self) -> str: ...

    def kernel(self) -> str: ...

    def cpu_count(self) -> int: ...

    def mem_total_bytes(self) -> int: ...

    def disk_free_bytes(self, path: str) -> int: ...

    async def spawn(
        self,
        argv: Sequence[str],
        *,
        cwd: str | None,
        env: Mapping[str, str],
        stdin: bool,
        separate_stderr: bool,
        pty: bool,
        cgroup: str | None = None,
        run_as: RunAs | None = None,
    ) -> HostProcess:
        """Start ``argv`` as the leader of a new session (so of its own process group).

        ``cgroup``: an existing v2 cgroup (a path in the hierarchy, such as
        ``/rc-worker-x/job``) the process is born in, so that nothing it
        forks is ever outside it; ``None`` leaves it in the worker's.

        ``env`` is the whole environment; ``argv[0]`` is looked up on its PATH.
        ``stdin`` asks for a pipe (else ``/dev/null``); ``separate_stderr``
        for stderr on its own stream (else merged into stdout); ``pty`` for a
        new pseudo-terminal as the process's controlling terminal and all
        three standard streams (with ``stdin`` false, the terminal's EOF is
        typed at once, so reading it ends as reading ``/dev/null`` would).
        Raises ``OSError`` when the process cannot be
        started (command not found, not executable, bad cwd).
        """
        ...

    def signal_group(self, pgid: int, sig: int) -> bool:
        """Send ``sig`` to process group ``pgid``; ``False`` when the group does not exist.

        Zombies are still members until reaped, so ``True`` does not mean
        anything in the group is alive. ``sig`` 0 only checks existence.
        """
        ...

    def signal_pid(self, pid: int, sig: int) -> bool:
        """Send ``sig`` to ``pid``; ``False`` when there is no such process."""
        ...

    def processes(self) -> list[ProcessInfo]:
        """The process table. Raises ``OSError`` when it cannot be listed at all."""
        ...

    def pid_mark(self) -> PidMark | None:
        """Where the kernel's pid allocation stands now (``core/pid_window.py``);
        ``None`` where this host cannot say (then every sweep reads the whole table)."""
        ...

    def processes_since(self, mark: PidMark) -> list[ProcessInfo] | None:
        """The rows of at least every process whose pid was handed out after ``mark``
        (see :func:`~rc_worker.core.pid_window.pid_window`), reading no other
        process's row; ``None`` when that cannot be proven (then use
        :meth:`processes`). Raises ``OSError`` as :meth:`processes` does."""
        ...

    def environ(self, pid: int) -> Mapping[str, str]:
        """The environment ``pid`` was started with.

        Raises ``ProcessLookupError`` when the process has gone and
        ``PermissionError`` when this worker may not look (not root).
        """
        ...

    def own_pid(self) -> int: ...

    store: StateStore
    """The host's files (``statestore.py``): the state directory, drop-ins, sheets, ``which``."""

    def new_rng(self) -> random.Random:
        """A generator for one worker process: its ids (faults, instance id) and retry
        jitter. Fresh entropy on the real host; seeded on a simulated one, to replay."""
        ...

    async def run_blocking(self, fn: Callable[[], T]) -> T:
        """Run blocking work on the state directory (an fsync) off the event loop.

        A worker thread on the real host; inline on the simulated one, whose
        disk takes no virtual time (a thread would let a mock clock jump).
        """
        ...

    def boot_ticks(self) -> int:
        """Now, in the clock of :attr:`ProcessInfo.start_time`."""
        ...

    def pin(self, pid: int, start_time: int) -> ProcessPin | None:
        """Hold ``pid`` for signalling, if it is still the process that started at
        ``start_time``; ``None`` when it has gone (or its pid now names another)."""
        ...

    def process(self, pid: int) -> ProcessInfo | None:
        """One row of the process table; ``None`` when ``pid`` is not there."""
        ...

    # -- cgroup v2 (paths are inside the unified hierarchy: "/", "/a/b") --

    containment: Containment | None
    """The worker's cgroup tree once set up (see ``cgroup.set_up``); ``None``: none."""

    def own_cgroup(self) -> str:
        """The worker's v2 cgroup. Raises ``OSError`` saying why when there is none."""
        ...

    def cgroup_read(self, path: str, name: str) -> str:
        """The file ``name`` of cgroup ``path``; ``FileNotFoundError`` if either is missing."""
        ...

    def cgroup_write(self, path: str, name: str, value: str) -> None: ...

    def cgroup_mkdir(self, path: str) -> None:
        """Create cgroup ``path`` (its parent must exist); one that exists is fine."""
        ...

    def cgroup_rmdir(self, path: str) -> None:
        """Remove the empty cgroup ``path``; ``OSError`` (EBUSY) while it is populated."""
        ...

    def cgroup_children(self, path: str) -> list[str]:
        """The names of the cgroups directly below ``path``."""
        ...


class LinuxHost:
    """The real host: /proc, os, signals and the cgroup v2 filesystem."""

    # Class-level defaults, so subclasses need not call __init__.
    containment: Containment | None = None
    store: StateStore = LINUX_STORE
    _cgroup_mount: str | None = None
    _spawn_lock: trio.Lock | None = None

    def hostname(self) -> str:
        return socket.gethostname()

    def boot_id(self) -> str:
        return BOOT_ID_PATH.read_text().strip()

    def kernel(self) -> str:
        return platform.release()

    def cpu_count(self) -> int:
        return os.cpu_count() or 1

    def mem_total_bytes(self) -> int:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) * 1024
        raise OSError("MemTotal missing from /proc/meminfo")

    def disk_free_bytes(self, path: str) -> int:
        # The nearest existing ancestor: the state dir may not exist yet on
        # a first start, and its filesystem is still the one jobs write to.
        p = Path(path).absolute()
        while not p.exists() and p != p.parent:
            p = p.parent
        st = os.statvfs(p)
        return st.f_bavail * st.f_frsize

    # -- processes ---------------------------------------------------------

    async def spawn(
        self,
        argv: Sequence[str],
        *,
        cwd: str | None,
        env: Mapping[str, str],
        stdin: bool,
        separate_stderr: bool,
        pty: bool,
        cgroup: str | None = None,
        run_as: RunAs | None = None,
    ) -> HostProcess:
        if cgroup is None:
            return await self._spawn(argv, cwd, env, stdin, separate_stderr, pty, run_as)
        # Born in the cgroup: the worker moves itself into it for the fork
        # and straight back, so the child is in it from its first
        # instruction, before it could fork or exec anything. (What
        # clone3(CLONE_INTO_CGROUP) does, which Python's subprocess cannot
        # ask for; a child that moves itself before exec would need a shell,
        # which rewrites the environment, or an interpreter, ~20 ms a spawn.)
        if self._spawn_lock is None:
            # Spawning into a cgroup moves the worker there for the fork:
            # one at a time, or a child could be born in another's cgroup.
            self._spawn_lock = trio.Lock()
        async with self._spawn_lock:
            # Where the worker lives was settled at start (``Containment.home``):
            # no need to read /proc/self/cgroup again at every spawn.
            home = self.containment.home if self.containment is not None else self.own_cgroup()
            pid = str(os.getpid())
            # Each move waits out an RCU grace period in the kernel (the cgroup
            # threadgroup lock's writer side): about 4-5 ms when moves are spaced
            # out, as spawns are. In a thread, so the event loop (every device's
            # heartbeats, output and kills) does not stop twice a spawn for it; the
            # fork itself already runs in a thread (trio's open_process). Shielded:
            # a cancel must never leave the worker moved and not moved back.
            with trio.CancelScope(shield=True):
                await trio.to_thread.run_sync(self.cgroup_write, cgroup, "cgroup.procs", pid)
            try:
                return await self._spawn(argv, cwd, env, stdin, separate_stderr, pty, run_as)
            finally:
                with trio.CancelScope(shield=True):
                    try:
                        await trio.to_thread.run_sync(self.cgroup_write, home, "cgroup.procs", pid)
                    except OSError as e:
                        # Not raised: that would strand the child just started.
                        # It cannot fail where the move in succeeded (same
                        # delegation), but if it ever does, say so loudly.
                        log.error("could not move the worker back to cgroup %s: %s", home, e)

    async def _spawn(
        self,
        argv: Sequence[str],
        cwd: str | None,
        env: Mapping[str, str],
        stdin: bool,
        separate_stderr: bool,
        pty: bool,
        run_as: RunAs | None = None,
    ) -> HostProcess:
        if pty:
            return await _spawn_on_pty(argv, cwd=cwd, env=env, stdin=stdin, run_as=run_as)
        proc = await trio.lowlevel.open_process(
            list(argv),
            cwd=cwd,
            env=dict(env),
            stdin=subprocess.PIPE if stdin else subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE if separate_stderr else subprocess.STDOUT,
            start_new_session=True,
            **_identity(run_as),
        )
        assert proc.stdout is not None
        for stream in (proc.stdout, proc.stderr):
            if isinstance(stream, trio.lowlevel.FdStream):
                _widen_pipe(stream.fileno())
        return _PipedProcess(proc, proc.stdin, proc.stdout, proc.stderr)

    def signal_group(self, pgid: int, sig: int) -> bool:
        try:
            os.killpg(pgid, sig)
        except ProcessLookupError:
            return False
        except PermissionError:
            # EPERM means it exists but none of it is ours to signal.
            return True
        return True

    def signal_pid(self, pid: int, sig: int) -> bool:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True

    def processes(self) -> list[ProcessInfo]:
        table: list[ProcessInfo] = []
        for name in os.listdir(PROC):
            if not name.isdigit():
                continue
            info = read_proc_stat(int(name))
            if info is not None:
                table.append(info)
        return table

    def pid_mark(self) -> PidMark | None:
        return self._pid_mark(closing=False)

    def _pid_mark(self, *, closing: bool) -> PidMark | None:
        # The last pid is the reader's pid namespace's; /proc lists the
        # namespace it was mounted for. Where those differ, no window.
        try:
            if os.readlink(PROC / "self") != str(os.getpid()):
                return None
        except OSError:
            return None
        return read_pid_mark(closing=closing)

    def processes_since(self, mark: PidMark) -> list[ProcessInfo] | None:
        names = os.listdir(PROC)
        # After the listing, in the closing order: it must cover every pid listed.
        now = self._pid_mark(closing=True)
        window = None if now is None else pid_window(mark, now)
        if window is None:
            return None
        table: list[ProcessInfo] = []
        for name in names:
            if name.isdigit() and window.holds(pid := int(name)):
                info = read_proc_stat(pid)
                if info is not None:
                    table.append(info)
        return table

    def boot_ticks(self) -> int:
        return boot_ticks()

    def process(self, pid: int) -> ProcessInfo | None:
        return read_proc_stat(pid)

    # -- cgroup v2 ---------------------------------------------------------

    def _mount(self) -> str:
        if self._cgroup_mount is None:
            with open("/proc/self/mountinfo") as f:
                mount = parse_mountinfo(f.read())
            if mount is None:
                # Not ENOENT: "no such cgroup" would read as "empty, so gone".
                raise OSError(errno.ENODEV, "no cgroup2 filesystem in /proc/self/mountinfo")
            self._cgroup_mount = mount
        return self._cgroup_mount

    def _path(self, path: str, name: str = "") -> str:
        if not path.startswith("/") or "/../" in f"{path}/" or "\0" in path:
            raise ValueError(f"not a cgroup path: {path!r}")
        return os.path.join(self._mount() + path.rstrip("/"), name)

    def own_cgroup(self) -> str:
        self._mount()
        with open("/proc/self/cgroup") as f:
            own = parse_proc_cgroup(f.read())
        if own is None:
            raise OSError(errno.ENODEV, "no '0::' line in /proc/self/cgroup")
        return own

    def cgroup_read(self, path: str, name: str) -> str:
        with open(self._path(path, name)) as f:
            return f.read()

    def cgroup_write(self, path: str, name: str, value: str) -> None:
        fd = os.open(self._path(path, name), os.O_WRONLY)
        try:
            os.write(fd, value.encode())
        finally:
            os.close(fd)

    def cgroup_mkdir(self, path: str) -> None:
        with contextlib.suppress(FileExistsError):
            os.mkdir(self._path(path))

    def cgroup_rmdir(self, path: str) -> None:
        os.rmdir(self._path(path))

    def cgroup_children(self, path: str) -> list[str]:
        with os.scandir(self._path(path)) as entries:
            return [e.name for e in entries if e.is_dir(follow_symlinks=False)]

    def pin(self, pid: int, start_time: int) -> ProcessPin | None:
        try:
            fd = os.pidfd_open(pid)
        except ProcessLookupError:
            return None
        except OSError as e:
            if e.errno != errno.ENOSYS:
                return None
            # A kernel before 5.3: no pidfd. Re-check the start time right
            # before each signal instead; the window shrinks to microseconds.
            return StatPin(pid, start_time)
        # Read after opening: if the pid was recycled before the open, the
        # pidfd names the newcomer and its start time gives it away; after
        # the open, the pidfd can only ever reach the process it names.
        now = read_proc_stat(pid)
        if now is None or now.start_time != start_time:
            os.close(fd)
            return None
        return PidfdPin(fd)

    def environ(self, pid: int) -> Mapping[str, str]:
        # Through a thread that still runs when the first has exited (procfs.py).
        return parse_environ(read_environ(pid))

    def own_pid(self) -> int:
        return os.getpid()

    def new_rng(self) -> random.Random:
        return random.Random()

    async def run_blocking(self, fn: Callable[[], T]) -> T:
        return await trio.to_thread.run_sync(fn)


def _widen_pipe(fd: int) -> None:
    # A chatty job then blocks less often and each wakeup of ours finds more
    # to read: about a seventh less CPU per byte in bench_supervise.py. The
    # buffer is kernel memory, bounded per pipe; our reads stay CHUNK_SIZE.
    with contextlib.suppress(OSError):
        fcntl.fcntl(fd, fcntl.F_SETPIPE_SZ, OUTPUT_PIPE_BYTES)


@attrs.define
class _PipedProcess:
    _proc: trio.Process
    stdin: trio.abc.SendStream | None
    stdout: trio.abc.ReceiveStream
    stderr: trio.abc.ReceiveStream | None

    @property
    def pid(self) -> int:
        return self._proc.pid

    @property
    def returncode(self) -> int | None:
        return self._proc.returncode

    async def wait(self) -> int:
        return await self._proc.wait()


class _PtyInput(trio.abc.SendStream):
    """The write side of a PTY master, where closing means typing EOF.

    Closing the master would hang up the terminal (SIGHUP to the job) and
    also end our reading of its output, so end-of-input is the terminal's
    EOF character instead: once after a complete line, twice after a partial
    one (the first only flushes the pending line to the reader).
    """

    def __init__(self, master: trio.lowlevel.FdStream) -> None:
        self._master = master
        self._at_line_start = True
        self._closed = False

    async def send_all(self, data: bytes | bytearray | memoryview) -> None:
        if self._closed:
            raise trio.ClosedResourceError("input to the terminal was already ended")
        if len(data):
            self._at_line_start = bytes(data[-1:]) in (b"\n", b"\r")
        await self._master.send_all(data)

    async def wait_send_all_might_not_block(self) -> None:
        await self._master.wait_send_all_might_not_block()

    def type_eof(self) -> None:
        """End the input now; synchronous so it can run where no checkpoint may."""
        if self._closed:
            return
        self._closed = True
        eof = _veof(self._master.fileno())
        # Non-blocking on purpose: a job that stopped reading its terminal
        # must not be able to hold the supervisor here.
        with contextlib.suppress(OSError):
            os.write(self._master.fileno(), eof if self._at_line_start else eof * 2)

    async def aclose(self) -> None:
        self.type_eof()
        await trio.lowlevel.checkpoint()


def _veof(fd: int) -> bytes:
    try:
        cc = termios.tcgetattr(fd)[6]
        char = cc[termios.VEOF]
        if isinstance(char, bytes) and char:
            return char
    except (termios.error, OSError, IndexError):
        pass
    return b"\x04"


@attrs.define
class _PtyProcess:
    _proc: trio.Process
    _master: trio.lowlevel.FdStream
    stdin: trio.abc.SendStream | None

    @property
    def pid(self) -> int:
        return self._proc.pid

    @property
    def stdout(self) -> trio.abc.ReceiveStream:
        # Reading the master raises BrokenResourceError (EIO) once every
        # holder of the slave side has gone: the terminal's end of file.
        return self._master

    @property
    def stderr(self) -> trio.abc.ReceiveStream | None:
        return None

    @property
    def returncode(self) -> int | None:
        return self._proc.returncode

    async def wait(self) -> int:
        return await self._proc.wait()


def _take_controlling_tty() -> None:
    # Runs in the child after setsid() (start_new_session) and after fd 0
    # has become the slave: make it the new session's controlling terminal.
    fcntl.ioctl(0, termios.TIOCSCTTY, 0)


def _identity(run_as: RunAs | None) -> dict[str, Any]:
    """``subprocess`` arguments that drop to ``run_as`` (its groups first, then its uid)."""
    if run_as is None:
        return {}
    return {"user": run_as.uid, "group": run_as.gid, "extra_groups": list(run_as.groups)}


async def _spawn_on_pty(
    argv: Sequence[str],
    *,
    cwd: str | None,
    env: Mapping[str, str],
    stdin: bool,
    run_as: RunAs | None = None,
) -> HostProcess:
    master_fd, slave_fd = os.openpty()
    try:
        fcntl.ioctl(slave_fd, termios.TIOCSWINSZ, struct.pack("HHHH", PTY_ROWS, PTY_COLS, 0, 0))
        if run_as is not None:
            # The job's terminal is its own, as a login's is (it may reopen /dev/tty).
            os.fchown(slave_fd, run_as.uid, -1)
        proc = await trio.lowlevel.open_process(
            list(argv),
            cwd=cwd,
            env=dict(env),
            stdin=slave_fd,
            stdout=slave_fd,
            stderr=slave_fd,
            start_new_session=True,
            preexec_fn=_take_controlling_tty,
            **_identity(run_as),
        )
    except subprocess.SubprocessError as e:
        os.close(master_fd)
        raise OSError(f"could not make the new terminal the job's controlling tty: {e}") from e
    except BaseException:
        os.close(master_fd)
        raise
    finally:
        # The child has its own copies; ours would keep the terminal from
        # ever hanging up, so its output would never reach end of file.
        os.close(slave_fd)
    master = trio.lowlevel.FdStream(master_fd)
    keyboard = _PtyInput(master)
    if not stdin:
        # Nobody will type: a job reading its terminal gets end of file at
        # once, as it would from /dev/null, instead of waiting forever. No
        # checkpoint here: a cancellation must not strand a started process.
        keyboard.type_eof()
    return _PtyProcess(proc, master, keyboard if stdin else None)
