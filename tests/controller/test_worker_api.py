"""Every worker endpoint over HTTP: the happy path and the main errors."""

from __future__ import annotations

from typing import Any

import httpx
import pytest
import trio

from rc_worker.controller import Store, create_app

from .helpers import USER_TOKENS, WORKER_TOKENS, FakeWorker


def error_of(r: httpx.Response) -> str:
    code: str = r.json()["error"]
    return code


async def test_register_reply(client: httpx.AsyncClient, store: Store) -> None:
    with trio.fail_after(5):
        reply = await FakeWorker(client, devices=["gpu0", "gpu1"]).register()
    assert reply["session"]
    assert reply["heartbeat_interval_s"] == store.config.heartbeat_interval_s
    assert reply["poll_wait_s"] == store.config.poll_wait_s
    assert reply["devices"]["gpu1"] == {
        "state": "free",
        "reason": None,
        "fault_id": None,
        "faults": [],
        "idle_behavior": "run",
    }


async def test_assignment_fields(client: httpx.AsyncClient, store: Store) -> None:
    w = FakeWorker(client)
    with trio.fail_after(5):
        await w.register()
        assert await w.poll(wait_s=0) == []
        job = store.submit(
            ["python", "train.py"],
            env={"SEED": "1"},
            cwd="/work",
            max_runtime_s=60,
            grace_s=5,
            pty=True,
            stdin=True,
        )
        [a] = await w.poll()
    assert a == {
        "job_id": job,
        "attempt": 1,
        "device": "gpu0",
        "command": ["python", "train.py"],
        "cwd": "/work",
        "env": {"SEED": "1"},
        "max_runtime_s": 60,
        "idle_timeout_s": None,
        "grace_s": 5,
        "stdin": {"url": f"/v1/jobs/{job}/stdin?attempt=1"},
        "pty": True,
    }


async def test_job_lifecycle_output_and_finish(client: httpx.AsyncClient, store: Store) -> None:
    w = FakeWorker(client)
    with trio.fail_after(5):
        await w.register()
        job = store.submit(["x"])
        [a] = await w.poll()
        assert (await w.start(a)).status_code == 200
        assert store.job(job).state == "running"
        r = await w.output(a, 0, b"hello ")
        assert r.json() == {"committed": 6}
        assert (await w.output(a, 0, b"hello ")).json() == {"committed": 6}  # a retry
        assert (await w.output(a, 3, b"lo world")).json() == {"committed": 11}
        r = await w.output(a, 20, b"?")
        assert r.status_code == 409
        assert r.json()["error"] == "gap"
        assert r.json()["committed"] == 11
        r = await w.finish(a, "failed", exit_code=2, output_bytes=11)
        assert r.status_code == 200
        r = await w.finish(a, "succeeded", exit_code=0)  # later finishes change nothing
        assert r.status_code == 200
    info = store.job(job)
    assert (info.state, info.exit_code, info.output_bytes) == ("failed", 2, 11)
    assert store.output(job) == b"hello world"


async def test_start_errors(client: httpx.AsyncClient, store: Store) -> None:
    w = FakeWorker(client)
    with trio.fail_after(5):
        await w.register()
        job = store.submit(["x"])
        [a] = await w.poll()
        r = await w.start({**a, "attempt": 2})
        assert (r.status_code, error_of(r)) == (409, "stale_attempt")
        r = await w.start({**a, "job_id": "j-404"})
        assert (r.status_code, error_of(r)) == (404, "unknown_job")
        store.cancel(job)
        r = await w.start(a)
        assert (r.status_code, error_of(r)) == (409, "cancelled")


async def test_refused_is_offered_again_as_a_new_attempt(
    client: httpx.AsyncClient, store: Store
) -> None:
    w = FakeWorker(client)
    with trio.fail_after(5):
        await w.register()
        job = store.submit(["x"])
        [a] = await w.poll()
        assert (await w.finish(a, "refused", reason="on_acquire exited 1")).status_code == 200
        [a2] = await w.poll()
        assert (a2["job_id"], a2["attempt"]) == (job, 2)
        r = await w.output(a, 0, b"late")
        assert (r.status_code, error_of(r)) == (409, "stale_attempt")


