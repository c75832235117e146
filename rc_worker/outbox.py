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

import functools
import logging
import random
from collections.abc import AsyncIterator, Callable, Mapping
from pathlib import Path
from typing import Any

import attrs
import trio

from rc_worker import client as client_module
from rc_worker.client import ControllerClient
from rc_worker.core.errors import ControllerError
from rc_worker.core.retry import Backoff
from rc_worker.durable import Committer
from rc_worker.logs import set_log_context
from rc_worker.spool import JobDir, OutputSpool, job_dirs, move_aside, read_json
from rc_worker.statestore import StateStore

log = logging.getLogger("rc_worker.outbox")

# Output is streamed to the controller: one request carries whatever is
# spooled, up to REQUEST_MAX bytes (the protocol's limit for one output
# body), read from disk and sent CHUNK bytes at a time. CHUNK is the most the
# shipper holds in memory per job, whatever the job's rate or the
# controller's speed; REQUEST_MAX sets how many round trips a long output
# costs (one per 16 MiB rather than one per chunk).
CHUNK = 1 << 20
REQUEST_MAX = 16 << 20
# How long one request stays open while the job is still writing: caught up
# with the spool, its body waits for more up to this long, so a job writing
# fast fills few large requests instead of one per pipe read. The controller
# appends as it reads, so followers see the bytes at once either way.
STREAM_WINDOW_S = 1.0
# A backlog at least this large is sent as one request of known length
# (Content-Length) rather than a chunked stream: every byte is already on disk,
# nothing is gained by leaving the body open, and each chunk of a chunked body
# costs a copy of it in h11 (its size line, the bytes and CRLF joined into one
# buffer), about a tenth of the worker's CPU per GiB. Smaller backlogs (a job
# writing slowly) keep the streamed body, so followers see its bytes as they come.
BULK_MIN = 4 << 20


@attrs.define
class _Delivery:
    job_dir: JobDir
    job_id: str
    attempt: int
    spool: OutputSpool | None = None
    device: str | None = None
    # Started by this worker process (running, or a report of an attempt that
    # never ran): the controller cannot hold any of its output yet.
    fresh: bool = False
    finish_ready: trio.Event = attrs.field(factory=trio.Event)
    done: trio.Event = attrs.field(factory=trio.Event)
    report: dict[str, Any] | None = None
    """The finish this process made (on disk too, if the disk took it); ``None`` for
    one a previous process left on disk, read from there."""
    finish_durable: bool = False
    """Whether ``report`` is known durable on disk: its write completed, the
    directory fsync included. Never inferred from ``finish.json`` existing: a write
    whose directory fsync failed leaves the file there, not durable."""
    asked_under: int | None = None
    """The client's registration (:attr:`ControllerClient.generation`) under which the
    last output request went: the controller's word on the committed offset holds for it."""


