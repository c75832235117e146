"""The garbage-collector keeper: when it freezes, when it collects everything, and that a
whole collection finds the cycles a freeze hid."""

from __future__ import annotations

import gc
import weakref
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

import trio
from hypothesis import given
from hypothesis import strategies as st

from rc_worker.controller import rc_cli
from rc_worker.controller.gcpause import GcAction, GcPlan, keep_gc_pauses_short


def test_plan_freezes_until_the_whole_interval_then_collects_everything_once() -> None:
    plan = GcPlan(whole_interval_s=600.0, last_whole=1000.0)
    assert plan.decide(1001.0) is GcAction.FREEZE
    assert plan.decide(1599.9) is GcAction.FREEZE
    assert plan.decide(1600.0) is GcAction.WHOLE
    assert plan.last_whole == 1600.0
    assert plan.decide(1600.5) is GcAction.FREEZE
    assert plan.decide(2200.0) is GcAction.WHOLE


@given(
    interval=st.floats(min_value=1.0, max_value=1000.0),
    steps=st.lists(st.floats(min_value=0.0, max_value=300.0), max_size=200),
)
def test_plan_collects_everything_at_most_once_per_interval_and_never_waits_two(
    interval: float, steps: list[float]
) -> None:
    plan = GcPlan(whole_interval_s=interval, last_whole=0.0)
    now, last = 0.0, 0.0
    for step in steps:
        now += step
        if plan.decide(now) is GcAction.WHOLE:
            assert now - last >= interval
            last = now
        # Whatever the gaps between looks, a look a whole interval after the last whole
        # collection is one.
        assert now - last < interval


class Node:
    """A container that can sit in a reference cycle (and be weakly referenced)."""

    def __init__(self) -> None:
        self.other: Any = None


def cycle() -> tuple[list[Node], weakref.ref[Node]]:
    """Two nodes referring to each other, held by the list returned (empty it to drop them)."""
    a, b = Node(), Node()
    a.other, b.other = b, a
    return [a], weakref.ref(a)


@asynccontextmanager
async def keeper(**kw: float) -> AsyncIterator[None]:
    async with trio.open_nursery() as nursery:
        await nursery.start(lambda task_status: keep_gc_pauses_short(**kw, task_status=task_status))
        yield
        nursery.cancel_scope.cancel()


async def wait_for(condition: Callable[[], bool]) -> None:
    for _ in range(3000):  # 30 s at most
        if condition():
            return
        await trio.sleep(0.01)
    raise AssertionError("the keeper never got there")


async def test_the_keeper_freezes_survivors_and_unfreezes_when_it_stops() -> None:
    assert gc.get_freeze_count() == 0
    try:
        async with keeper(check_s=0.01, whole_interval_s=3600.0):
            assert gc.get_freeze_count() > 0  # what was loaded before serving
            held, ref = cycle()
            await wait_for(lambda: _frozen(ref))  # frozen by a later look...
            held.clear()  # ...and then garbage: no collection sees it...
            gc.collect()
            assert ref() is not None  # ...not even a full one, while it stays frozen
        assert gc.get_freeze_count() == 0
        gc.collect()
        assert ref() is None  # unfrozen when the keeper stopped: collected as usual
    finally:
        gc.unfreeze()


async def test_a_whole_collection_finds_the_cycles_a_freeze_hid() -> None:
    try:
        async with keeper(check_s=0.01, whole_interval_s=0.0):
            held, ref = cycle()
            gc.freeze()  # as a look of the keeper would, while the cycle was still in use
            held.clear()
            await wait_for(lambda: ref() is None)  # a whole collection, without anyone's help
    finally:
        gc.unfreeze()


async def test_rc_serve_runs_the_keeper() -> None:
    argv = ["--listen", "127.0.0.1:0", "--worker-token", "wt", "--user-token", "ut", "--memory"]
    try:
        async with trio.open_nursery() as nursery:
            await nursery.start(
                lambda task_status: rc_cli.run_serve(argv, env={}, task_status=task_status)
            )
            assert gc.get_freeze_count() > 0
            nursery.cancel_scope.cancel()
        assert gc.get_freeze_count() == 0
    finally:
        gc.unfreeze()


def _frozen(ref: weakref.ref[Node]) -> bool:
    """Whether the object is in the permanent generation (no generation lists it)."""
    obj = ref()
    return obj is not None and not any(o is obj for o in gc.get_objects())
