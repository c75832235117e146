"""A job's output file removed under a running SQLite controller, with a real worker.

The worker (real processes, the real clock, its spool on disk) ships the first part of a
job's output; the controller's file for it is then removed, as a tmpfiles clean-up or an
operator's ``rm`` would; the job writes the rest. The controller counts what the file
holds when that output arrives, answers the worker with it, and the worker resends from
its spool: the job's output ends whole, every byte once, and the controller never stops
answering the rest of the fleet (before, every commit failed until the file came back).
"""

from __future__ import annotations

from pathlib import Path

import httpx
import trio

from rc_worker.controller.persist.sqlite import OUTPUT_DIR
from rc_worker.testing import make_config, wait_until
from rc_worker.worker import Worker

from .helpers import WORKER_TOKEN
from .persistkit import StorePlace, clients, open_controller

GUARD = 60


async def test_a_real_worker_resends_what_a_removed_output_file_lost(tmp_path: Path) -> None:
    place = StorePlace("sqlite", state_dir=tmp_path / "controller")
    opened = open_controller(place.open())
    go = tmp_path / "go"
    script = f"printf 0123456789; while [ ! -e {go} ]; do sleep 0.02; done; printf abc"
    config = make_config(tmp_path / "worker", host="box1", token=WORKER_TOKEN)
    try:
        with trio.fail_after(GUARD):
            async with (
                clients(opened.app) as (_, user),
                httpx.AsyncClient(
                    transport=httpx.ASGITransport(app=opened.app), base_url="http://controller"
                ) as http,
                trio.open_nursery() as nursery,
            ):
                worker = Worker(config, http=http)
                await nursery.start(worker.run)
                r = await user.post("/v1/jobs", json={"command": ["sh", "-c", script]})
                assert r.status_code == 200, r.text
                job = r.json()["job_id"]

                def committed_10() -> bool:
                    return opened.store.job(job).committed_bytes == 10

                def succeeded() -> bool:
                    info = opened.store.job(job)
                    assert info.state in ("assigned", "running", "succeeded"), info
                    return info.state == "succeeded"

                await wait_until(opened.store, committed_10)
                await opened.durability.flush()  # those 10 bytes are in the file
                path = place.state_dir / OUTPUT_DIR / job  # type: ignore[operator]
                path.unlink()
                go.touch()
                await wait_until(opened.store, succeeded)
                await opened.durability.flush()
                assert (await user.get(f"/v1/jobs/{job}/output")).content == b"0123456789abc"
                assert path.read_bytes() == b"0123456789abc"
                events = (await user.get("/v1/events")).json()["events"]
                [recount] = [e for e in events if e["type"] == "job_output_recounted"]
                assert (recount["job_id"], recount["counted"]) == (job, 0)
                assert (await user.get("/v1/health")).json()["store"] == "ok"
                worker.drain()
    finally:
        opened.backend.close()
