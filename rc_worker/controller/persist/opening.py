"""Opening a controller's store at start: the backend, the schema, the state read back.

Every failure is a :class:`~rc_worker.controller.persist.StoreOpenError` whose
message is one line naming the store and the fix (``rc serve`` prints it and
exits 2).
"""

from __future__ import annotations

from pathlib import Path

from rc_worker.controller.persist import Backend, MemoryBackend, StoreOpenError
from rc_worker.controller.persist.codec import restore
from rc_worker.controller.store import Store, StoreConfig

__all__ = ["open_backend", "open_store"]


def open_backend(*, state_dir: Path | None = None, db: str | None = None) -> Backend:
    """A backend for ``db`` (a ``postgresql://`` URI), else ``state_dir`` (SQLite), else memory."""
    if db is not None:
        if not db.startswith(("postgresql://", "postgres://")):
            raise StoreOpenError(
                f"--db {db!r} is not a PostgreSQL URI; give postgresql://USER@HOST/DB"
            )
        from rc_worker.controller.persist.postgres import PostgresBackend

        backend: Backend = PostgresBackend(db)
    elif state_dir is not None:
        from rc_worker.controller.persist.sqlite import SqliteBackend

        backend = SqliteBackend(state_dir)
    else:
        return MemoryBackend()
    migrate = getattr(backend, "migrate", None)
    if migrate is not None:
        try:
            migrate()
        except StoreOpenError:
            backend.close()
            raise
    return backend


def open_store(
    backend: Backend,
    config: StoreConfig | None = None,
    *,
    now: float,
    recovery_grace_s: float | None,
) -> tuple[Store, bool]:
    """A store holding what ``backend`` keeps; also whether anything was there.

    On a store that had state, every known host starts ``unknown`` (the recovery
    phase) for at most ``recovery_grace_s``. A stored record this version cannot read
    (edited by hand, or garbled) is a :class:`StoreOpenError` too, never guessed at.
    """
    config = config or StoreConfig()
    loaded = backend.load(config.max_events)
    store = Store(config)
    had_state = bool(loaded.meta.get("instance"))
    if had_state:
        try:
            restore(store, loaded, now=now, recovery_grace_s=recovery_grace_s)
        except (ValueError, KeyError, TypeError, AttributeError, IndexError) as e:
            what = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
            raise StoreOpenError(
                f"cannot read the state stored in {backend.description}: a record is not "
                f"one this version can read ({what}); restore a backup of the store, or "
                "start on an empty one"
            ) from e
    return store, had_state