@pytest.mark.parametrize("outcome", ["rejected", "error"])
async def test_unusable_assignment_is_terminal(
    client: httpx.AsyncClient, store: Store, outcome: str
) -> None:
    w = FakeWorker(client)
    with trio.fail_after(5):
        await w.register()
        job = store.submit(["x"])
        [a] = await w.poll()
        r = await w.finish(a, outcome, reason="device not ready", error="no such device")
        assert r.status_code == 200
    assert store.job(job).state == outcome
    assert store.device("box1", "gpu0").state == "free"


async def test_finish_with_a_failed_verify(client: httpx.AsyncClient, store: Store) -> None:
    w = FakeWorker(client)
    with trio.fail_after(5):
        await w.register()
        job = store.submit(["x"])
        [a] = await w.poll()
        await w.start(a)
        r = await w.finish(a, verify={"ok": False, "reason": "verify: ecc"}, fault_id="f-1")
        assert r.status_code == 200
        hb = await w.heartbeat({"gpu0": {"state": "quarantined", "faults": ["f-1"]}})
        assert hb.json()["cleared"] == {}
    assert store.job(job).state == "succeeded"
    assert store.device("box1", "gpu0").reason == "fault"
    [e] = [e for e in store.events() if e.type == "verify_failed"]
    assert e.data["reason"] == "verify: ecc"


async def test_heartbeat_reply(client: httpx.AsyncClient, store: Store) -> None:
    w = FakeWorker(client, devices=["gpu0", "gpu1"])
    with trio.fail_after(5):
        await w.register()
        job = store.submit(["x"], device="box1/gpu0")
        [a] = await w.poll(["gpu0"])
        await w.start(a)
        store.set_idle_behavior("box1", "gpu1", "drain")
        store.cancel(job, "cancelled by alice")
        r = await w.heartbeat({"gpu0": {"state": "running", "job_id": job, "attempt": 1}})
    assert r.json() == {
        "cancel": [{"job_id": job, "attempt": 1, "reason": "cancelled by alice"}],
        "idle_behavior": {"gpu0": "run", "gpu1": "drain"},
        "cleared": {},
    }
    assert store.device("box1", "gpu0").worker_state == "running"


async def test_fault_labels_and_sheets(
    client: httpx.AsyncClient, user: httpx.AsyncClient, store: Store
) -> None:
    w = FakeWorker(client, devices=["gpu0", "gpu1"])
    with trio.fail_after(5):
        await w.register()
        body: dict[str, Any] = {
            "session": w.session,
            "fault_id": "f-9",
            "kind": "hook_failed",
            "reason": "on_release exited 3",
            "job_id": None,
        }
        r = await w.post("/v1/hosts/box1/devices/gpu1/fault", body)
        assert r.json() == {"ok": True, "state": "quarantined"}
        r = await w.post("/v1/hosts/box1/devices/gpu7/fault", body)
        assert (r.status_code, error_of(r)) == (404, "unknown_device")
        labels = {"session": w.session, "host": {"disk_free_bytes": "5"}, "devices": {"gpu0": {}}}
        r = await client.put("/v1/hosts/box1/labels", json=labels, headers=w.headers)
        assert r.status_code == 200
        sheets = {"session": w.session, "host": "# box1", "devices": {"gpu0": "# gpu0"}}
        r = await client.put("/v1/hosts/box1/sheets", json=sheets, headers=w.headers)
        assert r.status_code == 200
        r = await user.get("/v1/devices/box1/gpu0/sheet")
    assert r.json() == {
        "host": "box1",
        "device": "gpu0",
        "host_sheet": "# box1",
        "device_sheet": "# gpu0",
    }
    assert store.device("box1", "gpu0").labels["disk_free_bytes"] == "5"
    assert store.device("box1", "gpu1").fault_id == "f-9"


async def test_unknown_session_on_every_worker_endpoint(
    client: httpx.AsyncClient, store: Store
) -> None:
    w = FakeWorker(client)
    with trio.fail_after(5):
        await w.register()
        job = store.submit(["x"])
        [a] = await w.poll()
        old = w.session
        await w.register()  # a new worker process: the old session is gone
        w.session = old
        calls = [
            w.heartbeat(),
            w.poll_raw(),
            w.start(a),
            w.finish(a),
            client.put("/v1/hosts/box1/labels", json={"session": old}, headers=w.headers),
            client.put("/v1/hosts/box1/sheets", json={"session": old}, headers=w.headers),
            w.post(
                "/v1/hosts/box1/devices/gpu0/fault",
                {"session": old, "fault_id": "f", "kind": "dirty"},
            ),
            client.post(
                f"/v1/jobs/{job}/output",
                params={"attempt": 1, "offset": 0, "session": old},
                content=b"",
                headers=w.headers,
            ),
        ]
        for call in calls:
            r = await call
            assert (r.status_code, error_of(r)) == (409, "unknown_session"), r.text


