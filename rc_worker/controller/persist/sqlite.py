"""The default backend: one SQLite database (WAL) in the controller's state directory.

The directory is the whole controller: the database holds every record, and
``output/`` every byte of job output, one append-only file a job, of which the
database keeps the committed length (:mod:`.output_files`: why, and why it is
crash-safe). Copying the directory while ``rc serve`` is stopped backs it up.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sqlite3
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from rc_worker.controller.persist import StoreOpenError, StoreWriteError
from rc_worker.controller.persist.output_files import OutputFiles, extend, reconcile
from rc_worker.controller.persist.sql import SqlBackend
from rc_worker.core.errors import ConfigError
from rc_worker.statelock import StateDirLock, StateDirLocked

__all__ = ["DB_NAME", "OUTPUT_DIR", "SqliteBackend", "default_state_dir"]

DB_NAME = "controller.db"
OUTPUT_DIR = "output"
MIGRATION_HEADROOM = 64 << 20
"""Free space kept beyond the output itself when an older store's output moves into files."""

log = logging.getLogger("rc_worker.controller")


def default_state_dir(env: Mapping[str, str]) -> Path:
    """``$RC_STATE_DIR``, else ``$XDG_STATE_HOME/rc``, else ``~/.local/state/rc``."""
    if env.get("RC_STATE_DIR"):
        return Path(env["RC_STATE_DIR"])
    if env.get("XDG_STATE_HOME"):
        return Path(env["XDG_STATE_HOME"]) / "rc"
    return Path.home() / ".local" / "state" / "rc"


