"""The default backend: one SQLite database (WAL) in the controller's state directory.

The directory is the whole controller: the database holds every record and
every byte of job output, so copying the directory backs it up.
"""

from __future__ import annotations

import contextlib
import os
import sqlite3
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from rc_worker.controller.persist import StoreOpenError
from rc_worker.controller.persist.sql import SqlBackend
from rc_worker.core.errors import ConfigError
from rc_worker.statelock import StateDirLock, StateDirLocked

__all__ = ["DB_NAME", "SqliteBackend", "default_state_dir"]

DB_NAME = "controller.db"


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
