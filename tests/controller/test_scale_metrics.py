"""What the controller counts about itself on ``GET /metrics``: registrations by outcome,
dispatch latency and queue wait, long polls parked, commit latency, webhook deliveries;
and ``GET /v1/health`` reporting the store's health."""

from __future__ import annotations

import json
import random
import re
from pathlib import Path

import httpx
import trio
import trio.testing

from rc_worker.controller import Store, create_app
from rc_worker.controller.persist.opening import open_backend
from rc_worker.controller.serve import WEBHOOK_TRIES, deliver_webhooks
from rc_worker.controller.stats import Histogram

from .helpers import USER_TOKENS, WORKER_TOKENS, FakeWorker
from .persistkit import clients, open_controller


def _value(text: str, name: str) -> float:
    m = re.search(rf"^{re.escape(name)} (\S+)$", text, re.MULTILINE)
    assert m is not None, f"{name} not in /metrics"
    return float(m.group(1))


def test_histogram_buckets_are_cumulative() -> None:
    h = Histogram((0.1, 1.0))
    for v in (0.05, 0.1, 0.5, 7.0, -1.0):
        h.observe(v)
    assert h.cumulative() == [("0.1", 3), ("1.0", 4), ("+Inf", 5)]
    assert h.sum == 0.05 + 0.1 + 0.5 + 7.0


async def test_registrations_dispatch_and_parked_polls() -> None:
    store = Store(instance="t")
    app = create_app(store=store, worker_tokens=WORKER_TOKENS, user_tokens=USER_TOKENS)
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://rc") as client:
        w = FakeWorker(client)
        with trio.fail_after(30):
            await w.register()
            bad = FakeWorker(client, devices=["gpu.0"])
            r = await bad.post(
                "/v1/hosts/box1/register",
                {"boot_id": "b", "devices": [{"name": "gpu.0"}]},
            )
            assert r.status_code == 400
            r = await client.post("/v1/hosts/box1/register", json={"boot_id": "b"})
            assert r.status_code == 401  # no token: refused before the store

            # A poll parks; a submit wakes it; the job starts.
            async with trio.open_nursery() as nursery:
                got: list[list[dict[str, object]]] = []

                async def park() -> None:
                    got.append(await w.poll(wait_s=30))

                nursery.start_soon(park)
                for _ in range(3000):  # bounded: the poll parks within a few ticks
                    if store.stats.polls_parked == 1:
                        break
                    await trio.sleep(0.01)
                text = (await client.get("/metrics")).text
                assert _value(text, "rc_controller_long_polls_parked") == 1.0
                job = store.submit(["true"])
            [[a]] = got
            assert a["job_id"] == job
            assert store.stats.polls_parked == 0
            assert (await w.start(a)).status_code == 200
            # The worker process restarts while the job runs: that registration recovered.
            again = FakeWorker(client, boot_id="boot-1")
            await again.register(instance_id="another-process")
            text = (await client.get("/metrics")).text
    assert 'rc_controller_registrations_total{outcome="registered"} 1.0' in text
    assert 'rc_controller_registrations_total{outcome="recovered"} 1.0' in text
    assert 'rc_controller_registrations_total{outcome="refused"} 2.0' in text
    assert _value(text, "rc_controller_dispatch_latency_seconds_count") == 1.0
    assert _value(text, "rc_controller_queue_wait_seconds_count") == 1.0
    assert _value(text, "rc_controller_long_polls_parked") == 0.0
    assert _value(text, "rc_controller_store_commit_seconds_count") == 0.0  # in memory


async def test_webhook_deliveries_by_result(autojump_clock: trio.testing.MockClock) -> None:
    store = Store(instance="t")
    app = create_app(store=store, webhooks=["http://hooks.example/x"])

    async def handler(request: httpx.Request) -> httpx.Response:
        seq = json.loads(request.content)["seq"]
        if seq == 1:
            raise httpx.ConnectError("refused", request=request)
        return httpx.Response(400 if seq == 2 else 204)

    for _ in range(3):
        store.cancel(store.submit(["x"]))
    want = {"retried": WEBHOOK_TRIES - 1, "failed": 1, "refused": 1, "delivered": 1}
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
            for _ in range(10_000):
                if dict(store.stats.webhook_deliveries) == want:
                    break
                await trio.sleep(1)
            nursery.cancel_scope.cancel()
    assert dict(store.stats.webhook_deliveries) == want
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://rc") as c:
        text = (await c.get("/metrics")).text
    assert 'rc_controller_webhook_deliveries_total{result="failed"} 1.0' in text
    assert f'rc_controller_webhook_deliveries_total{{result="retried"}} {WEBHOOK_TRIES - 1}.0' in (
        text
    )


async def test_commit_latency_and_health_of_a_persisted_store(tmp_path: Path) -> None:
    opened = open_controller(open_backend(state_dir=tmp_path / "state"))
    try:
        async with clients(opened.app) as (bare, user):
            with trio.fail_after(30):
                health = (await bare.get("/v1/health")).json()
                assert health["ok"] is True
                assert health["store"] == "ok"
                assert "store_error" not in health  # absent while writes work
                assert str(tmp_path / "state") in health["store_backend"]
                r = await user.post("/v1/jobs", json={"command": ["true"]})
                assert r.status_code == 200, r.text
                health = (await bare.get("/v1/health")).json()
                text = (await bare.get("/metrics")).text
        assert health["last_commit_s"] is not None
        assert health["last_commit_s"] >= 0
        assert health["store_pending"] is False
        assert _value(text, "rc_controller_store_commit_seconds_count") >= 1.0
    finally:
        opened.backend.close()
