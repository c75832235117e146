"""``rc serve`` closes a keep-alive connection as soon as its client has (issue 12).

hypercorn kept each such socket in CLOSE-WAIT until its keep-alive timer
(75 s) fired, so bursts of short-lived clients piled them up.
"""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

import trio

from .helpers import wait_listening

RC = str(Path(sys.executable).parent / "rc")
CLOSE_WAIT = "08"


def _close_wait_count(port: int) -> int:
    count = 0
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            local_port = int(fields[1].rsplit(":", 1)[1], 16)
            if local_port == port and fields[3] == CLOSE_WAIT:
                count += 1
    return count


def _burst(port: int, n: int) -> None:
    socks = [socket.create_connection(("127.0.0.1", port)) for _ in range(n)]
    try:
        for s in socks:
            s.sendall(b"GET /v1/health HTTP/1.1\r\nHost: rc\r\n\r\n")
        for s in socks:
            s.settimeout(10)
            assert b"200" in s.recv(4096).split(b"\r\n", 1)[0]
    finally:
        for s in socks:
            s.close()


async def test_idle_keep_alive_connections_are_closed_when_the_client_goes() -> None:
    proc = await trio.lowlevel.open_process(
        [
            RC,
            "serve",
            "--listen",
            "127.0.0.1:0",
            "--user-token",
            "u",
            "--worker-token",
            "w",
            "--memory",
        ],
        stderr=subprocess.PIPE,
    )
    try:
        with trio.fail_after(30):
            port = int((await wait_listening(proc)).rsplit(":", 1)[1])
            await trio.to_thread.run_sync(_burst, port, 64)
            # The server must close its ends once the clients have closed theirs; with the
            # bug they stayed in CLOSE-WAIT for the 75 s keep-alive timer, past this guard.
            for _ in range(400):  # bounded: at most about 20 s, far below 75 s
                if _close_wait_count(port) == 0:
                    break
                await trio.sleep(0.05)
            assert _close_wait_count(port) == 0
            await trio.to_thread.run_sync(_burst, port, 8)  # and it still serves
    finally:
        proc.terminate()
        with trio.move_on_after(10):
            await proc.wait()
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
