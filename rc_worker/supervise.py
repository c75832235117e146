"""Run one job under supervision: a :class:`JobSpec` in, a :class:`Result` out.

The job is the leader of a new session, so its process group is its own
(with ``pty=True`` a new pseudo-terminal is its controlling terminal). While
it runs, its output is read in fixed-size chunks and handed to the sink one
chunk at a time, so the worker's memory stays flat whatever the job prints;
its input is fed from a task through a pipe the supervisor owns.

Limits are deadlines on the cancel scope that waits for the job: the max
runtime is a fixed deadline, the idle timeout a deadline that every chunk of
output pushes back, and a :class:`JobHandle` stop is a cancel of the same
scope. When one fires, the group gets SIGTERM, the grace ceiling, SIGKILL,
and is reaped. When the job's main process ends on its own, whatever is left
of its group is torn down the same way, then the optional RC_JOB_ID sweep
runs, then output is drained for at most :data:`DRAIN_SECONDS`, so a pipe
held open by something that survived everything cannot hang the report.

``killed`` means the supervisor killed the main process, nothing else. What
teardown and the sweep had to do afterwards is reported in ``Result.sweep``
and never touches ``killed``, ``reason`` or ``exit_code``.
"""

from __future__ import annotations

import logging
import math
import os
import signal
from collections.abc import AsyncIterable, Awaitable, Callable, Mapping, Sequence
from types import MappingProxyType

import attrs
import trio

from rc_worker import cgroup as cgroups
from rc_worker.core.pid_window import PidMark
from rc_worker.host import Host, HostProcess, LinuxHost, RunAs
from rc_worker.spawn_status import describe_spawn_error, exit_status
from rc_worker.sweep import KILL_WAIT as SWEEP_KILL_WAIT
from rc_worker.sweep import NOT_SWEPT, NOTHING_STARTED, SweepReport, sweep_job_survivors

log = logging.getLogger(__name__)

Sink = Callable[[bytes], Awaitable[None]]
"""Where output goes: awaited once per chunk, in order; its backpressure is the job's."""

StdinSource = bytes | AsyncIterable[bytes]

CHUNK_SIZE = 64 * 1024
"""Largest piece of output handed to a sink at once (and all the RAM one read takes)."""

DRAIN_SECONDS = 1.0
"""How long output is still read after the job and everything found of it are gone."""

KILL_WAIT = 2.0
"""How long to wait after SIGKILL for the group to vanish and the main process to be reaped."""

_POLL_MAX = 0.1

REASON_MAX_RUNTIME = "max_runtime"
REASON_IDLE_TIMEOUT = "idle_timeout"
REASON_CANCELLED = "cancelled"


# -- the spec ---------------------------------------------------------------


def _to_command(value: Sequence[str]) -> tuple[str, ...]:
    if isinstance(value, str | bytes):
        raise ValueError(
            f"command must be a list of arguments such as ['sh', '-c', {value!r}], "
            "not a single string"
        )
    command = tuple(value)
    if not command:
        raise ValueError("command must not be empty: give the program and its arguments")
    for arg in command:
        if not isinstance(arg, str):
            raise ValueError(f"command arguments must be strings, got {arg!r}")
        if "\0" in arg:
            raise ValueError(f"command argument {arg!r} contains a NUL byte")
    if not command[0]:
        raise ValueError("command[0] must name the program to run, got an empty string")
    return command


def _to_env(value: Mapping[str, str]) -> Mapping[str, str]:
    env = dict(value)
    for key, val in env.items():
        if not isinstance(key, str) or not isinstance(val, str):
            raise ValueError(f"env must map strings to strings, got {key!r}: {val!r}")
        if not key or "=" in key or "\0" in key or "\0" in val:
            raise ValueError(f"env entry {key!r} is not a valid variable (no '=' or NUL in names)")
    # A private read-only copy: the caller mutating its dict later must
    # not change what a running (or frozen) spec says.
    return MappingProxyType(env)


