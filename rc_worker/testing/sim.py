"""A simulated host: the :class:`~rc_worker.host.Host` seam with scripted processes.

``SimHost`` implements the whole Host protocol with no operating system
underneath: an in-memory process table (pid, parent, process group, session,
state, environment) whose processes are Trio tasks running a :class:`Script`
in virtual time. Run it under ``trio.testing.MockClock(autojump_threshold=0)``
and the worker's own code (``run_job``, the sweep, recovery, the whole
``Worker``) runs unchanged, minutes of virtual time in milliseconds::

    host = SimHost()
    host.program("train", Script.printing((1.0, b"epoch 1\\n"), (2.0, b"done\\n")))
    result = await run_job(JobSpec(["train"], env={}), sink, host=host)

A command resolves through the host's program registry: a bare name
registered with :meth:`SimHost.program` is found whatever the PATH says; a
name with a ``/`` must be registered under exactly that path. Anything else
raises ``FileNotFoundError`` as a real spawn would.

What the model keeps from Linux, because the worker depends on it:

- a spawned process leads a new session and process group; a :class:`Fork`
  child inherits its group, session, environment and (unless told not to) its
  stdout, so the pipe stays open until every holder has gone; ``setsid``
  leaves both group and session but keeps the environment (``RC_JOB_ID``);
- SIGKILL ends a process at once, except in uninterruptible sleep
  (:class:`Hang`, state ``D``), where every signal waits until the sleep ends;
  SIGTERM does what the script's :class:`OnSigterm` says;
- an exited process stays a zombie (``Z``, still a group member) until its
  parent reaps it: ``wait()`` or ``returncode`` for the worker's children, at
  once for everything else (their parent is a shell or init);
- pipes hold :data:`DEFAULT_PIPE_CAPACITY` bytes; a writer blocks when one is
  full and dies of SIGPIPE when its reader has gone.

A crash of the worker is :meth:`SimHost.worker_died`: the processes carry
on, its pipes lose their reader, its children go to init, and whatever the
dying worker's code still does through this host (its shielded kill paths
run while it is cancelled) has no effect, since a SIGKILLed process runs no
code at all. :meth:`SimHost.worker_started` is the next worker process;
:meth:`SimHost.reboot` ends everything and changes the boot id.

Process tasks run as Trio system tasks, so a SimHost needs no nursery; they
end with the run. Only ``trio.sleep`` and ``trio.current_time`` are used: no
threads, no real I/O.
"""

from __future__ import annotations

import errno
import random
import signal
from collections.abc import Callable, Iterable, Mapping, Sequence
from types import MappingProxyType
from typing import TypeVar

import attrs
import trio

from rc_worker.cgroup import Containment
from rc_worker.host import HostProcess, ProcessInfo, ProcessPin, RunAs
from rc_worker.statestore import LINUX_STORE, StateStore
from rc_worker.testing.sim_cgroup import SimCgroupFs

T = TypeVar("T")

__all__ = [
    "DEFAULT_PIPE_CAPACITY",
    "EchoStdin",
    "Fork",
    "Hang",
    "HostFacts",
    "OnSigterm",
    "Script",
    "SimHost",
    "SimPipe",
    "SimProcess",
    "Sleep",
    "Step",
    "Write",
]

DEFAULT_PIPE_CAPACITY = 4096
"""Bytes a simulated pipe holds: small, so that backpressure is exercised."""

INIT_PID = 1

CLOCK_TICKS = 100
"""Clock ticks per virtual second in start times (Linux's USER_HZ)."""

# Signals whose default action is to do nothing; everything else not handled
# below kills, as the default disposition does.
_IGNORED_BY_DEFAULT = frozenset({signal.SIGCHLD, signal.SIGCONT, signal.SIGURG, signal.SIGWINCH})


# -- scripts ------------------------------------------------------------------


@attrs.frozen
class Sleep:
    """Run (asleep, state ``S``) for ``seconds`` of virtual time."""

    seconds: float


