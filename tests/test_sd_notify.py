"""systemd's Type=notify: what a real worker sends to the socket in ``$NOTIFY_SOCKET``."""

from __future__ import annotations

import signal
import socket
import uuid
from pathlib import Path

import trio
from workerproc import TOKEN, serve_controller, wait_store, worker_process, write_config

from rc_worker.controller.store import Store, StoreConfig
from rc_worker.sd_notify import Notifier, status_line


def test_status_line_counts_devices_by_state() -> None:
    assert status_line({"free": 2, "running": 1}) == "STATUS=3 devices: 2 free, 1 running"
    assert status_line({"free": 1, "running": 0}) == "STATUS=1 device: 1 free"


def test_without_notify_socket_nothing_is_sent() -> None:
    notifier = Notifier({})
    assert not notifier.enabled
    notifier.notify("READY=1")  # a no-op, not an error


def test_the_watchdog_interval_is_half_of_watchdog_usec_for_this_process() -> None:
    env = {"NOTIFY_SOCKET": "/run/x", "WATCHDOG_USEC": "3000000"}
    assert Notifier(env).watchdog_interval == 1.5
    assert Notifier({**env, "WATCHDOG_PID": "1"}).watchdog_interval is None
    assert Notifier({"NOTIFY_SOCKET": "/run/x"}).watchdog_interval is None


class _Socket:
    def __init__(self, sock: trio.socket.SocketType) -> None:
        self.sock = sock
        self.messages: list[str] = []

    async def until(self, wanted: str) -> list[str]:
        """Receive until a message holds the line ``wanted``; returns that message's lines."""
        while True:
            data = await self.sock.recv(4096)
            lines = data.decode().split("\n")
            self.messages.append(data.decode())
            if wanted in lines or any(line.startswith(wanted) for line in lines):
                return lines


async def test_a_real_worker_notifies_ready_status_watchdog_and_stopping(tmp_path: Path) -> None:
    name = f"@rc-test-notify-{uuid.uuid4().hex}"
    sock = trio.socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    await sock.bind("\0" + name[1:])
    store = Store(StoreConfig(heartbeat_interval_s=0.5, poll_wait_s=2.0))
    env = {"NOTIFY_SOCKET": name, "WATCHDOG_USEC": "400000"}
    with sock, trio.fail_after(60):
        notify = _Socket(sock)
        async with trio.open_nursery() as nursery:
            url = await serve_controller(nursery, store, {TOKEN: "op-host"})
            config = write_config(tmp_path, url)
            async with worker_process(config, env=env) as w:
                registering = await notify.until("STATUS=registering")
                assert registering == [f"STATUS=registering with the controller at {url}"]
                ready = await notify.until("READY=1")
                assert "STATUS=1 device: 1 free" in ready
                assert any(d.host == "op-host" for d in store.devices())
                job_id = store.submit(["sh", "-c", "echo a; exec sleep 30"], grace_s=1)
                await wait_store(store, lambda: store.output(job_id) == b"a\n")
                assert "STATUS=1 device: 1 running" in await notify.until("STATUS=1 device: 1 r")
                await notify.until("WATCHDOG=1")
                w.proc.send_signal(signal.SIGTERM)
                await notify.until("STOPPING=1")
                w.proc.send_signal(signal.SIGTERM)
                assert await w.wait() == 0
            nursery.cancel_scope.cancel()
    # READY comes once, and only after the register.
    assert sum("READY=1" in m.split("\n") for m in notify.messages) == 1