def _to_cwd(value: str | os.PathLike[str] | None) -> str | None:
    return None if value is None else os.fspath(value)


def _seconds(name: str, value: float, *, allow_zero: bool) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"{name} must be a number of seconds, got {value!r}")
    seconds = float(value)
    if not math.isfinite(seconds) or seconds < 0 or (seconds == 0 and not allow_zero):
        bound = ">= 0" if allow_zero else "> 0 (use None for no limit)"
        raise ValueError(f"{name} must be a finite number of seconds {bound}, got {value!r}")
    return seconds


def _to_grace(value: float) -> float:
    return _seconds("grace_ceiling", value, allow_zero=True)


def _to_max_runtime(value: float | None) -> float | None:
    return None if value is None else _seconds("max_runtime", value, allow_zero=False)


def _to_idle_timeout(value: float | None) -> float | None:
    return None if value is None else _seconds("idle_timeout", value, allow_zero=False)


def _to_stdin(
    value: bytes | bytearray | memoryview | AsyncIterable[bytes] | None,
) -> StdinSource | None:
    if value is None:
        return None
    if isinstance(value, bytes | bytearray | memoryview):
        return bytes(value)
    if isinstance(value, AsyncIterable):
        return value
    hint = "; encode the str" if isinstance(value, str) else ""
    raise ValueError(f"stdin must be None, bytes or an async iterable of bytes{hint}")


def _check_stderr(_: object, __: object, value: Sink | None) -> None:
    if value is not None and not callable(value):
        raise ValueError(f"stderr must be None or an async callable taking bytes, got {value!r}")


def _check_job_id(_: object, __: object, value: str | None) -> None:
    if value is not None and (not isinstance(value, str) or not value or "\0" in value):
        raise ValueError(f"sweep_job_id must be None or a non-empty string, got {value!r}")


@attrs.frozen
class JobSpec:
    """What to run and under which limits.

    ``command``: the program and its arguments (stored as a tuple);
    ``command[0]`` is looked up on the PATH in ``env``.
    ``cwd``: the working directory, or ``None`` for the worker's own.
    ``env``: the job's WHOLE environment, exactly this mapping and nothing
    inherited: the caller builds it (PATH, HOME, RC_JOB_ID, device
    variables...). An empty mapping gives an empty environment.
    ``grace_ceiling``: seconds between SIGTERM and SIGKILL.
    ``max_runtime``: seconds the job may run in all; ``None`` for no limit.
    ``idle_timeout``: the longest gap in seconds with no output on stdout or
    stderr; ``None`` for no limit.
    ``stdin``: ``None`` for ``/dev/null``, else bytes or an async iterable of
    bytes fed through a pipe, closed (EOF) when the input ends. A job that
    does not read it all is not an error.
    ``stderr``: ``None`` to combine stderr into the sink; else a separate sink.
    ``sweep_job_id``: after the group is torn down, remove every process whose
    environment carries exactly ``RC_JOB_ID=<this>`` (see ``sweep.py``). An
    explicit opt-in, never read out of ``env``: hooks and verify probes carry
    the id too and must never sweep.
    ``run_as``: the user (and groups) to run as; needs a root worker.
    ``pty``: run on a new pseudo-terminal (stdout and stderr are then one
    stream, so ``stderr`` must be ``None``; with no ``stdin`` the terminal's
    EOF is typed at once, so a reader sees end of file as from /dev/null).
    ``cgroup``: the v2 cgroup (a path in the hierarchy) to create and run it
    in; ``None`` gives it a fresh one of its own when the host has a cgroup
    tree set up (``Host.containment``), else none. With a cgroup, whatever is
    left in it after the group teardown is ended through it (the exact
    sweep, ``method`` ``cgroup``), and the cgroup is removed.
    ``cgroup_limits``: files to write into that cgroup before the job starts
    (``memory.max``, ``cpu.max``).
    """

    command: tuple[str, ...] = attrs.field(converter=_to_command)
    cwd: str | None = attrs.field(default=None, converter=_to_cwd)
    env: Mapping[str, str] = attrs.field(factory=dict, converter=_to_env)
    grace_ceiling: float = attrs.field(default=10.0, converter=_to_grace)
    max_runtime: float | None = attrs.field(default=None, converter=_to_max_runtime)
    idle_timeout: float | None = attrs.field(default=None, converter=_to_idle_timeout)
    stdin: StdinSource | None = attrs.field(default=None, converter=_to_stdin)
    stderr: Sink | None = attrs.field(default=None, validator=_check_stderr)
    sweep_job_id: str | None = attrs.field(default=None, validator=_check_job_id)
    pty: bool = attrs.field(default=False, converter=bool)
    cgroup: str | None = None
    cgroup_limits: Mapping[str, str] = attrs.field(factory=dict)
    run_as: RunAs | None = None

    def __attrs_post_init__(self) -> None:
        if self.pty and self.stderr is not None:
            raise ValueError(
                "stderr cannot be a separate sink with pty=True: a terminal carries "
                "stdout and stderr as one stream; drop stderr or pty"
            )


