"""Two ``rc serve`` on one PostgreSQL database: one active, one standby that takes over.

Real processes on a real PostgreSQL server (conftest.py's ``pg_server``):
``rc serve`` twice, ``rc-worker run`` given both URLs, ``rc`` as a subprocess.
The active controller is killed with SIGKILL during a running job with work
queued behind it; the standby takes the lock and the worker moves to it. Jobs
wait on files the test creates, never on time.
"""

from __future__ import annotations

import logging
import os
import re
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import psycopg
import pytest
import trio
from hypothesis import given
from hypothesis import strategies as st

from rc_worker.controller.persist import StoreWriteError
from rc_worker.controller.persist.codec import Batch
from rc_worker.controller.persist.postgres import (
    LOCK_KEY,
    BadLeaderEpoch,
    PostgresBackend,
    parse_epoch,
    unreachable,
)
from rc_worker.controller.standby import wait_to_lead

from .persistkit import StorePlace
from .pgserver import PgServer
from .test_persist_restart import (
    BIN,
    GUARD,
    HOST,
    USER_TOKEN,
    WORKER_TOKEN,
    Controller,
    stop_worker,
    until,
)

pytestmark = pytest.mark.filterwarnings("ignore::ResourceWarning")


def terminate_leader(db: str) -> int:
    """End the database session holding the controllers' lock; returns its pid."""
    with psycopg.connect(db, autocommit=True) as conn:
        pid = holder(conn)
        assert pid is not None, "nobody holds the controllers' lock"
        conn.execute("SELECT pg_terminate_backend(%s)", (pid,))
        # The signal is asynchronous: wait (bounded) until that session is gone, lock and all.
        for _ in range(600):
            if not conn.execute("SELECT 1 FROM pg_stat_activity WHERE pid = %s", (pid,)).fetchone():
                return pid
            time.sleep(0.05)
        raise AssertionError(f"database session {pid} did not end after pg_terminate_backend")


# --- the backend's lock, in-process ---------------------------------------------------------


def test_one_backend_leads_and_a_takeover_fences_the_old_one(db: str) -> None:
    first, second = PostgresBackend(db), PostgresBackend(db)
    try:
        first.migrate()
        assert first.try_lead()
        assert not second.try_lead()  # a standby
        assert first.check_lead()
        terminate_leader(db)
        assert second.try_lead()  # the lock went with the session
        # The old leader's reconnect finds another epoch: it has lost, and stays lost.
        assert not first.check_lead()
        assert first.lost is not None
        assert "another controller" in first.lost
        with pytest.raises(StoreWriteError):
            first.write([Batch(generation=1)])
        assert second.check_lead()
    finally:
        first.close()
        second.close()


def test_a_leader_whose_session_ended_stops_leading_even_when_nobody_else_did(db: str) -> None:
    """Issue 14: "an active controller that loses its lock (its database session ended)
    stops serving at once". It took the lock back on a new session when the epoch was still
    its own, so whether a standby took over depended on which tried first."""
    backend = PostgresBackend(db)
    try:
        backend.migrate()
        assert backend.try_lead()
        epoch = backend.leader_epoch
        terminate_leader(db)
        assert not backend.check_lead()
        assert backend.lost is not None
        assert backend.lost.startswith(
            "its database session ended, and the controllers' lock with it; rc serve stops"
        )
        assert "\n" not in backend.lost
        with pytest.raises(StoreWriteError, match="session ended"):
            backend.write([Batch(generation=1, hosts=(("after", "{}"),))])
        with psycopg.connect(db, autocommit=True) as admin:
            assert lock_goes(admin)  # the new session took no lock, and is closed
            assert admin.execute("SELECT name FROM hosts").fetchall() == []
        again = PostgresBackend(db)  # started again by its service manager: leads anew
        try:
            assert again.try_lead()
            assert again.leader_epoch == (epoch or 0) + 1
        finally:
            again.close()
    finally:
        backend.close()


