"""Simulated processes: one row of the process table, and what the worker holds of it
(the handle ``spawn`` returns, a pidfd pin)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

import attrs
import trio

from rc_worker.host import ProcessInfo
from rc_worker.testing.sim_pipe import SimPipe, _PipeReader, _PipeWriter
from rc_worker.testing.sim_script import OnSigterm, Script

if TYPE_CHECKING:
    from rc_worker.testing.sim import SimHost

__all__ = ["SimProcess"]


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
