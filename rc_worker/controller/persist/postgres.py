"""The fleet backend: a PostgreSQL database through psycopg 3.

Everything lives in the database, job output included, so another controller
process pointed at the same database can take over. The URL is any libpq
connection URI; the password comes from the URI, ``PGPASSWORD`` or
``~/.pgpass``, as libpq does. A dropped connection is reopened at the next
call, so a standby recovers by itself when the server comes back; the active
controller's session held the lock, and it stops (below).

Several controllers may share one database: one is active, holding a session
advisory lock (:data:`LOCK_KEY`) on its connection; the others are standbys
that try the lock now and then (:meth:`PostgresBackend.try_lead`). Taking it
bumps a ``leader_epoch`` kept in the ``meta`` table. A session that ends (its
connection broken, or terminated) loses the lock with it, and the active
controller then stops leading, at once and for good: the first new session it
opens raises :class:`LeadershipLost` (saying, from the epoch, whether another
controller led meanwhile), is closed, and ``rc serve`` stops (status 3), so
that a service manager starts it again, as a standby or to lead anew. It never
takes the lock back on a new session, so no write goes through a session that
did not take the lock as a fresh leader. Writes go through the lock-holding
session, so a controller that lost the lock can no longer store anything, and
so can no longer answer ``200`` for anything that changes state.

Every failure after the lock was taken closes the session, so the lock never
outlives a try that did not end in leading. The active controller keeps
claiming to lead without proof only while the database cannot be reached, or
has no session at all (starting up, recovering after a crash), so that no other
controller can lead through it either (:func:`unreachable`); a database that
answers but lets it prove nothing ends its leadership
(:meth:`PostgresBackend.check_lead`), a refused reconnect included (a login
refused, no connection to spare, the server shutting down: psycopg gives those no
SQLSTATE, and :func:`connect_refusal` reads the server's answer from the message).
"""

from __future__ import annotations

import re
from typing import Any, NoReturn
from urllib.parse import urlsplit, urlunsplit

import attrs
import psycopg

from rc_worker.controller.persist import StoreOpenError
from rc_worker.controller.persist.sql import SqlBackend
from rc_worker.core.errors import RcWorkerError

__all__ = [
    "LOCK_KEY",
    "MIGRATE_KEY",
    "BadLeaderEpoch",
    "LeadershipLost",
    "PostgresBackend",
    "Refusal",
    "connect_failed",
    "connect_refusal",
    "parse_epoch",
    "redact",
    "unreachable",
]

CONNECT_TIMEOUT_S = 10
LOCK_KEY = 0x72635F73  # "rc_s": the one advisory lock the controllers of a database share
"""The key of the session advisory lock the active controller holds."""
MIGRATE_KEY = 0x72635F6D  # "rc_m"
"""The key of the transaction advisory lock a controller holds while it creates or migrates
the schema. Not :data:`LOCK_KEY`: an active controller holds that one for as long as it
runs, and every other controller checks the schema at start, before it tries to lead."""


class LeadershipLost(Exception):
    """This controller no longer holds the controllers' lock: another one leads."""


class BadLeaderEpoch(RcWorkerError):
    """``meta.leader_epoch`` is not a whole number: no controller can lead until it is fixed."""


_EPOCH = re.compile(r"-?[0-9]+")

_EPOCH_GONE = (
    "meta.leader_epoch is gone (deleted by hand?), so this controller cannot show that no "
    "other led meanwhile: put it back, one above any epoch a controller used (INSERT INTO "
    "meta (key, value) VALUES ('leader_epoch', 'N')), then start this controller again"
)


def parse_epoch(value: object) -> int:
    """``meta.leader_epoch`` as stored (the text of a whole number); :class:`BadLeaderEpoch`,
    naming the value and the fix, for anything else."""
    if isinstance(value, str) and _EPOCH.fullmatch(value):
        return int(value)
    shown = "NULL" if value is None else repr(value)
    if len(shown) > 40:
        shown = shown[:37] + "..."
    raise BadLeaderEpoch(
        f"meta.leader_epoch is {shown}, not a whole number: set it to one above any epoch "
        "a controller used (UPDATE meta SET value = 'N' WHERE key = 'leader_epoch')"
    )