class Outbox:
    """Owns delivery; ``run`` is its task under the worker's root nursery."""

    def __init__(
        self,
        root: Path,
        client: ControllerClient,
        *,
        on_change: Callable[[], None] | None = None,
        committer: Committer | None = None,
        rng: random.Random | None = None,
    ) -> None:
        self._rng = rng or random.Random()
        self._root = root
        # Every durable write of the worker goes through this one committer,
        # so writes issued together share their fsyncs (durable.py).
        self.committer = committer if committer is not None else Committer()
        # The host's files, as the committer writes them.
        self._store = self.committer.store
        # Reports being written before their delivery starts: owed already.
        self._writing = 0
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
        self._early_records: dict[Path, dict[str, Any]] = {}
        self.damaged: list[tuple[str | None, str]] = []
        """``(device or None, why)`` of each damaged fault file :meth:`faults_on_disk` moved
        aside; the worker quarantines those devices (all of them for None)."""

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            for jd in job_dirs(self._root, self._store):
                if jd.key in self._deliveries or not jd.has_finish():
                    continue
                ident = _identity(jd)
                if ident is None:
                    log.error("cannot tell which job %s is; leaving it for an operator", jd.path)
                    continue
                device = (read_json(jd.journal, self._store) or {}).get("device")
                self._spawn(
                    _Delivery(jd, *ident, device=device if isinstance(device, str) else None)
                )
            for path in _pending_fault_files(self._root, self._store):
                if path not in self._early_faults:
                    self._start_fault(path)
            early, self._early = self._early, []
            for delivery in early:
                self._spawn(delivery)
            faults, self._early_faults = self._early_faults, []
            for path in faults:
                self._start_fault(path, self._early_records.pop(path, None))
            task_status.started()
            await trio.sleep_forever()

    def track(
        self,
        job_dir: JobDir,
        job_id: str,
        attempt: int,
        spool: OutputSpool,
        device: str | None = None,
    ) -> None:
        """Start shipping a running job's output as it is written."""
        self._spawn(_Delivery(job_dir, job_id, attempt, spool, device=device, fresh=True))

    def _spawn(self, delivery: _Delivery) -> None:
        self._deliveries[delivery.job_dir.key] = delivery
        if delivery.report is not None or delivery.job_dir.has_finish():
            delivery.finish_ready.set()
        if self._nursery is None:
            self._early.append(delivery)
            return
        self._nursery.start_soon(self._deliver_job, delivery)

    def deliver_report(
        self,
        job_dir: JobDir,
        job_id: str,
        attempt: int,
        device: str | None = None,
        *,
        fresh: bool = False,
    ) -> None:
        """Deliver a job directory whose finish is already on disk; ``fresh``
        when this process wrote it (no need to ask where the output stands)."""
        self._spawn(_Delivery(job_dir, job_id, attempt, device=device, fresh=fresh))

    def hold_report(
        self,
        job_dir: JobDir,
        job_id: str,
        attempt: int,
        report: Mapping[str, Any],
        device: str | None = None,
        *,
        fresh: bool = False,
    ) -> None:
        """Deliver a finish the disk would not take, from memory; ``fresh`` only for
        an attempt this process started or reports as never run. One a previous
        process left (recovery's) may have output the controller holds already: its
        delivery asks where that stands rather than resend it from offset 0."""
        self._spawn(
            _Delivery(job_dir, job_id, attempt, report=dict(report), device=device, fresh=fresh)
        )

    def owes(self, device: str) -> bool:
        """Whether a finish for an attempt on ``device`` is not yet acknowledged.

        The device is not offered meanwhile: the controller must have the outcome
        of every attempt it placed there (this process's, a refused or killed one,
        or one a previous process left on disk) before it sees the device ready.
        """
        return any(d.device == device for d in self._deliveries.values())

    async def finish(self, key: str, report: Mapping[str, Any]) -> None:
        """Record a job's finish report durably; it is sent once its output is in."""
        delivery = self._deliveries[key]
        delivery.report = dict(report)
        try:
            await self._write_finish(key, delivery, report)
        finally:
            # Sent from memory by this process: the disk's copy is for the next one. A
            # directory that vanished meanwhile must not leave it an empty finish to send.
            # Set however the write ended, cancelled included: the report is in memory,
            # and a delivery waiting for it for ever would hold its device and a drain.
            delivery.finish_ready.set()

    async def _write_finish(self, key: str, delivery: _Delivery, report: Mapping[str, Any]) -> None:
        # Replaced on disk by this write: durable again only once it completes.
        delivery.finish_durable = False
        try:
            await self.committer.write(delivery.job_dir.finish, report)
            delivery.finish_durable = True
        except OSError as e:
            # A directory that vanished is made again, journal and all: held in
            # memory only, the outcome would be lost if the worker stopped first.
            if not delivery.job_dir.exists() and await self.write_held(delivery):
                log.warning(
                    "job %s: its directory was gone (%s); wrote it again with its finish",
                    key,
                    e,
                )
            else:
                log.error(
                    "job %s: cannot write its finish (%s); holding it in memory to send",
                    key,
                    e,
                )

    async def write_held(self, delivery: _Delivery) -> bool:
        """Write a finish held in memory only (the disk refused it, or its directory
        vanished since, or its directory fsync failed) to disk, with its directory and
        the journal this process wrote if they are gone too; whether the finish is
        durable on disk now.

        Known durable (:attr:`_Delivery.finish_durable`) and still there, not merely
        present: an earlier write whose directory fsync failed left ``finish.json`` in
        place, and a power loss could still take it. Such a finish is written again.

        The journal goes first, as when the job was spawned: a crash between the
        two leaves a job that was interrupted, never a finish the controller's
        registration would not expect (a spawned job's finish needs its journal
        to be reported in ``recovery`` at the next start).
        """
        jd = delivery.job_dir
        if delivery.report is None or _finish_on_disk(delivery):
            return True
        writes: list[tuple[Path, Mapping[str, Any]]] = []
        if jd.written_journal is not None and not jd.store.exists(jd.journal):
            writes.append((jd.journal, jd.written_journal))
        writes.append((jd.finish, delivery.report))
        # The directory only, never an empty output file: the shipper tells a vanished
        # spool by its missing file, and would resend into an empty one for ever.
        mkdir = functools.partial(jd.store.mkdir, jd.path, parents=True)
        try:
            await self.committer.write_all(writes, before=mkdir)
        except OSError as e:
            log.error("job %s: still cannot write its finish (%s)", jd.key, e)
            return False
        delivery.finish_durable = True
        return True

    async def write_held_reports(self) -> None:
        """At a stop: write every finish and fault report held in memory only to disk,
        so that the next start delivers it (those the disk still refuses stay in memory).

        A fault lost at a stop is worse than a late one: the next worker would not
        know the device is quarantined, and would offer it."""
        for d in list(self._deliveries.values()):
            if not d.done.is_set():
                await self.write_held(d)
        for path, record in list(self._in_memory.items()):
            try:
                await self.committer.write(path, record)
            except OSError as e:
                log.error("cannot write fault %s at the stop either (%s)", path.name, e)
                continue
            if path in self._in_memory:
                del self._in_memory[path]  # on disk now: the next start sends it
            else:
                # Delivered while it was being written: the file must not send it twice.
                await self._remove_delivered_fault(path)

    def held_in_memory(self) -> list[str]:
        """What is owed and held in memory only: lost if the worker stops now."""
        held = [
            d.job_dir.key
            for d in self._deliveries.values()
            if d.report is not None and not d.done.is_set() and not _finish_on_disk(d)
        ]
        # Fault reports the disk refused are held in memory only too.
        return held + [path.name for path in self._in_memory]

    async def report(
        self,
        job_dir: JobDir,
        job_id: str,
        attempt: int,
        report: Mapping[str, Any],
        journal: Mapping[str, Any],
    ) -> None:
        """Durably record, then deliver, the finish of an attempt that never ran.

        The finish is renamed into place before the journal (one flush), so a
        crash between them leaves a finish with no journal, which the next
        start still delivers (``_identity``); never a journal alone that
        claims a report. Counted as owed from the start, so a drain does not
        stop the worker while it is being written.
        """
        self._writing += 1
        try:
            await self.committer.write_all(
                [(job_dir.finish, report), (job_dir.journal, journal)], before=job_dir.create
            )
        except BaseException:
            self._writing -= 1
            self._on_change()
            raise
        self._writing -= 1
        device = journal.get("device")
        # Sent from memory, as a finish of a job that ran is (Outbox.finish).
        self._spawn(
            _Delivery(
                job_dir,
                job_id,
                attempt,
                report=dict(report),
                device=device if isinstance(device, str) else None,
                fresh=True,
                finish_durable=True,
            )
        )

    async def delivered(self, key: str) -> None:
        """Wait until the job's finish is acknowledged (or finally refused)."""
        delivery = self._deliveries.get(key)
        if delivery is not None:
            await delivery.done.wait()

    def spooled(self, key: str) -> int:
        """How many bytes of output the delivery of this job attempt has to ship: its
        spool's count (a disk error's marker held in memory included), else its file's."""
        return _spooled(self._deliveries[key])

    def tracking(self, key: str) -> bool:
        """Whether a delivery for this job attempt is under way."""
        return key in self._deliveries

    def pending(self) -> int:
        return len(self._deliveries) + len(self._pending_faults) + self._writing

    def faults_on_disk(self) -> list[tuple[str, str, str, str, str | None]]:
        """``(device, fault_id, reason, kind, parent_fault)`` of every fault report not
        yet acknowledged (``parent_fault``: the GPU's fault a MIG slice's copy names).

        A fault the controller has not heard of is still a fault: its device
        must stay quarantined across a restart until the report lands and an
        operator clears it.
        """
        found = []
        for path in _pending_fault_files(self._root, self._store):
            data = read_json(path, self._store)
            problem = _fault_problem(data)
            if problem is not None:
                device = data.get("device") if isinstance(data, dict) else None
                move_aside(self._root, path, problem, self._store)
                self.damaged.append(
                    (device if isinstance(device, str) else None, f"{path.name}: {problem}")
                )
                continue
            assert data is not None
            report = data["report"]
            found.append(
                (
                    data["device"],
                    report["fault_id"],
                    str(report.get("reason")),
                    str(report.get("kind") or "fault"),
                    parent if isinstance(parent := report.get("parent_fault"), str) else None,
                )
            )
        return found

    def fault(self, device: str, report: Mapping[str, Any]) -> None:
        """Record a fault report durably, then deliver it.

        Returns at once (it is called where a device cannot wait, an error
        handler among them): the delivery task writes the file and sends the
        report only once the file is durable, so the rule "on disk before the
        first send" holds. The device's quarantine is in memory already.
        """
        path = self._root / "faults" / f"{device}.{report['fault_id']}.json"
        record = {"device": device, "report": dict(report)}
        if self._nursery is None:
            # Raised before the outbox runs (a damaged state file at start):
            # written and sent once it does, counted as owed from now.
            self._pending_faults.append(path)
            self._early_faults.append(path)
            self._early_records[path] = record
            return
        self._start_fault(path, record)

    def _start_fault(self, path: Path, record: Mapping[str, Any] | None = None) -> None:
        assert self._nursery is not None, "Outbox.run must be started first"
        # Counted as pending now, not when its task first runs: a drain that
        # looked in between would otherwise see nothing owed and stop the
        # worker with the fault undelivered.
        if path not in self._pending_faults:
            self._pending_faults.append(path)
        self._nursery.start_soon(self._deliver_fault, path, record)

    async def _deliver_fault(self, path: Path, record: Mapping[str, Any] | None = None) -> None:
        try:
            if record is not None:
                try:
                    await self.committer.write(path, record)
                except OSError as e:
                    # A full disk must not turn one device's fault into the
                    # worker's crash, nor keep the controller from hearing it.
                    log.error("cannot write fault %s (%s); holding it in memory", path.name, e)
                    self._in_memory[path] = dict(record)
            # What was just written is in hand: read the disk only for a report
            # a previous process left there.
            data = (
                dict(record)
                if record is not None
                else (self._in_memory.get(path) or read_json(path, self._store))
            )
            problem = _fault_problem(data)
            if problem is not None:
                if data is not None:
                    move_aside(self._root, path, problem, self._store)
                return
            assert data is not None
            try:
                await self._client.fault(str(data["device"]), data["report"])
            except ControllerError as e:
                log.error("fault report %s was refused for good: %s", path.name, e)
            self._in_memory.pop(path, None)
            await self._remove_delivered_fault(path)
        finally:
            self._pending_faults.remove(path)
            self._on_change()

    async def _remove_delivered_fault(self, path: Path) -> None:
        try:
            await self.committer.run_blocking(functools.partial(self._store.unlink, path))
        except OSError as e:
            # A file system gone read-only (ext4 does so on errors, just when faults
            # come): the controller has the fault; the next start sends it again, and
            # the controller takes a fault id once.
            log.error(
                "cannot remove delivered fault %s (%s); it is sent again at the next start",
                path.name,
                e,
            )

    async def _deliver_job(self, d: _Delivery) -> None:
        # Every line this delivery logs (client retries included) names the job.
        set_log_context(job_id=d.job_id, attempt=d.attempt)
        try:
            committed = await self._ship_output(d)
            await d.finish_ready.wait()
            while committed and d.asked_under != self._client.generation:
                # Registered again since the controller last said where this output stands:
                # a controller that lost its store adopts a running attempt with none of its
                # output (docs/protocol.md, register). A job that wrote nothing since would
                # otherwise get its finish in with the bytes sent before never there.
                log.warning(
                    "job %s: the worker registered again since %d bytes of output were "
                    "committed; asking the controller where they stand",
                    d.job_dir.key,
                    committed,
                )
                committed = await self._ship_output(d, ask=True)
            report = (
                d.report if d.report is not None else read_json(d.job_dir.finish, self._store) or {}
            )
            written = report.get("output_bytes")
            if written is not None and (not isinstance(written, int) or isinstance(written, bool)):
                # A report damaged on disk (recovery checks the fields that say whose it
                # is): the controller would refuse it, and the outcome in it would be lost.
                # The spool says how much was written, as for a finish recovery rebuilds.
                damaged, written = written, _spooled(d)
                log.warning(
                    "job %s: its finish on disk had output_bytes %.40r; sending %d, the "
                    "size of its spooled output",
                    d.job_dir.key,
                    damaged,
                    written,
                )
                report = {**report, "output_bytes": written}
            if committed is not None and committed < (written or 0):
                log.error(
                    "job %s: finish sent with output only committed to %d", d.job_id, committed
                )
            try:
                await self._client.finish(d.job_id, report)
            except ControllerError as e:
                log.error("job %s: finish was refused for good: %s", d.job_dir.key, e)
            # The controller has the outcome: the device may be offered again
            # now. The directory goes next, still counted as owed, so a drain
            # waits for it; a crash before it is gone resends an idempotent finish.
            d.done.set()
            await self.committer.run_blocking(d.job_dir.remove)
        finally:
            d.done.set()
            self._deliveries.pop(d.job_dir.key, None)
            self._on_change()

    async def _ship_output(self, d: _Delivery, *, ask: bool = False) -> int | None:
        """Ship output until the job is done writing and all of it is committed.

        Returns the committed offset, or None when the controller refused
        the output for good (the finish is still sent). ``ask``: begin by asking
        where the controller stands, even for an attempt this process started.
        """
        stalled = Backoff(
            base=client_module.RETRY_BASE_S, cap=client_module.RETRY_CAP_S, rng=self._rng
        )
        try:
            if d.fresh and not ask:
                # An attempt this process started: the controller cannot hold
                # any of its output yet, so no round trip to ask.
                committed = 0
            else:
                d.asked_under = self._client.generation
                # An empty append asks where the controller is: after a
                # restart the worker resumes there instead of resending from zero.
                committed = await self._client.output(d.job_id, d.attempt, 0, b"")
            bulk = True
            furthest = committed  # the most the controller has said it holds
            while True:
                size = _spooled(d)
                if committed < size and not _output_exists(d):
                    # Its directory vanished (an operator's rm, a lost mount): what is
                    # not yet shipped cannot be read back. Without this, an empty body
                    # every retry, for ever; the finish still goes.
                    log.error(
                        "job %s: its output file %s is gone; %d bytes cannot be sent",
                        d.job_dir.key,
                        d.job_dir.output,
                        size - committed,
                    )
                    await _until_closed(d)
                    return committed
                if committed < size:
                    backlog = min(size - committed, REQUEST_MAX)
                    d.asked_under = self._client.generation
                    try:
                        answer = await self._client.output(
                            d.job_id,
                            d.attempt,
                            committed,
                            *_body(d, committed, backlog if bulk and backlog >= BULK_MIN else None),
                        )
                    except _ShortRead as e:
                        # The spool gave back less than it holds (a truncated or
                        # failing file): a streamed body sends what can be read, and
                        # one that can read nothing more ends the delivery (below).
                        log.warning("job %s: %s; streaming its output instead", d.job_dir.key, e)
                        bulk = False
                        continue
                    if answer == committed and not _read(d, committed, 1):
                        # The spool cannot give back what it says it holds (its file cut,
                        # a failing disk): those bytes cannot be sent, to this controller
                        # or any. Resending nothing for ever would keep the job from its
                        # finish; as for a vanished file, say so once and let it go.
                        log.error(
                            "job %s: its spooled output cannot be read past offset %d "
                            "(%d bytes were spooled); the rest cannot be sent",
                            d.job_dir.key,
                            committed,
                            size,
                        )
                        await _until_closed(d)
                        return committed
                    if answer == committed:
                        # A controller that answers 200 without taking the
                        # bytes would otherwise be resent them in a tight loop.
                        delay = stalled.next_delay()
                        log.warning(
                            "job %s: the controller took none of %d bytes at offset %d; "
                            "resending in %.1fs",
                            d.job_dir.key,
                            min(size - committed, REQUEST_MAX),
                            committed,
                            delay,
                        )
                        await trio.sleep(delay)
                    elif answer < committed:
                        # The controller holds less than it said before: restored from a
                        # backup (resend from there), or two controllers answering in turn.
                        # Never a tight loop: the backoff grows while it keeps going back.
                        delay = stalled.next_delay()
                        log.warning(
                            "job %s: the controller went back from offset %d to %d; "
                            "resending from there in %.1fs",
                            d.job_dir.key,
                            committed,
                            answer,
                            delay,
                        )
                        await trio.sleep(delay)
                    elif answer > furthest:
                        stalled.attempts = 0
                    if answer > (spooled := _spooled(d)):
                        # Not an honest answer: the bytes between were never sent. Trusted
                        # (there is nothing else to go by), but never silently.
                        log.error(
                            "job %s: the controller says it holds %d bytes of output, more "
                            "than the %d spooled",
                            d.job_dir.key,
                            answer,
                            spooled,
                        )
                    furthest = max(furthest, answer)
                    committed = answer
                elif d.spool is not None and not d.spool.closed:
                    await d.spool.wait_changed()
                else:
                    return committed
        except ControllerError as e:
            log.error("job %s: output was refused for good: %s", d.job_dir.key, e)
            await _until_closed(d)
            return None


