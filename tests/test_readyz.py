"""/healthz (liveness) and /readyz (readiness) of a real worker through register, outage, drain."""

from __future__ import annotations

import signal
from pathlib import Path

import httpx
import trio
from workerproc import TOKEN, Outage, free_port, wait_store, worker_process, write_config

from rc_worker.controller.store import Store, StoreConfig


async def _until(http: httpx.AsyncClient, status: int, text: str) -> str:
    """Poll /readyz until it answers ``status`` with ``text`` (the caller bounds it)."""
    while True:
        try:
            answer = await http.get("/readyz")
        except httpx.TransportError:
            answer = None
        if answer is not None and answer.status_code == status and text in answer.text:
            return answer.text
        await trio.sleep(0.1)


async def test_readyz_through_register_outage_and_drain(tmp_path: Path) -> None:
    store = Store(StoreConfig(heartbeat_interval_s=0.5, poll_wait_s=1.0))
    controller = Outage(store, {TOKEN: "op-host"}, free_port())
    status_port = free_port()
    config = write_config(
        tmp_path, controller.url, extra=f"status_listen: 127.0.0.1:{status_port}\n"
    )
    with trio.fail_after(90):
        async with (
            trio.open_nursery() as nursery,
            worker_process(config) as w,
            httpx.AsyncClient(base_url=f"http://127.0.0.1:{status_port}") as http,
        ):
            # No controller yet: alive, not ready.
            text = await _until(http, 503, "not registered")
            assert (await http.get("/healthz")).status_code == 200
            await controller.up(nursery)
            await _until(http, 200, "ready")
            # The controller goes away: still alive, not ready, and it says why.
            await controller.down()
            text = await _until(http, 503, "the controller has not answered")
            assert "three heartbeat intervals" in text
            assert (await http.get("/healthz")).status_code == 200
            await controller.up(nursery)
            await _until(http, 200, "ready")
            # Draining: not ready for new work while the running job finishes.
            job_id = store.submit(["sh", "-c", "echo a; exec sleep 30"], grace_s=1)
            await wait_store(store, lambda: store.output(job_id) == b"a\n")
            w.proc.send_signal(signal.SIGTERM)
            await _until(http, 503, "draining")
            assert (await http.get("/healthz")).status_code == 200
            w.proc.send_signal(signal.SIGTERM)
            assert await w.wait() == 0
            nursery.cancel_scope.cancel()
