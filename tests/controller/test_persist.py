"""Persistence: one behavioural suite, run against SQLite and a real PostgreSQL server.

A controller is opened on a store, driven over its HTTP API in-process, then
dropped without closing anything (as SIGKILL would leave it) and a second one
opened on the same store. Everything acknowledged must be there.
"""

from __future__ import annotations

import json
import re
from collections.abc import AsyncIterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio
from hypothesis import given
from hypothesis import strategies as st

from rc_worker.controller import StoreConfig, worker_api
from rc_worker.controller.persist import Backend, StoreOpenError
from rc_worker.controller.persist.codec import Batch, coalesce_output
from rc_worker.controller.persist.schema import SCHEMA_VERSION
from rc_worker.controller.persist.sql import stored_schema_version

from .helpers import FakeWorker
from .persistkit import Breakable, StorePlace, all_jobs, clients, open_controller
from .pgserver import PgServer

GUARD = 60
FIXTURES = Path(__file__).parent.parent / "fixtures"


class Counting(Breakable):
    """Counts the commits that reach the backend."""

    def __init__(self, inner: Backend) -> None:
        super().__init__(inner)
        self.writes = 0

    def write(self, batches: Sequence[Batch]) -> Mapping[str, int]:
        self.writes += 1
        return super().write(batches)


async def submit(user: httpx.AsyncClient, *command: str, **extra: Any) -> str:
    r = await user.post("/v1/jobs", json={"command": list(command), **extra})
    assert r.status_code == 200, r.text
    job_id: str = r.json()["job_id"]
    return job_id


async def job(user: httpx.AsyncClient, job_id: str) -> dict[str, Any]:
    r = await user.get(f"/v1/jobs/{job_id}")
    assert r.status_code == 200, r.text
    body: dict[str, Any] = r.json()
    return body


async def output(user: httpx.AsyncClient, job_id: str) -> bytes:
    r = await user.get(f"/v1/jobs/{job_id}/output")
    assert r.status_code == 200, r.text
    return r.content


async def devices(user: httpx.AsyncClient) -> dict[str, dict[str, Any]]:
    r = await user.get("/v1/devices")
    return {d["address"]: d for d in r.json()["devices"]}


LABELS = {"host": {"cpu": "x86"}, "devices": {"gpu0": {"gpu0.mem": "80G"}, "gpu1": {}, "gpu2": {}}}


async def test_a_restart_keeps_everything_acknowledged(store_place: StorePlace) -> None:
    with trio.fail_after(GUARD):
        first = open_controller(store_place.open())
        async with clients(first.app) as (bare, user):
            w = FakeWorker(bare, devices=["gpu0", "gpu1", "gpu2"], labels=LABELS)
            await w.register(sheets={"host": "host sheet", "devices": {"gpu0": "gpu0 sheet"}})
            done = await submit(user, "echo", "done", device="box1/gpu0")
            a1 = await w.run_one(b"hello\n")
            assert a1["job_id"] == done
            running = await submit(user, "sleep", "1", device="box1/gpu0")
            [a2] = await w.poll(["gpu0"])
            assert (await w.start(a2)).status_code == 200
            assert (await w.output(a2, 0, b"part1")).status_code == 200
            queued = [await submit(user, "echo", str(i), device="box1/gpu0") for i in range(3)]
            pinned = await submit(user, "echo", "pinned", device="box1/gpu1")
            r = await w.post(
                "/v1/hosts/box1/devices/gpu1/fault",
                {"session": w.session, "fault_id": "f-dirty", "kind": "dirty", "reason": "left"},
            )
            assert r.status_code == 200, r.text
            r = await user.post(
                "/v1/devices/box1/gpu2/idle-behavior", json={"idle_behavior": "hold"}
            )
            assert r.status_code == 200
            cancelled = await submit(user, "never")
            assert (await user.post(f"/v1/jobs/{cancelled}/cancel", json={})).status_code == 200
            events_before = (await user.get("/v1/events")).json()
        # No close, no flush: what a SIGKILL leaves.

        second = open_controller(store_place.open())
        first.backend.close()
        assert second.had_state
        async with clients(second.app) as (bare, user):
            j = await job(user, done)
            assert (j["state"], j["exit_code"]) == ("succeeded", 0)
            assert await output(user, done) == b"hello\n"
            j = await job(user, running)
            assert (j["state"], j["attempt"], j["committed_bytes"]) == ("running", 1, 5)
            assert (await job(user, cancelled))["state"] == "killed"
            r = await user.get("/v1/jobs", params={"state": "queued"})
            assert [x["job_id"] for x in r.json()["jobs"]] == [*queued, pinned]
            devs = await devices(user)
            assert devs["box1/gpu1"]["state"] == "quarantined"
            assert devs["box1/gpu1"]["fault_id"] == "f-dirty"
            assert devs["box1/gpu2"]["idle_behavior"] == "hold"
            assert devs["box1/gpu0"]["labels"]["gpu0.mem"] == "80G"
            assert devs["box1/gpu0"]["labels"]["cpu"] == "x86"
            assert {d["host_state"] for d in devs.values()} == {"unknown"}
            sheet = (await user.get("/v1/devices/box1/gpu0/sheet")).json()
            assert (sheet["host_sheet"], sheet["device_sheet"]) == ("host sheet", "gpu0 sheet")
            events_after = (await user.get("/v1/events")).json()
            assert events_after["events"] == events_before["events"]
            assert events_after["last"] == events_before["last"]
            new = await submit(user, "echo", "new")
            assert new not in {done, running, cancelled, pinned, *queued}

            # The worker carried on through the outage: it registers again (same process),
            # its job ends normally with every byte, once.
            w.client = bare
            await w.register()
            devs = await devices(user)
            assert {d["host_state"] for d in devs.values()} == {"up"}
            r = await w.heartbeat({"gpu0": {"state": "running", "job_id": running, "attempt": 1}})
            assert r.status_code == 200
            assert (await w.output(a2, 0, b"part1part2")).json() == {"committed": 10}
            r = await w.finish(a2, "succeeded", output_bytes=10)
            assert r.status_code == 200, r.text
            assert (await job(user, running))["state"] == "succeeded"
            assert await output(user, running) == b"part1part2"
            # Only the free device gets work: gpu1 is quarantined, gpu2 on hold.
            got = await w.poll(["gpu0", "gpu1", "gpu2"])
            assert [(a["job_id"], a["device"]) for a in got] == [(queued[0], "gpu0")]
            r = await user.post("/v1/devices/box1/gpu1/clear")
            assert r.json()["cleared"] == ["f-dirty"]
            await w.heartbeat({"gpu1": {"state": "free", "faults": []}})
            got = await w.poll(["gpu1"])
            assert [(a["job_id"], a["device"]) for a in got] == [(pinned, "gpu1")]
        second.backend.close()

        third = open_controller(store_place.open())
        async with clients(third.app) as (_, user):
            assert (await job(user, running))["state"] == "succeeded"
            assert await output(user, running) == b"part1part2"
            devs = await devices(user)
            assert devs["box1/gpu1"]["faults"] == []
            ids = [x["job_id"] for x in (await user.get("/v1/jobs")).json()["jobs"]]
            assert len(ids) == len(set(ids)) == 8
        third.backend.close()


