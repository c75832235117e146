"""Cancels reach the job through the long poll (``watch_cancels``), not the next heartbeat."""

from __future__ import annotations

from pathlib import Path

import httpx
import trio
from faults import FaultyTransport

from rc_worker.testing import local_system, make_config

# So long that no heartbeat is sent while a test runs: a cancel that arrives
# came through the watch.
NO_HEARTBEAT = 3600.0


async def test_a_cancel_reaches_a_running_job_without_a_heartbeat(tmp_path: Path) -> None:
    config = make_config(tmp_path, heartbeat_interval=NO_HEARTBEAT, poll_wait=30.0)
    with trio.fail_after(30):
        async with local_system(config) as system:
            job_id = system.submit(["sh", "-c", "echo a; exec sleep 60"], grace_s=1)
            await system.wait_until(lambda: system.output(job_id) == b"a\n")
            system.store.cancel(job_id, "stop it")
            info = await system.wait_job(job_id)
    assert info.state == "killed"
    assert "stop it" in (info.reason or "")


async def test_a_job_that_ended_before_its_cancel_keeps_its_own_outcome(tmp_path: Path) -> None:
    config = make_config(tmp_path, heartbeat_interval=NO_HEARTBEAT, poll_wait=30.0)
    faults: list[FaultyTransport] = []

    def wrap(inner: httpx.AsyncBaseTransport) -> FaultyTransport:
        faults.append(FaultyTransport(inner))
        faults[0].outage("finish")
        return faults[0]

    with trio.fail_after(30):
        async with local_system(config, transport_wrapper=wrap) as system:
            t = faults[0]
            job_id = system.submit(["sh", "-c", "echo a; exit 3"])
            # The job has exited and its finish is held back: the controller
            # still thinks it runs when the user cancels it.
            await t.wait_until(lambda: len(t.exchanges("finish")) > 0)
            before = len(t.log)
            system.store.cancel(job_id, "too late")
            # A watch answered after the cancel carries it (the job is live
            # at the controller until its finish lands).
            await t.wait_until(
                lambda: any(
                    e.endpoint == "poll" and '"watch_cancels"' in e.body and e.status == 200
                    for e in t.log[before:]
                )
            )
            assert system.worker.devices["gpu0"].lease.job == (job_id, 1)
            t.restore("finish")
            info = await system.wait_job(job_id)
    assert info.state == "failed"
    assert info.exit_code == 3
