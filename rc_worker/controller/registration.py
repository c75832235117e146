"""What a registration decides about interrupted jobs and the devices they ran on.

A registration by a new worker process (a different ``instance_id`` or boot id
than the last one; see ``store._same_process``) means the process that
supervised this host's jobs is gone, so every job it was running was
interrupted. (The same live process registering again after an
``unknown_session`` interrupted nothing: its jobs stay as they are, and the
recovery entries it resends were judged when it first registered.) For each
interrupted job, and each device quarantined for one:

- the boot id now differs from the one recorded when the job started: a reboot
  proves nothing of it survives, the device is freed;
- else the worker's ``recovery`` entry claims ``gone`` (and the worker does not
  run with ``require_manual_clear``): freed;
- else the device stays (or becomes) quarantined, reason ``interrupted``, until
  an operator clears it.

A device the registration claims runs a job the controller itself ended (the
host was retired with ``--force`` while its worker lived on, say) is quarantined
the same way, naming the job: the process is there, so the device is not free.

A job the controller believed running that the worker does not report in
``recovery`` is finished ``lost``; one it does report stays running, and the
worker owes its ``finish`` (the store finishes it ``lost`` itself if no
heartbeat mentions it for ``report_timeout_s``). A fault raised at host loss
for a device that had no started job is lifted: nothing the controller started
can be on it. Sans-IO, like the store.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from rc_worker.controller.claims import claimed_attempts, claimed_placements
from rc_worker.controller.messages import Recovery, RegisterRequest
from rc_worker.controller.records import Device, Host

if TYPE_CHECKING:
    from rc_worker.controller.state import StoreState


def reconcile_registration(
    store: StoreState, h: Host, req: RegisterRequest, now: float, *, same_process: bool
) -> None:
    recovery = {r.job_id: r for r in req.recovery}
    settled: set[tuple[str, str]] = set()
    # Attempts the worker says it runs now (protocol 2): facts, whatever process registers.
    claimed = claimed_attempts(req)

    def proof(start_boot: str | None, rec: Recovery | None) -> str | None:
        boot = start_boot if start_boot is not None else (None if rec is None else rec.boot_id)
        if boot is not None and boot != req.boot_id:
            return "reboot"
        # A worker that must be cleared by hand never proves anything by claim, even if a
        # buggy one sends "gone": the setting may only ever make things more cautious.
        if rec is not None and rec.claim == "gone" and not req.require_manual_clear:
            return "gone"
        return None

    def settle(
        d: Device,
        job_id: str,
        attempt: int | None,
        start_boot: str | None,
        rec: Recovery | None,
        detail: str,
    ) -> None:
        settled.add((d.name, job_id))
        existing = [
            f.fault_id
            for f in d.faults.values()
            if f.kind == "interrupted" and f.raised_by == "controller" and f.job_id == job_id
        ]
        why = proof(start_boot, rec)
        if why is not None:
            store.lift(d, existing, by=why)
        elif not existing:
            boot = start_boot if start_boot is not None else (None if rec is None else rec.boot_id)
            store.controller_fault(d, job_id, attempt, boot, detail)

    for job, att in store.running_on(h.name):
        if claimed.get(job.job_id, 0) >= att.number:
            # Still running here, or running a later attempt (a store restored from an
            # older copy): nothing was interrupted. The claims adopt the later attempt.
            att.adopted = True
            att.last_heard = now
            settled.add((att.device, job.job_id))
            continue
        if same_process:
            # Still supervised by the process that registered again: it owes the finish,
            # and if its heartbeats never mention the job the store finishes it lost.
            att.adopted = True
            att.last_heard = now
            continue
        rec = recovery.get(job.job_id)
        if rec is not None and rec.attempt not in (None, att.number):
            rec = None
        d = h.devices.get(att.device)
        if d is not None:
            settle(
                d,
                job.job_id,
                att.number,
                att.start_boot_id,
                rec,
                f"worker restarted while job {job.job_id} was running",
            )
        if rec is None:
            store.lose_job(job, "the worker restarted and did not report the job")
        else:
            att.adopted = True
            att.last_heard = now

    # The same live process registering again resends the recovery entries it sent
    # when it started (until their finishes are delivered): they were judged then,
    # so a resend changes nothing, not even a device an operator has since cleared.
    for rec in () if same_process else req.recovery:
        d = h.devices.get(rec.device)
        if d is None or not d.present or (d.name, rec.job_id) in settled:
            continue
        known = store.known_job(rec.job_id)
        if known is not None and known.finished_by == "worker":
            # Its finish came after its process tree was gone and swept: a journal entry
            # resent for it proves nothing new, and must not quarantine the device again.
            continue
        start_boot = None
        if known is not None:
            for att in known.attempts:
                if att.number == rec.attempt and att.host == h.name:
                    start_boot = att.start_boot_id
        settle(
            d,
            rec.job_id,
            rec.attempt,
            start_boot,
            rec,
            f"worker restarted with job {rec.job_id} in its journal ({rec.claim})",
        )

    # A device claimed running a job the controller itself ended (its host retired with
    # --force while the worker lived on, or the job's report timed out): the process runs
    # there now, and its device is no more free than a lost host's, so it is quarantined
    # the same way, naming the job, until an operator clears it. Nothing proves otherwise
    # (the worker says it runs), so no proof is asked. The same live process registering
    # again was judged when the job ended; an operator's clear since then stands.
    for job_id, (name, claim) in () if same_process else claimed_placements(req).items():
        d = h.devices.get(name)
        known = store.known_job(job_id)
        if (
            d is None
            or not d.present
            or known is None
            or not known.terminal
            or known.finished_by != "controller"
            or (name, job_id) in settled
        ):
            continue
        settled.add((name, job_id))
        if not any(
            f.kind == "interrupted" and f.raised_by == "controller" and f.job_id == job_id
            for f in d.faults.values()
        ):
            store.controller_fault(
                d,
                job_id,
                claim.attempt,
                req.boot_id,
                f"the worker registered running job {job_id}, which had ended "
                f"{known.state} ({known.reason})",
            )

    for d in h.devices.values():
        for fault in list(d.faults.values()):
            if fault.kind != "interrupted" or fault.raised_by != "controller":
                continue
            if fault.job_id is None:
                store.lift(d, [fault.fault_id], by="register")
            elif (d.name, fault.job_id) not in settled:
                settle(
                    d, fault.job_id, fault.attempt, fault.boot_id, recovery.get(fault.job_id), ""
                )
