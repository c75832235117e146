"""What the SQLite and PostgreSQL backends share: the queries, migration and loading.

Subclasses give the connection, the parameter placeholder, the two column types
that differ, and how to ask whether the schema exists. Every method runs in a
thread (never on the event loop) and holds :attr:`SqlBackend.lock`, so the
batches and the webhook cursors never share a transaction by accident.
"""

from __future__ import annotations

import re
import threading
from collections.abc import Callable, Collection, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from rc_worker.controller.persist import StoreOpenError, StoreWriteError
from rc_worker.controller.persist.codec import Batch, Loaded, coalesce_output
from rc_worker.controller.persist.schema import SCHEMA_VERSION, statements, too_new


class SqlBackend:
    description = "sql"
    real = "DOUBLE PRECISION"
    blob = "BYTEA"
    ph = "%s"
    errors: tuple[type[BaseException], ...] = (Exception,)
    schema_target = SCHEMA_VERSION
    """The version this backend creates and migrates to (``schema.py``)."""

    def __init__(self) -> None:
        # Re-entrant: retention holds it across a transaction and what follows its commit.
        self.lock = threading.RLock()
        self._in_transaction = False

    @contextmanager
    def _transaction(self, fail: Callable[[BaseException], Exception]) -> Iterator[Any]:
        """One transaction under :attr:`lock`, yielding its cursor. A driver error rolls
        it back and is raised as ``fail(error)``; the store's own errors pass through."""
        with self.lock:
            if self._in_transaction:
                # The lock is re-entrant (retention holds it past its commit): a nested
                # transaction would BEGIN inside this one, and its rollback undo both.
                raise RuntimeError("a store transaction was opened inside another")
            self._in_transaction = True
            try:
                # Inside the try: connecting again (after the server went away) can fail too.
                cur = self._cursor()
                self._begin(cur)
                yield cur
                self._commit()
            except (StoreOpenError, StoreWriteError):
                self._rollback()
                raise
            except self.errors as e:
                self._rollback()
                raise fail(e) from e
            except BaseException:
                # Anything else (a bug, a cancellation) still ends the transaction: left
                # open, the next BEGIN on this connection would fail.
                self._rollback()
                raise
            finally:
                self._in_transaction = False

    def _write_failed(self, e: BaseException) -> Exception:
        return StoreWriteError(f"writing to {self.description} failed: {e}")

    def _read_failed(self, e: BaseException) -> Exception:
        return StoreWriteError(f"reading {self.description} failed: {e}")

    # --- subclass hooks -----------------------------------------------------------------------

    def _cursor(self) -> Any:
        raise NotImplementedError

    def _begin(self, cur: Any) -> None:
        raise NotImplementedError

    def _commit(self) -> None:
        raise NotImplementedError

    def _rollback(self) -> None:
        raise NotImplementedError

    def _has_schema(self, cur: Any) -> bool:
        raise NotImplementedError

    # --- schema ---------------------------------------------------------------------------------

    def schema_version(self) -> int:
        """The version the store is at: 0 when it has no tables yet. StoreOpenError, in one
        line naming the fix, when ``meta`` says no version, or one that is not a number."""
        cur = self._cursor()
        if not self._has_schema(cur):
            return 0
        cur.execute(f"SELECT value FROM meta WHERE key = {self.ph}", ("schema_version",))
        row = cur.fetchone()
        return stored_schema_version(None if row is None else row[0], self.description)

    def migrate(self) -> int:
        """Create or upgrade the schema; returns the version found. Raises StoreOpenError."""
        with self._transaction(
            lambda e: StoreOpenError(f"cannot set up the store in {self.description}: {e}")
        ) as cur:
            self._lock_schema(cur)
            found = self.schema_version()
            target = self.schema_target
            if found > target:
                raise StoreOpenError(too_new(found, self.description, target))
            if found < target:
                for sql in statements(found, real=self.real, blob=self.blob, target=target):
                    cur.execute(sql)
                self._migrate_more(cur, found)
                self._put_meta(cur, [("schema_version", str(target))])
            return found

    def _lock_schema(self, cur: Any) -> None:
        """Hold off every other controller's migration until this transaction ends."""

    def _migrate_more(self, cur: Any, found: int) -> None:
        """A backend's own migration steps from version ``found``, in the same transaction."""

    def _put_meta(self, cur: Any, rows: Sequence[tuple[str, str]]) -> None:
        p = self.ph
        for key, value in rows:
            cur.execute(
                f"INSERT INTO meta (key, value) VALUES ({p}, {p})"
                " ON CONFLICT (key) DO UPDATE SET value = excluded.value",
                (key, value),
            )

    # --- reading at start ---------------------------------------------------------------------

    def load(self, max_events: int) -> Loaded:
        with self._transaction(
            lambda e: StoreOpenError(f"cannot read the store in {self.description}: {e}")
        ) as cur:
            cur.execute("SELECT key, value FROM meta")
            meta = {str(k): str(v) for k, v in cur.fetchall()}
            cur.execute("SELECT data FROM hosts ORDER BY name")
            hosts = tuple(str(r[0]) for r in cur.fetchall())
            # Lazy: only the jobs still to run or running. Finished jobs stay in the store
            # and are read when someone asks for them (read_job, read_finished).
            cur.execute("SELECT data FROM jobs WHERE finished_at IS NULL ORDER BY seq")
            jobs = tuple(str(r[0]) for r in cur.fetchall())
            cur.execute(
                f"SELECT seq, type, time, data FROM events ORDER BY seq DESC LIMIT {self.ph}",
                (max_events,),
            )
            events = tuple(
                (int(s), str(t), float(tm), str(d)) for s, t, tm, d in reversed(cur.fetchall())
            )
            # Only how much each of those jobs has: the bytes are read when someone asks.
            cur.execute(self._LIVE_OUTPUT_LENGTHS)
            output = {str(j): int(n) for j, n in cur.fetchall()}
            cur.execute(
                "SELECT state, COUNT(*) FROM jobs WHERE finished_at IS NOT NULL GROUP BY state"
            )
            finished = {str(st): int(n) for st, n in cur.fetchall()}
        return Loaded(
            meta=meta, jobs=jobs, hosts=hosts, events=events, output=output, finished=finished
        )

    # --- writing while serving ----------------------------------------------------------------

    def write(self, batches: Sequence[Batch]) -> dict[str, int]:
        p = self.ph
        recounted: dict[str, int] = {}
        # One statement per table and batch (executemany), not one round trip per row:
        # this runs on every commit, with every request that changes state waiting on it.
        with self._transaction(self._write_failed) as cur:
            for b in batches:
                _many(
                    cur,
                    "INSERT INTO jobs (job_id, seq, state, finished_at, data)"
                    f" VALUES ({p}, {p}, {p}, {p}, {p}) ON CONFLICT (job_id) DO UPDATE"
                    " SET state = excluded.state, finished_at = excluded.finished_at,"
                    " data = excluded.data",
                    [(r.job_id, r.seq, r.state, r.finished_at, r.data) for r in b.jobs],
                )
                _many(
                    cur,
                    f"INSERT INTO hosts (name, data) VALUES ({p}, {p})"
                    " ON CONFLICT (name) DO UPDATE SET data = excluded.data",
                    list(b.hosts),
                )
                _many(cur, f"DELETE FROM hosts WHERE name = {p}", [(n,) for n in b.deleted_hosts])
                _many(
                    cur,
                    "INSERT INTO events (seq, type, time, data)"
                    f" VALUES ({p}, {p}, {p}, {p}) ON CONFLICT (seq) DO NOTHING",
                    list(b.events),
                )
                recounted.update(self._write_output(cur, b.output))
                self._put_meta(cur, b.meta)
        return recounted

    def _write_output(self, cur: Any, rows: Sequence[tuple[str, int, bytes]]) -> dict[str, int]:
        """Store output pieces ``(job_id, offset, data)`` within the open transaction: as
        rows, the pieces that continue each other joined (``coalesce_output``). Returns
        the jobs whose stored output had to be recounted lower (rows are never lost
        under a running controller: none here; see ``OutputFiles.write``)."""
        p = self.ph
        # A row at an offset already stored is the same bytes or more of them: a commit
        # that reached the database but whose COMMIT answer was lost is written again,
        # and by then more output may have joined that row. Keeping the stored row
        # (DO NOTHING) dropped the bytes that joined it, though the worker had been
        # told they were committed; the longer one replaces it.
        _many(
            cur,
            f"INSERT INTO output (job_id, off, data) VALUES ({p}, {p}, {p})"
            " ON CONFLICT (job_id, off) DO UPDATE SET data = excluded.data"
            " WHERE length(excluded.data) > length(output.data)",
            coalesce_output(rows),
        )
        return {}

    # Each job with how many bytes of output it has stored (its committed length).
    _JOB_WITH_BYTES = (
        "SELECT j.data, (SELECT COALESCE(SUM(length(o.data)), 0) FROM output o"
        " WHERE o.job_id = j.job_id) FROM jobs j"
    )
    # The jobs still to run or running, with their stored output length (if any).
    _LIVE_OUTPUT_LENGTHS = (
        "SELECT o.job_id, SUM(length(o.data)) FROM output o"
        " JOIN jobs j ON j.job_id = o.job_id WHERE j.finished_at IS NULL"
        " GROUP BY o.job_id"
    )

    def read_job(self, job_id: str) -> tuple[str, int] | None:
        """One stored job document and its stored output length; None if there is none."""
        with self._transaction(self._read_failed) as cur:
            cur.execute(f"{self._JOB_WITH_BYTES} WHERE j.job_id = {self.ph}", (job_id,))
            row = cur.fetchone()
        return None if row is None else (str(row[0]), int(row[1]))

    def read_finished(
        self, state: str | None, after: int | None, limit: int, newest_first: bool
    ) -> list[tuple[str, int]]:
        """Stored finished jobs in submission order (or newest first) after the cursor
        ``after`` (a job's ``seq``), at most ``limit``, each with its stored output length."""
        p = self.ph
        sql = f"{self._JOB_WITH_BYTES} WHERE j.finished_at IS NOT NULL"
        params: list[object] = []
        if state is not None:
            sql += f" AND j.state = {p}"
            params.append(state)
        if after is not None:
            sql += f" AND j.seq {'<' if newest_first else '>'} {p}"
            params.append(after)
        sql += f" ORDER BY j.seq {'DESC' if newest_first else 'ASC'} LIMIT {p}"
        params.append(limit)
        with self._transaction(self._read_failed) as cur:
            cur.execute(sql, tuple(params))
            rows = [(str(d), int(n)) for d, n in cur.fetchall()]
        return rows

    def read_output(self, job_id: str, offset: int, limit: int | None) -> bytes:
        """Stored output of ``job_id`` from ``offset``, at most ``limit`` bytes."""
        p = self.ph
        with self._transaction(self._read_failed) as cur:
            # Rows start where the one holding ``offset`` starts: two seeks on the primary
            # key (job_id, off). A condition on ``off + length(data)`` cannot use it, and
            # made a follower reading a long output chunk by chunk quadratic.
            sql = (
                f"SELECT off, data FROM output WHERE job_id = {p} AND off >= COALESCE("
                f"(SELECT MAX(off) FROM output WHERE job_id = {p} AND off <= {p}), 0)"
            )
            params: tuple[object, ...] = (job_id, job_id, offset)
            if limit is not None:
                sql += f" AND off < {p}"
                params += (offset + limit,)
            cur.execute(sql + " ORDER BY off", params)
            rows = cur.fetchall()
        out = bytearray()
        for off, data in rows:
            pos = offset + len(out)
            if int(off) > pos:
                break  # a hole (chunks are written contiguously, so never): stop at it
            view = memoryview(data)[pos - int(off) :]
            out += view if limit is None else view[: limit - len(out)]
        return bytes(out)

    def read_events(self, after: int, limit: int) -> list[tuple[int, str, float, str]]:
        """Stored events with ``seq > after``, oldest first, at most ``limit``."""
        p = self.ph
        with self._transaction(self._read_failed) as cur:
            cur.execute(
                f"SELECT seq, type, time, data FROM events WHERE seq > {p} ORDER BY seq LIMIT {p}",
                (after, limit),
            )
            rows = [(int(s), str(t), float(tm), str(d)) for s, t, tm, d in cur.fetchall()]
        return rows

    def webhook_cursors(self) -> dict[str, int]:
        with self._transaction(self._read_failed) as cur:
            cur.execute("SELECT url, last_seq FROM webhooks")
            out = {str(u): int(a) for u, a in cur.fetchall()}
        return out

    def save_webhook_cursor(self, url: str, seq: int) -> None:
        p = self.ph
        with self._transaction(self._write_failed) as cur:
            cur.execute(
                f"INSERT INTO webhooks (url, last_seq) VALUES ({p}, {p})"
                " ON CONFLICT (url) DO UPDATE SET last_seq = excluded.last_seq",
                (url, seq),
            )

    def delete_finished_before(
        self, wall_time: float, limit: int, keep: Collection[str] = ()
    ) -> list[tuple[str, str]]:
        """Retention: drop at most ``limit`` finished jobs (and their output) that ended
        before ``wall_time``, the oldest first; returns each one's id and state.

        Bounded because a transaction holds :attr:`lock`, and every commit, so every
        request that changes state, waits for it: an hour of jobs at 100 a second,
        deleted at once, would stall the controller for as long as that takes.
        """
        p = self.ph
        # The lock is held on past the commit, through the removal of what lives outside
        # the database: a commit that wrote one of these ids again in between (an adopted
        # attempt of a deleted job) would have its new output removed under it.
        with self.lock:
            with self._transaction(self._write_failed) as cur:
                cur.execute(
                    "SELECT job_id, state FROM jobs WHERE finished_at IS NOT NULL"
                    f" AND finished_at < {p} ORDER BY finished_at LIMIT {p}",
                    (wall_time, limit + len(keep)),  # room for the kept ones among them
                )
                rows = [(str(r[0]), str(r[1])) for r in cur.fetchall()]
                gone = [row for row in rows if row[0] not in keep][:limit]
                ids = [(job_id,) for job_id, _ in gone]
                self._delete_output(cur, ids)
                _many(cur, f"DELETE FROM jobs WHERE job_id = {p}", ids)
            self._output_deleted([job_id for job_id, _ in gone])
        return gone

    def _delete_output(self, cur: Any, ids: Sequence[tuple[str]]) -> None:
        """Delete these jobs' output within the open transaction."""
        _many(cur, f"DELETE FROM output WHERE job_id = {self.ph}", ids)

    def _output_deleted(self, job_ids: Sequence[str]) -> None:
        """After the commit that deleted these jobs' output (what lives outside the database)."""


_VERSION = re.compile(r"[1-9][0-9]*")


def stored_schema_version(value: object, where: str) -> int:
    """``meta.schema_version`` of the store ``where`` as stored (``None``: no such row).

    It is written, as the text of a version (1 or more), in the transaction that creates
    the tables, so anything else was put there by hand. Guessing could damage the store
    (0 creates the tables again; a wrong version skips or repeats a migration), so it is
    refused: :class:`StoreOpenError`, one line naming the fix.
    """
    if isinstance(value, str) and _VERSION.fullmatch(value):
        return int(value)
    if value is None:
        problem = "a meta table with no schema_version row"
        fix = "INSERT INTO meta (key, value) VALUES ('schema_version', 'N')"
    else:
        shown = repr(value)
        if len(shown) > 40:
            shown = shown[:37] + "..."
        problem = f"meta.schema_version {shown}, not a schema version"
        fix = "UPDATE meta SET value = 'N' WHERE key = 'schema_version'"
    raise StoreOpenError(
        f"{where} has {problem}: set it to the version its tables are at ({fix}), "
        "or restore the store from a backup"
    )


def _many(cur: Any, sql: str, rows: Sequence[Sequence[object]]) -> None:
    if rows:
        cur.executemany(sql, rows)
