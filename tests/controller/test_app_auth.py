"""Auth (401/403) and the error format, through the ASGI app."""

from __future__ import annotations

import httpx
import pytest
import trio

from rc_worker.controller import Store

from .helpers import BOX1_TOKEN, USER_TOKEN, WORKER_TOKEN, FakeWorker, auth

WORKER_CALLS = [
    ("POST", "/v1/hosts/box1/register"),
    ("POST", "/v1/hosts/box1/heartbeat"),
    ("POST", "/v1/hosts/box1/poll"),
    ("PUT", "/v1/hosts/box1/labels"),
    ("PUT", "/v1/hosts/box1/sheets"),
    ("POST", "/v1/hosts/box1/devices/gpu0/fault"),
    ("POST", "/v1/jobs/j-1/start"),
    ("POST", "/v1/jobs/j-1/output?attempt=1&offset=0"),
    ("POST", "/v1/jobs/j-1/finish"),
    ("GET", "/v1/jobs/j-1/stdin?attempt=1"),
]
USER_CALLS = [
    ("POST", "/v1/jobs"),
    ("GET", "/v1/jobs"),
    ("GET", "/v1/jobs/j-1"),
    ("GET", "/v1/jobs/j-1/output"),
    ("PUT", "/v1/jobs/j-1/stdin"),
    ("POST", "/v1/jobs/j-1/cancel"),
    ("GET", "/v1/devices"),
    ("GET", "/v1/devices/box1/gpu0/sheet"),
    ("POST", "/v1/devices/box1/gpu0/clear"),
    ("POST", "/v1/devices/box1/gpu0/idle-behavior"),
    ("GET", "/v1/events"),
]


def assert_error(r: httpx.Response, status: int, code: str) -> dict[str, object]:
    assert r.status_code == status, r.text
    body: dict[str, object] = r.json()
    assert body["error"] == code
    assert isinstance(body["message"], str)
    assert body["message"]
    return body


@pytest.mark.parametrize(("method", "path"), WORKER_CALLS + USER_CALLS)
@pytest.mark.parametrize("headers", [{}, auth("nope"), {"Authorization": "Basic abc"}])
async def test_missing_or_wrong_token_is_401(
    client: httpx.AsyncClient, method: str, path: str, headers: dict[str, str]
) -> None:
    with trio.fail_after(5):
        r = await client.request(method, path, headers=headers, json={})
    assert_error(r, 401, "unauthorized")
    assert r.headers["www-authenticate"] == "Bearer"


@pytest.mark.parametrize(("method", "path"), WORKER_CALLS)
async def test_user_token_on_a_worker_endpoint_is_403(
    client: httpx.AsyncClient, method: str, path: str
) -> None:
    with trio.fail_after(5):
        r = await client.request(method, path, headers=auth(USER_TOKEN), json={})
    assert_error(r, 403, "forbidden")


@pytest.mark.parametrize(("method", "path"), USER_CALLS)
async def test_worker_token_on_a_user_endpoint_is_403(
    client: httpx.AsyncClient, method: str, path: str
) -> None:
    with trio.fail_after(5):
        r = await client.request(method, path, headers=auth(WORKER_TOKEN), json={})
    assert_error(r, 403, "forbidden")


async def test_a_host_token_may_act_only_as_its_host(
    client: httpx.AsyncClient, store: Store
) -> None:
    with trio.fail_after(5):
        box2 = FakeWorker(client, "box2")
        await box2.register()
        r = await client.post(
            "/v1/hosts/box2/register",
            json={"boot_id": "b", "devices": []},
            headers=auth(BOX1_TOKEN),
        )
        assert_error(r, 403, "forbidden")
        # Job endpoints: the host comes from the session, or from the attempt.
        store.submit(["x"])
        [a] = await box2.poll()
        body = {"session": box2.session, "attempt": 1, "device": "gpu0", "boot_id": "b"}
        r = await client.post(f"/v1/jobs/{a['job_id']}/start", json=body, headers=auth(BOX1_TOKEN))
        assert_error(r, 403, "forbidden")
        r = await client.post(
            f"/v1/jobs/{a['job_id']}/output?attempt=1&offset=0",
            content=b"x",
            headers=auth(BOX1_TOKEN),
        )
        assert_error(r, 403, "forbidden")
        box1 = FakeWorker(client, "box1", token=BOX1_TOKEN)
        await box1.register()


async def test_health_needs_no_token(client: httpx.AsyncClient) -> None:
    with trio.fail_after(5):
        r = await client.get("/v1/health")
    assert r.json() == {"ok": True, "protocol": 2, "store": "memory"}


async def test_unknown_route_and_method(user: httpx.AsyncClient) -> None:
    with trio.fail_after(5):
        assert_error(await user.get("/v1/nothing"), 404, "not_found")
        assert_error(await user.delete("/v1/jobs"), 405, "method_not_allowed")


async def test_malformed_json_and_wrong_types_name_the_field(
    client: httpx.AsyncClient, user: httpx.AsyncClient
) -> None:
    w = FakeWorker(client)
    with trio.fail_after(5):
        r = await user.post("/v1/jobs", content=b"{not json")
        assert "not valid JSON" in str(assert_error(r, 400, "bad_request")["message"])
        r = await user.post("/v1/jobs", json=["echo"])
        assert "expected a JSON object" in str(assert_error(r, 400, "bad_request")["message"])
        r = await user.post("/v1/jobs", json={"command": "echo hi"})
        assert "command" in str(assert_error(r, 400, "bad_request")["message"])
        r = await user.post("/v1/jobs", json={"command": ["x"], "grace_s": "10"})
        assert "grace_s" in str(assert_error(r, 400, "bad_request")["message"])
        r = await user.post("/v1/jobs", json={"command": ["x"], "pty": 1})
        assert "pty" in str(assert_error(r, 400, "bad_request")["message"])
        r = await w.post("/v1/hosts/box1/register", {"boot_id": 7, "devices": []})
        assert "boot_id" in str(assert_error(r, 400, "bad_request")["message"])
        body = {
            "boot_id": "b",
            "devices": [{"name": "gpu0"}],
            "recovery": [{"device": "gpu0", "job_id": 5}],
        }
        r = await w.post("/v1/hosts/box1/register", body)
        assert "recovery[0].job_id" in str(assert_error(r, 400, "bad_request")["message"])
        await w.register()
        r = await w.post("/v1/hosts/box1/heartbeat", {"session": w.session, "devices": {"gpu0": 3}})
        assert "devices.gpu0" in str(assert_error(r, 400, "bad_request")["message"])
        r = await w.post("/v1/hosts/box1/poll", {"session": w.session, "ready": "gpu0"})
        assert "ready" in str(assert_error(r, 400, "bad_request")["message"])
        r = await client.post(
            "/v1/jobs/j-1/output?attempt=one&offset=0", content=b"", headers=w.headers
        )
        assert "attempt" in str(assert_error(r, 400, "bad_request")["message"])
