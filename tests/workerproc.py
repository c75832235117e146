"""Helpers for tests that run ``rc-worker run`` as a real process.

The reference controller is served on 127.0.0.1 (port 0) in the test's own
nursery; the worker is a real subprocess talking HTTP to it. Its stderr is
collected as it comes, so a test can wait for a line and read them all.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from collections.abc import AsyncIterator, Callable, Mapping
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import trio

from rc_worker.changed import Changed
from rc_worker.controller import create_app
from rc_worker.controller.serve import serve
from rc_worker.controller.store import Store

RC_WORKER = str(Path(sys.executable).parent / "rc-worker")
TOKEN = "worker-token-5ec4e7"


def write_config(tmp_path: Path, url: str, *, host: str = "op-host", extra: str = "") -> Path:
    config = tmp_path / "worker.yaml"
    config.write_text(
        f"controller_url: {url}\n"
        f"host: {host}\n"
        "devices: [gpu0]\n"
        f"state_dir: {tmp_path / 'state'}\n"
        f"probe_dir: {tmp_path / 'probe.d'}\n"
        f"verify_dir: {tmp_path / 'verify.d'}\n"
        f"sheet_dir: {tmp_path / 'sheets'}\n"
        "heartbeat_interval: 0.5s\n"
        "poll_wait: 2s\n" + extra
    )
    return config


async def serve_controller(
    nursery: trio.Nursery, store: Store, tokens: Mapping[str, str], listen: str = "127.0.0.1:0"
) -> str:
    """Serve the reference controller over ``store``; returns its URL."""
    app = create_app(store=store, worker_tokens=dict(tokens), user_tokens=[])
    binds: list[str] = await nursery.start(serve, app, listen)
    return binds[0]


class WorkerProcess:
    """A running ``rc-worker run`` and what it has written to stderr so far."""

    def __init__(self, proc: trio.Process) -> None:
        self.proc = proc
        self.stderr = b""
        self._changed = Changed()
        self.eof = False

    @property
    def lines(self) -> list[str]:
        return self.stderr.decode(errors="replace").splitlines()

    async def pump(self) -> None:
        assert self.proc.stderr is not None
        while True:
            chunk = await self.proc.stderr.receive_some(65536)
            if not chunk:
                self.eof = True
                self._changed.notify()
                return
            self.stderr += chunk
            self._changed.notify()

    async def wait_for_line(self, predicate: Callable[[str], bool]) -> str:
        while True:
            for line in self.lines:
                if predicate(line):
                    return line
            if self.eof:
                raise AssertionError(f"the worker exited without such a line:\n{self.stderr!r}")
            await self._changed.wait()

    async def wait(self) -> int:
        code = await self.proc.wait()
        while not self.eof:
            await self._changed.wait()
        return code


@asynccontextmanager
async def worker_process(
    config: Path, *, env: Mapping[str, str] | None = None, args: tuple[str, ...] = ()
) -> AsyncIterator[WorkerProcess]:
    environ: dict[str, Any] = {
        k: v for k, v in os.environ.items() if k not in ("NOTIFY_SOCKET", "WATCHDOG_USEC")
    }
    environ.update({"RC_TOKEN": TOKEN, **(env or {})})
    proc = await trio.lowlevel.open_process(
        [RC_WORKER, "run", "--config", str(config), *args],
        env=environ,
        stdin=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    running = WorkerProcess(proc)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(running.pump)
        try:
            yield running
        finally:
            # Stop it the way an operator would; its jobs die with it.
            with trio.CancelScope(shield=True):
                if proc.returncode is None:
                    proc.send_signal(signal.SIGQUIT)
                    with trio.move_on_after(15):
                        await proc.wait()
                    if proc.returncode is None:
                        proc.kill()
                        await proc.wait()
                with trio.move_on_after(5):
                    await running.wait()
            nursery.cancel_scope.cancel()


async def wait_store(store: Store, predicate: Callable[[], bool]) -> None:
    """Wait until ``predicate()`` holds, re-checked at every change of the store."""
    while not predicate():
        changed = trio.Event()
        unsubscribe = store.subscribe(changed.set)
        try:
            await changed.wait()
        finally:
            unsubscribe()


def no_traceback(text: str) -> None:
    assert "Traceback" not in text, text
    assert "sub-exception" not in text, text
    assert "ExceptionGroup" not in text, text


def free_port() -> int:
    """A port nothing listens on now (the caller binds it soon after)."""
    with socket.socket() as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


class Outage:
    """A controller that can go away and come back on the same port, with the same store."""

    def __init__(self, store: Store, tokens: Mapping[str, str], port: int) -> None:
        self.app = create_app(store=store, worker_tokens=dict(tokens), user_tokens=[])
        self.port = port
        self.url = f"http://127.0.0.1:{port}"
        self._scope: trio.CancelScope | None = None
        self._done = trio.Event()

    async def up(self, nursery: trio.Nursery) -> None:
        await nursery.start(self._serve)

    async def _serve(
        self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
    ) -> None:
        self._done = trio.Event()
        try:
            with trio.CancelScope() as self._scope:
                async with trio.open_nursery() as inner:
                    await inner.start(serve, self.app, f"127.0.0.1:{self.port}")
                    task_status.started()
        finally:
            self._done.set()

    async def down(self) -> None:
        """Stop serving; returns once the listening socket is closed."""
        assert self._scope is not None
        self._scope.cancel()
        await self._done.wait()