@attrs.frozen
class Refusal:
    """What the server answered to a connection attempt, as libpq's message shows it."""

    sqlstate: str
    """The SQLSTATE the server sent with it, known by its words (libpq's message does not
    show it); empty for words not known here."""
    said: str
    """The server's own words, one line."""
    fix: str
    """What an operator does about it."""
    nobody_in: bool = False
    """The server has no session at all just now (starting up, recovering after a crash):
    no other controller can hold the controllers' lock through it."""


_NOT_NETWORK = "the server answered, so not a network problem"
_AUTH_FIX = (
    f"{_NOT_NETWORK}: check the user and password in --db / RC_DB (or PGPASSWORD, "
    "~/.pgpass) and the server's pg_hba.conf"
)
# The server's words for each refusal at connection start (PostgreSQL's own messages, as
# written in English: a server set to another lc_messages is not recognised, and its
# refusals count as no answer, as all of them did before).
_REFUSALS: tuple[tuple[re.Pattern[str], str, str], ...] = tuple(
    (re.compile(pattern), sqlstate, fix)
    for pattern, sqlstate, fix in [
        (r"password authentication failed for user", "28P01", _AUTH_FIX),
        (r"\bauthentication failed for user", "28000", _AUTH_FIX),
        (r"\bfe_sendauth: no password supplied", "28P01", _AUTH_FIX),
        (r"no pg_hba\.conf entry for|pg_hba\.conf rejects connection", "28000", _AUTH_FIX),
        (r"^role \".*\" is not permitted to log in", "28000", _AUTH_FIX),
        (
            r"^role \".*\" does not exist",
            "28000",
            f"{_NOT_NETWORK}: create the role on the server, or fix the user in --db / RC_DB",
        ),
        (
            r"^database \".*\" does not exist",
            "3D000",
            f"{_NOT_NETWORK}: create the database (createdb NAME), or fix its name in --db / RC_DB",
        ),
        (
            r"^permission denied for database",
            "42501",
            f"{_NOT_NETWORK}: GRANT CONNECT ON DATABASE NAME TO the user in --db / RC_DB",
        ),
        (
            r"^database \".*\" is not currently accepting connections",
            "55000",
            f"{_NOT_NETWORK}: ALTER DATABASE NAME ALLOW_CONNECTIONS true",
        ),
        (
            r"too many clients already|remaining connection slots are reserved"
            r"|too many connections for (role|database)",
            "53300",
            f"{_NOT_NETWORK}: every connection it allows is in use; raise max_connections"
            " (or the role's or database's CONNECTION LIMIT), or end other sessions",
        ),
        (
            r"^the database system is (starting up|in recovery mode"
            r"|not yet accepting connections)",
            "57P03",
            "the server is starting: try again once it accepts sessions",
        ),
        (
            r"^the database system is shutting down",
            "57P03",
            "the server is shutting down: try again once it is back",
        ),
    ]
)
_NOBODY_IN = re.compile(r"^the database system is (starting up|in recovery mode|not yet)")
_ATTEMPT = re.compile(r"connection to server .*? failed: (.*)")
_SERVER_SAID = re.compile(r"\b(?:FATAL|ERROR|PANIC):  (.*)")


def connect_refusal(message: str) -> Refusal | None:
    """What the server answered, in the message of a failed connection attempt; None when
    the message holds no answer from it (it could not be reached).

    psycopg gives no SQLSTATE for a failed connection attempt, whatever the server said:
    libpq puts the server's answer into its own message, ``connection to server ...
    failed: FATAL:  database "x" does not exist``, where only the text tells a refused
    login or a missing database from a server that is down. Each line is one attempt
    (psycopg lists every host it tried); the first answer counts.
    """
    for line in message.splitlines():
        attempt = _ATTEMPT.search(line)
        reason = attempt.group(1) if attempt else line
        answer = _SERVER_SAID.search(reason)
        said = (answer.group(1) if answer else reason).strip()
        for pattern, sqlstate, fix in _REFUSALS:
            if pattern.search(said):
                return Refusal(sqlstate, said, fix, nobody_in=bool(_NOBODY_IN.match(said)))
        if answer:
            return Refusal("", said, f"{_NOT_NETWORK}: check --db / RC_DB, and the server's log")
    return None


