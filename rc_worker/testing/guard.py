"""Invariant 6, everything ends, for a simulation: a stall guard and a wall-clock limit.

Under an autojumping ``MockClock`` a livelock (a task that retries without ever
sleeping) stops virtual time, so no virtual deadline ever comes. :class:`StallGuard`
is a Trio instrument that counts task steps at one virtual instant, and watches
the real clock too, and cancels the run past either limit; :func:`~rc_worker.testing.fleet.simulate`
turns that into :class:`SimulationStalled` or :class:`SimulationTimedOut`.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable

import trio

__all__ = ["STALL_STEPS", "WALL_LIMIT", "SimulationStalled", "SimulationTimedOut", "StallGuard"]


class SimulationStalled(Exception):
    """Virtual time stopped while tasks kept running: a livelock, which never ends (invariant 6).

    ``trio.fail_after`` in virtual time cannot see one: the deadline never comes.
    """


WALL_LIMIT = 90.0
"""Real seconds a :func:`simulate` run may take (under the suite's 120 s per-test timeout)."""

STALL_STEPS = 200_000
"""Task steps at one virtual instant past which :func:`simulate` calls the run stalled."""


class SimulationTimedOut(Exception):
    """A simulation ran past its wall-clock limit (``simulate(wall_limit=...)``).

    Raised as an ordinary failure, before a per-test timeout would kill the
    process, so that hypothesis still prints the plan that caused it.
    """


WALL_CHECK_STEPS = 1000
"""Task steps between two looks at the wall clock."""


class StallGuard(trio.abc.Instrument):
    """Cancels ``scope`` past ``limit`` task steps at one virtual instant, or past
    ``wall_limit`` real seconds (looked at every ``WALL_CHECK_STEPS`` steps).

    ``clock``: the clock the run is given, if any (the run's time is read from it).
    ``every``: called at each look at the wall clock, for what else wants doing now and
    then (:mod:`~rc_worker.testing.gcpause`).
    """

    def __init__(
        self,
        limit: int,
        wall_limit: float | None = None,
        clock: trio.abc.Clock | None = None,
        every: Callable[[], None] | None = None,
    ) -> None:
        self.limit = limit
        self._every = every
        # The run's clock, read directly: this runs at every task step, and
        # trio.current_time() only finds its way to the same clock.
        self._now = trio.current_time if clock is None else clock.current_time
        self.at = -math.inf
        self.steps = 0
        self.scope: trio.CancelScope | None = None
        self.stalled_at: float | None = None
        self.wall_deadline = math.inf if wall_limit is None else time.monotonic() + wall_limit
        self.timed_out = False
        self._since_wall = 0

    def before_task_step(self, task: trio.lowlevel.Task) -> None:
        self._since_wall += 1
        if self._since_wall >= WALL_CHECK_STEPS:
            self._since_wall = 0
            if self._every is not None:
                self._every()
            if time.monotonic() > self.wall_deadline and not self.timed_out and self.scope:
                self.timed_out = True
                self.scope.cancel()
        now = self._now()
        if now != self.at:
            self.at, self.steps = now, 0
            return
        self.steps += 1
        if self.steps > self.limit and self.stalled_at is None and self.scope is not None:
            self.stalled_at = now
            self.scope.cancel()