async def test_a_host_absent_past_the_recovery_grace_is_lost(store_place: StorePlace) -> None:
    with trio.fail_after(GUARD):
        first = open_controller(store_place.open())
        async with clients(first.app) as (bare, user):
            w = FakeWorker(bare)
            await w.register()
            running = await submit(user, "sleep", "1")
            [a] = await w.poll()
            assert (await w.start(a)).status_code == 200
        second = open_controller(store_place.open(), grace=120.0)
        first.backend.close()
        store, now = second.store, trio.current_time()
        store.tick(now + 119.0)
        assert store.device("box1", "gpu0").host_state == "unknown"
        assert store.job(running).state == "running"
        store.tick(now + 121.0)
        assert store.device("box1", "gpu0").host_state == "lost"
        assert store.job(running).state == "lost"
        assert store.device("box1", "gpu0").state == "quarantined"
        await second.durability.flush()
        second.backend.close()
        third = open_controller(store_place.open())
        assert (await third.durability.job_info(running)).state == "lost"
        third.backend.close()


async def test_an_adopted_job_waits_out_the_recovery_grace(store_place: StorePlace) -> None:
    # A job the same live worker carried over a registration is stored as adopted. After a
    # controller restart its host has the recovery grace to come back; the job must not be
    # ended lost report_timeout_s (60 s) in, while nobody could have mentioned it.
    with trio.fail_after(GUARD):
        first = open_controller(store_place.open())
        async with clients(first.app) as (bare, user):
            w = FakeWorker(bare)
            await w.register(instance_id="w1")
            running = await submit(user, "sleep", "1")
            [a] = await w.poll()
            assert (await w.start(a)).status_code == 200
            await w.register(instance_id="w1")  # the same process again: adopted
            await first.durability.flush()
        second = open_controller(store_place.open(), grace=300.0)
        first.backend.close()
        store, now = second.store, trio.current_time()
        store.tick(now + 61.0)
        store.tick(now + 250.0)
        assert store.job(running).state == "running"
        async with clients(second.app) as (bare, user):
            w = FakeWorker(bare)
            await w.register(instance_id="w1")
            assert (await w.finish(a)).status_code == 200
            assert (await job(user, running))["state"] == "succeeded"
        second.backend.close()


async def test_an_offer_claimed_running_after_a_restart_that_lost_its_start_runs_on(
    store_place: StorePlace,
) -> None:
    # The controller stored the offer and went down before storing the worker's start.
    # The worker, restarted too with the job's process still running, claims it at
    # register: the job runs on as started, stored so, never offered again.
    with trio.fail_after(GUARD):
        first = open_controller(store_place.open())
        async with clients(first.app) as (bare, user):
            w = FakeWorker(bare)
            await w.register(instance_id="first", protocol=2)
            running = await submit(user, "train")
            [offer] = await w.poll()
            assert (offer["job_id"], offer["attempt"]) == (running, 1)
        second = open_controller(store_place.open())
        first.backend.close()
        async with clients(second.app) as (bare, user):
            assert (await job(user, running))["state"] == "assigned"
            w.client = bare
            claim = {"job_id": running, "attempt": 1, "output_bytes": 0, "started_at": 7.0}
            decl = {"name": "gpu0", "declared_labels": {}, "faults": [], "running": claim}
            await w.register(instance_id="second", protocol=2, devices=[decl])
            r = await w.heartbeat({"gpu0": {"state": "running", "job_id": running, "attempt": 1}})
            assert r.json()["cancel"] == []
            other = await submit(user, "other")
            assert await w.poll() == []
            await second.durability.flush()
        third = open_controller(store_place.open())
        second.backend.close()
        async with clients(third.app) as (bare, user):
            j = await job(user, running)
            assert (j["state"], j["attempt"], j["host"], j["device"]) == (
                "running",
                1,
                "box1",
                "gpu0",
            )
            assert [a["status"] for a in j["attempts"]] == ["running"]
            assert (await job(user, other))["state"] == "queued"
            events = (await user.get("/v1/events")).json()["events"]
            [adopted] = [e for e in events if e["type"] == "job_adopted"]
            assert (adopted["job_id"], adopted["via"]) == (running, "register")
            # The same process, back after this restart too, finishes it: attempt 1, once.
            w.client = bare
            await w.register(instance_id="second", protocol=2, devices=[decl])
            assert (await w.output(offer, 0, b"done")).json() == {"committed": 4}
            assert (await w.finish(offer, "succeeded", output_bytes=4)).status_code == 200
            j = await job(user, running)
            assert (j["state"], j["attempt"]) == ("succeeded", 1)
            assert await output(user, running) == b"done"
        third.backend.close()


