"""Helpers for the persistence tests: where a store lives, and a controller opened on it."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Collection, Mapping, Sequence
from pathlib import Path

import attrs
import httpx
import trio
from starlette.applications import Starlette

from rc_worker.controller import Store, StoreConfig, create_app
from rc_worker.controller.durable import KEEP_FINISHED, Durability
from rc_worker.controller.messages import JobInfo
from rc_worker.controller.persist import Backend, StoreWriteError
from rc_worker.controller.persist.codec import Batch, Loaded
from rc_worker.controller.persist.opening import open_backend, open_store

from .helpers import USER_TOKEN, USER_TOKENS, WORKER_TOKENS, auth
from .pgserver import PgServer

OPENED: list[Backend] = []
"""Every backend a test opened through :meth:`StorePlace.open`: closed at its end by the
``close_opened_backends`` fixture, whether the test closed them or failed first."""


def close_opened() -> None:
    """Close every backend opened since the last call (closing twice is harmless)."""
    while OPENED:
        backend = OPENED.pop()
        with contextlib.suppress(Exception):
            backend.close()


@attrs.define
class StorePlace:
    kind: str
    state_dir: Path | None = None
    db: str | None = None
    server: PgServer | None = None
    opened: list[Backend] = attrs.Factory(list)

    def open(self) -> Backend:
        """A backend on this store, as a controller process starting now would open it.

        The tests play a controller killed and a new one started within one process, by
        opening again without closing. A killed process's state-directory lock is dropped
        by the kernel; here, the earlier backends' locks are let go in the same way (their
        connections are left as they were).
        """
        for earlier in self.opened:
            lock = getattr(earlier, "_lock", None)
            if lock is not None:
                lock.release()
        backend = open_backend(state_dir=self.state_dir, db=self.db)
        self.opened.append(backend)
        OPENED.append(backend)
        return backend

    def cli_args(self) -> list[str]:
        if self.db is not None:
            return ["--db", self.db]
        assert self.state_dir is not None
        return ["--state-dir", str(self.state_dir)]


class Breakable:
    """A backend whose writes can be made to fail, as a full or read-only disk would."""

    def __init__(self, inner: Backend) -> None:
        self.inner = inner
        self.description = inner.description
        self.broken = False

    def load(self, max_events: int) -> Loaded:
        return self.inner.load(max_events)

    def write(self, batches: Sequence[Batch]) -> Mapping[str, int]:
        if self.broken:
            raise StoreWriteError(f"writing to {self.description} failed: disk I/O error")
        return self.inner.write(batches)

    def read_output(self, job_id: str, offset: int, limit: int | None) -> bytes:
        return self.inner.read_output(job_id, offset, limit)

    def read_events(self, after: int, limit: int) -> list[tuple[int, str, float, str]]:
        return self.inner.read_events(after, limit)

    def read_job(self, job_id: str) -> tuple[str, int] | None:
        return self.inner.read_job(job_id)

    def read_finished(
        self, state: str | None, after: int | None, limit: int, newest_first: bool
    ) -> list[tuple[str, int]]:
        return self.inner.read_finished(state, after, limit, newest_first)

    def delete_finished_before(
        self, wall_time: float, limit: int, keep: Collection[str] = ()
    ) -> list[tuple[str, str]]:
        return self.inner.delete_finished_before(wall_time, limit, keep)

    def webhook_cursors(self) -> dict[str, int]:
        return self.inner.webhook_cursors()

    def save_webhook_cursor(self, url: str, seq: int) -> None:
        self.inner.save_webhook_cursor(url, seq)

    def close(self) -> None:
        self.inner.close()


@attrs.define
class Opened:
    store: Store
    app: Starlette
    durability: Durability
    backend: Backend
    had_state: bool


def open_controller(
    backend: Backend,
    config: StoreConfig | None = None,
    *,
    grace: float | None = 300.0,
    keep_finished: int = KEEP_FINISHED,
) -> Opened:
    store, had = open_store(backend, config, now=trio.current_time(), recovery_grace_s=grace)
    durability = Durability(store, backend, keep_finished=keep_finished)
    app = create_app(
        store=store, worker_tokens=WORKER_TOKENS, user_tokens=USER_TOKENS, durability=durability
    )
    return Opened(store, app, durability, backend, had)


async def all_jobs(opened: Opened) -> list[JobInfo]:
    """Every job of the store, in memory or only in the database beneath."""
    jobs, _ = await opened.durability.jobs_page(None, after=None, limit=None, newest_first=False)
    return jobs


@contextlib.asynccontextmanager
async def clients(app: Starlette) -> AsyncIterator[tuple[httpx.AsyncClient, httpx.AsyncClient]]:
    """A bare client (for FakeWorker) and a user client, both in-process."""
    transport = httpx.ASGITransport(app=app)
    async with (
        httpx.AsyncClient(transport=transport, base_url="http://rc") as bare,
        httpx.AsyncClient(
            transport=transport, base_url="http://rc", headers=auth(USER_TOKEN)
        ) as user,
    ):
        yield bare, user