@attrs.frozen
class Result:
    """How a job ended.

    ``exit_code``: the shell convention, its exit status or 128+N when it died
    of signal N; ``None`` when it never started (``error`` says why) or, in
    the one pathological case of a process that outlived SIGKILL, could not
    be reaped (``error`` says so too). ``signal``: N, or ``None``.
    ``killed``: the supervisor killed the main process (a stop, the max
    runtime, the idle timeout); a job that ended on its own is never killed,
    whatever teardown or the sweep did afterwards. ``reason``: ``""`` or why
    it was killed (``"max_runtime"``, ``"idle_timeout"``, the stop reason).
    ``sweep``: what the sweep saw and did: a report, not an outcome.
    ``usage``: the job's cgroup accounting when it had one (``cpu_usec``,
    ``cpu_user_usec``, ``cpu_system_usec``, and ``memory_peak_bytes`` where
    the memory controller is enabled); empty without.
    """

    exit_code: int | None
    signal: int | None = None
    killed: bool = False
    reason: str = ""
    error: str | None = None
    sweep: SweepReport = NOT_SWEPT
    usage: Mapping[str, int] = attrs.field(factory=dict)


# -- the stop handle --------------------------------------------------------


class JobHandle:
    """Lets an owner stop a running job and still get its :class:`Result`.

    Create one, pass it as ``run_job(..., handle=h)``, and call
    ``h.stop(reason)`` from any Trio task: ``run_job`` then kills the job
    (SIGTERM, grace, SIGKILL) and returns ``killed=True, reason=reason``.
    ``stop`` is synchronous and idempotent (the first reason wins); after the
    job's main process has ended it does nothing. A stop before the job
    started means it is never started (``exit_code=None``, ``error`` says
    so). From another thread use ``trio.from_thread.run_sync(h.stop, ...)``.
    One handle serves one ``run_job`` call.

    Cancelling the scope around ``run_job`` instead (worker shutdown) also
    kills the job, shielded and bounded, but then ``Cancelled`` propagates and
    there is no Result: that is the difference between stopping a job and
    abandoning it.
    """

    def __init__(self) -> None:
        self._reason: str | None = None
        self._scope: trio.CancelScope | None = None
        self._claimed = False
        self._settled = False
        self.pid: int | None = None
        """The job's pid (and process group id) once it has started."""

    @property
    def stop_reason(self) -> str | None:
        """The reason given to the first effective :meth:`stop`, if any."""
        return self._reason

    def stop(self, reason: str = REASON_CANCELLED) -> None:
        if not reason:
            raise ValueError("a stop reason must be a non-empty string, e.g. 'cancelled'")
        if self._reason is not None or self._settled:
            return
        self._reason = reason
        if self._scope is not None:
            self._scope.cancel()

    def _claim(self) -> None:
        if self._claimed:
            raise RuntimeError("this JobHandle was already given to a run_job; make a new one")
        self._claimed = True

    def _bind(self, scope: trio.CancelScope, pid: int) -> None:
        self.pid = pid
        self._scope = scope
        if self._reason is not None:
            scope.cancel()

    def _settle(self) -> None:
        self._settled = True
        self._scope = None


