"""One ``rc serve`` per state directory (real processes).

Two controllers on one SQLite database each handed out the same job ids and event
numbers from their own memory and overwrote each other's records: an acknowledged
submit was lost. The second is now refused in one line naming the first's pid; the lock
goes with the process that held it, SIGKILL included.
"""

from __future__ import annotations

from pathlib import Path

import httpx
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
