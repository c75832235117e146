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

from rc_worker.controller.persist import OutputRecounted, StoreOpenError
from rc_worker.controller.persist.output_files import OutputFiles, extend, file_name, reconcile
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
        self._copies: list[str] = []
        """Jobs whose output an upgrade has started copying into files (removed if it fails)."""
        self._moved = 0
        """Bytes an upgrade moved out of the database (said once it is committed)."""
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
        self._copies, self._moved = [], 0
        try:
            found = super().migrate()
        except BaseException:
            # The rows stay (the transaction rolled back, wherever it failed: a write, the
            # delete, the commit); the copies would only take space that an earlier rc serve,
            # which never reads them, would not give back.
            self.files.remove(self._copies)
            raise
        if self._moved:
            log.warning(
                "moved %d bytes of job output into %s; the database file keeps their space "
                "until it is compacted: stop rc serve and run sqlite3 %s VACUUM",
                self._moved,
                self.files.root,
                self.state_dir / DB_NAME,
            )
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
        cur.execute("SELECT job_id, SUM(length(data)) FROM output GROUP BY job_id")
        sizes = [int(n) for _, n in cur.fetchall()]
        if not sizes:
            return
        size = sum(sizes)
        # The files are written before the rows go, so the move needs the space the files
        # will take: said up front, rather than as a full disk halfway through.
        need, free, files_free = space_for_files(sizes, os.statvfs(self.files.root))
        if free < need + MIGRATION_HEADROOM or files_free < len(sizes):
            raise StoreOpenError(
                f"cannot upgrade the store in {self.description}: moving its {size} bytes of "
                f"job output into {self.files.root}, one file for each of {len(sizes)} jobs, "
                f"needs {need + MIGRATION_HEADROOM} bytes and {len(sizes)} files free there, "
                f"and {free} bytes and {files_free} files are; free some space there, or run "
                "the earlier rc serve"
            )
        log.info("moving %d bytes of job output out of the database into %s", size, self.files.root)
        lengths: dict[str, int] = {}
        cur.execute("SELECT job_id, off, data FROM output ORDER BY job_id, off")
        while batch := cur.fetchmany(16):
            pieces = [(str(j), int(o), bytes(d)) for j, o, d in batch]
            # Named before they are written: a write that fails midway leaves copies too.
            self._copies.extend(job_id for job_id, _, _ in pieces if job_id not in lengths)
            for job_id, off, data in pieces:
                lengths[job_id] = extend(lengths.get(job_id, 0), [(off, len(data))])
            self.files.write(pieces, {})
        cur.executemany(
            "INSERT INTO output_files (job_id, length) VALUES (?, ?)", sorted(lengths.items())
        )
        cur.execute("DELETE FROM output")
        self._moved = size  # said once the commit is done (migrate)

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
            sizes = self.files.sizes()
            stored = [n for n in lengths.values() if n > 0]
            if len(stored) > 1 and not any(
                file_name(job_id) in sizes for job_id, n in lengths.items() if n > 0
            ):
                # Every length would be cut to nothing, for good: far likelier a file system
                # not mounted, or a database restored alone, than every file lost. Say so.
                # (One job's file gone is cut and warned about, as any shorter file.)
                raise StoreOpenError(
                    f"cannot open the store in {self.description}: its database holds "
                    f"{sum(stored)} bytes of output of {len(stored)} jobs and {self.files.root} "
                    "holds none of it (a file system not mounted there, or the database "
                    f"restored without it?); restore {self.files.root}, or, to start without "
                    f"that output, run: sqlite3 {self.state_dir / DB_NAME} "
                    "'DELETE FROM output_files'"
                )
            repair = reconcile(lengths, sizes)
            self.files.repair(repair)
            for job_id, committed, found in repair.shortened:
                log.warning(
                    "job %s: its output file %s holds %d of the %d bytes stored; its length "
                    "is now %d and the rest is gone for good (to get it back, stop rc serve "
                    "and restore the database and %s together, from one backup)",
                    job_id,
                    self.files.path(job_id),
                    found,
                    committed,
                    found,
                    self.files.root,
                )
            cur.executemany(
                "UPDATE output_files SET length = ? WHERE job_id = ?",
                [(found, job_id) for job_id, _, found in repair.shortened],
            )

    def _write_output(self, cur: Any, rows: Sequence[tuple[str, int, bytes]]) -> dict[str, int]:
        if not rows:
            return {}
        spans: dict[str, list[tuple[int, int]]] = {}
        for job_id, off, data in rows:
            spans.setdefault(job_id, []).append((off, len(data)))
        committed: dict[str, int] = {}
        for job_id in spans:
            cur.execute("SELECT length FROM output_files WHERE job_id = ?", (job_id,))
            row = cur.fetchone()
            committed[job_id] = 0 if row is None else int(row[0])
        # The bytes are durable before the lengths that make them count are committed.
        recounted = self.files.write(rows, committed)
        for job_id, length in recounted.items():
            log.warning(
                "job %s: its output file %s was removed or cut under the running controller "
                "(%d bytes were stored); its output now counts %d bytes and the worker "
                "resends the rest",
                job_id,
                self.files.path(job_id),
                committed[job_id],
                length,
            )
        cur.executemany(
            "INSERT INTO output_files (job_id, length) VALUES (?, ?)"
            " ON CONFLICT (job_id) DO UPDATE SET length = excluded.length",
            [
                (job_id, recounted[job_id] if job_id in recounted else extend(n, spans[job_id]))
                for job_id, n in committed.items()
            ],
        )
        return recounted

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
            # length would leave a follower waiting forever for bytes that never come; a
            # read that failed instead would fail until the file came back or rc serve
            # restarted, and a finished job gets no more output to count it again at.
            raise OutputRecounted(job_id, now, self._recount(job_id))
        return data

    def _recount(self, job_id: str) -> int:
        """Count the job's output at what its file holds, if that is less than its stored
        length (as the next commit of its output, or the next start, would); returns the
        length it counts now."""
        with self._transaction(self._read_failed) as cur:
            cur.execute("SELECT length FROM output_files WHERE job_id = ?", (job_id,))
            row = cur.fetchone()
            length = 0 if row is None else int(row[0])
            try:
                found = self.files.size(job_id)
            except OSError as e:
                raise self._read_failed(e) from e
            if found >= length:
                return length  # put back meanwhile
            log.warning(
                "job %s: its output file %s was removed or cut under the running controller "
                "(%d bytes were stored); its output now counts the %d bytes it holds and the "
                "rest is gone for good (to get it back, stop rc serve and restore the "
                "database and %s together, from one backup)",
                job_id,
                self.files.path(job_id),
                length,
                found,
                self.files.root,
            )
            cur.execute("UPDATE output_files SET length = ? WHERE job_id = ?", (found, job_id))
        return found

    def _delete_output(self, cur: Any, ids: Sequence[tuple[str]]) -> None:
        cur.executemany("DELETE FROM output_files WHERE job_id = ?", ids)

    def _output_deleted(self, job_ids: Sequence[str]) -> None:
        self.files.remove(job_ids)

    def close(self) -> None:
        self.conn.close()
        if self._lock is not None:
            self._lock.release()


def space_for_files(sizes: Sequence[int], st: os.statvfs_result) -> tuple[int, int, int]:
    """What moving outputs of these ``sizes`` into files of a filesystem (``statvfs``)
    needs, and what it has: ``(bytes needed, bytes free, files free)``. Each file takes
    whole blocks, so many small outputs need far more than their sum. A filesystem that
    reports no inode count (``f_files`` 0, as btrfs does) has no fixed limit of files."""
    block = st.f_frsize or st.f_bsize or 4096
    need = sum(-(-n // block) * block for n in sizes)
    files_free = st.f_favail if st.f_files else len(sizes)
    return need, st.f_bavail * st.f_frsize, files_free


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
