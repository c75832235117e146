"""Durable before acknowledged: group commits of the store's changes, and 503 while failing.

:class:`Durability` takes what the store's journal marked and writes it through
a persistence backend in a thread (never on the event loop). Requests that
change state are answered only after the commit that holds their change:
:class:`DurableMiddleware` holds back each response's first message until
:meth:`Durability.flush` returns. Commits group themselves: while one is being
written, every request that changes something waits for it to end, and the next
commit takes all their changes at once.

When a write fails, its marks go back into the journal (the next commit writes
them, re-read from the records, with whatever changed since: one batch, however
long the outage), the request that waited for it gets ``503 store_unavailable``
with ``Retry-After``, and every later request that could change state gets the
same at once, without touching the store, until :meth:`Durability.run` manages a
write again.

Bounded memory: once stored, finished jobs beyond the most recent
:data:`KEEP_FINISHED` leave memory (:meth:`StoredState.evict_finished`). Reads of
them (:meth:`Durability.job_info`, :meth:`Durability.jobs_page`, output) go to
the backend in a thread; a request that acts on one (a late finish, a cancel, a
claim) first brings it back (:meth:`Durability.ensure_jobs`), and keeps it in
memory while it runs (:class:`DurableMiddleware` pins it).
"""

from __future__ import annotations

import collections
import contextlib
import json
import logging
import re
import time
from collections.abc import Iterable
from typing import Any, Final, NoReturn

import anyio
import anyio.to_thread

from rc_worker.controller.errors import NotFound, StoreUnavailable
from rc_worker.controller.job_filter import JobFilter
from rc_worker.controller.journal import Marks
from rc_worker.controller.messages import Event, JobInfo
from rc_worker.controller.persist import Backend, OutputRecounted, StoreWriteError
from rc_worker.controller.persist.codec import batch_of, stored_job
from rc_worker.controller.records import Job
from rc_worker.controller.store import Store
from rc_worker.core.protocol import ErrorReply, unstructure

__all__ = ["Durability", "DurableMiddleware"]

log = logging.getLogger("rc_worker.controller.durable")

RETRY_AFTER_S: Final = StoreUnavailable.retry_after_s
RETRY_INTERVAL_S: Final = 1.0
READ_METHODS: Final = frozenset({"GET", "HEAD", "OPTIONS"})
KEEP_FINISHED: Final = 1000
"""Finished jobs kept in memory once stored (the most recent): late reports about a job
that just ended are decided without a read from the store."""
JOB_PATH: Final = re.compile(r"^/v1/jobs/([^/]+)(?:/|$)")


