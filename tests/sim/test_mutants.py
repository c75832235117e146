"""Each of the fleet's invariant checks catches a deliberately broken worker.

A mutant is one single-point bug of the kind the seed's incidents describe,
applied by monkeypatching. Each test runs the same scenario twice: with the
real worker, where ``Fleet.check()`` must find nothing, and with the mutant,
where it must report the bug. A check that passes whatever the worker does
would fail the second half.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import pytest
import trio

from rc_worker import device as device_module
from rc_worker.core.config import DeviceConfig
from rc_worker.device import DeviceSupervisor
from rc_worker.hooks import HookOutcome
from rc_worker.outbox import Outbox
from rc_worker.scripts import TailBuffer
from rc_worker.supervise import JobSpec, run_job
from rc_worker.testing.fleet import Fault, Fleet, simulate
from rc_worker.testing.sim import OnSigterm, Script, Sleep

TRAIN = Script.printing((1, b"epoch 1\n"), (5, b"done\n"))
Scenario = Callable[[Fleet], Awaitable[None]]


def problems(fn: Scenario, **fleet_args: Any) -> list[str]:
    async def main(fleet: Fleet) -> list[str]:
        fleet.program("train", TRAIN)
        await fn(fleet)
        await fleet.settle()
        await fleet.drain()
        return fleet.check()

    return simulate(main, time_limit=3600.0, **fleet_args)


# -- a verify failure the worker did not quarantine itself --------------------------


async def _failing_verify(fleet: Fleet) -> None:
    fleet.verify_script("check", Script.sleeping(0.5, exit_code=1))
    job = fleet.submit(["train"])
    await fleet.wait_until(lambda: fleet.store.job(job).terminal)


def test_a_verify_failure_the_worker_did_not_quarantine_is_reported(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    assert problems(_failing_verify) == []

    real = DeviceSupervisor._run

    async def quarantine_only_failed_jobs(
        self: DeviceSupervisor, a: Any, key: str
    ) -> tuple[Any, Any, str | None, int]:
        result, verify, fault_id, size = await real(self, a, key)
        if not verify.ok and result.exit_code == 0 and fault_id is not None:
            self.lease.faults.discard(fault_id)  # the bug: a succeeded job keeps its device
            fault_id = None
        return result, verify, fault_id, size

    monkeypatch.setattr(DeviceSupervisor, "_run", quarantine_only_failed_jobs)
    found = problems(_failing_verify)
    assert any("failed verify pass" in p and "without quarantining" in p for p in found), found


# -- a device offered before its finish is acknowledged --------------------------------


async def _slow_finish(fleet: Fleet) -> None:
    fleet.outage("finish", Fault.UNAVAILABLE)
    job = fleet.submit(["train"])
    await fleet.wait_until(lambda: bool(fleet.store.output(job)))
    await trio.sleep(60)  # the job has ended; its finish meets 503s meanwhile
    fleet.restore()
    await fleet.wait_until(lambda: fleet.store.job(job).terminal)


def test_a_device_offered_before_its_finish_is_acknowledged_is_reported(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    assert problems(_slow_finish) == []

    async def delivered_at_once(self: Outbox, key: str) -> None:
        await trio.lowlevel.checkpoint()  # the bug: does not wait for the acknowledgement

    # The worker holds the rule in two places (the device waits for its finish,
    # and is not ready while the outbox owes one for it): the mutant breaks both.
    monkeypatch.setattr(Outbox, "delivered", delivered_at_once)
    monkeypatch.setattr(Outbox, "owes", lambda self, device: False)
    found = problems(_slow_finish)
    assert any("is unacknowledged" in p for p in found), found


# -- a hook killed at its timeout that exits 0 counted as a success -------------------

ACQUIRE = "/sim/acquire"
SLOW_HOOK_DEVICES = (DeviceConfig("gpu0", on_acquire=ACQUIRE, timeout=2.0),)


async def _slow_acquire(fleet: Fleet) -> None:
    # The hook outlives its timeout, and on SIGTERM exits 0: still a failed hook.
    fleet.program(ACQUIRE, Script((Sleep(60),), on_sigterm=OnSigterm(exit_code=0)))
    job = fleet.submit(["train"])
    await fleet.wait_until(lambda: bool(fleet.store.devices()))
    await fleet.wait_until(
        lambda: (
            fleet.store.device("h0", "gpu0").state == "quarantined" or fleet.store.job(job).terminal
        )
    )
    if not fleet.store.job(job).terminal:
        fleet.cancel(job)


def test_a_killed_hook_counted_as_a_success_is_reported(monkeypatch: pytest.MonkeyPatch) -> None:
    assert problems(_slow_acquire, devices=SLOW_HOOK_DEVICES) == []

    async def exit_code_only(
        hook: str, path: str, *, time_limit: float, env: Any, host: Any = None
    ) -> HookOutcome:
        spec = JobSpec(
            command=[path],
            env={**env, "RC_HOOK": hook},
            grace_ceiling=min(5.0, time_limit),
            max_runtime=time_limit,
            stderr=TailBuffer(),
        )
        result = await run_job(spec, TailBuffer(), host=host)
        # The bug: `killed` ignored, so a hook cut off at its timeout that exits 0 passes.
        return HookOutcome(ok=result.error is None and result.exit_code == 0, reason="hook")

    monkeypatch.setattr(device_module, "run_hook", exit_code_only)
    found = problems(_slow_acquire, devices=SLOW_HOOK_DEVICES)
    assert any("ran after its on_acquire hook failed" in p for p in found), found
