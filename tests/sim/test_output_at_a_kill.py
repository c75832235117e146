"""Output the worker took out of a job's pipe in the instant it was SIGKILLed.

The worker reads a chunk (a read(2) into its memory) and appends it to the job's
spool (a write(2)); a SIGKILL between the two loses that chunk with the process's
memory, and no worker built on read-then-write can prevent it. The output check
allows exactly that chunk (``SimPipe.lost_in_reader``) to be missing from the
committed output, and nothing else. A fault plan found the case first: its replay
is the last test here.
"""

from __future__ import annotations

import trio

from rc_worker.testing.fleet import Fleet, simulate
from rc_worker.testing.plans import (
    CrashPlan,
    FleetPlan,
    HooksPlan,
    IdlePlan,
    JobPlan,
    replay,
)
from rc_worker.testing.sim import Fork, Script, Sleep, Write
from rc_worker.testing.sim_pipe import SimPipe

# Seeds of Trio's tie-break between tasks ready at one instant. The kill lands
# between the read and the spool for some of them only: the test asserts that
# at least one does, so that it keeps exercising the case.
SEEDS = range(8)


def _kill_after_a_read(seed: int) -> tuple[SimPipe, bytes, list[str], list[str], str]:
    """Kill the worker as soon as it has taken the job's second write out of the pipe.

    Returns the job's stdout pipe, the committed output, ``check()``, ``check()``
    again with the pipe's ``lost_in_reader`` forgotten, and the job's final state.
    """

    async def scenario(fleet: Fleet) -> tuple[SimPipe, bytes, list[str], list[str], str]:
        fleet.program("job", Script((Write(b"a"), Sleep(10), Write(b"b"), Sleep(10))))
        job = fleet.submit(["job"], grace_s=0.0)
        host = fleet.nodes["h0"].host
        await fleet.wait_until(lambda: bool(host.spawned(job)), interval=0.5)
        proc = host.spawned(job)[0]
        assert proc.stdout is not None
        pipe = proc.stdout
        await trio.sleep_until(proc.started_at + 10)  # the job writes b"b" now
        for _ in range(50):  # bounded: the worker reads within a few task steps
            if len(pipe.read) == 2:
                break
            await trio.lowlevel.checkpoint()
        assert pipe.read == b"ab"
        await fleet.crash("h0")
        fleet.restart("h0")
        await fleet.settle()
        await fleet.drain()
        problems = fleet.check()
        held, pipe.lost_in_reader = pipe.lost_in_reader, b""
        strict = fleet.check()
        pipe.lost_in_reader = held
        return pipe, fleet.store.output(job), problems, strict, fleet.store.job(job).state

    return simulate(scenario, hosts=1, devices=("gpu0",), seed=seed)


def test_a_chunk_read_in_the_instant_of_a_kill_may_be_missing_and_only_it() -> None:
    raced = 0
    for seed in SEEDS:
        pipe, committed, problems, strict, state = _kill_after_a_read(seed)
        assert problems == [], (seed, problems)
        assert state == "lost", seed
        if pipe.lost_in_reader:
            # The kill came between the read and the spool: the worker held b"b" only in
            # its memory, everything before it was spooled and committed.
            raced += 1
            assert pipe.lost_in_reader == b"b"
            assert committed == b"a"
            # Without that allowance, the check reports the missing chunk.
            assert strict == [
                "j-1-sim: committed output is not what the worker read: 1 vs 2 bytes, "
                "first difference at 1: b'' vs b'b'"
            ], seed
        else:
            assert committed == b"ab", seed
            assert strict == [], seed
    assert raced > 0, "no seed killed the worker between a read and its spool"


def test_the_fault_plan_that_found_it_replays_clean() -> None:
    # j-3-sim's child prints b"late\n"; its last b"\x00" is read in the instant the
    # worker is killed (at 61 virtual seconds), so 6 of the 7 bytes read are committed.
    plan = FleetPlan(
        hosts=1,
        devices=2,
        jobs=(
            JobPlan(
                at=24.5,
                script=Script((Sleep(21.0),)),
                fields={"grace_s": 0.0, "max_runtime_s": 47.0},
            ),
            JobPlan(at=0.0, script=Script(), fields={"grace_s": 0.0}),
            JobPlan(at=51.0, script=Script(), fields={"grace_s": 0.0}),
            JobPlan(
                at=42.5,
                script=Script(
                    (
                        Fork(child=Script((Write(b"late\n"),))),
                        Sleep(6.0),
                        Write(b"\x00"),
                        Sleep(9.0),
                        Write(b"\x00"),
                    )
                ),
                fields={"grace_s": 0.0},
            ),
        ),
        crashes=(
            CrashPlan(at=53.0, host="h0", down_for=0.0, how="kill"),
            CrashPlan(at=0.5, host="h0", down_for=15.5, how="rereg"),
        ),
        idles=(IdlePlan(at=14.5, duration=55.0, host="h0", device="gpu0", behavior="hold"),),
        hooks=HooksPlan(acquire=Script((Sleep(0.5),)), release=None, linger=5.0, timeout=1.0),
    )
    played = replay(plan, seed=1181127)
    assert played.problems == [], played.story
    assert "j-3-sim: lost" in played.story
