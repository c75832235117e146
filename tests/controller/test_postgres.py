"""The PostgreSQL backend against a real server (conftest.py's ``pg_server``): opening it
while other controllers open it too, and what a failed connection is taken to mean.

Its leadership (the controllers' lock) is tested in test_standby.py.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator

import psycopg
import pytest

from rc_worker.controller.persist.postgres import PostgresBackend

from .pgserver import PgServer

pytestmark = pytest.mark.filterwarnings("ignore::ResourceWarning")


@pytest.fixture
def db(pg_server: PgServer) -> Iterator[str]:
    url = pg_server.new_database()
    try:
        yield url
    finally:
        pg_server.drop_database(url)


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
