"""Every user endpoint over HTTP: the happy path and the main errors."""

from __future__ import annotations

import httpx
import trio

from rc_worker.controller import Store

from .helpers import FakeWorker


def error_of(r: httpx.Response) -> tuple[int, str]:
    return r.status_code, r.json()["error"]


async def test_submit_get_and_list(user: httpx.AsyncClient, client: httpx.AsyncClient) -> None:
    with trio.fail_after(5):
        await FakeWorker(client).register()
        r = await user.post(
            "/v1/jobs",
            json={
                "command": ["echo", "hi"],
                "select": "product!=A100",
                "device": "box1/gpu0",
                "env": {"A": "1"},
                "cwd": None,
                "max_runtime_s": 5,
                "idle_timeout_s": None,
                "grace_s": 1,
                "pty": False,
                "stdin": False,
            },
        )
        assert r.status_code == 200
        job_id = r.json()["job_id"]
        job = (await user.get(f"/v1/jobs/{job_id}")).json()
        assert job["state"] == "queued"
        assert job["spec"]["device"] == "box1/gpu0"
        assert job["spec"]["env"] == {"A": "1"}
        listed = (await user.get("/v1/jobs")).json()["jobs"]
        assert [j["job_id"] for j in listed] == [job_id]
        assert (await user.get("/v1/jobs", params={"state": "running"})).json() == {
            "jobs": [],
            "next": None,
        }
        assert error_of(await user.get("/v1/jobs", params={"state": "zzz"})) == (400, "bad_request")
        assert error_of(await user.get("/v1/jobs/j-nope")) == (404, "unknown_job")


async def test_submit_errors(user: httpx.AsyncClient) -> None:
    with trio.fail_after(5):
        r = await user.post("/v1/jobs", json={"command": []})
        assert error_of(r) == (400, "bad_request")
        r = await user.post("/v1/jobs", json={"command": ["x"], "select": "a>=1Q"})
        assert error_of(r) == (400, "bad_request")
        assert "unknown size suffix" in r.json()["message"]
        r = await user.post("/v1/jobs", json={"command": ["x"], "device": "nohost/gpu0"})
        assert error_of(r) == (404, "unknown_device")
        r = await user.post("/v1/jobs", json={"command": ["x"], "device": "gpu0"})
        assert error_of(r) == (400, "bad_request")


async def test_output_plain_and_from_offset(
    user: httpx.AsyncClient, client: httpx.AsyncClient, store: Store
) -> None:
    w = FakeWorker(client)
    with trio.fail_after(5):
        await w.register()
        job = store.submit(["x"])
        await w.run_one(output=b"0123456789")
        r = await user.get(f"/v1/jobs/{job}/output")
        assert r.content == b"0123456789"
        assert r.headers["x-rc-job-state"] == "succeeded"
        assert (await user.get(f"/v1/jobs/{job}/output", params={"offset": 7})).content == b"789"
        r = await user.get(f"/v1/jobs/{job}/output", params={"follow": "true", "offset": 2})
        assert r.content == b"23456789"
        assert error_of(await user.get(f"/v1/jobs/{job}/output?offset=-1")) == (400, "bad_request")


async def test_cancel(user: httpx.AsyncClient, store: Store) -> None:
    job = store.submit(["x"])
    with trio.fail_after(5):
        r = await user.post(f"/v1/jobs/{job}/cancel", json={"reason": "cancelled by bob"})
        assert (r.json()["state"], r.json()["reason"]) == ("killed", "cancelled by bob")
        r = await user.post(f"/v1/jobs/{job}/cancel")  # no body at all; idempotent
        assert r.status_code == 200
        assert error_of(await user.post("/v1/jobs/j-x/cancel")) == (404, "unknown_job")


async def test_devices_clear_and_idle_behavior(
    user: httpx.AsyncClient, client: httpx.AsyncClient, store: Store
) -> None:
    w = FakeWorker(
        client,
        labels={"host": {"disk_free_bytes": "9"}, "devices": {"gpu0": {"product": "H100"}}},
    )
    with trio.fail_after(5):
        await w.register()
        [d] = (await user.get("/v1/devices")).json()["devices"]
        assert (d["address"], d["state"], d["idle_behavior"]) == ("box1/gpu0", "free", "run")
        assert d["labels"]["product"] == "H100"
        assert d["labels"]["disk_free_bytes"] == "9"
        await w.post(
            "/v1/hosts/box1/devices/gpu0/fault",
            {"session": w.session, "fault_id": "f-1", "kind": "dirty", "reason": "pid 9"},
        )
        [d] = (await user.get("/v1/devices")).json()["devices"]
        assert (d["state"], d["reason"], d["fault_id"]) == ("quarantined", "fault", "f-1")
        r = await user.post("/v1/devices/box1/gpu0/clear")
        assert r.json()["cleared"] == ["f-1"]
        assert r.json()["device"]["state"] == "free"
        r = await w.heartbeat({"gpu0": {"state": "quarantined", "faults": ["f-1"]}})
        assert r.json()["cleared"] == {"gpu0": ["f-1"]}
        r = await user.post("/v1/devices/box1/gpu0/idle-behavior", json={"idle_behavior": "hold"})
        assert r.json()["idle_behavior"] == "hold"
        r = await user.post("/v1/devices/box1/gpu0/idle-behavior", json={"idle_behavior": "x"})
        assert error_of(r) == (400, "bad_request")
        assert error_of(await user.post("/v1/devices/box1/gpu9/clear")) == (404, "unknown_device")
        r = await user.get("/v1/devices/box1/gpu0/sheet")
        assert r.json()["device_sheet"] is None
    events = [e.type for e in store.events()]
    assert events == ["device_quarantined", "device_cleared", "idle_behavior_set"]
    assert [e.data["by"] for e in store.events()[1:]] == ["alice", "alice"]


async def test_events(user: httpx.AsyncClient, store: Store) -> None:
    for _ in range(3):
        store.cancel(store.submit(["x"]))
    with trio.fail_after(5):
        body = (await user.get("/v1/events", params={"after": 1})).json()
        assert [e["seq"] for e in body["events"]] == [2, 3]
        assert body["last"] == 3
        assert body["events"][0]["type"] == "job_finished"
        assert body["events"][0]["outcome"] == "killed"
        body = (await user.get("/v1/events", params={"after": 3})).json()
        assert body == {"events": [], "last": 3}
