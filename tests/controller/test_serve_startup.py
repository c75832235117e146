"""``rc serve`` refusing to start, in one line (real processes).

One ``rc serve`` per state directory: two controllers on one SQLite database each
handed out the same job ids and event numbers from their own memory and overwrote each
other's records: an acknowledged submit was lost. The second is now refused in one
line naming the first's pid; the lock goes with the process that held it, SIGKILL
included. An address in use is one line too.
"""

from __future__ import annotations

import gc
import socket
import sqlite3
import warnings
from pathlib import Path
from typing import Any, cast

import httpx
import pytest
import trio

from rc_worker.controller import rc_cli
from rc_worker.controller import rc_serve as rc_serve_module
from rc_worker.controller.persist import Backend
from rc_worker.controller.persist.opening import open_backend
from rc_worker.controller.standby import Leader, wait_to_lead

from .rc_procs import RC, USER, WORKER, rc_serve

GUARD = 60


async def rc_serve_ends(listen: str, *store: str) -> tuple[int, str]:
    """Start ``rc serve`` (test tokens, ``store`` flags) where it is expected to stop by
    itself: its status and stderr."""
    with trio.fail_after(GUARD):
        done = await trio.run_process(
            [
                RC,
                "serve",
                "--listen",
                listen,
                "--user-token",
                USER,
                "--worker-token",
                WORKER,
                *store,
            ],
            check=False,
            capture_stdout=True,
            capture_stderr=True,
        )
    return done.returncode, done.stderr.decode()


async def test_a_second_rc_serve_on_one_state_dir_is_refused_in_one_line(tmp_path: Path) -> None:
    store = ("--state-dir", str(tmp_path / "state"))
    with trio.fail_after(GUARD):
        async with rc_serve(store=store) as first:
            status, err = await rc_serve_ends("127.0.0.1:0", *store)
            assert status == 2, err
            assert err.count("\n") == 1, err
            assert f"is in use by another rc serve (pid {first.proc.pid})" in err
            assert "Traceback" not in err
            async with httpx.AsyncClient(base_url=first.url) as c:
                assert (await c.get("/v1/health")).status_code == 200  # the first serves on
        # rc_serve ended the first with SIGKILL: its lock went with it.
        async with rc_serve(store=store) as again, httpx.AsyncClient(base_url=again.url) as c:
            assert (await c.get("/v1/health")).status_code == 200


async def test_an_address_in_use_is_one_line_and_status_1(tmp_path: Path) -> None:
    """Not hypercorn's bind error in three nested exception groups; the store is not even
    opened (no lock file, no database)."""
    state = tmp_path / "state"
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        listen = f"127.0.0.1:{held.getsockname()[1]}"
        status, err = await rc_serve_ends(listen, "--state-dir", str(state))
    assert status == 1, err
    assert err == (
        f"rc: rc serve: cannot listen on {listen} (Address already in use); stop what holds it,"
        " or choose another --listen\n"
    )
    assert not state.exists()


@pytest.mark.parametrize("listen", ["127.0.0.1:99999", "127.0.0.1:http", ":8080"])
async def test_a_listen_address_that_is_not_one_is_one_line_and_status_2(
    tmp_path: Path, listen: str
) -> None:
    state = tmp_path / "state"
    status, err = await rc_serve_ends(listen, "--state-dir", str(state))
    assert status == 2, err
    assert err == (f"rc: rc serve: --listen {listen!r} is not HOST:PORT (a port of 0 to 65535)\n")
    assert not state.exists()


async def test_a_store_whose_records_cannot_be_read_is_one_line_and_status_2(
    tmp_path: Path,
) -> None:
    """A record garbled by hand was read after the store opened, inside the server's
    nursery: an exception-group traceback ending in "child exited without calling
    task_status.started()", status 1. Now the store-open line and its status 2."""
    state = tmp_path / "state"
    with trio.fail_after(GUARD):
        async with rc_serve(store=("--state-dir", str(state))) as first:
            headers = {"Authorization": f"Bearer {USER}"}
            async with httpx.AsyncClient(base_url=first.url, headers=headers) as c:
                r = await c.post("/v1/jobs", json={"command": ["true"]})
                assert r.status_code == 200, r.text
    with sqlite3.connect(state / "controller.db") as conn:
        conn.execute("UPDATE jobs SET data = '{}'")
    conn.close()
    status, err = await rc_serve_ends("127.0.0.1:0", "--state-dir", str(state))
    assert status == 2, err
    assert err == (
        f"rc: rc serve: cannot read the state stored in state directory {state}: a record is "
        "not one this version can read (KeyError: 'spec'); restore a backup of the store, or "
        "start on an empty one\n"
    )


SERVE = ["serve", "--listen", "{listen}", "--user-token", USER, "--worker-token", WORKER]


