"""The retry schedule: capped exponential backoff with full jitter, Retry-After as a floor."""

from __future__ import annotations

import itertools
import random

from hypothesis import given
from hypothesis import strategies as st

from rc_worker.client import parse_retry_after
from rc_worker.core.retry import Backoff, RetryLog, is_transient_status


@given(seed=st.integers(), tries=st.integers(min_value=1, max_value=60))
def test_delays_stay_within_the_growing_ceiling_and_the_cap(seed: int, tries: int) -> None:
    backoff = Backoff(base=0.2, cap=30.0, rng=random.Random(seed))
    for n in range(tries):
        delay = backoff.next_delay()
        assert 0 <= delay <= min(30.0, 0.2 * 2**n)


@given(seed=st.integers(), retry_after=st.floats(min_value=0, max_value=1000))
def test_retry_after_is_a_floor_up_to_its_cap(seed: int, retry_after: float) -> None:
    backoff = Backoff(rng=random.Random(seed), retry_after_cap=300.0)
    assert backoff.next_delay(retry_after) >= min(retry_after, 300.0)


def test_jitter_spreads_a_fleet_out() -> None:
    delays = {round(Backoff(rng=random.Random(i), attempts=5).next_delay(), 3) for i in range(50)}
    assert len(delays) > 40


def test_transient_statuses() -> None:
    assert all(is_transient_status(s) for s in (408, 429, 500, 502, 503, 504))
    assert not any(is_transient_status(s) for s in (400, 401, 403, 404, 409, 422))


def test_parse_retry_after_seconds_and_dates() -> None:
    assert parse_retry_after("7") == 7.0
    assert parse_retry_after(None) is None
    assert parse_retry_after("soon") is None
    assert parse_retry_after("Wed, 21 Oct 2015 07:28:10 GMT", now=1445412480.0) == 10.0


@given(st.lists(st.floats(min_value=0, max_value=10), min_size=1, max_size=200))
def test_a_failing_endpoint_logs_at_most_once_a_minute(gaps: list[float]) -> None:
    retry_log = RetryLog(every=60.0)
    now, logged = 0.0, []
    for gap in gaps:
        now += gap
        if retry_log.failed(now):
            logged.append(now)
    assert logged[0] == gaps[0]  # the first failure always
    assert all(b - a >= 60.0 for a, b in itertools.pairwise(logged))
    assert len(logged) <= 1 + (now - gaps[0]) // 60.0
    assert retry_log.succeeded(now + 1) == (len(gaps), now + 1 - gaps[0])
    assert retry_log.succeeded(now + 2) is None  # recovery is said once
