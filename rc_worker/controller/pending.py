"""Why is a queued job still waiting? (``pending_reason`` in a job's JSON.)

Sans-IO and pure: :func:`explain` takes the job's selector and pin and a
snapshot of every device the controller knows (:class:`Candidate`), and says
why none of them is running the job. The store calls it whenever it hands out
a queued job's view, so the reason is always that of the current state, never
a stale one recorded at some earlier event.

Codes (``pending_code``), most permanent first:

``no_match``
    No registered device satisfies the selector (or the pinned device does
    not): the job can never run until the labels change. ``rc submit --strict``
    refuses such a job; ``rc submit`` warns.
``device_absent``
    The pinned device was not in its host's latest registration.
``host_lost``
    The pinned device's host stopped heartbeating (for an unpinned job: every
    matching device is on a lost host, or otherwise unavailable).
``device_quarantined`` / ``device_held`` / ``device_draining``
    The pinned device holds a fault, or its idle behaviour is ``hold`` or ``drain``.
``busy``
    Every matching device runs (or was offered) another job.
``unavailable``
    Every matching device is unavailable, for a mix of the reasons above.
``waiting_for_worker``
    A matching device is free: its worker has not asked for work yet (it may
    still be sweeping or verifying after the last job), or an older queued job
    takes it first.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Final

import attrs

from rc_worker.core.selectors import Selector, Term

__all__ = ["Candidate", "Pending", "explain", "waiting_reason"]

MAX_LISTED: Final = 3
MAX_COUNTED: Final = 100
"""Free devices counted in a ``waiting_for_worker`` reason: past it the reason says "more
than", so the controller can stop looking (a submit's answer carries the reason)."""
"""Devices named in one reason; the rest are counted, so a reason stays one short line."""


@attrs.frozen
class Candidate:
    """What :func:`explain` needs to know about one device."""

    address: str
    labels: Mapping[str, str] = attrs.field(hash=False)
    present: bool = True
    host_lost: bool = False
    fault: str | None = None
    """The first uncleared fault, as ``kind: detail`` (None when there is none)."""
    idle_behavior: str = "run"
    job_id: str | None = None
    """The job holding it (offered or running), if any."""
    worker_state: str | None = None


@attrs.frozen
class Pending:
    code: str
    reason: str


def _why_unavailable(c: Candidate) -> tuple[str, str] | None:
    """(code, short phrase) for a device that cannot take a job now; None when it could."""
    if not c.present:
        return "device_absent", "absent from its host's latest registration"
    if c.host_lost:
        return "host_lost", "on a lost host (no heartbeat)"
    if c.fault is not None:
        return "device_quarantined", f"quarantined ({c.fault}; rc clear {c.address})"
    if c.idle_behavior == "hold":
        return "device_held", f"held (rc idle {c.address} run)"
    if c.idle_behavior == "drain":
        return "device_draining", f"draining (rc idle {c.address} run)"
    if c.job_id is not None:
        return "busy", f"busy with {c.job_id}"
    return None


def _no_match(selector: Selector, labels: Sequence[Mapping[str, str]]) -> str:
    """Name the first selector term at which the registered devices run out."""
    if not labels:
        return "no device is registered"
    left = list(labels)
    for i, term in enumerate(selector.terms):
        kept = [lab for lab in left if term.matches(lab)]
        if kept:
            left = kept
            continue
        if i == 0 or not any(term.matches(lab) for lab in labels):
            return f"no registered device satisfies {str(term)!r}"
        before = ",".join(str(t) for t in selector.terms[:i])
        return f"no registered device that satisfies {before!r} also satisfies {str(term)!r}"
    raise AssertionError("some device satisfies every term")  # pragma: no cover


def _listing(items: Sequence[str]) -> str:
    shown = ", ".join(items[:MAX_LISTED])
    more = len(items) - MAX_LISTED
    return shown if more <= 0 else f"{shown} and {more} more"


def explain(selector: Selector, pinned: str | None, devices: Iterable[Candidate]) -> Pending:
    """Why a queued job with this ``selector`` (and ``pinned`` address) is not running."""
    known = list(devices)
    if pinned is not None:
        c = next((c for c in known if c.address == pinned), None)
        if c is None:
            return Pending("device_absent", f"the pinned device {pinned} is not registered")
        why = _why_unavailable(c)
        if why is not None and why[0] in ("device_absent", "host_lost"):
            return Pending(why[0], f"the pinned device {pinned} is {why[1]}")
        if not selector.matches(c.labels):
            term = _first_failing(selector, c.labels)
            return Pending("no_match", f"the pinned device {pinned} does not satisfy {str(term)!r}")
        if why is not None:
            return Pending(why[0], f"the pinned device {pinned} is {why[1]}")
        return Pending("waiting_for_worker", _waiting([c]))
    present = [c for c in known if c.present]
    matching = [c for c in present if selector.matches(c.labels)]
    if not matching:
        return Pending("no_match", _no_match(selector, [c.labels for c in present]))
    whys = [(c, _why_unavailable(c)) for c in matching]
    free = [c for c, why in whys if why is None]
    if free:
        return Pending("waiting_for_worker", _waiting(free))
    codes = {why[0] for _, why in whys if why is not None}
    if codes == {"busy"}:
        jobs = [f"{c.address} ({c.job_id})" for c in matching]
        return Pending("busy", f"every matching device is busy: {_listing(jobs)}")
    code = next(iter(codes)) if len(codes) == 1 else "unavailable"
    phrases = [f"{c.address} {why[1]}" for c, why in whys if why is not None]
    return Pending(code, f"no matching device is available: {_listing(phrases)}")


def _first_failing(selector: Selector, labels: Mapping[str, str]) -> Term:
    return next(t for t in selector.terms if not t.matches(labels))


def _waiting(free: Sequence[Candidate]) -> str:
    return waiting_reason(free[0], len(free))


def waiting_reason(c: Candidate, free: int) -> str:
    """The ``waiting_for_worker`` reason: ``c`` is the first of ``free`` free devices."""
    state = f" (worker: {c.worker_state})" if c.worker_state not in (None, "free") else ""
    others = f" (and {free - 1} more)" if free > 1 else ""
    if free - 1 > MAX_COUNTED:
        others = f" (and more than {MAX_COUNTED} more)"
    return (
        f"{c.address}{others} is free; waiting for its worker to ask for work{state}, "
        "or for older jobs to take it first"
    )
