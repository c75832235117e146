"""Short garbage-collector pauses for a controller that holds a large fleet.

CPython's cyclic collector stops the whole process for a full (generation 2)
collection, for a time proportional to every container object alive. At 1,000
hosts x 8 devices with 100 jobs/s flowing, the controller holds 300,000-400,000
such objects (hosts, devices, label views and indexes, connections, recent jobs
and events); each full collection took 300-500 ms on the 2-core development VM,
came every 3-10 s under that load (objects that live a few milliseconds longer
than a young collection's period are promoted, and they trigger the next one),
and freed nothing: the fleet's records live as long as the fleet. Every request
arriving meanwhile waited for it, and those waits were the 99th percentile of
dispatch latency (``bench/bench_swarm.py``, docs/performance.md).

The remedy, as large Python services do (``gc.freeze``): every second, collect the
young generations and move what is left into the permanent generation, which
collections skip. A full collection then scans only what was promoted since the
last freeze, and its pause no longer grows with the fleet. Frozen objects are still
freed by reference counting as usual; only a reference cycle among them would go
unnoticed, so every :data:`WHOLE_INTERVAL_S` the keeper unfreezes and collects
everything once. That one pause is as long as before, but rare: at 100 jobs/s ten
minutes are 60,000 jobs, of which a half-second pause delays about 50. It bounds
what such cycles can hold; measured, a whole collection after 20 s at 100 jobs/s
freed 21 objects.

:class:`GcPlan` decides (pure); :func:`keep_gc_pauses_short` applies it.
"""

from __future__ import annotations

import enum
import gc
import logging
import time
from typing import Final

import attrs
import trio

__all__ = ["WHOLE_INTERVAL_S", "GcAction", "GcPlan", "keep_gc_pauses_short"]

log = logging.getLogger("rc_worker.controller.gcpause")

CHECK_S: Final = 1.0
"""How often the keeper freezes: a full collection then scans at most this long's worth of
promoted objects (a freeze itself only splices lists; the young collection before it is
the young generations' usual work)."""
WHOLE_INTERVAL_S: Final = 600.0
"""How often everything is unfrozen and collected once (one pause as long as before)."""


class GcAction(enum.Enum):
    FREEZE = "freeze"
    """Collect the young generations, then freeze what is left."""
    WHOLE = "whole"
    """Time for the rare whole collection: unfreeze, collect everything, freeze again."""


@attrs.define
class GcPlan:
    """When to freeze and when to collect everything; pure (the caller passes the clock)."""

    whole_interval_s: float
    last_whole: float
    """When everything was last collected (or the keeper started)."""

    def decide(self, now: float) -> GcAction:
        if now - self.last_whole >= self.whole_interval_s:
            self.last_whole = now
            return GcAction.WHOLE
        return GcAction.FREEZE


def apply(action: GcAction) -> None:
    if action is GcAction.FREEZE:
        # Young cycles (a request's) die in the young collection first, not in the freezer.
        gc.collect(1)
        gc.freeze()
    elif action is GcAction.WHOLE:
        started = time.perf_counter()
        gc.unfreeze()
        freed = gc.collect()
        gc.freeze()
        log.debug(
            "whole collection: %d objects freed, %d kept, %.0f ms",
            freed,
            gc.get_freeze_count(),
            (time.perf_counter() - started) * 1000,
        )


async def keep_gc_pauses_short(
    *,
    whole_interval_s: float = WHOLE_INTERVAL_S,
    check_s: float = CHECK_S,
    task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Freeze the survivors of each full collection; collect everything once every
    ``whole_interval_s``. Runs until cancelled, then unfreezes (the process's collector
    is left as it was found: tests run the controller in their own process)."""
    # What is loaded by now (the store, the app) lives as long as the controller.
    apply(GcAction.FREEZE)
    plan = GcPlan(whole_interval_s, time.monotonic())
    task_status.started()
    try:
        while True:
            await trio.sleep(check_s)
            apply(plan.decide(time.monotonic()))
    finally:
        gc.unfreeze()
