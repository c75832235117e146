"""Group commits (``Durability.flush``): changes made while a commit is written go in one
next commit, every waiter wakes when its commit ends, and a failed commit fails every
request whose change it held, without one retry per request."""

from __future__ import annotations

import contextlib
import threading
from typing import Any

import trio

from rc_worker.controller.durable import Durability
from rc_worker.controller.errors import StoreUnavailable
from rc_worker.controller.persist import StoreWriteError
from rc_worker.controller.store import Store, StoreConfig


class GatedBackend:
    """Writes nothing; each write waits (in its thread) until the test opens the gate, and
    fails while ``failing`` is set."""

    description = "a test backend"

    def __init__(self) -> None:
        self.writes: list[list[str]] = []
        self.asked = 0
        self.gate = threading.Semaphore(0)
        self.failing = False

    def write(self, batches: list[Any]) -> dict[str, int]:
        self.asked += 1
        self.gate.acquire(timeout=30)
        self.writes.append([job.job_id for batch in batches for job in batch.jobs])
        if self.failing:
            raise StoreWriteError("the disk is full")
        return {}


async def writing(backend: GatedBackend, count: int) -> None:
    """Wait until ``count`` writes have been asked for (the gate holds them)."""
    for _ in range(3000):
        if backend.asked >= count:
            return
        await trio.sleep(0.01)
    raise AssertionError("no write came")


async def test_changes_made_during_a_commit_are_stored_by_one_next_commit() -> None:
    store = Store(StoreConfig())
    backend = GatedBackend()
    d = Durability(store, backend)  # type: ignore[arg-type]
    first = store.submit(["true"])
    done: list[str] = []

    async def flush(name: str) -> None:
        await d.flush()
        done.append(name)

    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(flush, "first")
            await writing(backend, 1)  # the first commit is being written (held at the gate)
            second, third = store.submit(["true"]), store.submit(["true"])
            for name in ("second", "third", "fourth"):
                nursery.start_soon(flush, name)
            await trio.sleep(0.05)
            assert done == []
            backend.gate.release()  # the first commit ends; the next one starts...
            await writing(backend, 2)
            backend.gate.release()  # ...and ends
    assert backend.writes == [[first], sorted([second, third])]  # two commits for four waiters
    assert sorted(done) == ["first", "fourth", "second", "third"]
    assert not d.dirty()


async def test_a_failed_commit_fails_each_request_it_held_once() -> None:
    store = Store(StoreConfig())
    backend = GatedBackend()
    backend.failing = True
    d = Durability(store, backend)  # type: ignore[arg-type]
    store.submit(["true"])
    failed: list[str] = []

    async def flush(name: str) -> None:
        try:
            await d.flush()
        except StoreUnavailable:
            failed.append(name)

    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            for name in ("a", "b", "c"):
                nursery.start_soon(flush, name)
            await writing(backend, 1)
            await trio.sleep(0.05)  # b and c wait for that commit
            backend.gate.release()
    assert sorted(failed) == ["a", "b", "c"]
    assert len(backend.writes) == 1  # one write for the three of them, not one each
    assert d.failed is not None
    assert d.dirty()
    backend.failing = False
    backend.gate.release()
    with trio.fail_after(30):
        await d.flush()
    assert d.failed is None
    assert not d.dirty()


async def test_a_job_whose_commit_is_in_flight_stays_in_memory_until_it_is_stored() -> None:
    """A finished job whose end is in the commit being written must not leave memory
    meanwhile: if that commit fails, the retry re-reads the job's record from memory, and
    an evicted one would never have its end stored (a cancelled job queued again after a
    restart). Found by a review with keep_finished=1."""
    store = Store(StoreConfig())
    backend = GatedBackend()
    backend.failing = True
    d = Durability(store, backend, keep_finished=0)  # type: ignore[arg-type]
    job = store.submit(["true"])
    store.cancel(job)  # finished: its end is in the next commit

    async def failing_flush() -> None:
        with contextlib.suppress(StoreUnavailable):
            await d.flush()

    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(failing_flush)
            await writing(backend, 1)  # in flight, held at the gate
            # Anything may evict meanwhile (a request's end, a job read back).
            store.evict_finished(0, d.busy)
            assert store.in_memory(job)
            backend.gate.release()  # ...and the commit fails
    backend.failing = False
    backend.gate.release()
    with trio.fail_after(30):
        await d.flush()  # the retry
    assert backend.writes[-1] == [job]  # its end is stored
    assert not store.in_memory(job)  # stored: now it may leave (keep_finished=0)


class BuggyBackend(GatedBackend):
    """Fails its first write with an error that is not a :class:`StoreWriteError` (a bug
    in a backend, a driver raising something unexpected)."""

    def __init__(self) -> None:
        super().__init__()
        self.bug = True

    def write(self, batches: list[Any]) -> dict[str, int]:
        written = super().write(batches)
        if self.bug:
            self.bug = False
            raise RuntimeError("a bug in the backend")
        return written


async def test_a_commit_that_fails_unexpectedly_answers_no_request_as_stored() -> None:
    """A commit that raised anything but StoreWriteError lost its marks and left no failure
    for its waiters to see: each of them then wrote a commit of its own, without the lost
    changes, and returned as if its change were stored; the change never was."""
    store = Store(StoreConfig())
    backend = BuggyBackend()
    d = Durability(store, backend)  # type: ignore[arg-type]
    job = store.submit(["true"])
    outcomes: dict[str, str] = {}

    async def flush(name: str) -> None:
        try:
            await d.flush()
        except StoreUnavailable:
            outcomes[name] = "503"
        except RuntimeError:
            outcomes[name] = "bug"
        else:
            outcomes[name] = "stored"

    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(flush, "leader")
            await writing(backend, 1)  # the commit holding the job, at the gate
            nursery.start_soon(flush, "waiter")  # its change is in that commit
            await trio.sleep(0.05)
            for _ in range(3):
                backend.gate.release()  # the buggy write, and any that follow it
    assert outcomes == {"leader": "503", "waiter": "503"}
    assert d.dirty()  # the job's change is still owed
    with trio.fail_after(30):
        backend.gate.release()
        await d.flush()
    assert [job] in backend.writes[1:]  # stored by the retry: its marks were put back
    assert not d.dirty()