async def test_a_failing_store_answers_503_and_recovers(store_place: StorePlace) -> None:
    with trio.fail_after(GUARD):
        backend = Breakable(store_place.open())
        opened = open_controller(backend)
        acknowledged: list[str] = []
        async with clients(opened.app) as (bare, user):
            w = FakeWorker(bare)
            await w.register()
            acknowledged.append(await submit(user, "echo", "before"))
            backend.broken = True
            r = await user.post("/v1/jobs", json={"command": ["echo", "during"]})
            assert r.status_code == 503
            assert r.headers["Retry-After"] == "2"
            assert r.json()["error"] == "store_unavailable"
            # Every later change is refused at once, without touching the store...
            r = await w.heartbeat()
            assert r.status_code == 503
            r = await user.post(
                "/v1/devices/box1/gpu0/idle-behavior", json={"idle_behavior": "hold"}
            )
            assert r.status_code == 503
            assert opened.store.device("box1", "gpu0").idle_behavior == "run"
            # ...reads still work, and health says the store is failing.
            assert (await user.get("/v1/jobs")).status_code == 200
            assert (await bare.get("/v1/health")).json()["store"] == "failing"
            backend.broken = False
            await opened.durability.flush()
            assert (await bare.get("/v1/health")).json()["store"] == "ok"
            acknowledged.append(await submit(user, "echo", "after"))
        reopened = open_controller(store_place.open())
        opened.backend.close()
        known = {j.job_id for j in await all_jobs(reopened)}
        assert set(acknowledged) <= known
        reopened.backend.close()


async def test_a_stopped_database_server_answers_503_until_it_is_back(
    pg_server: PgServer,
) -> None:
    server = pg_server
    store_place = StorePlace("postgres", db=server.new_database(), server=server)
    with trio.fail_after(GUARD):
        opened = open_controller(store_place.open())
        async with clients(opened.app) as (_, user):
            before = await submit(user, "echo", "before")
            server.stop()
            try:
                r = await user.post("/v1/jobs", json={"command": ["echo", "during"]})
                assert r.status_code == 503
                assert "Retry-After" in r.headers
            finally:
                server.start()
            await opened.durability.flush()
            after = await submit(user, "echo", "after")
        opened.backend.close()
        reopened = open_controller(store_place.open())
        known = {j.job_id for j in await all_jobs(reopened)}
        assert {before, after} <= known
        reopened.backend.close()


async def test_output_past_the_cap_is_acknowledged_dropped_and_marked(
    store_place: StorePlace,
) -> None:
    with trio.fail_after(GUARD):
        opened = open_controller(store_place.open(), StoreConfig(max_output_bytes=8))
        async with clients(opened.app) as (bare, user):
            w = FakeWorker(bare)
            await w.register()
            job_id = await submit(user, "yes")
            [a] = await w.poll()
            await w.start(a)
            assert (await w.output(a, 0, b"12345")).json() == {"committed": 5}
            assert (await w.output(a, 5, b"6789abc")).json() == {"committed": 12}
            assert (await w.output(a, 12, b"def")).json() == {"committed": 15}
            assert (await w.finish(a, output_bytes=15)).status_code == 200
        opened.backend.close()
        reopened = open_controller(store_place.open())
        info = await reopened.durability.job_info(job_id)
        assert info.output_truncated
        assert reopened.backend.read_output(job_id, 0, None) == b"12345678"
        reopened.backend.close()


def target(store_place: StorePlace) -> int:
    """The schema version a backend of this kind creates: the latest for SQLite; 2 for
    PostgreSQL (version 3 changed only SQLite's layout)."""
    return SCHEMA_VERSION if store_place.kind == "sqlite" else 2


def test_a_fresh_store_gets_the_current_schema(store_place: StorePlace) -> None:
    backend = store_place.open()
    try:
        assert backend.schema_version() == target(store_place)  # type: ignore[attr-defined]
    finally:
        backend.close()


def _execute(store_place: StorePlace, statements: list[str]) -> None:
    if store_place.db is not None:
        import psycopg

        with psycopg.connect(store_place.db, autocommit=True) as conn:
            for sql in statements:
                sql = sql.replace("BLOB", "BYTEA").replace(" REAL", " DOUBLE PRECISION")
                conn.execute(re.sub(r"X'([0-9a-f]*)'", r"decode('\1', 'hex')", sql).rstrip(";"))
        return
    import sqlite3

    assert store_place.state_dir is not None
    store_place.state_dir.mkdir(mode=0o700)
    conn = sqlite3.connect(store_place.state_dir / "controller.db")
    try:
        for sql in statements:
            conn.execute(sql)
        conn.commit()
    finally:
        conn.close()


