"""A scripted worker that speaks the wire protocol, for driving the controller in tests."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import httpx
import trio

WORKER_TOKEN = "worker-any"
BOX1_TOKEN = "worker-box1"
USER_TOKEN = "user-1"
WORKER_TOKENS = {WORKER_TOKEN: "*", BOX1_TOKEN: "box1"}
USER_TOKENS = (f"{USER_TOKEN}=alice:admin", "user-2=bob")
PLAIN_TOKEN = "user-2"
"""A plain (non-admin) user, bob."""


def auth(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


class FakeWorker:
    """One worker process: registers, then makes the calls a test asks for."""

    def __init__(
        self,
        client: httpx.AsyncClient,
        host: str = "box1",
        *,
        devices: Sequence[str] = ("gpu0",),
        boot_id: str = "boot-1",
        token: str = WORKER_TOKEN,
        labels: dict[str, Any] | None = None,
    ) -> None:
        self.client = client
        self.host = host
        self.devices = list(devices)
        self.boot_id = boot_id
        self.headers = auth(token)
        self.labels = labels
        self.session = ""

    async def post(self, path: str, body: dict[str, Any]) -> httpx.Response:
        return await self.client.post(path, json=body, headers=self.headers)

    async def register(
        self, recovery: Sequence[dict[str, Any]] = (), **extra: Any
    ) -> dict[str, Any]:
        body: dict[str, Any] = {
            "worker_version": "0.1.0",
            "boot_id": self.boot_id,
            "pid": 4242,
            "devices": [{"name": d, "declared_labels": {}} for d in self.devices],
            "labels": self.labels or {"host": {}, "devices": {d: {} for d in self.devices}},
            "sheets": {"host": None, "devices": {}},
            "recovery": list(recovery),
            "require_manual_clear": False,
            **extra,
        }
        r = await self.post(f"/v1/hosts/{self.host}/register", body)
        assert r.status_code == 200, r.text
        reply: dict[str, Any] = r.json()
        self.session = reply["session"]
        return reply

    async def heartbeat(self, devices: dict[str, Any] | None = None) -> httpx.Response:
        body = {"session": self.session, "devices": devices or {}}
        return await self.post(f"/v1/hosts/{self.host}/heartbeat", body)

    async def poll(
        self, ready: Sequence[str] | None = None, wait_s: float = 0
    ) -> list[dict[str, Any]]:
        r = await self.poll_raw(ready, wait_s)
        assert r.status_code == 200, r.text
        assignments: list[dict[str, Any]] = r.json()["assignments"]
        return assignments

    async def poll_raw(
        self, ready: Sequence[str] | None = None, wait_s: float = 0
    ) -> httpx.Response:
        body = {
            "session": self.session,
            "ready": list(self.devices if ready is None else ready),
            "wait_s": wait_s,
        }
        return await self.post(f"/v1/hosts/{self.host}/poll", body)

    async def start(self, a: dict[str, Any], **extra: Any) -> httpx.Response:
        body = {
            "session": self.session,
            "attempt": a["attempt"],
            "device": a["device"],
            "boot_id": self.boot_id,
            **extra,
        }
        return await self.post(f"/v1/jobs/{a['job_id']}/start", body)

    async def output(
        self, a: dict[str, Any], offset: int, data: bytes, *, session: bool = False
    ) -> httpx.Response:
        """POST output; with ``session``, naming this worker's session as the worker does."""
        params: dict[str, Any] = {"attempt": a["attempt"], "offset": offset}
        if session:
            params["session"] = self.session
        return await self.client.post(
            f"/v1/jobs/{a['job_id']}/output",
            params=params,
            content=data,
            headers={**self.headers, "Content-Type": "application/octet-stream"},
        )

    async def finish(
        self, a: dict[str, Any], outcome: str = "succeeded", **extra: Any
    ) -> httpx.Response:
        body: dict[str, Any] = {
            "session": self.session,
            "attempt": a["attempt"],
            "device": a["device"],
            "outcome": outcome,
            "exit_code": 0 if outcome == "succeeded" else None,
            "killed": False,
            "reason": "",
            "error": None,
            "output_bytes": 0,
            "sweep": {"scanned": True, "found": [], "remaining": [], "blind": False},
            "verify": {"ok": True, "reason": ""},
            "fault_id": None,
            **extra,
        }
        return await self.post(f"/v1/jobs/{a['job_id']}/finish", body)

    async def run_one(self, output: bytes = b"", exit_code: int = 0) -> dict[str, Any]:
        """Take one assignment and run it to completion; returns the assignment."""
        [a] = await self.poll(wait_s=5)
        assert (await self.start(a)).status_code == 200
        if output:
            assert (await self.output(a, 0, output)).status_code == 200
        outcome = "succeeded" if exit_code == 0 else "failed"
        r = await self.finish(a, outcome, exit_code=exit_code, output_bytes=len(output))
        assert r.status_code == 200, r.text
        return a


async def wait_listening(proc: trio.Process) -> str:
    """Read a real ``rc serve``'s stderr until it says where it listens; its (first) URL.

    Read to the end of that line: a read that stops inside the address would cut it."""
    assert proc.stderr is not None
    said = b""
    while b"listening on " not in said or not said.endswith(b"\n"):
        chunk = await proc.stderr.receive_some(4096)
        assert chunk, f"rc serve ended before listening: {said!r}"
        said += chunk
    return said.split(b"listening on ", 1)[1].split()[0].decode().rstrip(",")
