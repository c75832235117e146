"""Dispatch never waits for a heartbeat: every transition that makes a device
offerable wakes the poll loop (the lost wake-up of the hot-path issue).

The heartbeat is an hour here: a single lost wake-up then leaves a job queued
until the test's guard fails it, however loaded the machine. No timing is
asserted: 20 back-to-back jobs either all run, or the guard fires.
"""

from __future__ import annotations

from pathlib import Path

import trio

from rc_worker.testing import local_system, make_config

HOUR = 3600.0


async def test_back_to_back_jobs_on_one_device_do_not_wait_for_heartbeats(
    tmp_path: Path,
) -> None:
    config = make_config(tmp_path, heartbeat_interval=HOUR, poll_wait=HOUR)
    with trio.fail_after(60):
        async with local_system(config) as system:
            ids = [system.submit(["true"]) for _ in range(20)]
            for job_id in ids:
                info = await system.wait_job(job_id)
                assert info.state == "succeeded", info
