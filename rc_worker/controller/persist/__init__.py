"""Persistence beneath the controller's store: one interface, three implementations.

The :class:`~rc_worker.controller.store.Store` stays sans-IO and keeps its whole
state in memory; it marks what it changes in its journal
(:mod:`rc_worker.controller.journal`). A :class:`Backend` writes those changes
(:class:`~rc_worker.controller.persist.codec.Batch`) and reads them back at
start. Backends are synchronous and called from a thread
(:mod:`rc_worker.controller.durable` does that), never on the event loop.

- :class:`MemoryBackend`: stores nothing (``rc serve --memory``, tests, simulations);
- :class:`~rc_worker.controller.persist.sqlite.SqliteBackend`: one SQLite file (WAL)
  in the state directory;
- :class:`~rc_worker.controller.persist.postgres.PostgresBackend`: a PostgreSQL
  database (psycopg 3), so another controller process can take over.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from rc_worker.controller.persist.codec import Batch, Loaded
from rc_worker.core.errors import RcWorkerError

__all__ = ["Backend", "MemoryBackend", "StoreOpenError", "StoreWriteError"]


class StoreOpenError(RcWorkerError):
    """The store cannot be opened, created or migrated; the message is one line naming why."""


class StoreWriteError(RcWorkerError):
    """A write to the store failed while serving (the controller answers 503 until it works)."""


class Backend(Protocol):
    description: str
    """Where the state lives, for logs and errors (no password)."""

    def load(self, max_events: int) -> Loaded: ...

    def write(self, batches: Sequence[Batch]) -> None:
        """Write the batches in one transaction, in order; raise :class:`StoreWriteError`."""

    def read_output(self, job_id: str, offset: int, limit: int | None) -> bytes:
        """Stored output of a job from ``offset`` (at most ``limit`` bytes)."""

    def read_events(self, after: int, limit: int) -> list[tuple[int, str, float, str]]:
        """Stored events with ``seq > after`` (older than the store keeps in memory)."""

    def webhook_cursors(self) -> dict[str, int]: ...

    def save_webhook_cursor(self, url: str, seq: int) -> None: ...

    def close(self) -> None: ...


class MemoryBackend:
    """Stores nothing: state lives as long as the process (``--memory``)."""

    description = "memory"

    def __init__(self) -> None:
        self._cursors: dict[str, int] = {}

    def load(self, max_events: int) -> Loaded:
        return Loaded(meta={}, jobs=(), hosts=(), events=(), output={})

    def write(self, batches: Sequence[Batch]) -> None:
        pass

    def read_output(self, job_id: str, offset: int, limit: int | None) -> bytes:
        return b""  # the store keeps all output in memory: never asked

    def read_events(self, after: int, limit: int) -> list[tuple[int, str, float, str]]:
        return []  # events dropped from memory are gone

    def webhook_cursors(self) -> dict[str, int]:
        return dict(self._cursors)

    def save_webhook_cursor(self, url: str, seq: int) -> None:
        self._cursors[url] = seq

    def close(self) -> None:
        pass
