"""A buggy or hostile controller is contained (issue 12).

A scripted controller (``httpx.MockTransport``) serves malformed, oversized,
foreign-origin and duplicate assignments to a real worker running real
processes. Each bad one is rejected (or, for a duplicate, ignored) without
touching a device or another attempt's files, and the worker carries on.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio

from rc_worker.core.errors import AssignmentError
from rc_worker.core.model import check_controller_url, parse_assignment
from rc_worker.testing import make_config
from rc_worker.worker import Worker

LONG = {
    "job_id": "j-long",
    "attempt": 1,
    "device": "gpu1",
    "command": ["sh", "-c", "echo start; sleep 1; echo end"],
}
BAD = [
    {"job_id": "j-empty", "attempt": 1, "device": "gpu0", "command": [""]},
    {"job_id": "j-grace", "attempt": 1, "device": "gpu0", "command": ["true"], "grace_s": 1e12},
    {"job_id": "j-big", "attempt": 1, "device": "gpu0", "command": ["echo", "x" * 2_000_000]},
    {
        "job_id": "j-foreign",
        "attempt": 1,
        "device": "gpu0",
        "command": ["cat"],
        "stdin": {"url": "http://evil.example/steal"},
    },
    {
        "job_id": "j-relative",
        "attempt": 1,
        "device": "gpu0",
        "command": ["cat"],
        "stdin": {"url": "//evil.example/steal"},
    },
]


class HostileController:
    def __init__(self) -> None:
        self.finishes: list[tuple[str, dict[str, Any]]] = []
        self.output: dict[str, bytes] = {}
        self.hosts_seen: set[str] = set()
        self.long_started = trio.Event()
        self.long_finished = trio.Event()
        self.after_finished = trio.Event()
        self.polls = 0

    def batch(self) -> list[Any]:
        self.polls += 1
        if self.polls == 1:
            # The same attempt again right behind it, to a free device and to its own.
            return [*BAD, LONG, {**LONG, "device": "gpu0"}, LONG]
        if self.long_finished.is_set() and self.polls < 200:
            self.polls = 200
            return [{"job_id": "j-after", "attempt": 1, "device": "gpu0", "command": ["true"]}]
        return []

    async def __call__(self, request: httpx.Request) -> httpx.Response:
        self.hosts_seen.add(request.url.host)
        path = request.url.path
        if path.endswith("/register"):
            return httpx.Response(200, json={"session": "s-1", "heartbeat_interval_s": 0.2})
        if path.endswith("/poll"):
            batch = self.batch()
            if not batch:
                await trio.sleep(0.1)
            return httpx.Response(200, json={"assignments": batch})
        job = path.split("/")[3] if path.startswith("/v1/jobs/") else ""
        if path.endswith("/start") and job == "j-long":
            self.long_started.set()
        if path.endswith("/output"):
            offset = int(request.url.params["offset"])
            self.output[job] = self.output.get(job, b"")[:offset] + request.content
            return httpx.Response(200, json={"committed": len(self.output[job])})
        if path.endswith("/finish"):
            self.finishes.append((job, json.loads(request.content)))
            if job == "j-long":
                self.long_finished.set()
            if job == "j-after":
                self.after_finished.set()
        return httpx.Response(200, json={})


async def test_hostile_assignments_are_contained(tmp_path: Path) -> None:
    controller = HostileController()
    config = make_config(tmp_path, devices=("gpu0", "gpu1"), token="t")
    with trio.fail_after(60):
        async with httpx.AsyncClient(
            transport=httpx.MockTransport(controller), base_url="http://c"
        ) as http:
            worker = Worker(config, http=http)
            async with trio.open_nursery() as nursery:
                await nursery.start(worker.run)
                await controller.after_finished.wait()
                worker.drain()
    by_job: dict[str, list[dict[str, Any]]] = {}
    for job, body in controller.finishes:
        by_job.setdefault(job, []).append(body)
    reasons = {job: bodies[0]["reason"] for job, bodies in by_job.items()}
    for job in ("j-empty", "j-grace", "j-big", "j-foreign", "j-relative"):
        assert [b["outcome"] for b in by_job[job]] == ["rejected"], job
    assert "command[0]" in reasons["j-empty"]
    assert "grace_s must be at most" in reasons["j-grace"]
    assert "command is larger" in reasons["j-big"]
    assert "not on the controller's origin" in reasons["j-foreign"]
    assert "not on the controller's origin" in reasons["j-relative"]
    # The token never left for another origin.
    assert controller.hosts_seen == {"c"}
    # The duplicate touched nothing: one finish, the real one, with all the output.
    assert [b["outcome"] for b in by_job["j-long"]] == ["succeeded"]
    assert controller.output["j-long"] == b"start\nend\n"
    # gpu0 was never wedged by the empty command or the duplicate: it ran the next job.
    assert [b["outcome"] for b in by_job["j-after"]] == ["succeeded"]
    assert worker.metrics.duplicate_assignments._value.get() == 2


def _raw(**changes: Any) -> dict[str, Any]:
    return {"job_id": "j", "attempt": 1, "device": "gpu0", "command": ["true"], **changes}


@pytest.mark.parametrize(
    ("changes", "needle"),
    [
        ({"command": [""]}, "command[0]"),
        ({"grace_s": float("nan")}, "finite"),
        ({"max_runtime_s": float("inf")}, "finite"),
        ({"idle_timeout_s": 1e300}, "at most"),
        ({"env": {"A": "x" * 2_000_000}}, "env is larger"),
        ({"stdin": {"url": "https://c.example:8443/x"}}, "origin"),
        ({"stdin": {"url": "http://c.example.evil/x"}}, "origin"),
        ({"stdin": {"url": "javascript:alert(1)"}}, "origin"),
    ],
)
def test_parse_assignment_refuses(changes: dict[str, Any], needle: str) -> None:
    with pytest.raises(AssignmentError, match=needle.replace("[", r"\[").replace("]", r"\]")):
        parse_assignment(_raw(**changes), origin="http://c.example")


def test_stdin_url_on_the_controller_origin_is_accepted() -> None:
    origin = "http://c.example:8080"
    for url in ("/v1/jobs/j/stdin?attempt=1", "http://C.example:8080/v1/jobs/j/stdin"):
        assert parse_assignment(_raw(stdin={"url": url}), origin=origin).stdin_url == url
    assert check_controller_url("https://c.example/x", "https://c.example:443", "u")
