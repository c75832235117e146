"""``rc serve`` refusing to start, in one line (real processes).

One ``rc serve`` per state directory: two controllers on one SQLite database each
handed out the same job ids and event numbers from their own memory and overwrote each
other's records: an acknowledged submit was lost. The second is now refused in one
line naming the first's pid; the lock goes with the process that held it, SIGKILL
included. An address in use is one line too.
"""

from __future__ import annotations

import socket
from pathlib import Path

import httpx
import pytest
import trio

from .rc_procs import RC, USER, WORKER, rc_serve

GUARD = 60


async def test_a_second_rc_serve_on_one_state_dir_is_refused_in_one_line(tmp_path: Path) -> None:
    store = ("--state-dir", str(tmp_path / "state"))
    with trio.fail_after(GUARD):
        async with rc_serve(store=store) as first:
            second = await trio.run_process(
                [
                    RC,
                    "serve",
                    "--listen",
                    "127.0.0.1:0",
                    "--user-token",
                    USER,
                    "--worker-token",
                    WORKER,
                    *store,
                ],
                check=False,
                capture_stdout=True,
                capture_stderr=True,
            )
            err = second.stderr.decode()
            assert second.returncode == 2, err
            assert err.count("\n") == 1, err
            assert f"is in use by another rc serve (pid {first.proc.pid})" in err
            assert "Traceback" not in err
            async with httpx.AsyncClient(base_url=first.url) as c:
                assert (await c.get("/v1/health")).status_code == 200  # the first serves on
        # rc_serve ended the first with SIGKILL: its lock went with it.
        async with rc_serve(store=store) as again, httpx.AsyncClient(base_url=again.url) as c:
            assert (await c.get("/v1/health")).status_code == 200


async def test_an_address_in_use_is_one_line_and_status_1(tmp_path: Path) -> None:
    """Not hypercorn's bind error in three nested exception groups; the store is not even
    opened (no lock file, no database)."""
    state = tmp_path / "state"
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        listen = f"127.0.0.1:{held.getsockname()[1]}"
        with trio.fail_after(GUARD):
            done = await trio.run_process(
                [
                    RC,
                    "serve",
                    "--listen",
                    listen,
                    "--user-token",
                    USER,
                    "--worker-token",
                    WORKER,
                    "--state-dir",
                    str(state),
                ],
                check=False,
                capture_stdout=True,
                capture_stderr=True,
            )
    err = done.stderr.decode()
    assert done.returncode == 1, err
    assert err == (
        f"rc: rc serve: cannot listen on {listen} (Address already in use); stop what holds it,"
        " or choose another --listen\n"
    )
    assert not state.exists()


@pytest.mark.parametrize("listen", ["127.0.0.1:99999", "127.0.0.1:http", ":8080"])
async def test_a_listen_address_that_is_not_one_is_one_line_and_status_2(
    tmp_path: Path, listen: str
) -> None:
    state = tmp_path / "state"
    with trio.fail_after(GUARD):
        done = await trio.run_process(
            [
                *(RC, "serve", "--listen", listen),
                *("--user-token", USER, "--worker-token", WORKER, "--state-dir", str(state)),
            ],
            check=False,
            capture_stdout=True,
            capture_stderr=True,
        )
    err = done.stderr.decode()
    assert done.returncode == 2, err
    assert err == (f"rc: rc serve: --listen {listen!r} is not HOST:PORT (a port of 0 to 65535)\n")
    assert not state.exists()
