"""Disk faults as fault plans: a full disk, a vanished job directory, a torn write at a
crash (``DiskPlan``), played by ``Fleet.run_plan`` and replayed exactly by seed."""

from __future__ import annotations

import attrs
import pytest
import trio
from hypothesis import given, note, settings
from hypothesis import strategies as st

from rc_worker.testing import fault_plans
from rc_worker.testing.fleet import Fault, Fleet, simulate
from rc_worker.testing.plans import (
    DISK_FAULTS,
    DiskPlan,
    FleetPlan,
    JobPlan,
    PlanRun,
    disk_fault,
    play,
    replay,
    replay_line,
)
from rc_worker.testing.sim import Script

TIME_LIMIT = 4 * 3600.0
TRAIN = Script.printing((1, b"epoch 1\n"), (10, b"epoch 2\n"), (20, b"done\n"))
JOBS = (JobPlan(0.0, TRAIN), JobPlan(0.5, TRAIN), JobPlan(30.0, TRAIN))


def _plan(how: str, at: float = 12.0) -> FleetPlan:
    return FleetPlan(hosts=1, devices=2, jobs=JOBS, disks=(DiskPlan(at, 20.0, "h0", how),))


def test_a_vanished_job_directory_costs_only_what_was_not_yet_sent() -> None:
    async def scenario(fleet: Fleet) -> tuple[list[str], dict[str, bytes], set[str]]:
        problems = await play(fleet, _plan("vanish"))
        outputs = {j.job_id: fleet.store.output(j.job_id) for j in fleet.jobs()}
        return problems, outputs, fleet.nodes["h0"].vanished

    problems, outputs, vanished = simulate(scenario, seed=3, **_plan("vanish").fleet_args())
    assert problems == []
    assert len(vanished) == 1  # one of the two running jobs lost its directory
    [job] = vanished
    assert b"epoch 1\nepoch 2\ndone\n".startswith(outputs[job])
    assert outputs[job] != b"epoch 1\nepoch 2\ndone\n"  # its last lines went with it
    others = [out for j, out in outputs.items() if j != job]
    assert others == [b"epoch 1\nepoch 2\ndone\n"] * 2  # the rest untouched


def test_the_check_still_sees_lost_output_of_a_job_whose_directory_did_not_vanish() -> None:
    """The allowance is for the vanished job only: forget which one it was, and the
    same run is a violation."""

    async def scenario(fleet: Fleet) -> list[str]:
        await play(fleet, _plan("vanish"))
        fleet.nodes["h0"].vanished.clear()
        return fleet.check()

    problems = simulate(scenario, seed=3, **_plan("vanish").fleet_args())
    assert len(problems) == 1
    assert "committed output is not what the worker read" in problems[0]


def test_a_torn_write_at_a_crash_keeps_every_promise() -> None:
    played = replay(_plan("torn"), seed=4, time_limit=TIME_LIMIT)
    assert played.problems == []
    assert "power loss, torn writes" in played.story
    # The two jobs running at the power loss are lost, the one submitted after runs.
    states = sorted(line.split(": ")[1].split()[0] for line in played.story.splitlines()[-3:])
    assert states == ["lost", "lost", "succeeded"]


def test_a_full_disk_plan_is_repaired_after_its_duration() -> None:
    played = replay(_plan("full", at=5.0), seed=5, time_limit=TIME_LIMIT)
    assert played.problems == []
    assert "disk of h0: full" in played.story
    assert "disk of h0 repaired" in played.story


@pytest.mark.parametrize("how", DISK_FAULTS)
def test_a_disk_plan_replays_byte_for_byte(how: str) -> None:
    first = replay(_plan(how), seed=9, time_limit=TIME_LIMIT)
    assert replay(_plan(how), seed=9, time_limit=TIME_LIMIT) == first


def test_an_unknown_disk_fault_and_a_power_loss_under_a_running_worker_are_refused() -> None:
    async def scenario(fleet: Fleet) -> None:
        with pytest.raises(ValueError, match="expected one of full, vanish, torn"):
            disk_fault(fleet, "h0", "melted")
        with pytest.raises(RuntimeError, match="crash it first"):
            disk_fault(fleet, "h0", "torn")
        await fleet.drain()

    simulate(scenario, seed=1)