async def test_a_store_of_the_first_schema_is_migrated(store_place: StorePlace) -> None:
    text = "\n".join(
        line
        for line in (FIXTURES / "controller-schema-v1.sql").read_text().splitlines()
        if not line.startswith("--")
    )
    _execute(store_place, [s.strip() for s in text.split(";\n") if s.strip()])
    backend = store_place.open()
    try:
        assert backend.schema_version() == target(store_place)  # type: ignore[attr-defined]
        assert backend.webhook_cursors() == {}
    finally:
        backend.close()
    opened = open_controller(store_place.open())
    try:
        # Finished: not loaded at start, read from the store when asked for.
        assert not opened.store.in_memory("j-1-v1")
        old = await opened.durability.job_info("j-1-v1")
        assert old.state == "succeeded"
        assert opened.backend.read_output("j-1-v1", 0, None) == b"from schema 1\n"
        if store_place.state_dir is not None:  # SQLite's output moved out of its rows
            assert (store_place.state_dir / "output" / "j-1-v1").read_bytes() == b"from schema 1\n"
        assert old.committed_bytes == len(b"from schema 1\n")
        assert opened.store.job("j-2-v1").state == "queued"
        assert opened.store.device("box1", "gpu0").fault_id == "f-v1"
        assert opened.store.submit(["echo"]) == "j-3-v1"
    finally:
        opened.backend.close()


def test_a_store_newer_than_the_program_is_refused(store_place: StorePlace) -> None:
    store_place.open().close()
    _execute_meta = [f"UPDATE meta SET value = '{SCHEMA_VERSION + 5}' WHERE key = 'schema_version'"]
    want = target(store_place)
    if store_place.state_dir is not None:
        import sqlite3

        conn = sqlite3.connect(store_place.state_dir / "controller.db")
        conn.execute(_execute_meta[0])
        conn.commit()
        conn.close()
    else:
        _execute(store_place, _execute_meta)
    with pytest.raises(StoreOpenError) as caught:
        store_place.open()
    message = str(caught.value)
    assert "\n" not in message
    assert f"schema version {SCHEMA_VERSION + 5}" in message
    assert f"this program's {want}" in message


def _edit_meta(store_place: StorePlace, sql: str) -> None:
    """Run ``sql`` on a closed store's database, as an operator editing it by hand."""
    if store_place.db is not None:
        _execute(store_place, [sql])
        return
    import sqlite3

    assert store_place.state_dir is not None
    conn = sqlite3.connect(store_place.state_dir / "controller.db")
    try:
        conn.execute(sql)
        conn.commit()
    finally:
        conn.close()


@pytest.mark.parametrize(
    ("sql", "said"),
    [
        ("UPDATE meta SET value = 'two' WHERE key = 'schema_version'", "'two', not a"),
        ("UPDATE meta SET value = '-1' WHERE key = 'schema_version'", "'-1', not a"),
        ("UPDATE meta SET value = '0' WHERE key = 'schema_version'", "'0', not a"),
        ("UPDATE meta SET value = ' 2' WHERE key = 'schema_version'", "' 2', not a"),
        ("DELETE FROM meta WHERE key = 'schema_version'", "no schema_version row"),
    ],
)
def test_a_schema_version_edited_by_hand_is_refused_in_one_line(
    store_place: StorePlace, sql: str, said: str
) -> None:
    """Not a traceback (``int()`` of what was there), and no guess: 0 would create the
    tables again, a wrong version skip or repeat a migration."""
    store_place.open().close()
    _edit_meta(store_place, sql)
    with pytest.raises(StoreOpenError) as caught:
        store_place.open()
    message = str(caught.value)
    assert "\n" not in message
    assert said in message
    assert "set it to the version its tables are at" in message
    assert "key = 'schema_version'" in message or "('schema_version', 'N')" in message
    # Nothing was changed by the refused start: put right, the store opens as it was.
    _edit_meta(store_place, "DELETE FROM meta WHERE key = 'schema_version'")
    _edit_meta(
        store_place,
        f"INSERT INTO meta (key, value) VALUES ('schema_version', '{target(store_place)}')",
    )
    backend = store_place.open()
    try:
        assert backend.schema_version() == target(store_place)  # type: ignore[attr-defined]
    finally:
        backend.close()


@given(st.one_of(st.none(), st.integers(), st.text()))
def test_only_a_version_as_written_is_read_as_one(value: object) -> None:
    if isinstance(value, str) and re.fullmatch(r"[1-9][0-9]*", value):
        assert stored_schema_version(value, "here") == int(value)
        return
    with pytest.raises(StoreOpenError) as caught:
        stored_schema_version(value, "here")
    assert "\n" not in str(caught.value)
    assert str(caught.value).startswith("here has ")


async def test_webhook_cursors_survive_a_restart(store_place: StorePlace) -> None:
    backend = store_place.open()
    backend.save_webhook_cursor("http://hooks.example/a", 7)
    backend.save_webhook_cursor("http://hooks.example/a", 9)
    backend.close()
    backend = store_place.open()
    try:
        assert backend.webhook_cursors() == {"http://hooks.example/a": 9}
    finally:
        backend.close()


