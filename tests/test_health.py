"""Readiness as /readyz decides it (sans-IO), and the spool size the metrics report."""

from __future__ import annotations

from pathlib import Path

from hypothesis import given
from hypothesis import strategies as st

from rc_worker.health import not_ready_reason, tree_bytes

_times = st.floats(min_value=0, max_value=1e6, allow_nan=False)


@given(
    registered=st.booleans(),
    draining=st.booleans(),
    last=st.none() | _times,
    silence=_times,
    interval=st.floats(min_value=0.1, max_value=100),
)
def test_ready_exactly_when_registered_not_draining_and_heard_from_lately(
    registered: bool, draining: bool, last: float | None, silence: float, interval: float
) -> None:
    now = (last or 0.0) + silence
    reason = not_ready_reason(
        registered=registered,
        draining=draining,
        last_answer=last,
        now=now,
        heartbeat_interval=interval,
    )
    heard = last is not None and now - last <= 3 * interval
    assert (reason is None) == (registered and not draining and heard)
    if not registered:
        assert reason == "not registered with the controller yet"
    elif draining:
        assert reason == "draining: taking no new work"
    elif not heard:
        assert reason is not None
        assert "has not answered" in reason


def test_tree_bytes_counts_files_below_and_a_missing_directory_is_zero(tmp_path: Path) -> None:
    assert tree_bytes(tmp_path / "absent") == 0
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "x").write_bytes(b"12345")
    (tmp_path / "y").write_bytes(b"123")
    assert tree_bytes(tmp_path) == 8
