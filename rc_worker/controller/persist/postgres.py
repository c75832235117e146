"""The fleet backend: a PostgreSQL database through psycopg 3.

Everything lives in the database, job output included, so another controller
process pointed at the same database can take over. The URL is any libpq
connection URI; the password comes from the URI, ``PGPASSWORD`` or
``~/.pgpass``, as libpq does. A dropped connection is reopened at the next
write, so the controller recovers by itself when the server comes back.
"""

from __future__ import annotations

from typing import Any
from urllib.parse import urlsplit, urlunsplit

import psycopg

from rc_worker.controller.persist import StoreOpenError
from rc_worker.controller.persist.sql import SqlBackend

__all__ = ["PostgresBackend", "redact"]

CONNECT_TIMEOUT_S = 10


def redact(url: str) -> str:
    """The URL without its password, fit for a log line or an error."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    netloc = parts.netloc.replace(f":{parts.password}@", ":***@")
    return urlunsplit(parts._replace(netloc=netloc))


class PostgresBackend(SqlBackend):
    real = "DOUBLE PRECISION"
    blob = "BYTEA"
    ph = "%s"
    errors = (psycopg.Error, OSError)

    def __init__(self, url: str) -> None:
        super().__init__()
        self.url = url
        self.description = f"database {redact(url)}"
        self.conn: psycopg.Connection[Any] | None = None
        try:
            self._connect()
        except psycopg.Error as e:
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise StoreOpenError(
                f"cannot connect to {self.description}: {first}; check --db / RC_DB"
            ) from e

    def _connect(self) -> psycopg.Connection[Any]:
        if self.conn is not None and self.conn.broken and not self.conn.closed:
            self.conn.close()
        if self.conn is None or self.conn.closed:
            self.conn = psycopg.connect(self.url, connect_timeout=CONNECT_TIMEOUT_S)
        return self.conn

    def _cursor(self) -> Any:
        return self._connect().cursor()

    def _begin(self, cur: Any) -> None:
        pass  # psycopg opens a transaction at the first statement

    def _commit(self) -> None:
        assert self.conn is not None
        self.conn.commit()

    def _rollback(self) -> None:
        conn = self.conn
        if conn is None or conn.closed:
            return
        try:
            conn.rollback()
        except psycopg.Error:
            # The connection is broken: drop it, the next call connects again.
            conn.close()

    def _has_schema(self, cur: Any) -> bool:
        cur.execute("SELECT to_regclass('meta') IS NOT NULL")
        row = cur.fetchone()
        return bool(row and row[0])

    def close(self) -> None:
        if self.conn is not None:
            self.conn.close()