class SqliteBackend(SqlBackend):
    real = "REAL"
    blob = "BLOB"
    ph = "?"
    errors = (sqlite3.Error, OSError)

    def __init__(self, state_dir: Path) -> None:
        super().__init__()
        self.state_dir = state_dir
        self.description = f"state directory {state_dir}"
        self._lock: StateDirLock | None = None
        try:
            state_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
            if not os.access(state_dir, os.W_OK | os.X_OK):
                raise PermissionError(f"[Errno 13] Permission denied: '{state_dir}'")
            self._lock = _lock(state_dir)
            # Autocommit mode: transactions are the explicit BEGIN/COMMIT below, DDL included.
            self.conn = sqlite3.connect(
                state_dir / DB_NAME, isolation_level=None, check_same_thread=False, timeout=10.0
            )
            self.conn.execute("PRAGMA journal_mode=WAL")
            # FULL: a commit survives a power cut, not only a killed process.
            self.conn.execute("PRAGMA synchronous=FULL")
            self.files = OutputFiles(state_dir / OUTPUT_DIR)
        except (sqlite3.Error, OSError) as e:
            if self._lock is not None:
                self._lock.release()
            raise StoreOpenError(
                f"cannot use state directory {state_dir}: {e}; "
                "give a writable --state-dir, or --memory"
            ) from e

    def _cursor(self) -> Any:
        return self.conn.cursor()

    def _begin(self, cur: Any) -> None:
        cur.execute("BEGIN IMMEDIATE")

    def _commit(self) -> None:
        self.conn.execute("COMMIT")

    def _rollback(self) -> None:
        if self.conn.in_transaction:
            with contextlib.suppress(sqlite3.Error):
                self.conn.execute("ROLLBACK")

    def _has_schema(self, cur: Any) -> bool:
        cur.execute("SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = 'meta'")
        return cur.fetchone() is not None

    # --- output in files (output_files.py) ----------------------------------------------------

    _JOB_WITH_BYTES = (
        "SELECT j.data, COALESCE((SELECT f.length FROM output_files f"
        " WHERE f.job_id = j.job_id), 0) FROM jobs j"
    )
    _LIVE_OUTPUT_LENGTHS = (
        "SELECT f.job_id, f.length FROM output_files f"
        " JOIN jobs j ON j.job_id = f.job_id WHERE j.finished_at IS NULL"
    )

    def migrate(self) -> int:
        found = super().migrate()
        self._reconcile_output()
        return found

    def _migrate_more(self, cur: Any, found: int) -> None:
        if found >= 3:
            return
        cur.execute("CREATE TABLE output_files (job_id TEXT PRIMARY KEY, length BIGINT NOT NULL)")
        if found == 0:
            return
        # Output stored in rows by an earlier version moves to files in this transaction:
        # written and fsynced first, so a crash before the commit leaves the rows (and
        # files that the next attempt writes again, at the same offsets).
        cur.execute("SELECT COUNT(*), COALESCE(SUM(length(data)), 0) FROM output")
        rows, size = cur.fetchone()
        if not rows:
            return
        # The files are written before the rows go, so the move needs as much free space
        # as the output: said up front, rather than as a full disk halfway through.
        st = os.statvfs(self.files.root)
        free = st.f_bavail * st.f_frsize
        if free < size + MIGRATION_HEADROOM:
            raise StoreOpenError(
                f"cannot upgrade the store in {self.description}: moving its {size} bytes of "
                f"job output into {self.files.root} needs that much free space, and "
                f"{free} bytes are free; free some space there, or run the earlier rc serve"
            )
        log.info("moving %d bytes of job output out of the database into %s", size, self.files.root)
        lengths: dict[str, int] = {}
        cur.execute("SELECT job_id, off, data FROM output ORDER BY job_id, off")
        try:
            while batch := cur.fetchmany(16):
                pieces = [(str(j), int(o), bytes(d)) for j, o, d in batch]
                self.files.write(pieces)
                for job_id, off, data in pieces:
                    lengths[job_id] = extend(lengths.get(job_id, 0), [(off, len(data))])
        except BaseException:
            # The rows stay (the transaction rolls back); the copies would only take space
            # an earlier rc serve, which never reads them, would not give back.
            self.files.remove(lengths)
            raise
        cur.executemany(
            "INSERT INTO output_files (job_id, length) VALUES (?, ?)", sorted(lengths.items())
        )
        cur.execute("DELETE FROM output")
        log.warning(
            "moved %d bytes of job output into %s; the database file keeps their space "
            "until it is compacted: stop rc serve and run sqlite3 %s VACUUM",
            size,
            self.files.root,
            self.state_dir / DB_NAME,
        )

    def _reconcile_output(self) -> None:
        """Make the files agree with the committed lengths (after a crash, or a backup)."""
        with self._transaction(
            lambda e: StoreOpenError(
                f"cannot check the job output in {self.files.root}: {e}; "
                "give a writable --state-dir, or --memory"
            )
        ) as cur:
            cur.execute("SELECT job_id, length FROM output_files")
            lengths = {str(j): int(n) for j, n in cur.fetchall()}
            repair = reconcile(lengths, self.files.sizes())
            self.files.repair(repair)
            for job_id, committed, found in repair.shortened:
                log.warning(
                    "job %s: its output file %s holds %d of the %d bytes stored; serving "
                    "the %d there (restore the file from a backup to get the rest)",
                    job_id,
                    self.files.path(job_id),
                    found,
                    committed,
                    found,
                )
            cur.executemany(
                "UPDATE output_files SET length = ? WHERE job_id = ?",
                [(found, job_id) for job_id, _, found in repair.shortened],
            )

    def _write_output(self, cur: Any, rows: Sequence[tuple[str, int, bytes]]) -> None:
        if not rows:
            return
        # The bytes are durable before the lengths that make them count are committed.
        self.files.write(rows)
        spans: dict[str, list[tuple[int, int]]] = {}
        for job_id, off, data in rows:
            spans.setdefault(job_id, []).append((off, len(data)))
        updates = []
        for job_id, pieces in spans.items():
            cur.execute("SELECT length FROM output_files WHERE job_id = ?", (job_id,))
            row = cur.fetchone()
            updates.append((job_id, extend(0 if row is None else int(row[0]), pieces)))
        cur.executemany(
            "INSERT INTO output_files (job_id, length) VALUES (?, ?)"
            " ON CONFLICT (job_id) DO UPDATE SET length = excluded.length",
            updates,
        )

    def _length(self, job_id: str) -> int:
        """The job's committed output length (0: none)."""
        with self._transaction(self._read_failed) as cur:
            cur.execute("SELECT length FROM output_files WHERE job_id = ?", (job_id,))
            row = cur.fetchone()
        return 0 if row is None else int(row[0])

    def read_output(self, job_id: str, offset: int, limit: int | None) -> bytes:
        end = self._length(job_id)
        if limit is not None:
            end = min(end, offset + limit)
        try:
            # Outside the lock: commits need not wait for a follower's reads.
            data = self.files.read(job_id, offset, end - offset)
        except OSError as e:
            raise self._read_failed(e) from e
        if len(data) < end - offset:
            # Retention may have deleted the job (its length, then its file) since the length
            # was read: what holds now is what counts.
            now = self._length(job_id)
            if now < end:
                return data[: max(now - offset, 0)]
            # Cut or removed under a running controller. Serving less than the committed
            # length would leave a follower waiting forever for bytes that never come.
            raise StoreWriteError(
                f"reading {self.description} failed: the output file {self.files.path(job_id)} "
                f"holds fewer than the {end} bytes stored for job {job_id}; restart rc serve "
                "to serve what it holds (or restore the file)"
            )
        return data

    def _delete_output(self, cur: Any, ids: Sequence[tuple[str]]) -> None:
        cur.executemany("DELETE FROM output_files WHERE job_id = ?", ids)

    def _output_deleted(self, job_ids: Sequence[str]) -> None:
        self.files.remove(job_ids)

    def close(self) -> None:
        self.conn.close()
        if self._lock is not None:
            self._lock.release()


def _lock(state_dir: Path) -> StateDirLock:
    """One controller per state directory, as one worker per worker state directory.

    Two ``rc serve`` on one database would each hand out the same job ids and event
    numbers from their own memory and overwrite each other's records: an acknowledged
    submit lost. SQLite's own locks serialise writes, not owners. The lock is the
    worker's (``statelock``: an ``flock`` the kernel drops when the process dies).
    """
    try:
        return StateDirLock.acquire(state_dir)
    except StateDirLocked as e:
        who = f"pid {e.holder}" if e.holder is not None else "another process"
        raise StoreOpenError(
            f"state directory {state_dir} is in use by another rc serve ({who}); stop it, or "
            "give each controller its own --state-dir (controllers that share state, with a "
            "standby, use --db postgresql://...)"
        ) from None
    except ConfigError as e:
        raise StoreOpenError(f"cannot use state directory {state_dir}: {e}") from None
