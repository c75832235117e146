"""A finish held in memory only (its directory vanished) survives a stop of the worker.

Found by hypothesis: a job's directory vanished while it ran, so its finish could not be
written and was held in memory to send; the worker was then stopped (two signals)
while the controller's finish endpoint was down, said the report stayed on disk, and
the job ended ``lost`` though its worker never crashed. The worker now writes the
directory again, journal and finish, so the next start reports and delivers it.
"""

from __future__ import annotations

import logging

import attrs
import pytest

from rc_worker.testing.fleet import Fault, Fleet, simulate
from rc_worker.testing.plans import (
    CrashPlan,
    DiskPlan,
    FleetPlan,
    IdlePlan,
    JobPlan,
    OutagePlan,
    PlanRun,
    play,
    replay,
)
from rc_worker.testing.sim import Script, Sleep, Write

# One byte at 2 s, then it exits 0 at 10 s; its directory vanishes at 5 s (for good),
# the finish endpoint is down from 1 s to 20 s, and the worker is stopped at 15 s,
# while the finish, sent from memory, is still being retried.
JOB = Script(steps=(Sleep(2.0), Write(b"x"), Sleep(8.0)), exit_code=0)
PLAN = FleetPlan(
    hosts=1,
    devices=1,
    jobs=(JobPlan(0.0, JOB),),
    outages=(OutagePlan(1.0, 19.0, "finish", Fault.UNAVAILABLE, None),),
    crashes=(CrashPlan(15.0, "h0", 0.0, "stop"),),
    disks=(DiskPlan(5.0, 1.0, "h0", "vanish"),),
)

# The plan hypothesis printed, replayed as it was found.
FOUND = FleetPlan(
    hosts=1,
    devices=1,
    jobs=(
        JobPlan(0.0, Script(steps=(), exit_code=0), {"grace_s": 0.0}),
        JobPlan(0.0, Script(steps=(), exit_code=0), {"grace_s": 0.0}),
        JobPlan(
            7.0,
            Script(
                steps=(
                    Sleep(2.0),
                    Write(b"\x00"),
                    Sleep(8.5),
                    Write(b"\x00"),
                    Sleep(13.5),
                    Write(b"\x00"),
                    Sleep(18.5),
                ),
                exit_code=0,
            ),
            {"grace_s": 0.0},
        ),
    ),
    outages=(OutagePlan(67.5, 2.5, "finish", Fault.UNAVAILABLE, None),),
    crashes=(CrashPlan(67.5, "h0", 0.0, "stop"),),
    idles=(IdlePlan(6.0, 14.5, "h0", "gpu0", "hold"),),
    disks=(DiskPlan(25.5, 1.0, "h0", "vanish"),),
)


def _outcome(played: PlanRun, job: str) -> str:
    [line] = [s for s in played.story.splitlines() if s.startswith(f"{job}:")]
    return line


def test_a_finish_whose_directory_vanished_survives_a_stop_before_it_is_taken() -> None:
    played = replay(PLAN, 0)
    assert "the directory of j-1-sim.1 vanished" in played.story
    assert "stop h0" in played.story
    assert played.problems == []
    assert _outcome(played, "j-1-sim").startswith("j-1-sim: succeeded on h0/gpu0 exit 0")


def test_the_plan_hypothesis_found_replays_without_a_lost_job() -> None:
    played = replay(FOUND, 0)
    assert "the directory of j-3-sim.1 vanished" in played.story
    assert played.problems == []
    assert _outcome(played, "j-3-sim").startswith("j-3-sim: succeeded on h0/gpu0 exit 0")


def test_a_finish_whose_directory_vanished_after_it_was_written_survives_a_stop() -> None:
    """The finish was on disk, then its directory vanished while the controller was
    down: the stop writes it back rather than say it stays on disk."""
    plan = attrs.evolve(PLAN, disks=(DiskPlan(12.0, 1.0, "h0", "vanish"),))
    played = replay(plan, 0)
    assert "the directory of j-1-sim.1 vanished" in played.story
    assert played.problems == []
    assert _outcome(played, "j-1-sim").startswith("j-1-sim: succeeded on h0/gpu0 exit 0")


def test_a_directory_written_again_does_not_hide_that_its_output_is_gone() -> None:
    """The output endpoint is down until after the job's finish wrote its directory
    again: the shipper must still see the spool is gone (no empty output file made
    for it), or it would resend into an empty file for ever and never send the finish."""
    plan = attrs.evolve(
        PLAN, outages=(OutagePlan(1.0, 29.0, "output", Fault.UNAVAILABLE, None),), crashes=()
    )
    played = replay(plan, 0)
    assert "the directory of j-1-sim.1 vanished" in played.story
    assert played.problems == []
    assert _outcome(played, "j-1-sim").startswith("j-1-sim: succeeded on h0/gpu0 exit 0")


# Its directory vanishes, then the disk is full from before the job ends until after
# the stop: the finish can be written neither when the job ends nor at the stop.
UNWRITABLE = attrs.evolve(
    PLAN, disks=(DiskPlan(5.0, 1.0, "h0", "vanish"), DiskPlan(9.0, 20.0, "h0", "full"))
)


def test_a_finish_the_disk_still_refuses_at_a_stop_is_said_to_be_lost(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, logger="rc_worker.worker")
    played = replay(UNWRITABLE, 0)
    [stopping] = [r.getMessage() for r in caplog.records if r.getMessage().startswith("stopping")]
    assert "1 of them the disk would not take and are lost (j-1-sim.1)" in stopping
    assert _outcome(played, "j-1-sim").startswith("j-1-sim: lost on h0/gpu0")
    # The one case a job that exited 0 on its own may end lost (invariants.py).
    assert played.problems == []


def test_a_finish_a_full_disk_refused_through_a_stop_is_lost_and_allowed_so() -> None:
    # No vanished directory: the disk, full from before the job's end until after the
    # stop, refused the finish then and at the stop; the finish endpoint refused it too.
    played = replay(attrs.evolve(PLAN, disks=(DiskPlan(9.0, 20.0, "h0", "full"),)), 0)
    assert _outcome(played, "j-1-sim").startswith("j-1-sim: lost on h0/gpu0")
    assert played.problems == []


@pytest.mark.parametrize("forget", ["full_disk", "stops"])
def test_the_check_allows_that_loss_only_with_a_full_disk_at_a_stop(forget: str) -> None:
    """Forget the full disk or the stop, and the same run is a violation: a job that
    exited 0 must not end lost for either one alone (nor for a vanished directory,
    which the worker writes again)."""

    async def scenario(fleet: Fleet) -> list[str]:
        await play(fleet, UNWRITABLE)
        getattr(fleet.nodes["h0"], forget).clear()
        return fleet.check()

    problems = simulate(scenario, seed=0, **UNWRITABLE.fleet_args())
    assert any("j-1-sim: ended lost on h0" in p for p in problems)
    assert any("j-1-sim: exited 0 on its own but was reported lost" in p for p in problems)
