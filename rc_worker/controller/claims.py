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
  output and finish are stored as for any job;
- a running attempt that is the controller's own offer, still ``assigned`` (its
  ``start`` never arrived: the controller restarted before storing it, or it was
  lost in an outage), is **started**: the claim is that start. Neither given back
  nor cancelled as stale, which would kill a running job and run it again.

:func:`judge_claim` decides what a claim is, against the store's record of its
job; pure, so that a property test can hold it to these rules.

Sans-IO, like the store.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

from rc_worker.controller.messages import JobSpec, RegisterRequest, RunningClaim
from rc_worker.controller.records import Attempt, Device, Fault, Host, Job
from rc_worker.core.selectors import parse_selector

if TYPE_CHECKING:
    from rc_worker.controller.state import StoreState

ADOPTED_COMMAND = ("(adopted: the controller had no record of this job)",)


ClaimKind = Literal["invalid", "unknown", "ended", "newer", "offer", "current", "stale"]
"""What a claim that a device runs an attempt of a job is, by :func:`judge_claim`."""

OfferFate = Literal["start", "keep", "requeue"]
"""What a registration does with an unstarted offer to its host, by :func:`offer_fate`."""


def claimed_attempts(req: RegisterRequest) -> dict[str, int]:
    """The attempt a registration says each job runs at (protocol 2): job id -> number."""
    return {job_id: claim.attempt for job_id, (_, claim) in claimed_placements(req).items()}


def claimed_placements(req: RegisterRequest) -> dict[str, tuple[str, RunningClaim]]:
    """Where a registration says each job runs (protocol 2): job id -> (device, claim)."""
    return {d.running.job_id: (d.name, d.running) for d in req.devices if d.running is not None}


def judge_claim(job: Job | None, host: str, device: str, attempt: int) -> ClaimKind:
    """What ``host``/``device`` running ``attempt`` of ``job`` (None: never recorded) is.

    - ``invalid``: no attempt (numbers start at 1); nothing to take.
    - ``unknown``: a job never recorded: adopted.
    - ``ended``: the job has ended; nothing is adopted (a heartbeat cancels it only for
      a cancel: one declared lost while its worker was cut off is left to run).
    - ``newer``: above every attempt recorded (a store restored from an older copy):
      the worker's attempt becomes the current one.
    - ``offer``: the current attempt, offered to that very device and still
      ``assigned``: its start never arrived, and the claim is that start.
    - ``current``: the current attempt, already running there: nothing to do.
    - ``stale``: anything else (an older attempt, or the current number placed on
      another host or device: another process): never adopted, a heartbeat cancels it.
    """
    if attempt < 1:
        return "invalid"
    if job is None:
        return "unknown"
    if job.terminal:
        return "ended"
    if attempt > job.attempt:
        return "newer"
    cur = job.current
    if cur is None or (cur.number, cur.host, cur.device) != (attempt, host, device):
        return "stale"
    return "offer" if cur.status == "assigned" else "current"


def offer_fate(
    job: Job, claim: tuple[str, int] | None, host: str, *, same_process: bool
) -> OfferFate:
    """What a registration from ``host`` does with ``job``'s unstarted offer there.

    ``claim``: (device, attempt) the registration says runs ``job``, if any. The offer
    is ``start``-ed when the claim is it; ``keep``-ed when a newer attempt claimed
    supersedes it (the claims record that) or the same live process still holds it;
    else ``requeue``-d: a new process does not hold what its predecessor was offered.
    """
    kind = None if claim is None else judge_claim(job, host, *claim)
    if kind == "offer":
        return "start"
    if kind == "newer" or same_process:
        return "keep"
    return "requeue"


def apply_register_claims(store: StoreState, h: Host, req: RegisterRequest, now: float) -> None:
    """Take the faults and running attempts a registration declares (protocol 2).

    A claimed offer was started already (:func:`offer_fate`), before the registration
    judged what was interrupted: here it is ``current``, and nothing is done."""
    for decl in req.devices:
        d = h.devices.get(decl.name)
        if d is None:
            continue
        if decl.faults is not None:
            d.worker_faults = {f.fault_id for f in decl.faults}
            for f in decl.faults:
                adopt_fault(store, d, f.fault_id, f.kind, f.reason, f.parent_fault)
        if decl.running is not None:
            r = decl.running
            adopt_attempt(
                store, h, d, r.job_id, r.attempt, now, started_at=r.started_at, via="register"
            )


def adopt_fault(
    store: StoreState,
    d: Device,
    fault_id: str,
    kind: str,
    reason: str,
    parent_fault: str | None = None,
) -> None:
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
            parent_fault=parent_fault,
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
    via: str,
) -> Job | None:
    """Record a running attempt the controller never saw; None if it knows it already.

    A job the controller knows whose record stops short of the attempt (its highest
    attempt is lower: the store came back from an older copy, queued or offered
    elsewhere) takes the worker's attempt as its current one. Left queued, it would be
    offered again under the very number the worker is running, and that worker's output
    and finish would pass for the new attempt's. The attempt offered to this device
    and not yet started is started. ``via``: ``register`` or ``heartbeat``, for the event.
    """
    known = store.known_job(job_id)
    kind = judge_claim(known, h.name, d.name, attempt)
    if known is not None and kind == "newer":
        store.adopt_newer_attempt(known, d, attempt, now, via=via)
        return known
    if known is not None and kind == "offer":
        store.start_claimed_offer(known, d, now, boot_id=h.boot_id, started_at=started_at, via=via)
        return known
    if kind != "unknown":
        return None  # the same attempt, or a stale one (the heartbeat cancels it)
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
    store.adopt_job(job, d, via=via)
    return job