def test_a_reconnect_whose_epoch_check_failed_is_never_written_through(db: str) -> None:
    """The old leader's session ends; a standby leads (epoch 2) and its session ends too,
    letting the lock go. The old leader reconnects and takes the lock, but reading the epoch
    fails with a statement error (here: ``meta`` renamed away for a moment), not a broken
    connection. That connection must not be kept: the next write would go through it with
    no epoch check, a controller that lost leadership overwriting its successor's state."""
    first, second = PostgresBackend(db), PostgresBackend(db)
    stale = Batch(generation=1, hosts=(("stale", "{}"),))
    try:
        first.migrate()
        assert first.try_lead()
        assert first.leader_epoch == 1
        terminate_leader(db)
        assert second.try_lead()
        assert second.leader_epoch == 2
        terminate_leader(db)  # the standby's session ends too: nobody holds the lock
        with psycopg.connect(db, autocommit=True) as admin:
            admin.execute("ALTER TABLE meta RENAME TO meta_away")
            with pytest.raises(StoreWriteError):
                first.write([stale])  # on the old session, found ended
            with pytest.raises(StoreWriteError, match="meta"):
                first.write([stale])  # reconnected: it gives up; the epoch cannot be read
            admin.execute("ALTER TABLE meta_away RENAME TO meta")
            with pytest.raises(StoreWriteError, match="session ended"):
                first.write([stale])  # given up for good
            assert not first.check_lead()
            assert lock_goes(admin)
            assert admin.execute("SELECT name FROM hosts").fetchall() == []
            epoch = admin.execute("SELECT value FROM meta WHERE key = 'leader_epoch'").fetchone()
            assert epoch == ("2",)
    finally:
        first.close()
        second.close()


def test_a_standby_that_fails_to_lead_lets_the_lock_go(db: str) -> None:
    """A standby takes the lock but cannot bump the epoch (a statement error, here ``meta``
    renamed away): it does not lead, and it must not keep the lock either, or no other
    controller could lead until this one tried again."""
    first, second = PostgresBackend(db), PostgresBackend(db)
    try:
        first.migrate()
        with psycopg.connect(db, autocommit=True) as admin:
            admin.execute("ALTER TABLE meta RENAME TO meta_away")
            with pytest.raises(psycopg.Error, match="meta"):
                first.try_lead()
            assert first.leader_epoch is None
            admin.execute("ALTER TABLE meta_away RENAME TO meta")
            # The server lets go of a closed session's lock a moment after the close:
            # trying at once lost that race now and then on a loaded machine.
            assert lock_goes(admin)
        assert second.try_lead()
        assert second.leader_epoch == 1
    finally:
        first.close()
        second.close()


def set_epoch(admin: psycopg.Connection[object], value: str) -> None:
    admin.execute(
        "INSERT INTO meta (key, value) VALUES ('leader_epoch', %s)"
        " ON CONFLICT (key) DO UPDATE SET value = excluded.value",
        (value,),
    )


def holder(admin: psycopg.Connection[object]) -> int | None:
    """The pid of the session holding the controllers' lock, if one does."""
    row = admin.execute(
        "SELECT pid FROM pg_locks WHERE locktype = 'advisory' AND granted"
        " AND ((classid::bigint << 32) | objid::bigint) = %s",
        (LOCK_KEY,),
    ).fetchone()
    return None if row is None else int(row[0])


def lock_goes(admin: psycopg.Connection[object]) -> bool:
    """Whether the controllers' lock is let go: a closed session ends, and lets go of its
    locks, a moment after the client closed it, so wait for that (bounded)."""
    for _ in range(600):
        if holder(admin) is None:
            return True
        time.sleep(0.05)
    return False


def test_a_leader_that_cannot_show_its_lock_while_the_database_answers_gives_up(
    db: str,
) -> None:
    """The leader's session is terminated by an administrator and its reconnect fails a
    statement (``meta`` renamed away): the database answers, the lock is free, and this
    controller cannot show it still leads. It must not keep claiming to: another
    controller may take the lock now."""
    first, second = PostgresBackend(db), PostgresBackend(db)
    try:
        first.migrate()
        assert first.try_lead()
        with psycopg.connect(db, autocommit=True) as admin:
            admin.execute("ALTER TABLE meta RENAME TO meta_away")
            terminate_leader(db)
            assert not first.check_lead()
            assert first.lost is not None
            assert first.lost.startswith("its database session ended")
            assert '"meta" does not exist' in first.lost
            assert "\n" not in first.lost
            assert lock_goes(admin)  # the reconnect's session went, and took no lock
            admin.execute("ALTER TABLE meta_away RENAME TO meta")
        assert second.try_lead()
        assert not first.check_lead()  # given up for good, not only until the next check
        with pytest.raises(StoreWriteError):
            first.write([Batch(generation=1)])
        assert second.check_lead()
    finally:
        first.close()
        second.close()


