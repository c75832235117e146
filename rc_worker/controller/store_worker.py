"""The store's worker side: the protocol of docs/protocol.md (register, heartbeat, poll,
start, output, finish, faults, labels and sheets).

A part of :class:`~rc_worker.controller.store.Store` (see its module); sans-IO.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from rc_worker.controller.claims import (
    adopt_attempt,
    apply_register_claims,
    claimed_placements,
    offer_fate,
)
from rc_worker.controller.errors import (
    BadRequest,
    Conflict,
    Forbidden,
    NotFound,
    StaleAttempt,
)
from rc_worker.controller.messages import (
    Assignment,
    CancelOrder,
    DeviceInfo,
    DeviceStatus,
    FaultRequest,
    FinishRequest,
    HeartbeatReply,
    HeartbeatRequest,
    JobInfo,
    LabelsUpdate,
    PollReply,
    RegisterReply,
    RegisterRequest,
    SheetsUpdate,
    StartRequest,
)
from rc_worker.controller.records import Attempt, Device, Host, Job
from rc_worker.controller.registration import reconcile_registration
from rc_worker.controller.state import job_topic
from rc_worker.controller.state_persist import StoredState
from rc_worker.core.model import PROTOCOL_VERSION


def _check_name(kind: str, name: str) -> None:
    if not name or "/" in name or name != name.strip():
        raise BadRequest(
            f"{kind} name {name!r} must be non-empty, without '/' or spaces at the ends"
        )


def _stored_worker_view(d: Device) -> tuple[object, ...]:
    """What a heartbeat may change of a device's stored record (``persist/codec.py``)."""
    return (d.worker_state, frozenset(d.worker_faults), tuple(d.cleared_pending.items()))


def _orders(h: Host) -> tuple[dict[str, str], dict[str, tuple[str, ...]]]:
    """What the controller tells a worker of its devices at each heartbeat and host watch:
    every present device's idle behaviour, and the fault ids cleared it must still hear."""
    return (
        {n: d.idle_behavior for n, d in h.devices.items() if d.present},
        {n: tuple(d.cleared_pending) for n, d in h.devices.items() if d.cleared_pending},
    )


def _same_process(h: Host, req: RegisterRequest, running: Sequence[tuple[Job, Attempt]]) -> bool:
    """Whether a registration comes from the live worker process the host last had.

    A worker sends an ``instance_id`` it picked at start and keeps in memory only,
    so a new process (even one with the same pid, as in a restarted container)
    never repeats it; with one the answer comes from that id and the boot id alone,
    never from the ``recovery`` entries, which a restarted worker legitimately
    resends, at every registration, until their finishes are delivered. Without one
    (an older worker) the old rule stands: same boot, same pid, and no recovery
    entry for a job running here.
    """
    if h.boot_id != req.boot_id:
        return False
    if req.instance_id is not None or h.instance_id is not None:
        return req.instance_id is not None and req.instance_id == h.instance_id
    running_here = {job.job_id for job, _ in running}
    return (
        h.pid is not None
        and h.pid == req.pid
        and not any(r.job_id in running_here for r in req.recovery)
    )


