"""Persistence beneath the controller's store: one interface, three implementations.

The :class:`~rc_worker.controller.store.Store` stays sans-IO and keeps in memory
what its decisions need (hosts, devices, queued and running jobs, the most
recently finished jobs); it marks what it changes in its journal
(:mod:`rc_worker.controller.journal`). A :class:`Backend` writes those changes
(:class:`~rc_worker.controller.persist.codec.Batch`), reads the live part back at
start, and reads finished jobs and output when someone asks for them: once
stored, finished jobs leave memory (:meth:`Durability.flush
<rc_worker.controller.durable.Durability.flush>`), so memory does not grow with
the number of jobs ever run. Backends are synchronous and called from a thread
(:mod:`rc_worker.controller.durable` does that), never on the event loop.

- :class:`MemoryBackend`: keeps rows in dicts of its own, for as long as the process
  lives (tests; ``rc serve --memory`` uses no backend at all: its store keeps
  everything);
- :class:`~rc_worker.controller.persist.sqlite.SqliteBackend`: one SQLite file (WAL)
  in the state directory;
- :class:`~rc_worker.controller.persist.postgres.PostgresBackend`: a PostgreSQL
  database (psycopg 3), so another controller process can take over.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from typing import Protocol

from rc_worker.controller.persist.codec import Batch, JobRow, Loaded
from rc_worker.core.errors import RcWorkerError

__all__ = ["Backend", "MemoryBackend", "StoreOpenError", "StoreWriteError"]


class StoreOpenError(RcWorkerError):
    """The store cannot be opened, created or migrated; the message is one line naming why."""


class StoreWriteError(RcWorkerError):
    """A write to the store failed while serving (the controller answers 503 until it works)."""


class OutputRecounted(StoreWriteError):
    """A read found a job's stored output shorter than its committed length (its file
    removed or cut under a running controller), and the store beneath now counts what it
    holds: ``counted`` bytes where it counted ``stored``. The caller lowers its own count
    to match (``recount_output``) and reads again. A :class:`StoreWriteError`, so that a
    caller that knows nothing of it still fails the read rather than serve short."""

    def __init__(self, job_id: str, stored: int, counted: int) -> None:
        super().__init__(
            f"the output of job {job_id} now counts {counted} bytes, not {stored}: "
            "its file was removed or cut"
        )
        self.job_id = job_id
        self.stored = stored
        self.counted = counted


class Backend(Protocol):
    description: str
    """Where the state lives, for logs and errors (no password)."""

    def load(self, max_events: int) -> Loaded: ...

    def write(self, batches: Sequence[Batch]) -> Mapping[str, int]:
        """Write the batches in one transaction, in order; raise :class:`StoreWriteError`.

        Returns the jobs whose stored output was found shorter than committed (a file
        removed under a running controller) with the length it now counts: the store
        lowers its own count to match, and the worker resends the rest."""

    def read_output(self, job_id: str, offset: int, limit: int | None) -> bytes:
        """Stored output of a job from ``offset`` (at most ``limit`` bytes); raises
        :class:`OutputRecounted` once it lowered the job's stored length to what is left."""

    def read_job(self, job_id: str) -> tuple[str, int] | None:
        """A stored job document and its stored output length; None if there is none."""

    def read_finished(
        self, state: str | None, after: int | None, limit: int, newest_first: bool
    ) -> list[tuple[str, int]]:
        """Stored finished jobs by ``seq`` after the cursor ``after``, with output lengths."""

    def delete_finished_before(
        self, wall_time: float, limit: int, keep: Collection[str] = ()
    ) -> list[tuple[str, str]]:
        """Retention: delete at most ``limit`` of the jobs that finished before ``wall_time``
        (the oldest first) in one transaction, but none of ``keep`` (jobs a request is
        reading: deleted under a reader, its output would end short with no error); their
        ids and states."""

    def read_events(self, after: int, limit: int) -> list[tuple[int, str, float, str]]:
        """Stored events with ``seq > after`` (older than the store keeps in memory)."""

    def webhook_cursors(self) -> dict[str, int]: ...

    def save_webhook_cursor(self, url: str, seq: int) -> None: ...

    def close(self) -> None: ...


class MemoryBackend:
    """Keeps what it is given in dicts, for as long as the process lives.

    A faithful backend without a database (tests, simulations): what the store
    evicts after a commit can be read back, as from SQLite.
    """

    description = "memory"

    def __init__(self) -> None:
        self._cursors: dict[str, int] = {}
        self._jobs: dict[str, JobRow] = {}
        self._output: dict[str, bytearray] = {}

    def load(self, max_events: int) -> Loaded:
        return Loaded(meta={}, jobs=(), hosts=(), events=(), output={})

    def write(self, batches: Sequence[Batch]) -> Mapping[str, int]:
        for b in batches:
            for row in b.jobs:
                self._jobs[row.job_id] = row
            for job_id, off, data in b.output:
                out = self._output.setdefault(job_id, bytearray())
                if off == len(out):
                    out += data
        return {}

    def read_output(self, job_id: str, offset: int, limit: int | None) -> bytes:
        out = self._output.get(job_id, bytearray())
        return bytes(out[offset : None if limit is None else offset + limit])

    def read_job(self, job_id: str) -> tuple[str, int] | None:
        row = self._jobs.get(job_id)
        return None if row is None else (row.data, len(self._output.get(job_id, b"")))

    def read_finished(
        self, state: str | None, after: int | None, limit: int, newest_first: bool
    ) -> list[tuple[str, int]]:
        rows = sorted(
            (r for r in self._jobs.values() if r.finished_at is not None),
            key=lambda r: r.seq,
            reverse=newest_first,
        )
        if state is not None:
            rows = [r for r in rows if r.state == state]
        if after is not None:
            rows = [r for r in rows if (r.seq < after if newest_first else r.seq > after)]
        return [(r.data, len(self._output.get(r.job_id, b""))) for r in rows[:limit]]

    def delete_finished_before(
        self, wall_time: float, limit: int, keep: Collection[str] = ()
    ) -> list[tuple[str, str]]:
        old = sorted(
            (r.finished_at, r.job_id, r.state)
            for r in self._jobs.values()
            if r.finished_at is not None and r.finished_at < wall_time and r.job_id not in keep
        )
        gone = [(job_id, state) for _, job_id, state in old[:limit]]
        for job_id, _ in gone:
            del self._jobs[job_id]
            self._output.pop(job_id, None)
        return gone

    def read_events(self, after: int, limit: int) -> list[tuple[int, str, float, str]]:
        return []  # events dropped from memory are gone

    def webhook_cursors(self) -> dict[str, int]:
        return dict(self._cursors)

    def save_webhook_cursor(self, url: str, seq: int) -> None:
        self._cursors[url] = seq

    def close(self) -> None:
        pass
