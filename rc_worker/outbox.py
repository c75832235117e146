"""Delivers what the worker owes the controller: job output, finish reports, faults.

Everything is shipped from disk (``spool.py``), never from memory alone, so
a controller outage of any length, or a worker restart, loses nothing.
Output goes first, from the controller's committed offset; the ``finish``
follows only once every byte up to ``output_bytes`` is committed; the job's
directory (journal included) is removed once the ``finish`` is acknowledged.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import attrs
import trio

from rc_worker import client as client_module
from rc_worker.client import ControllerClient
from rc_worker.errors import ControllerError
from rc_worker.logs import set_log_context
from rc_worker.retry import Backoff
from rc_worker.spool import JobDir, OutputSpool, job_dirs, read_json, write_json_durably

log = logging.getLogger("rc_worker.outbox")

# The most output bytes one request carries, and so the most the shipper ever
# holds in memory per job, whatever the job's rate or the controller's speed.
CHUNK = 1 << 20


@attrs.define
class _Delivery:
    job_dir: JobDir
    job_id: str
    attempt: int
    spool: OutputSpool | None = None
    finish_ready: trio.Event = attrs.field(factory=trio.Event)
    done: trio.Event = attrs.field(factory=trio.Event)


class Outbox:
    """Owns delivery; ``run`` is its task under the worker's root nursery."""

    def __init__(
        self,
        root: Path,
        client: ControllerClient,
        *,
        on_change: Callable[[], None] | None = None,
        rng: random.Random | None = None,
    ) -> None:
        self._rng = rng or random.Random()
        self._root = root
        self._on_change = on_change or (lambda: None)
        self._client = client
        self._deliveries: dict[str, _Delivery] = {}
        self._nursery: trio.Nursery | None = None
        self._pending_faults: list[Path] = []

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            for jd in job_dirs(self._root):
                if jd.key in self._deliveries or not jd.finish.exists():
                    continue
                ident = _identity(jd)
                if ident is None:
                    log.error("cannot tell which job %s is; leaving it for an operator", jd.path)
                    continue
                self._spawn(_Delivery(jd, *ident))
            for path in _pending_fault_files(self._root):
                self._start_fault(path)
            task_status.started()
            await trio.sleep_forever()

    def track(self, job_dir: JobDir, job_id: str, attempt: int, spool: OutputSpool) -> None:
        """Start shipping a running job's output as it is written."""
        self._spawn(_Delivery(job_dir, job_id, attempt, spool))

    def _spawn(self, delivery: _Delivery) -> None:
        assert self._nursery is not None, "Outbox.run must be started first"
        self._deliveries[delivery.job_dir.key] = delivery
        if delivery.job_dir.finish.exists():
            delivery.finish_ready.set()
        self._nursery.start_soon(self._deliver_job, delivery)

    def deliver_report(self, job_dir: JobDir, job_id: str, attempt: int) -> None:
        """Deliver a job directory whose finish is already on disk."""
        self._spawn(_Delivery(job_dir, job_id, attempt))

    def finish(self, key: str, report: Mapping[str, Any]) -> None:
        """Record a job's finish report durably; it is sent once its output is in."""
        delivery = self._deliveries[key]
        write_json_durably(delivery.job_dir.finish, report)
        delivery.finish_ready.set()

    async def delivered(self, key: str) -> None:
        """Wait until the job's finish is acknowledged (or finally refused)."""
        delivery = self._deliveries.get(key)
        if delivery is not None:
            await delivery.done.wait()

    def tracking(self, key: str) -> bool:
        """Whether a delivery for this job attempt is under way."""
        return key in self._deliveries

    def pending(self) -> int:
        return len(self._deliveries) + len(self._pending_faults)

    def faults_on_disk(self) -> list[tuple[str, str, str]]:
        """``(device, fault_id, reason)`` of every fault report not yet acknowledged.

        A fault the controller has not heard of is still a fault: its device
        must stay quarantined across a restart until the report lands and an
        operator clears it.
        """
        found = []
        for path in _pending_fault_files(self._root):
            data = read_json(path)
            if data is None or not isinstance(data.get("report"), dict):
                continue
            report = data["report"]
            found.append(
                (str(data.get("device")), str(report.get("fault_id")), str(report.get("reason")))
            )
        return found

    def fault(self, device: str, report: Mapping[str, Any]) -> None:
        """Record a fault report durably, then deliver it."""
        path = self._root / "faults" / f"{device}.{report['fault_id']}.json"
        write_json_durably(path, {"device": device, "report": dict(report)})
        self._start_fault(path)

    def _start_fault(self, path: Path) -> None:
        assert self._nursery is not None, "Outbox.run must be started first"
        # Counted as pending now, not when its task first runs: a drain that
        # looked in between would otherwise see nothing owed and stop the
        # worker with the fault undelivered.
        self._pending_faults.append(path)
        self._nursery.start_soon(self._deliver_fault, path)

    async def _deliver_fault(self, path: Path) -> None:
        try:
            data = read_json(path)
            if data is None:
                return
            try:
                await self._client.fault(str(data["device"]), data["report"])
            except ControllerError as e:
                log.error("fault report %s was refused for good: %s", path.name, e)
            _remove(path)
        finally:
            self._pending_faults.remove(path)
            self._on_change()

    async def _deliver_job(self, d: _Delivery) -> None:
        # Every line this delivery logs (client retries included) names the job.
        set_log_context(job_id=d.job_id, attempt=d.attempt)
        try:
            committed = await self._ship_output(d)
            await d.finish_ready.wait()
            report = read_json(d.job_dir.finish) or {}
            if committed is not None and committed < int(report.get("output_bytes", 0)):
                log.error(
                    "job %s: finish sent with output only committed to %d", d.job_id, committed
                )
            try:
                await self._client.finish(d.job_id, report)
            except ControllerError as e:
                log.error("job %s: finish was refused for good: %s", d.job_dir.key, e)
            d.job_dir.remove()
        finally:
            d.done.set()
            self._deliveries.pop(d.job_dir.key, None)
            self._on_change()

    async def _ship_output(self, d: _Delivery) -> int | None:
        """Ship output until the job is done writing and all of it is committed.

        Returns the committed offset, or None when the controller refused
        the output for good (the finish is still sent).
        """
        stalled = Backoff(
            base=client_module.RETRY_BASE_S, cap=client_module.RETRY_CAP_S, rng=self._rng
        )
        try:
            # An empty append asks where the controller is: after a restart
            # the worker resumes there instead of resending from zero.
            committed = await self._client.output(d.job_id, d.attempt, 0, b"")
            while True:
                size = d.spool.size if d.spool is not None else d.job_dir.output_size()
                if committed < size:
                    chunk = d.job_dir.read_output(committed, CHUNK)
                    answer = await self._client.output(d.job_id, d.attempt, committed, chunk)
                    if chunk and answer == committed:
                        # A controller that answers 200 without taking the
                        # bytes would otherwise be resent them in a tight loop.
                        delay = stalled.next_delay()
                        log.warning(
                            "job %s: the controller took none of %d bytes at offset %d; "
                            "resending in %.1fs",
                            d.job_dir.key,
                            len(chunk),
                            committed,
                            delay,
                        )
                        await trio.sleep(delay)
                    else:
                        stalled.attempts = 0
                    committed = answer
                elif d.spool is not None and not d.spool.closed:
                    await d.spool.wait_changed()
                else:
                    return committed
        except ControllerError as e:
            log.error("job %s: output was refused for good: %s", d.job_dir.key, e)
            if d.spool is not None:
                while not d.spool.closed:
                    await d.spool.wait_changed()
            return None


def _identity(jd: JobDir) -> tuple[str, int] | None:
    """The job id and attempt of a directory: from its journal, else from its name.

    A report of an attempt that never ran is written before its journal, so a
    crash between the two leaves a finish with no journal; the directory's
    name (``<job_id>.<attempt>``) still says whose it is.
    """
    journal = read_json(jd.journal)
    if journal is not None:
        return str(journal["job_id"]), int(journal["attempt"])
    job_id, _, attempt = jd.key.rpartition(".")
    if not job_id or not attempt.isdigit():
        return None
    return job_id, int(attempt)


def _pending_fault_files(root: Path) -> list[Path]:
    return sorted((root / "faults").glob("*.json"))


def _remove(path: Path) -> None:
    path.unlink(missing_ok=True)
