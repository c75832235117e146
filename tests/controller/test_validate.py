"""Validation at the edge: hostile bodies are 400s naming the field, never 500s (issue 12)."""

from __future__ import annotations

import json
import math
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
import trio
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rc_worker.controller import Store, StoreConfig, create_app
from rc_worker.controller.errors import BadRequest
from rc_worker.controller.validate import json_depth, loads

from .helpers import USER_TOKEN, USER_TOKENS, WORKER_TOKEN, WORKER_TOKENS, FakeWorker, auth


def _deep(n: int) -> bytes:
    return b"[" * n + b"]" * n


@pytest.mark.parametrize(
    ("body", "needle"),
    [
        (_deep(100_000), "nested too deep"),
        (b'{"wait_s": 1e400}', "out of range"),
        (b'{"grace_s": NaN}', "NaN"),
        (b'{"a": -Infinity}', "Infinity"),
        (b'{"n": ' + b"9" * 5000 + b"}", "too large"),
        (b"\xff\xfe", "UTF-8"),
        (b"{", "not valid JSON"),
    ],
)
def test_loads_refuses(body: bytes, needle: str) -> None:
    with pytest.raises(BadRequest, match=needle):
        loads(body)


@given(
    st.recursive(
        st.none() | st.integers(-(2**60), 2**60),
        lambda c: st.lists(c) | st.dictionaries(st.text(), c),
    )
)
def test_json_depth_matches_a_recursive_count(value: Any) -> None:
    def depth(v: Any) -> int:
        if isinstance(v, list):
            return 1 + max((depth(x) for x in v), default=0)
        if isinstance(v, dict):
            return 1 + max((depth(x) for x in v.values()), default=0)
        return 0

    assert json_depth(value) == depth(value)
    assert loads(json.dumps(value).encode()) == value


@pytest.fixture
def small_store() -> Store:
    # No long poll may hold the fuzzer: polls answer at once.
    return Store(StoreConfig(max_grace_s=60.0, max_poll_wait_s=0.0), instance="t")


@pytest.fixture
async def edge(small_store: Store) -> AsyncIterator[httpx.AsyncClient]:
    app = create_app(store=small_store, worker_tokens=WORKER_TOKENS, user_tokens=USER_TOKENS)
    # 500s come back as answers, not as exceptions, so the test sees what a client would.
    transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
    async with httpx.AsyncClient(transport=transport, base_url="http://rc") as c:
        yield c


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"command": [""]}, "command[0]"),
        ({"command": []}, "command"),
        ({"command": ["x", "a\0b"]}, "command[1]"),
        ({"command": ["x"] * 5000}, "command"),
        ({"command": ["x" * 300_000]}, "command"),
        ({"command": ["x"], "env": {"A": "v" * 300_000}}, "env"),
        ({"command": ["x"], "env": {"": "v"}}, "env"),
        ({"command": ["x"], "grace_s": -1}, "grace_s"),
        ({"command": ["x"], "grace_s": 1e9}, "grace_s"),
        ({"command": ["x"], "grace_s": 61}, "grace_s"),
        ({"command": ["x"], "max_runtime_s": 1e300}, "max_runtime_s"),
        ({"command": ["x"], "max_runtime_s": -5}, "max_runtime_s"),
        ({"command": ["x"], "idle_timeout_s": 0}, "idle_timeout_s"),
        ({"command": ["x"], "cwd": ""}, "cwd"),
    ],
)
async def test_submit_refuses_naming_the_field(
    edge: httpx.AsyncClient, body: dict[str, Any], field: str
) -> None:
    r = await edge.post("/v1/jobs", json=body, headers=auth(USER_TOKEN))
    assert r.status_code == 400, r.text
    assert r.json()["error"] == "bad_request"
    assert r.json()["message"].startswith(field + ":")


@pytest.mark.parametrize(
    "raw",
    [
        b'{"command": ["x"], "max_runtime_s": 1e999}',
        b'{"command": ["x"], "grace_s": NaN}',
        b'{"command": ["x"], "grace_s": Infinity}',
    ],
)
async def test_non_finite_numbers_never_reach_the_store(
    edge: httpx.AsyncClient, small_store: Store, raw: bytes
) -> None:
    r = await edge.post("/v1/jobs", content=raw, headers=auth(USER_TOKEN))
    assert r.status_code == 400
    assert small_store.jobs() == []
    listed = await edge.get("/v1/jobs", headers=auth(USER_TOKEN))
    assert listed.status_code == 200


async def test_poll_wait_and_deep_arrays_are_400s(edge: httpx.AsyncClient) -> None:
    with trio.fail_after(10):
        w = FakeWorker(edge)
        await w.register()
        for raw in (
            b'{"session": "%s", "wait_s": 1e400}' % w.session.encode(),
            _deep(100_000),
        ):
            r = await edge.post("/v1/hosts/box1/poll", content=raw, headers=auth(WORKER_TOKEN))
            assert r.status_code == 400, r.text
        r = await edge.get("/v1/events", params={"wait_s": "1" * 400}, headers=auth(USER_TOKEN))
        assert r.status_code == 400


