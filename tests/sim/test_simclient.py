"""The fleet's lean HTTP path makes the same requests and gets the same answers as httpx's.

``SimClient`` builds requests with less work and sends them straight to the transport;
``InProcessTransport`` calls the controller's ASGI app as ``httpx.ASGITransport`` does.
Both must be invisible: a request is the same, byte for byte, and so is each answer.
"""

from __future__ import annotations

import random
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
import trio
from hypothesis import given
from hypothesis import strategies as st
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.middleware.gzip import GZipMiddleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from rc_worker.controller import Store, StoreConfig, create_app
from rc_worker.testing.asgi import InProcessTransport
from rc_worker.testing.simclient import SimClient

BASE = "http://controller"
JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(max_size=5),
    lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=4), c, max_size=3),
    max_leaves=8,
)
PATHS = st.sampled_from(["/v1/hosts/h0/heartbeat", "/v1/jobs/j-1/finish", "/v1/jobs/j-2/output"])
HEADERS = st.sampled_from([None, {}, {"Authorization": "Bearer t"}, {"X-A": "1", "x-a": "2"}])
PARAMS = st.sampled_from([None, {"attempt": 1, "offset": 0, "session": "s-1"}])


def _same(a: httpx.Request, b: httpx.Request) -> None:
    assert (a.method, a.url, a.headers.raw, a.extensions) == (
        b.method,
        b.url,
        b.headers.raw,
        b.extensions,
    )


@given(
    method=st.sampled_from(["POST", "PUT", "GET"]),
    path=PATHS,
    body=JSON,
    headers=HEADERS,
    params=PARAMS,
    timeout=st.sampled_from([None, 3.0]),
)
def test_a_json_request_is_built_as_httpx_builds_it(
    method: str, path: str, body: Any, headers: Any, params: Any, timeout: float | None
) -> None:
    plain = httpx.AsyncClient(base_url=BASE)
    lean = SimClient(transport=httpx.MockTransport(lambda r: httpx.Response(200)), base_url=BASE)
    extra: dict[str, Any] = {} if timeout is None else {"timeout": timeout}
    for _ in range(2):  # the second time from the cache
        a = lean.build_request(method, path, json=body, headers=headers, params=params, **extra)
        b = plain.build_request(method, path, json=body, headers=headers, params=params, **extra)
        _same(a, b)
        assert a.content == b.content


async def _chunks() -> AsyncIterator[bytes]:
    yield b"ab"
    yield b"c"


def test_other_requests_are_built_as_httpx_builds_them() -> None:
    plain = httpx.AsyncClient(base_url=BASE)
    lean = SimClient(transport=httpx.MockTransport(lambda r: httpx.Response(200)), base_url=BASE)
    octets = {"Content-Type": "application/octet-stream"}
    for kwargs in [
        {},
        {"content": b"xyz", "params": {"offset": 3}, "headers": octets},
        {"content": b""},
        {"data": {"a": "1"}},
        {"cookies": {"c": "1"}},
        {"extensions": {"timeout": {"read": 1.0}}},
    ]:
        _same(
            lean.build_request("POST", "/v1/x", **kwargs),
            plain.build_request("POST", "/v1/x", **kwargs),
        )
    streamed = lean.build_request("POST", "/v1/x", content=_chunks())
    assert streamed.headers["Transfer-Encoding"] == "chunked"
    # A fail-over replaces base_url: later requests go to the new controller.
    lean.base_url = httpx.URL("http://other:8000")
    assert str(lean.build_request("POST", "/v1/x", json={}).url) == "http://other:8000/v1/x"
    assert lean.build_request("POST", "/v1/x", json={}).headers["Host"] == "other:8000"
    # The client's own headers, changed in place, are sent from then on.
    lean.headers["User-Agent"] = "sim"
    plain.headers["User-Agent"] = "sim"
    plain.base_url = lean.base_url
    _same(
        lean.build_request("POST", "/v1/x", json={}), plain.build_request("POST", "/v1/x", json={})
    )


async def _echo(request: Request) -> Response:
    body = await request.body()
    return JSONResponse(
        {
            "method": request.method,
            "path": request.url.path,
            "query": request.url.query,
            "headers": sorted([k, v] for k, v in request.headers.items() if k != "content-length"),
            "body": body.decode(),
        },
        status_code=201,
        headers={"X-Seen": str(len(body))},
    )


async def _fail(request: Request) -> Response:
    raise RuntimeError("the handler broke")


async def _stream(request: Request) -> Response:
    async def parts() -> AsyncIterator[bytes]:
        yield b"one "
        await trio.lowlevel.checkpoint()
        yield b"two"

    return StreamingResponse(parts(), media_type="text/plain")


async def _stream_fail(request: Request) -> Response:
    async def parts() -> AsyncIterator[bytes]:
        yield b"one "
        raise RuntimeError("the stream broke")

    return StreamingResponse(parts(), media_type="text/plain")


APP = Starlette(
    routes=[
        Route("/echo/{x}", _echo, methods=["POST", "PUT", "GET", "HEAD"]),
        Route("/fail", _fail, methods=["POST"]),
        Route("/stream", _stream, methods=["GET"]),
        Route("/stream-fail", _stream_fail, methods=["GET"]),
    ]
)


async def _both(**kwargs: Any) -> tuple[httpx.Response, httpx.Response]:
    answers = []
    for transport in (httpx.ASGITransport(app=APP), InProcessTransport(APP)):
        async with httpx.AsyncClient(transport=transport, base_url=BASE) as client:
            content = kwargs.pop("stream_body", None)
            if content is not None:
                kwargs["content"] = content()
            answer = await client.request(**kwargs)
            if content is not None:
                kwargs["stream_body"] = content
            answers.append(answer)
    return answers[0], answers[1]


