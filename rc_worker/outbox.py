"""Delivers what the worker owes the controller: job output, finish reports, faults.

Everything is shipped from disk (``spool.py``), so a controller outage of
any length, or a worker restart, loses nothing. A report the disk refuses
(full, failing) is held in memory and delivered from there: the worker
carries on, and only a restart before delivery could lose it.
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
from rc_worker.spool import (
    JobDir,
    OutputSpool,
    job_dirs,
    move_aside,
    read_json,
    write_json_durably,
)

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
    report: dict[str, Any] | None = None
    """The finish, when the disk would not take it."""


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
        # Fault reports the disk would not take, by the path they would have had.
        self._in_memory: dict[Path, dict[str, Any]] = {}
        # Started once run() is: reports held before the outbox runs (recovery's).
        self._early: list[_Delivery] = []
        self._early_faults: list[Path] = []
        self.damaged: list[tuple[str | None, str]] = []
        """``(device or None, why)`` of each damaged fault file :meth:`faults_on_disk` moved
        aside; the worker quarantines those devices (all of them for None)."""

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
                if path not in self._early_faults:
                    self._start_fault(path)
            early, self._early = self._early, []
            for delivery in early:
                self._spawn(delivery)
            faults, self._early_faults = self._early_faults, []
            for path in faults:
                self._start_fault(path)
            task_status.started()
            await trio.sleep_forever()

    def track(self, job_dir: JobDir, job_id: str, attempt: int, spool: OutputSpool) -> None:
        """Start shipping a running job's output as it is written."""
        self._spawn(_Delivery(job_dir, job_id, attempt, spool))

    def _spawn(self, delivery: _Delivery) -> None:
        self._deliveries[delivery.job_dir.key] = delivery
        if delivery.report is not None or delivery.job_dir.finish.exists():
            delivery.finish_ready.set()
        if self._nursery is None:
            self._early.append(delivery)
            return
        self._nursery.start_soon(self._deliver_job, delivery)

    def hold_report(
        self, job_dir: JobDir, job_id: str, attempt: int, report: Mapping[str, Any]
    ) -> None:
        """Deliver a finish the disk would not take, from memory."""
        self._spawn(_Delivery(job_dir, job_id, attempt, report=dict(report)))

    def deliver_report(self, job_dir: JobDir, job_id: str, attempt: int) -> None:
        """Deliver a job directory whose finish is already on disk."""
        self._spawn(_Delivery(job_dir, job_id, attempt))

    def finish(self, key: str, report: Mapping[str, Any]) -> None:
        """Record a job's finish report durably; it is sent once its output is in."""
        delivery = self._deliveries[key]
        try:
            write_json_durably(delivery.job_dir.finish, report)
        except OSError as e:
            log.error(
                "job %s: cannot write its finish (%s); holding it in memory to send",
                key,
                e,
            )
            delivery.report = dict(report)
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
            problem = _fault_problem(data)
            if problem is not None:
                device = data.get("device") if isinstance(data, dict) else None
                move_aside(self._root, path, problem)
                self.damaged.append(
                    (device if isinstance(device, str) else None, f"{path.name}: {problem}")
                )
                continue
            assert data is not None
            report = data["report"]
            found.append((data["device"], report["fault_id"], str(report.get("reason"))))
        return found

    def fault(self, device: str, report: Mapping[str, Any]) -> None:
        """Record a fault report durably, then deliver it."""
        path = self._root / "faults" / f"{device}.{report['fault_id']}.json"
        data = {"device": device, "report": dict(report)}
        try:
            write_json_durably(path, data)
        except OSError as e:
            # A full disk must not turn one device's fault into the worker's crash.
            log.error("cannot write fault %s (%s); holding it in memory", path.name, e)
            self._in_memory[path] = data
        if self._nursery is None:
            self._pending_faults.append(path)
            self._early_faults.append(path)
            return
        self._start_fault(path)

    def _start_fault(self, path: Path) -> None:
        assert self._nursery is not None, "Outbox.run must be started first"
        # Counted as pending now, not when its task first runs: a drain that
        # looked in between would otherwise see nothing owed and stop the
        # worker with the fault undelivered.
        if path not in self._pending_faults:
            self._pending_faults.append(path)
        self._nursery.start_soon(self._deliver_fault, path)

    async def _deliver_fault(self, path: Path) -> None:
        try:
            data = self._in_memory.get(path) or read_json(path)
            problem = _fault_problem(data)
            if problem is not None:
                if data is not None:
                    move_aside(self._root, path, problem)
                return
            assert data is not None
            try:
                await self._client.fault(str(data["device"]), data["report"])
            except ControllerError as e:
                log.error("fault report %s was refused for good: %s", path.name, e)
            self._in_memory.pop(path, None)
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
            report = d.report if d.report is not None else read_json(d.job_dir.finish) or {}
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
                    read = d.spool.read if d.spool is not None else d.job_dir.read_output
                    chunk = read(committed, CHUNK)
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
        job_id, attempt = journal.get("job_id"), journal.get("attempt")
        if isinstance(job_id, str) and isinstance(attempt, int) and not isinstance(attempt, bool):
            return job_id, attempt
    job_id, _, attempt = jd.key.rpartition(".")
    if not job_id or not attempt.isdigit():
        return None
    return job_id, int(attempt)


def _fault_problem(data: object) -> str | None:
    """Why a fault file's content is unusable, or None."""
    if not isinstance(data, dict):
        return "not a JSON object"
    report = data.get("report")
    if not isinstance(data.get("device"), str) or not data["device"]:
        return "no device"
    if not isinstance(report, dict):
        return f"report is {type(report).__name__}, not an object"
    if not isinstance(report.get("fault_id"), str) or not report["fault_id"]:
        return "report has no fault_id"
    return None


def _pending_fault_files(root: Path) -> list[Path]:
    return sorted((root / "faults").glob("*.json"))


def _remove(path: Path) -> None:
    path.unlink(missing_ok=True)
