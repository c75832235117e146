"""Durable before acknowledged: group commits of the store's changes, and 503 while failing.

:class:`Durability` takes what the store's journal marked and writes it through
a persistence backend in a thread (never on the event loop). Requests that
change state are answered only after the commit that holds their change:
:class:`DurableMiddleware` holds back each response's first message until
:meth:`Durability.flush` returns. Commits group themselves: while one is being
written, every request that changes something waits on the lock, and the next
commit takes all their changes at once.

When a write fails, the batch is kept (written first next time), the request
that waited for it gets ``503 store_unavailable`` with ``Retry-After``, and every
later request that could change state gets the same at once, without touching
the store, until :meth:`Durability.run` manages a write again.
"""

from __future__ import annotations

import contextlib
import json
import logging
import time
from typing import Any, Final

import anyio
import anyio.to_thread

from rc_worker.controller.errors import StoreUnavailable
from rc_worker.controller.messages import Event
from rc_worker.controller.persist import Backend, StoreWriteError
from rc_worker.controller.persist.codec import Batch, take_batch
from rc_worker.controller.state import StoreState

__all__ = ["Durability", "DurableMiddleware"]

log = logging.getLogger("rc_worker.controller.durable")

RETRY_AFTER_S: Final = 2
RETRY_INTERVAL_S: Final = 1.0
READ_METHODS: Final = frozenset({"GET", "HEAD", "OPTIONS"})


class Durability:
    """The store's journal, committed through ``backend``."""

    def __init__(self, store: StoreState, backend: Backend) -> None:
        self.store = store
        self.backend = backend
        store.journal.enable()
        self.written = store.journal.generation
        self.pending: list[Batch] = []
        self.failed: str | None = None
        """Why the last write failed; None while writes succeed."""
        self._lock: anyio.Lock | None = None
        self.last_commit_s: float | None = None
        """How long the last successful commit took to write (for /v1/health)."""

    def dirty(self) -> bool:
        return bool(self.pending) or self.store.journal.generation > self.written

    async def flush(self) -> None:
        """Return once everything changed so far is stored; :class:`StoreUnavailable` if not."""
        target = self.store.journal.generation
        if target <= self.written and not self.pending:
            return
        if self._lock is None:
            self._lock = anyio.Lock()
        async with self._lock:
            if target <= self.written and not self.pending:
                return  # the commit that held the lock before took this change too
            self.pending.append(take_batch(self.store))
            batches = list(self.pending)
            try:
                # Shielded: a request cancelled mid-commit must not leave the outcome unknown.
                with anyio.CancelScope(shield=True):
                    began = time.perf_counter()
                    await anyio.to_thread.run_sync(self.backend.write, batches)
                    self.last_commit_s = time.perf_counter() - began
                    stats = getattr(self.store, "stats", None)
                    if stats is not None:
                        stats.commit_latency.observe(self.last_commit_s)
            except StoreWriteError as e:
                if self.failed is None:
                    log.error("%s; answering 503 until it works again", e)
                self.failed = str(e)
                raise StoreUnavailable(
                    f"the controller could not store this change ({e}); retry later"
                ) from None
            if self.failed is not None:
                log.warning("the store works again (%s)", self.backend.description)
            self.failed = None
            self.pending.clear()
            self.written = batches[-1].generation
            # Committed output leaves memory: reads below it go to the backend.
            stored: dict[str, int] = {}
            for batch in batches:
                for job_id, off, data in batch.output:
                    stored[job_id] = max(stored.get(job_id, 0), off + len(data))
            for job_id, upto in stored.items():
                self.store.trim_output(job_id, upto)

    async def read_events(self, after: int, limit: int) -> list[Event]:
        """Stored events after ``after``, read in a thread."""
        try:
            rows = await anyio.to_thread.run_sync(self.backend.read_events, after, limit)
        except StoreWriteError as e:
            raise StoreUnavailable(f"the controller could not read events ({e})") from None
        return [Event(seq, type_, t, json.loads(data)) for seq, type_, t, data in rows]

    async def read_output(self, job_id: str, offset: int, limit: int | None) -> bytes:
        """Stored output, read in a thread (:class:`StoreUnavailable` if the read fails)."""
        try:
            return await anyio.to_thread.run_sync(self.backend.read_output, job_id, offset, limit)
        except StoreWriteError as e:
            raise StoreUnavailable(f"the controller could not read this output ({e})") from None

    async def run(
        self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED
    ) -> None:
        """While the store is failing, retry the kept batch every second; runs until cancelled."""
        task_status.started()
        while True:
            await anyio.sleep(RETRY_INTERVAL_S)
            if self.failed is not None or self.dirty():
                with contextlib.suppress(StoreUnavailable):
                    await self.flush()


async def _send_503(send: Any, message: str) -> None:
    body = json.dumps({"error": "store_unavailable", "message": message}).encode()
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
    """ASGI middleware: a request that may change state is answered only once it is stored."""

    def __init__(self, app: Any, durability: Durability) -> None:
        self.app = app
        self.durability = durability

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope["method"] in READ_METHODS:
            await self.app(scope, receive, send)
            return
        d = self.durability
        if d.failed is not None:
            await _send_503(send, f"the controller cannot store changes now ({d.failed})")
            return
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