class _ShortRead(Exception):
    """A body of declared length could not be read whole."""


def _body(
    d: _Delivery, start: int, length: int | None
) -> tuple[Callable[[], AsyncIterator[bytes]], int | None]:
    """One request's body and its length: exactly ``length`` spooled bytes from
    ``start``, or (``None``) a stream of what is spooled, as it comes."""
    if length is None:
        return functools.partial(_stream, d, start), None
    return functools.partial(_exactly, d, start, length), length


async def _exactly(d: _Delivery, start: int, length: int) -> AsyncIterator[bytes]:
    """``length`` bytes already spooled from ``start``, CHUNK bytes at a time; raises
    :class:`_ShortRead` (ending the request before its body is whole) rather than send
    fewer bytes than the request declared."""
    pos, end = start, start + length
    while pos < end:
        n = min(CHUNK, end - pos)
        data = _read(d, pos, n)
        if len(data) != n:
            raise _ShortRead(f"read {len(data)} of {n} bytes of output at offset {pos}")
        pos += n
        yield data


def _read(d: _Delivery, pos: int, n: int) -> bytes:
    # The spool's own read: past what the disk took it holds the marker of a disk
    # error in memory (a full disk costs the output, not its marker).
    try:
        return d.spool.read(pos, n) if d.spool is not None else d.job_dir.read_output(pos, n)
    except OSError as e:
        # A failing disk: read as nothing there, which ends this job's shipping with
        # one error (_ship_output), rather than the worker with a traceback.
        log.warning(
            "job %s: reading its spooled output at offset %d failed: %s", d.job_dir.key, pos, e
        )
        return b""