@attrs.frozen
class Write:
    """Write ``data`` to stdout, or to stderr (which is stdout unless spawned separate).

    ``repeat`` writes it that many times over, in one go: a big output that
    still reads (and prints in a failing example) in one line.
    """

    data: bytes
    stderr: bool = False
    repeat: int = 1

    @property
    def payload(self) -> bytes:
        return self.data * self.repeat


@attrs.frozen
class Hang:
    """Uninterruptible sleep (state ``D``) for ``seconds``; ``math.inf`` for ever.

    Signals sent meanwhile are held and acted on when it ends: a SIGKILL
    then kills at once. This is the process that survives SIGKILL.
    """

    seconds: float


@attrs.frozen
class EchoStdin:
    """Read standard input to its end, writing each piece to stdout as it comes."""


@attrs.frozen
class Fork:
    """Start ``child`` alongside and carry on at once.

    The child inherits the environment (``RC_JOB_ID`` included). With
    ``setsid`` it leaves the process group and session (it escapes group
    teardown); with ``holds_output`` (the default) it holds the parent's
    stdout and stderr open, else its output goes to ``/dev/null``.
    """

    child: Script
    setsid: bool = False
    holds_output: bool = True


@attrs.frozen
class OnSigterm:
    """What a process does on SIGTERM.

    The default dies of it. ``ignore`` ignores it (only SIGKILL works then);
    otherwise a handler runs ``delay`` seconds (the rest of the script does
    not), then exits with ``exit_code``, or dies of the signal when ``None``.
    """

    ignore: bool = False
    delay: float = 0.0
    exit_code: int | None = None


def _steps(steps: Iterable[Step]) -> tuple[Step, ...]:
    return tuple(steps)


@attrs.frozen
class Script:
    """What a simulated process does: ``steps`` in order, then exit with ``exit_code``.

    Frozen and built from frozen parts, so scripts compose (:meth:`then`) and
    hypothesis can build them (``st.builds(Script, ...)``). ``environ_readable``
    False makes the process's environment unreadable to the worker (another
    user's process, for a worker that is not root): sweeps go blind.
    ``uid`` is the owner the process table shows.
    """

    steps: tuple[Step, ...] = attrs.field(default=(), converter=_steps)
    exit_code: int = 0
    on_sigterm: OnSigterm = OnSigterm()
    environ_readable: bool = True
    uid: int = 0

    @classmethod
    def sleeping(cls, seconds: float, *, exit_code: int = 0) -> Script:
        """Run ``seconds`` of virtual time, print nothing, exit with ``exit_code``."""
        return cls((Sleep(seconds),), exit_code=exit_code)

    @classmethod
    def printing(cls, *chunks: tuple[float, bytes], exit_code: int = 0) -> Script:
        """Print each ``(at, data)`` at ``at`` seconds after the start (in order), then exit."""
        steps: list[Step] = []
        now = 0.0
        for at, data in chunks:
            if at > now:
                steps.append(Sleep(at - now))
                now = at
            steps.append(Write(data))
        return cls(steps, exit_code=exit_code)

    def then(self, *steps: Step) -> Script:
        """This script with ``steps`` appended."""
        return attrs.evolve(self, steps=(*self.steps, *steps))

    def exiting(self, exit_code: int) -> Script:
        return attrs.evolve(self, exit_code=exit_code)

    def ignoring_sigterm(self) -> Script:
        return attrs.evolve(self, on_sigterm=OnSigterm(ignore=True))

    def on_term(self, delay: float, exit_code: int | None = 0) -> Script:
        """On SIGTERM, stop, spend ``delay`` seconds cleaning up, then exit."""
        return attrs.evolve(self, on_sigterm=OnSigterm(delay=delay, exit_code=exit_code))

    @property
    def duration(self) -> float:
        """Virtual seconds its own steps take when nothing blocks or signals it."""
        return sum(s.seconds for s in self.steps if isinstance(s, Sleep | Hang))

    @property
    def output(self) -> bytes:
        """What its own steps write (stdout and stderr), forks and stdin left out."""
        return b"".join(s.payload for s in self.steps if isinstance(s, Write))


