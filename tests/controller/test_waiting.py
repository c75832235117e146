"""Long polls, followed output and lazy timers, in Trio's virtual time (MockClock, autojump)."""

from __future__ import annotations

import httpx
import trio
import trio.lowlevel
import trio.testing

from rc_worker.controller import Store, create_app

from .helpers import USER_TOKEN, USER_TOKENS, WORKER_TOKENS, FakeWorker, auth


async def test_long_poll_wakes_on_submit(
    client: httpx.AsyncClient, user: httpx.AsyncClient, autojump_clock: trio.testing.MockClock
) -> None:
    w = FakeWorker(client)
    got: list[dict[str, object]] = []

    async def poll() -> None:
        got.extend(await w.poll(wait_s=30))

    with trio.fail_after(100):
        await w.register()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(poll)
            await trio.sleep(5)
            r = await user.post("/v1/jobs", json={"command": ["x"]})
    assert [a["job_id"] for a in got] == [r.json()["job_id"]]
    assert trio.current_time() < 30  # woken by the submit, not by the deadline


async def test_long_poll_wakes_on_a_direct_store_submit(
    client: httpx.AsyncClient, store: Store, autojump_clock: trio.testing.MockClock
) -> None:
    w = FakeWorker(client)
    with trio.fail_after(100):
        await w.register()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(w.poll, None, 30)
            await trio.sleep(1)
            job = store.submit(["x"])
    assert store.job(job).state == "assigned"
    assert trio.current_time() < 30


async def test_long_poll_times_out_empty_and_wait_is_capped(
    client: httpx.AsyncClient, store: Store, autojump_clock: trio.testing.MockClock
) -> None:
    w = FakeWorker(client)
    with trio.fail_after(1000):
        await w.register()
        store.set_idle_behavior("box1", "gpu0", "hold")
        store.submit(["x"])
        # Keep the host alive while the long polls wait.
        async with trio.open_nursery() as nursery:

            async def heartbeats() -> None:
                while True:
                    await w.heartbeat()
                    await trio.sleep(5)

            nursery.start_soon(heartbeats)
            t0 = trio.current_time()
            assert await w.poll(wait_s=3) == []
            assert trio.current_time() - t0 == 3
            t0 = trio.current_time()
            assert await w.poll(wait_s=10_000) == []
            assert trio.current_time() - t0 == store.config.max_poll_wait_s
            nursery.cancel_scope.cancel()


async def test_a_superseded_long_poll_answers_unknown_session(
    client: httpx.AsyncClient, autojump_clock: trio.testing.MockClock
) -> None:
    w = FakeWorker(client)
    with trio.fail_after(100):
        await w.register()
        results: list[httpx.Response] = []

        async def poll() -> None:
            results.append(await w.poll_raw(wait_s=30))

        async with trio.open_nursery() as nursery:
            nursery.start_soon(poll)
            await trio.sleep(1)
            await FakeWorker(client).register()
    assert results[0].status_code == 409
    assert results[0].json()["error"] == "unknown_session"


async def test_host_lost_after_three_missed_heartbeats(
    client: httpx.AsyncClient,
    user: httpx.AsyncClient,
    store: Store,
    autojump_clock: trio.testing.MockClock,
) -> None:
    w = FakeWorker(client)
    interval = store.config.heartbeat_interval_s
    with trio.fail_after(1000):
        await w.register()
        job = store.submit(["x"])
        [a] = await w.poll()
        await w.start(a)
        await w.output(a, 0, b"partial")
        for _ in range(2):
            await trio.sleep(interval)
            assert (await w.heartbeat()).status_code == 200
        last = trio.current_time()
        # Nobody asks anything: a follower's wait still ends when the host is declared lost.
        r = await user.get(f"/v1/jobs/{job}/output", params={"follow": "true"})
        assert r.content == b"partial"
        assert trio.current_time() == last + 3 * interval
        info = (await user.get(f"/v1/jobs/{job}")).json()
        assert (info["state"], info["reason"]) == ("lost", "host lost: no heartbeat")
        [d] = (await user.get("/v1/devices")).json()["devices"]
        assert (d["state"], d["reason"], d["host_state"]) == ("quarantined", "interrupted", "lost")
        assert "host_lost" in [e.type for e in store.events()]
        r = await w.heartbeat()
        assert r.json()["error"] == "unknown_session"


async def test_host_lost_is_evaluated_lazily_on_any_request(
    client: httpx.AsyncClient,
    user: httpx.AsyncClient,
    store: Store,
    autojump_clock: trio.testing.MockClock,
) -> None:
    w = FakeWorker(client)
    with trio.fail_after(1000):
        await w.register()
        await trio.sleep(29)
        [d] = (await user.get("/v1/devices")).json()["devices"]
        assert d["host_state"] == "up"
        await trio.sleep(1)
        [d] = (await user.get("/v1/devices")).json()["devices"]
        assert d["host_state"] == "lost"


async def test_follow_streams_until_the_job_ends(
    client: httpx.AsyncClient, user: httpx.AsyncClient, store: Store
) -> None:
    w = FakeWorker(client)
    followed: list[bytes] = []

    async def follow(job: str) -> None:
        r = await user.get(f"/v1/jobs/{job}/output", params={"follow": "true"})
        followed.append(r.content)

    with trio.fail_after(10):
        await w.register()
        job = store.submit(["x"])
        async with trio.open_nursery() as nursery:
            nursery.start_soon(follow, job)
            [a] = await w.poll()
            await w.start(a)
            offset = 0
            for chunk in (b"one\n", b"two\n", b"three\n"):
                await trio.lowlevel.checkpoint()
                await w.output(a, offset, chunk)
                offset += len(chunk)
            await w.finish(a, output_bytes=offset)
    assert followed == [b"one\ntwo\nthree\n"]


async def test_events_long_poll(
    user: httpx.AsyncClient, store: Store, autojump_clock: trio.testing.MockClock
) -> None:
    got: list[dict[str, object]] = []

    async def wait_for_events() -> None:
        r = await user.get("/v1/events", params={"after": 0, "wait_s": 30})
        got.extend(r.json()["events"])

    with trio.fail_after(100):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(wait_for_events)
            await trio.sleep(2)
            store.cancel(store.submit(["x"]))
    assert [e["type"] for e in got] == ["job_finished"]
    assert trio.current_time() < 30


async def test_a_custom_clock_drives_the_timers(autojump_clock: trio.testing.MockClock) -> None:
    # A controller clock that is not the loop's (here: offset by a day) still times out right.
    store = Store(instance="t")
    app = create_app(
        store=store,
        worker_tokens=WORKER_TOKENS,
        user_tokens=USER_TOKENS,
        clock=lambda: trio.current_time() + 86_400,
    )
    with trio.fail_after(1000):
        async with httpx.AsyncClient(
            transport=httpx.ASGITransport(app=app), base_url="http://rc"
        ) as client:
            w = FakeWorker(client)
            await w.register()
            t0 = trio.current_time()
            assert await w.poll(wait_s=7) == []
            assert trio.current_time() - t0 == 7
            r = await client.get("/v1/events", params={"wait_s": 60}, headers=auth(USER_TOKEN))
            # The wait ended when the host was lost (30 s after its registration).
            assert [e["type"] for e in r.json()["events"]] == ["device_quarantined", "host_lost"]
            assert trio.current_time() - t0 == 30
