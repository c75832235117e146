"""The device lease state machine (sans-IO).

Which worker-side transitions are legal, what a fault does, and when a
device may be offered as ready. ``DeviceSupervisor`` performs the I/O and
asks this object at every step, so the rules live in one place and are
property-tested without processes.

Invariant 1 of ARCHITECTURE.md lives here: ``ready`` is true only in
``free`` or ``lingering`` (after the job's process tree is gone and the
verify pass is done), with no fault held, idle behaviour ``run``, and the
worker not draining.
"""

from __future__ import annotations

import attrs

from rc_worker.core.model import DeviceState, IdleBehavior

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
        """Drop cleared faults; returns the state to move to, if any."""
        self.faults -= cleared
        if self.state is S.QUARANTINED and not self.faults:
            return S.RELEASING if self.held else S.FREE
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

    def released(self) -> None:
        self.held = False

    def fail(self, fault_id: str) -> None:
        """Quarantine from any state: the worker hit a bug serving this device.

        The one transition outside ``LEGAL``, because after an unexpected
        error nothing is known about the device except that it must not be
        offered until someone has looked.
        """
        self.faults.add(fault_id)
        self.state = S.QUARANTINED
        self.job = None
