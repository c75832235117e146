"""The retry schedule for controller requests (sans-IO).

Capped exponential backoff with full jitter (the AWS architecture blog's
"full jitter": sleep uniformly in [0, min(cap, base * 2**n)]), so a fleet of
workers that lost their controller at the same moment do not come back in
lock-step. A server's ``Retry-After`` is a floor, never ignored.

Pure: the caller gives the time and the random source (``client.py``).
"""

from __future__ import annotations

import email.utils
from typing import Protocol

import attrs

TRANSIENT_STATUSES = frozenset({408, 429})


def is_transient_status(status: int) -> bool:
    """Whether a response status means "try again" rather than "no"."""
    return status in TRANSIENT_STATUSES or status >= 500


class Uniform(Protocol):
    """A random source (``random.Random``): the jitter is drawn from it."""

    def uniform(self, a: float, b: float) -> float: ...


def retry_after_seconds(value: str | None, *, now: float) -> float | None:
    """Seconds to wait from a ``Retry-After`` header (delta-seconds or an HTTP date);
    ``now`` is the wall-clock time, which an HTTP date is measured against."""
    if value is None:
        return None
    value = value.strip()
    if value.isdigit():
        return float(value)
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    return max(0.0, when.timestamp() - now)


@attrs.define
class Backoff:
    """One request's retry schedule; ``next_delay`` gives each wait in turn."""

    base: float = 0.2
    cap: float = 30.0
    retry_after_cap: float = 300.0
    rng: Uniform = attrs.field(kw_only=True)
    attempts: int = 0

    def next_delay(self, retry_after: float | None = None) -> float:
        ceiling = min(self.cap, self.base * 2 ** min(self.attempts, 30))
        self.attempts += 1
        delay = self.rng.uniform(0, ceiling)
        if retry_after is not None:
            delay = max(delay, min(retry_after, self.retry_after_cap))
        return delay


# How often an endpoint that keeps failing is logged again.
RETRY_LOG_EVERY_S = 60.0


@attrs.define
class RetryLog:
    """When to log retries of one failing endpoint (sans-IO; the caller gives the time).

    Once at WARNING when failures start, then at most once every
    ``every`` seconds while they go on, then once at INFO when it answers
    again: an outage is three lines a minute at most, not one per try.
    """

    every: float = RETRY_LOG_EVERY_S
    failing_since: float | None = None
    failures: int = 0
    _last_logged: float = 0.0

    def failed(self, now: float) -> bool:
        """Record a failed try; True when this one should be logged."""
        self.failures += 1
        if self.failing_since is None:
            self.failing_since = now
            self._last_logged = now
            return True
        if now - self._last_logged >= self.every:
            self._last_logged = now
            return True
        return False

    def succeeded(self, now: float) -> tuple[int, float] | None:
        """Record a success; ``(failures, seconds failing)`` when it ends an outage."""
        if self.failing_since is None:
            return None
        outage = (self.failures, now - self.failing_since)
        self.failing_since = None
        self.failures = 0
        return outage
