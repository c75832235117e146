"""DeviceSupervisor: one device's lease, from assignment to free again.

Each device runs in its own task with its own cancel scopes: the acquire
hook, the job, the verify pass and the release hook each have their
deadline on the scope that owns the work. A fault on one device never
reaches another: everything here is caught, reported and turned into a
quarantine of this device alone.

    acquire hook → start → journal → job (sweep) → verify → finish → linger → release hook
"""

from __future__ import annotations

import logging
import math
import random
import time
from collections.abc import Collection, Coroutine, Mapping
from typing import TYPE_CHECKING, Any

import trio

from rc_worker.changed import Changed
from rc_worker.core import protocol
from rc_worker.core.config import DeviceConfig
from rc_worker.core.errors import ControllerError, JobUserError
from rc_worker.core.gpu_health import Fault, kind_defaults
from rc_worker.core.lease import Lease
from rc_worker.core.mig_share import HeldHealthFault
from rc_worker.core.model import (
    Assignment,
    DeviceState,
    IdleBehavior,
    VerifyResult,
    effective_limit,
    job_key,
)
from rc_worker.core.protocol import (
    NO_SESSION,
    DeviceDecl,
    DeviceReport,
    FaultRequest,
    HeldFault,
    RunningClaim,
)
from rc_worker.core.reports import finish_report, not_run_report, stale_offer_report
from rc_worker.hooks import run_hook
from rc_worker.host import RunAs
from rc_worker.logs import log_context, set_log_context
from rc_worker.spool import JobDir, OutputSpool
from rc_worker.supervise import JobHandle, JobSpec, Result, run_job
from rc_worker.verify import run_verify

if TYPE_CHECKING:
    from rc_worker.context import WorkerContext

log = logging.getLogger("rc_worker.device")

S = DeviceState


# How long an error handler waits for the error finish to be on disk; past
# it the journal is still there, and the next start finishes the job lost.
FINISH_AFTER_ERROR_S = 30.0


def new_fault_id(rng: random.Random) -> str:
    """A fault id: random, so that no two workers (or restarts) ever repeat one."""
    return f"f-{rng.getrandbits(48):012x}"


class _NotJournaled(Exception):
    """The disk refused a job's journal or spool file: nothing was spawned."""


def _run_as(run_as: RunAs | None) -> dict[str, Any]:
    """``run_as=`` for a hook or verify call only when set: the unset call is the plain one."""
    return {} if run_as is None else {"run_as": run_as}