@pytest.mark.parametrize("role", ["active", "standby"])
async def test_an_address_taken_after_the_check_is_one_line_and_status_1(
    request: pytest.FixtureRequest,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    role: str,
) -> None:
    """Free when check_listen asked, taken by the bind (while the store opened, or while this
    controller waited as a standby): hypercorn's bind error came out of the server's
    nursery as an exception-group traceback; now check_listen's line and status. And no
    socket is left open: hypercorn's own bind left its socket to the garbage collector, a
    ResourceWarning that failed whichever test happened to collect it."""
    # The race, made certain: the check passes, the address is held all along.
    monkeypatch.setattr(rc_serve_module, "check_listen", lambda args: None)
    store = ["--memory"]
    leader = None
    if role == "standby":
        db: str = request.getfixturevalue("db")
        leader = open_backend(db=db)
        assert getattr(leader, "try_lead")()  # noqa: B009 - a PostgresBackend's
        store = ["--db", db]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", ResourceWarning)
        try:
            with socket.socket() as held:
                held.bind(("127.0.0.1", 0))
                held.listen()
                listen = f"127.0.0.1:{held.getsockname()[1]}"
                with trio.fail_after(GUARD):
                    argv = [arg.format(listen=listen) for arg in SERVE]
                    status = await rc_cli.amain([*argv, *store], env={})
        finally:
            if leader is not None:
                leader.close()
            # Here, even when the test fails: collected later, a leak fails another test.
            gc.collect()
    assert [str(w.message) for w in caught if w.category is ResourceWarning] == []
    err = capsys.readouterr().err
    assert status == 1, err
    assert err.splitlines()[-1] == (
        f"rc: rc serve: cannot listen on {listen} (Address already in use); stop what holds it,"
        " or choose another --listen"
    )
    assert "Traceback" not in err


async def test_a_standby_stopped_before_it_listens_stops_cleanly(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """run_serve returning before it reported itself listening (wait_to_lead's None) was
    "child exited without calling task_status.started()" in an exception group."""

    class Database:
        description = "a database"
        closed = False

        def try_lead(self) -> bool:
            return False

        def close(self) -> None:
            self.closed = True

    async def stopped(*args: object, **kwargs: object) -> None:
        return None

    monkeypatch.setattr(rc_serve_module, "wait_to_lead", stopped)
    backend = Database()
    argv = [arg.format(listen="127.0.0.1:0") for arg in SERVE[1:]]
    with trio.fail_after(GUARD):
        status = await rc_serve_module._serve_until_signalled(argv, {}, cast(Backend, backend))
    assert status == 0
    assert capsys.readouterr().err == "rc: controller stopped\n"
    assert backend.closed


async def test_an_os_error_opening_the_store_is_not_called_an_address_problem(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Only the bind's failure is "cannot listen on": an OSError while the store's state is
    read (a file it may not read, say) is not said to be the address's."""

    def refused(*args: object, **kwargs: object) -> object:
        raise PermissionError(13, "Permission denied", str(tmp_path / "state"))

    monkeypatch.setattr(rc_serve_module, "open_store", refused)
    argv = ["serve", "--listen", "127.0.0.1:0", "--user-token", USER, "--worker-token", WORKER]
    with trio.fail_after(GUARD), pytest.RaisesGroup(PermissionError, flatten_subgroups=True):
        await rc_cli.amain([*argv, "--state-dir", str(tmp_path / "state")], env={})
    assert "cannot listen" not in capsys.readouterr().err


async def test_an_address_taken_after_a_standby_took_over_is_one_line_and_status_1(
    db: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A standby listens, takes the lock, stops its listener and binds again as the active
    controller: an address taken in between was a traceback (the standby had already said
    it listens, so the bind's error was passed on as is); now check_listen's line and
    status, as at a normal start."""
    leader = open_backend(db=db)
    assert getattr(leader, "try_lead")()  # noqa: B009 - a PostgresBackend's
    held = socket.socket()
    taken: list[str] = []

    class FreeTheLock(trio.TaskStatus[list[str]]):
        def __init__(self, inner: trio.TaskStatus[list[str]]) -> None:
            self.inner = inner

        def started(self, value: list[str] | None = None) -> None:
            self.inner.started(value)
            leader.close()  # the standby listens: now let it take the lock

    async def then_taken(backend: Leader, listen: str, **kwargs: Any) -> tuple[str, bool] | None:
        task_status = FreeTheLock(kwargs.pop("task_status"))
        chosen = await wait_to_lead(backend, listen, task_status=task_status, **kwargs)
        assert chosen is not None
        # The standby's listener is closed: something else takes its port before the
        # active controller binds it.
        host, _, port = chosen[0].rpartition(":")
        # As the servers bind: a connection of the standby's left in TIME_WAIT on the
        # port must not fail this bind (it failed once so); listening, it still keeps
        # the active controller's bind out.
        held.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        held.bind((host, int(port)))
        held.listen()
        taken.append(chosen[0])
        return chosen

    monkeypatch.setattr(rc_serve_module, "wait_to_lead", then_taken)
    try:
        with trio.fail_after(GUARD):
            argv = [arg.format(listen="127.0.0.1:0") for arg in SERVE]
            status = await rc_cli.amain([*argv, "--db", db], env={})
    finally:
        held.close()
        leader.close()
    err = capsys.readouterr().err
    assert taken, err
    assert status == 1, err
    assert err.splitlines() == [
        f"rc: controller listening on http://{taken[0]}",  # the standby
        f"rc: rc serve: cannot listen on {taken[0]} (Address already in use); stop what holds"
        " it, or choose another --listen",
    ]