Step = Sleep | Write | Hang | EchoStdin | Fork
"""One step of a :class:`Script`."""


@attrs.frozen
class HostFacts:
    """The built-in facts a SimHost reports; replace ``SimHost.facts`` to change them."""

    hostname: str = "sim-host"
    kernel: str = "6.1.0-sim"
    cpu_count: int = 8
    mem_total_bytes: int = 64 * 2**30
    disk_free_bytes: int = 500 * 10**9


# -- pipes --------------------------------------------------------------------


class _BrokenPipe(Exception):
    """The reader has gone: EPIPE, which a writer's default disposition turns into SIGPIPE."""


class SimPipe:
    """A pipe with a small buffer: one reader, any number of writers.

    ``written`` is every byte that got into the pipe and ``read`` every byte
    the reader took out, both in order: what a job printed, and what the
    worker saw of it.
    """

    def __init__(self, capacity: int = DEFAULT_PIPE_CAPACITY) -> None:
        if capacity <= 0:
            raise ValueError(f"a pipe's capacity must be at least 1 byte, got {capacity}")
        self.capacity = capacity
        self.written = bytearray()
        self.read = bytearray()
        self._buffer = bytearray()
        self._writers = 0
        self._reader_open = True
        self._severed = False
        self._lot = trio.lowlevel.ParkingLot()

    @property
    def writers(self) -> int:
        """How many ends are open for writing."""
        return self._writers

    def add_writer(self) -> None:
        self._writers += 1

    def close_writer(self) -> None:
        self._writers -= 1
        self._lot.unpark_all()

    def close_reader(self) -> None:
        self._reader_open = False
        self._buffer.clear()
        self._lot.unpark_all()

    def sever(self) -> None:
        """The reading process died: writers get SIGPIPE, its old end reads EOF."""
        self._severed = True
        self.close_reader()

    async def write(self, data: bytes) -> None:
        """Put all of ``data`` in, blocking while full. Raises ``_BrokenPipe``."""
        await trio.lowlevel.checkpoint_if_cancelled()
        view = memoryview(data)
        while view:
            if not self._reader_open:
                raise _BrokenPipe
            room = self.capacity - len(self._buffer)
            if room <= 0:
                await self._lot.park()
                continue
            piece = bytes(view[:room])
            view = view[room:]
            self._buffer += piece
            self.written += piece
            self._lot.unpark_all()
        await trio.lowlevel.cancel_shielded_checkpoint()

    async def receive(self, max_bytes: int) -> bytes:
        """Up to ``max_bytes``; ``b""`` at end of file (every writer gone)."""
        await trio.lowlevel.checkpoint_if_cancelled()
        while True:
            if self._severed:
                piece = b""
                break
            if not self._reader_open:
                raise trio.ClosedResourceError("this end of the pipe was already closed")
            if self._buffer:
                piece = bytes(self._buffer[:max_bytes])
                del self._buffer[:max_bytes]
                self.read += piece
                self._lot.unpark_all()
                break
            if self._writers <= 0:
                piece = b""
                break
            await self._lot.park()
        # Taken before this point, so a cancellation here must not lose it.
        await trio.lowlevel.cancel_shielded_checkpoint()
        return piece


class _PipeReader(trio.abc.ReceiveStream):
    def __init__(self, pipe: SimPipe) -> None:
        self._pipe = pipe
        self._closed = False

    async def receive_some(self, max_bytes: int | None = None) -> bytes:
        if self._closed:
            raise trio.ClosedResourceError("the stream was already closed")
        return await self._pipe.receive(max_bytes or 65536)

    async def aclose(self) -> None:
        if not self._closed:
            self._closed = True
            self._pipe.close_reader()
        await trio.lowlevel.checkpoint()


