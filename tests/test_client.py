"""ControllerClient: the retry loop and re-registration, against scripted answers.

Virtual time (``autojump_clock``): the backoff's sleeps cost nothing, and
``trio.current_time()`` measures them exactly, so "Retry-After was honoured"
is a statement about the schedule, not about a wall clock.
"""

from __future__ import annotations

import itertools
import json
import random
from collections.abc import Awaitable, Callable
from typing import Any

import httpx
import pytest
import trio
import trio.testing

from rc_worker.client import ControllerClient
from rc_worker.core.errors import ControllerError, UnknownSession

TOKEN = "s3cret-token-for-client-tests"

Handler = Callable[[httpx.Request], Awaitable[httpx.Response]]


def _client(
    handler: Handler,
    *,
    on_unknown_session: Callable[[ControllerClient], Awaitable[None]] | None = None,
) -> tuple[ControllerClient, httpx.AsyncClient]:
    http = httpx.AsyncClient(transport=httpx.MockTransport(handler), base_url="http://ctl")
    client = ControllerClient(
        http,
        host="box1",
        token=TOKEN,
        on_unknown_session=on_unknown_session,
        rng=random.Random(7),
    )
    client.session = "s-1"
    return client, http


def _ok(body: dict[str, Any] | None = None) -> httpx.Response:
    return httpx.Response(200, json=body if body is not None else {"ok": True})


def _error(status: int, code: str, **extra: Any) -> httpx.Response:
    return httpx.Response(status, json={"error": code, "message": "scripted", **extra})


def _scripted(
    answers: list[Callable[[httpx.Request], httpx.Response]],
) -> tuple[Handler, list[Any]]:
    """A handler giving each answer in turn (the last one repeats); logs (time, request)."""
    seen: list[Any] = []

    async def handler(request: httpx.Request) -> httpx.Response:
        seen.append((trio.current_time(), request))
        answer = answers[min(len(seen), len(answers)) - 1]
        return answer(request)

    return handler, seen


def _raise(exc: type[httpx.TransportError]) -> Callable[[httpx.Request], httpx.Response]:
    def answer(request: httpx.Request) -> httpx.Response:
        raise exc("scripted", request=request)

    return answer


@pytest.mark.parametrize(
    "transient",
    [
        lambda r: _error(503, "unavailable"),
        lambda r: _error(500, "internal"),
        lambda r: _error(502, "bad_gateway"),
        lambda r: _error(408, "timeout"),
        lambda r: _error(429, "slow_down"),
        _raise(httpx.ConnectError),
        _raise(httpx.ReadTimeout),
        _raise(httpx.RemoteProtocolError),
    ],
    ids=["503", "500", "502", "408", "429", "connect", "read-timeout", "disconnect"],
)
async def test_transient_failures_are_retried_until_answered(
    autojump_clock: trio.testing.MockClock,
    transient: Callable[[httpx.Request], httpx.Response],
) -> None:
    handler, seen = _scripted([transient] * 5 + [lambda r: _ok({"committed": 3})])
    client, http = _client(handler)
    async with http:
        assert await client.output("j-1", 1, 0, b"abc") == 3
    assert len(seen) == 6
    # Each retry carries the same bytes at the same offset: idempotent at the controller.
    assert {(r.url.params["offset"], r.content) for _, r in seen} == {("0", b"abc")}


async def test_backoff_grows_with_full_jitter_and_stays_under_the_cap(
    autojump_clock: trio.testing.MockClock,
) -> None:
    handler, seen = _scripted([lambda r: _error(503, "unavailable")] * 12 + [lambda r: _ok()])
    client, http = _client(handler)
    async with http:
        await client.heartbeat({})
    gaps = [b[0] - a[0] for a, b in itertools.pairwise(seen)]
    assert len(gaps) == 12
    for n, gap in enumerate(gaps):
        assert 0 <= gap <= min(30.0, 0.2 * 2**n) + 1e-9
    # Full jitter, not a fixed schedule: the waits are not simply doubling.
    assert len({round(g, 6) for g in gaps}) == len(gaps)


async def test_retry_after_is_honoured_as_a_floor(autojump_clock: trio.testing.MockClock) -> None:
    handler, seen = _scripted(
        [
            lambda r: httpx.Response(503, headers={"Retry-After": "7"}),
            lambda r: httpx.Response(429, headers={"Retry-After": "3"}),
            lambda r: _ok(),
        ]
    )
    client, http = _client(handler)
    async with http:
        await client.heartbeat({})
    times = [t for t, _ in seen]
    assert times[1] - times[0] >= 7
    assert times[2] - times[1] >= 3


@pytest.mark.parametrize("status", [400, 401, 403, 404, 409, 422])
async def test_a_final_4xx_is_raised_after_one_try(
    autojump_clock: trio.testing.MockClock, status: int
) -> None:
    handler, seen = _scripted([lambda r: _error(status, "nope")])
    client, http = _client(handler)
    async with http:
        with pytest.raises(ControllerError) as info:
            await client.finish("j-1", {"attempt": 1})
    assert info.value.status == status
    assert info.value.code == "nope"
    assert len(seen) == 1


