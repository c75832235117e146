"""Regression: the cancel watch polled in a loop, without waiting, at one virtual instant.

Found by a fault plan (a crash, a finish outage, a cancel): the controller keeps
listing the cancel of an attempt until its finish is acknowledged, and the
worker left out of ``known_cancels`` every cancel whose attempt no device held
any more (one that ended before a crash, its finish still in the outbox). With
another device holding a job, the watch was answered at once, again and again:
a worker burning a core, and a simulation stalled (``SimulationStalled``: how
these tests failed).
"""

from __future__ import annotations

import trio

from rc_worker.testing.fleet import Fault, Fleet, simulate
from rc_worker.testing.plans import describe, parse_plan, replay
from rc_worker.testing.sim import Script

from .watches import WatchCount


def test_a_cancel_of_an_attempt_ended_before_a_crash_does_not_make_the_watch_spin() -> None:
    async def fn(fleet: Fleet) -> None:
        watches = WatchCount(fleet, "h0")
        fleet.program("short", Script.printing((2, b"a\n")))
        fleet.program("long", Script.printing((1, b"a\n"), (120, b"b\n")))
        await fleet.wait_until(lambda: len(fleet.store.devices()) == 2)
        first = fleet.submit(["short"], device="h0/gpu0")
        fleet.outage("finish", Fault.UNAVAILABLE)
        await trio.sleep(10)  # the first job has ended; its finish is refused
        await fleet.crash("h0")
        fleet.restart("h0")
        await trio.sleep(10)  # the new worker queues the first job's finish; no device holds it
        second = fleet.submit(["long"], device="h0/gpu1")
        await fleet.wait_until(lambda: fleet.store.job(second).state == "running")
        assert fleet.store.job(first).state == "running"  # as the controller sees it
        watches.n = 0
        fleet.cancel(first)
        await trio.sleep(30)
        # A watch a round, each answered at its wait (30 s) or at a change: a few, not hundreds.
        assert watches.n < 10
        fleet.restore()
        await fleet.wait_until(lambda: fleet.store.job(first).terminal)
        assert fleet.store.job(first).state == "succeeded"  # the cancel came after its end
        fleet.cancel(second)
        await fleet.wait_until(lambda: fleet.store.job(second).terminal)
        await fleet.settle()
        await fleet.drain()
        assert fleet.check() == []

    async def main(fleet: Fleet) -> None:
        try:
            await fn(fleet)
        except BaseException:
            print(describe(fleet))  # shown by pytest with the failure
            raise

    simulate(main, seed=1, hosts=1, devices=("gpu0", "gpu1"))


# The plan hypothesis found (docs/simulation.md): it stalled at 57.0 s, the watch
# answered at once, again and again, for the cancel of job 1, whose finish was
# still refused after the crash at 44 s.
FOUND = parse_plan(
    "FleetPlan(hosts=1, devices=2, jobs=(JobPlan(at=22.0, script=Script(steps=(Sleep(seconds=1.0), "
    "Write(data=b'0123456789abcdef\\n', stderr=False, repeat=340), Sleep(seconds=0.5), "
    "Write(data=b'0123456789abcdef\\n', stderr=False, repeat=407), Sleep(seconds=6.0), "
    "Write(data=b'0123456789abcdef\\n', stderr=False, repeat=550), Sleep(seconds=21.5)), "
    "exit_code=0, on_sigterm=OnSigterm(ignore=False, delay=4.0, exit_code=0), "
    "environ_readable=True, uid=0), fields={'grace_s': 6.0, 'idle_timeout_s': 7.0}), "
    "JobPlan(at=40.5, script=Script(steps=(Sleep(seconds=28.0),), exit_code=1, "
    "on_sigterm=OnSigterm(ignore=True, delay=0.0, exit_code=None), environ_readable=True, uid=0), "
    "fields={'grace_s': 5.0, 'idle_timeout_s': 30.0}), JobPlan(at=10.5, "
    "script=Script(steps=(Sleep(seconds=4.5), "
    "Write(data=b'6\\x8a\\xdb\\xf3', stderr=False, repeat=1),"
    " Sleep(seconds=10.5), Write(data=b'application/json', stderr=False, repeat=1), "
    "Sleep(seconds=2.0), Write(data=b'0123456789abcdef\\n', stderr=False, repeat=392), "
    "Sleep(seconds=27.5)), exit_code=1, on_sigterm=OnSigterm(ignore=False, delay=7.5, exit_code=1),"
    " environ_readable=True, uid=0), fields={'grace_s': 0.5, 'idle_timeout_s': 28.0}), "
    "JobPlan(at=40.5, script=Script(steps=(Sleep(seconds=28.0),), exit_code=1, "
    "on_sigterm=OnSigterm(ignore=True, delay=0.0, exit_code=None), environ_readable=True, uid=0), "
    "fields={'grace_s': 5.0, 'idle_timeout_s': 30.0})), outages=(), injections=(InjectPlan(at=77.0,"
    " endpoint='finish', faults=(Fault.UNKNOWN_SESSION, Fault.UNKNOWN_SESSION, Fault.TIMEOUT), "
    "host=None), InjectPlan(at=13.0, endpoint='heartbeat', faults=(Fault.UNKNOWN_SESSION, "
    "Fault.TIMEOUT), host=None), InjectPlan(at=20.5, endpoint='finish', "
    "faults=(Fault.UNAVAILABLE,), host='h0')), crashes=(CrashPlan(at=3.5, host='h0', down_for=8.5, "
    "how='rereg'), CrashPlan(at=44.0, host='h0', down_for=0.0, how='kill')), "
    "cancels=(CancelPlan(at=65.5, job=3), CancelPlan(at=22.5, job=2)), idles=(IdlePlan(at=1.0, "
    "duration=54.0, host='h0', device='gpu1', behavior='hold'), IdlePlan(at=45.0, duration=44.5, "
    "host='h0', device='gpu0', behavior='hold')), unoffers=(), smi=(SmiPlan(at=13.0, duration=18.0,"
    " how='fails'),), hooks=HooksPlan(acquire=None, release=Script(steps=(Sleep(seconds=28.5),), "
    "exit_code=0, on_sigterm=OnSigterm(ignore=False, delay=0.0, exit_code=None), "
    "environ_readable=True, uid=0), linger=0.0, timeout=2.0), "
    "verify=Script(steps=(Sleep(seconds=29.0),), exit_code=0, on_sigterm=OnSigterm(ignore=False, "
    "delay=0.0, exit_code=None), environ_readable=True, uid=0), require_manual_clear=False, "
    "foreign_process=True, cgroups=True, disks=())"
)


def test_the_plan_that_found_it_replays_without_a_stall() -> None:
    played = replay(FOUND, seed=92226)
    assert played.problems == [], played.story
