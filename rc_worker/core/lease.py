"""The device lease state machine (sans-IO).

Which worker-side transitions are legal, what a fault does, where a device
goes after each step (an acquire hook that failed or was cancelled, a job's
end with its sweep and verify pass, a linger that is over, a release hook),
and when a device may be offered as ready. ``DeviceSupervisor`` performs the
I/O and asks this object at every step: it never picks a state itself. So
the rules live in one place and are property-tested against a model
without processes (tests/test_lease.py).

Whether a job left its device clean is the rule recovery decides by too
(``claim_decision.why_not_clean``), so the two never disagree.

Invariant 1 of ARCHITECTURE.md lives here: ``ready`` is true only in
``free`` or ``lingering`` (after the job's process tree is gone and the
verify pass is done), with no fault held, idle behaviour ``run``, and the
worker not draining.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping

import attrs

from rc_worker.core.claim_decision import why_not_clean
from rc_worker.core.model import DeviceState, IdleBehavior, VerifyResult
from rc_worker.core.sweep_report import SweepReport

S = DeviceState

LEGAL: dict[DeviceState, frozenset[DeviceState]] = {
    S.FREE: frozenset({S.ACQUIRING, S.QUARANTINED}),
    # ACQUIRING covers the acquire hook and the `start` request; a refused
    # start leaves a held device lingering (or free when nothing is held).
    S.ACQUIRING: frozenset({S.RUNNING, S.QUARANTINED, S.LINGERING, S.FREE, S.RELEASING}),
    S.RUNNING: frozenset({S.VERIFYING}),
    S.VERIFYING: frozenset({S.LINGERING, S.RELEASING, S.FREE, S.QUARANTINED}),
    S.LINGERING: frozenset({S.ACQUIRING, S.RELEASING, S.QUARANTINED}),
    S.RELEASING: frozenset({S.FREE, S.QUARANTINED}),
    S.QUARANTINED: frozenset({S.FREE, S.RELEASING}),
}


class IllegalTransition(RuntimeError):
    """A bug: the supervisor asked for a transition the lease does not allow."""


@attrs.frozen
class AfterJob:
    """What a job's end decides (:meth:`Lease.after_job`).

    ``fault_kind`` and ``reason``: the fault to raise (``verify_failed`` or
    ``dirty``), or None when the job left the device proven clean. ``next``:
    where the device goes once the controller has the finish, as things
    stand now (``quarantined`` with any fault held, new or old).
    """

    next: DeviceState
    fault_kind: str | None = None
    reason: str = ""


@attrs.define
class Lease:
    """One device's worker-side lease state.

    ``held`` is true between a successful acquire hook and the release
    hook: a held device runs ``on_release`` before it is free again.
    """

    name: str
    has_hooks: bool = False
    state: DeviceState = S.FREE
    idle_behavior: IdleBehavior = IdleBehavior.RUN
    faults: set[str] = attrs.field(factory=set)
    held: bool = False
    job: tuple[str, int] | None = None
    # Held for health: a GPU check that could not run (check -> why). Not a
    # fault (nothing to clear), but never offered while any is set; each
    # lifts when its check next succeeds (fail closed, issue 15).
    health_hold: dict[str, str] = attrs.field(factory=dict)

    def to(self, new: DeviceState) -> None:
        if new is self.state:
            return
        if new not in LEGAL[self.state]:
            raise IllegalTransition(f"device {self.name}: {self.state} → {new} is not allowed")
        if self.faults and new in (S.FREE, S.LINGERING):
            raise IllegalTransition(
                f"device {self.name}: cannot become {new} while it holds faults "
                f"{sorted(self.faults)}"
            )
        self.state = new
        if new in (S.FREE, S.LINGERING, S.QUARANTINED, S.RELEASING):
            self.job = None

    def ready(self, *, draining: bool) -> bool:
        return (
            self.state in (S.FREE, S.LINGERING)
            and not self.faults
            and not self.health_hold
            and self.idle_behavior is IdleBehavior.RUN
            and not draining
        )

    def can_take(self, *, draining: bool) -> bool:
        """Whether an assignment the controller made may run here.

        Idle behaviour is left out on purpose: the controller owns it, and
        its assignment is newer than the worker's last heartbeat, so a device
        the controller just switched from hold back to run must not reject
        the job the controller then gave it.
        """
        # A health hold is left out too: an assignment made while the poll
        # was in flight reaches the health gate, which refuses it (requeued)
        # rather than rejecting it for good.
        return self.state in (S.FREE, S.LINGERING) and not self.faults and not draining

    def begin(self, job: tuple[str, int]) -> bool:
        """Take an assignment; returns whether the acquire hook must run first."""
        needs_acquire = self.state is S.FREE and self.has_hooks
        self.to(S.ACQUIRING)
        self.job = job
        return needs_acquire

    def acquired(self) -> None:
        self.held = self.has_hooks

    def add_fault(self, fault_id: str) -> None:
        """Record a fault. An idle device is quarantined at once; a busy one
        finishes its step and is quarantined instead of becoming ready."""
        self.faults.add(fault_id)
        if self.state in (S.FREE, S.LINGERING):
            self.to(S.QUARANTINED)

    def clear_faults(self, cleared: set[str]) -> DeviceState | None:
        """Drop cleared faults; a quarantine with none left ends (a held device is
        released first). Returns the state it moved to, if it moved."""
        self.faults -= cleared
        if self.state is S.QUARANTINED and not self.faults:
            nxt = S.RELEASING if self.held else S.FREE
            self.to(nxt)
            return nxt
        return None

    def settle(self, *, draining: bool) -> DeviceState:
        """Where a device goes when its step is done and no job is next."""
        if self.faults:
            return S.QUARANTINED
        if not self.held:
            return S.FREE
        if draining or self.idle_behavior is IdleBehavior.DRAIN:
            return S.RELEASING
        return S.LINGERING

    def step_done(self, *, draining: bool) -> DeviceState:
        """A step is over and no job is next: move where :meth:`settle` says."""
        nxt = self.settle(draining=draining)
        self.to(nxt)
        return nxt

    def released(self) -> None:
        self.held = False

    # -- transitions of one lease step (DeviceSupervisor carries them out) ----

    def acquire_cancelled(self) -> None:
        """The acquire hook was cancelled (by the controller or a shutdown).

        Not a failure, so nothing is quarantined; but a half-run acquire may
        have claimed something, so the device is held and the release hook runs.
        """
        self.held = True
        self.to(S.RELEASING)

    def acquire_failed(self, fault_id: str) -> None:
        """The acquire hook failed: the device is quarantined with ``fault_id``."""
        self.faults.add(fault_id)
        self.to(S.QUARANTINED)

    def job_started(self) -> None:
        """The job's journal is on disk and its process is about to be spawned."""
        self.to(S.RUNNING)

    def job_ended(self) -> None:
        """The job's process tree is gone (swept): the verify pass is next."""
        self.to(S.VERIFYING)

    def after_job(
        self, sweep: SweepReport, verify: VerifyResult | None, *, draining: bool = False
    ) -> AfterJob:
        """Decide a job's end from its sweep and verify pass (``verify`` None: none ran).

        Not proven clean (:func:`~rc_worker.core.claim_decision.why_not_clean`, the
        rule recovery decides by too) raises a fault. A fault already held
        (a GPU health check after the job, an operator's, the controller's)
        quarantines the device too; a health hold does not move it (it is
        simply not offered while the hold lasts). Changes nothing: the
        supervisor raises the fault with the id it draws, and settles with
        :meth:`step_done` once the controller has the finish.
        """
        doubt = why_not_clean(sweep, verify)
        if doubt is not None:
            return AfterJob(S.QUARANTINED, doubt.kind, doubt.reason)
        return AfterJob(self.settle(draining=draining))

    def linger_over(self, *, now: float, until: float, draining: bool, offered: bool) -> bool:
        """Whether a lingering device's release starts now.

        Never while a poll that offered it is in flight (an assignment may be
        on its way). Idle behaviour ``drain`` or a draining worker release at
        once; ``hold`` keeps the device held however long; ``run`` waits for
        the linger deadline ``until``.
        """
        if self.state is not S.LINGERING or offered:
            return False
        if draining or self.idle_behavior is IdleBehavior.DRAIN:
            return True
        if self.idle_behavior is IdleBehavior.HOLD:
            return False
        return now >= until

    def end_linger(self) -> None:
        """The linger is over (see :meth:`linger_over`): release the device."""
        self.to(S.RELEASING)

    def release_done(self) -> DeviceState:
        """The release hook succeeded (or there is none): free, unless a fault came
        in meanwhile (the controller's, an operator's), which quarantines it."""
        self.held = False
        nxt = S.QUARANTINED if self.faults else S.FREE
        self.to(nxt)
        return nxt

    def release_failed(self, fault_id: str) -> None:
        """The release hook failed: not held any more, but quarantined with ``fault_id``."""
        self.held = False
        self.faults.add(fault_id)
        self.to(S.QUARANTINED)

    def set_idle_behavior(self, behavior: IdleBehavior) -> bool:
        """The controller changed the idle behaviour; returns whether it changed.

        It moves nothing at once: a lingering device then releases when
        :meth:`linger_over` says so, and readiness follows it.
        """
        if behavior is self.idle_behavior:
            return False
        self.idle_behavior = behavior
        return True

    def set_health_hold(self, held: Mapping[str, str], passed: Collection[str]) -> bool:
        """Hold for the GPU checks that could not run (check -> why); lift the
        ones that ran. Returns whether the hold changed."""
        before = dict(self.health_hold)
        for check in passed:
            self.health_hold.pop(check, None)
        self.health_hold.update(held)
        return self.health_hold != before

    def drained(self, *, draining: bool) -> bool:
        """Whether a draining worker is done with this device (nothing left to release)."""
        return draining and self.state in (S.FREE, S.QUARANTINED)

    def fail(self, fault_id: str) -> None:
        """Quarantine from any state: the worker hit a bug serving this device.

        The one transition outside ``LEGAL``, because after an unexpected
        error nothing is known about the device except that it must not be
        offered until someone has looked.
        """
        self.faults.add(fault_id)
        self.state = S.QUARANTINED
        self.job = None
