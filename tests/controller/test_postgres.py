"""The PostgreSQL backend against a real server (conftest.py's ``pg_server``): opening it
while other controllers open it too, and what a failed connection is taken to mean.

Its leadership (the controllers' lock) is tested in test_standby.py.
"""

from __future__ import annotations

import threading
from pathlib import Path

import psycopg
import pytest
from hypothesis import assume, given
from hypothesis import strategies as st

from rc_worker.controller.persist import StoreOpenError
from rc_worker.controller.persist.opening import open_backend
from rc_worker.controller.persist.postgres import (
    _REFUSALS,
    PostgresBackend,
    connect_failed,
    connect_refusal,
    unreachable,
)

from .pgserver import PgServer

pytestmark = pytest.mark.filterwarnings("ignore::ResourceWarning")


@pytest.mark.parametrize("attempt", range(3))
def test_controllers_started_together_on_a_fresh_database_all_open_it(
    db: str, attempt: int
) -> None:
    """Each found no tables and created them; all but one failed on the catalog's unique
    index (``pg_type_typname_nsp_index``), a start refused in several lines. Four at once,
    three times: without the migration lock every try lost at least one."""
    backends = [PostgresBackend(db) for _ in range(4)]
    ready = threading.Barrier(len(backends))
    found: list[int | BaseException] = []

    def migrate(backend: PostgresBackend) -> None:
        ready.wait(timeout=30)
        try:
            found.append(backend.migrate())
        except Exception as e:
            found.append(e)

    threads = [threading.Thread(target=migrate, args=(b,)) for b in backends]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=60)
        assert not any(t.is_alive() for t in threads)
        # One created the schema (found 0); the others found it made (found 2).
        assert sorted(found, key=repr) == [0, 2, 2, 2], found
        with psycopg.connect(db, autocommit=True) as conn:
            rows = conn.execute("SELECT key, value FROM meta").fetchall()
        assert rows == [("schema_version", "2")]
    finally:
        for b in backends:
            b.close()


# --- a failed connection attempt: no answer, or what the server answered ------------------

_AT = 'connection failed: connection to server on socket "/run/pg/.s.PGSQL.5432" failed: '
_TCP = 'connection failed: connection to server at "10.0.0.5", port 5432 failed: '

# Messages as psycopg 3.3 gave them against the PostgreSQL 15 test server (the failed
# connections of the investigation), and what each is taken to be: (SQLSTATE, whether no
# other session can exist there). None: the server could not be reached.
CONNECT_FAILURES: list[tuple[str, tuple[str, bool] | None]] = [
    (_AT + 'FATAL:  database "nosuchdb" does not exist', ("3D000", False)),
    (_AT + 'FATAL:  role "nosuchrole" does not exist', ("28000", False)),
    (_AT + 'FATAL:  role "nolog" is not permitted to log in', ("28000", False)),
    (_AT + 'FATAL:  password authentication failed for user "pw"', ("28P01", False)),
    (_AT + "fe_sendauth: no password supplied", ("28P01", False)),
    (
        _TCP + 'FATAL:  no pg_hba.conf entry for host "10.0.0.9", user "rc", database "rc", '
        "no encryption",
        ("28000", False),
    ),
    (
        _AT + 'FATAL:  permission denied for database "priv"\n'
        "DETAIL:  User does not have CONNECT privilege.",
        ("42501", False),
    ),
    (_AT + 'FATAL:  database "closed" is not currently accepting connections', ("55000", False)),
    (_AT + "FATAL:  sorry, too many clients already", ("53300", False)),
    (_AT + 'FATAL:  too many connections for role "lim"', ("53300", False)),
    (
        _AT + "FATAL:  remaining connection slots are reserved for roles with the SUPERUSER "
        "attribute",
        ("53300", False),
    ),
    (_AT + "FATAL:  the database system is shutting down", ("57P03", False)),
    (_AT + "FATAL:  the database system is starting up", ("57P03", True)),
    (_AT + "FATAL:  the database system is in recovery mode", ("57P03", True)),
    (_AT + "FATAL:  the database system is not yet accepting connections", ("57P03", True)),
    (_AT + "FATAL:  a refusal this program does not know", ("", False)),
    # libpq before 14 gave the server's answer alone.
    ('connection failed: FATAL:  database "x" does not exist', ("3D000", False)),
    (
        # psycopg lists each address it tried; the first answer counts.
        "connection failed: Multiple connection attempts failed. All failures were:\n"
        "- host: 'db', port: '5432', hostaddr: '::1': " + _TCP + "Connection refused\n"
        "- host: 'db', port: '5432', hostaddr: '10.0.0.5': " + _TCP + "FATAL:  sorry, too "
        "many clients already",
        ("53300", False),
    ),
    (
        'connection is bad: connection to server on socket "/run/pg/.s.PGSQL.5432" failed: '
        "No such file or directory\n\tIs the server running locally and accepting "
        "connections on that socket?",
        None,
    ),
    (
        _TCP + "Connection refused\n\tIs the server running on that host and accepting "
        "TCP/IP connections?",
        None,
    ),
    (_TCP + "timeout expired", None),
    (_TCP + "server closed the connection unexpectedly", None),
    ("failed to resolve host 'db': [Errno -2] Name or service not known", None),
    ("consuming input failed: server closed the connection unexpectedly", None),
]


