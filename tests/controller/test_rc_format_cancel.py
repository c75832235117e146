"""What `rc cancel` prints."""

from __future__ import annotations

from rc_worker.controller.rc_format import cancel_result


def test_a_running_jobs_cancel_says_its_worker_is_told_at_once() -> None:
    # The worker hears of a cancel through its cancel watch, not at its next heartbeat:
    # the line said "at its next heartbeat", up to a heartbeat interval too pessimistic.
    line = cancel_result({"job_id": "j-1", "state": "running"})
    assert line.startswith("j-1: cancel requested")
    assert "heartbeat" not in line
    assert "SIGTERM" in line


def test_a_job_that_had_not_started_says_it_is_cancelled() -> None:
    line = cancel_result({"job_id": "j-2", "state": "cancelled", "reason": "cancelled"})
    assert line.startswith("j-2: ")
    assert "cancelled" in line
    assert "\n" not in line
