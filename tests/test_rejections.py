"""Assignments the worker cannot run are answered with a rejected finish (a defect of the
assignment) or a refused one (the device is not ready: a stale offer); the worker carries on.

The reference controller never sends a malformed assignment, so these tests
talk to a scripted controller through ``httpx.MockTransport``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import trio

from rc_worker.testing import make_config
from rc_worker.worker import Worker

BAD_AND_GOOD = [
    {"job_id": "j-1", "attempt": 1, "device": "gpu0", "command": []},
    {"job_id": "j-2", "attempt": 1, "device": "gpu9", "command": ["true"]},
    {"job_id": "j-3", "attempt": 1, "device": "gpu0", "command": ["true"], "env": {"A": 1}},
    {"job_id": "j-4", "attempt": 2, "device": "gpu1", "command": ["echo", "ok"]},
    {"garbage": True},
    {"job_id": "j-5", "attempt": 1, "device": "gpu1", "command": ["true"]},
    {"job_id": "j-6", "attempt": 1, "device": "gpu0", "command": ["true"], "max_runtime_s": "x"},
]


class ScriptedController:
    def __init__(self, assignments: list[Any]) -> None:
        self.assignments = assignments
        self.finishes: dict[str, dict[str, Any]] = {}
        self.output: dict[str, bytes] = {}
        self.done = trio.Event()

    async def __call__(self, request: httpx.Request) -> httpx.Response:
        path = request.url.path
        if path.endswith("/register"):
            return httpx.Response(200, json={"session": "s-1", "heartbeat_interval_s": 0.2})
        if path.endswith("/poll"):
            batch, self.assignments = self.assignments, []
            if not batch:
                await trio.sleep(0.2)
            return httpx.Response(200, json={"assignments": batch})
        if path.endswith("/output"):
            job = path.split("/")[3]
            offset = int(request.url.params["offset"])
            data = self.output.get(job, b"")
            self.output[job] = data[:offset] + request.content
            return httpx.Response(200, json={"committed": len(self.output[job])})
        if path.endswith("/finish"):
            self.finishes[path.split("/")[3]] = json.loads(request.content)
            if len(self.finishes) == 6:
                self.done.set()
            return httpx.Response(200, json={})
        return httpx.Response(200, json={})


async def test_unusable_assignments_are_rejected_and_the_rest_run(tmp_path: Path) -> None:
    controller = ScriptedController(BAD_AND_GOOD)
    config = make_config(tmp_path, devices=("gpu0", "gpu1"), token="t")
    transport = httpx.MockTransport(controller)
    with trio.fail_after(30):
        async with httpx.AsyncClient(transport=transport, base_url="http://c") as http:
            worker = Worker(config, http=http)
            async with trio.open_nursery() as nursery:
                await nursery.start(worker.run)
                await controller.done.wait()
                worker.drain()
    f = controller.finishes
    assert f["j-1"]["outcome"] == "rejected"
    assert "command must be a non-empty list" in f["j-1"]["reason"]
    assert f["j-2"]["outcome"] == "rejected"
    assert "unknown device 'gpu9'" in f["j-2"]["reason"]
    assert f["j-3"]["outcome"] == "rejected"
    assert "env must be" in f["j-3"]["reason"]
    assert f["j-6"]["outcome"] == "rejected"
    assert "max_runtime_s must be a number" in f["j-6"]["reason"]
    # gpu1 took j-4, so j-5 in the same poll found it busy: the device's state,
    # not a defect of the assignment, so a stale offer, refused (requeued).
    assert f["j-5"]["outcome"] == "refused"
    assert f["j-5"]["stale_offer"] is True
    assert f["j-5"]["reason"].startswith("stale offer: device gpu1 is")
    assert f["j-4"]["outcome"] == "succeeded"
    assert f["j-4"]["attempt"] == 2
    assert controller.output["j-4"] == b"ok\n"
    assert all(r["attempt"] == 1 for k, r in f.items() if k != "j-4")