def test_a_leader_that_cannot_reach_the_database_hopes(db: str, tmp_path: Path) -> None:
    """The other side of the rule: the session ended and the database cannot be reached
    (here: its socket is nowhere), so no other controller can prove it leads either.
    The leader keeps claiming to lead (storing nothing) while it cannot tell; once the
    database answers, it finds its session gone and stops leading."""
    backend = PostgresBackend(db)
    try:
        backend.migrate()
        assert backend.try_lead()
        backend.url = f"postgresql:///nowhere?host={tmp_path / 'no-server'}&user=postgres"
        terminate_leader(db)
        assert backend.check_lead()
        assert backend.lost is None
        backend.url = db
        assert not backend.check_lead()  # the database answers: its session is gone
        assert backend.lost is not None
        assert backend.lost.startswith("its database session ended")
    finally:
        backend.close()


def test_a_cancelled_check_keeps_the_leaders_session_and_its_lock(db: str) -> None:
    """The leader's check is cancelled by the server (``statement_timeout``, 57014) on a
    session that is alive and holds the lock. Closing it let the lock go (a standby could
    take it before the reconnect) and, with the check cancelled again on the new session,
    the leader gave up for nothing. It keeps leading, on the same session."""

    class SlowCheck(PostgresBackend):
        check_statement = "SELECT pg_sleep(30)"  # always past the session's timeout

    backend = SlowCheck(db + "&options=-c%20statement_timeout%3D200")
    try:
        backend.migrate()
        assert backend.try_lead()
        assert backend.conn is not None
        pid = backend.conn.info.backend_pid
        with psycopg.connect(db, autocommit=True) as admin:
            assert backend.check_lead()
            assert backend.lost is None
            assert holder(admin) == pid  # the same session, never let go
        backend.write([Batch(generation=1, hosts=(("kept", "{}"),))])
        assert backend.conn.info.backend_pid == pid
    finally:
        backend.close()


def test_a_leader_refused_a_new_session_while_a_standby_leads_gives_up(
    db: str, pg_server: PgServer
) -> None:
    """The leader's session ends, and the server refuses its reconnect for want of a free
    connection (here its role's CONNECTION LIMIT 1: the same FATAL 53300 as a full
    max_connections). The server answered, and a standby that kept its session takes
    the lock meanwhile: the leader must give up, not hope as if the database could not
    be reached (psycopg gives no SQLSTATE for a refused connection attempt)."""
    role = f"rc_limited_{os.getpid()}"
    name = db.split("/")[3].split("?")[0]
    url = db.replace("user=postgres", f"user={role}")
    with psycopg.connect(db, autocommit=True) as admin:
        admin.execute(f"CREATE ROLE {role} LOGIN CONNECTION LIMIT 1")
        admin.execute(f"ALTER DATABASE {name} OWNER TO {role}")
    backend = PostgresBackend(url)
    standby: psycopg.Connection[object] | None = None
    try:
        backend.migrate()
        assert backend.try_lead()
        terminate_leader(db)
        standby = psycopg.connect(url, autocommit=True)  # the role's one connection
        row = standby.execute("SELECT pg_try_advisory_lock(%s)", (LOCK_KEY,)).fetchone()
        assert row == (True,)  # the lock went with the leader's session
        assert not backend.check_lead()
        assert backend.lost is not None
        assert backend.lost == (
            "the database answers but this controller cannot show it still holds the "
            f'controllers\' lock: it refused a new session (too many connections for role "{role}")'
        )
        with pytest.raises(StoreWriteError):
            backend.write([Batch(generation=1)])
    finally:
        backend.close()
        if standby is not None:
            standby.close()
        pg_server.drop_database(db)
        with psycopg.connect(pg_server.url("postgres"), autocommit=True) as admin:
            admin.execute(f"DROP ROLE IF EXISTS {role}")


