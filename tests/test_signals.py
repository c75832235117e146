"""``rc-worker run`` as a real process: SIGTERM drains, a second one or SIGQUIT stops jobs.

The reference controller is served on 127.0.0.1 (port 0) in the test's own
nursery; the worker is a real subprocess talking HTTP to it.
"""

from __future__ import annotations

import os
import signal
import sys
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path

import attrs
import trio

from rc_worker.controller import create_app
from rc_worker.controller.serve import serve
from rc_worker.controller.store import Store, StoreConfig

RC_WORKER = str(Path(sys.executable).parent / "rc-worker")
TOKEN = "signal-test-token"


@attrs.define
class Running:
    store: Store
    proc: trio.Process


@asynccontextmanager
async def worker_process(tmp_path: Path) -> AsyncIterator[Running]:
    store = Store(StoreConfig(heartbeat_interval_s=0.5, poll_wait_s=2.0))
    app = create_app(store=store, worker_tokens={TOKEN: "sig-host"})
    async with trio.open_nursery() as nursery:
        binds = await nursery.start(serve, app, "127.0.0.1:0")
        config = tmp_path / "worker.yaml"
        config.write_text(
            f"controller_url: {binds[0]}\n"
            "host: sig-host\n"
            "devices: [gpu0]\n"
            f"state_dir: {tmp_path / 'state'}\n"
            f"probe_dir: {tmp_path / 'probe.d'}\n"
            f"verify_dir: {tmp_path / 'verify.d'}\n"
            f"sheet_dir: {tmp_path / 'sheets'}\n"
            "heartbeat_interval: 0.5s\n"
            "poll_wait: 2s\n"
        )
        env = {**os.environ, "RC_TOKEN": TOKEN}
        proc = await trio.lowlevel.open_process(
            [RC_WORKER, "run", "--config", str(config)], env=env
        )
        try:
            await _wait(store, lambda: any(d.host == "sig-host" for d in store.devices()))
            yield Running(store, proc)
        finally:
            # Stop it the way an operator would; its jobs die with it.
            if proc.returncode is None:
                proc.send_signal(signal.SIGQUIT)
                with trio.move_on_after(15):
                    await proc.wait()
                if proc.returncode is None:
                    proc.kill()
                    await proc.wait()
            nursery.cancel_scope.cancel()


async def _wait(store: Store, predicate: Callable[[], bool]) -> None:
    """Wait until ``predicate()`` holds, re-checked at every change of the store."""
    while not predicate():
        changed = trio.Event()
        unsubscribe = store.subscribe(changed.set)
        try:
            await changed.wait()
        finally:
            unsubscribe()


async def test_first_sigterm_drains_a_running_job_to_success(tmp_path: Path) -> None:
    with trio.fail_after(60):
        async with worker_process(tmp_path) as w:
            job_id = w.store.submit(["sh", "-c", "echo a; sleep 1.5; echo b"])
            await _wait(w.store, lambda: w.store.output(job_id) == b"a\n")
            w.proc.send_signal(signal.SIGTERM)
            assert await w.proc.wait() == 0
            info = w.store.job(job_id)
            assert info.state == "succeeded"
            assert w.store.output(job_id) == b"a\nb\n"


async def test_second_sigterm_stops_the_running_job(tmp_path: Path) -> None:
    with trio.fail_after(60):
        async with worker_process(tmp_path) as w:
            job_id = w.store.submit(["sh", "-c", "echo a; exec sleep 60"], grace_s=1)
            await _wait(w.store, lambda: w.store.output(job_id) == b"a\n")
            w.proc.send_signal(signal.SIGTERM)
            await trio.sleep(0.5)
            assert w.proc.returncode is None  # draining: the job keeps running
            w.proc.send_signal(signal.SIGTERM)
            assert await w.proc.wait() == 0
            info = w.store.job(job_id)
            assert info.state == "killed"
            assert "shutting down" in info.reason


async def test_sigquit_stops_at_once(tmp_path: Path) -> None:
    with trio.fail_after(60):
        async with worker_process(tmp_path) as w:
            job_id = w.store.submit(["sh", "-c", "echo a; exec sleep 60"], grace_s=1)
            await _wait(w.store, lambda: w.store.output(job_id) == b"a\n")
            w.proc.send_signal(signal.SIGQUIT)
            assert await w.proc.wait() == 0
            assert w.store.job(job_id).state == "killed"


async def test_sighup_reprobes_and_rereads_the_sheets(tmp_path: Path) -> None:
    sheets = tmp_path / "sheets"
    sheets.mkdir()
    (sheets / "host.md").write_text("# before\n")
    with trio.fail_after(60):
        async with worker_process(tmp_path) as w:
            assert w.store.sheet("sig-host", "gpu0").host_sheet == "# before\n"
            (sheets / "host.md").write_text("# after\n")
            w.proc.send_signal(signal.SIGHUP)
            await _wait(
                w.store, lambda: w.store.sheet("sig-host", "gpu0").host_sheet == "# after\n"
            )
            assert w.proc.returncode is None