class Durability:
    """The store's journal, committed through ``backend``."""

    def __init__(
        self, store: Store, backend: Backend, *, keep_finished: int = KEEP_FINISHED
    ) -> None:
        self.store = store
        self.backend = backend
        self.keep_finished = keep_finished
        store.journal.enable()
        self.written = store.journal.generation
        self.failed: str | None = None
        """Why the last write failed; None while writes succeed."""
        self._committing: anyio.Event | None = None
        """Set while a commit is being written; set (the event) when it ends."""
        self._failed_commit: tuple[int, str] | None = None
        """The generation the last commit covered and why it failed, if it failed."""
        self.last_commit_s: float | None = None
        """How long the last successful commit took to write (for /v1/health)."""
        self.busy: collections.Counter[str] = collections.Counter()
        """Jobs a request in flight uses: never evicted meanwhile."""

    def dirty(self) -> bool:
        return self.store.journal.generation > self.written

    async def flush(self) -> None:
        """Return once everything changed so far is stored; :class:`StoreUnavailable` if not.

        One commit is written at a time. A caller whose change came in while one was being
        written waits for it to end, then returns if that commit held its change, or starts
        the next (which takes every change made meanwhile). Waiters wait on an event, not a
        lock: all of them wake together when the commit ends. With a lock each of them had
        to be handed it in turn, one per pass of the event loop, before the next commit
        could start, and under load the commits slowed to a few a second.
        """
        target = self.store.journal.generation
        while target > self.written:
            if self._committing is not None:
                ending = self._committing
                await ending.wait()
                failed = self._failed_commit
                if target > self.written and failed is not None and failed[0] >= target:
                    # The commit that held this change failed: so does this request.
                    raise StoreUnavailable(failed[1])
                continue
            await self._commit()

    async def _commit(self) -> None:
        self._committing = anyio.Event()
        try:
            marks, generation = self.store.journal.take()
            try:
                batch = batch_of(self.store, marks, generation)
                # Shielded: a request cancelled mid-commit must not leave the outcome unknown.
                with anyio.CancelScope(shield=True):
                    began = time.perf_counter()
                    recounted = await anyio.to_thread.run_sync(self.backend.write, [batch])
                    self.last_commit_s = time.perf_counter() - began
                    self.store.stats.commit_latency.observe(self.last_commit_s)
            except StoreWriteError as e:
                self._fail(marks, generation, str(e))
            except Exception as e:
                # Not a store error: a bug (in the backend, in building the batch). Failed
                # all the same: marks dropped here were never written, and a waiter that
                # saw no failure would take the next commit, made without them, for its own.
                log.exception("a commit failed unexpectedly")
                self._fail(marks, generation, f"unexpected error: {e!r}")
            if self.failed is not None:
                log.warning("the store works again (%s)", self.backend.description)
            self.failed = None
            self._failed_commit = None
            self.written = generation
            self.store.journal.stored()
            for job_id, length in recounted.items():
                # Its file was removed or cut: what the store counts follows what is
                # stored, and the worker's next output is told where to resend from.
                self.store.recount_output(job_id, length)
            # Committed output leaves memory: reads below it go to the backend.
            stored: dict[str, int] = {}
            for job_id, off, data in batch.output:
                stored[job_id] = max(stored.get(job_id, 0), off + len(data))
            stored.update(recounted)  # no piece past a hole was stored
            for job_id, upto in stored.items():
                self.store.trim_output(job_id, upto)
            # So do stored finished jobs, but the most recent.
            self.store.evict_finished(self.keep_finished, self.busy)
        finally:
            ending, self._committing = self._committing, None
            ending.set()

    def _fail(self, marks: Marks, generation: int, why: str) -> NoReturn:
        """A commit failed: its marks go back into the journal (written next time, re-read
        from the records: batches never pile up), and the requests it held are answered 503."""
        self.store.journal.put_back(marks)
        if self.failed is None:
            log.error("%s; answering 503 until it works again", why)
        self.failed = why
        message = f"the controller could not store this change ({why}); retry later"
        self._failed_commit = (generation, message)
        raise StoreUnavailable(message) from None

    # --- finished jobs, read from the backend -----------------------------------------------

    async def _read_job(self, job_id: str) -> Job | None:
        """A job the store beneath holds, read in a thread; None if it holds none."""
        try:
            row = await anyio.to_thread.run_sync(self.backend.read_job, job_id)
        except StoreWriteError as e:
            raise StoreUnavailable(f"the controller could not read job {job_id} ({e})") from None
        return None if row is None else stored_job(row[0], row[1], anyio.current_time())

    async def ensure_jobs(self, job_ids: Iterable[str]) -> None:
        """Bring the named jobs the store beneath holds back into memory, so that a decision
        about them is made on their record (ids nobody stored are left unknown)."""
        wanted = list(dict.fromkeys(job_ids))
        for job_id in wanted:
            if self.store.in_memory(job_id):
                continue
            job = await self._read_job(job_id)
            if job is not None and not self.store.in_memory(job_id):
                self.store.readmit(job)
        # Room for them, but they stay until the caller's decision (the next commit's
        # eviction, or the request's end, may drop them then).
        self.store.evict_finished(self.keep_finished, [*self.busy, *wanted])

    async def job_info(self, job_id: str) -> JobInfo:
        """A job's record: from memory, else from the store beneath (never brought back)."""
        if self.store.in_memory(job_id):
            return self.store.job(job_id)
        job = await self._read_job(job_id)
        if job is None:
            if self.store.in_memory(job_id):  # submitted or brought back meanwhile
                return self.store.job(job_id)
            raise NotFound(f"no job {job_id!r}", code="unknown_job")
        return job.info()

    async def jobs_page(
        self,
        state: str | None,
        *,
        after: int | None,
        limit: int | None,
        newest_first: bool,
        where: JobFilter | None = None,
    ) -> tuple[list[JobInfo], int | None]:
        """One page of every job (in memory or only in the store beneath), by ``seq``.

        What is in memory is taken first, then the stored finished jobs, leaving out any
        job that was in memory then (its record there is the newer one): a job evicted
        meanwhile was stored before it left, so it is in the read either way.
        """
        store = self.store
        big = limit if limit is not None else 2**62
        mem, _ = store.jobs_page(
            state, after=after, limit=big + 1, newest_first=newest_first, where=where
        )
        merged = [(j.seq, info) for j, info in zip(mem, store.views(mem), strict=True)]
        known = store.memory_job_ids()
        cursor, found = after, 0
        while found <= big:
            try:
                rows = await anyio.to_thread.run_sync(
                    self.backend.read_finished, state, cursor, big + 1, newest_first
                )
            except StoreWriteError as e:
                raise StoreUnavailable(f"the controller could not read jobs ({e})") from None
            for doc, stored_bytes in rows:
                job = stored_job(doc, stored_bytes, 0.0)
                cursor = job.seq
                if job.job_id not in known and (where is None or where(job)):
                    merged.append((job.seq, job.info()))
                    found += 1
            if len(rows) <= big:
                break  # the store has no more
        merged.sort(key=lambda pair: pair[0], reverse=newest_first)
        page = merged[:big]
        nxt = page[-1][0] if len(merged) > big and page else None
        return [info for _, info in page], nxt

    async def read_events(self, after: int, limit: int) -> list[Event]:
        """Stored events after ``after``, read in a thread."""
        try:
            rows = await anyio.to_thread.run_sync(self.backend.read_events, after, limit)
        except StoreWriteError as e:
            raise StoreUnavailable(f"the controller could not read events ({e})") from None
        return [Event(seq, type_, t, json.loads(data)) for seq, type_, t, data in rows]

    async def read_output(self, job_id: str, offset: int, limit: int | None) -> bytes:
        """Stored output, read in a thread (:class:`StoreUnavailable` if the read fails).

        Output whose file went under the running controller is counted at what is left
        (as the commit of a running job's next output would) and read again: served, the
        rest given up with a warning and a ``job_output_recounted`` event, rather than a
        503 on every read until the file is restored or ``rc serve`` restarts. (A request
        naming a job holds its record in memory, :class:`DurableMiddleware`: the count
        lowered there is the one the answer reports.)"""
        try:
            return await self._read_stored(job_id, offset, limit)
        except OutputRecounted as e:
            self.store.recount_output(e.job_id, e.counted)
        try:
            return await self._read_stored(job_id, offset, limit)
        except OutputRecounted as e:  # cut again between the two reads
            self.store.recount_output(e.job_id, e.counted)
            raise StoreUnavailable(f"the controller could not read this output ({e})") from None

    async def _read_stored(self, job_id: str, offset: int, limit: int | None) -> bytes:
        try:
            return await anyio.to_thread.run_sync(self.backend.read_output, job_id, offset, limit)
        except OutputRecounted:
            raise
        except StoreWriteError as e:
            raise StoreUnavailable(f"the controller could not read this output ({e})") from None

    async def run(
        self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED
    ) -> None:
        """Store what is not stored yet (changes kept while the store failed, changes no
        request waited for) every second; runs until cancelled."""
        task_status.started()
        while True:
            await anyio.sleep(RETRY_INTERVAL_S)
            if self.dirty():
                with contextlib.suppress(StoreUnavailable):
                    await self.flush()