async def test_a_bug_is_a_logged_500_with_an_error_id(
    edge: httpx.AsyncClient,
    small_store: Store,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    def boom(*args: object, **kwargs: object) -> None:
        raise RuntimeError("a planted bug")

    monkeypatch.setattr(small_store, "jobs", boom)
    r = await edge.get("/v1/jobs", headers=auth(USER_TOKEN))
    assert r.status_code == 500
    error_id = r.json()["error_id"]
    assert error_id in r.json()["message"]
    assert any(error_id in rec.getMessage() for rec in caplog.records)


# --- the fuzz test: every endpoint, malformed bodies, no 500, still serving -----------------

ENDPOINTS: list[tuple[str, str, str]] = [
    ("POST", "/v1/hosts/box1/register", WORKER_TOKEN),
    ("POST", "/v1/hosts/box1/deregister", WORKER_TOKEN),
    ("POST", "/v1/hosts/box1/clear", USER_TOKEN),
    ("POST", "/v1/hosts/box1/heartbeat", WORKER_TOKEN),
    ("POST", "/v1/hosts/box1/poll", WORKER_TOKEN),
    ("PUT", "/v1/hosts/box1/labels", WORKER_TOKEN),
    ("PUT", "/v1/hosts/box1/sheets", WORKER_TOKEN),
    ("POST", "/v1/hosts/box1/devices/gpu0/fault", WORKER_TOKEN),
    ("POST", "/v1/jobs/JOB/start", WORKER_TOKEN),
    ("POST", "/v1/jobs/JOB/output?attempt=1&offset=0", WORKER_TOKEN),
    ("POST", "/v1/jobs/JOB/finish", WORKER_TOKEN),
    ("GET", "/v1/jobs/JOB/stdin?attempt=1", WORKER_TOKEN),
    ("POST", "/v1/jobs", USER_TOKEN),
    ("GET", "/v1/jobs", USER_TOKEN),
    ("GET", "/v1/jobs/JOB", USER_TOKEN),
    ("GET", "/v1/jobs/JOB/output?offset=0", USER_TOKEN),
    ("POST", "/v1/jobs/JOB/cancel", USER_TOKEN),
    ("PUT", "/v1/jobs/JOB/stdin", USER_TOKEN),
    ("GET", "/v1/devices", USER_TOKEN),
    ("GET", "/v1/devices/box1/gpu0/sheet", USER_TOKEN),
    ("POST", "/v1/devices/box1/gpu0/clear", USER_TOKEN),
    ("POST", "/v1/devices/box1/gpu0/idle-behavior", USER_TOKEN),
    ("GET", "/v1/events?wait_s=0", USER_TOKEN),
    ("GET", "/v1/health", USER_TOKEN),
    ("GET", "/v1/pool", USER_TOKEN),
    ("GET", "/metrics", USER_TOKEN),
    ("POST", "/v1/hosts/box1/drain", USER_TOKEN),
    ("POST", "/v1/hosts/box1/resume", USER_TOKEN),
    ("POST", "/v1/hosts/box1/retire", USER_TOKEN),
]

_scalars = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=20)
)
_json = st.recursive(
    _scalars,
    lambda c: st.lists(c, max_size=4) | st.dictionaries(st.text(max_size=12), c, max_size=4),
    max_leaves=12,
)
_NASTY = [
    _deep(100_000),
    _deep(70),
    b'{"wait_s": 1e400}',
    b'{"grace_s": NaN, "command": ["x"]}',
    b'{"command": [""]}',
    b"-Infinity",
    b"\x00\xff",
    b"",
    b'{"attempt": 1' + b"0" * 40 + b"}",
]
_FIELDS = [
    "session",
    "devices",
    "recovery",
    "ready",
    "wait_s",
    "attempt",
    "device",
    "outcome",
    "exit_code",
    "verify",
    "sweep",
    "fault_id",
    "kind",
    "command",
    "env",
    "grace_s",
    "max_runtime_s",
    "idle_timeout_s",
    "select",
    "cwd",
    "pty",
    "stdin",
    "idle_behavior",
    "reason",
    "boot_id",
    "labels",
    "sheets",
    "host",
    "state",
    "faults",
    "output_bytes",
]


@st.composite
def _bodies(draw: st.DrawFn, session: str) -> bytes:
    kind = draw(st.sampled_from(["nasty", "json", "object"]))
    if kind == "nasty":
        return draw(st.sampled_from(_NASTY))
    if kind == "json":
        return json.dumps(draw(_json)).encode()
    # A plausible object with a live session, so the handler gets past its first check.
    body: dict[str, Any] = {"session": session}
    for key in draw(st.lists(st.sampled_from(_FIELDS), max_size=6, unique=True)):
        body[key] = draw(_json)
    return json.dumps(body).encode()


