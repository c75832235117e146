"""Roles on the controller: users cancel their own jobs; admin clears, idles and cancels all."""

from __future__ import annotations

import httpx
import pytest
import trio

from rc_worker.controller import Store
from rc_worker.controller.context import User, parse_user_token

from .helpers import PLAIN_TOKEN, USER_TOKEN, FakeWorker, auth


def test_parse_user_token() -> None:
    assert parse_user_token("s3cret=ann:admin") == ("s3cret", User("ann", admin=True))
    assert parse_user_token("s3cret=bob") == ("s3cret", User("bob", admin=False))
    assert parse_user_token("s3cret=bob:user") == ("s3cret", User("bob", admin=False))
    token, user = parse_user_token("bare")
    assert token == "bare"
    assert not user.admin
    assert user.name.startswith("user-")
    assert "bare" not in user.name
    # base64 padding stays part of a bare token
    assert parse_user_token("abc==")[0] == "abc=="
    with pytest.raises(ValueError, match="admin"):
        parse_user_token("t=ann:root")
    with pytest.raises(ValueError, match="TOKEN must be non-empty"):
        parse_user_token("=ann")


async def test_submitted_by_and_own_cancel_only(client: httpx.AsyncClient, store: Store) -> None:
    with trio.fail_after(10):
        alice, bob = auth(USER_TOKEN), auth(PLAIN_TOKEN)
        a_job = (await client.post("/v1/jobs", json={"command": ["x"]}, headers=alice)).json()
        b_job = (await client.post("/v1/jobs", json={"command": ["y"]}, headers=bob)).json()
        got = (await client.get(f"/v1/jobs/{b_job['job_id']}", headers=alice)).json()
        assert got["submitted_by"] == "bob"
        # bob may not cancel alice's job
        r = await client.post(f"/v1/jobs/{a_job['job_id']}/cancel", headers=bob)
        assert r.status_code == 403
        assert "alice" in r.json()["message"]
        assert store.job(a_job["job_id"]).state == "queued"
        # bob cancels his own; alice (admin) cancels anybody's
        r = await client.post(f"/v1/jobs/{b_job['job_id']}/cancel", headers=bob)
        assert r.status_code == 200
        assert r.json()["state"] == "killed"
        c_job = store.submit(["z"], submitted_by="carol")
        r = await client.post(f"/v1/jobs/{c_job}/cancel", headers=alice)
        assert r.status_code == 200
        events = [(e.type, e.data.get("by")) for e in store.events()]
        assert ("job_cancel_requested", "bob") in events
        assert ("job_cancel_requested", "alice") in events
        assert ("job_submitted", "bob") in events


async def test_only_the_submitter_or_an_admin_feeds_a_jobs_stdin(
    client: httpx.AsyncClient, store: Store
) -> None:
    with trio.fail_after(10):
        alice, bob = auth(USER_TOKEN), auth(PLAIN_TOKEN)
        body = {"command": ["cat"], "stdin": True}
        job = (await client.post("/v1/jobs", json=body, headers=alice)).json()["job_id"]
        r = await client.put(f"/v1/jobs/{job}/stdin", content=b"from bob", headers=bob)
        assert r.status_code == 403
        assert "alice" in r.json()["message"]


async def test_clear_and_idle_need_admin(client: httpx.AsyncClient, store: Store) -> None:
    with trio.fail_after(10):
        w = FakeWorker(client)
        await w.register()
        await w.post(
            "/v1/hosts/box1/devices/gpu0/fault",
            {"session": w.session, "fault_id": "f-1", "kind": "dirty"},
        )
        bob, alice = auth(PLAIN_TOKEN), auth(USER_TOKEN)
        r = await client.post("/v1/devices/box1/gpu0/clear", headers=bob)
        assert r.status_code == 403
        assert "admin" in r.json()["message"]
        assert store.device("box1", "gpu0").state == "quarantined"
        body = {"idle_behavior": "drain"}
        r = await client.post("/v1/devices/box1/gpu0/idle-behavior", json=body, headers=bob)
        assert r.status_code == 403
        assert store.device("box1", "gpu0").idle_behavior == "run"
        r = await client.post("/v1/devices/box1/gpu0/clear", headers=alice)
        assert r.json()["cleared"] == ["f-1"]
        cleared = [e for e in store.events() if e.type == "device_cleared"]
        assert cleared[-1].data["by"] == "alice"


async def test_host_drain_resume_retire_need_admin(client: httpx.AsyncClient, store: Store) -> None:
    with trio.fail_after(10):
        await FakeWorker(client).register()
        bob, alice = auth(PLAIN_TOKEN), auth(USER_TOKEN)
        for action in ("drain", "resume", "retire", "clear"):
            r = await client.post(f"/v1/hosts/box1/{action}", headers=bob)
            assert r.status_code == 403, action
            assert "admin" in r.json()["message"]
        assert store.device("box1", "gpu0").idle_behavior == "run"
        r = await client.post("/v1/hosts/box1/drain", headers=alice)
        assert r.status_code == 200
        r = await client.post("/v1/hosts/box1/retire", json={}, headers=alice)
        assert r.status_code == 200
        by = {e.type: e.data.get("by") for e in store.events()}
        assert by["host_idle_behavior"] == "alice"
        assert by["host_retired"] == "alice"