async def test_a_restarted_controller_forgets_every_session() -> None:
    first = create_app(worker_tokens=WORKER_TOKENS, user_tokens=USER_TOKENS)
    second = create_app(worker_tokens=WORKER_TOKENS, user_tokens=USER_TOKENS)
    with trio.fail_after(5):
        async with httpx.AsyncClient(
            transport=httpx.ASGITransport(app=first), base_url="http://rc"
        ) as c1:
            w = FakeWorker(c1)
            await w.register()
        async with httpx.AsyncClient(
            transport=httpx.ASGITransport(app=second), base_url="http://rc"
        ) as c2:
            w.client = c2
            r = await w.heartbeat()
            assert (r.status_code, error_of(r)) == (409, "unknown_session")
            await w.register()
            assert (await w.heartbeat()).status_code == 200


async def test_a_streamed_output_body_is_appended_as_it_arrives(
    client: httpx.AsyncClient, store: Store
) -> None:
    w = FakeWorker(client)
    seen_mid_stream: list[bytes] = []

    async def body() -> Any:
        yield b"first piece "
        # The controller stored the first piece before the body ended.
        seen_mid_stream.append(store.output(job))
        yield b"second piece"

    with trio.fail_after(5):
        await w.register()
        job = store.submit(["x"])
        [a] = await w.poll()
        assert (await w.start(a)).status_code == 200
        r = await client.post(
            f"/v1/jobs/{job}/output",
            params={"attempt": 1, "offset": 0},
            content=body(),
            headers={**w.headers, "Content-Type": "application/octet-stream"},
        )
    assert r.json() == {"committed": len(b"first piece second piece")}
    assert seen_mid_stream == [b"first piece "]
    assert store.output(job) == b"first piece second piece"


async def test_a_streamed_body_overlapping_the_committed_output_is_stored_once(
    client: httpx.AsyncClient, store: Store
) -> None:
    w = FakeWorker(client)

    async def body(*pieces: bytes) -> Any:
        for piece in pieces:
            yield piece

    with trio.fail_after(5):
        await w.register()
        job = store.submit(["x"])
        [a] = await w.poll()
        await w.start(a)
        assert (await w.output(a, 0, b"abcdef")).json() == {"committed": 6}
        # A retry from offset 2 in three pieces: "cd" is held, "ef" too, "gh" is new.
        r = await client.post(
            f"/v1/jobs/{job}/output",
            params={"attempt": 1, "offset": 2},
            content=body(b"cd", b"ef", b"gh"),
            headers=w.headers,
        )
        assert r.json() == {"committed": 8}
        # A gap is answered after the whole body was read, with where to resend from.
        r = await client.post(
            f"/v1/jobs/{job}/output",
            params={"attempt": 1, "offset": 10},
            content=body(b"x" * 100, b"y" * 100),
            headers=w.headers,
        )
        assert (r.status_code, error_of(r), r.json()["committed"]) == (409, "gap", 8)
    assert store.output(job) == b"abcdefgh"


async def test_a_streamed_body_over_the_limit_is_refused(
    client: httpx.AsyncClient, store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    from rc_worker.controller import worker_api

    monkeypatch.setattr(worker_api, "MAX_OUTPUT_CHUNK", 10)
    w = FakeWorker(client)

    async def body() -> Any:
        yield b"0123456"
        yield b"789abc"

    with trio.fail_after(5):
        await w.register()
        job = store.submit(["x"])
        [a] = await w.poll()
        await w.start(a)
        r = await client.post(
            f"/v1/jobs/{job}/output",
            params={"attempt": 1, "offset": 0},
            content=body(),
            headers=w.headers,
        )
    assert (r.status_code, error_of(r)) == (413, "too_large")
    assert "send less per request" in r.json()["message"]
    # What came before the limit is a correct prefix, kept.
    assert store.output(job) == b"0123456"