def unreachable(error: BaseException) -> bool:
    """Whether ``error`` leaves the active controller hoping: the database could not be
    reached, or has no session at all just now, so no other controller can lead through
    it either (see :meth:`PostgresBackend.check_lead`).

    libpq's own failures carry no SQLSTATE: a connection attempt that failed (psycopg
    raises a bare ``OperationalError`` for every one), a connection that broke under a
    statement. Whatever the server said on a session carries one, ``OperationalError``
    subclasses included: a statement cancelled (``QueryCanceled``, 57014), our session
    terminated by an administrator (``AdminShutdown``, 57P01). So the class alone does
    not tell. Nor does the SQLSTATE at connection start, where the server's answer is
    only in the message (:func:`connect_refusal`): a refused login, a missing database,
    no connection to spare (53300) or a server shutting down is an answer, and other
    controllers may still have sessions there; a server starting up or recovering after
    a crash (57P03) has none.
    """
    if isinstance(error, OSError):
        return True
    if not isinstance(error, psycopg.OperationalError) or error.sqlstate is not None:
        return False
    refusal = connect_refusal(str(error))
    return refusal is None or refusal.nobody_in


def connect_failed(where: str, error: BaseException) -> str:
    """One line for a connection to ``where`` that failed with ``error``: what the server
    answered and the fix, or that it could not be reached."""
    refusal = connect_refusal(str(error)) if isinstance(error, psycopg.Error) else None
    if refusal is None:
        return (
            f"cannot connect to {where}: the server could not be reached "
            f"({_one_line(error)}); check the host and port in --db / RC_DB, and that "
            "the server is running"
        )
    return f"cannot connect to {where}: {refusal.said}; {refusal.fix}"