def test_a_garbled_epoch_fails_the_try_in_one_line_and_lets_the_lock_go(db: str) -> None:
    first, second = PostgresBackend(db), PostgresBackend(db)
    try:
        first.migrate()
        with psycopg.connect(db, autocommit=True) as admin:
            set_epoch(admin, "x")
            with pytest.raises(BadLeaderEpoch) as caught:
                first.try_lead()
            assert str(caught.value) == (
                "meta.leader_epoch is 'x', not a whole number: set it to one above any "
                "epoch a controller used (UPDATE meta SET value = 'N' WHERE key = "
                "'leader_epoch')"
            )
            assert first.leader_epoch is None
            # The failed try's session held the lock: closed, it let it go.
            assert lock_goes(admin)
            set_epoch(admin, "7")
        assert second.try_lead()
        assert second.leader_epoch == 8
    finally:
        first.close()
        second.close()


def test_a_leader_that_finds_a_garbled_epoch_on_reconnect_gives_up_in_one_line(
    db: str,
) -> None:
    backend = PostgresBackend(db)
    try:
        backend.migrate()
        assert backend.try_lead()
        with psycopg.connect(db, autocommit=True) as admin:
            set_epoch(admin, "one")
            terminate_leader(db)
            assert not backend.check_lead()
            assert backend.lost is not None
            assert backend.lost.startswith("meta.leader_epoch is 'one', not a whole number")
            assert lock_goes(admin)
            with pytest.raises(StoreWriteError, match="leader_epoch"):
                backend.write([Batch(generation=1)])
    finally:
        backend.close()


def test_a_leader_whose_epoch_row_was_deleted_says_so_when_it_reconnects(db: str) -> None:
    """``meta.leader_epoch`` deleted by hand while a controller leads, then its session
    ends: nobody led meanwhile (a controller that leads writes the row), so the reason it
    gives up must say what is wrong and how to fix it, not "another controller led
    meanwhile (epoch None after ours)"."""
    backend = PostgresBackend(db)
    try:
        backend.migrate()
        assert backend.try_lead()
        with psycopg.connect(db, autocommit=True) as admin:
            admin.execute("DELETE FROM meta WHERE key = 'leader_epoch'")
            terminate_leader(db)
            assert not backend.check_lead()
            assert backend.lost is not None
            assert "another controller" not in backend.lost
            assert backend.lost.startswith("meta.leader_epoch is gone (deleted by hand?)")
            assert "INSERT INTO meta (key, value) VALUES ('leader_epoch', 'N')" in backend.lost
            assert "\n" not in backend.lost
            assert lock_goes(admin)  # the reconnect that found it gone let the lock go
        # Nothing was written meanwhile; a fresh start leads again.
        again = PostgresBackend(db)
        try:
            assert again.try_lead()
        finally:
            again.close()
    finally:
        backend.close()


async def test_a_standby_facing_a_garbled_epoch_says_so_once_and_leads_once_fixed(
    db: str, caplog: pytest.LogCaptureFixture
) -> None:
    tries = 0

    class Counted(PostgresBackend):
        def try_lead(self) -> bool:
            nonlocal tries
            tries += 1
            return super().try_lead()

    backend = Counted(db)
    led: list[tuple[str, bool] | None] = []

    async def standby(task_status: trio.TaskStatus[list[str]]) -> None:
        led.append(
            await wait_to_lead(
                backend, "127.0.0.1:0", shutdown_trigger=None, task_status=task_status
            )
        )

    caplog.set_level(logging.WARNING, logger="rc_worker.controller.standby")
    try:
        backend.migrate()
        with psycopg.connect(db, autocommit=True) as admin:
            set_epoch(admin, "x")
            with trio.fail_after(GUARD):
                async with trio.open_nursery() as nursery:
                    await nursery.start(standby)
                    while tries < 3:  # noqa: ASYNC110
                        await trio.sleep(0.05)
                    said = [
                        r.getMessage() for r in caplog.records if "leader_epoch" in r.getMessage()
                    ]
                    assert said == [
                        "cannot take the controllers' lock: meta.leader_epoch is 'x', not a "
                        "whole number: set it to one above any epoch a controller used "
                        "(UPDATE meta SET value = 'N' WHERE key = 'leader_epoch')"
                    ]
                    assert not any(
                        "another controller holds" in r.getMessage() for r in caplog.records
                    )
                    set_epoch(admin, "4")
            assert led
            assert led[0] is not None
            assert backend.leader_epoch == 5
            assert backend.conn is not None
            assert holder(admin) == backend.conn.info.backend_pid  # it leads, on its session
    finally:
        backend.close()


