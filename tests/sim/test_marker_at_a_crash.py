"""A worker killed after the disk refused a job's output loses the marker with it.

Found by hypothesis (``fault_plans()``): the disk was full when the job wrote its last
byte, so its spooling stopped and the disk-error marker was held in memory to send
last (spool.py); the worker was killed a second later, before the marker went out,
and its successor sent what the spool held: a prefix of what the job wrote, with no
marker. The output check now allows that, and only with both the full disk and the crash.
"""

from __future__ import annotations

import pytest

from rc_worker.testing.fleet import Fleet, simulate
from rc_worker.testing.plans import CrashPlan, DiskPlan, FleetPlan, JobPlan, play, replay
from rc_worker.testing.sim import Script, Sleep, Write

BYTE = Write(b"\x00")
FOUND = FleetPlan(
    hosts=1,
    devices=1,
    jobs=(
        JobPlan(0.0, Script(steps=(), exit_code=0), {"grace_s": 0.0}),
        JobPlan(0.0, Script(steps=(), exit_code=0), {"grace_s": 0.0}),
        JobPlan(
            46.5,
            Script(
                steps=(BYTE, Sleep(9.5), BYTE, Sleep(13.0), BYTE, Sleep(14.0), BYTE),
                exit_code=0,
            ),
            {"grace_s": 0.0},
        ),
    ),
    crashes=(CrashPlan(10.5, "h0", 28.0, "rereg"), CrashPlan(10.5, "h0", 0.0, "kill")),
    disks=(DiskPlan(82.5, 1.0, "h0", "full"),),
)


def test_the_plan_hypothesis_found_keeps_the_invariants() -> None:
    played = replay(FOUND, 0)
    assert "disk of h0: full" in played.story
    assert played.problems == []


@pytest.mark.parametrize("forget", ["full_disk", "crashes"])
def test_the_check_allows_the_missing_marker_only_with_the_full_disk_and_the_crash(
    forget: str,
) -> None:
    async def scenario(fleet: Fleet) -> list[str]:
        await play(fleet, FOUND)
        getattr(fleet.nodes["h0"], forget).clear()
        return fleet.check()

    problems = simulate(scenario, seed=0, **FOUND.fleet_args())
    assert any("j-3-sim: committed output is not what the worker read" in p for p in problems)