def _one_line(error: BaseException) -> str:
    text = " ".join(str(error).split())
    if len(text) > 300:
        text = text[:297] + "..."
    return text or type(error).__name__


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


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
    check_statement = "SELECT 1"
    """What :meth:`check_lead` runs on the lock's session to see that it is alive."""

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
            raise StoreOpenError(connect_failed(self.description, e)) from e

    def _connect(self) -> psycopg.Connection[Any]:
        if self.lost is not None:
            raise LeadershipLost(self.lost)
        if self.conn is not None and self.conn.broken and not self.conn.closed:
            self.conn.close()
        if self.conn is None or self.conn.closed:
            conn = psycopg.connect(self.url, connect_timeout=CONNECT_TIMEOUT_S)
            if self.leader_epoch is not None:
                # The session that held the lock has ended, and the lock with it: this
                # controller stops leading, at once and for good (issue 14: "an active
                # controller that loses its lock stops serving at once"). It never takes
                # the lock back on a new session, even with the epoch unchanged: a service
                # manager starts it again, to lead anew (a fresh epoch, the state loaded
                # from the database) or as a standby while another leads.
                self._lose(conn, self._why_the_lock_went(conn))
            self.conn = conn
        return self.conn

    # --- leading ----------------------------------------------------------------------------

    def try_lead(self) -> bool:
        """Take the controllers' lock if no other session holds it; True once this leads.

        Call from a thread. Raises the driver's error when the database cannot be reached,
        :class:`BadLeaderEpoch` when ``meta.leader_epoch`` is not a number.
        """
        with self.lock:
            conn = self._connect()
            try:
                with conn.cursor() as cur:
                    cur.execute("SELECT pg_try_advisory_lock(%s)", (LOCK_KEY,))
                    row = cur.fetchone()
                    if not (row and row[0]):
                        conn.rollback()
                        return False
                    cur.execute("SELECT value FROM meta WHERE key = 'leader_epoch'")
                    found = cur.fetchone()
                    epoch = (parse_epoch(found[0]) if found else 0) + 1
                    self._put_meta(cur, [("leader_epoch", str(epoch))])
                conn.commit()
            except BaseException:
                # Whatever failed (a statement, a garbled epoch, the lock's own answer),
                # the session may hold the lock: a rollback keeps a session's advisory
                # lock, and this session would hold it while not leading, so that no
                # other controller could take over until this process ended. Closed, the
                # lock goes with the session; the next try connects again.
                conn.close()
                raise
            self.leader_epoch = epoch
            return True

    def _why_the_lock_went(self, conn: psycopg.Connection[Any]) -> str:
        """Why this controller lost the lock, for its last line: what the epoch in the
        database says of who led since (read on ``conn``, a new session, without the lock),
        best effort."""
        ended = "its database session ended, and the controllers' lock with it"
        try:
            with conn.cursor() as cur:
                cur.execute("SELECT value FROM meta WHERE key = 'leader_epoch'")
                found = cur.fetchone()
            conn.rollback()
        except psycopg.Error as e:
            return f"{ended} ({_first_line(e)})"
        if found is None:
            # Written when this controller took the lock, and by any that led after it:
            # gone means deleted by hand, and no epoch is left to compare ours with.
            return _EPOCH_GONE
        try:
            epoch = parse_epoch(found[0])
        except BadLeaderEpoch as e:
            return str(e)
        if epoch != self.leader_epoch:
            return f"another controller led meanwhile (epoch {epoch} after ours)"
        return f"{ended}; rc serve stops so that it starts again, as a standby or to lead anew"

    def _lose(self, conn: psycopg.Connection[Any], why: str) -> NoReturn:
        self.lost = why
        conn.close()
        raise LeadershipLost(why)

    def check_lead(self) -> bool:
        """Whether this controller still leads: the lock's session is alive. False once
        lost, with :attr:`lost` saying why: the session ended (the lock went with it, and a
        new session gives up leading, :meth:`_connect`).

        While the database cannot be reached, or has no session at all (:func:`unreachable`),
        True (hoping): no other controller can lead through it either, and nothing is stored
        meanwhile (the first session opened once it answers gives up leading). When the
        database answers but the lock cannot be proven (the reconnect is refused: a login
        refused, no connection to spare, the server shutting down), another controller may
        be leading (one that kept its session can take the lock): this one gives up leading
        (:attr:`lost` is set, for good) rather than claim what it cannot show. A statement
        that fails on a session still alive (cancelled by a ``statement_timeout``, say)
        proves nothing lost: that session, and so the lock, is kept.
        """
        if self.lost is not None:
            return False
        with self.lock:
            failed: Exception | None = None
            for _ in range(2):  # a session found dead: the next _connect gives up leading
                try:
                    conn = self._connect()
                    with conn.cursor() as cur:
                        cur.execute(self.check_statement)
                    conn.commit()
                    return True
                except LeadershipLost:
                    return False
                except (psycopg.Error, OSError) as e:
                    failed = e
                    self._rollback()  # closes the connection if that fails too
                    kept = self.conn
                    if kept is None or kept.closed:
                        continue
                    if not kept.broken and self.leader_epoch is not None:
                        # The statement failed (cancelled by a statement_timeout or an
                        # administrator, 57014, say) but the session answered the
                        # rollback: it is alive, and holds the lock, which lasts as long
                        # as the session does. Closed, the lock would go with it, and a
                        # standby could take it before this reconnected.
                        return True
                    kept.close()
            assert failed is not None
            if unreachable(failed):
                return True
            connecting = isinstance(failed, psycopg.OperationalError) and not failed.sqlstate
            refusal = connect_refusal(str(failed)) if connecting else None
            self.lost = (
                "the database answers but this controller cannot show it still holds "
                "the controllers' lock: "
                + (f"it refused a new session ({refusal.said})" if refusal else _first_line(failed))
            )
            return False

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

    def _lock_schema(self, cur: Any) -> None:
        # Controllers started together on a fresh database each found no tables and
        # created them: all but the first failed on the catalog's unique index. Waiting
        # here, the next one looks only once the first committed, and finds the schema.
        # The lock goes with the transaction, committed or rolled back.
        cur.execute("SELECT pg_advisory_xact_lock(%s)", (MIGRATE_KEY,))

    def _has_schema(self, cur: Any) -> bool:
        cur.execute("SELECT to_regclass('meta') IS NOT NULL")
        row = cur.fetchone()
        return bool(row and row[0])

    def close(self) -> None:
        if self.conn is not None:
            self.conn.close()