class _PipeWriter(trio.abc.SendStream):
    def __init__(self, pipe: SimPipe) -> None:
        self._pipe = pipe
        self._closed = False

    async def send_all(self, data: bytes | bytearray | memoryview) -> None:
        if self._closed:
            raise trio.ClosedResourceError("the stream was already closed")
        try:
            await self._pipe.write(bytes(data))
        except _BrokenPipe:
            raise trio.BrokenResourceError("the process no longer reads its input") from None

    async def wait_send_all_might_not_block(self) -> None:
        await trio.lowlevel.checkpoint()

    def drop(self) -> None:
        if not self._closed:
            self._closed = True
            self._pipe.close_writer()

    async def aclose(self) -> None:
        self.drop()
        await trio.lowlevel.checkpoint()


# -- processes ----------------------------------------------------------------


@attrs.define(eq=False)
class SimProcess:
    """One process of the simulated table, and its record once it has ended.

    ``signals`` lists every signal delivered to it (0 excluded), in order;
    ``stdout`` is the pipe it writes to (shared with the forks holding it).
    """

    pid: int
    ppid: int
    pgid: int
    sid: int
    argv: tuple[str, ...]
    environ: Mapping[str, str]
    script: Script
    started_at: float
    spawned_by_worker: bool
    readable: bool = True
    started_ticks: int = 0
    cgroup: str = "/"
    signalable: bool = True
    state: str = "R"
    returncode: int | None = None
    ended_at: float | None = None
    reaped: bool = False
    signals: list[int] = attrs.Factory(list)
    stdout: SimPipe | None = None
    stderr: SimPipe | None = None
    stdin: SimPipe | None = None
    _auto_reap: bool = False
    _pending: list[int] = attrs.Factory(list)
    _handler: OnSigterm | None = None
    _life: trio.CancelScope = attrs.Factory(trio.CancelScope)
    _flow: trio.CancelScope = attrs.Factory(trio.CancelScope)
    _exited: trio.Event = attrs.Factory(trio.Event)

    @property
    def alive(self) -> bool:
        """Not yet exited (a zombie has)."""
        return self.returncode is None

    @property
    def job_id(self) -> str | None:
        return self.environ.get("RC_JOB_ID")

    @property
    def signalled(self) -> bool:
        """Whether any signal reached it before it ended."""
        return bool(self.signals)

    @property
    def start_time(self) -> int:
        """When it started, in clock ticks since the (simulated) boot."""
        return self.started_ticks

    def info(self) -> ProcessInfo:
        return ProcessInfo(
            self.pid,
            self.ppid,
            self.pgid,
            self.sid,
            self.state,
            start_time=self.started_ticks,
            uid=self.script.uid,
        )

    def _outputs(self) -> list[SimPipe]:
        # stderr merged into stdout is one pipe, held once.
        pipes = [p for p in (self.stdout, self.stderr) if p is not None]
        return pipes if len(pipes) < 2 or pipes[0] is not pipes[1] else pipes[:1]


class _SimHandle:
    """What ``spawn`` returns: a :class:`~rc_worker.host.HostProcess`."""

    def __init__(
        self,
        host: SimHost,
        proc: SimProcess,
        stdin: _PipeWriter | None,
        stdout: SimPipe,
        stderr: SimPipe | None,
    ) -> None:
        self._host = host
        self._proc = proc
        self.pid = proc.pid
        self._stdin_writer = stdin
        self.stdin: trio.abc.SendStream | None = stdin
        self.stdout: trio.abc.ReceiveStream = _PipeReader(stdout)
        self.stderr: trio.abc.ReceiveStream | None = None if stderr is None else _PipeReader(stderr)
        self._pipes = [p for p in (stdout, stderr) if p is not None]

    @property
    def returncode(self) -> int | None:
        # Like trio.Process.returncode (Popen.poll), looking reaps.
        if self._proc.returncode is not None:
            self._host._reap(self._proc)
        return self._proc.returncode

    async def wait(self) -> int:
        await self._proc._exited.wait()
        self._host._reap(self._proc)
        assert self._proc.returncode is not None
        return self._proc.returncode

    def _sever(self) -> None:
        for pipe in self._pipes:
            pipe.sever()
        if self._stdin_writer is not None:
            self._stdin_writer.drop()


