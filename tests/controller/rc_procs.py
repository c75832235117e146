"""Real ``rc`` processes for tests: ``rc serve``, client commands, a connection-dropping proxy."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import attrs
import trio
from hypercorn.trio import serve as hypercorn_serve

from rc_worker.changed import Changed
from rc_worker.controller.serve import hypercorn_config
from rc_worker.controller.standby import standby_app

from .helpers import wait_listening

RC = str(Path(sys.executable).parent / "rc")
USER = "ut"
WORKER = "wt"


def rc_env(url: str) -> dict[str, str]:
    return {**os.environ, "RC_URL": url, "RC_USER_TOKEN": USER}


@attrs.define
class Served:
    proc: trio.Process
    url: str
    port: int


@asynccontextmanager
async def rc_serve(
    listen: str = "127.0.0.1:0", store: Sequence[str] = ("--memory",)
) -> AsyncIterator[Served]:
    """A real ``rc serve`` process (worker token ``wt`` for box1, user token ``ut``), keeping
    its state in memory only unless ``store`` says otherwise: a restart forgets everything."""
    proc = await trio.lowlevel.open_process(
        [
            RC,
            "serve",
            "--listen",
            listen,
            "--user-token",
            f"{USER}=ops:admin",
            "--worker-token",
            f"{WORKER}=box1",
            *store,
        ],
        stderr=subprocess.PIPE,
    )
    try:
        with trio.fail_after(30):
            url = await wait_listening(proc)
        yield Served(proc, url, int(url.rsplit(":", 1)[1]))
    finally:
        await stop(proc)


async def stop(proc: trio.Process) -> None:
    if proc.returncode is None:
        proc.send_signal(signal.SIGKILL)
    with trio.move_on_after(10, shield=True):
        await proc.wait()


class Reader:
    """Collects a process's pipe in the background; ``until`` waits for some bytes."""

    def __init__(self, stream: trio.abc.ReceiveStream) -> None:
        self.stream = stream
        self.data = b""
        self._changed = Changed()

    async def run(self) -> None:
        while chunk := await self.stream.receive_some(65536):
            self.data += chunk
            self._changed.notify()
        self._changed.notify()

    async def until(self, needle: bytes) -> None:
        while needle not in self.data:
            await self._changed.wait()


@asynccontextmanager
async def rc_client(
    argv: Sequence[str], url: str
) -> AsyncIterator[tuple[trio.Process, Reader, Reader]]:
    """A real ``rc`` client process with its stdout and stderr collected as it runs."""
    proc = await trio.lowlevel.open_process(
        [RC, *argv],
        env=rc_env(url),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        stdin=subprocess.DEVNULL,
    )
    assert proc.stdout is not None
    assert proc.stderr is not None
    out, err = Reader(proc.stdout), Reader(proc.stderr)
    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(out.run)
            nursery.start_soon(err.run)
            yield proc, out, err
            with trio.fail_after(60):
                await proc.wait()
    finally:
        await stop(proc)


class DroppingProxy:
    """A TCP proxy to ``target`` that can cut every connection and refuse new ones."""

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self.down = False
        self.accepted = 0
        self.retried = trio.Event()
        """Set once two connections were refused while down (a client retried twice)."""
        self._refused = 0
        self._scopes: set[trio.CancelScope] = set()

    async def serve(self, task_status: trio.TaskStatus[str] = trio.TASK_STATUS_IGNORED) -> None:
        listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
        port = listeners[0].socket.getsockname()[1]
        task_status.started(f"http://127.0.0.1:{port}")
        await trio.serve_listeners(self._handle, listeners)

    def drop(self) -> None:
        """Cut every open connection, and close each new one at once until :meth:`restore`."""
        self.down = True
        for scope in self._scopes:
            scope.cancel()

    def restore(self) -> None:
        self.down = False

    async def _handle(self, client: trio.SocketStream) -> None:
        async with client:
            self.accepted += 1
            if self.down:
                self._refused += 1
                if self._refused >= 2:
                    self.retried.set()
                return
            upstream = await trio.open_tcp_stream("127.0.0.1", self.target_port)
            async with upstream:
                with trio.CancelScope() as scope:
                    self._scopes.add(scope)
                    try:
                        async with trio.open_nursery() as nursery:
                            nursery.start_soon(_pipe, client, upstream)
                            nursery.start_soon(_pipe, upstream, client)
                    finally:
                        self._scopes.discard(scope)


async def _pipe(src: trio.SocketStream, dst: trio.SocketStream) -> None:
    try:
        while data := await src.receive_some(65536):
            await dst.send_all(data)
        await dst.send_eof()
    except (trio.BrokenResourceError, trio.ClosedResourceError):
        pass


class Standby:
    """A standby controller's listener (:func:`standby_app`: every request ``503 standby``
    with ``Retry-After``), counting the requests it answered."""

    def __init__(self) -> None:
        self.answered = 0
        self._changed = Changed()
        self._app = standby_app()

    async def serve(self, task_status: trio.TaskStatus[str] = trio.TASK_STATUS_IGNORED) -> None:
        """Serve on a free port of 127.0.0.1; reports its URL once it listens."""

        async def counted(scope: Any, receive: Any, send: Any) -> None:
            if scope["type"] == "http":
                self.answered += 1
                self._changed.notify()
            await self._app(scope, receive, send)

        async with trio.open_nursery() as nursery:
            binds: list[str] = await nursery.start(
                lambda task_status: hypercorn_serve(
                    counted, hypercorn_config("127.0.0.1:0"), task_status=task_status
                )
            )
            task_status.started(binds[0])

    async def until(self, answered: int) -> None:
        """Wait until it has answered ``answered`` requests in all."""
        while self.answered < answered:
            await self._changed.wait()