# -- the Trio shell ---------------------------------------------------------


async def run_job(
    spec: JobSpec,
    sink: Sink,
    *,
    host: Host | None = None,
    handle: JobHandle | None = None,
) -> Result:
    """Run ``spec`` to the end and say how it ended; output goes to ``sink``.

    A job that cannot be started (command not found, bad cwd) is a Result
    with ``error`` set, never an exception. An exception raised by a sink or
    by the stdin iterable kills the job and propagates (in an
    ExceptionGroup); so does cancellation of the surrounding scope, after
    the process group has been killed and reaped (shielded, bounded by the
    grace ceiling). See :class:`JobHandle` to stop a job and keep its Result.
    """
    if not callable(sink):
        raise TypeError(f"sink must be an async callable taking bytes, got {sink!r}")
    host = host if host is not None else LinuxHost()
    handle = handle if handle is not None else JobHandle()
    handle._claim()
    if handle.stop_reason is not None:
        handle._settle()
        await trio.lowlevel.checkpoint()
        return Result(
            exit_code=None,
            reason=handle.stop_reason,
            error="stopped before it was started",
            sweep=NOTHING_STARTED if spec.sweep_job_id is not None else NOT_SWEPT,
        )
    # A lower bound of the job's start time, taken before it exists: the
    # sweep never inspects a process that started earlier (see sweep.candidate).
    since = host.boot_ticks() if spec.sweep_job_id is not None else None
    swept = NOTHING_STARTED if spec.sweep_job_id is not None else NOT_SWEPT
    path = spec.cgroup
    if path is None and host.containment is not None:
        path = host.containment.leaf()
    if path is not None:
        try:
            cgroups.create(host, path, spec.cgroup_limits)
        except OSError as exc:
            handle._settle()
            await trio.lowlevel.checkpoint()
            why = exc.strerror or str(exc)
            return Result(
                exit_code=None,
                error=f"cannot start {spec.command[0]!r}: cannot create its cgroup {path}: {why}",
                sweep=swept,
            )
    # Where pid allocation stood before the job existed: a sweep without a
    # cgroup then reads only the rows of pids handed out since (pid_window.py).
    mark = host.pid_mark() if spec.sweep_job_id is not None and path is None else None
    try:
        proc = await host.spawn(
            spec.command,
            cwd=spec.cwd,
            env=spec.env,
            stdin=spec.stdin is not None,
            separate_stderr=spec.stderr is not None,
            pty=spec.pty,
            **({} if spec.run_as is None else {"run_as": spec.run_as}),
            cgroup=path,
        )
    except OSError as exc:
        handle._settle()
        if path is not None:
            cgroups.remove(host, path)
        why = describe_spawn_error(exc, spec.command, spec.cwd, spec.env.get("PATH"))
        return Result(exit_code=None, error=why, sweep=swept)
    # No checkpoint between the spawn and the try/finally in run(): a
    # cancellation must not find a started process nobody will kill.
    return await _Supervisor(spec, sink, host, proc, handle, since, mark, path).run()


