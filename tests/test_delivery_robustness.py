"""What a worker's delivery survives without going down (from a review of the outbox).

A damaged report left on disk, a file system gone read-only, an answer that does not
decode, a controller whose committed offset goes back and forth, a finish whose write is
cancelled: each once took the worker down, looped, or held a device for ever.
"""

from __future__ import annotations

import errno
import json
import logging
import random
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio
from test_delivery import (
    JOB,
    JOB_OUTPUT,
    failing_release_hook,
    finished_events,
    leave_finish_on_disk,
    left_on_disk,
    steady_store,
)

from rc_worker import client as client_module
from rc_worker.durable import Committer
from rc_worker.outbox import Outbox, _Delivery
from rc_worker.spool import JobDir, ensure_state_dir
from rc_worker.statestore import LinuxStore
from rc_worker.testing import local_system, make_config


@pytest.fixture(autouse=True)
def fast_retries(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(client_module, "RETRY_BASE_S", 0.005)
    monkeypatch.setattr(client_module, "RETRY_CAP_S", 0.05)


@pytest.mark.parametrize("damaged", [None, "lots", [1]])
async def test_a_finish_on_disk_with_a_damaged_output_count_is_still_delivered(
    tmp_path: Path, damaged: object
) -> None:
    store = steady_store()
    config = make_config(tmp_path)
    job_id = store.submit(["sh", "-c", "echo done; exit 4"])
    with trio.fail_after(40):
        finish = await leave_finish_on_disk(config, store, job_id)
        report = json.loads(finish.read_text())
        report["output_bytes"] = damaged
        finish.write_text(json.dumps(report))
        async with local_system(config, store=store) as system:  # not down at its start
            info = await system.wait_job(job_id)
    assert info.state == "failed"
    assert info.exit_code == 4
    assert store.output(job_id) == b"done\n"


async def test_a_delivered_fault_that_cannot_be_removed_does_not_take_the_worker_down(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    config = failing_release_hook(tmp_path)
    real_unlink = LinuxStore.unlink

    def unlink(self: LinuxStore, path: Path) -> None:
        if path.parent.name == "faults":
            raise OSError(errno.EROFS, "Read-only file system", str(path))
        real_unlink(self, path)

    monkeypatch.setattr(LinuxStore, "unlink", unlink)
    store = steady_store()
    job_id = store.submit(JOB)
    caplog.set_level(logging.ERROR, logger="rc_worker.outbox")
    with trio.fail_after(40):
        async with local_system(config, store=store) as system:
            await system.wait_job(job_id)
            await system.wait_until(lambda: system.device("gpu0").state == "quarantined")
            for _ in range(200):  # bounded: until the delivered fault's removal was tried
                if any("cannot remove delivered fault" in r.getMessage() for r in caplog.records):
                    break
                await trio.sleep(0.01)
    assert any("cannot remove delivered fault" in r.getMessage() for r in caplog.records)
    assert store.device("test-host", "gpu0").state == "quarantined"


class Undecodable(httpx.AsyncBaseTransport):
    """Lets every request through, but answers the first output request (applied at the
    controller) with a body its Content-Encoding does not decode."""

    def __init__(self, inner: httpx.AsyncBaseTransport) -> None:
        self.inner, self.garbled = inner, 0

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        response = await self.inner.handle_async_request(request)
        if request.url.path.endswith("/output") and not self.garbled:
            self.garbled += 1
            await response.aread()
            return httpx.Response(
                200, headers={"Content-Encoding": "gzip"}, content=b"not gzip", request=request
            )
        return response


async def test_an_answer_that_does_not_decode_is_retried_not_raised(tmp_path: Path) -> None:
    store = steady_store()
    config = make_config(tmp_path)
    job_id = store.submit(JOB)
    made: list[Undecodable] = []

    def wrap(inner: httpx.AsyncBaseTransport) -> httpx.AsyncBaseTransport:
        made.append(Undecodable(inner))
        return made[0]

    with trio.fail_after(40):
        async with local_system(config, store=store, transport_wrapper=wrap) as system:
            info = await system.wait_job(job_id)
    assert made[0].garbled == 1
    assert info.state == "succeeded"
    assert store.output(job_id) == JOB_OUTPUT
    assert len(finished_events(store, job_id)) == 1
    assert left_on_disk(config) == []


class Enough(Exception):
    pass


class Flapping:
    """A controller (two behind a balancer, say) that holds at most 100 bytes and answers
    every other output request with 0; it ends the test after ``limit`` requests."""

    generation = 1  # registered once, never again

    def __init__(self, limit: int) -> None:
        self.calls, self.limit = 0, limit

    async def output(
        self, job_id: str, attempt: int, offset: int, data: Any, length: int | None = None
    ) -> int:
        self.calls += 1
        if self.calls > self.limit:
            raise Enough
        sent = 0
        if callable(data):
            async for piece in data():
                sent += len(piece)
        await trio.lowlevel.checkpoint()
        return 0 if self.calls % 2 == 0 else min(offset + sent, 100)


class Ceilings(random.Random):
    """Backoff's randomness, recorded: each delay asked for is its ceiling, noted."""

    def __init__(self) -> None:
        super().__init__(0)
        self.asked: list[float] = []

    def uniform(self, a: float, b: float) -> float:
        self.asked.append(b)
        return b


async def test_a_controller_whose_offset_goes_back_and_forth_is_backed_off_not_flooded(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every time the offset goes back the worker waits, and the wait grows while it keeps
    going back (reset only past the furthest offset seen). Before, each step forward reset
    the backoff and a step back was resent at once: tens of thousands a second."""
    monkeypatch.setattr(client_module, "RETRY_BASE_S", 0.001)
    monkeypatch.setattr(client_module, "RETRY_CAP_S", 0.008)
    jd = JobDir(ensure_state_dir(tmp_path), "j-1.1")
    jd.create()
    jd.output.write_bytes(b"x" * 250)
    client, rng = Flapping(limit=20), Ceilings()
    outbox = Outbox(tmp_path, client, rng=rng)  # type: ignore[arg-type]
    with trio.fail_after(30), pytest.raises(Enough):
        await outbox._ship_output(_Delivery(jd, "j-1", 1))
    # Ten answers of 0 (going back), each waited for, the waits doubling to the cap.
    assert len(rng.asked) >= 9
    assert rng.asked == sorted(rng.asked)
    assert rng.asked[-1] == 0.008


async def test_a_finish_whose_write_is_cancelled_still_lets_its_delivery_go(
    tmp_path: Path,
) -> None:
    class Stuck:
        store = LinuxStore()

        async def write(self, *args: Any, **kwargs: Any) -> None:
            await trio.sleep_forever()

    jd = JobDir(ensure_state_dir(tmp_path), "j-1.1")
    jd.create()
    outbox = Outbox(tmp_path, object(), committer=Stuck())  # type: ignore[arg-type]
    delivery = _Delivery(jd, "j-1", 1, device="gpu0")
    outbox._deliveries[jd.key] = delivery
    with trio.move_on_after(0.05):
        await outbox.finish(jd.key, {"outcome": "succeeded"})
    assert delivery.finish_ready.is_set()
    assert delivery.report == {"outcome": "succeeded"}


async def test_a_spool_that_cannot_be_stat_ed_ends_its_shipping_not_the_worker(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    real_exists = LinuxStore.exists

    def exists(self: LinuxStore, path: Path) -> bool:
        if path.name == "output":
            raise OSError(errno.EIO, "Input/output error", str(path))
        return real_exists(self, path)

    monkeypatch.setattr(LinuxStore, "exists", exists)
    store = steady_store()
    config = make_config(tmp_path)
    job_id = store.submit(JOB)
    caplog.set_level(logging.WARNING, logger="rc_worker.outbox")
    with trio.fail_after(40):
        async with local_system(config, store=store) as system:
            info = await system.wait_job(job_id)
    assert info.state == "succeeded"  # the finish went
    assert any("cannot stat its spooled output" in r.getMessage() for r in caplog.records)


class Holding:
    """A controller that already holds ``holds`` bytes of the job's output (sent by a
    previous worker process); it records every output request and the finish."""

    generation = 1  # registered once, never again

    def __init__(self, holds: int) -> None:
        self.holds = holds
        self.requests: list[tuple[int, bytes]] = []
        self.finished = trio.Event()

    async def output(
        self, job_id: str, attempt: int, offset: int, data: Any, length: int | None = None
    ) -> int:
        body = b""
        if callable(data):
            async for piece in data():
                body += piece
        else:
            body = bytes(data)
        self.requests.append((offset, body))
        await trio.lowlevel.checkpoint()
        if offset <= self.holds:
            self.holds = max(self.holds, offset + len(body))
        return self.holds

    async def finish(self, job_id: str, report: Any) -> None:
        self.finished.set()


async def deliver_held(tmp_path: Path, client: Holding, **kwargs: Any) -> None:
    """Hold a finish for a job whose 300 bytes of output are spooled, and deliver it."""
    jd = JobDir(ensure_state_dir(tmp_path), "j-1.1")
    jd.create()
    jd.output.write_bytes(b"x" * 300)
    outbox = Outbox(tmp_path, client)  # type: ignore[arg-type]
    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            report = {"outcome": "interrupted", "output_bytes": 300}
            outbox.hold_report(jd, "j-1", 1, report, "gpu0", **kwargs)
            await nursery.start(outbox.run)
            await client.finished.wait()
            nursery.cancel_scope.cancel()


async def test_a_held_report_of_a_recovered_job_asks_where_its_output_stands(
    tmp_path: Path,
) -> None:
    """Recovery holds a finish it cannot write for a job a previous process ran: the
    controller may hold its output already (docs/protocol.md, one job's reports in order),
    so the delivery begins with an empty append at offset 0. Before, it was taken for an
    attempt this process started and resent every byte from 0 without asking."""
    client = Holding(holds=300)
    await deliver_held(tmp_path, client)  # as the worker's recovery holds it
    assert client.requests[0] == (0, b"")
    assert client.requests == [(0, b"")]  # all 300 bytes were there: nothing resent


async def test_a_held_report_of_an_attempt_that_never_ran_starts_at_zero_unasked(
    tmp_path: Path,
) -> None:
    """An attempt this process reports as never run: nothing of it can be at the
    controller, so no round trip to ask."""
    client = Holding(holds=0)
    await deliver_held(tmp_path, client, fresh=True)
    assert client.requests == [(0, b"x" * 300)]


class FsyncRefusedOnce(LinuxStore):
    """The real disk, except that the first fsync of directory ``refuse`` fails (EIO);
    every directory fsync that succeeds is recorded."""

    def __init__(self, refuse: Path) -> None:
        self.refuse: Path | None = refuse
        self.synced: list[Path] = []

    def fsync_dir(self, path: Path) -> None:
        if path == self.refuse:
            self.refuse = None
            raise OSError(errno.EIO, "Input/output error", str(path))
        super().fsync_dir(path)
        self.synced.append(path)


async def test_a_finish_whose_directory_fsync_failed_is_written_again_at_the_stop(
    tmp_path: Path,
) -> None:
    """The file is there (renamed into place) but a power loss could take it: it counts as
    held in memory, and the stop writes it again, fsync and all. Before, its mere existence
    passed for durable: nothing was rewritten and the stop said nothing was at risk."""
    root = ensure_state_dir(tmp_path)
    jd = JobDir(root, "j-1.1")
    jd.create()
    store = FsyncRefusedOnce(refuse=jd.path)
    jd.store = store
    outbox = Outbox(root, object(), committer=Committer(store=store))  # type: ignore[arg-type]
    delivery = _Delivery(jd, "j-1", 1, device="gpu0", fresh=True)
    outbox._deliveries[jd.key] = delivery
    await outbox.finish(jd.key, {"outcome": "succeeded"})
    assert jd.finish.exists()  # renamed into place; its directory's fsync refused
    assert store.synced == []
    assert outbox.held_in_memory() == [jd.key]
    await outbox.write_held_reports()
    assert jd.path in store.synced  # written again, its directory fsynced this time
    assert json.loads(jd.finish.read_text()) == {"outcome": "succeeded"}
    assert outbox.held_in_memory() == []
