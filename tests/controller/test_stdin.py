"""A job's stdin: from the user's PUT to the worker's GET, with bounded memory."""

from __future__ import annotations

from collections.abc import AsyncIterator

import httpx
import trio
import trio.testing
from starlette.applications import Starlette

from rc_worker.controller import Store
from rc_worker.controller.stdin import PIPE_BOUND

from .helpers import FakeWorker


def pipe_size(app: Starlette, job: str) -> int:
    pipes = app.state.controller.stdin._pipes
    return len(pipes[job].buffer) if job in pipes else 0


async def test_stdin_flows_with_backpressure_and_bounded_memory(
    app: Starlette, client: httpx.AsyncClient, user: httpx.AsyncClient, store: Store
) -> None:
    w = FakeWorker(client)
    total = 3 * PIPE_BOUND + 12345
    sent = 0
    payload = bytes(range(256)) * (total // 256) + bytes(total % 256)
    results: dict[str, httpx.Response] = {}

    async def body() -> AsyncIterator[bytes]:
        nonlocal sent
        for i in range(0, total, 100_000):
            assert pipe_size(app, job) <= PIPE_BOUND
            sent = i
            yield payload[i : i + 100_000]
        sent = total

    async def upload() -> None:
        results["put"] = await user.put(f"/v1/jobs/{job}/stdin", content=body())

    with trio.fail_after(20):
        await w.register()
        job = store.submit(["cat"], stdin=True)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(upload)
            await trio.testing.wait_all_tasks_blocked()
            # Nobody reads yet: the upload waits once the pipe is full.
            assert sent < 2 * PIPE_BOUND
            assert "put" not in results
            [a] = await w.poll()
            assert a["stdin"] == {"url": f"/v1/jobs/{job}/stdin?attempt=1"}
            await w.start(a)
            r = await client.get(a["stdin"]["url"], headers=w.headers)
    assert r.status_code == 200
    assert r.content == payload
    assert results["put"].json() == {"accepted": total}


async def test_stdin_errors(
    client: httpx.AsyncClient, user: httpx.AsyncClient, store: Store
) -> None:
    w = FakeWorker(client)
    with trio.fail_after(10):
        await w.register()
        plain = store.submit(["x"])
        r = await user.put(f"/v1/jobs/{plain}/stdin", content=b"x")
        assert (r.status_code, r.json()["error"]) == (409, "no_stdin")
        job = store.submit(["x"], stdin=True)
        assert (await user.put(f"/v1/jobs/{job}/stdin", content=b"abc")).status_code == 200
        r = await user.put(f"/v1/jobs/{job}/stdin", content=b"more")
        assert (r.status_code, r.json()["error"]) == (409, "stdin_closed")
        [a] = await w.poll(wait_s=0)  # the plain job
        r = await client.get(f"/v1/jobs/{a['job_id']}/stdin?attempt=1", headers=w.headers)
        assert (r.status_code, r.json()["error"]) == (409, "no_stdin")
        r = await client.get(f"/v1/jobs/{job}/stdin?attempt=1", headers=w.headers)
        assert (r.status_code, r.json()["error"]) == (409, "stale_attempt")  # not offered yet
        r = await user.put("/v1/jobs/j-none/stdin", content=b"x")
        assert (r.status_code, r.json()["error"]) == (404, "unknown_job")


async def test_a_waiting_upload_ends_when_the_job_ends(
    user: httpx.AsyncClient, store: Store
) -> None:
    job = store.submit(["x"], stdin=True)
    results: list[httpx.Response] = []

    async def upload() -> None:
        results.append(await user.put(f"/v1/jobs/{job}/stdin", content=b"x" * (2 * PIPE_BOUND)))

    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(upload)
            await trio.testing.wait_all_tasks_blocked()
            store.cancel(job)
    assert results[0].status_code == 409
    assert results[0].json()["error"] == "finished"


async def test_the_worker_stream_ends_when_the_job_ends(
    client: httpx.AsyncClient, user: httpx.AsyncClient, store: Store
) -> None:
    w = FakeWorker(client)
    responses: list[httpx.Response] = []
    with trio.fail_after(10):
        await w.register()
        job = store.submit(["x"], stdin=True)
        [a] = await w.poll()
        await w.start(a)

        async def read() -> None:
            responses.append(await client.get(a["stdin"]["url"], headers=w.headers))

        async with trio.open_nursery() as nursery:
            nursery.start_soon(read)
            await trio.testing.wait_all_tasks_blocked()
            await w.finish(a)
    assert store.job(job).state == "succeeded"
    assert (responses[0].status_code, responses[0].content) == (200, b"")
