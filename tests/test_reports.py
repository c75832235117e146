"""Finish report bodies: how a job's Result maps onto the protocol's outcome."""

from __future__ import annotations

from rc_worker.core.model import Assignment, Outcome, VerifyResult
from rc_worker.core.reports import finish_report, lost_report, not_run_report, outcome_of
from rc_worker.supervise import Result
from rc_worker.sweep import SweepReport

A = Assignment(job_id="j-1", attempt=2, device="gpu0", command=("true",))


def test_outcomes() -> None:
    assert outcome_of(0, False, None, "") is Outcome.SUCCEEDED
    assert outcome_of(3, False, None, "") is Outcome.FAILED
    assert outcome_of(137, True, None, "max_runtime") is Outcome.KILLED
    assert outcome_of(None, False, "cannot start 'x'", "") is Outcome.ERROR
    # Stopped by its owner before the process existed: killed, not an error.
    assert outcome_of(None, False, "stopped before it was started", "cancelled") is Outcome.KILLED


def test_a_swept_survivor_never_relabels_a_successful_job() -> None:
    sweep = SweepReport(scanned=True, found=(4242,), remaining=())
    report = finish_report(
        A,
        Result(exit_code=0, sweep=sweep),
        verify=VerifyResult(ok=True),
        fault_id=None,
        output_bytes=12,
    )
    assert report["outcome"] == "succeeded"
    assert report["killed"] is False
    assert report["sweep"] == {
        "scanned": True,
        "found": [4242],
        "remaining": [],
        "blind": False,
        "blind_pids": [],
        "method": "environ",
    }
    assert report["output_bytes"] == 12
    assert report["attempt"] == 2


def test_not_run_and_lost_reports() -> None:
    refused = not_run_report(A, "refused", "on_acquire hook exited 1")
    assert refused["outcome"] == "refused"
    assert refused["exit_code"] is None
    assert refused["killed"] is False
    assert not_run_report(("j-9", 1, "gpu1"), "killed", "cancelled")["killed"] is True
    lost = lost_report("j-1", 2, "gpu0", sweep=None, output_bytes=7)
    assert lost["outcome"] == "lost"
    assert lost["output_bytes"] == 7
