"""Bounded memory: finished jobs live in the store beneath, not in the controller's memory.

Run against SQLite, a real PostgreSQL, and the in-memory backend. A controller that
keeps only the 2 most recent finished jobs in memory still answers every read
about the others (from the store, in a thread), decides late reports about them
on their record, and does not rewrite a record it only read.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path

import httpx
import pytest
import trio

from rc_worker.controller import rc_cli
from rc_worker.controller.errors import StoreUnavailable
from rc_worker.controller.persist import Backend, MemoryBackend
from rc_worker.controller.persist.codec import Batch

from .helpers import USER_TOKEN, FakeWorker
from .persistkit import Breakable, StorePlace, all_jobs, clients, open_controller
from .pgserver import PgServer

GUARD = 60
KEEP = 2


@pytest.fixture(params=["sqlite", "postgres", "memory"])
def place(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[StorePlace | None]:
    if request.param == "memory":
        yield None
        return
    if request.param == "sqlite":
        yield StorePlace("sqlite", state_dir=tmp_path / "state")
        return
    server: PgServer = request.getfixturevalue("pg_server")
    db = server.new_database()
    try:
        yield StorePlace("postgres", db=db, server=server)
    finally:
        server.drop_database(db)


def _open(place: StorePlace | None) -> Backend:
    return MemoryBackend() if place is None else place.open()


async def _run_jobs(w: FakeWorker, user: httpx.AsyncClient, n: int) -> list[str]:
    ids = []
    for i in range(n):
        r = await user.post("/v1/jobs", json={"command": ["echo", str(i)]})
        ids.append(r.json()["job_id"])
        await w.run_one(f"output of {i}\n".encode(), exit_code=i % 2)
    return ids


async def test_finished_jobs_leave_memory_and_every_read_still_finds_them(
    place: StorePlace | None,
) -> None:
    with trio.fail_after(GUARD):
        opened = open_controller(_open(place), keep_finished=KEEP)
        store = opened.store
        async with clients(opened.app) as (bare, user):
            w = FakeWorker(bare)
            await w.register()
            ids = await _run_jobs(w, user, 5)
            queued = (await user.post("/v1/jobs", json={"command": ["sleep", "1"]})).json()
            await opened.durability.flush()
            in_memory = [j for j in ids if store.in_memory(j)]
            assert in_memory == ids[-KEEP:]
            assert store.in_memory(queued["job_id"])

            # Every job is listed, in order, with its outcome, paged or not.
            listed = (await user.get("/v1/jobs")).json()["jobs"]
            assert [j["job_id"] for j in listed] == [*ids, queued["job_id"]]
            assert [j["state"] for j in listed[:5]] == ["succeeded", "failed"] * 2 + ["succeeded"]
            page = (await user.get("/v1/jobs", params={"limit": 2, "order": "desc"})).json()
            assert [j["job_id"] for j in page["jobs"]] == [queued["job_id"], ids[4]]
            rest = (
                await user.get(
                    "/v1/jobs", params={"limit": 10, "order": "desc", "after": page["next"]}
                )
            ).json()
            assert [j["job_id"] for j in rest["jobs"]] == ids[3::-1]
            assert rest["next"] is None
            failed = (await user.get("/v1/jobs", params={"state": "failed", "limit": 1})).json()
            assert [j["job_id"] for j in failed["jobs"]] == [ids[1]]
            nxt = (
                await user.get(
                    "/v1/jobs", params={"state": "failed", "limit": 1, "after": failed["next"]}
                )
            ).json()
            assert [j["job_id"] for j in nxt["jobs"]] == [ids[3]]

            # One evicted job: its record, its output, and rc logs.
            gen = store.journal.generation
            r = await user.get(f"/v1/jobs/{ids[0]}")
            assert (r.status_code, r.json()["state"]) == (200, "succeeded")
            assert r.json()["committed_bytes"] == len(b"output of 0\n")
            r = await user.get(f"/v1/jobs/{ids[1]}/output")
            assert r.content == b"output of 1\n"
            # Reads are not changes: nothing was marked for rewriting.
            assert store.journal.generation == gen
            assert not opened.durability.dirty()
            env = {"RC_URL": "http://rc", "RC_USER_TOKEN": USER_TOKEN}
            transport = httpx.ASGITransport(app=opened.app)
            assert await rc_cli.amain(["logs", ids[2]], env=env, transport=transport) == 0
            r = await user.get(f"/v1/jobs/{ids[0]}")
            counts = store.job_state_counts()
            assert (counts["succeeded"], counts["failed"], counts["queued"]) == (3, 2, 1)
            r = await user.get("/v1/jobs/j-999-nobody")
            assert (r.status_code, r.json()["error"]) == (404, "unknown_job")
        # Memory stays bounded whatever was read back.
        await opened.durability.flush()
        assert sum(store.in_memory(j) for j in ids) <= KEEP
        opened.backend.close()


async def test_late_reports_about_an_evicted_job_are_decided_on_its_record(
    place: StorePlace | None,
) -> None:
    with trio.fail_after(GUARD):
        opened = open_controller(_open(place), keep_finished=0)
        store = opened.store
        async with clients(opened.app) as (bare, user):
            w = FakeWorker(bare)
            await w.register()
            job_id = (await user.post("/v1/jobs", json={"command": ["true"]})).json()["job_id"]
            [a] = await w.poll()
            assert (await w.start(a)).status_code == 200
            assert (await w.output(a, 0, b"done\n")).json() == {"committed": 5}
            assert (await w.finish(a, output_bytes=5)).status_code == 200
            await opened.durability.flush()
            assert not store.in_memory(job_id)
            # A retried finish and output: answered as before the eviction (idempotent).
            assert (await w.finish(a, output_bytes=5)).status_code == 200
            assert (await w.output(a, 0, b"done\n")).json() == {"committed": 5}
            # A heartbeat that still names the finished attempt adopts nothing.
            hb = await w.heartbeat(
                {"gpu0": {"state": "running", "job_id": job_id, "attempt": a["attempt"]}}
            )
            assert hb.status_code == 200
            info = (await user.get(f"/v1/jobs/{job_id}")).json()
            assert (info["state"], info["adopted"]) == ("succeeded", False)
            assert (await user.get(f"/v1/jobs/{job_id}/output")).content == b"done\n"
            # A cancel of the finished job is a no-op, and is answered.
            r = await user.post(f"/v1/jobs/{job_id}/cancel", json={})
            assert (r.status_code, r.json()["state"]) == (200, "succeeded")
        opened.backend.close()


async def test_a_restart_loads_no_finished_job(store_place: StorePlace) -> None:
    place = store_place
    with trio.fail_after(GUARD):
        opened = open_controller(place.open())
        async with clients(opened.app) as (bare, user):
            w = FakeWorker(bare)
            await w.register()
            ids = await _run_jobs(w, user, 3)
            queued = (await user.post("/v1/jobs", json={"command": ["sleep", "1"]})).json()
        opened.backend.close()
        reopened = open_controller(place.open())
        store = reopened.store
        assert [j for j in ids if store.in_memory(j)] == []
        assert store.in_memory(queued["job_id"])
        counts = store.job_state_counts()
        assert (counts["succeeded"], counts["failed"], counts["queued"]) == (2, 1, 1)
        async with clients(reopened.app) as (_, user):
            listed = (await user.get("/v1/jobs")).json()["jobs"]
            assert [j["job_id"] for j in listed] == [*ids, queued["job_id"]]
            assert (await user.get(f"/v1/jobs/{ids[2]}/output")).content == b"output of 2\n"
        reopened.backend.close()


async def test_a_failing_store_keeps_one_batch_however_long_it_fails(
    store_place: StorePlace,
) -> None:
    """Changes made while the store fails are written in one commit when it works again,
    each record once, as it is then: no batch per failed try piles up meanwhile."""
    with trio.fail_after(GUARD):
        writes: list[list[Batch]] = []

        class Counting(Breakable):
            def write(self, batches: Sequence[Batch]) -> Mapping[str, int]:
                recounted = super().write(batches)
                writes.append(list(batches))
                return recounted

        backend = Counting(store_place.open())
        opened = open_controller(backend)
        store = opened.store
        backend.broken = True
        ids = []
        for i in range(5):
            ids.append(store.submit(["echo", str(i)]))
            with pytest.raises(StoreUnavailable):
                await opened.durability.flush()
        store.cancel(ids[0], "changed while failing")
        with pytest.raises(StoreUnavailable):
            await opened.durability.flush()
        assert writes == []
        backend.broken = False
        await opened.durability.flush()
        [[batch]] = writes
        assert sorted(row.job_id for row in batch.jobs) == sorted(ids)
        assert [row.state for row in batch.jobs if row.job_id == ids[0]] == ["killed"]
        opened.backend.close()
        reopened = open_controller(store_place.open())
        assert {j.job_id for j in await all_jobs(reopened)} == set(ids)
        reopened.backend.close()


async def test_paging_finds_a_job_read_back_into_memory_in_its_place(
    place: StorePlace | None,
) -> None:
    # A finished job read back from the store (here by GET /v1/jobs/{id}) joins the
    # jobs in memory after newer ones; pages go by submission order all the same.
    with trio.fail_after(GUARD):
        opened = open_controller(_open(place), keep_finished=KEEP)
        async with clients(opened.app) as (bare, user):
            w = FakeWorker(bare)
            await w.register()
            ids = await _run_jobs(w, user, 6)
            queued = [
                (await user.post("/v1/jobs", json={"command": ["sleep", "1"]})).json()["job_id"]
                for _ in range(3)
            ]
            await opened.durability.flush()
            assert not opened.store.in_memory(ids[0])
            assert (await user.get(f"/v1/jobs/{ids[0]}")).status_code == 200
            for order, expected in (("asc", [*ids, *queued]), ("desc", [*ids, *queued][::-1])):
                seen: list[str] = []
                params: dict[str, object] = {"limit": 2, "order": order}
                for _ in range(20):  # bounded: 9 jobs, 2 a page
                    page = (await user.get("/v1/jobs", params=params)).json()
                    seen += [j["job_id"] for j in page["jobs"]]
                    if page["next"] is None:
                        break
                    params["after"] = page["next"]
                assert seen == expected, order
        opened.backend.close()