@given(st.integers())
def test_an_epoch_written_as_a_number_reads_back(n: int) -> None:
    assert parse_epoch(str(n)) == n


@given(st.one_of(st.none(), st.text().filter(lambda t: not re.fullmatch(r"-?[0-9]+", t))))
def test_anything_else_as_an_epoch_is_one_line_naming_the_fix(value: str | None) -> None:
    # " 7", "٣" (an Arabic-Indic three) and "1_0" are numbers to int(), not to the rule.
    with pytest.raises(BadLeaderEpoch) as caught:
        parse_epoch(value)
    message = str(caught.value)
    assert "\n" not in message
    assert message.startswith("meta.leader_epoch is ")
    assert "UPDATE meta SET value" in message


def _with_sqlstate(cls: type[psycopg.Error] = psycopg.Error) -> Iterator[type[psycopg.Error]]:
    for sub in cls.__subclasses__():
        if sub.sqlstate:
            yield sub
        yield from _with_sqlstate(sub)


def test_only_failures_with_no_answer_from_the_server_count_as_unreachable() -> None:
    """psycopg raises a bare OperationalError for a failed connection attempt and a broken
    connection; every error the server sent carries its SQLSTATE, whatever its class."""
    answered = list(_with_sqlstate())
    assert psycopg.errors.AdminShutdown in answered
    assert psycopg.errors.QueryCanceled in answered
    assert [cls for cls in answered if unreachable(cls("said"))] == []
    assert unreachable(psycopg.OperationalError("connection failed: no such file"))
    assert unreachable(psycopg.errors.ConnectionTimeout("connection timeout expired"))
    assert unreachable(OSError("no route to host"))
    # Nothing else proves the server went unheard: fail closed.
    assert not unreachable(psycopg.InterfaceError("a misuse"))
    assert not unreachable(psycopg.ProgrammingError("no results to fetch"))


# --- two rc serve processes -------------------------------------------------------------------


async def health(url: str) -> tuple[int, dict[str, object]]:
    async with httpx.AsyncClient(base_url=url, timeout=5) as c:
        r = await c.get("/v1/health")
        return r.status_code, r.json()


async def status_of(url: str) -> int | None:
    """``/v1/health``'s status, or None when no answer came."""
    try:
        return (await health(url))[0]
    except httpx.HTTPError:
        return None


async def watch_roles(a: Controller, b: Controller, samples: list[tuple[bool, bool]]) -> None:
    """Record, again and again, whether each controller answers as the active one."""

    while True:
        # b first: a never leads again once b does, so asking in this order cannot
        # pair a's answer from before a takeover with b's from after it.
        b_active = (await status_of(b.url)) == 200
        a_active = (await status_of(a.url)) == 200
        samples.append((a_active, b_active))
        await trio.sleep(0.05)


async def rc(url: str, *argv: str) -> subprocess.CompletedProcess[bytes]:
    env = {**os.environ, "RC_URL": url, "RC_USER_TOKEN": USER_TOKEN}
    return await trio.run_process(
        [str(BIN / "rc"), *argv], env=env, capture_stdout=True, capture_stderr=True, check=False
    )


