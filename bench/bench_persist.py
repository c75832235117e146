"""Persistence: the controller on SQLite and on PostgreSQL against ``--memory``, in one run.

Measured in-process (httpx.ASGITransport, no sockets), so the figures are the
store's cost, not the network's:

- dispatch: one job's whole cycle (submit, poll, start, finish), sequential;
- ingest, sequential: 64 KiB output chunks to one job, one after another;
- ingest, concurrent: 16 jobs streaming 64 KiB chunks at once (group commits);
- restart: opening a store holding N finished jobs with output, and the RSS after it.

PostgreSQL runs on a temporary server started here (initdb + pg_ctl on a Unix
socket), like the tests'. Ratios are against ``--memory`` in the same run.

    python bench/bench_persist.py [--jobs N] [--finished N] [--no-postgres]
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import trio

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from rc_worker.controller import Store, StoreConfig, create_app
from rc_worker.controller.durable import Durability
from rc_worker.controller.persist import Backend
from rc_worker.controller.persist.codec import take_batch
from rc_worker.controller.persist.opening import open_backend, open_store
from tests.controller.helpers import (
    USER_TOKEN,
    USER_TOKENS,
    WORKER_TOKENS,
    FakeWorker,
    auth,
)

CHUNK = b"x" * 65536


def rss_mib() -> float:
    with open("/proc/self/statm") as f:
        pages = int(f.read().split()[1])
    return pages * os.sysconf("SC_PAGE_SIZE") / 2**20


def make_app(backend: Backend | None) -> tuple[Store, Any, Durability | None]:
    if backend is None:
        store = Store(StoreConfig())
        return (
            store,
            create_app(store=store, worker_tokens=WORKER_TOKENS, user_tokens=USER_TOKENS),
            None,
        )
    store, _ = open_store(backend, now=trio.current_time(), recovery_grace_s=300)
    d = Durability(store, backend)
    app = create_app(
        store=store, worker_tokens=WORKER_TOKENS, user_tokens=USER_TOKENS, durability=d
    )
    return store, app, d


async def measure(backend: Backend | None, jobs: int) -> dict[str, float]:
    _, app, _ = make_app(backend)
    transport = httpx.ASGITransport(app=app)
    out: dict[str, float] = {}
    async with (
        httpx.AsyncClient(transport=transport, base_url="http://rc") as bare,
        httpx.AsyncClient(
            transport=transport, base_url="http://rc", headers=auth(USER_TOKEN)
        ) as user,
    ):
        w = FakeWorker(bare, devices=[f"gpu{i}" for i in range(16)])
        await w.register()
        t0 = time.perf_counter()
        for _ in range(jobs):
            r = await user.post("/v1/jobs", json={"command": ["x"], "device": "box1/gpu0"})
            assert r.status_code == 200
            [a] = await w.poll(["gpu0"])
            assert (await w.start(a)).status_code == 200
            assert (await w.finish(a)).status_code == 200
        out["dispatch_ms"] = (time.perf_counter() - t0) / jobs * 1000

        r = await user.post("/v1/jobs", json={"command": ["x"], "device": "box1/gpu1"})
        [a] = await w.poll(["gpu1"])
        await w.start(a)
        chunks = max(50, jobs)
        t0 = time.perf_counter()
        for i in range(chunks):
            assert (await w.output(a, i * len(CHUNK), CHUNK)).status_code == 200
        out["ingest_seq_mib_s"] = chunks * len(CHUNK) / 2**20 / (time.perf_counter() - t0)

        started = []
        for i in range(2, 16):
            await user.post("/v1/jobs", json={"command": ["x"], "device": f"box1/gpu{i}"})
        for a in await w.poll([f"gpu{i}" for i in range(2, 16)]):
            await w.start(a)
            started.append(a)
        per = max(10, chunks // len(started))

        async def stream(a: dict[str, Any]) -> None:
            for i in range(per):
                assert (await w.output(a, i * len(CHUNK), CHUNK)).status_code == 200

        t0 = time.perf_counter()
        async with trio.open_nursery() as n:
            for a in started:
                n.start_soon(stream, a)
        total = per * len(started) * len(CHUNK)
        out["ingest_conc_mib_s"] = total / 2**20 / (time.perf_counter() - t0)
    return out


def fill(backend: Backend, finished: int, output_each: int) -> None:
    """A store holding ``finished`` finished jobs, each with ``output_each`` bytes of output."""
    store, _ = open_store(backend, now=0.0, recovery_grace_s=300)
    store.journal.enable()
    from rc_worker.controller.messages import (
        DeviceDecl,
        FinishRequest,
        RegisterRequest,
        StartRequest,
    )

    reply = store.register("box1", RegisterRequest("b", (DeviceDecl("gpu0"),)), now=0.0)
    data = b"y" * output_each
    for i in range(finished):
        job_id = store.submit(["x"])
        [a] = store.poll("box1", reply.session, ["gpu0"], now=0.0)
        store.start(job_id, StartRequest(reply.session, a.attempt, "gpu0"), now=0.0)
        store.append_output(job_id, a.attempt, 0, data)
        store.finish(
            job_id, FinishRequest(reply.session, a.attempt, "gpu0", "succeeded", 0), now=0.0
        )
        if i % 1000 == 999:
            backend.write([take_batch(store)])
    backend.write([take_batch(store)])


def restart(open_: Callable[[], Backend]) -> tuple[float, float]:
    gc.collect()
    before = rss_mib()
    t0 = time.perf_counter()
    backend = open_()
    store, _ = open_store(backend, now=0.0, recovery_grace_s=300)
    took = time.perf_counter() - t0
    after = rss_mib()
    # Finished jobs stay in the store: only their count per state is read at start.
    assert sum(store.job_state_counts().values()) > 0
    backend.close()
    return took, after - before


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--jobs", type=int, default=200)
    parser.add_argument("--finished", type=int, default=10_000)
    parser.add_argument("--output-each", type=int, default=4096)
    parser.add_argument("--no-postgres", action="store_true")
    args = parser.parse_args()

    tmp = Path(tempfile.mkdtemp(prefix="rc-bench-"))
    places: dict[str, Callable[[], Backend] | None] = {"memory": None}
    places["sqlite"] = lambda: open_backend(state_dir=tmp / "sqlite")
    server = None
    if not args.no_postgres:
        from tests.controller import pgserver

        if pgserver.available():
            server = pgserver.PgServer()
    try:
        if server is not None:
            server.init()
            url = server.new_database()
            places["postgres"] = lambda: open_backend(db=url)
        results: dict[str, dict[str, float]] = {}
        for name, open_ in places.items():
            backend = None if open_ is None else open_()
            results[name] = trio.run(measure, backend, args.jobs)
            if backend is not None:
                backend.close()
        base = results["memory"]
        print(
            f"{'store':10} {'dispatch ms':>12} {'ratio':>6} {'ingest MiB/s':>13} {'ratio':>6}"
            f" {'16-way MiB/s':>13} {'ratio':>6}"
        )
        for name, r in results.items():
            d, i, c = r["dispatch_ms"], r["ingest_seq_mib_s"], r["ingest_conc_mib_s"]
            print(
                f"{name:10} {d:12.2f} {d / base['dispatch_ms']:6.1f}"
                f" {i:13.1f} {base['ingest_seq_mib_s'] / i:6.1f}"
                f" {c:13.1f} {base['ingest_conc_mib_s'] / c:6.1f}"
            )
        print()
        stored = args.finished * args.output_each / 2**20
        print(f"restart with {args.finished} finished jobs, {stored:.0f} MiB of output:")
        for name, open_ in places.items():
            if open_ is None:
                continue
            fresh = (
                (lambda n=name: open_backend(state_dir=tmp / "restart-sqlite"))
                if name == "sqlite"
                else None
            )
            if name == "postgres" and server is not None:
                url2 = server.new_database()
                fresh = lambda u=url2: open_backend(db=u)  # noqa: E731
            assert fresh is not None
            b = fresh()
            fill(b, args.finished, args.output_each)
            b.close()
            took, grew = restart(fresh)
            print(f"  {name:10} open {took:6.2f} s, RSS +{grew:7.1f} MiB")
    finally:
        if server is not None:
            server.destroy()
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