def test_job_documents_round_trip() -> None:
    # The codec keeps every field a JobInfo shows (a regression guard for new fields).
    from rc_worker.controller.persist.codec import job_doc, load_job
    from rc_worker.controller.store import Store

    store = Store(instance="t")
    job_id = store.submit(["a", "b"], select="mem>=1", env={"K": "V"}, max_runtime_s=5.0)
    record = store.known_job(job_id)
    assert record is not None
    doc = json.loads(json.dumps(job_doc(record)))
    assert load_job(doc, 0.0).info() == record.info()


async def test_retention_deletes_old_finished_jobs_and_their_output(
    store_place: StorePlace,
) -> None:
    from rc_worker.controller.serve import retention_pass

    with trio.fail_after(GUARD):
        opened = open_controller(store_place.open())
        async with clients(opened.app) as (bare, user):
            w = FakeWorker(bare)
            await w.register()
            old = await submit(user, "echo", "old")
            await w.run_one(b"old output\n")
            keep = await submit(user, "sleep", "1")
            assert await retention_pass(opened.app, 3600.0) == []
            assert await retention_pass(opened.app, 0.0) == [old]
            r = await user.get(f"/v1/jobs/{old}")
            assert (r.status_code, r.json()["error"]) == (404, "unknown_job")
        opened.backend.close()
        reopened = open_controller(store_place.open())
        assert [j.job_id for j in await all_jobs(reopened)] == [keep]
        reopened.backend.close()


async def test_retention_leaves_a_job_a_request_is_reading(store_place: StorePlace) -> None:
    """A job whose output a request is streaming is not deleted under it (its output
    would end short, and a raw HTTP client could not tell): the next pass takes it."""
    from rc_worker.controller.serve import retention_pass

    with trio.fail_after(GUARD):
        opened = open_controller(store_place.open())
        async with clients(opened.app) as (bare, user):
            w = FakeWorker(bare)
            await w.register()
            first = await submit(user, "echo", "first")
            await w.run_one(b"first output\n")
            second = await submit(user, "echo", "second")
            await w.run_one(b"second output\n")
            opened.durability.busy[first] += 1  # as DurableMiddleware pins it for a request
            assert await retention_pass(opened.app, 0.0) == [second]
            del opened.durability.busy[first]  # the request ended
            assert await retention_pass(opened.app, 0.0) == [first]
        opened.backend.close()