class _SimPin:
    """A pidfd: it reaches the one process it was opened on, or nothing."""

    def __init__(self, host: SimHost, proc: SimProcess) -> None:
        self._host = host
        self._proc: SimProcess | None = proc

    def send_signal(self, sig: int) -> bool:
        proc = self._proc
        if proc is None or not self._host.worker_alive or not proc.alive:
            return False
        self._host._deliver(proc, sig)
        return True

    def close(self) -> None:
        self._proc = None


# -- the host -------------------------------------------------------------------


class SimHost(SimCgroupFs):
    """A complete :class:`~rc_worker.host.Host` with scripted processes (see the module doc)."""

    def __init__(
        self,
        name: str = "sim-host",
        *,
        boot_id: str | None = None,
        facts: HostFacts | None = None,
        pipe_capacity: int = DEFAULT_PIPE_CAPACITY,
    ) -> None:
        self.name = name
        self.facts = facts if facts is not None else HostFacts(hostname=name)
        self.pipe_capacity = pipe_capacity
        self.current_boot_id = boot_id if boot_id is not None else f"{name}-boot-1"
        self.environ_readable = True
        """False: the worker is not root, so no other process's environment is readable."""
        self.history: list[SimProcess] = []
        """Every process ever started here, in order, ended ones included."""
        self.boots = 1
        self._programs: dict[str, Script] = {}
        self._table: dict[int, SimProcess] = {}
        self._next_pid = 100
        self._handles: list[_SimHandle] = []
        self.worker_pid = self._allocate_pid()
        self.worker_alive = True
        self._booted_at = 0.0
        self.cgroup_v2 = False
        """True: a unified (v2) hierarchy the worker may use (a root worker, Delegate=yes)."""
        self.cgroup_controllers: frozenset[str] = frozenset()
        """The controllers delegated to the worker's cgroup (``memory``, ``cpu``...)."""
        self.service_cgroup = "/system.slice/rc-worker.service"
        """Where the service manager starts the worker."""
        self.worker_cgroup = self.service_cgroup
        self.containment: Containment | None = None
        self._cgroups: dict[str, dict[str, str]] = {}
        self._reset_cgroups()

    # -- what simulations drive --

    def program(self, name: str, script: Script) -> None:
        """Make ``name`` (a bare command name, or an exact absolute path) run ``script``."""
        if not name:
            raise ValueError("a program needs a name, e.g. 'train' or '/opt/bin/train'")
        self._programs[name] = script

    def start(
        self,
        script: Script,
        *,
        environ: Mapping[str, str] | None = None,
        argv: Sequence[str] = ("daemon",),
        signalable: bool = True,
        pid: int | None = None,
    ) -> SimProcess:
        """Start a process the worker did not spawn (a daemon, another user's job).

        It leads a session of its own under init. ``signalable`` False
        answers the worker's signals with EPERM: they arrive nowhere.
        ``pid`` reuses a pid no live process holds (a recycled pid); by
        default the next free one.
        """
        if pid is None:
            pid = self._allocate_pid()
        elif pid in self._table or pid in (INIT_PID, self.worker_pid):
            raise ValueError(f"pid {pid} is in use; only a pid nothing holds can be recycled")
        proc = SimProcess(
            pid=pid,
            ppid=INIT_PID,
            pgid=pid,
            sid=pid,
            argv=tuple(argv),
            environ=MappingProxyType(dict(environ or {})),
            script=script,
            started_at=trio.current_time(),
            spawned_by_worker=False,
            readable=script.environ_readable,
            signalable=signalable,
            auto_reap=True,
        )
        self._launch(proc)
        return proc

    def worker_died(self) -> None:
        """The worker process was SIGKILLed: its processes carry on without it.

        Its pipes lose their reader (a writer then dies of SIGPIPE), its
        children go to init, and until :meth:`worker_started` every protocol
        call answers as nothing at all: what the dying worker's code still
        does through this host changes nothing.
        """
        if not self.worker_alive:
            return
        self.worker_alive = False
        for handle in self._handles:
            handle._sever()
        self._handles.clear()
        for proc in list(self._table.values()):
            if proc.ppid == self.worker_pid:
                proc.ppid = INIT_PID
                proc._auto_reap = True
                if proc.returncode is not None:
                    self._reap(proc)

    def worker_started(self) -> int:
        """A new worker process (after :meth:`worker_died`); returns its pid."""
        self.worker_died()
        self.worker_pid = self._allocate_pid()
        self.worker_alive = True
        self.worker_cgroup = self.service_cgroup
        self.containment = None
        return self.worker_pid

    def reboot(self, boot_id: str | None = None) -> None:
        """Power-cycle: every process ends (whatever its state), the boot id changes.

        The worker dies with the rest; call :meth:`worker_started` for the
        one the service manager starts after the boot.
        """
        self.worker_died()
        for proc in list(self._table.values()):
            proc._pending.clear()
            self._end(proc, -signal.SIGKILL)
            self._reap(proc)
        self.boots += 1
        self._booted_at = trio.current_time()
        self._reset_cgroups()
        self.current_boot_id = boot_id if boot_id is not None else f"{self.name}-boot-{self.boots}"

    def table(self) -> list[SimProcess]:
        """The process table now (zombies included), for checks; never raises."""
        return list(self._table.values())

    def live(self, *, job_id: str | None = None, device: str | None = None) -> list[SimProcess]:
        """Processes still alive, by the ``RC_JOB_ID`` / ``RC_DEVICE`` they were started with.

        The truth, whatever the worker may read: unreadable environments and
        escaped sessions included.
        """
        return [
            p
            for p in self._table.values()
            if p.alive
            and (job_id is None or p.environ.get("RC_JOB_ID") == job_id)
            and (device is None or p.environ.get("RC_DEVICE") == device)
        ]

    def spawned(self, job_id: str | None = None) -> list[SimProcess]:
        """The processes a worker spawned (ended ones too), optionally one job's."""
        return [
            p
            for p in self.history
            if p.spawned_by_worker and (job_id is None or p.job_id == job_id)
        ]

    # -- the Host protocol --

    def hostname(self) -> str:
        return self.facts.hostname

    def boot_id(self) -> str:
        return self.current_boot_id

    def kernel(self) -> str:
        return self.facts.kernel

    def cpu_count(self) -> int:
        return self.facts.cpu_count

    def mem_total_bytes(self) -> int:
        return self.facts.mem_total_bytes

    def disk_free_bytes(self, path: str) -> int:
        return self.facts.disk_free_bytes

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
        # As trio.lowlevel.open_process: a cancel point before, none after,
        # so a cancellation never strands a started process.
        await trio.lowlevel.checkpoint_if_cancelled()
        if not self.worker_alive:
            raise OSError(errno.ESRCH, "the worker process is gone (simulated crash)")
        if cgroup is not None:
            self._cgroup(cgroup)
        script = self._resolve(argv)
        out = SimPipe(self.pipe_capacity)
        err = SimPipe(self.pipe_capacity) if separate_stderr and not pty else None
        feed = SimPipe(self.pipe_capacity) if stdin else None
        pid = self._allocate_pid()
        proc = SimProcess(
            pid=pid,
            ppid=self.worker_pid,
            pgid=pid,
            sid=pid,
            argv=tuple(argv),
            environ=MappingProxyType(dict(env)),
            script=script,
            started_at=trio.current_time(),
            spawned_by_worker=True,
            readable=script.environ_readable,
            stdout=out,
            stderr=err if err is not None else out,
            stdin=feed,
            cgroup=self.worker_cgroup if cgroup is None else cgroup,
        )
        writer = None
        if feed is not None:
            feed.add_writer()
            writer = _PipeWriter(feed)
        handle = _SimHandle(self, proc, writer, out, err)
        self._handles.append(handle)
        self._launch(proc)
        return handle

    def signal_group(self, pgid: int, sig: int) -> bool:
        if not self.worker_alive:
            return False
        members = [p for p in self._table.values() if p.pgid == pgid]
        for proc in members:
            self._deliver(proc, sig)
        return bool(members)

    def signal_pid(self, pid: int, sig: int) -> bool:
        if not self.worker_alive:
            return False
        proc = self._table.get(pid)
        if proc is not None:
            self._deliver(proc, sig)
            return True
        return pid in (INIT_PID, self.worker_pid)

    def processes(self) -> list[ProcessInfo]:
        if not self.worker_alive:
            raise OSError(errno.ESRCH, "the worker process is gone (simulated crash)")
        rows = [
            ProcessInfo(INIT_PID, 0, INIT_PID, INIT_PID, "S", uid=0),
            ProcessInfo(self.worker_pid, INIT_PID, self.worker_pid, self.worker_pid, "S", uid=0),
        ]
        return rows + [p.info() for p in self._table.values()]

    def environ(self, pid: int) -> Mapping[str, str]:
        if pid == self.worker_pid and self.worker_alive:
            return {}
        proc = self._table.get(pid)
        if proc is None or not self.worker_alive:
            raise ProcessLookupError(errno.ESRCH, f"process {pid} has exited")
        if not (proc.readable and self.environ_readable):
            raise PermissionError(errno.EACCES, f"/proc/{pid}/environ: Permission denied")
        # A zombie's environment reads empty, as /proc shows it.
        return proc.environ if proc.alive else {}

    def own_pid(self) -> int:
        return self.worker_pid

    store: StateStore = LINUX_STORE

    def new_rng(self) -> random.Random:
        return random.Random()

    async def run_blocking(self, fn: Callable[[], T]) -> T:
        # Inline: a real thread would leave every task blocked for a moment,
        # and an autojumping MockClock would leap to its next deadline.
        await trio.lowlevel.checkpoint()
        return fn()

    def boot_ticks(self) -> int:
        return int((trio.current_time() - self._booted_at) * CLOCK_TICKS)

    def pin(self, pid: int, start_time: int) -> ProcessPin | None:
        proc = self._table.get(pid)
        if not self.worker_alive or proc is None or proc.started_ticks != start_time:
            return None
        return _SimPin(self, proc)

    def process(self, pid: int) -> ProcessInfo | None:
        proc = self._table.get(pid)
        return None if proc is None or not self.worker_alive else proc.info()

    # -- internals --

    def _allocate_pid(self) -> int:
        pid = self._next_pid
        self._next_pid += 1
        return pid

    def _resolve(self, argv: Sequence[str]) -> Script:
        name = argv[0]
        script = self._programs.get(name)
        if script is None:
            raise FileNotFoundError(errno.ENOENT, "No such file or directory", name)
        return script

    def _launch(self, proc: SimProcess) -> None:
        proc.started_ticks = self.boot_ticks()
        for pipe in proc._outputs():
            pipe.add_writer()
        self._table[proc.pid] = proc
        self.history.append(proc)
        trio.lowlevel.spawn_system_task(self._live, proc, name=f"sim pid {proc.pid}")

    def _reap(self, proc: SimProcess) -> None:
        if proc.returncode is not None and not proc.reaped:
            proc.reaped = True
            self._table.pop(proc.pid, None)

    def _end(self, proc: SimProcess, returncode: int) -> None:
        if proc.returncode is not None:
            return
        proc.returncode = returncode
        proc.ended_at = trio.current_time()
        proc.state = "Z"
        for pipe in proc._outputs():
            pipe.close_writer()
        if proc.stdin is not None:
            proc.stdin.close_reader()
        proc._life.cancel()
        proc._exited.set()
        if proc._auto_reap:
            self._reap(proc)

    def _deliver(self, proc: SimProcess, sig: int) -> None:
        if sig == 0 or not proc.alive or not proc.signalable:
            return
        proc.signals.append(sig)
        if proc.state == "D":
            proc._pending.append(sig)
        else:
            self._act(proc, sig)

    def _act(self, proc: SimProcess, sig: int) -> None:
        if sig == signal.SIGTERM:
            policy = proc.script.on_sigterm
            if policy.ignore or proc._handler is not None:
                return
            if policy.delay > 0:
                proc._handler = policy
                proc._flow.cancel()
            else:
                self._end(proc, -sig if policy.exit_code is None else policy.exit_code)
        elif sig not in _IGNORED_BY_DEFAULT:
            self._end(proc, -sig)

    async def _live(self, proc: SimProcess) -> None:
        with proc._life:
            with proc._flow:
                try:
                    await self._run_steps(proc, proc.script.steps)
                except _BrokenPipe:
                    self._end(proc, -signal.SIGPIPE)
                    return
                self._end(proc, proc.script.exit_code)
                return
            # The flow was interrupted by a SIGTERM handler: it cleans up, then exits.
            handler = proc._handler
            assert handler is not None
            proc.state = "S"
            await trio.sleep(handler.delay)
            self._end(proc, -signal.SIGTERM if handler.exit_code is None else handler.exit_code)

    async def _run_steps(self, proc: SimProcess, steps: Sequence[Step]) -> None:
        for step in steps:
            # A process killed while it was scheduled (a write's last
            # checkpoint, say) must not take another step: a dead one forks nothing.
            await trio.lowlevel.checkpoint_if_cancelled()
            if isinstance(step, Sleep):
                proc.state = "S"
                await trio.sleep(step.seconds)
                proc.state = "R"
            elif isinstance(step, Write):
                pipe = proc.stderr if step.stderr else proc.stdout
                if pipe is None:
                    await trio.lowlevel.checkpoint()
                else:
                    await pipe.write(step.payload)
            elif isinstance(step, Hang):
                await self._hang(proc, step.seconds)
            elif isinstance(step, EchoStdin):
                await self._echo(proc)
            else:
                self._fork(proc, step)
                await trio.lowlevel.checkpoint()

    async def _hang(self, proc: SimProcess, seconds: float) -> None:
        proc.state = "D"
        await trio.sleep(seconds)
        proc.state = "R"
        pending, proc._pending = proc._pending, []
        if signal.SIGKILL in pending:
            pending = [signal.SIGKILL]
        for sig in pending:
            self._act(proc, sig)
        # Whatever those signals did takes effect here.
        await trio.lowlevel.checkpoint()

    async def _echo(self, proc: SimProcess) -> None:
        if proc.stdin is None:
            await trio.lowlevel.checkpoint()
            return
        while True:
            proc.state = "S"
            data = await proc.stdin.receive(self.pipe_capacity)
            proc.state = "R"
            if not data:
                return
            if proc.stdout is not None:
                await proc.stdout.write(data)

    def _fork(self, parent: SimProcess, step: Fork) -> None:
        assert parent.alive, f"pid {parent.pid} forked after it ended"
        pid = self._allocate_pid()
        group = pid if step.setsid else parent.pgid
        child = SimProcess(
            pid=pid,
            ppid=parent.pid,
            pgid=group,
            sid=pid if step.setsid else parent.sid,
            argv=parent.argv,
            environ=parent.environ,
            script=step.child,
            started_at=trio.current_time(),
            spawned_by_worker=False,
            readable=step.child.environ_readable,
            cgroup=parent.cgroup,
            stdout=parent.stdout if step.holds_output else None,
            stderr=parent.stderr if step.holds_output else None,
            # Its parent is a script (a shell waits for it) or init: reaped at once.
            auto_reap=True,
        )
        self._launch(child)
