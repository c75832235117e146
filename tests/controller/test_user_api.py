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


MIG = ("gpu0", "gpu0-mig1", "gpu0-mig2")


async def gpu_fault(w: FakeWorker, device: str, fault_id: str, parent: str | None = None) -> None:
    body = {"session": w.session, "fault_id": fault_id, "kind": "gpu_missing", "reason": "lost"}
    r = await w.post(f"/v1/hosts/box1/devices/{device}/fault", {**body, "parent_fault": parent})
    assert r.status_code == 200, r.text


async def states(user: httpx.AsyncClient) -> dict[str, tuple[str, list[str]]]:
    devices = (await user.get("/v1/devices")).json()["devices"]
    return {
        d["address"].split("/")[1]: (d["state"], [f["fault_id"] for f in d["faults"]])
        for d in devices
    }


async def test_clearing_a_gpu_clears_its_slices_copies_even_those_that_came_late(
    user: httpx.AsyncClient, client: httpx.AsyncClient, store: Store
) -> None:
    """A slice's copy of its GPU's fault (``parent_fault``) that arrived after the GPU's
    was cleared (the worker raised it, for a slice cleared alone, before it heard of
    the clear) kept the slice quarantined for good: clearing gpu0 again lifted nothing,
    gpu0 holding no fault. It goes with the GPU's now; clearing one slice alone still
    clears that slice only."""
    w = FakeWorker(client, devices=MIG)
    with trio.fail_after(5):
        await w.register()
        await gpu_fault(w, "gpu0", "f-gpu")
        await gpu_fault(w, "gpu0-mig1", "f-c1", "f-gpu")
        await gpu_fault(w, "gpu0-mig2", "f-c2", "f-gpu")
        r = await user.post("/v1/devices/box1/gpu0-mig1/clear")
        assert r.json()["cleared"] == ["f-c1"]
        assert await states(user) == {
            "gpu0": ("quarantined", ["f-gpu"]),
            "gpu0-mig1": ("free", []),
            "gpu0-mig2": ("quarantined", ["f-c2"]),
        }
        # The worker's next check quarantines the slice again, by a copy of the GPU's.
        await gpu_fault(w, "gpu0-mig1", "f-c1b", "f-gpu")
        r = await user.post("/v1/devices/box1/gpu0/clear")
        assert r.json()["cleared"] == ["f-gpu"]
        assert {s for s, _ in (await states(user)).values()} == {"free"}
        # One more copy, raised before the worker heard of that clear: it goes too.
        await gpu_fault(w, "gpu0-mig1", "f-c1c", "f-gpu")
        assert (await states(user))["gpu0-mig1"] == ("free", [])
        r = await w.heartbeat({n: {"state": "quarantined", "faults": []} for n in MIG})
        assert r.json()["cleared"]["gpu0-mig1"] == ["f-c1", "f-c1b", "f-c1c"]
    lifted = [e.data for e in store.events() if e.type == "device_cleared"]
    assert [(e["device"], e["fault_ids"], e["by"]) for e in lifted] == [
        ("gpu0-mig1", ["f-c1"], "alice"),
        ("gpu0", ["f-gpu"], "alice"),
        ("gpu0-mig1", ["f-c1b"], "alice"),
        ("gpu0-mig2", ["f-c2"], "alice"),
        ("gpu0-mig1", ["f-c1c"], "parent_cleared"),
    ]


async def test_clearing_a_gpu_clears_a_slices_copy_of_a_fault_it_no_longer_holds(
    user: httpx.AsyncClient, client: httpx.AsyncClient, store: Store
) -> None:
    """A copy left naming a GPU fault lifted some other way (here a host clear): clearing
    the GPU's device, though it holds nothing now, clears it."""
    w = FakeWorker(client, devices=MIG)
    with trio.fail_after(5):
        await w.register()
        body = {"session": w.session, "kind": "gpu_missing", "reason": "pci", "scope": "host"}
        for name in MIG:
            await w.post(f"/v1/hosts/box1/devices/{name}/fault", {**body, "fault_id": "f-host"})
        r = await user.post("/v1/devices/box1/gpu0-mig1/clear")
        assert r.json()["cleared"] == ["f-host"]
        # The worker quarantines the slice again, by a copy of the GPU's host fault...
        await gpu_fault(w, "gpu0-mig1", "f-c1", "f-host")
        # ...which ``rc clear HOST`` lifts with the host fault itself.
        r = await user.post("/v1/hosts/box1/clear")
        assert r.json()["cleared"] == {"gpu0": ["f-host"], "gpu0-mig2": ["f-host"]}
        assert (await states(user))["gpu0-mig1"] == ("free", [])
    # Raised directly on the store, as a copy the controller kept before this fix would be.
    store.device("box1", "gpu0")  # known
    h = store._hosts["box1"]
    from rc_worker.controller.records import Fault

    h.devices["gpu0-mig2"].faults["f-old"] = Fault(
        "f-old", "gpu_missing", "fault", "lost", None, None, "worker", parent_fault="f-host"
    )
    with trio.fail_after(5):
        assert (await states(user))["gpu0-mig2"] == ("quarantined", ["f-old"])
        r = await user.post("/v1/devices/box1/gpu0/clear")
        assert r.json()["cleared"] == []
        assert (await states(user))["gpu0-mig2"] == ("free", [])


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
