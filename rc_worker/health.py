"""Readiness (``/readyz``) and the spool's size: what the status endpoint reports (sans-IO).

Liveness (``/healthz``) needs no decision: answering proves the event loop
runs. Readiness does: the worker is ready for work when it is registered,
the controller answered one of its requests within the last three heartbeat
intervals, and it is not draining.
"""

from __future__ import annotations

from pathlib import Path

from rc_worker.statestore import LINUX_STORE

# How many heartbeat intervals without an answer from the controller make the
# worker not ready: the controller itself declares a host lost after three.
SILENT_INTERVALS = 3


def not_ready_reason(
    *,
    registered: bool,
    draining: bool,
    last_answer: float | None,
    now: float,
    heartbeat_interval: float,
) -> str | None:
    """None when ready for work, else why not (one sentence for ``/readyz``)."""
    if not registered:
        return "not registered with the controller yet"
    if draining:
        return "draining: taking no new work"
    limit = SILENT_INTERVALS * heartbeat_interval
    if last_answer is None or now - last_answer > limit:
        since = "ever" if last_answer is None else f"{now - last_answer:.0f}s"
        return (
            f"the controller has not answered for {since} (more than three heartbeat "
            f"intervals, {limit:g}s)"
        )
    return None


def tree_bytes(path: Path) -> int:
    """Bytes in the files under ``path`` (0 when it does not exist)."""
    return LINUX_STORE.tree_bytes(path)