async def test_a_gap_answer_tells_where_to_resend_from(
    autojump_clock: trio.testing.MockClock,
) -> None:
    handler, _ = _scripted([lambda r: _error(409, "gap", committed=5)])
    client, http = _client(handler)
    async with http:
        assert await client.output("j-1", 1, 9, b"xyz") == 5


async def test_every_request_carries_the_token_and_the_session(
    autojump_clock: trio.testing.MockClock,
) -> None:
    handler, seen = _scripted([lambda r: _ok({"committed": 1, "assignments": []})])
    client, http = _client(handler)
    async with http:
        await client.heartbeat({"gpu0": {"state": "free"}})
        await client.poll(["gpu0"], 1.0)
        await client.start("j-1", 1, "gpu0", "boot")
        await client.output("j-1", 1, 0, b"x")
        await client.finish("j-1", {"attempt": 1})
    for _, request in seen:
        assert request.headers["Authorization"] == f"Bearer {TOKEN}"
        if request.url.path.endswith("/output"):
            assert request.url.params["session"] == "s-1"
            assert request.headers["Content-Type"] == "application/octet-stream"
        else:
            assert json.loads(request.content)["session"] == "s-1"


async def test_unknown_session_registers_once_and_resends_with_the_new_session(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Three requests notice the lost session at once; one register serves them all."""
    registers = 0
    requests: list[tuple[str, str]] = []

    async def handler(request: httpx.Request) -> httpx.Response:
        nonlocal registers
        body = json.loads(request.content)
        if request.url.path.endswith("/register"):
            registers += 1
            await trio.sleep(1)  # let the other requests pile up behind the lock
            return _ok({"session": f"s-{registers + 1}"})
        requests.append((request.url.path, body["session"]))
        if body["session"] == "s-1":
            return _error(409, "unknown_session")
        return _ok()

    async def register(client: ControllerClient) -> None:
        await client.register({"recovery": []})

    client, http = _client(handler, on_unknown_session=register)
    async with http, trio.open_nursery() as nursery:
        for job in ("j-1", "j-2", "j-3"):
            nursery.start_soon(client.finish, job, {"attempt": 1})
    assert registers == 1
    assert client.session == "s-2"
    resent = [(path, s) for path, s in requests if s == "s-2"]
    assert sorted(path for path, _ in resent) == [f"/v1/jobs/j-{i}/finish" for i in (1, 2, 3)]


async def test_a_refused_re_register_keeps_the_request_instead_of_failing_it(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """If registering again is refused (say, a 401 while the token is being
    rotated), the finish that noticed must not come back as "refused for
    good": the outbox would drop a report the controller never saw."""
    register_answers = [_error(401, "unauthorized"), _error(401, "unauthorized")]
    finishes: list[str] = []

    async def handler(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        if request.url.path.endswith("/register"):
            return register_answers.pop(0) if register_answers else _ok({"session": "s-2"})
        finishes.append(body["session"])
        if body["session"] == "s-1":
            return _error(409, "unknown_session")
        return _ok()

    async def register(client: ControllerClient) -> None:
        await client.register({})

    client, http = _client(handler, on_unknown_session=register)
    async with http:
        await client.finish("j-1", {"attempt": 1})
    assert finishes[-1] == "s-2"
    assert client.session == "s-2"


async def test_unknown_session_without_a_register_routine_is_raised(
    autojump_clock: trio.testing.MockClock,
) -> None:
    handler, _ = _scripted([lambda r: _error(409, "unknown_session")])
    client, http = _client(handler)
    async with http:
        with pytest.raises(UnknownSession):
            await client.heartbeat({})


async def test_register_without_a_session_in_the_answer_is_an_error(
    autojump_clock: trio.testing.MockClock,
) -> None:
    handler, _ = _scripted([lambda r: _ok({"heartbeat_interval_s": 1})])
    client, http = _client(handler)
    async with http:
        with pytest.raises(ControllerError, match="without a session"):
            await client.register({})


async def test_the_caller_bounds_the_retries_with_a_cancel_scope(
    autojump_clock: trio.testing.MockClock,
) -> None:
    handler, seen = _scripted([_raise(httpx.ConnectError)])
    client, http = _client(handler)
    async with http:
        with trio.move_on_after(120) as scope:
            await client.heartbeat({})
    assert scope.cancelled_caught
    assert len(seen) > 5


async def test_a_heartbeat_given_as_a_function_is_read_afresh_at_every_try(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Retried through an outage and resent after registering again, a
    heartbeat reports the states of now, not of when it was first sent."""
    states = {"n": 0}
    bodies: list[dict[str, Any]] = []

    async def handler(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        if request.url.path.endswith("/register"):
            return _ok({"session": "s-2"})
        bodies.append(body)
        states["n"] += 1
        if len(bodies) == 1:
            return _error(503, "unavailable")
        if body["session"] == "s-1":
            return _error(409, "unknown_session")
        return _ok()

    async def register(client: ControllerClient) -> None:
        await client.register({})

    client, http = _client(handler, on_unknown_session=register)
    async with http:
        await client.heartbeat(lambda: {"gpu0": {"state": "free", "seen": states["n"]}})
    assert [(b["session"], b["devices"]["gpu0"]["seen"]) for b in bodies] == [
        ("s-1", 0),
        ("s-1", 1),
        ("s-2", 2),
    ]
