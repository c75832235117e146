"""4 hosts x 4 devices under 200 random fault plans, each checked against the invariants.

    python examples/simulate_fleet.py [PLANS]

Virtual time: each plan is minutes of a fleet's life, played in a fraction of a
second. A failure prints the line that replays it exactly (the plan and its seed):
paste it after ``from rc_worker.testing.plans import *``.
"""

from __future__ import annotations

import logging
import sys

from hypothesis import HealthCheck, given, note, settings
from hypothesis import strategies as st

from rc_worker.testing import FleetPlan, fault_plans, replay
from rc_worker.testing.plans import replay_line

PLANS = int(sys.argv[1]) if len(sys.argv) > 1 else 200


@settings(max_examples=PLANS, deadline=None, database=None, suppress_health_check=list(HealthCheck))
@given(plan=fault_plans(hosts=4, devices=4), seed=st.integers(0, 2**32 - 1))
def check_plan(plan: FleetPlan, seed: int) -> None:
    note(replay_line(plan, seed))
    run = replay(plan, seed)
    note(run.story)
    assert run.problems == [], run.problems


if __name__ == "__main__":
    logging.disable(logging.CRITICAL)  # the workers' own warnings: faults are the point here
    check_plan()
    print(f"{PLANS} fault plans on 4 hosts x 4 devices: every invariant held")
