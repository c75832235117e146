"""How a device hands a job's output to the outbox: whatever ends the run, the spool is
closed, so its delivery ends and the finish goes."""

from __future__ import annotations

from pathlib import Path

import pytest
import trio
from test_delivery import finished_events, left_on_disk, steady_store

from rc_worker import client as client_module
from rc_worker.context import WorkerContext
from rc_worker.core.model import Assignment
from rc_worker.testing import local_system, make_config


@pytest.fixture(autouse=True)
def fast_retries(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(client_module, "RETRY_BASE_S", 0.005)
    monkeypatch.setattr(client_module, "RETRY_CAP_S", 0.05)


async def test_a_job_that_cannot_be_spawned_after_its_spool_opened_still_gets_its_finish(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An environment the job's spec cannot carry (a NUL byte in it) makes the run fail
    after the spool was opened and handed to the outbox, before anything is spawned.
    Before, that spool was never closed, its delivery waited on it for ever, and the
    finish never went: the job stayed running at the controller and a drain never ended.

    A probe's uuid holding a NUL once led here; probes are refused such a value now
    (tests/test_probe.py), so the bad environment is put in directly."""
    real_job_env = WorkerContext.job_env

    def job_env(self: WorkerContext, device: str, a: Assignment) -> dict[str, str]:
        return {**real_job_env(self, device, a), "CUDA_VISIBLE_DEVICES": "GPU-\0bad"}

    monkeypatch.setattr(WorkerContext, "job_env", job_env)
    config = make_config(tmp_path)
    store = steady_store()
    job_id = store.submit(["sh", "-c", "echo never"])
    with trio.fail_after(30):
        async with local_system(config, store=store) as system:
            info = await system.wait_job(job_id)
            await system.wait_until(lambda: system.device("gpu0").state == "quarantined")
    assert info.state == "error", info
    assert len(finished_events(store, job_id)) == 1
    assert store.output(job_id) == b""
    assert left_on_disk(config) == []