async def test_retention_deletes_in_batches_oldest_first(
    store_place: StorePlace, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A transaction holds the store's lock, and every commit waits for it: a large
    deletion goes a batch per transaction, so requests go on in between."""
    from rc_worker.controller import serve as serve_module

    monkeypatch.setattr(serve_module, "RETENTION_BATCH", 2)
    with trio.fail_after(GUARD):
        backend = Counting(store_place.open())
        calls: list[int] = []
        delete = backend.inner.delete_finished_before

        def counted(wall_time: float, limit: int, keep: Any = ()) -> list[tuple[str, str]]:
            gone = delete(wall_time, limit, keep)
            calls.append(len(gone))
            return gone

        backend.inner.delete_finished_before = counted  # type: ignore[method-assign]
        opened = open_controller(backend)
        async with clients(opened.app) as (bare, user):
            w = FakeWorker(bare)
            await w.register()
            finished = []
            for i in range(5):
                finished.append(await submit(user, "echo", str(i)))
                await w.run_one(f"{i}\n".encode())
            keep = await submit(user, "sleep", "1")
            assert await serve_module.retention_pass(opened.app, 0.0) == finished
            assert calls == [2, 2, 1]
            assert [j.job_id for j in await all_jobs(opened)] == [keep]
        opened.backend.close()


async def test_webhook_deliveries_not_confirmed_are_made_after_a_restart(
    store_place: StorePlace,
) -> None:
    from rc_worker.controller.serve import deliver_webhooks

    url = "http://hooks.example/in"
    got: list[int] = []
    confirm = trio.Event()

    def handler(request: httpx.Request) -> httpx.Response:
        got.append(int(request.headers["X-RC-Event-Seq"]))
        if len(got) == 2:
            confirm.set()
        return httpx.Response(200)

    with trio.fail_after(GUARD):
        backend = store_place.open()
        opened = open_controller(backend)
        store = opened.store
        for _ in range(3):
            store.cancel(store.submit(["echo"]))
        await opened.durability.flush()
        assert store.last_event_seq == 3
        # A consumer confirmed events 1 and 2 before the controller died.
        backend.save_webhook_cursor(url, 2)
        backend.close()
        reopened = open_controller(store_place.open())
        stored = trio.Event()
        save = reopened.backend.save_webhook_cursor

        def save_and_tell(url: str, seq: int) -> None:  # called in a worker thread
            save(url, seq)
            if seq == 4:
                trio.from_thread.run_sync(stored.set)

        reopened.backend.save_webhook_cursor = save_and_tell  # type: ignore[method-assign]
        from rc_worker.controller import create_app

        app = create_app(store=reopened.store, webhooks=[url], durability=reopened.durability)
        async with (
            httpx.AsyncClient(transport=httpx.MockTransport(handler)) as hooks,
            trio.open_nursery() as nursery,
        ):
            await nursery.start(deliver_webhooks, app, hooks)
            reopened.store.cancel(reopened.store.submit(["echo"]))
            await confirm.wait()
            await stored.wait()  # the confirmation of event 4, stored after its POST returned
            nursery.cancel_scope.cancel()
        assert got == [3, 4]
        assert reopened.backend.webhook_cursors() == {url: 4}
        reopened.backend.close()


async def test_rc_serve_refuses_a_store_it_cannot_use_in_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from rc_worker.controller import rc_cli

    blocker = tmp_path / "a-file"
    blocker.write_text("")
    tokens = ["--worker-token", "w", "--user-token", "u", "--listen", "127.0.0.1:0"]
    cases = [
        (["--state-dir", str(blocker / "state")], str(blocker / "state")),
        (["--db", f"postgresql:///rc?host={tmp_path}/nowhere"], "cannot connect"),
        (["--db", "mysql://x/y"], "not a PostgreSQL URI"),
    ]
    for extra, named in cases:
        with trio.fail_after(GUARD):
            assert await rc_cli.amain(["serve", *tokens, *extra], env={}) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1, err
        assert err.startswith("rc: rc serve: ")
        assert named in err
        assert "Traceback" not in err


async def test_committed_output_leaves_memory_and_is_read_from_the_store(
    store_place: StorePlace,
) -> None:
    with trio.fail_after(GUARD):
        opened = open_controller(store_place.open())
        async with clients(opened.app) as (bare, user):
            w = FakeWorker(bare)
            await w.register()
            job_id = await submit(user, "cat")
            [a] = await w.poll()
            await w.start(a)
            sent = b""
            for i in range(5):
                chunk = bytes([65 + i]) * 1000
                assert (await w.output(a, len(sent), chunk)).json() == {
                    "committed": len(sent) + len(chunk)
                }
                sent += chunk
            record = opened.store.known_job(job_id)
            assert record is not None
            assert (len(record.output), record.output_base) == (0, len(sent))
            assert await output(user, job_id) == sent
            r = await user.get(f"/v1/jobs/{job_id}/output", params={"offset": 2500})
            assert r.content == sent[2500:]
            assert (await w.finish(a, output_bytes=len(sent))).status_code == 200
            r = await user.get(f"/v1/jobs/{job_id}/output", params={"follow": "true"})
            assert r.content == sent
        opened.backend.close()
        reopened = open_controller(store_place.open())
        async with clients(reopened.app) as (_, user):
            assert await output(user, job_id) == sent
            assert (await job(user, job_id))["committed_bytes"] == len(sent)
        reopened.backend.close()


async def test_events_older_than_memory_keeps_are_read_from_the_store(
    store_place: StorePlace,
) -> None:
    with trio.fail_after(GUARD):
        opened = open_controller(store_place.open(), StoreConfig(max_events=3))
        for _ in range(7):
            opened.store.cancel(opened.store.submit(["echo"]))
        await opened.durability.flush()
        async with clients(opened.app) as (_, user):
            seqs: list[int] = []
            after = 0
            for _ in range(10):  # pages, until the end
                body = (await user.get("/v1/events", params={"after": after})).json()
                if not body["events"]:
                    break
                seqs += [e["seq"] for e in body["events"]]
                after = seqs[-1]
            assert seqs == list(range(1, 8))
            body = (await user.get("/v1/events", params={"after": 2, "limit": 2})).json()
            assert [e["seq"] for e in body["events"]] == [3, 4]
        opened.backend.close()


def test_host_documents_round_trip() -> None:
    from rc_worker.controller.messages import DeviceDecl, FaultRequest, RegisterRequest
    from rc_worker.controller.persist.codec import host_doc, load_host
    from rc_worker.controller.store import Store

    store = Store(instance="t")
    req = RegisterRequest(
        boot_id="b", devices=(DeviceDecl("gpu0", {"rack": "r1"}),), pid=9, instance_id="i-1"
    )
    session = store.register("box1", req, now=0.0).session
    store.set_idle_behavior("box1", "gpu0", "drain")
    fault = FaultRequest(
        session, "f-9", "verify_failed", "ecc errors", severity="fatal", action="replace"
    )
    store.raise_fault("box1", "gpu0", fault, now=0.0)
    h = store.known_host("box1")
    assert h is not None
    loaded = load_host(json.loads(json.dumps(host_doc(h))), 5.0)
    assert (loaded.instance_id, loaded.pid, loaded.boot_id) == ("i-1", 9, "b")
    assert loaded.devices["gpu0"].info(loaded) == h.devices["gpu0"].info(h)
    stored = loaded.devices["gpu0"].faults["f-9"]
    assert (stored.severity, stored.action) == ("fatal", "replace")


async def test_host_drain_and_retire_survive_a_restart(store_place: StorePlace) -> None:
    with trio.fail_after(GUARD):
        opened = open_controller(store_place.open())
        async with clients(opened.app) as (bare, user):
            await FakeWorker(bare, "box1").register()
            await FakeWorker(bare, "box2").register()
            r = await user.post("/v1/hosts/box1/drain")
            assert r.status_code == 200, r.text
            r = await user.post("/v1/hosts/box2/retire", json={})
            assert r.status_code == 200, r.text
        opened.backend.close()
        reopened = open_controller(store_place.open())
        assert [(d.address, d.idle_behavior) for d in reopened.store.devices()] == [
            ("box1/gpu0", "drain")
        ]
        reopened.backend.close()


def test_stored_output_reads_back_exactly_at_any_offset_and_limit(
    store_place: StorePlace,
) -> None:
    """Rows of several sizes, two jobs interleaved: every read is the slice of the whole.
    (A read seeks the row holding its offset; it must neither miss the bytes of that row
    before the offset nor run past its limit.)"""
    whole = {"j-a": bytes(range(97)), "j-b": bytes(range(200, 255))}
    pieces, pos = [], dict.fromkeys(whole, 0)
    sizes = [1, 5, 2, 13, 7, 3, 11]
    for i in range(40):
        job = "j-a" if i % 3 else "j-b"
        data = whole[job][pos[job] : pos[job] + sizes[i % len(sizes)]]
        if data:
            pieces.append((job, pos[job], data))
            pos[job] += len(data)
    assert pos == {k: len(v) for k, v in whole.items()}  # every byte was written
    backend = store_place.open()
    try:
        backend.write([Batch(generation=1, output=coalesce_output(pieces, 9))])
        for job, data in whole.items():
            for offset in range(len(data) + 2):
                for limit in (None, 1, 4, 9, 10, 1000):
                    want = data[offset:] if limit is None else data[offset : offset + limit]
                    assert backend.read_output(job, offset, limit) == want, (job, offset, limit)
    finally:
        backend.close()


async def test_a_long_streamed_body_is_committed_as_it_is_read(
    store_place: StorePlace, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Memory stays bounded by the commit size, not the body size: the store's writes
    happen while the body is still arriving, and everything is acknowledged once."""
    monkeypatch.setattr(worker_api, "COMMIT_OUTPUT_BYTES", 1000)
    with trio.fail_after(GUARD):
        backend = Counting(store_place.open())
        opened = open_controller(backend)
        async with clients(opened.app) as (bare, user):
            w = FakeWorker(bare)
            await w.register()
            job_id = await submit(user, "cat")
            [a] = await w.poll()
            await w.start(a)
            pieces = [bytes([65 + i % 26]) * 300 for i in range(20)]  # 6,000 bytes
            held: list[int] = []

            async def body() -> AsyncIterator[bytes]:
                for piece in pieces:
                    record = opened.store.known_job(job_id)
                    assert record is not None
                    held.append(len(record.output))
                    yield piece

            before = backend.writes
            r = await bare.post(
                f"/v1/jobs/{job_id}/output",
                params={"attempt": a["attempt"], "offset": 0},
                content=body(),
                headers={**w.headers, "Content-Type": "application/octet-stream"},
            )
            assert r.json() == {"committed": 6000}
            assert backend.writes - before == 5  # once 1,000 bytes wait: every fourth piece
            assert max(held) < 1000 + 300
            assert await output(user, job_id) == b"".join(pieces)
        opened.backend.close()


async def test_an_unknown_hosts_free_devices_are_not_free_capacity(
    store_place: StorePlace,
) -> None:
    """In a restarted controller's recovery grace, a host is ``unknown`` until its worker
    registers again: it has no session, so its free devices can take no work and the pool
    counts them ``absent``, not free; once registered, they are free again."""
    with trio.fail_after(GUARD):
        first = open_controller(store_place.open())
        async with clients(first.app) as (bare, _):
            await FakeWorker(
                bare, labels={"host": {}, "devices": {"gpu0": {"product": "H100"}}}
            ).register()
        reopened = open_controller(store_place.open(), grace=120.0)
        first.backend.close()
        async with clients(reopened.app) as (bare, user):
            pool = (await user.get("/v1/pool")).json()
            assert pool["hosts"]["unknown"] == 1
            assert (pool["devices"]["free"], pool["devices"]["absent"]) == (0, 1)
            assert pool["free_by_class"] == {}
            gpu0 = (await devices(user))["box1/gpu0"]
            assert (gpu0["state"], gpu0["host_state"]) == ("absent", "unknown")
            await FakeWorker(
                bare, labels={"host": {}, "devices": {"gpu0": {"product": "H100"}}}
            ).register()
            pool = (await user.get("/v1/pool")).json()
            assert (pool["devices"]["free"], pool["devices"]["absent"]) == (1, 0)
            assert pool["free_by_class"] == {"H100": 1}
        reopened.backend.close()


async def test_retired_hosts_stay_counted_across_a_restart(store_place: StorePlace) -> None:
    with trio.fail_after(GUARD):
        opened = open_controller(store_place.open())
        async with clients(opened.app) as (bare, user):
            await FakeWorker(bare, "box1").register()
            await FakeWorker(bare, "box2").register()
            r = await user.post("/v1/hosts/box2/retire", json={})
            assert r.status_code == 200, r.text
            assert (await user.get("/v1/pool")).json()["hosts"]["retired"] == 1
        opened.backend.close()
        reopened = open_controller(store_place.open())
        async with clients(reopened.app) as (_, user):
            pool = (await user.get("/v1/pool")).json()
            assert (pool["hosts"]["retired"], pool["hosts"]["unknown"]) == (1, 1)
            metrics = (await user.get("/metrics")).text
            assert 'rc_controller_hosts{state="retired"} 1.0' in metrics
        reopened.backend.close()


async def test_output_whose_file_went_under_a_running_controller_is_recounted_then_resent(
    tmp_path: Path,
) -> None:
    """SQLite: a job's output file removed under a running controller. The next output
    for it is never written past the hole, and the rest of the controller never notices:
    the answer says what is stored (nothing now), the worker resends from there out of
    its spool, and every byte lands once. Before, every commit failed until the file was
    restored: every submit, finish and output on the controller answered 503."""
    from rc_worker.controller.persist.sqlite import OUTPUT_DIR

    place = StorePlace("sqlite", state_dir=tmp_path / "state")
    with trio.fail_after(GUARD):
        opened = open_controller(place.open())
        async with clients(opened.app) as (bare, user):
            w = FakeWorker(bare, devices=("gpu0", "gpu1"))
            await w.register()
            job = await submit(user, "x")
            other = await submit(user, "y")
            [a, b] = sorted(await w.poll(wait_s=1), key=lambda x: x["job_id"] != job)
            await w.start(a)
            await w.start(b)
            assert (await w.output(a, 0, b"0123456789")).json() == {"committed": 10}
            path = place.state_dir / OUTPUT_DIR / job  # type: ignore[operator]
            path.unlink()
            r = await w.output(a, 10, b"abc")
            assert r.status_code == 200, r.text
            assert r.json() == {"committed": 0}  # resend from the start
            assert not path.read_bytes()  # nothing written past the hole
            # The rest of the controller goes on: other output, a submit, a finish.
            assert (await w.output(b, 0, b"other")).json() == {"committed": 5}
            assert (await user.get("/v1/health")).json()["store"] == "ok"
            third = await submit(user, "z")
            assert (await w.finish(b, "succeeded", output_bytes=5)).status_code == 200
            r = await w.output(a, 13, b"d")  # above what is stored: a gap
            assert (r.status_code, r.json()["committed"]) == (409, 0)
            r = await w.output(a, 0, b"0123456789abc")  # the worker's resend
            assert r.json() == {"committed": 13}
            await w.finish(a, "succeeded", exit_code=0, output_bytes=13)
            await opened.durability.flush()
            assert (await user.get(f"/v1/jobs/{job}/output")).content == b"0123456789abc"
            assert (await user.get(f"/v1/jobs/{other}/output")).content == b"other"
            assert (await user.get(f"/v1/jobs/{third}")).json()["state"] == "queued"
            events = (await user.get("/v1/events")).json()["events"]
            [recount] = [e for e in events if e["type"] == "job_output_recounted"]
            assert (recount["job_id"], recount["stored"], recount["counted"]) == (job, 13, 0)
        opened.backend.close()


async def test_a_finished_jobs_output_file_cut_under_a_running_controller_is_served_as_held(
    tmp_path: Path,
) -> None:
    """SQLite: a finished job's output file cut (then removed) under a running controller.
    No more output comes to count it again at, so the read does: what the file holds is
    served, with the length that counts it, the rest given up with an event, and a
    follower's stream ends. Before, every read of it answered 503 until the file was
    restored or rc serve restarted, and `rc logs -f` of it never ended."""
    from rc_worker.controller.persist.sqlite import OUTPUT_DIR

    place = StorePlace("sqlite", state_dir=tmp_path / "state")
    with trio.fail_after(GUARD):
        opened = open_controller(place.open())
        async with clients(opened.app) as (bare, user):
            w = FakeWorker(bare, devices=("gpu0",))
            await w.register()
            job = await submit(user, "x")
            [a] = await w.poll(wait_s=1)
            await w.start(a)
            assert (await w.output(a, 0, b"0123456789")).json() == {"committed": 10}
            await w.finish(a, "succeeded", exit_code=0, output_bytes=10)
            await opened.durability.flush()
            path = place.state_dir / OUTPUT_DIR / job  # type: ignore[operator]
            with path.open("r+b") as f:
                f.truncate(4)
            r = await user.get(f"/v1/jobs/{job}/output")
            assert (r.status_code, r.content) == (200, b"0123"), r.text
            assert r.headers["X-RC-Committed"] == "4"
            assert (await user.get(f"/v1/jobs/{job}")).json()["committed_bytes"] == 4
            path.unlink()
            r = await user.get(f"/v1/jobs/{job}/output", params={"follow": "true"})
            assert (r.status_code, r.content) == (200, b"")
            r = await user.get(f"/v1/jobs/{job}/output", params={"offset": 2})
            assert (r.status_code, r.content) == (200, b"")
            await opened.durability.flush()
            events = (await user.get("/v1/events")).json()["events"]
            recounts = [
                (e["job_id"], e["stored"], e["counted"])
                for e in events
                if e["type"] == "job_output_recounted"
            ]
            assert recounts == [(job, 10, 4), (job, 4, 0)]
            assert (await user.get("/v1/health")).json()["store"] == "ok"
        opened.backend.close()
        # What was counted is what was stored: a restart counts the same.
        reopened = open_controller(place.open())
        async with clients(reopened.app) as (_, user):
            assert (await user.get(f"/v1/jobs/{job}")).json()["committed_bytes"] == 0
        reopened.backend.close()


def test_a_commit_written_again_with_more_output_keeps_every_byte(
    store_place: StorePlace,
) -> None:
    """A commit that reached the database but whose COMMIT answer was lost (the
    connection dropped) counts as failed and is written again, by then with more output
    joined to the same row (a row at the same offset): every byte counts. PostgreSQL
    kept the shorter row, losing output the worker had been told was committed."""
    backend = store_place.open()
    try:
        backend.write([Batch(generation=1, output=(("j-1-t", 0, b"a" * 100),))])
        again = (("j-1-t", 0, b"a" * 100), ("j-1-t", 100, b"b" * 200))
        backend.write([Batch(generation=2, output=again)])
        assert backend.read_output("j-1-t", 0, None) == b"a" * 100 + b"b" * 200
        # And a shorter row at an offset already stored changes nothing.
        backend.write([Batch(generation=3, output=(("j-1-t", 0, b"a" * 50),))])
        assert backend.read_output("j-1-t", 0, None) == b"a" * 100 + b"b" * 200
    finally:
        backend.close()