def test_the_fuzz_covers_every_route() -> None:
    app = create_app()
    routes = set()
    for route in app.routes:
        for method in getattr(route, "methods", None) or ():
            if method != "HEAD":
                routes.add((method, route.path))  # type: ignore[attr-defined]
    fuzzed = {
        (
            m,
            p.split("?")[0]
            .replace("box1", "{host}")
            .replace("gpu0", "{device}")
            .replace("JOB", "{job_id}"),
        )
        for m, p, _ in ENDPOINTS
    }
    assert routes == fuzzed


async def test_fuzz_every_endpoint_no_500(small_store: Store) -> None:
    app = create_app(store=small_store, worker_tokens=WORKER_TOKENS, user_tokens=USER_TOKENS)
    transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
    async with httpx.AsyncClient(transport=transport, base_url="http://rc") as http:
        w = FakeWorker(http)
        await w.register()
        job = small_store.submit(["true"])
        seen: list[tuple[str, int]] = []

        @settings(max_examples=300, deadline=None, suppress_health_check=list(HealthCheck))
        @given(
            endpoint=st.sampled_from(ENDPOINTS),
            body=_bodies(w.session),
            content_type=st.sampled_from(["application/json", "text/plain"]),
        )
        def drive(endpoint: tuple[str, str, str], body: bytes, content_type: str) -> None:
            method, path, token = endpoint
            seen.append((f"{method} {path}", -1))
            # Each example runs to completion here, in this test's own Trio run.
            answer = trio.from_thread.run(
                _request, http, method, path.replace("JOB", job), token, body, content_type
            )
            assert answer.status_code != 500, (method, path, body[:200], answer.text)
            seen[-1] = (f"{method} {path}", answer.status_code)

        await trio.to_thread.run_sync(drive)
        # 300 random draws from 29 endpoints can miss one now and then: each one not
        # drawn gets a malformed body of its own, so every endpoint is fuzzed every run.
        for method, path, token in ENDPOINTS:
            if f"{method} {path}" not in {p for p, _ in seen}:
                answer = await _request(
                    http, method, path.replace("JOB", job), token, b'{"x": [', "application/json"
                )
                assert answer.status_code != 500, (method, path, answer.text)
                seen.append((f"{method} {path}", answer.status_code))
        assert len({p for p, _ in seen}) == len(ENDPOINTS)
        # Still serving: a well-formed request works after all of that.
        r = await http.post("/v1/jobs", json={"command": ["true"]}, headers=auth(USER_TOKEN))
        assert r.status_code == 200
        health = await http.get("/v1/health")
        assert health.json()["ok"] is True
        for job_info in small_store.jobs():
            for value in (job_info.spec.grace_s, job_info.spec.max_runtime_s or 0.0):
                assert math.isfinite(value)
        # Every state the fuzzing left serialises: no non-finite float got in.
        assert (await http.get("/v1/jobs", headers=auth(USER_TOKEN))).status_code == 200
        assert (await http.get("/v1/devices", headers=auth(USER_TOKEN))).status_code == 200


async def _request(
    http: httpx.AsyncClient, method: str, path: str, token: str, body: bytes, content_type: str
) -> httpx.Response:
    with trio.fail_after(10):
        return await http.request(
            method,
            path,
            content=None if method == "GET" else body,
            headers={**auth(token), "content-type": content_type},
        )


@pytest.mark.parametrize(
    ("body", "message"),
    [
        (
            b'{"command": ["x"], "max_runtime_s": 1e999}',
            "max_runtime_s: 1e999 is out of range for a number",
        ),
        (b'{"grace_s": NaN}', "grace_s: NaN is not a JSON number; send a finite number"),
        (
            b'{"env": {"A": "1"}, "labels": {"x": [1, -Infinity]}}',
            "labels.x[1]: -Infinity is not a JSON number; send a finite number",
        ),
        (b"-Infinity", "body: -Infinity is not a JSON number; send a finite number"),
    ],
)
def test_a_non_finite_number_is_refused_by_its_field(body: bytes, message: str) -> None:
    with pytest.raises(BadRequest) as refused:
        loads(body)
    assert str(refused.value) == message


async def test_a_non_finite_number_in_a_submit_is_a_400_naming_the_field(
    edge: httpx.AsyncClient, small_store: Store
) -> None:
    raw = b'{"command": ["x"], "grace_s": Infinity}'
    r = await edge.post("/v1/jobs", content=raw, headers=auth(USER_TOKEN))
    assert r.status_code == 400
    assert r.json()["message"] == "grace_s: Infinity is not a JSON number; send a finite number"
    assert small_store.jobs() == []