async def job(url: str, job_id: str) -> dict[str, object] | None:
    async with httpx.AsyncClient(
        base_url=url, headers={"Authorization": f"Bearer {USER_TOKEN}"}, timeout=5
    ) as c:
        try:
            r = await c.get(f"/v1/jobs/{job_id}")
        except httpx.HTTPError:
            return None
        body: dict[str, object] = r.json()
        return body if r.status_code == 200 else None


async def until_job(url: str, job_id: str, *states: str) -> dict[str, object]:
    while True:
        body = await job(url, job_id)
        if body is not None and body["state"] in states:
            return body
        await trio.sleep(0.1)


async def test_the_standby_takes_over_a_killed_controller_and_nothing_is_lost(
    db: str, pg_server: PgServer, tmp_path: Path
) -> None:
    place = StorePlace("postgres", db=db, server=pg_server)
    a, b = Controller(place, tmp_path), Controller(place, tmp_path)
    worker: trio.Process | None = None
    samples: list[tuple[bool, bool]] = []
    try:
        with trio.fail_after(GUARD):
            await a.start()
            await b.start()
            status, body = await health(b.url)
            assert (status, body["role"]) == (503, "standby")
            async with httpx.AsyncClient(base_url=b.url) as c:
                r = await c.get("/v1/jobs")
            assert r.status_code == 503
            assert r.json()["error"] == "standby"
            assert r.headers["Retry-After"]

            config = tmp_path / "worker.yaml"
            config.write_text(
                f"controller_url: [{a.url}, {b.url}]\n"
                f"host: {HOST}\n"
                "devices: [gpu0]\n"
                f"state_dir: {tmp_path / 'worker-state'}\n"
                f"probe_dir: {tmp_path / 'probe.d'}\n"
                f"verify_dir: {tmp_path / 'verify.d'}\n"
                f"sheet_dir: {tmp_path / 'sheets'}\n"
                "heartbeat_interval: 0.5s\n"
                "poll_wait: 2s\n"
            )
            worker = await trio.lowlevel.open_process(
                [str(BIN / "rc-worker"), "run", "--config", str(config)],
                env={**os.environ, "RC_TOKEN": WORKER_TOKEN},
                stderr=subprocess.DEVNULL,
            )
            async with trio.open_nursery() as nursery:
                nursery.start_soon(watch_roles, a, b, samples)
                await until(a, "/v1/devices", lambda body: len(body["devices"]) == 1)
                go = tmp_path / "go"
                script = f"echo begin; while [ ! -e {go} ]; do sleep 0.05; done; echo end"
                done = await rc(
                    a.url, "submit", "--device", f"{HOST}/gpu0", "--", "sh", "-c", script
                )
                assert done.returncode == 0, done.stderr
                running = done.stdout.decode().strip()
                while (await job(a.url, running) or {}).get("committed_bytes") != 6:  # noqa: ASYNC110
                    await trio.sleep(0.1)
                queued = []
                for n in range(2):
                    done = await rc(
                        a.url, "submit", "--device", f"{HOST}/gpu0", "--", "echo", f"q{n}"
                    )
                    assert done.returncode == 0, done.stderr
                    queued.append(done.stdout.decode().strip())

                await a.kill()
                # The standby's listener closes as it takes over: a request may be cut.
                while (await status_of(b.url)) != 200:  # noqa: ASYNC110
                    await trio.sleep(0.1)
                go.touch()
                finished = await until_job(b.url, running, "succeeded", "failed", "lost")
                assert finished["state"] == "succeeded"
                for job_id in queued:
                    assert (await until_job(b.url, job_id, "succeeded", "failed"))["state"] == (
                        "succeeded"
                    )
                nursery.cancel_scope.cancel()

            logs = await rc(b.url, "logs", running)
            assert logs.stdout == b"begin\nend\n"
            for n, job_id in enumerate(queued):
                assert (await rc(b.url, "logs", job_id)).stdout == f"q{n}\n".encode()
            events = await rc(b.url, "events", "--json")
            finishes = [
                line for line in events.stdout.decode().splitlines() if '"job_finished"' in line
            ]
            # Each job finished once, the one running through the takeover too.
            for job_id in [running, *queued]:
                assert sum(job_id in line for line in finishes) == 1, job_id
    finally:
        with trio.CancelScope(shield=True):
            await stop_worker(worker)
            await a.stop()
            await b.stop()
    assert samples, "the roles were never sampled"
    assert not any(both for both in (x and y for x, y in samples)), "two active controllers"
    assert any(x for x, _ in samples)
    assert any(y for _, y in samples)