@settings(max_examples=15, deadline=None)
@given(data=st.data(), seed=st.integers(0, 2**32 - 1))
def test_every_disk_fault_keeps_the_invariants(data: st.DataObject, seed: int) -> None:
    plan = data.draw(fault_plans(max_jobs=4))
    disks = data.draw(
        st.lists(
            st.builds(
                DiskPlan,
                st.integers(0, 120).map(lambda n: n / 2),
                st.integers(2, 80).map(lambda n: n / 2),
                st.sampled_from([f"h{i}" for i in range(plan.hosts)]),
                st.sampled_from(DISK_FAULTS),
            ),
            min_size=1,
            max_size=3,
        )
    )
    plan = attrs.evolve(plan, disks=tuple(disks))
    note(replay_line(plan, seed))
    played: PlanRun = replay(plan, seed, time_limit=TIME_LIMIT)
    note(played.story)
    assert played.problems == []


def test_a_finish_whose_directory_vanished_before_it_was_sent_is_still_sent_whole() -> None:
    """Found by hypothesis with a vanish plan: the finish of a job that ended while
    its output could not be sent was on disk only, so once its directory vanished the
    worker sent an empty finish, the controller refused it for good (400), and the
    job never ended there. This process sends the finish it made from memory."""

    async def scenario(fleet: Fleet) -> tuple[str, int, list[str]]:
        fleet.program("train", Script.printing((1, b"a\n"), (10, b"b\n" * 300), (20, b"c\n")))
        job = fleet.submit(["train"])
        fleet.outage("output", Fault.TIMEOUT)  # the finish waits for the output
        await fleet.wait_until(lambda: bool(fleet.nodes["h0"].host.spawned(job)))
        node = fleet.nodes["h0"]
        await fleet.wait_until(lambda: node.host.spawned(job)[0].ended_at is not None)
        await trio.sleep(5)  # its finish is written
        disk_fault(fleet, "h0", "vanish")
        await trio.sleep(30)
        fleet.restore()
        await fleet.settle()
        await fleet.drain()
        finishes = [e for e in node.transport.exchanges("finish") if e.status is not None]
        return fleet.store.job(job).state, len(finishes), fleet.check()

    state, finishes, problems = simulate(scenario, hosts=1, devices=("gpu0",), seed=5)
    assert state == "succeeded"
    assert finishes == 1
    assert problems == []


def test_output_not_yet_sent_at_a_power_loss_may_be_lost_and_only_then() -> None:
    """Found by hypothesis: a job ended while its output could not be sent, then the host
    lost power. Its finish was durable, its output (the spool is never fsynced) was not,
    so the finish went out with less output than the job wrote. The check allows that,
    a prefix of what the worker read, for a job whose host lost power before its finish
    was in; the same run with the power loss forgotten is a violation."""

    async def scenario(fleet: Fleet) -> tuple[bytes, list[str], list[str]]:
        fleet.program("job", Script.printing((0, b"x" * 10)))
        job = fleet.submit(["job"])
        fleet.outage("output", Fault.TIMEOUT)
        node = fleet.nodes["h0"]
        await fleet.wait_until(lambda: bool(node.host.spawned(job)))
        await trio.sleep(20)  # ended; its finish durable, its output not sent
        await fleet.crash("h0")
        disk_fault(fleet, "h0", "torn")
        fleet.restore()
        fleet.restart("h0")
        await fleet.settle()
        await fleet.drain()
        allowed = fleet.check()
        node.power_losses.clear()
        return fleet.store.output(job), allowed, fleet.check()

    output, allowed, forgotten = simulate(scenario, hosts=1, devices=("gpu0",), seed=2)
    assert output != b"x" * 10
    assert (b"x" * 10).startswith(output)
    assert allowed == []
    assert len(forgotten) == 1
    assert "committed output is not what the worker read" in forgotten[0]