@pytest.mark.parametrize(
    "kwargs",
    [
        {"method": "POST", "url": "/echo/a?x=1&y=%20z", "json": {"a": [1, "é"]}},
        {"method": "PUT", "url": "/echo/b", "content": b"raw", "headers": {"X-B": "2"}},
        {"method": "POST", "url": "/echo/c", "stream_body": _chunks},
        {"method": "GET", "url": "/echo/d"},
        {"method": "HEAD", "url": "/echo/e"},
        {"method": "GET", "url": "/stream"},
        {"method": "GET", "url": "/nowhere"},
    ],
)
async def test_an_answer_is_the_one_the_asgi_transport_gives(kwargs: dict[str, Any]) -> None:
    old, new = await _both(**kwargs)
    assert (new.status_code, new.headers.raw, new.content) == (
        old.status_code,
        old.headers.raw,
        old.content,
    )


async def test_an_exception_of_the_app_reaches_the_caller() -> None:
    for transport in (httpx.ASGITransport(app=APP), InProcessTransport(APP)):
        async with httpx.AsyncClient(transport=transport, base_url=BASE) as client:
            with pytest.raises(RuntimeError, match="the handler broke"):
                await client.post("/fail")
            with pytest.raises(RuntimeError, match="the stream broke"):
                await client.get("/stream-fail")


def test_a_plain_app_is_called_one_layer_further_in() -> None:
    """The handlers of a Starlette app with no middleware of its own are called directly
    (the answers above are the same either way); an app with more goes through whole."""
    direct = InProcessTransport(APP).direct
    assert direct is not None
    scope = {"type": "http", "method": "POST", "path": "/echo/a", "root_path": ""}
    found = direct.find(scope)
    assert found is not None
    assert (found[1], found[2]) == (_echo, {"x": "a"})
    assert direct.find({**scope, "path": "/nowhere"}) is None
    assert direct.find({**scope, "method": "DELETE"}) is None  # a 405 is the app's
    fleet_app = create_app(store=Store(StoreConfig(), instance="t"), worker_tokens={"t": "h0"})
    assert InProcessTransport(fleet_app).direct is not None
    layered = Starlette(routes=APP.routes, middleware=[Middleware(GZipMiddleware)])
    assert InProcessTransport(layered).direct is None


async def test_the_controller_answers_alike_through_both() -> None:
    """A worker's register and heartbeat, through each path, get the same answers."""
    answers: list[list[tuple[int, bytes]]] = []
    for lean in (False, True):
        store = Store(StoreConfig(), instance="t", rng=random.Random(1))
        app = create_app(store=store, worker_tokens={"tok": "h0"}, user_tokens=[])
        auth = {"Authorization": "Bearer tok"}
        client: httpx.AsyncClient = (
            SimClient(transport=InProcessTransport(app), base_url=BASE)
            if lean
            else httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url=BASE)
        )
        seen = []
        async with client:
            reg = await client.post(
                "/v1/hosts/h0/register",
                json={
                    "worker_version": "0.1.0",
                    "boot_id": "b",
                    "pid": 4242,
                    "devices": [{"name": "gpu0", "declared_labels": {}}],
                    "labels": {"host": {}, "devices": {"gpu0": {}}},
                    "recovery": [],
                },
                headers=auth,
            )
            seen.append((reg.status_code, reg.content))
            session = reg.json().get("session")
            beat = await client.post(
                "/v1/hosts/h0/heartbeat",
                json={"session": session, "devices": {}},
                headers=auth,
            )
            seen.append((beat.status_code, beat.content))
            bad = await client.post("/v1/hosts/h0/heartbeat", json=[1], headers=auth)
            seen.append((bad.status_code, bad.content))
            for path, headers in [
                ("/v1/hosts/h0/heartbeat", {}),  # 401, with WWW-Authenticate
                ("/v1/hosts/h1/heartbeat", auth),  # 403: another host's token
                ("/v1/hosts/h0/nothing", auth),  # 404 from the router
            ]:
                answer = await client.post(
                    path, json={"session": "x", "devices": {}}, headers=headers
                )
                seen.append((answer.status_code, answer.content, answer.headers.raw))
            gone = await client.post(
                "/v1/hosts/h0/heartbeat", json={"session": "gone", "devices": {}}, headers=auth
            )
            seen.append((gone.status_code, gone.content, gone.headers.raw))
            wrong = await client.get("/v1/hosts/h0/heartbeat", headers=auth)  # 405
            seen.append((wrong.status_code, wrong.content))
        answers.append(seen)
    assert answers[0] == answers[1]
    assert [status for status, *_ in answers[0]] == [200, 200, 400, 401, 403, 404, 409, 405]


async def test_a_controller_bug_is_logged_and_raised_alike_through_both(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """An unexpected exception in a handler: logged with an error id, raised to the caller."""

    def broken(*args: object, **kwargs: object) -> object:
        raise KeyError("a store bug")

    app = create_app(store=Store(StoreConfig(), instance="t"), worker_tokens={"tok": "h0"})
    monkeypatch.setattr(app.state.store, "heartbeat", broken)
    for transport in (httpx.ASGITransport(app=app), InProcessTransport(app)):
        caplog.clear()
        async with httpx.AsyncClient(transport=transport, base_url=BASE) as client:
            with pytest.raises(KeyError, match="a store bug"):
                await client.post(
                    "/v1/hosts/h0/heartbeat",
                    json={"session": "s", "devices": {}},
                    headers={"Authorization": "Bearer tok"},
                )
        assert [r.getMessage().split(" in ")[-1] for r in caplog.records] == [
            "POST /v1/hosts/h0/heartbeat"
        ]