@pytest.mark.parametrize(("message", "taken_as"), CONNECT_FAILURES)
def test_what_a_failed_connection_attempt_is_taken_to_be(
    message: str, taken_as: tuple[str, bool] | None
) -> None:
    refusal = connect_refusal(message)
    got = None if refusal is None else (refusal.sqlstate, refusal.nobody_in)
    assert got == taken_as
    # The leader's rule: hope only when no other controller can lead through the server.
    error = psycopg.OperationalError(message)
    assert unreachable(error) == (taken_as is None or taken_as[1])
    line = connect_failed("database postgresql:///rc", error)
    assert "\n" not in line
    assert line.startswith("cannot connect to database postgresql:///rc: ")
    if taken_as is None:
        assert "could not be reached" in line
    else:
        assert refusal is not None
        assert refusal.said in line
        assert "could not be reached" not in line
        if taken_as[0] != "57P03":
            assert "not a network problem" in line


@given(st.text())
def test_a_connection_failure_is_one_line_whatever_it_said(message: str) -> None:
    line = connect_failed("database d", psycopg.OperationalError(message))
    assert "\n" not in line
    assert "\r" not in line


@given(st.text().filter(lambda t: ":  " not in t and "fe_sendauth" not in t))
def test_words_with_no_answer_from_the_server_in_them_are_no_answer(message: str) -> None:
    """The server's answer comes as ``SEVERITY:  text`` (two spaces); libpq's own words
    never have that, and stay "could not be reached", as every failed attempt was before."""
    assume(not any(p.search(message) for p, _, _ in _REFUSALS))
    assert connect_refusal(message) is None
    assert unreachable(psycopg.OperationalError(message))


def test_a_missing_database_is_refused_at_start_in_one_line_naming_it(
    pg_server: PgServer,
) -> None:
    url = pg_server.url("rc_no_such_database")
    with pytest.raises(StoreOpenError) as caught:
        open_backend(db=url)
    message = str(caught.value)
    assert message == (
        f'cannot connect to database {url}: database "rc_no_such_database" does not exist; '
        "the server answered, so not a network problem: create the database (createdb "
        "NAME), or fix its name in --db / RC_DB"
    )


def test_a_missing_role_is_refused_at_start_in_one_line_naming_it(
    pg_server: PgServer, db: str
) -> None:
    url = db.replace("user=postgres", "user=rc_no_such_role")
    with pytest.raises(StoreOpenError) as caught:
        open_backend(db=url)
    message = str(caught.value)
    assert "\n" not in message
    assert 'role "rc_no_such_role" does not exist' in message
    assert "not a network problem" in message
    assert "create the role on the server, or fix the user in --db / RC_DB" in message


def test_a_server_that_is_not_there_is_unreachable_at_start(tmp_path: Path) -> None:
    url = f"postgresql:///rc?host={tmp_path}/nowhere&user=postgres"
    with pytest.raises(StoreOpenError) as caught:
        open_backend(db=url)
    message = str(caught.value)
    assert "\n" not in message
    assert "the server could not be reached" in message
    assert "No such file or directory" in message
    assert "check the host and port in --db / RC_DB" in message
