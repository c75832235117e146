"""The worker's offers and assignments: long polls for its ready devices, and each
answer's assignments handed to their devices, or rejected or refused.

A part of :class:`~rc_worker.worker.Worker` (it is one of its bases): one long poll per
batch of newly ready devices, withdrawn devices sent with the next, an assignment seen
twice ignored, and rejections written together (group commit) and delivered from the
root nursery so a drain does not lose them.
"""

from __future__ import annotations

import logging
import math
from typing import Any

import attrs
import trio

from rc_worker.changed import Changed
from rc_worker.client import ControllerClient
from rc_worker.context import WorkerContext
from rc_worker.core.config import Config
from rc_worker.core.errors import AssignmentError, ControllerError
from rc_worker.core.model import Assignment, assignment_identity, job_key, parse_assignment
from rc_worker.core.reports import not_run_report, stale_offer_report
from rc_worker.device import DeviceSupervisor
from rc_worker.host import Host
from rc_worker.metrics import WorkerMetrics
from rc_worker.spool import JobDir

log = logging.getLogger("rc_worker.worker")

Rejections = list[tuple[tuple[str, int, str], dict[str, Any]]]
"""A poll's rejections and refusals: each attempt's identity and its report."""


class Polling:
    """Offering the worker's ready devices and taking what the controller assigns."""

    # What it uses of the worker (each set in Worker.__init__).
    config: Config
    host: Host
    devices: dict[str, DeviceSupervisor]
    metrics: WorkerMetrics
    _ctx: WorkerContext | None
    _nursery: trio.Nursery | None
    _poll_wake: Changed
    _poll_wait: float
    _poll_seq: int
    _heartbeat_interval: float
    _rejecting: int
    _seen_attempts: set[tuple[str, int]]

    def _poke_poller(self) -> None:
        self._poll_wake.notify()

    async def _poll_manager(self, client: ControllerClient, nursery: trio.Nursery) -> None:
        assert self._ctx is not None
        parked: list[_Poll] = []
        with trio.CancelScope() as polls:
            async with trio.open_nursery() as poll_nursery:
                while not self._ctx.draining:
                    wake = self._poll_wake.watch()
                    # A device listed in a parked poll that is no longer offerable
                    # (quarantined, held, busy...) must not stay on offer until
                    # poll_wait runs out: send a poll that withdraws it, which
                    # makes the controller answer the old poll at once. An
                    # assignment it made meanwhile still arrives, and is refused as
                    # a stale offer (requeued). The old poll's devices that are
                    # still ready stay with it until it answers, then are polled
                    # again: no device is ever listed by two polls in flight, or
                    # the controller would take the second listing for a lost
                    # answer and requeue the first poll's offer (its start then
                    # 409 stale_attempt, and again, with no time passing).
                    withdrawn: list[DeviceSupervisor] = []
                    for p in parked:
                        # A poll already answered is not parked any more: its
                        # devices may be busy with what it brought, and
                        # withdrawing them would have the controller requeue
                        # that very offer (a stale_attempt at start, again and
                        # again, with no time passing).
                        if p.done or p.superseded or all(d.ready() for d in p.devices):
                            continue
                        p.superseded = True
                        withdrawn += [dev for dev in p.devices if not dev.ready()]
                    parked[:] = [p for p in parked if not p.done]
                    fresh = [d for d in self.devices.values() if d.ready() and not d.offered]
                    if fresh or withdrawn:
                        self._poll_seq += 1
                        poll = _Poll(self._poll_seq, fresh)
                        for dev in fresh:
                            dev.offered, dev.poll_id = True, poll.id
                        parked.append(poll)
                        names = [d.name for d in withdrawn]
                        poll_nursery.start_soon(self._poll_once, client, poll, names)
                    await wake.wait()
                # Draining: in-flight polls are abandoned; an assignment lost
                # with them is never started, and the controller offers it again.
                polls.cancel()

    async def _poll_once(self, client: ControllerClient, poll: _Poll, withdrawn: list[str]) -> None:
        devices = poll.devices
        assignments: list[Any] = []
        try:
            linger = min((d.linger_deadline() for d in devices), default=math.inf)
            wait_s = min(self._poll_wait, max(1.0, linger - trio.current_time()))
            if not devices:
                wait_s = 0.0  # only withdrawing: answered at once
            try:
                assignments = await client.poll(
                    [d.name for d in devices], round(wait_s, 3), withdrawn
                )
            except ControllerError as e:
                log.error("poll refused: %s; retrying after the heartbeat interval", e)
                await trio.sleep(self._heartbeat_interval)
                return
        finally:
            poll.done = True
            for dev in devices:
                if dev.poll_id == poll.id:
                    dev.offered, dev.poll_id = False, None
                dev.poke()
            self._poke_poller()
        rejections: Rejections = []
        for raw in assignments:
            self._dispatch(raw, rejections)
        self._record_soon(rejections)

    def _record_soon(self, rejections: Rejections) -> None:
        """Write and deliver a poll's rejections and refusals, all together.

        In the root nursery, not the poll's: a drain cancels polls, and a
        rejection half-written must still be delivered (counted as owed
        until then). Written as one group (group commit), off the event
        loop: a thousand of them do not stall the heartbeat.
        """
        if rejections:
            assert self._nursery is not None
            self._rejecting += len(rejections)
            self._nursery.start_soon(self._record_rejections, rejections)

    async def _record_rejections(self, rejections: Rejections) -> None:
        assert self._ctx is not None
        try:
            async with trio.open_nursery() as nursery:
                for ident, report in rejections:
                    # WorkerContext.report never fails for the disk: it sends from memory.
                    nursery.start_soon(self._ctx.report, ident, report)
        finally:
            self._rejecting -= len(rejections)
            self._poke_poller()

    def _dispatch(self, raw: Any, rejections: Rejections | None = None) -> None:
        """Hand one assignment to its device, or reject or refuse it: into
        ``rejections`` when given (the caller records them together), else
        recorded at once."""
        if rejections is None:
            own: Rejections = []
            self._dispatch(raw, own)
            self._record_soon(own)
            return
        assert self._ctx is not None
        ident = assignment_identity(raw)
        if ident is not None and self._known_attempt(ident[0], ident[1]):
            # A buggy controller repeated an attempt (to this device or another). That attempt
            # has, or will have, its one report from its own run; a rejection would overwrite
            # its files and contradict it. Nothing is written or sent.
            log.error(
                "ignoring job %s attempt %d assigned again (to %s): this worker already has it",
                ident[0],
                ident[1],
                ident[2] or "no device",
            )
            self.metrics.duplicate_assignments.inc()
            return
        if ident is not None:
            self._seen_attempts.add((ident[0], ident[1]))
        try:
            assignment = parse_assignment(raw, origin=self._ctx.client.origin)
        except AssignmentError as e:
            self._reject(raw, f"malformed assignment: {e}", rejections)
            return
        dev = self.devices.get(assignment.device)
        if dev is None:
            self._reject(
                raw,
                f"unknown device {assignment.device!r} on host {self.config.host}",
                rejections,
            )
        elif not dev.can_take():
            # The device's state, not the assignment, is in the way: the poll that
            # offered it went stale. Refused, so the controller requeues the job.
            self._refuse_stale(assignment, dev.not_offerable_reason(), rejections)
        else:
            log.info(
                "device %s: assigned job %s attempt %d: %s",
                dev.name,
                assignment.job_id,
                assignment.attempt,
                list(assignment.command),
                extra={
                    "device": dev.name,
                    "job_id": assignment.job_id,
                    "attempt": assignment.attempt,
                },
            )
            dev.assign(assignment)

    def _known_attempt(self, job_id: str, attempt: int) -> bool:
        """This worker process was handed the attempt before, or its files are on disk."""
        assert self._ctx is not None
        if (job_id, attempt) in self._seen_attempts:
            return True
        return JobDir(self._ctx.root, job_key(job_id, attempt), self.host.store).exists()

    def _refuse_stale(
        self,
        assignment: Assignment,
        why: str,
        rejections: Rejections,
    ) -> None:
        report = stale_offer_report(assignment, why)
        log.info(
            "refusing job %s attempt %d: %s",
            assignment.job_id,
            assignment.attempt,
            report["reason"],
        )
        rejections.append(((assignment.job_id, assignment.attempt, assignment.device), report))

    def _reject(
        self,
        raw: Any,
        reason: str,
        rejections: Rejections,
    ) -> None:
        assert self._ctx is not None
        ident = assignment_identity(raw)
        if ident is None:
            log.error("ignoring an assignment with no usable job_id/attempt: %s", reason)
            return
        log.warning(
            "rejecting job %s attempt %d: %s",
            ident[0],
            ident[1],
            reason,
            extra={"job_id": ident[0], "attempt": ident[1]},
        )
        rejections.append((ident, not_run_report(ident, "rejected", reason)))


@attrs.define(eq=False)
class _Poll:
    """One long poll in flight and the devices it offers."""

    id: int
    devices: list[DeviceSupervisor]
    superseded: bool = False
    done: bool = False
