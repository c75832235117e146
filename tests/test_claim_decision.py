"""``Lease.after_job``'s decision table, and the one "proven clean" rule it shares
with recovery's claim (rc_worker/claim_decision.py)."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

import rc_worker.core.claim_decision as claim_decision
from rc_worker import recovery
from rc_worker.core.claim_decision import Doubt, decide_claim, proven_clean, why_not_clean
from rc_worker.core.lease import Lease
from rc_worker.core.model import Claim, DeviceState, IdleBehavior, VerifyResult
from rc_worker.core.sweep_report import SweepReport

S = DeviceState

SWEEPS = {
    "proven, nothing found": SweepReport(scanned=True),
    "proven, survivors removed": SweepReport(scanned=True, found=(41, 42)),
    "proven through the cgroup": SweepReport(scanned=True, found=(41,), method="cgroup"),
    "unproven, a survivor": SweepReport(scanned=True, found=(41,), remaining=(41,)),
    "unproven, not scanned": SweepReport(scanned=False),
    "blind": SweepReport(scanned=True, blind=True, blind_pids=(77,)),
}
# Why each sweep does not prove the job gone (None: it does), as an operator reads it.
SWEEP_DOUBT = {
    "proven, nothing found": None,
    "proven, survivors removed": None,
    "proven through the cgroup": None,
    "unproven, a survivor": "processes [41] survived SIGKILL",
    "unproven, not scanned": "could not be looked for",
    "blind": "could not inspect processes [77]",
}
FAILED = VerifyResult(ok=False, reason="verify failed: 10-gpu-mem: exit 1")
VERIFIES = {"passed": VerifyResult(ok=True), "failed": FAILED, "none ran": None}
HEALTH = ("healthy", "health fault", "held for health")


def _lease(health: str) -> Lease:
    """A held device whose job has just ended (an acquire hook, so it would linger)."""
    lease = Lease("gpu0", has_hooks=True, held=True, state=S.VERIFYING, job=("j-1", 1))
    if health == "health fault":
        # Raised by the GPU check after the job, before verify (gpu_health_coord).
        lease.add_fault("f-ecc")
    elif health == "held for health":
        lease.set_health_hold({"resident": "nvidia-smi timed out"}, ())
    return lease


@pytest.mark.parametrize("health", HEALTH)
@pytest.mark.parametrize("verify_name", list(VERIFIES))
@pytest.mark.parametrize("sweep_name", list(SWEEPS))
def test_after_job_decision_table(sweep_name: str, verify_name: str, health: str) -> None:
    lease = _lease(health)
    before = (lease.state, set(lease.faults), dict(lease.health_hold), lease.held, lease.job)
    decision = lease.after_job(SWEEPS[sweep_name], VERIFIES[verify_name])

    doubt = SWEEP_DOUBT[sweep_name]
    if verify_name == "failed":
        # A failed verify pass is named whatever the sweep saw.
        assert decision.fault_kind == "verify_failed"
        assert decision.reason == FAILED.reason
    elif doubt is not None:
        assert decision.fault_kind == "dirty"
        assert doubt in decision.reason
    else:
        assert decision.fault_kind is None
        assert decision.reason == ""
    # Any fault, new or already held, keeps the device from lingering; a health
    # hold does not move it (it lingers, held, never offered while the hold lasts).
    if decision.fault_kind is not None or health == "health fault":
        assert decision.next is S.QUARANTINED
    else:
        assert decision.next is S.LINGERING
    # Deciding changes nothing: the supervisor raises the fault and settles later.
    assert before == (lease.state, lease.faults, lease.health_hold, lease.held, lease.job)


@pytest.mark.parametrize(
    ("held", "draining", "behavior", "nxt"),
    [
        (False, False, IdleBehavior.RUN, S.FREE),
        (True, False, IdleBehavior.RUN, S.LINGERING),
        (True, False, IdleBehavior.HOLD, S.LINGERING),
        (True, False, IdleBehavior.DRAIN, S.RELEASING),
        (True, True, IdleBehavior.RUN, S.RELEASING),
        (False, True, IdleBehavior.RUN, S.FREE),
    ],
)
def test_after_a_clean_job_the_device_goes_where_a_settled_step_goes(
    held: bool, draining: bool, behavior: IdleBehavior, nxt: DeviceState
) -> None:
    lease = Lease("gpu0", has_hooks=held, held=held, state=S.VERIFYING, idle_behavior=behavior)
    decision = lease.after_job(SweepReport(scanned=True), VerifyResult(ok=True), draining=draining)
    assert decision.next is nxt
    assert lease.step_done(draining=draining) is nxt


def test_the_supervisor_raises_what_after_job_decides() -> None:
    """The sequence DeviceSupervisor runs: decide, raise the fault, deliver, settle."""
    lease = _lease("healthy")
    decision = lease.after_job(SWEEPS["blind"], VerifyResult(ok=True))
    assert decision.fault_kind == "dirty"
    lease.add_fault("f-dirty")
    assert lease.state is S.VERIFYING  # quarantined only once the finish is delivered
    assert lease.step_done(draining=False) is decision.next is S.QUARANTINED
    assert not lease.ready(draining=False)


# -- the one rule, in both places -----------------------------------------------------

REPORTS = st.builds(
    SweepReport,
    scanned=st.booleans(),
    found=st.lists(st.integers(2, 99), max_size=3).map(tuple),
    remaining=st.lists(st.integers(2, 99), max_size=3).map(tuple),
    blind=st.booleans(),
    blind_pids=st.lists(st.integers(2, 99), max_size=2).map(tuple),
    method=st.sampled_from(["environ", "cgroup"]),
)


@given(sweep=REPORTS, verify=st.sampled_from([None, VerifyResult(ok=True)]))
def test_a_job_end_and_recovery_judge_a_sweep_alike(
    sweep: SweepReport, verify: VerifyResult | None
) -> None:
    """A sweep that lets a job's end offer the device is exactly one that lets
    recovery claim the job gone, so a restart never disagrees with a job's end."""
    end_clean = Lease("gpu0", state=S.VERIFYING).after_job(sweep, verify).fault_kind is None
    claim = recovery.decide_claim(sweep, reboot=False, require_manual_clear=False)
    assert end_clean is (claim is Claim.GONE)
    assert end_clean is sweep.clean
    # And recovery never claims a survivor gone.
    if sweep.remaining:
        assert claim is Claim.ALIVE