async def _until_closed(d: _Delivery) -> None:
    """Until the job is done writing: a delivery that gave up on its output still sends
    the finish, and only once the job has one."""
    if d.spool is not None:
        while not d.spool.closed:
            await d.spool.wait_changed()


def _spooled(d: _Delivery) -> int:
    if d.spool is not None:
        return d.spool.size
    try:
        return d.job_dir.output_size()
    except OSError as e:  # a failing disk: nothing can be read there either
        log.warning("job %s: cannot stat its spooled output: %s", d.job_dir.key, e)
        return 0


def _finish_on_disk(d: _Delivery) -> bool:
    """Whether this process's finish is durable on disk: its write completed (directory
    fsync included) and the file is still there (its directory may have vanished since)."""
    return d.finish_durable and d.job_dir.has_finish()


def _output_exists(d: _Delivery) -> bool:
    try:
        return d.job_dir.store.exists(d.job_dir.output)
    except OSError as e:  # EIO, EACCES: as good as gone for sending
        log.warning("job %s: cannot stat its spooled output: %s", d.job_dir.key, e)
        return False


async def _stream(d: _Delivery, start: int) -> AsyncIterator[bytes]:
    """One request's body: the output spooled from ``start``, at most
    REQUEST_MAX bytes, CHUNK bytes at a time.

    Caught up with a job still writing, it waits for more until
    STREAM_WINDOW_S after it began; it ends at once when the spool is closed,
    so the finish never waits on it.
    """
    end = start + REQUEST_MAX
    pos = start
    until = trio.current_time() + STREAM_WINDOW_S
    if not _output_exists(d):
        return
    while pos < end:
        n = min(CHUNK, _spooled(d) - pos, end - pos)
        if n <= 0:
            spool = d.spool
            if spool is None or spool.closed or trio.current_time() >= until:
                return
            with trio.move_on_at(until):
                await spool.wait_changed()
            continue
        data = _read(d, pos, n)
        if not data:
            return
        pos += len(data)
        yield data


def _identity(jd: JobDir) -> tuple[str, int] | None:
    """The job id and attempt of a directory: from its journal, else from its name.

    A report of an attempt that never ran is written before its journal, so a
    crash between the two leaves a finish with no journal; the directory's
    name (``<job_id>.<attempt>``) still says whose it is.
    """
    journal = read_json(jd.journal, jd.store)
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


def _pending_fault_files(root: Path, store: StateStore) -> list[Path]:
    faults = root / "faults"
    try:
        names = store.listdir(faults)
    except (FileNotFoundError, NotADirectoryError):
        return []
    return [faults / n for n in names if n.endswith(".json")]
