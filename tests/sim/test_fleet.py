"""Whole fleets under hypothesis-drawn fault plans, in virtual time, checked against the invariants.

Each example is one Trio run under ``MockClock(autojump_threshold=0)``: a
reference controller and one or two workers on simulated hosts, jobs with
scripted behaviour (output at set times, exit codes, SIGTERM handlers,
escaping children, children holding stdout, uninterruptible sleep), and
controller faults, worker crashes and reboots at drawn times. What must hold
is ARCHITECTURE.md's invariants, as ``Fleet.check`` states them.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import httpx
import pytest
import trio
from hypothesis import given, note, settings
from hypothesis import strategies as st

from rc_worker.core.config import DeviceConfig
from rc_worker.core.retry import Backoff
from rc_worker.testing import fault_plans
from rc_worker.testing.fleet import Fault, Fleet, SimulationStalled, SimulationTimedOut, simulate
from rc_worker.testing.plans import SMI_BROKEN, SMI_OK, FleetPlan, describe, replay, replay_line
from rc_worker.testing.sim import Fork, Hang, Script, Sleep, Write
from rc_worker.testing.strategies import fleet_plans

TIME_LIMIT = 4 * 3600.0  # virtual seconds: invariant 6, everything ends


def run(plan: FleetPlan, seed: int) -> None:
    # Printed with a failure: pasted after `from rc_worker.testing.plans import *`,
    # this line replays the example exactly (docs/simulation.md).
    note(replay_line(plan, seed))
    played = replay(plan, seed, time_limit=TIME_LIMIT)
    note(played.story)
    assert played.problems == []


SEEDS = st.integers(0, 2**32 - 1)


@settings(max_examples=25)
@given(fleet_plans(crashes=False, outages=False), SEEDS)
def test_jobs_alone_keep_the_invariants(plan: FleetPlan, seed: int) -> None:
    run(plan, seed)


@settings(max_examples=25)
@given(fleet_plans(crashes=False), SEEDS)
def test_controller_faults_keep_the_invariants(plan: FleetPlan, seed: int) -> None:
    run(plan, seed)


@settings(max_examples=25)
@given(fleet_plans(outages=False), SEEDS)
def test_crashes_and_reboots_keep_the_invariants(plan: FleetPlan, seed: int) -> None:
    run(plan, seed)


@settings(max_examples=25)
@given(fleet_plans(), SEEDS)
def test_everything_at_once_keeps_the_invariants(plan: FleetPlan, seed: int) -> None:
    run(plan, seed)


@settings(max_examples=15)
@given(fault_plans(), SEEDS)
def test_the_public_fault_plans_full_disks_included_keep_the_invariants(
    plan: FleetPlan, seed: int
) -> None:
    run(plan, seed)


# -- named scenarios: each fault once, with what it must lead to -------------------------

TRAIN = Script.printing((1, b"epoch 1\n"), (10, b"epoch 2\n"), (20, b"done\n"))


def scenario(fn: Callable[[Fleet], Awaitable[None]], **fleet_args: object) -> None:
    async def main(fleet: Fleet) -> None:
        fleet.program("train", TRAIN)
        try:
            await fn(fleet)
            await fleet.settle()
            await fleet.drain()
            assert fleet.check() == []
        except BaseException:
            print(describe(fleet))  # shown by pytest with the failure
            raise

    simulate(main, time_limit=TIME_LIMIT, **fleet_args)


def test_a_crash_mid_job_is_lost_with_its_output_so_far_and_the_device_proven_clean() -> None:
    async def fn(fleet: Fleet) -> None:
        job = fleet.submit(["train"])
        await trio.sleep(5)
        [proc] = fleet.nodes["h0"].host.live(job_id=job)
        await fleet.crash("h0")
        fleet.restart("h0")  # before the controller misses a heartbeat
        await fleet.wait_until(lambda: fleet.store.job(job).terminal)
        assert fleet.store.job(job).state == "lost"
        assert not proc.alive  # the new worker's recovery sweep removed it
        assert fleet.store.output(job) == b"epoch 1\n"
        # Proven gone: no operator needed before the next job runs there.
        second = fleet.submit(["train"])
        await fleet.wait_until(lambda: fleet.store.job(second).terminal)
        assert fleet.store.job(second).state == "succeeded"

    scenario(fn)


def test_a_reboot_frees_the_device_of_a_job_the_controller_thought_lost() -> None:
    async def fn(fleet: Fleet) -> None:
        job = fleet.submit(["train"])
        await trio.sleep(5)
        await fleet.crash("h0", reboot=True)
        await trio.sleep(60)  # long enough for the controller to lose the host
        assert fleet.store.device("h0", "gpu0").state == "quarantined"
        fleet.restart("h0")
        await fleet.wait_until(lambda: fleet.store.device("h0", "gpu0").state == "free")
        assert fleet.store.job(job).state == "lost"
        cleared = [e for e in fleet.events() if e.type == "device_cleared"]
        assert [e.data["by"] for e in cleared] == ["reboot"]

    scenario(fn, heartbeat_interval=5.0)


def test_require_manual_clear_keeps_a_device_quarantined_until_an_operator_clears_it() -> None:
    async def fn(fleet: Fleet) -> None:
        job = fleet.submit(["train"])
        await trio.sleep(5)
        await fleet.crash("h0")
        fleet.restart("h0")
        await fleet.wait_until(lambda: fleet.store.job(job).terminal)
        await trio.sleep(300)
        assert fleet.store.device("h0", "gpu0").state == "quarantined"
        assert fleet.clear_clean_devices() == ["h0/gpu0"]

    scenario(fn, require_manual_clear=True)


@pytest.mark.parametrize("endpoint", ["poll", "start", "output", "finish", "register"])
def test_a_lost_answer_neither_loses_nor_doubles_a_job(endpoint: str) -> None:
    async def fn(fleet: Fleet) -> None:
        fleet.inject(endpoint, Fault.LOST, Fault.LOST)
        job = fleet.submit(["train"])
        await fleet.wait_until(lambda: fleet.store.job(job).terminal)
        assert fleet.store.job(job).state == "succeeded"
        assert fleet.store.output(job) == TRAIN.output

    scenario(fn)


def test_an_escaped_child_holds_its_device_until_the_sweep_has_removed_it() -> None:
    async def fn(fleet: Fleet) -> None:
        unkillable = Script((Hang(100),))
        fleet.program("leaky", Script((Write(b"x"), Fork(unkillable, setsid=True))))
        job = fleet.submit(["leaky"])
        await fleet.wait_until(lambda: fleet.store.job(job).terminal)
        info = fleet.store.job(job)
        assert (info.state, info.killed) == ("succeeded", False)
        assert info.sweep is not None
        assert info.sweep["remaining"]
        assert fleet.store.device("h0", "gpu0").state == "quarantined"

    scenario(fn)


def test_a_drained_worker_lets_its_job_finish_and_a_stopped_one_kills_it() -> None:
    async def fn(fleet: Fleet) -> None:
        first = fleet.submit(["train"])
        await trio.sleep(5)
        await fleet.stop("h0", drain=True)
        assert fleet.store.job(first).state == "succeeded"
        fleet.restart("h0")
        second = fleet.submit(["train"])
        await fleet.wait_until(lambda: fleet.store.job(second).state == "running")
        await fleet.stop("h0", drain=False)
        info = fleet.store.job(second)
        assert (info.state, info.killed) == ("killed", True)
        assert "shutting down" in info.reason
        fleet.restart("h0")

    scenario(fn)


def test_a_failing_verify_script_quarantines_the_device_but_keeps_the_outcome() -> None:
    async def fn(fleet: Fleet) -> None:
        fleet.verify_script("10-check", Script.sleeping(1, exit_code=2))
        job = fleet.submit(["train"])
        await fleet.wait_until(lambda: fleet.store.job(job).terminal)
        info = fleet.store.job(job)
        assert info.state == "succeeded"
        assert info.verify is not None
        assert not info.verify.ok
        assert fleet.store.device("h0", "gpu0").state == "quarantined"
        fleet.verify_script("10-check", Script.sleeping(1))

    scenario(fn)


# -- regressions: worker bugs the simulations found (fixed in client.py and device.py) ----


def test_a_persistent_unknown_session_is_retried_with_backoff_not_in_a_hot_loop() -> None:
    registers = 0

    async def fn(fleet: Fleet) -> None:
        node = fleet.nodes["h0"]
        hook = node.transport.on_request
        assert hook is not None

        def counting(endpoint: str, request: httpx.Request) -> httpx.Request:
            nonlocal registers
            if endpoint == "register":
                registers += 1
                if registers > 500:
                    fleet.restore()  # break the livelock, or the run never ends
            return hook(endpoint, request)

        node.transport.on_request = counting
        await trio.sleep(10)
        fleet.outage("heartbeat", Fault.UNKNOWN_SESSION)
        await trio.sleep(30)
        fleet.restore()
        # Backoff capped at 30 s from 0.2 s allows a dozen tries in 30 s, not hundreds.
        assert registers < 50

    scenario(fn)


def test_a_linger_shorter_than_the_poll_does_not_spin() -> None:
    async def fn(fleet: Fleet) -> None:
        fleet.program("/sim/release", Script.sleeping(1))
        job = fleet.submit(["train"])
        await fleet.wait_until(lambda: fleet.store.job(job).terminal)
        await trio.sleep(30)

    scenario(fn, devices=(DeviceConfig("gpu0", on_release="/sim/release", release_linger=0.5),))


def test_a_poll_outage_while_lingering_does_not_spin() -> None:
    async def fn(fleet: Fleet) -> None:
        fleet.program("/sim/release", Script.sleeping(1))
        job = fleet.submit(["train"])
        await fleet.wait_until(lambda: fleet.store.job(job).terminal)
        fleet.outage("poll", Fault.UNAVAILABLE)
        await trio.sleep(30)
        fleet.restore()

    scenario(fn, devices=(DeviceConfig("gpu0", on_release="/sim/release", release_linger=5.0),))


def test_a_blind_sweep_does_not_offer_a_device_an_unseen_escapee_may_hold() -> None:
    async def fn(fleet: Fleet) -> None:
        fleet.nodes["h0"].host.environ_readable = False  # the worker is not root
        escapee = Script.sleeping(300)
        fleet.program("leaky", Script((Write(b"x"), Fork(escapee, setsid=True))))
        job = fleet.submit(["leaky"])
        await fleet.wait_until(lambda: fleet.store.job(job).terminal)
        await trio.sleep(10)
        assert fleet.violations == []
        [escapee] = fleet.nodes["h0"].host.live()
        [quarantine] = [e for e in fleet.events() if e.type == "device_quarantined"]
        assert quarantine.data["kind"] == "dirty"
        assert str(escapee.pid) in str(quarantine.data["detail"])

    scenario(fn)


def test_with_a_cgroup_a_worker_that_is_not_root_ends_the_escapee_and_offers_the_device() -> None:
    async def fn(fleet: Fleet) -> None:
        host = fleet.nodes["h0"].host
        host.environ_readable = False  # the worker is not root: no environment is readable
        hidden = Script((Sleep(300),), environ_readable=False)
        fleet.program("leaky", Script((Write(b"x"), Fork(hidden, setsid=True))))
        job = fleet.submit(["leaky"])
        await fleet.wait_until(lambda: fleet.store.job(job).terminal)
        await trio.sleep(10)
        assert host.live() == []  # the escapee went with the job's cgroup
        assert [e for e in fleet.events() if e.type == "device_quarantined"] == []
        second = fleet.submit(["train"])  # the device is offered again
        await fleet.wait_until(lambda: fleet.store.job(second).terminal)
        assert fleet.violations == []

    scenario(fn, cgroups=True)


def test_a_reregistration_resending_an_undelivered_recovery_entry_loses_no_running_job() -> None:
    # The re-registration issue's reduced case: the restarted worker's recovered job
    # cannot be finished yet (output answers unknown_session), a second job starts on
    # the other device, and every re-registration resends the recovery entry. The
    # controller once took that for a new process and ended the second job `lost`.
    async def fn(fleet: Fleet) -> None:
        fleet.program("long", Script.printing((1, b"a\n"), (120, b"b\n")))
        await fleet.wait_until(lambda: len(fleet.store.devices()) == 2)
        first = fleet.submit(["train"], device="h0/gpu0")
        await trio.sleep(5)
        fleet.outage("output", Fault.UNKNOWN_SESSION)
        await fleet.crash("h0")
        fleet.restart("h0")
        await trio.sleep(10)
        second = fleet.submit(["long"], device="h0/gpu1")
        await fleet.wait_until(lambda: fleet.store.job(second).state == "running")
        await trio.sleep(60)  # many re-registrations, each resending the entry
        assert fleet.store.job(second).state == "running"
        fleet.restore()
        await fleet.wait_until(lambda: fleet.store.job(second).terminal)
        assert fleet.store.job(second).state == "succeeded"
        assert fleet.store.output(second) == b"a\nb\n"
        await fleet.wait_until(lambda: fleet.store.job(first).terminal)
        assert fleet.store.job(first).state == "lost"

    scenario(fn, devices=("gpu0", "gpu1"))


# -- the harness is safe to use ------------------------------------------------------


def test_register_cannot_meet_unknown_session() -> None:
    async def fn(fleet: Fleet) -> None:
        with pytest.raises(ValueError, match="register cannot meet unknown_session"):
            fleet.outage("register", Fault.UNKNOWN_SESSION)
        with pytest.raises(ValueError, match="register cannot meet unknown_session"):
            fleet.inject("register", Fault.UNAVAILABLE, Fault.UNKNOWN_SESSION)

    scenario(fn)


def test_a_retry_loop_without_backoff_is_reported_as_stalled(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A worker bug: retries with no delay. Virtual time stops moving while the
    # loop spins; the stall guard must end the run with a clear error.
    monkeypatch.setattr(Backoff, "next_delay", lambda self, retry_after=None: 0.0)

    async def fn(fleet: Fleet) -> None:
        await trio.sleep(10)
        fleet.outage("heartbeat", Fault.UNAVAILABLE)
        await trio.sleep(60)

    with pytest.raises(SimulationStalled, match="virtual time stopped"):
        simulate(fn, stall_steps=20_000)


def test_a_run_past_its_wall_limit_fails_instead_of_hanging() -> None:
    async def fn(fleet: Fleet) -> None:
        while True:  # a scenario that never ends, in virtual time as in real time
            fleet.submit(["true"])
            await trio.sleep(1)

    with pytest.raises(SimulationTimedOut, match="wall-clock limit"):
        simulate(fn, time_limit=1e9, wall_limit=0.5)


def test_a_device_quarantined_while_its_poll_is_parked_then_a_submit_costs_no_job() -> None:
    # The stale-offer window: the poll listing gpu0 is parked at the controller
    # when the worker quarantines gpu0, and a job is submitted in the same instant.
    async def fn(fleet: Fleet) -> None:
        await fleet.wait_until(lambda: bool(fleet.store.devices()))
        await trio.sleep(2)  # the poll that lists gpu0 is parked now
        assert fleet.quarantine("h0", "gpu0")
        job = fleet.submit(["train"])
        await trio.sleep(60)
        assert fleet.store.job(job).state == "queued"  # waits: not rejected, not run
        assert fleet.clear_clean_devices() == ["h0/gpu0"]
        await fleet.wait_until(lambda: fleet.store.job(job).terminal)
        assert fleet.store.job(job).state == "succeeded"

    scenario(fn)


def test_a_restarted_worker_offers_a_device_only_after_its_recovered_finish_is_in() -> None:
    # Found by the fleet's unacknowledged-finish check: the new worker process
    # offered the device while the `lost` finish recovery wrote for it was still
    # undelivered. The device now waits for it, as for a job of its own.
    async def fn(fleet: Fleet) -> None:
        job = fleet.submit(["train"])
        await trio.sleep(5)
        fleet.outage("finish", Fault.UNAVAILABLE)
        await fleet.crash("h0")
        fleet.restart("h0")
        await trio.sleep(30)
        assert fleet.store.job(job).state == "running"  # its lost finish is not in yet
        fleet.restore()
        await fleet.wait_until(lambda: fleet.store.job(job).terminal)
        second = fleet.submit(["train"])
        await fleet.wait_until(lambda: fleet.store.job(second).terminal)
        assert fleet.store.job(second).state == "succeeded"

    scenario(fn)


@pytest.mark.parametrize("seed", range(12))
def test_a_device_withdrawn_beside_a_ready_one_does_not_livelock_the_other(seed: int) -> None:
    # Found by the fleet: a poll listing gpu0 and gpu1 is parked; gpu1 stops being
    # offerable in the instant a job is submitted. The old poll's still-ready gpu0
    # must not be listed by a second poll while the first is in flight, or the
    # controller takes that for a lost answer and requeues the first poll's offer,
    # whose start is then stale, again and again with no time passing.
    async def fn(fleet: Fleet) -> None:
        fleet.program("train", TRAIN)
        await fleet.wait_until(lambda: len(fleet.store.devices()) == 2)
        await trio.sleep(2)
        job = fleet.submit(["train"])
        assert fleet.quarantine("h0", "gpu1")
        await fleet.wait_until(lambda: fleet.store.job(job).terminal)
        assert fleet.store.job(job).state == "succeeded"
        assert fleet.store.job(job).device == "gpu0"
        await fleet.drain()
        assert fleet.check() == []

    simulate(fn, seed=seed, time_limit=TIME_LIMIT, devices=("gpu0", "gpu1"))


@pytest.mark.parametrize("seed", range(6))
def test_a_register_retried_with_facts_from_before_a_failed_probe_is_not_a_wipe(seed: int) -> None:
    # Found by the fleet (a false alarm of the check, not a worker bug): the host is
    # lost, its re-registration meets 503s, and nvidia-smi fails in the instant they
    # end. The register retried afterwards carries the body built before, with the
    # facts of the last good pass: the same facts again, which wipe nothing.
    async def fn(fleet: Fleet) -> None:
        await fleet.wait_until(lambda: bool(fleet.store.devices()))
        await fleet.wait_until(lambda: "product" in fleet.store.device("h0", "gpu0").facts)
        fleet.outage("heartbeat", Fault.REFUSED)
        await fleet.wait_until(lambda: fleet.store.device("h0", "gpu0").host_state == "lost")
        fleet.outage("register", Fault.UNAVAILABLE)
        fleet.restore("heartbeat")
        await trio.sleep(20)  # the worker learns its session is gone; register meets 503s
        fleet.restore("register")
        fleet.program_nvidia_smi(SMI_BROKEN["fails"])
        node = fleet.nodes["h0"]
        assert node.worker is not None
        node.worker.reprobe()
        await trio.sleep(60)
        assert fleet.store.device("h0", "gpu0").facts.get("product") == "NVIDIA H100 80GB HBM3"
        await fleet.drain()
        assert fleet.check() == []

    simulate(fn, seed=seed, time_limit=TIME_LIMIT, nvidia_smi=SMI_OK)


def test_a_held_device_cleared_while_its_worker_drains_is_released_and_the_worker_exits() -> None:
    """Found by hypothesis: a device quarantined while its lease was still held (its
    release hook not yet run) is done as far as a drain goes, and its task ended. Cleared
    while the drain waited for another device's job, it moved to releasing with no task
    left to release it, and the worker waited for it for ever."""
    release = "/sim/hooks/release"
    devices = [DeviceConfig(n, on_release=release, release_linger=300.0) for n in ("a", "b")]

    async def scenario(fleet: Fleet) -> tuple[str, list[str], list[str]]:
        fleet.program(release, Script.sleeping(1))
        fleet.program("quick", Script.printing((1, b"ok\n")))
        fleet.program("long", Script.printing((60, b"done\n")))
        quick = fleet.submit(["quick"])
        await fleet.wait_until(lambda: fleet.store.job(quick).state == "succeeded")
        fleet.submit(["long"])  # on the other device: the quick one's lingers
        await trio.sleep(5)
        held = fleet.store.job(quick).device
        assert held is not None
        assert fleet.quarantine("h0", held)  # lingering: its lease is still held
        node = fleet.nodes["h0"]
        assert node.worker is not None
        node.worker.drain()
        await trio.sleep(5)  # the drain is done with the quarantined device
        assert fleet.clear_clean_devices() == [f"h0/{held}"]
        with trio.fail_after(600):
            await fleet.drain()
        ran = [p.argv[0] for p in node.host.spawned()]
        return fleet.store.device("h0", held).state, ran, fleet.check()

    state, ran, problems = simulate(scenario, hosts=1, devices=devices, seed=11)
    assert ran.count(release) == 2  # each device released once, then the worker left
    assert state != "quarantined"
    assert problems == []
