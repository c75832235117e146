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

Its files are in memory (:class:`~rc_worker.testing.simdisk.SimDisk`, as
``host.disk``, which is also ``host.store``): the worker's state directory, and
a file at the path of each program registered under one (so that drop-in
listings and ``which`` find it). Faults of the disk are injected there (a full
disk, a torn write at :meth:`SimHost.power_loss`, a directory that vanishes).

The parts live in their own modules, every name re-exported here:
``sim_script`` (:class:`Script` and its steps), ``sim_pipe`` (:class:`SimPipe`),
``sim_process`` (:class:`SimProcess`), ``sim_cgroup`` (the cgroup v2 tree) and
``simdisk``.

Process tasks run as Trio system tasks, so a SimHost needs no nursery; they
end with the run. Only ``trio.sleep`` and ``trio.current_time`` are used: no
threads, no real I/O.
"""

from __future__ import annotations

import errno
import random
import signal
from collections.abc import Callable, Mapping, Sequence
from types import MappingProxyType
from typing import TypeVar

import trio

from rc_worker.cgroup import Containment
from rc_worker.core.pid_window import PidMark, pid_window
from rc_worker.host import HostProcess, ProcessInfo, ProcessPin, RunAs
from rc_worker.statestore import StateStore
from rc_worker.testing.sim_cgroup import SimCgroupFs
from rc_worker.testing.sim_pipe import DEFAULT_PIPE_CAPACITY, SimPipe, _BrokenPipe, _PipeWriter
from rc_worker.testing.sim_process import SimProcess, _SimHandle, _SimPin
from rc_worker.testing.sim_script import (
    EchoStdin,
    Fork,
    Hang,
    HostFacts,
    OnSigterm,
    Script,
    Sleep,
    Step,
    Write,
)
from rc_worker.testing.simdisk import SimDisk

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

INIT_PID = 1
_FIRST_PID = 100
# The simulated pid_max: far more pids than any simulation hands out.
SIM_PID_MAX = 1 << 22

CLOCK_TICKS = 100
"""Clock ticks per virtual second in start times (Linux's USER_HZ)."""

# Signals whose default action is to do nothing; everything else not handled
# below kills, as the default disposition does.
_IGNORED_BY_DEFAULT = frozenset({signal.SIGCHLD, signal.SIGCONT, signal.SIGURG, signal.SIGWINCH})


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
        seed: int | str | None = None,
    ) -> None:
        self.name = name
        self.disk = SimDisk()
        """Every file of this host, in memory (``simdisk.py``): its faults are injected there."""
        self.store: StateStore = self.disk
        self.seed = seed
        """Seeds each worker process's generator (:meth:`new_rng`); ``None``: fresh entropy."""
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
        self._next_pid = _FIRST_PID
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
        if name.startswith("/"):
            # A program at a path is a file there too: listed, found by ``which``.
            self.disk.install(name)

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
        self.disk.release_locks(self.worker_pid)
        self.disk.frozen = True
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
        self.disk.frozen = False
        self.worker_cgroup = self.service_cgroup
        self.containment = None
        return self.worker_pid

    def reboot(self, boot_id: str | None = None) -> None:
        """Reboot: every process ends (whatever its state), the boot id changes.

        A clean reboot syncs the disks first, so nothing written is lost
        (:meth:`power_loss` is the other kind). The worker dies with the rest;
        call :meth:`worker_started` for the one the service manager starts after the boot.
        """
        self.disk.sync()
        self._restart_machine(boot_id)

    def power_loss(self, boot_id: str | None = None) -> None:
        """The machine loses power and boots again: as :meth:`reboot`, but the disk
        keeps only what was durable (``SimDisk.power_loss``: fsynced data and names)."""
        self.disk.power_loss()
        self._restart_machine(boot_id)

    def _restart_machine(self, boot_id: str | None) -> None:
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

    def pid_mark(self) -> PidMark | None:
        # Pids are handed out in order and never wrap here; the counts are
        # the kernel's, so the real window rule decides (and is exercised).
        created = self._next_pid - _FIRST_PID
        return PidMark(self._next_pid - 1, created, len(self._table) + 2, SIM_PID_MAX, 1)

    def processes_since(self, mark: PidMark) -> list[ProcessInfo] | None:
        table = self.processes()
        now = self.pid_mark()
        window = None if now is None else pid_window(mark, now)
        if window is None:
            return None
        return [p for p in table if window.holds(p.pid)]

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

    def new_rng(self) -> random.Random:
        if self.seed is None:
            return random.Random()
        # One stream per worker process: a restart is a new process with new ids.
        return random.Random(f"{self.seed}/{self.name}/{self.worker_pid}")

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
