"""Damaged files in state_dir never crash the worker and are never silently deleted (issue 12).

Each is moved aside to ``state_dir/damaged/`` with a log line, and its
device (every device, when the file cannot say which) is quarantined with a
``damaged_state`` fault; the worker starts and serves the other devices.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import trio

from rc_worker.testing import local_system, make_config

SPAWNED = {"job_id": "j-9", "attempt": 1, "device": "gpu0", "boot_id": "old", "spawned": True}


def _seed(state: Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        path = state / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


CASES = {
    "journal missing attempt": (
        {
            "jobs/j-9.1/journal.json": json.dumps({**SPAWNED, "attempt": None}),
            "jobs/j-9.1/output": "x",
        },
        "j-9.1",
        {"gpu0"},
    ),
    "bad claim": (
        {
            "jobs/j-9.1/journal.json": json.dumps(SPAWNED),
            "jobs/j-9.1/recovery.json": json.dumps(
                {"device": "gpu0", "job_id": "j-9", "attempt": 1, "boot_id": "b", "claim": "maybe"}
            ),
        },
        "j-9.1",
        {"gpu0"},
    ),
    "fault with report 5": (
        {"faults/gpu0.f-1.json": json.dumps({"device": "gpu0", "report": 5})},
        "gpu0.f-1.json",
        {"gpu0"},
    ),
    "garbage journal": (
        {"jobs/j-9.1/journal.json": "{not json", "jobs/j-9.1/output": "precious output"},
        "j-9.1",
        {"gpu0", "gpu1", "gpu2"},  # which device ran it is unknown: all of them
    ),
    "garbage finish": (
        {"jobs/j-9.1/journal.json": json.dumps(SPAWNED), "jobs/j-9.1/finish.json": "]["},
        "j-9.1",
        {"gpu0"},
    ),
}


@pytest.mark.parametrize("case", sorted(CASES))
async def test_damaged_state_is_moved_aside_and_quarantined(tmp_path: Path, case: str) -> None:
    files, moved, quarantined = CASES[case]
    config = make_config(tmp_path, devices=("gpu0", "gpu1", "gpu2"))
    state = Path(config.state_dir)
    _seed(state, files)
    with trio.fail_after(30):
        async with local_system(config) as system:

            def faulted() -> set[str]:
                return {
                    d.name
                    for d in system.store.devices()
                    if any(f.kind == "damaged_state" for f in d.faults)
                }

            await system.wait_until(lambda: faulted() == quarantined)
            # The worker carries on: a device nobody's damaged state names runs a job.
            if "gpu2" not in quarantined:
                job = system.submit(["echo", "alive"], device="test-host/gpu2")
                assert (await system.wait_job(job)).state == "succeeded"
            assert system.worker.registered.is_set()
            assert {d.name for d in system.store.devices() if d.state == "quarantined"} == (
                quarantined
            )
    aside = state / "damaged" / moved
    assert aside.exists()  # moved, not deleted
    if case == "garbage journal":
        assert (aside / "output").read_text() == "precious output"
    assert not (state / "jobs" / "j-9.1").exists()
