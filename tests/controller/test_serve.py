"""Serving: hypercorn on 127.0.0.1:0, the housekeeping task, webhook delivery."""

from __future__ import annotations

import json
import random
from collections.abc import AsyncIterator

import httpx
import pytest
import trio
import trio.testing

from rc_worker.controller import Store, StoreConfig, create_app
from rc_worker.controller.serve import WEBHOOK_TRIES, deliver_webhooks, housekeeping, serve

from .helpers import USER_TOKEN, USER_TOKENS, WORKER_TOKENS, FakeWorker, auth


async def test_serve_on_a_free_port_streams_output_while_the_job_runs() -> None:
    store = Store(instance="t")
    app = create_app(store=store, worker_tokens=WORKER_TOKENS, user_tokens=USER_TOKENS)
    with trio.fail_after(20):
        async with trio.open_nursery() as nursery:
            [url] = await nursery.start(serve, app, "127.0.0.1:0")
            assert url.startswith("http://127.0.0.1:")
            async with httpx.AsyncClient(base_url=url) as client:
                assert (await client.get("/v1/health")).json()["ok"] is True
                w = FakeWorker(client)
                await w.register()
                job = store.submit(["x"])
                [a] = await w.poll(wait_s=5)
                await w.start(a)
                await w.output(a, 0, b"first\n")
                async with client.stream(
                    "GET",
                    f"/v1/jobs/{job}/output",
                    params={"follow": "true"},
                    headers=auth(USER_TOKEN),
                ) as r:
                    chunks = r.aiter_raw()
                    # Over HTTP the follower gets bytes while the job is still running.
                    assert await chunks.__anext__() == b"first\n"
                    assert store.job(job).state == "running"
                    await w.output(a, 6, b"second\n")
                    assert await chunks.__anext__() == b"second\n"
                    await w.finish(a, output_bytes=13)
                    assert [c async for c in chunks] == []
            nursery.cancel_scope.cancel()


async def test_serve_stops_on_its_shutdown_trigger() -> None:
    app = create_app(worker_tokens=WORKER_TOKENS, user_tokens=USER_TOKENS)
    stop = trio.Event()
    with trio.fail_after(20):
        async with trio.open_nursery() as nursery:
            await nursery.start(
                lambda task_status: serve(
                    app, "127.0.0.1:0", shutdown_trigger=stop.wait, task_status=task_status
                )
            )
            stop.set()


async def test_housekeeping_reaps_a_silent_host(autojump_clock: trio.testing.MockClock) -> None:
    store = Store(StoreConfig(heartbeat_interval_s=10), instance="t")
    app = create_app(store=store, worker_tokens=WORKER_TOKENS, user_tokens=USER_TOKENS)
    lost = trio.Event()
    store.subscribe(lambda: lost.set() if "host_lost" in [e.type for e in store.events()] else None)
    with trio.fail_after(1000):
        async with trio.open_nursery() as nursery:
            await nursery.start(housekeeping, app)
            async with httpx.AsyncClient(
                transport=httpx.ASGITransport(app=app), base_url="http://rc"
            ) as client:
                await FakeWorker(client).register()
            t0 = trio.current_time()
            await lost.wait()  # no request comes in: only the housekeeping task can do it
            assert trio.current_time() - t0 == 30
            nursery.cancel_scope.cancel()


@pytest.mark.parametrize("failures", [0, 2])
async def test_webhooks_get_every_event_in_order_with_retries(
    failures: int, autojump_clock: trio.testing.MockClock
) -> None:
    store = Store(instance="t")
    app = create_app(
        store=store,
        worker_tokens=WORKER_TOKENS,
        user_tokens=USER_TOKENS,
        webhooks=["http://hooks.example/a", "http://hooks.example/b"],
    )
    received: dict[str, list[int]] = {"/a": [], "/b": []}
    calls = {"/a": 0, "/b": 0}
    all_in = trio.Event()

    async def handler(request: httpx.Request) -> httpx.Response:
        path = request.url.path
        calls[path] += 1
        if path == "/a" and calls[path] <= failures:
            return httpx.Response(503)
        event = json.loads(request.content)
        assert request.headers["x-rc-event"] == event["type"]
        received[path].append(event["seq"])
        if len(received["/a"]) == len(received["/b"]) == 4:
            all_in.set()
        return httpx.Response(204)

    for _ in range(3):
        store.cancel(store.submit(["x"]))
    with trio.fail_after(1000):
        async with (
            httpx.AsyncClient(transport=httpx.MockTransport(handler)) as hooks,
            trio.open_nursery() as nursery,
        ):
            await nursery.start(deliver_webhooks, app, hooks)
            store.cancel(store.submit(["y"]))
            await all_in.wait()
            nursery.cancel_scope.cancel()
    assert received == {"/a": [1, 2, 3, 4], "/b": [1, 2, 3, 4]}


async def test_a_webhook_that_never_answers_is_skipped_after_its_tries(
    autojump_clock: trio.testing.MockClock,
) -> None:
    store = Store(instance="t")
    app = create_app(store=store, webhooks=["http://hooks.example/down"])
    tries: list[int] = []
    last_seen = trio.Event()

    async def handler(request: httpx.Request) -> httpx.Response:
        seq = json.loads(request.content)["seq"]
        tries.append(seq)
        if seq == 3:
            last_seen.set()
        if seq == 1:
            raise httpx.ConnectError("refused", request=request)
        return httpx.Response(400 if seq == 2 else 200)

    store.cancel(store.submit(["x"]))
    store.cancel(store.submit(["x"]))
    store.cancel(store.submit(["x"]))
    with trio.fail_after(10_000):
        async with (
            httpx.AsyncClient(transport=httpx.MockTransport(handler)) as hooks,
            trio.open_nursery() as nursery,
        ):
            await nursery.start(
                lambda task_status: deliver_webhooks(
                    app, hooks, rng=random.Random(1), task_status=task_status
                )
            )
            await last_seen.wait()
            nursery.cancel_scope.cancel()
    assert tries == [1] * WEBHOOK_TRIES + [2, 3]


async def test_stdin_streams_over_http() -> None:
    store = Store(instance="t")
    app = create_app(store=store, worker_tokens=WORKER_TOKENS, user_tokens=USER_TOKENS)
    second_chunk, uploaded = trio.Event(), trio.Event()
    with trio.fail_after(20):
        async with trio.open_nursery() as nursery:
            [url] = await nursery.start(serve, app, "127.0.0.1:0")
            async with httpx.AsyncClient(base_url=url) as client:
                w = FakeWorker(client)
                await w.register()
                job = store.submit(["cat"], stdin=True)
                [a] = await w.poll(wait_s=5)
                await w.start(a)

                async def body() -> AsyncIterator[bytes]:
                    yield b"line 1\n"
                    await second_chunk.wait()
                    yield b"line 2\n"

                async def upload() -> None:
                    r = await client.put(
                        f"/v1/jobs/{job}/stdin", content=body(), headers=auth(USER_TOKEN)
                    )
                    assert r.json() == {"accepted": 14}
                    uploaded.set()

                nursery.start_soon(upload)
                async with client.stream("GET", a["stdin"]["url"], headers=w.headers) as r:
                    chunks = r.aiter_raw()
                    assert await chunks.__anext__() == b"line 1\n"  # before the upload ends
                    second_chunk.set()
                    assert b"".join([c async for c in chunks]) == b"line 2\n"
                await uploaded.wait()
            nursery.cancel_scope.cancel()