@given(sweep=REPORTS)
def test_a_reboot_proves_the_job_gone_and_manual_clear_only_tightens(sweep: SweepReport) -> None:
    assert decide_claim(sweep, reboot=True, require_manual_clear=False) is Claim.GONE
    assert proven_clean(sweep, reboot=True)
    for reboot in (False, True):
        assert decide_claim(sweep, reboot=reboot, require_manual_clear=True) is Claim.UNKNOWN


def test_recovery_uses_the_shared_decision() -> None:
    assert recovery.decide_claim is claim_decision.decide_claim


@pytest.mark.parametrize("name", list(SWEEPS))
def test_a_failed_verify_pass_is_the_doubt_named_first(name: str) -> None:
    assert why_not_clean(SWEEPS[name], FAILED) == Doubt("verify_failed", FAILED.reason)
    assert why_not_clean(SWEEPS[name], FAILED, reboot=True) == Doubt("verify_failed", FAILED.reason)


def test_claim_decision_is_pure() -> None:
    """No I/O in the decision: it is to move into the pure core as it is."""
    forbidden = {"trio", "httpx", "os", "subprocess", "socket", "time"}
    for module in (claim_decision, Path(claim_decision.__file__).with_name("sweep_report.py")):
        path = module if isinstance(module, Path) else Path(inspect.getfile(module))
        tree = ast.parse(path.read_text())
        imported = {
            alias.name.split(".")[0]
            for node in ast.walk(tree)
            if isinstance(node, ast.Import)
            for alias in node.names
        } | {
            node.module.split(".")[0]
            for node in ast.walk(tree)
            if isinstance(node, ast.ImportFrom) and node.module
        }
        assert not imported & forbidden, (path.name, imported & forbidden)