class DeviceSupervisor:
    def __init__(self, ctx: WorkerContext, config: DeviceConfig) -> None:
        self.ctx = ctx
        self.config = config
        self.name = config.name
        self.lease = Lease(name=config.name, has_hooks=bool(config.on_acquire or config.on_release))
        # Set while a poll that offered this device is in flight: a lingering
        # device does not start its release until that poll has answered.
        self.offered = False
        # Which of the worker's polls offers it (the newest), while ``offered``.
        self.poll_id: int | None = None
        # Who the job in hand (its hooks, process, verify pass) runs as.
        self._run_as: RunAs | None = None
        self._pending: tuple[Assignment, bool] | None = None
        self._changed = Changed()
        self._acquire_scope: trio.CancelScope | None = None
        self._delivery_scope: trio.CancelScope | None = None
        self._cancel_text: str | None = None
        self._handle: JobHandle | None = None
        self._linger_until = math.inf
        self._last_job_id: str | None = None
        # The key of the last attempt whose finish was recorded, so an error
        # after that point does not record a second one.
        self._finished: str | None = None
        # A physical GPU whose MIG slices are devices is offered through them only.
        self.carries_slices = False
        # Health faults raised here and still held, by kind: one is enough.
        self._health_faults: dict[str, str] = {}
        # The physical GPU's fault each child raised here names (fault id -> parent's).
        self._health_parents: dict[str, str] = {}
        self.scope = trio.CancelScope()
        # Kind and reason of each fault held, sent with register (protocol 2).
        self.fault_notes: dict[str, tuple[str, str]] = {}
        self._started_at: float | None = None

    # -- inputs from the worker (sync, never block) ------------------------

    def ready(self) -> bool:
        # Not while a finish for this device is unacknowledged (the outbox pokes
        # the poll loop when one is): the controller must know the outcome first.
        return (
            not self.carries_slices
            and self.lease.ready(draining=self.ctx.draining)
            and not self.ctx.outbox.owes(self.name)
        )

    def awaits_controller(self) -> bool:
        """Whether this device waits for a change only the controller makes: a fault
        cleared, an idle behaviour back to ``run``, or a linger ended by ``drain``."""
        lease = self.lease
        return (
            bool(lease.faults)
            or lease.idle_behavior is not IdleBehavior.RUN
            or lease.state is S.LINGERING
        )

    def can_take(self) -> bool:
        return not self.carries_slices and self.lease.can_take(draining=self.ctx.draining)

    def not_offerable_reason(self) -> str:
        """Why this device cannot take an assignment now (for a stale offer's refusal)."""
        if self.ctx.stopping:
            return f"device {self.name}: the worker is shutting down"
        if self.ctx.draining:
            return f"device {self.name}: the worker is draining"
        if self.lease.faults:
            return f"device {self.name} is quarantined"
        return f"device {self.name} is {self.lease.state}"

    @property
    def job_pid(self) -> int | None:
        """The running job's pid, also its process group and session id; None when
        no job process runs (before its spawn, during hooks and verify)."""
        return None if self._handle is None else self._handle.pid

    def idle(self) -> bool:
        """Nothing to do now: free or quarantined, no assignment waiting."""
        return self._pending is None and self.lease.state in (S.FREE, S.QUARANTINED)

    def assign(self, assignment: Assignment) -> None:
        """Hand a ready device an assignment; the caller checked ``ready()``."""
        needs_acquire = self.lease.begin((assignment.job_id, assignment.attempt))
        self._pending = (assignment, needs_acquire)
        self._poke()

    def cancel(self, job_id: str, attempt: int, text: str) -> None:
        """The controller cancelled this device's job (heartbeat ``cancel``)."""
        if self.lease.job != (job_id, attempt):
            return
        self._cancel_text = text
        if self._acquire_scope is not None:
            self._acquire_scope.cancel()
        if self._handle is not None:
            self._handle.stop(_cancel_reason(text))

    def stop_for_shutdown(self) -> None:
        """The worker's second signal: stop what runs now, report, and go."""
        self.cancel(*(self.lease.job or ("", -1)), "the worker is shutting down")
        if self._delivery_scope is not None:
            self._delivery_scope.cancel()
        self._poke()

    def set_idle_behavior(self, behavior: IdleBehavior) -> bool:
        """Whether it changed."""
        if self.lease.set_idle_behavior(behavior):
            log.info("device %s: idle behaviour %s", self.name, behavior)
            self._poke()
            return True
        return False

    def add_fault(
        self, fault_id: str, why: str, *, kind: str = "fault", parent_fault: str | None = None
    ) -> None:
        """Hold a fault raised elsewhere: by the controller (at register), or
        by an earlier worker process (a report still on disk, with the GPU's fault
        a slice's copy names: register's claims say it as the report does)."""
        if fault_id not in self.lease.faults:
            log.warning(
                "device %s: quarantined (%s, fault %s)",
                self.name,
                why,
                fault_id,
                extra={"device": self.name, "fault_id": fault_id},
            )
        # Kept for register's claims (protocol 2): a controller that adopts the fault
        # from them must record the same kind the report itself carries.
        self.fault_notes.setdefault(fault_id, (kind, why))
        if parent_fault is not None:
            self._health_parents.setdefault(fault_id, parent_fault)
        self.lease.add_fault(fault_id)
        self._poke()

    def _quarantine(
        self,
        kind: str,
        reason: str,
        *,
        job_id: str | None = None,
        report: bool = True,
        extra: Mapping[str, Any] | None = None,
        fault_id: str | None = None,
    ) -> str:
        """Raise a fault of this worker's own; ``report`` sends it with ``fault``
        (a fault outside a finish), else the caller puts it in the finish.
        ``extra`` carries severity, action, scope, parent_fault (docs/protocol.md)."""
        fault_id = fault_id or new_fault_id(self.ctx.rng)
        log.warning(
            "device %s: quarantined (%s: %s, fault %s)",
            self.name,
            kind,
            reason,
            fault_id,
            extra={"device": self.name, "fault_id": fault_id},
        )
        self.fault_notes[fault_id] = (kind, reason)
        self.ctx.metrics.quarantines.labels(kind).inc()
        if report:
            severity, action = kind_defaults(kind)
            fields: dict[str, Any] = {"severity": severity, "action": action, **(extra or {})}
            body = FaultRequest(NO_SESSION, fault_id, kind, reason, job_id=job_id, **fields)
            self.ctx.outbox.fault(self.name, protocol.unstructure(body))
        self.lease.add_fault(fault_id)
        self._poke()
        return fault_id

    # -- GPU health (issue 15; the checks are in gpu_health*.py) ------------

    def raise_health_fault(
        self,
        fault: Fault,
        *,
        job_id: str | None = None,
        fault_id: str | None = None,
        parent_fault: str | None = None,
    ) -> str | None:
        """Quarantine for a health fault, once per kind while it is held.

        Returns the new fault id, or None when one of that kind still holds
        the device (a condition that persists is not news every interval).
        A child (``parent_fault``: the physical GPU's fault it stands for) is
        held back only by one naming the same parent: which slices need one is
        ``core/mig_share.gpu_fault_steps``'s to decide.
        """
        held = self.health_fault(fault.kind)
        if held is not None and (parent_fault is None or held.parent_fault == parent_fault):
            return None
        extra: dict[str, Any] = fault.body()
        extra.pop("kind")
        extra.pop("reason")
        if parent_fault is not None:
            extra["parent_fault"] = parent_fault
        new_id = self._quarantine(
            fault.kind, fault.reason, job_id=job_id, extra=extra, fault_id=fault_id
        )
        self._health_faults[fault.kind] = new_id
        if parent_fault is not None:
            self._health_parents[new_id] = parent_fault
        return new_id

    def health_fault(self, kind: str) -> HeldHealthFault | None:
        """The health fault of ``kind`` raised here and still held, and the GPU's
        fault it names (for a MIG slice's child), or None."""
        held = self._health_faults.get(kind)
        if held is None or held not in self.lease.faults:
            return None
        return HeldHealthFault(held, self._health_parents.get(held))

    def set_health_hold(self, held: Mapping[str, str], passed: Collection[str]) -> None:
        """Hold for the checks that could not run; lift the ones that ran."""
        if self.lease.set_health_hold(held, passed):
            if self.lease.health_hold:
                log.warning("device %s: held for health: %s", self.name, self.health_reason())
            else:
                log.info("device %s: health checks pass again; hold lifted", self.name)
            self._poke()

    def health_reason(self) -> str:
        return "; ".join(f"{c}: {why}" for c, why in sorted(self.lease.health_hold.items()))

    def health_faulted(self) -> bool:
        return any(f in self.lease.faults for f in self._health_faults.values())

    def raise_fault(self, kind: str, reason: str) -> str:
        """Quarantine this device with a fault found outside a job (a health
        check, an operator's tool, a simulation), reported to the controller.
        Returns the fault id."""
        return self._quarantine(kind, reason)

    def clear_faults(self, cleared: set[str]) -> bool:
        """Drop the faults in ``cleared`` this device holds; whether it held any."""
        held = cleared & self.lease.faults
        if held:
            log.info("device %s: faults %s cleared", self.name, sorted(held))
        moved = self.lease.clear_faults(cleared)
        for fault_id in cleared:
            self.fault_notes.pop(fault_id, None)
            self._health_parents.pop(fault_id, None)
        if moved is not None:
            self._poke()
        return bool(held)

    def poke(self) -> None:
        self._poke()

    def status(self) -> dict[str, Any]:
        """This device as ``GET /status`` shows it."""
        entry = self.heartbeat_entry()
        entry.update(
            idle_behavior=str(self.lease.idle_behavior),
            held=self.lease.held,
            faults=sorted(self.lease.faults),
        )
        if self.lease.health_hold:
            entry["held_for_health"] = self.health_reason()
        if self.lease.state is S.LINGERING and self.lease.idle_behavior is IdleBehavior.RUN:
            entry["linger_left_s"] = round(max(0.0, self._linger_until - trio.current_time()), 3)
        return entry

    def register_decl(self, declared_labels: Mapping[str, str]) -> DeviceDecl:
        """This device for ``register``; with what it holds (protocol 2): the faults, with
        kind and reason, and the attempt it runs, so a controller that lost its store
        learns them."""
        running = None
        if self.lease.job is not None and self.lease.state is S.RUNNING:
            job_id, attempt = self.lease.job
            job_dir = JobDir(self.ctx.root, job_key(job_id, attempt), self.ctx.host.store)
            running = RunningClaim(job_id, attempt, job_dir.output_size(), self._started_at)
        return DeviceDecl(
            self.name,
            dict(declared_labels),
            faults=tuple(
                HeldFault(f, kind, reason, self._health_parents.get(f))
                for f in sorted(self.lease.faults)
                for kind, reason in [self.fault_notes.get(f, ("fault", ""))]
            ),
            running=running,
        )

    def heartbeat_report(self) -> DeviceReport:
        job_id, attempt = self.lease.job if self.lease.job is not None else (None, None)
        return DeviceReport(
            str(self.lease.state),
            job_id,
            attempt,
            tuple(sorted(self.lease.faults)),
            self.health_reason() if self.lease.health_hold else None,
        )

    def heartbeat_entry(self) -> dict[str, Any]:
        return protocol.unstructure(self.heartbeat_report())

    def linger_deadline(self) -> float:
        return self._linger_until if self.lease.state is S.LINGERING else math.inf

    def _poke(self) -> None:
        self._changed.notify()
        # Any change to this device may change what is offerable; the poll
        # loop re-reads readiness on every wake, so an extra wake costs a scan.
        self.ctx.poke_poller()

    # -- the device's own task --------------------------------------------

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """The device's own task. Its cancel scope is the device: cancelling
        it abandons this device alone (its job is killed, shielded and bounded)."""
        set_log_context(device=self.name)
        with trio.CancelScope() as self.scope:
            task_status.started()
            await self._loop()

    async def _loop(self) -> None:
        while True:
            state = self.lease.state
            if self._pending is not None:
                assignment, needs_acquire = self._pending
                self._pending = None
                with log_context(job_id=assignment.job_id, attempt=assignment.attempt):
                    await self._isolated(self._serve(assignment, needs_acquire), assignment)
            elif state is S.RELEASING:
                await self._isolated(self._release(), None)
            elif self._linger_over():
                self.lease.end_linger()
            elif self.lease.drained(draining=self.ctx.draining):
                # Done as far as the drain goes, but not gone: an operator's clear of
                # a quarantine while the lease is held still moves it to releasing,
                # and only this task runs the release. The worker ends it when it exits.
                self.ctx.poke_poller()
                await self._wait_for_change()
            else:
                await self._wait_for_change()

    async def _isolated(self, step: Coroutine[Any, Any, None], a: Assignment | None) -> None:
        """Run one lease step so that a bug in it costs this device, not the worker.

        An unexpected error (a full disk under the spool, say) is logged, the
        attempt in hand is finished as ``error``, and the device quarantined
        with a fault an operator must clear: after a bug nothing is known
        about what is left on it.
        """
        try:
            await step
        except Exception as exc:
            log.exception("device %s: internal error; quarantining the device", self.name)
            detail = f"internal worker error: {type(exc).__name__}: {exc}"
            if a is not None and self._finished != self.ctx.job_key(a):
                # Bounded and shielded: an error handler must finish.
                with trio.move_on_after(FINISH_AFTER_ERROR_S, shield=True):
                    await self._finish_after_error(a, detail)
            fault_id = new_fault_id(self.ctx.rng)
            self.ctx.metrics.quarantines.labels("dirty").inc()
            self.ctx.outbox.fault(
                self.name, {"fault_id": fault_id, "kind": "dirty", "reason": detail}
            )
            self.fault_notes[fault_id] = ("dirty", detail)  # for register's claims
            self.lease.fail(fault_id)
            self._handle = None
            self._acquire_scope = None
            self.ctx.poke_poller()

    async def _finish_after_error(self, a: Assignment, detail: str) -> None:
        key = self.ctx.job_key(a)
        report = not_run_report(a, "error", "", error=detail)
        try:
            if self.ctx.outbox.tracking(key):
                # The spool's count, as a finish after a run says (``_run``): what the
                # delivery ships, a disk error's marker held in memory included. The
                # file's size would leave that out, and the finish would claim less
                # output than the controller was sent.
                report["output_bytes"] = self.ctx.outbox.spooled(key)
                await self.ctx.outbox.finish(key, report)
            else:
                await self.ctx.report(a, report)
        except Exception:
            log.exception("device %s: cannot record the finish of job %s", self.name, a.job_id)

    def _linger_over(self) -> bool:
        return self.lease.linger_over(
            now=trio.current_time(),
            until=self._linger_until,
            draining=self.ctx.draining,
            offered=self.offered,
        )

    async def _wait_for_change(self) -> None:
        changed = self._changed.watch()
        deadline = self.linger_deadline()
        if self.lease.idle_behavior is not IdleBehavior.RUN or deadline <= trio.current_time():
            # A linger already over waits for the poll that offered the device
            # to answer (it pokes us); a past deadline here would spin.
            deadline = math.inf
        with trio.move_on_at(deadline):
            await changed.wait()

    async def _serve(self, a: Assignment, needs_acquire: bool) -> None:
        self._cancel_text = None
        self._last_job_id = a.job_id
        key = self.ctx.job_key(a)
        if self.ctx.stopping:
            # Taken just before the worker was told to stop: not started, so
            # hand it back; a refused attempt is requeued as a new one, and the
            # refusal is the device's state, not the job's: a stale offer.
            report = stale_offer_report(a, "the worker is shutting down")
            await self.ctx.report(a, report)
            self._settle()
            return
        refusal = await self._health_gate(None)
        if refusal is not None:
            await self.ctx.report(a, not_run_report(a, "refused", refusal))
            self._settle()
            return
        try:
            # Once per job, for its acquire hook, process and verify pass alike.
            self._run_as = await self.ctx.run_as(self.config)
        except JobUserError as e:
            # Nothing ran, so the job goes elsewhere (refused: requeued); the device
            # would fail every job the same way, so it is quarantined until cleared.
            await self.ctx.report(a, not_run_report(a, "refused", str(e)))
            self._quarantine("job_user", str(e), job_id=a.job_id)
            self._settle()
            return
        if needs_acquire and self.config.on_acquire and not await self._acquire(a):
            return
        self.lease.acquired()
        if not await self._start(a):
            self._settle()
            return
        try:
            result, verify, fault_id, output_bytes = await self._run(a, key)
        except _NotJournaled as e:
            # Nothing was spawned, so the device is as clean as before: this job ends
            # `error` (its report held in memory if the disk refuses it too), no quarantine.
            log.error("device %s: cannot journal job %s (%s); not run", self.name, a.job_id, e)
            await self.ctx.report(
                a, not_run_report(a, "error", "", error=f"the worker's state_dir refused it: {e}")
            )
            self._settle()
            return
        report = finish_report(
            a, result, verify=verify, fault_id=fault_id, output_bytes=output_bytes
        )
        await self.ctx.outbox.finish(key, report)
        self.ctx.metrics.jobs_finished.labels(report["outcome"]).inc()
        log.info(
            "device %s: job %s attempt %d %s (exit %s)%s",
            self.name,
            a.job_id,
            a.attempt,
            report["outcome"],
            result.exit_code,
            f", {report['reason']}" if report["reason"] else "",
        )
        # The device is offered again only once the controller has the
        # outcome, so it never sees a device ready while a job it assigned
        # there still looks running.
        self._finished = key
        # Stopping (a second SIGTERM) does not wait for the controller: the
        # finish is on disk and goes out after the next start.
        with trio.CancelScope() as self._delivery_scope:
            if self.ctx.stopping:
                self._delivery_scope.cancel()
            await self.ctx.outbox.delivered(key)
        self._delivery_scope = None
        self._settle()

    async def _acquire(self, a: Assignment) -> bool:
        assert self.config.on_acquire is not None
        with trio.CancelScope() as scope:
            self._acquire_scope = scope
            with self.ctx.metrics.hook_seconds.labels("on_acquire").time():
                outcome = await run_hook(
                    "on_acquire",
                    self.config.on_acquire,
                    time_limit=self.config.timeout,
                    env=self.ctx.child_env(self.name, a.job_id),
                    host=self.ctx.host,
                    **_run_as(self._run_as),
                )
        self._acquire_scope = None
        if scope.cancelled_caught:
            # Cancelled, not failed: nothing is quarantined, but a half-run
            # acquire may have claimed something, so release runs.
            text = self._cancel_text or "cancelled"
            await self.ctx.report(a, not_run_report(a, "killed", _cancel_reason(text)))
            self.lease.acquire_cancelled()
            return False
        if not outcome.ok:
            await self.ctx.report(a, not_run_report(a, "refused", outcome.reason))
            fault_id = self._quarantine("hook_failed", outcome.reason, job_id=a.job_id)
            self.lease.acquire_failed(fault_id)
            return False
        return True

    async def _start(self, a: Assignment) -> bool:
        with trio.CancelScope() as scope:
            self._acquire_scope = scope
            try:
                await self.ctx.client.start(a.job_id, a.attempt, self.name, self.ctx.boot_id)
            except ControllerError as e:
                log.info(
                    "device %s: job %s attempt %d not started: %s",
                    self.name,
                    a.job_id,
                    a.attempt,
                    e,
                )
                return False
            finally:
                self._acquire_scope = None
        if scope.cancelled_caught:
            await self.ctx.report(
                a, not_run_report(a, "killed", _cancel_reason(self._cancel_text or ""))
            )
            return False
        return True

    async def _run(self, a: Assignment, key: str) -> tuple[Result, VerifyResult, str | None, int]:
        job_dir = JobDir(self.ctx.root, key, self.ctx.host.store)
        try:
            cgroup = await self.ctx.journal(job_dir, a)
            spool = OutputSpool(job_dir, cap=self.ctx.config.spool_max_bytes)
        except OSError as e:
            raise _NotJournaled(str(e)) from e
        self.ctx.outbox.track(job_dir, a.job_id, a.attempt, spool, device=self.name)
        # From here the outbox ships this spool until it is closed, and sends the finish
        # only then: every way out of the run, a spec that cannot be built included (an
        # environment it cannot carry), must close it, or the delivery
        # waits for more output for ever and the controller never hears the outcome.
        try:
            self.lease.job_started()
            self._started_at = time.time()
            handle = JobHandle()
            self._handle = handle
            if self._cancel_text is not None:
                handle.stop(_cancel_reason(self._cancel_text))
            spec = self._job_spec(a, cgroup)
            began = trio.current_time()
            result = await run_job(spec, spool, host=self.ctx.host, handle=handle)
        finally:
            self._handle = None
            spool.close()
            if spool.truncated:
                self.ctx.metrics.output_truncated.inc()
        self.ctx.metrics.job_seconds.observe(trio.current_time() - began)
        self.ctx.metrics.swept.inc(len(result.sweep.found))
        self.lease.job_ended()
        env = {
            **self.ctx.child_env(self.name, a.job_id),
            "RC_JOB_EXIT_CODE": "" if result.exit_code is None else str(result.exit_code),
        }
        # After the sweep, before verify: what is still resident on the GPU.
        # The job's own grace, as capped by max_grace: the after-job sweep must not
        # wait longer than the job's teardown was allowed to.
        await self._health_gate(a.job_id, grace=self._grace(a))
        with self.ctx.metrics.verify_seconds.time():
            verify = await run_verify(
                self.ctx.config.verify_dir,
                script_timeout=self.ctx.config.verify_timeout,
                pass_budget=self.ctx.config.verify_pass_budget,
                env=env,
                host=self.ctx.host,
                **_run_as(self._run_as),
            )
        # The lease decides, by the one rule recovery decides by too: not proven
        # clean (a failed verify pass, a sweep that proves nothing) is a fault,
        # sent in the finish rather than on its own.
        decision = self.lease.after_job(result.sweep, verify, draining=self.ctx.draining)
        fault_id = None
        if decision.fault_kind is not None:
            fault_id = self._quarantine(decision.fault_kind, decision.reason, report=False)
        return result, verify, fault_id, spool.size

    def _job_spec(self, a: Assignment, cgroup: str | None) -> JobSpec:
        return JobSpec(
            command=list(a.command),
            cwd=a.cwd,
            env=self.ctx.job_env(self.name, a),
            grace_ceiling=self._grace(a),
            max_runtime=effective_limit(self.config.max_runtime, a.max_runtime_s),
            idle_timeout=a.idle_timeout_s,
            stdin=self.ctx.client.stdin(a.stdin_url) if a.stdin_url else None,
            sweep_job_id=a.job_id,
            pty=a.pty,
            run_as=self._run_as,
            cgroup=cgroup,
            cgroup_limits=self.ctx.cgroup_limits(self.config),
        )

    def _grace(self, a: Assignment) -> float:
        # max_grace lets shutdown_grace and a service manager's stop timeout
        # be sized whatever grace a user asks for.
        if a.grace_s > self.ctx.config.max_grace:
            log.info(
                "device %s: job %s asked for a %gs grace; cut to max_grace (%gs)",
                self.name,
                a.job_id,
                a.grace_s,
                self.ctx.config.max_grace,
            )
            return self.ctx.config.max_grace
        return a.grace_s

    async def _health_gate(self, job_id: str | None, *, grace: float = 0.0) -> str | None:
        """The GPU checks before an assignment (``job_id`` None) or after a job.

        Returns why the device cannot take work, or None. Faults and holds are
        applied to this device (and its slices) by the gate itself.
        """
        gate = self.ctx.health_gate
        if gate is None:
            return None
        return await gate(self.name, job_id, grace)

    def _settle(self) -> None:
        nxt = self.lease.step_done(draining=self.ctx.draining)
        if nxt is S.LINGERING:
            self._linger_until = trio.current_time() + self.config.release_linger
        # Wake the poll loop whatever the next state: a device settling to
        # `free` is offerable too. The outbox's wake-up on the finish ack can
        # land in the same scheduler batch as this task's resumption, and
        # Trio orders a batch at random, so without this poke the poll loop
        # may look before the device has settled and sleep until the next
        # heartbeat (half the jobs waited ~10 s with default intervals).
        self.ctx.poke_poller()

    async def _release(self) -> None:
        if self.config.on_release:
            try:
                run_as = await self.ctx.run_as(self.config)
            except JobUserError as e:
                fault_id = self._quarantine("job_user", str(e), job_id=self._last_job_id)
                self.lease.release_failed(fault_id)
                return
            with self.ctx.metrics.hook_seconds.labels("on_release").time():
                outcome = await run_hook(
                    "on_release",
                    self.config.on_release,
                    time_limit=self.config.timeout,
                    env=self.ctx.child_env(self.name, self._last_job_id),
                    host=self.ctx.host,
                    **_run_as(run_as),
                )
            if not outcome.ok:
                fault_id = self._quarantine("hook_failed", outcome.reason, job_id=self._last_job_id)
                self.lease.release_failed(fault_id)
                return
        self.lease.release_done()
        self.ctx.poke_poller()


def _cancel_reason(text: str) -> str:
    """``cancelled``, with the controller's own words when it gave some."""
    return f"cancelled: {text}" if text and text != "cancelled" else "cancelled"