class WorkerSide(StoredState):
    """What workers do to the state, one method per protocol request."""

    # --- worker side ------------------------------------------------------------------------

    def register(self, host: str, req: RegisterRequest, *, now: float) -> RegisterReply:
        """A worker process (re)registers: a new session, and the rules of docs/protocol.md."""
        try:
            _check_name("host", host)
            names = [decl.name for decl in req.devices]
            for name in names:
                _check_name("device", name)
                if "." in name:
                    raise BadRequest(f"devices: device name {name!r} must not contain '.'")
            if len(set(names)) != len(names):
                raise BadRequest("devices: device names must be unique")
        except BadRequest:
            self.stats.registrations["refused"] += 1
            raise
        h = self._hosts.get(host)
        carried = [] if h is None else self.running_on(host)
        same_process = h is not None and _same_process(h, req, carried)
        # The seed's boot outcomes: "recovered" when this start carries anything over (jobs
        # the controller had running here, recovery entries, claimed attempts or faults).
        recovered = bool(carried or req.recovery) or any(
            decl.running is not None or decl.faults for decl in req.devices
        )
        self.stats.registrations["recovered" if recovered else "registered"] += 1
        if h is None:
            h = self._hosts[host] = Host(host, req.boot_id, last_seen=now)
            self.retired_hosts.discard(host)  # back: a new host of that name
        self.journal.host(host)
        h.recovering_until = None
        if h.session is not None:
            del self._sessions[h.session]
        h.session = f"{self._next_id('s')}-{self._token()}"
        self._sessions[h.session] = h
        h.lost = False
        h.left = False
        h.last_seen = now
        h.pid = req.pid
        h.instance_id = req.instance_id
        h.worker_version = req.worker_version
        h.require_manual_clear = req.require_manual_clear
        wanted = {decl.name: decl for decl in req.devices}
        for name, d in h.devices.items():
            d.present = name in wanted
        for name, decl in wanted.items():
            d = h.devices.setdefault(name, Device(host, name))
            d.declared = dict(decl.declared_labels)
        self._apply_labels(h, req.labels)
        self._apply_sheets(h, req.sheets)
        self._reindex_host(h)
        self._touch_host(host)
        self._claimed = {a for a in self._claimed if a[0] != host}
        self._listed.pop(host, None)
        # The host's unstarted offers, before what was interrupted is judged: one the
        # worker claims running is started here (its start never arrived), so that the
        # registration finds it running and claimed, as if the start had come.
        claimed = claimed_placements(req)
        for job in list(self._live.values()):
            cur = job.current
            if cur is None or cur.host != host or cur.status != "assigned":
                continue
            placed = claimed.get(job.job_id)
            claim = None if placed is None else (placed[0], placed[1].attempt)
            fate = offer_fate(job, claim, host, same_process=same_process)
            if fate == "start":
                assert placed is not None
                self.start_claimed_offer(
                    job,
                    h.devices[cur.device],
                    now,
                    boot_id=req.boot_id,
                    started_at=placed[1].started_at,
                    via="register",
                )
            elif fate == "requeue":
                self._requeue(job, "a new worker process registered before starting it")
        reconcile_registration(self, h, req, now, same_process=same_process)
        apply_register_claims(self, h, req, now)
        h.boot_id = req.boot_id
        self._changed()
        h.heartbeat_interval_s = self.heartbeat_interval_now()
        self._arm_host(h)
        for d in h.devices.values():
            if d.job is not None:
                self._arm_job(d.job)  # carried over the registration: owes a report
        return RegisterReply(
            protocol=PROTOCOL_VERSION,
            session=h.session,
            heartbeat_interval_s=h.heartbeat_interval_s,
            poll_wait_s=self.config.poll_wait_s,
            devices={name: self._status(h.devices[name]) for name in wanted},
        )

    @staticmethod
    def _status(d: Device) -> DeviceStatus:
        first = d.first_fault()
        return DeviceStatus(
            state="quarantined" if d.faults else "free",
            reason=None if first is None else first.reason,
            fault_id=None if first is None else first.fault_id,
            faults=tuple(d.faults),
            idle_behavior=d.idle_behavior,
        )

    def heartbeat(self, host: str, req: HeartbeatRequest, *, now: float) -> HeartbeatReply:
        h = self._session(req.session, host, mark=False)
        h.last_seen = now  # not stored: a restart gives every host a fresh grace anyway
        before = [_stored_worker_view(d) for d in h.devices.values()]
        cancel: dict[tuple[str, int], CancelOrder] = {}
        unblocked = False
        for name, report in req.devices.items():
            d = h.devices.get(name)
            if d is None:
                continue
            d.worker_state = report.state
            # The worker no longer holds a fault (it heard a clear): the device may be
            # offerable now, and a poll parked for it must look again.
            unblocked = unblocked or bool(d.worker_faults and not report.faults)
            d.worker_faults = set(report.faults)
            d.held_for_health = report.held_for_health
            self._age_cleared(d, report.faults)
            if report.job_id is None or report.attempt is None:
                continue
            if report.state == "running" and adopt_attempt(
                self, h, d, report.job_id, report.attempt, now, via="heartbeat"
            ):
                self.journal.host(h.name)
                self._changed()
            job = self._jobs.get(report.job_id)
            cur = None if job is None else job.current
            # The attempt is this one only where the controller placed it: the same number
            # on another host or device is another process (a store restored from an older
            # copy offered the number again), whose silence this report must not cover.
            here = (
                cur
                if cur is not None
                and cur.number == report.attempt
                and (cur.host, cur.device) == (h.name, name)
                else None
            )
            if here is not None:
                here.last_heard = now
            if report.state not in ("acquiring", "running") or job is None:
                continue
            why = None
            if cur is None or cur.number != report.attempt:
                why = "stale attempt: the job was offered again"
            elif here is None:
                why = f"stale attempt: attempt {cur.number} was offered to {cur.host}/{cur.device}"
            elif job.cancel_reason is not None:
                why = job.cancel_reason
            elif job.terminal and report.state == "acquiring":
                why = job.reason or f"job already ended ({job.state})"
            # A job declared lost while its worker was only cut off is left to run: its
            # output is still taken, and its device stays quarantined until cleared anyway.
            if why is not None:
                cancel[(job.job_id, report.attempt)] = CancelOrder(job.job_id, report.attempt, why)
        if [_stored_worker_view(d) for d in h.devices.values()] != before:
            self.journal.host(h.name)  # what the worker says of its devices is stored
        if unblocked:
            self._touch_host(h.name)
            self._changed()
        for job in self._live_cancelled():
            cur = job.current
            if cur is not None and cur.host == host and job.cancel_reason is not None:
                cancel[(job.job_id, cur.number)] = CancelOrder(
                    job.job_id, cur.number, job.cancel_reason
                )
        idle, cleared = _orders(h)
        return HeartbeatReply(cancel=tuple(cancel.values()), idle_behavior=idle, cleared=cleared)

    def watch_answer(self, host: str, session: str, *, orders: bool = True) -> PollReply:
        """What a host watch (a poll with ``watch_cancels``) answers besides its
        assignments: the cancels, and with ``orders`` (the worker sent ``known_control``)
        the heartbeat's idle behaviours and clears with the token that names them."""
        h = self._session(session, host, mark=False)
        cancel = tuple(self.cancels_for(host, session))
        if not orders:
            return PollReply(cancel=cancel)
        idle, cleared = _orders(h)
        return PollReply(
            cancel=cancel,
            control=self.control_token(host),
            idle_behavior=idle,
            cleared=cleared,
        )

    def cancels_for(self, host: str, session: str) -> list[CancelOrder]:
        """Cancels of this host's live jobs, for a long poll to deliver at once."""
        self._session(session, host, mark=False)
        return [
            CancelOrder(job.job_id, cur.number, job.cancel_reason)
            for job in self._live_cancelled()
            if (cur := job.current) is not None
            and cur.host == host
            and job.cancel_reason is not None
        ]

    def _live_cancelled(self) -> list[Job]:
        """Live jobs with a cancel to deliver: a few, never every running job of the fleet."""
        for job_id in [j for j in self._cancelled if j not in self._live]:
            del self._cancelled[job_id]
        return list(self._cancelled.values())

    def deregister(self, host: str, session: str, *, now: float) -> None:
        """A draining worker leaves: forget its session without losing the host.

        Its devices keep their state (a quarantine stays, a free device is not
        quarantined: the worker finished and reported everything before it
        left) and are offered nothing, since only a session polls. An offer it
        never started is offered again; a job still running in the controller's
        view (it should be none) ends ``lost`` and its device gets a fault, as
        at host loss.
        """
        h = self._session(session, host)
        assert h.session is not None
        del self._sessions[h.session]
        h.session = None
        h.left = True
        self._touch_host(host)
        self._listed.pop(host, None)
        self._claimed = {a for a in self._claimed if a[0] != host}
        for d in h.devices.values():
            job = d.job
            cur = None if job is None else job.current
            if job is not None and cur is not None and cur.status == "assigned":
                self._requeue(job, "the worker left before starting it")
            elif job is not None and cur is not None:
                self.controller_fault(
                    d, job.job_id, cur.number, cur.start_boot_id, "the worker left while it ran"
                )
                self._terminate(job, "lost", reason="the worker left while it ran", by="controller")
        self._emit("host_left", host=host)
        self._changed()

    def _age_cleared(self, d: Device, reported: Sequence[str]) -> None:
        # Dropped only after several heartbeats in a row stop reporting an id: one stale or
        # reordered heartbeat (a retried body from before a registration) cannot lose a clear.
        for fault_id in list(d.cleared_pending):
            if fault_id in reported:
                d.cleared_pending[fault_id] = 0
                continue
            d.cleared_pending[fault_id] += 1
            if d.cleared_pending[fault_id] >= self.config.cleared_omissions:
                del d.cleared_pending[fault_id]

    def open_poll(
        self, host: str, ready: Sequence[str], withdrawn: Sequence[str] = ()
    ) -> dict[str, int]:
        """A long poll begins: it supersedes every earlier poll listing its devices.

        Returns the offer generations to hand to each :meth:`poll` of this long
        poll. A worker that sees a device it listed in a parked poll stop being
        offerable polls again at once, with the devices still ready in ``ready``
        and that one in ``withdrawn``: the older poll, superseded, is answered
        at once (:meth:`superseded`) and is handed nothing more for any of them.
        """
        gens: dict[str, int] = {}
        h = self._hosts.get(host)
        bumped = False
        listed = self._listed.setdefault(host, {}) if h is not None else {}
        for name in dict.fromkeys([*ready, *withdrawn]):
            if h is None or name not in h.devices:
                continue  # poll() skips it anyway; keep the table to known devices
            key = (host, name)
            old = self._poll_gen.get(key, 0)
            bumped = bumped or old > 0
            gen = self._poll_gen[key] = old + 1
            if name in ready:
                gens[name] = gen
                listed[name] = gen
            else:
                listed.pop(name, None)
        if bumped:
            self._touch_host(host)
            self._changed()  # wake the superseded poll, so that it answers now
        return gens

    def close_poll(self, host: str, offers: Mapping[str, int]) -> None:
        """A long poll answered: its devices are no longer parked (unless a newer poll
        lists them), so no queued job is aimed at them."""
        listed = self._listed.get(host)
        if listed is None:
            return
        for name, gen in offers.items():
            if listed.get(name) == gen:
                del listed[name]
                self._claimed.discard((host, name))
        if not listed:
            del self._listed[host]

    def superseded(self, host: str, offers: Mapping[str, int]) -> bool:
        """Whether a newer poll has listed or withdrawn any device of this one's offers."""
        return any(self._poll_gen.get((host, name)) != gen for name, gen in offers.items())

    def poll(
        self,
        host: str,
        session: str,
        ready: Sequence[str],
        *,
        now: float,
        offers: Mapping[str, int] | None = None,
    ) -> list[Assignment]:
        """Assign at most one queued job to each ready device; never waits.

        ``offers``: this long poll's generations from :meth:`open_poll`; a device
        a newer poll has offered since is skipped (the offer is superseded).
        """
        # A poll that assigns nothing changes nothing stored: only an assignment or a
        # requeue (a device's last job) marks the host, below.
        h = self._session(session, host, mark=False)
        out: list[Assignment] = []
        changed = False
        missed = False
        for name in dict.fromkeys(ready):
            d = h.devices.get(name)
            if d is None or not d.present:
                continue
            if offers is not None and self._poll_gen.get((host, name)) != offers.get(name):
                continue
            aimed = (host, name) in self._claimed
            self._claimed.discard((host, name))
            got, touched = self._poll_device(h, d, now)
            if got is not None:
                out.append(got)
            changed = changed or touched
            if got is None and aimed:
                missed = True
        if out or changed:
            self.journal.host(host)  # the devices' last_job / last_busy moved
        if missed and self._queue:
            # A job was aimed at a device here that took nothing: aim the queue again.
            self._wake_queue_again()
            changed = True
        if changed:
            self._changed()
        return out

    def _poll_device(self, h: Host, d: Device, now: float) -> tuple[Assignment | None, bool]:
        """Offer one ready device the first queued job it matches; (assignment, changed)."""
        changed = False
        held = d.job
        cur = None if held is None else held.current
        if held is not None and cur is not None and cur.status == "assigned":
            # Ready again with an unstarted offer outstanding: the offer never reached
            # the worker (a lost poll response). Offer it again as a new attempt.
            self._requeue(held, "the device was reported ready again; offered again")
            changed = True
        if d.job is not None or d.faults or d.worker_faults or d.idle_behavior != "run":
            return None, changed
        job = self._pick(h, d)
        if job is None:
            return None, changed
        self._queue.remove((job.seq, job.job_id))
        att = Attempt(job.attempt + 1, h.name, d.name, "assigned", last_heard=now)
        job.attempts.append(att)
        job.state = "assigned"
        self.journal.job(job.job_id)
        d.occupy(job, self._wall())
        self._live[job.job_id] = job
        self._touch_job(job)
        self._arm_job(job)
        since = self._queued_since.pop(job.job_id, None)
        if since is not None:
            self.stats.queue_wait.observe(self._wall() - since)
        return Assignment.offer(job.job_id, att.number, d.name, job.spec), True

    def _pick(self, h: Host, d: Device) -> Job | None:
        """The first queued job this device may run: a set lookup per job, against each
        job's candidate devices from the label index (never a selector match per poll)."""
        addr = (h.name, d.name)
        for _, job_id in self._queue:
            job = self._jobs[job_id]
            cands = self._job_candidates(job)
            if cands is None or addr in cands:
                return job
        return None

    def start(self, job_id: str, req: StartRequest, *, now: float) -> JobInfo:
        h = self._session(req.session)
        job = self._job(job_id)
        if job.cancel_reason is not None and job.attempts and req.attempt == job.attempt:
            if job.state == "running":
                # A retried start after a cancel: refused, so nothing will run. End it here
                # (if the first start did spawn it, the heartbeat's cancel stops that).
                reason = job.cancel_reason
                self._terminate(job, "killed", by="controller", reason=reason, killed=True)
                self._changed()
            raise Conflict(f"job {job_id} was cancelled: {job.cancel_reason}", code="cancelled")
        cur = self._current(job, req.attempt)
        self._check_placement(job, cur, h, req.device)
        if job.terminal:
            raise StaleAttempt(f"job {job_id} already ended ({job.state}); do not run it")
        if cur.status == "assigned":
            self.journal.job(job_id)
            cur.status = "running"
            cur.start_boot_id = req.boot_id
            cur.last_heard = now
            job.state = "running"
            job.started_at = self._wall()
            self.stats.dispatch_latency.observe(job.started_at - job.submitted_at)
            self._touched.add(job_topic(job_id))  # its followers; no poll cares
            self._changed()
        return job.info()

    @staticmethod
    def _check_placement(job: Job, cur: Attempt, h: Host, device: str) -> None:
        if cur.host != h.name:
            raise Forbidden(f"attempt {cur.number} of job {job.job_id} is not on host {h.name}")
        if cur.device != device:
            raise BadRequest(
                f"device: attempt {cur.number} of job {job.job_id} is on {cur.device}, not {device}"
            )

    def append_output(self, job_id: str, attempt: int, offset: int, data: bytes) -> int:
        """Idempotent append; returns the committed length. Conflict ``gap`` above it.

        Past ``config.max_output_bytes`` the bytes are acknowledged (counted in the
        committed length) and dropped, and the job is marked ``output_truncated``.
        """
        job = self._job(job_id)
        self._current(job, attempt)
        committed = job.stored_bytes + job.dropped_bytes
        if offset < 0:
            raise BadRequest("offset: must not be negative")
        if offset > committed:
            raise Conflict(
                f"offset {offset} is above the committed {committed}; resend from {committed}",
                code="gap",
                extra={"committed": committed},
            )
        if offset + len(data) > committed:
            new = data[committed - offset :]
            cap = self.config.max_output_bytes
            if cap and job.stored_bytes + len(new) > cap:
                keep = max(0, cap - job.stored_bytes)
                job.dropped_bytes += len(new) - keep
                job.output_truncated = True
                new = new[:keep]
                self.journal.job(job_id)  # the record says so; its bytes are rows of their own
            if new:
                self.journal.output(job_id, job.stored_bytes, new)
                job.output += new
            self._touched.add(job_topic(job_id))  # wakes only this job's followers
            self._changed()
        return job.stored_bytes + job.dropped_bytes

    def finish(self, job_id: str, req: FinishRequest, *, now: float) -> JobInfo:
        h = self._session(req.session)
        job = self._job(job_id)
        d = h.devices.get(req.device)
        cur = job.current
        if cur is None or cur.number != req.attempt:
            # A fault is a fact about the device, not the attempt: keep it even from a
            # stale finish, or the worker holds a quarantine nobody can ever clear.
            if d is not None and req.fault_id is not None and self._finish_fault(job, d, req):
                self._changed()
            raise self._stale(job, req.attempt)
        self._check_placement(job, cur, h, req.device)
        assert d is not None
        first = not job.terminal
        changed = False
        if req.fault_id is not None or (first and req.verify is not None and not req.verify.ok):
            changed = self._finish_fault(job, d, req) or changed
        if first:
            self._record_finish(job, cur, req)
            changed = True
        if changed:
            self._changed()
        return job.info()

    def _finish_fault(self, job: Job, d: Device, req: FinishRequest) -> bool:
        verify_failed = req.verify is not None and not req.verify.ok
        sweep = req.sweep or {}
        remaining = sweep.get("remaining")
        if verify_failed:
            kind = "verify_failed"
            detail = req.verify.reason if req.verify is not None else ""
        elif remaining:
            kind, detail = "dirty", f"processes left after the sweep: {remaining}"
        elif sweep.get("blind") or sweep.get("scanned") is False:
            # The worker could not prove the job left nothing (invariant 1).
            blind = sweep.get("blind_pids") or "some"
            kind, detail = "dirty", f"the sweep could not inspect processes: {blind}"
        else:
            kind, detail = "fault", req.reason or "reported at finish"
        fault_id = req.fault_id or self._next_id("fc")
        raised = self._worker_fault(d, fault_id, kind, detail, job.job_id)
        if raised and verify_failed:
            self._emit(
                "verify_failed",
                host=d.host,
                device=d.name,
                job_id=job.job_id,
                fault_id=fault_id,
                reason=detail,
            )
        if raised and job.fault_id is None:
            job.fault_id = fault_id
            self.journal.job(job.job_id)
        return raised

    def _record_finish(self, job: Job, cur: Attempt, req: FinishRequest) -> None:
        job.output_bytes = req.output_bytes
        job.verify = req.verify
        job.sweep = None if req.sweep is None else dict(req.sweep)
        job.error = req.error
        if req.outcome != "refused":
            self._terminate(
                job,
                req.outcome,
                by="worker",
                reason=req.reason,
                exit_code=req.exit_code,
                killed=req.killed,
            )
            return
        if cur.status == "running":
            self._terminate(job, "error", by="worker", reason="refused after it had started")
        elif job.cancel_reason is not None:
            self._terminate(job, "killed", by="controller", reason=job.cancel_reason, killed=True)
        elif req.stale_offer and job.stale_refusals < self.config.max_stale_refusals:
            # The device stopped being offerable after the poll that listed it: the
            # offer was stale, not the job unrunnable. Back in its place in the queue,
            # not counted (a separate, generous bound stops a worker stuck saying so).
            job.stale_refusals += 1
            self._requeue(job, f"refused (stale offer): {req.reason}")
        else:
            job.refusals += 1
            if job.refusals >= self.config.max_refusals:
                self._terminate(
                    job, "error", by="controller", reason=f"refused {job.refusals} times"
                )
            else:
                self._requeue(job, f"refused: {req.reason or 'acquire hook failed'}")

    def raise_fault(self, host: str, device: str, req: FaultRequest, *, now: float) -> DeviceInfo:
        h = self._session(req.session, host)
        d = h.devices.get(device)
        if d is None:
            raise NotFound(f"no device {host}/{device}", code="unknown_device")
        if self._worker_fault(d, req.fault_id, req.kind, req.reason, req.job_id, req):
            if req.kind == "verify_failed":
                self._emit(
                    "verify_failed",
                    host=host,
                    device=device,
                    job_id=req.job_id,
                    fault_id=req.fault_id,
                    reason=req.reason,
                )
            self._changed()
        return d.info(h)

    def put_labels(self, host: str, session: str, update: LabelsUpdate, *, now: float) -> None:
        h = self._session(session, host)
        self._apply_labels(h, update)
        self._reindex_host(h)  # the label views are rebuilt only here and at register
        self._touch_host(host)
        self._changed()

    def put_sheets(self, host: str, session: str, update: SheetsUpdate, *, now: float) -> None:
        self._apply_sheets(self._session(session, host), update)
        self._touch_host(host)
        self._changed()

    @staticmethod
    def _apply_labels(h: Host, update: LabelsUpdate) -> None:
        if update.host is not None:
            h.facts = dict(update.host)
        for name, facts in update.devices.items():
            d = h.devices.get(name)
            if d is not None:
                prefix = f"{name}."
                d.facts = {k.removeprefix(prefix): v for k, v in facts.items()}

    @staticmethod
    def _apply_sheets(h: Host, update: SheetsUpdate) -> None:
        if update.host_given:
            h.sheet = update.host
        for name, text in update.devices.items():
            d = h.devices.get(name)
            if d is not None:
                d.sheet = text
