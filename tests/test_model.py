"""Assignments from the controller are checked before anything acts on them."""

from __future__ import annotations

from typing import Any

import pytest

from rc_worker.core.errors import AssignmentError
from rc_worker.core.model import assignment_identity, effective_limit, parse_assignment


def _raw(**changes: Any) -> dict[str, Any]:
    raw: dict[str, Any] = {
        "job_id": "j-18",
        "attempt": 1,
        "device": "gpu0",
        "command": ["python", "train.py"],
        "cwd": None,
        "env": {"SEED": "1"},
        "max_runtime_s": None,
        "idle_timeout_s": None,
        "grace_s": 10,
        "stdin": None,
        "pty": False,
    }
    raw.update(changes)
    return raw


def test_protocol_example_parses() -> None:
    a = parse_assignment(_raw(stdin={"url": "/v1/jobs/j-18/stdin?attempt=1"}, max_runtime_s=60))
    assert a.command == ("python", "train.py")
    assert a.env == {"SEED": "1"}
    assert a.stdin_url == "/v1/jobs/j-18/stdin?attempt=1"
    assert a.max_runtime_s == 60.0
    assert a.grace_s == 10.0


@pytest.mark.parametrize(
    ("changes", "fragment"),
    [
        ({"command": []}, "command must be a non-empty list"),
        ({"command": "echo hi"}, "command must be a non-empty list"),
        ({"command": ["echo", 3]}, "command must be a non-empty list"),
        ({"job_id": "../../etc"}, "job_id must be"),
        ({"attempt": "1"}, "attempt an integer"),
        ({"device": 5}, "device must be"),
        ({"env": {"A": 1}}, "env must be"),
        ({"env": ["A=1"]}, "env must be"),
        ({"grace_s": "10"}, "grace_s must be a number"),
        ({"grace_s": -1}, "non-negative"),
        ({"max_runtime_s": 0}, "more than zero"),
        ({"idle_timeout_s": True}, "idle_timeout_s must be a number"),
        ({"stdin": "yes"}, "stdin must be null"),
        ({"pty": "no"}, "pty must be true or false"),
        ({"cwd": 7}, "cwd must be"),
    ],
)
def test_malformed_assignments_name_the_problem(changes: dict[str, Any], fragment: str) -> None:
    with pytest.raises(AssignmentError, match=fragment):
        parse_assignment(_raw(**changes))


def test_identity_of_a_malformed_assignment_is_kept_for_the_rejection() -> None:
    assert assignment_identity(_raw(command=[])) == ("j-18", 1, "gpu0")
    assert assignment_identity({"job_id": 3}) is None
    assert assignment_identity("nonsense") is None


def test_effective_limit_is_the_smaller() -> None:
    assert effective_limit(None, None) is None
    assert effective_limit(60.0, None) == 60.0
    assert effective_limit(None, 30.0) == 30.0
    assert effective_limit(60.0, 30.0) == 30.0
