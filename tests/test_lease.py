"""The device lease state machine, property-tested without processes."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from rc_worker.core.lease import LEGAL, IllegalTransition, Lease
from rc_worker.core.model import DeviceState, IdleBehavior

S = DeviceState


def test_free_device_with_hooks_acquires_then_lingers_then_releases() -> None:
    lease = Lease("gpu0", has_hooks=True)
    assert lease.ready(draining=False)
    assert lease.begin(("j-1", 1)) is True
    assert not lease.ready(draining=False)
    lease.acquired()
    lease.to(S.RUNNING)
    lease.to(S.VERIFYING)
    assert lease.settle(draining=False) is S.LINGERING
    lease.to(S.LINGERING)
    assert lease.ready(draining=False)
    # A job taken while lingering skips the acquire hook.
    assert lease.begin(("j-2", 1)) is False


def test_device_without_hooks_goes_straight_back_to_free() -> None:
    lease = Lease("gpu0")
    assert lease.begin(("j-1", 1)) is False
    lease.acquired()
    assert lease.held is False
    lease.to(S.RUNNING)
    lease.to(S.VERIFYING)
    assert lease.settle(draining=False) is S.FREE


def test_draining_releases_a_held_device_instead_of_lingering() -> None:
    lease = Lease("gpu0", has_hooks=True, held=True, state=S.VERIFYING)
    assert lease.settle(draining=True) is S.RELEASING
    lease.idle_behavior = IdleBehavior.DRAIN
    assert lease.settle(draining=False) is S.RELEASING


def test_fault_quarantines_an_idle_device_at_once() -> None:
    lease = Lease("gpu0", state=S.LINGERING, has_hooks=True, held=True)
    lease.add_fault("f-1")
    assert lease.state is S.QUARANTINED
    assert not lease.ready(draining=False)


def test_fault_during_a_job_quarantines_when_the_job_is_done() -> None:
    lease = Lease("gpu0", state=S.VERIFYING)
    lease.add_fault("f-1")
    assert lease.state is S.VERIFYING
    assert lease.settle(draining=False) is S.QUARANTINED


def test_every_fault_must_be_cleared_before_the_device_is_free() -> None:
    lease = Lease("gpu0")
    lease.add_fault("f-1")
    lease.add_fault("f-2")
    assert lease.clear_faults({"f-1"}) is None
    assert lease.state is S.QUARANTINED
    assert lease.clear_faults({"f-2"}) is S.FREE


def test_a_held_device_is_released_after_its_quarantine_is_cleared() -> None:
    lease = Lease("gpu0", has_hooks=True, held=True, state=S.LINGERING)
    lease.add_fault("f-1")
    assert lease.clear_faults({"f-1"}) is S.RELEASING


def test_illegal_transition_is_refused() -> None:
    lease = Lease("gpu0")
    with pytest.raises(IllegalTransition, match="free → running"):
        lease.to(S.RUNNING)


_EVENTS = st.lists(
    st.one_of(
        st.tuples(st.just("to"), st.sampled_from(list(S))),
        st.tuples(st.just("fault"), st.sampled_from(["f-1", "f-2", "f-3"])),
        st.tuples(st.just("clear"), st.sets(st.sampled_from(["f-1", "f-2", "f-3"]))),
        st.tuples(st.just("idle"), st.sampled_from(list(IdleBehavior))),
        st.tuples(st.just("begin"), st.just(("j", 1))),
        st.tuples(st.just("settle"), st.booleans()),
    ),
    max_size=40,
)


@given(events=_EVENTS, has_hooks=st.booleans(), draining=st.booleans())
def test_ready_only_when_idle_unfaulted_and_running_behaviour(
    events: list[tuple[str, object]], has_hooks: bool, draining: bool
) -> None:
    """Invariant 1: whatever happens, a device offered as ready holds no job,
    no fault, and is in free or lingering with idle behaviour run."""
    lease = Lease("gpu0", has_hooks=has_hooks)
    for kind, arg in events:
        before = lease.state
        try:
            if kind == "to":
                assert isinstance(arg, DeviceState)
                lease.to(arg)
                assert arg is before or arg in LEGAL[before]
            elif kind == "fault":
                lease.add_fault(str(arg))
            elif kind == "clear":
                assert isinstance(arg, set)
                nxt = lease.clear_faults(arg)
                if nxt is not None:
                    lease.to(nxt)
            elif kind == "idle":
                assert isinstance(arg, IdleBehavior)
                lease.idle_behavior = arg
            elif kind == "begin":
                if lease.ready(draining=False):
                    lease.begin(("j", 1))
                    lease.acquired()
            elif kind == "settle" and lease.state is S.VERIFYING:
                lease.to(lease.settle(draining=bool(arg)))
        except IllegalTransition:
            assert lease.state is before
        if lease.ready(draining=draining):
            assert lease.state in (S.FREE, S.LINGERING)
            assert not lease.faults
            assert lease.idle_behavior is IdleBehavior.RUN
            assert not draining
        if lease.faults and lease.state in (S.FREE, S.LINGERING):
            pytest.fail("a faulted device sits free or lingering")


def test_an_assignment_is_taken_whatever_the_stale_idle_behaviour() -> None:
    """The controller owns idle behaviour: its assignment is newer than the
    worker's last heartbeat, so a device it just switched back to run takes it."""
    lease = Lease("gpu0", idle_behavior=IdleBehavior.HOLD)
    assert not lease.ready(draining=False)
    assert lease.can_take(draining=False)
    assert not lease.can_take(draining=True)
    lease.add_fault("f-1")
    assert not lease.can_take(draining=False)


# -- held for health (issue 15) -------------------------------------------------


@given(
    state=st.sampled_from([S for S in DeviceState]),
    checks=st.dictionaries(st.sampled_from(["memory", "resident", "pci"]), st.text(min_size=1)),
)
def test_a_health_hold_is_never_ready_and_is_not_a_fault(
    state: DeviceState, checks: dict[str, str]
) -> None:
    lease = Lease(name="gpu0", state=state, health_hold=dict(checks))
    if checks:
        assert not lease.ready(draining=False)
    else:
        assert lease.ready(draining=False) == (state in (DeviceState.FREE, DeviceState.LINGERING))
    # Held is not quarantined: nothing to clear, and an idle device stays where it is.
    assert lease.faults == set()
    assert lease.state is state