async def test_a_controller_that_lost_the_lock_stops_with_one_line(
    db: str, pg_server: PgServer, tmp_path: Path
) -> None:
    place = StorePlace("postgres", db=db, server=pg_server)
    ctl = Controller(place, tmp_path)
    try:
        with trio.fail_after(GUARD):
            await ctl.start()
            assert (await status_of(ctl.url)) == 200

            def take_the_lock_from_it() -> psycopg.Connection[object]:
                thief: psycopg.Connection[object] = psycopg.connect(db, autocommit=True)
                row = thief.execute(
                    "SELECT pid FROM pg_locks WHERE locktype = 'advisory' AND granted"
                ).fetchone()
                assert row is not None
                thief.execute("SELECT pg_terminate_backend(%s)", (row[0],))
                # Queued behind the dying session: the lock is ours as soon as it is gone.
                thief.execute("SELECT pg_advisory_lock(%s)", (LOCK_KEY,))
                return thief

            thief = await trio.to_thread.run_sync(take_the_lock_from_it)
            try:
                lines, said = await stopped_with(ctl, 3)
                assert "rc serve: lost the controllers' lock" in lines[-1], said
            finally:
                thief.close()
    finally:
        with trio.CancelScope(shield=True):
            await ctl.stop()


async def test_a_controller_whose_session_ended_stops_even_when_nobody_took_the_lock(
    db: str, pg_server: PgServer, tmp_path: Path
) -> None:
    """Issue 14: an active controller that loses its lock (its database session ended)
    stops serving at once, whether or not another controller is there to lead: a service
    manager starts it again. It used to take the lock back and carry on."""
    place = StorePlace("postgres", db=db, server=pg_server)
    ctl = Controller(place, tmp_path)
    try:
        with trio.fail_after(GUARD):
            await ctl.start()
            assert (await status_of(ctl.url)) == 200
            await trio.to_thread.run_sync(terminate_leader, db)
            lines, said = await stopped_with(ctl, 3)
            assert lines[-1].startswith("rc: rc serve: lost the controllers' lock"), said
            assert "its database session ended" in lines[-1], said
    finally:
        with trio.CancelScope(shield=True):
            await ctl.stop()


async def stopped_with(ctl: Controller, status: int) -> tuple[list[str], str]:
    """Wait for the controller process to exit with ``status``; its ``rc: `` lines and all
    it said on stderr (never a traceback)."""
    assert ctl.proc is not None
    assert await ctl.proc.wait() == status
    assert ctl.proc.stderr is not None
    said = b""
    while chunk := await ctl.proc.stderr.receive_some(4096):
        said += chunk
    text = said.decode()
    assert "Traceback" not in text
    return [line for line in text.splitlines() if line.startswith("rc: ")], text


async def test_a_controller_that_cannot_show_its_lock_stops_with_one_line(
    db: str, pg_server: PgServer, tmp_path: Path
) -> None:
    """Its session is terminated and every reconnect fails a statement while the database
    answers: it stops (status 3, one line saying why) instead of serving as the active
    controller on a lock it cannot show it holds."""
    place = StorePlace("postgres", db=db, server=pg_server)
    ctl = Controller(place, tmp_path)
    try:
        with trio.fail_after(GUARD):
            await ctl.start()
            assert (await status_of(ctl.url)) == 200

            def break_it() -> None:
                with psycopg.connect(db, autocommit=True) as admin:
                    admin.execute("ALTER TABLE meta RENAME TO meta_away")
                terminate_leader(db)

            await trio.to_thread.run_sync(break_it)
            lines, said = await stopped_with(ctl, 3)
            assert lines[-1].startswith("rc: rc serve: lost the controllers' lock"), said
            assert "its database session ended" in lines[-1], said
    finally:
        with trio.CancelScope(shield=True):
            await ctl.stop()
