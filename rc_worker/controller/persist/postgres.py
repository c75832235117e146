"""The fleet backend: a PostgreSQL database through psycopg 3.

Everything lives in the database, job output included, so another controller
process pointed at the same database can take over. The URL is any libpq
connection URI; the password comes from the URI, ``PGPASSWORD`` or
``~/.pgpass``, as libpq does. A dropped connection is reopened at the next
write, so the controller recovers by itself when the server comes back.

Several controllers may share one database: one is active, holding a session
advisory lock (:data:`LOCK_KEY`) on its connection; the others are standbys
that try the lock now and then (:meth:`PostgresBackend.try_lead`). Taking it
bumps a ``leader_epoch`` kept in the ``meta`` table. A connection that breaks
loses the lock with it, so every reconnect of the active takes the lock again
and checks the epoch is still its own: if another controller led in between
(or leads now), :class:`LeadershipLost` is raised, nothing more is written on
this connection, and ``rc serve`` stops. A new connection is kept only once
that check has passed; one whose check failed part-way is closed, so no write
goes through a session whose epoch was never compared. Writes go through the lock-holding
session, so a controller that lost the lock can no longer store anything, and
so can no longer answer ``200`` for anything that changes state.
"""

from __future__ import annotations

from typing import Any
from urllib.parse import urlsplit, urlunsplit

import psycopg

from rc_worker.controller.persist import StoreOpenError
from rc_worker.controller.persist.sql import SqlBackend

__all__ = ["LOCK_KEY", "LeadershipLost", "PostgresBackend", "redact"]

CONNECT_TIMEOUT_S = 10
LOCK_KEY = 0x72635F73  # "rc_s": the one advisory lock the controllers of a database share
"""The key of the session advisory lock the active controller holds."""


class LeadershipLost(Exception):
    """This controller no longer holds the controllers' lock: another one leads."""


def redact(url: str) -> str:
    """The URL without its password, fit for a log line or an error."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    netloc = parts.netloc.replace(f":{parts.password}@", ":***@")
    return urlunsplit(parts._replace(netloc=netloc))


class PostgresBackend(SqlBackend):
    # Version 3 changes only SQLite's layout (its output moved into files). A PostgreSQL
    # store stays at 2, so that a standby still running the previous release can take
    # over from an upgraded controller (an old program refuses a newer schema).
    schema_target = 2
    real = "DOUBLE PRECISION"
    blob = "BYTEA"
    ph = "%s"
    errors = (psycopg.Error, OSError, LeadershipLost)

    def __init__(self, url: str) -> None:
        super().__init__()
        self.url = url
        self.description = f"database {redact(url)}"
        self.conn: psycopg.Connection[Any] | None = None
        self.leader_epoch: int | None = None
        """Set once this controller leads (:meth:`try_lead`)."""
        self.lost: str | None = None
        """Why leadership was lost, once it was; never cleared."""
        try:
            self._connect()
        except psycopg.Error as e:
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise StoreOpenError(
                f"cannot connect to {self.description}: {first}; check --db / RC_DB"
            ) from e

    def _connect(self) -> psycopg.Connection[Any]:
        if self.lost is not None:
            raise LeadershipLost(self.lost)
        if self.conn is not None and self.conn.broken and not self.conn.closed:
            self.conn.close()
        if self.conn is None or self.conn.closed:
            conn = psycopg.connect(self.url, connect_timeout=CONNECT_TIMEOUT_S)
            if self.leader_epoch is not None:
                # The old session, and the lock with it, is gone.
                try:
                    self._lead_again(conn)
                except BaseException:
                    # Kept only once the check passed: a check cut short by a statement
                    # error leaves a live session, maybe holding the lock, whose epoch was
                    # never compared; kept, the next call would write through it unchecked.
                    # Closed, the lock goes with it and the next call checks afresh.
                    conn.close()
                    raise
            self.conn = conn
        return self.conn

    # --- leading ----------------------------------------------------------------------------

    def try_lead(self) -> bool:
        """Take the controllers' lock if no other session holds it; True once this leads.

        Call from a thread. Raises the driver's error when the database cannot be reached.
        """
        with self.lock:
            conn = self._connect()
            locked = False
            try:
                with conn.cursor() as cur:
                    cur.execute("SELECT pg_try_advisory_lock(%s)", (LOCK_KEY,))
                    row = cur.fetchone()
                    if not (row and row[0]):
                        conn.rollback()
                        return False
                    locked = True
                    cur.execute("SELECT value FROM meta WHERE key = 'leader_epoch'")
                    found = cur.fetchone()
                    epoch = (int(found[0]) if found else 0) + 1
                    self._put_meta(cur, [("leader_epoch", str(epoch))])
                conn.commit()
            except psycopg.Error:
                if locked:
                    # A rollback keeps a session's advisory lock: this session would hold
                    # it while not leading, and no other controller could take over until
                    # this one tried again. Closed, the lock goes with the session.
                    conn.close()
                else:
                    self._rollback()
                raise
            self.leader_epoch = epoch
            return True

    def _lead_again(self, conn: psycopg.Connection[Any]) -> None:
        assert self.leader_epoch is not None
        with conn.cursor() as cur:
            cur.execute("SELECT pg_try_advisory_lock(%s)", (LOCK_KEY,))
            row = cur.fetchone()
            got = bool(row and row[0])
            epoch = None
            if got:
                cur.execute("SELECT value FROM meta WHERE key = 'leader_epoch'")
                found = cur.fetchone()
                epoch = int(found[0]) if found else None
        conn.commit()
        if not got:
            self._lose(conn, "another controller holds the controllers' lock")
        if epoch != self.leader_epoch:
            self._lose(conn, f"another controller led meanwhile (epoch {epoch} after ours)")

    def _lose(self, conn: psycopg.Connection[Any], why: str) -> None:
        self.lost = why
        conn.close()
        raise LeadershipLost(why)

    def check_lead(self) -> bool:
        """Whether this controller still leads: the lock's session is alive, or was
        reopened with the lock and our epoch. False once lost; True (hoping) while the
        database is unreachable, since no other controller can lead through it either
        without the lock this session held."""
        if self.lost is not None:
            return False
        with self.lock:
            for _ in range(2):  # a session found dead is reopened (and relocked) at once
                try:
                    conn = self._connect()
                    with conn.cursor() as cur:
                        cur.execute("SELECT 1")
                    conn.commit()
                    break
                except LeadershipLost:
                    return False
                except (psycopg.Error, OSError):
                    self._rollback()
                    if self.conn is not None and not self.conn.closed:
                        self.conn.close()
        return self.lost is None

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
