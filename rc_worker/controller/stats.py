"""The controller's own counters and histograms, kept sans-IO for ``GET /metrics``.

The store, the commit path, the long-poll handler and the webhook sender each
count what they do here (plain numbers, no Prometheus import), and
:mod:`rc_worker.controller.metrics` exports them at scrape time. One instance per
store (``Store.stats``), so two controllers in one process never share them.
"""

from __future__ import annotations

import bisect
from collections import Counter

__all__ = ["LATENCY_BUCKETS", "REGISTRATION_OUTCOMES", "WEBHOOK_RESULTS", "Histogram", "Stats"]

LATENCY_BUCKETS = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
    300.0,
    1800.0,
    3600.0,
)
"""Seconds: from a millisecond (a commit, a dispatch to a parked poll) to an hour (a queue)."""

REGISTRATION_OUTCOMES = ("registered", "recovered", "refused")
"""The seed's boot outcomes: a clean start, a start that carried jobs or faults over, and a
registration the controller refused."""

WEBHOOK_RESULTS = ("delivered", "retried", "refused", "failed")
"""Per POST attempt: accepted, failed and tried again, refused by the receiver (4xx: skipped),
failed for the last time (given up)."""


class Histogram:
    """Cumulative-bucket histogram, as Prometheus wants it."""

    def __init__(self, buckets: tuple[float, ...] = LATENCY_BUCKETS) -> None:
        self.buckets = buckets
        self.counts = [0] * len(buckets)  # per bucket, not cumulative
        self.count = 0
        self.sum = 0.0

    def observe(self, value: float) -> None:
        value = max(value, 0.0)
        i = bisect.bisect_left(self.buckets, value)
        if i < len(self.counts):
            self.counts[i] += 1
        self.count += 1
        self.sum += value

    def cumulative(self) -> list[tuple[str, int]]:
        """``[(upper bound, count at or below it), …, ("+Inf", count)]``."""
        out = []
        running = 0
        for bound, n in zip(self.buckets, self.counts, strict=True):
            running += n
            out.append((repr(float(bound)), running))
        out.append(("+Inf", self.count))
        return out


class Stats:
    """Everything the controller counts about itself."""

    def __init__(self) -> None:
        self.registrations: Counter[str] = Counter()
        self.dispatch_latency = Histogram()
        """Seconds from a job's submission to its (first) start."""
        self.queue_wait = Histogram()
        """Seconds a job waited in the queue each time it was queued, until it was offered."""
        self.commit_latency = Histogram()
        """Seconds one group commit took to write (persisted stores only)."""
        self.webhook_deliveries: Counter[str] = Counter()
        self.jobs_finished: Counter[str] = Counter()
        """Jobs that reached a terminal state since the controller started, by outcome."""
        self.faults_cleared: Counter[str] = Counter()
        """Device faults lifted (an operator's clear, a reboot, a device gone), by kind."""
        self.polls_parked = 0
        """Long polls waiting now."""
