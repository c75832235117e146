"""A simulation runs with Python's cyclic collector paused, and bounded (testing/gcpause.py)."""

from __future__ import annotations

import gc
import weakref

import pytest
from trio.testing import MockClock

from rc_worker.testing import gcpause
from rc_worker.testing.fleet import Fleet, simulate
from rc_worker.testing.guard import WALL_CHECK_STEPS, StallGuard


class _Cycle:
    def __init__(self) -> None:
        self.me = self


def test_the_collector_is_paused_for_the_block_and_runs_again_after() -> None:
    assert gc.isenabled()
    with gcpause.collector_paused():
        assert not gc.isenabled()
    assert gc.isenabled()
    with pytest.raises(RuntimeError, match="boom"), gcpause.collector_paused():
        raise RuntimeError("boom")
    assert gc.isenabled()


def test_a_collector_the_caller_paused_stays_paused() -> None:
    gc.disable()
    try:
        with gcpause.collector_paused():
            assert not gc.isenabled()
        assert not gc.isenabled()
    finally:
        gc.enable()


def test_past_the_limit_the_young_generations_are_collected(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    with gcpause.collector_paused():
        gc.collect()
        monkeypatch.setattr(gcpause, "YOUNG_LIMIT", 1000)
        garbage = _Cycle()
        gone = weakref.ref(garbage)
        del garbage
        gcpause.keep_bounded()
        assert gone() is not None  # under the limit: nothing collected
        for _ in range(1000):
            _Cycle()  # cycles: only the collector frees them
        gcpause.keep_bounded()
        assert gone() is None


def test_a_simulation_runs_with_the_collector_paused() -> None:
    async def scenario(fleet: Fleet) -> bool:
        return gc.isenabled()

    assert simulate(scenario, seed=1, hosts=1, devices=("gpu0",)) is False
    assert gc.isenabled()


def test_the_stall_guard_keeps_it_bounded_every_so_many_steps() -> None:
    calls: list[int] = []
    guard = StallGuard(10**9, None, MockClock(), every=lambda: calls.append(guard.steps))
    for _ in range(3 * WALL_CHECK_STEPS):
        guard.before_task_step(None)  # type: ignore[arg-type]
    assert len(calls) == 3
