"""What a worker claims to hold, taken as fact: protocol 2's answer to a lost store.

The controller's store can be lost (a fresh disk, last night's backup). The
worker is the one that knows what is on its host, so its ``register`` says, per
device, the faults it holds and the attempt it runs, and its heartbeats name
the attempt too. Here:

- a fault the controller does not know is **adopted**: the device is quarantined
  with it, and an operator's clear lifts it as any other; a fault it knows as
  already cleared is listed in heartbeat ``cleared`` again;
- whatever the store says, a device whose worker holds any fault is never
  assigned (:attr:`~rc_worker.controller.records.Device.worker_faults`);
- a running attempt of a job the controller never recorded is **adopted**: the
  job is recorded running (marked ``adopted``), its device is busy, and its
  output and finish are stored as for any job.

Sans-IO, like the store.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from rc_worker.controller.messages import JobSpec, RegisterRequest
from rc_worker.controller.records import Attempt, Device, Fault, Host, Job
from rc_worker.core.selectors import parse_selector

if TYPE_CHECKING:
    from rc_worker.controller.state import StoreState

ADOPTED_COMMAND = ("(adopted: the controller had no record of this job)",)


def claimed_attempts(req: RegisterRequest) -> dict[str, int]:
    """The attempt a registration says each job runs at (protocol 2): job id -> number."""
    return {d.running.job_id: d.running.attempt for d in req.devices if d.running is not None}


def apply_register_claims(store: StoreState, h: Host, req: RegisterRequest, now: float) -> None:
    """Take the faults and running attempts a registration declares (protocol 2)."""
    for decl in req.devices:
        d = h.devices.get(decl.name)
        if d is None:
            continue
        if decl.faults is not None:
            d.worker_faults = {f.fault_id for f in decl.faults}
            for f in decl.faults:
                adopt_fault(store, d, f.fault_id, f.kind, f.reason)
        if decl.running is not None:
            r = decl.running
            adopt_attempt(store, h, d, r.job_id, r.attempt, now, started_at=r.started_at)


def adopt_fault(store: StoreState, d: Device, fault_id: str, kind: str, reason: str) -> None:
    if fault_id in d.faults:
        return
    if fault_id in d.seen_faults:
        # Cleared here, still held there: say so again in the heartbeat's `cleared`.
        d.cleared_pending.setdefault(fault_id, 0)
        store.journal.host(d.host)
        return
    store.adopt_fault(
        d,
        Fault(
            fault_id,
            kind or "fault",
            "fault",
            reason or "held by the worker at registration",
            None,
            None,
            raised_by="worker",
        ),
    )


def adopt_attempt(
    store: StoreState,
    h: Host,
    d: Device,
    job_id: str,
    attempt: int,
    now: float,
    *,
    started_at: float | None = None,
) -> Job | None:
    """Record a running attempt the controller never saw; None if it knows it already.

    A job the controller knows whose record stops short of the attempt (its highest
    attempt is lower: the store came back from an older copy, queued or offered
    elsewhere) takes the worker's attempt as its current one. Left queued, it would be
    offered again under the very number the worker is running, and that worker's output
    and finish would pass for the new attempt's.
    """
    if attempt < 1:
        return None
    known = store.known_job(job_id)
    if known is not None:
        if known.terminal or attempt <= known.attempt:
            return None  # the same attempt, or a stale one (the heartbeat cancels it)
        store.adopt_newer_attempt(known, d, attempt, now)
        return known
    spec = JobSpec(command=ADOPTED_COMMAND)
    job = Job(
        job_id,
        store.next_seq(),
        spec,
        parse_selector(""),
        submitted_at=started_at if started_at is not None else store.wall(),
        state="running",
    )
    # Earlier attempts are unknown: placeholders keep the numbering the worker uses.
    for n in range(1, attempt):
        job.attempts.append(Attempt(n, h.name, d.name, "requeued", now, note="not recorded"))
    job.attempts.append(Attempt(attempt, h.name, d.name, "running", now, adopted=True))
    job.started_at = started_at if started_at is not None else store.wall()
    job.adopted = True
    store.adopt_job(job, d)
    return job
