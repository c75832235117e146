"""``simulate(..., seed=N)`` replays a run exactly (the architecture issue).

One seed and one scenario give one run: the controller's event log, every
job's output and the harness's log are the same between two runs. The
scenario below has what used to make runs diverge: retries with jitter
(outages), fault ids (a failing verify script), re-registrations (session
tokens) and a crash (a new worker process, new instance id).
"""

from __future__ import annotations

from typing import Any

import pytest
import trio
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rc_worker.testing import fault_plans, plans
from rc_worker.testing.fleet import Fault, Fleet, simulate
from rc_worker.testing.plans import (
    CrashPlan,
    FleetPlan,
    JobPlan,
    PlanRun,
    parse_plan,
    replay,
    replay_line,
)
from rc_worker.testing.sim import Script

TRAIN = Script.printing((1, b"epoch 1\n"), (7, b"epoch 2\n"), (12, b"done\n"))


async def _busy_run(fleet: Fleet) -> dict[str, Any]:
    fleet.program("train", TRAIN)
    fleet.verify_script("check", Script.sleeping(0.5, exit_code=1))
    jobs = [fleet.submit(["train"]) for _ in range(4)]
    await trio.sleep(3)
    fleet.outage("output", Fault.UNAVAILABLE)
    fleet.inject("heartbeat", Fault.UNKNOWN_SESSION, Fault.TIMEOUT)
    await trio.sleep(20)
    await fleet.crash("h1")
    fleet.restore()
    await trio.sleep(5)
    fleet.restart("h1")
    await fleet.settle()
    await fleet.drain()
    events = [(e.seq, e.type, round(e.time, 6), sorted(e.data.items())) for e in fleet.events()]
    return {
        "events": events,
        "outputs": {j: fleet.store.output(j) for j in jobs},
        "log": fleet.log,
        "problems": fleet.check(),
    }


def test_the_same_seed_replays_the_same_run() -> None:
    first = simulate(_busy_run, seed=7, hosts=2, devices=("gpu0", "gpu1"))
    second = simulate(_busy_run, seed=7, hosts=2, devices=("gpu0", "gpu1"))
    assert first["problems"] == []
    assert any(t == "device_quarantined" for _, t, _, _ in first["events"])  # fault ids drawn
    assert first["events"] == second["events"]
    assert first["outputs"] == second["outputs"]
    assert first["log"] == second["log"]


# -- a printed plan replays: what a failing example prints is what to paste back ----------


@settings(max_examples=3, deadline=None, suppress_health_check=list(HealthCheck), database=None)
@given(plan=fault_plans(hosts=2, devices=2, max_jobs=3), seed=st.integers(0, 2**32 - 1))
def test_a_printed_plan_and_seed_replay_the_same_run(plan: FleetPlan, seed: int) -> None:
    line = replay_line(plan, seed)
    assert line.startswith("replay(FleetPlan(")
    assert line.endswith(f", seed={seed})")
    assert parse_plan(repr(plan)) == plan
    first = replay(plan, seed)
    # The printed line, evaluated as a user pastes it after `from ... import *`.
    names = {name: getattr(plans, name) for name in plans.__all__}
    again = eval(line, names)
    assert isinstance(again, PlanRun)
    assert again == first  # the same violations, the same story, byte for byte


def test_a_malformed_plan_is_one_clear_error() -> None:
    with pytest.raises(ValueError, match="not a FleetPlan"):
        parse_plan("JobPlan(at=1.0, script=Script(()))")


def test_fleet_run_plan_is_play() -> None:
    plan = FleetPlan(jobs=(JobPlan(1.0, TRAIN),), crashes=(CrashPlan(3.0, "h0", 5.0, "kill"),))

    async def scenario(fleet: Fleet) -> list[str]:
        problems = await fleet.run_plan(plan)
        assert [j.state for j in fleet.jobs()] in (["lost"], ["succeeded"])
        return problems

    assert simulate(scenario, seed=1, **plan.fleet_args()) == []
    assert replay(plan, seed=1).problems == []