class _Supervisor:
    def __init__(
        self,
        spec: JobSpec,
        sink: Sink,
        host: Host,
        proc: HostProcess,
        handle: JobHandle,
        since: int | None,
        mark: PidMark | None,
        cgroup: str | None,
    ) -> None:
        self.spec = spec
        # What the sweep may skip: older start times, pids handed out before.
        self.since = since
        self.mark = mark
        self.cgroup = cgroup
        self.usage: dict[str, int] = {}
        self.sink = sink
        self.host = host
        self.proc = proc
        self.handle = handle
        self.pgid = proc.pid
        self.killed = False
        self.reason = ""
        self.sweep = NOT_SWEPT
        self.idle_scope = trio.CancelScope()
        self.open_outputs = 0
        self.output_done = trio.Event()
        self.cleaned_up = False

    async def run(self) -> Result:
        try:
            async with trio.open_nursery() as nursery:
                self._start_io(nursery)
                try:
                    await self._wait_main()
                finally:
                    await self._clean_up()
                with trio.move_on_after(DRAIN_SECONDS):
                    await self.output_done.wait()
                if not self.output_done.is_set():
                    log.warning(
                        "job %d: output still open %.1fs after the job and its survivors "
                        "were gone; stopped reading it",
                        self.pgid,
                        DRAIN_SECONDS,
                    )
                nursery.cancel_scope.cancel()
        finally:
            # Idempotent: normally done above, but no path out of here may
            # leave a started process behind.
            await self._clean_up()
            with trio.move_on_after(1.0, shield=True):
                await self._close_streams()
        return self._result()

    def _cleanup_budget(self) -> float:
        # A backstop only: each step below bounds itself.
        return 2 * self.spec.grace_ceiling + KILL_WAIT + SWEEP_KILL_WAIT + 5.0

    # -- while it runs --

    def _start_io(self, nursery: trio.Nursery) -> None:
        now = trio.current_time()
        if self.spec.idle_timeout is not None:
            self.idle_scope.deadline = now + self.spec.idle_timeout
        self.open_outputs = 1
        nursery.start_soon(self._pump, self.proc.stdout, self.sink)
        if self.proc.stderr is not None and self.spec.stderr is not None:
            self.open_outputs += 1
            nursery.start_soon(self._pump, self.proc.stderr, self.spec.stderr)
        if self.proc.stdin is not None and self.spec.stdin is not None:
            nursery.start_soon(self._feed, self.proc.stdin, self.spec.stdin)

    async def _wait_main(self) -> None:
        runtime = trio.CancelScope()
        if self.spec.max_runtime is not None:
            runtime.deadline = trio.current_time() + self.spec.max_runtime
        self.handle._bind(runtime, self.proc.pid)
        try:
            with runtime, self.idle_scope:
                await self.proc.wait()
        finally:
            self.handle._settle()
        if not (runtime.cancelled_caught or self.idle_scope.cancelled_caught):
            return
        if self.proc.returncode is not None:
            return  # it ended on its own at the same instant: not ours to claim
        self.killed = True
        if self.idle_scope.cancelled_caught:
            self.reason = REASON_IDLE_TIMEOUT
        elif self.handle.stop_reason is not None:
            self.reason = self.handle.stop_reason
        else:
            self.reason = REASON_MAX_RUNTIME

    def _output_seen(self) -> None:
        if self.spec.idle_timeout is not None:
            self.idle_scope.deadline = trio.current_time() + self.spec.idle_timeout

    async def _pump(self, stream: trio.abc.ReceiveStream, sink: Sink) -> None:
        try:
            while True:
                try:
                    chunk = await stream.receive_some(CHUNK_SIZE)
                except trio.BrokenResourceError:
                    # EIO from a PTY master once the terminal hung up: its EOF.
                    break
                if not chunk:
                    break
                self._output_seen()
                await sink(chunk if isinstance(chunk, bytes) else bytes(chunk))
                # Again after the sink: while it applied backpressure the job
                # was blocked writing, which is not the job being idle.
                self._output_seen()
        finally:
            self.open_outputs -= 1
            if self.open_outputs == 0:
                self.output_done.set()

    async def _feed(self, stream: trio.abc.SendStream, source: StdinSource) -> None:
        try:
            if isinstance(source, bytes):
                await stream.send_all(source)
            else:
                async for piece in source:
                    if not isinstance(piece, bytes | bytearray | memoryview):
                        raise TypeError(f"stdin iterable yielded {piece!r}; expected bytes")
                    await stream.send_all(piece)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            # The job exited or closed its input without reading it all:
            # its choice, not an error.
            pass
        finally:
            aclose = getattr(source, "aclose", None)
            if aclose is not None:
                with trio.move_on_after(1.0, shield=True):
                    await aclose()
            await stream.aclose()

    # -- after it ran --

    async def _clean_up(self) -> None:
        """Kill or tear down the group, then sweep: once, shielded, bounded."""
        if self.cleaned_up:
            return
        self.cleaned_up = True
        with trio.move_on_after(self._cleanup_budget(), shield=True):
            if self.proc.returncode is None and not self.killed:
                # Reached by an exception (an outer cancellation, a failing
                # sink) rather than a limit: the job is abandoned, still killed.
                self.killed = True
                self.reason = self.reason or REASON_CANCELLED
            await self._teardown()
            if self.cgroup is not None:
                # Exact: everything the job forked is in its cgroup, whatever
                # it did with its session, group or environment.
                self.sweep = await cgroups.sweep_cgroup(
                    self.host, self.cgroup, grace=self.spec.grace_ceiling
                )
                self.usage = cgroups.usage(self.host, self.cgroup)
                if self.sweep.clean:
                    cgroups.remove(self.host, self.cgroup)
            elif self.spec.sweep_job_id is not None:
                self.sweep = await sweep_job_survivors(
                    self.spec.sweep_job_id,
                    grace=self.spec.grace_ceiling,
                    host=self.host,
                    since=self.since,
                    mark=self.mark,
                )

    def _signal(self, sig: int) -> bool:
        delivered = self.host.signal_group(self.pgid, sig)
        if self.proc.returncode is None:
            # Only while unreaped is the pid certainly still ours; it may
            # also have left its group with setpgid(2).
            delivered = self.host.signal_pid(self.proc.pid, sig) or delivered
        return delivered

    async def _teardown(self) -> None:
        """SIGTERM the group (and the main process if alive), grace, SIGKILL, reap."""
        if not self._signal(signal.SIGTERM):
            await trio.lowlevel.checkpoint()
            return  # the usual case: nothing of the group is left
        with trio.move_on_after(self.spec.grace_ceiling):
            await self._all_gone()
            return
        self._signal(signal.SIGKILL)
        with trio.move_on_after(KILL_WAIT):
            await self._all_gone()

    async def _all_gone(self) -> None:
        if self.proc.returncode is None:
            await self.proc.wait()
        # Group members are not our children, so nothing notifies us when
        # they exit: a backing-off poll, always under a caller's deadline.
        delay = 0.002
        while self._group_alive():
            await trio.sleep(delay)
            delay = min(delay * 2, _POLL_MAX)

    def _group_alive(self) -> bool:
        if not self.host.signal_group(self.pgid, 0):
            return False
        # Zombies still count as members for kill(2) until someone reaps
        # them (and an init that never reaps is not unheard of): look.
        try:
            table = self.host.processes()
        except OSError:
            return True
        return any(p.pgid == self.pgid and p.alive for p in table)

    async def _close_streams(self) -> None:
        for stream in (self.proc.stdin, self.proc.stdout, self.proc.stderr):
            if stream is not None:
                await stream.aclose()

    def _result(self) -> Result:
        returncode = self.proc.returncode
        if returncode is None:
            log.error("job %d did not exit after SIGKILL; it may be stuck in the kernel", self.pgid)
            return Result(
                exit_code=None,
                killed=self.killed,
                reason=self.reason,
                error=f"process {self.proc.pid} did not exit after SIGKILL (stuck in the kernel?)",
                sweep=self.sweep,
                usage=self.usage,
            )
        exit_code, sig = exit_status(returncode)
        return Result(
            exit_code=exit_code,
            signal=sig,
            killed=self.killed,
            reason=self.reason,
            sweep=self.sweep,
            usage=self.usage,
        )
