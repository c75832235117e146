"""Dispatch never waits for a heartbeat: every transition that makes a device
offerable wakes the poll loop (the lost wake-up of the hot-path issue).

With the default heartbeat interval (10 s), a lost wake-up costs a job up to
a heartbeat; 20 back-to-back jobs would then take about 100 s. The bound
below is one a lost wake-up breaks by a wide margin and a working worker
meets with room to spare on a loaded 2-core machine.
"""

from __future__ import annotations

from pathlib import Path

import trio

from rc_worker.config import DEFAULT_HEARTBEAT_INTERVAL, DEFAULT_POLL_WAIT
from rc_worker.testing import local_system, make_config


async def test_back_to_back_jobs_on_one_device_do_not_wait_for_heartbeats(
    tmp_path: Path,
) -> None:
    config = make_config(
        tmp_path,
        heartbeat_interval=DEFAULT_HEARTBEAT_INTERVAL,
        poll_wait=DEFAULT_POLL_WAIT,
    )
    assert config.heartbeat_interval >= 10.0
    jobs = 20
    with trio.fail_after(30 + 20):
        async with local_system(config) as system:
            started = trio.current_time()
            ids = [system.submit(["true"]) for _ in range(jobs)]
            for job_id in ids:
                info = await system.wait_job(job_id)
                assert info.state == "succeeded", info
            elapsed = trio.current_time() - started
    # 20 jobs in under 30 s: less than one heartbeat interval for all of them.
    assert elapsed < 30.0, f"{jobs} jobs took {elapsed:.1f}s: dispatch waited for heartbeats"
