"""The retry schedule for controller requests (sans-IO).

Capped exponential backoff with full jitter (the AWS architecture blog's
"full jitter": sleep uniformly in [0, min(cap, base * 2**n)]), so a fleet of
workers that lost their controller at the same moment do not come back in
lock-step. A server's ``Retry-After`` is a floor, never ignored.
"""

from __future__ import annotations

import email.utils
import random
import time

import attrs

TRANSIENT_STATUSES = frozenset({408, 429})


def is_transient_status(status: int) -> bool:
    """Whether a response status means "try again" rather than "no"."""
    return status in TRANSIENT_STATUSES or status >= 500


def parse_retry_after(value: str | None, *, now: float | None = None) -> float | None:
    """Seconds to wait from a ``Retry-After`` header (delta-seconds or an HTTP date)."""
    if value is None:
        return None
    value = value.strip()
    if value.isdigit():
        return float(value)
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    # A reported timestamp, not a timeout: the only place wall time is read.
    now = time.time() if now is None else now
    return max(0.0, when.timestamp() - now)


@attrs.define
class Backoff:
    """One request's retry schedule; ``next_delay`` gives each wait in turn."""

    base: float = 0.2
    cap: float = 30.0
    retry_after_cap: float = 300.0
    rng: random.Random = attrs.field(factory=random.Random)
    attempts: int = 0

    def next_delay(self, retry_after: float | None = None) -> float:
        ceiling = min(self.cap, self.base * 2 ** min(self.attempts, 30))
        self.attempts += 1
        delay = self.rng.uniform(0, ceiling)
        if retry_after is not None:
            delay = max(delay, min(retry_after, self.retry_after_cap))
        return delay