async def _send_503(send: Any, message: str) -> None:
    body = json.dumps(unstructure(ErrorReply("store_unavailable", message))).encode()
    await send(
        {
            "type": "http.response.start",
            "status": 503,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(body)).encode()),
                (b"retry-after", str(RETRY_AFTER_S).encode()),
            ],
        }
    )
    await send({"type": "http.response.body", "body": body})


class DurableMiddleware:
    """ASGI middleware: a request that may change state is answered only once it is stored;
    a request naming a job (``/v1/jobs/{id}/…``) has that job's record in memory while it
    runs (brought back from the store beneath if it had left, and pinned there)."""

    def __init__(self, app: Any, durability: Durability) -> None:
        self.app = app
        self.durability = durability

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        d = self.durability
        read_only = scope["method"] in READ_METHODS
        if not read_only and d.failed is not None:
            await _send_503(send, f"the controller cannot store changes now ({d.failed})")
            return
        match = JOB_PATH.match(scope.get("path", ""))
        job_id = None if match is None else match.group(1)
        if job_id is not None:
            d.busy[job_id] += 1
        try:
            if job_id is not None:
                try:
                    await d.ensure_jobs([job_id])
                except StoreUnavailable as e:
                    await _send_503(send, e.message)
                    return
            if read_only:
                await self.app(scope, receive, send)
            else:
                await self._answer_when_stored(scope, receive, send)
        finally:
            if job_id is not None:
                d.busy[job_id] -= 1
                if d.busy[job_id] <= 0:
                    del d.busy[job_id]
                    # Kept while the request used it: it may leave now (if stored).
                    d.store.evict_finished(d.keep_finished, d.busy)

    async def _answer_when_stored(self, scope: Any, receive: Any, send: Any) -> None:
        d = self.durability
        replaced = False

        async def send_when_stored(message: Any) -> None:
            nonlocal replaced
            if replaced:
                return
            if message["type"] == "http.response.start":
                try:
                    await d.flush()
                except StoreUnavailable as e:
                    replaced = True
                    await _send_503(send, e.message)
                    return
            await send(message)

        await self.app(scope, receive, send_when_stored)
