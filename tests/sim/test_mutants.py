"""Each of the fleet's invariant checks catches a deliberately broken worker.

A mutant is one single-point bug of the kind the seed's incidents describe,
applied by monkeypatching. Each test runs the same scenario twice: with the
real worker, where ``Fleet.check()`` must find nothing, and with the mutant,
where it must report the bug. A check that passes whatever the worker does
would fail the second half.

The mutants: a success relabelled as killed, an unconfirmed device's labels
wiped, a dirty device offered, a finish reported twice, an output byte dropped
on retry, a blind sweep trusted; and a verify failure not quarantined, a device
offered before its finish is acknowledged, a killed hook counted as a success.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import attrs
import pytest
import trio

from rc_worker import device as device_module
from rc_worker import outbox as outbox_module
from rc_worker import supervise as supervise_module
from rc_worker import worker as worker_module
from rc_worker.client import ControllerClient
from rc_worker.core import claim_decision
from rc_worker.core.config import DeviceConfig
from rc_worker.core.labels import ProbeResult
from rc_worker.device import DeviceSupervisor
from rc_worker.hooks import HookOutcome
from rc_worker.outbox import Outbox
from rc_worker.scripts import TailBuffer
from rc_worker.supervise import JobSpec, Result, run_job
from rc_worker.sweep import SweepReport
from rc_worker.testing.fleet import Fault, Fleet, simulate
from rc_worker.testing.sim import Fork, OnSigterm, Script, Sleep, Write

from .test_fleet_probes import SMI_FAILS, SMI_OK, smi_breaks_after_a_good_pass

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


# -- a success relabelled as killed ---------------------------------------------------


async def _one_job(fleet: Fleet) -> None:
    job = fleet.submit(["train"])
    await fleet.wait_until(lambda: fleet.store.job(job).terminal)


def test_a_success_relabelled_as_killed_is_reported(monkeypatch: pytest.MonkeyPatch) -> None:
    assert problems(_one_job) == []
    real = device_module.run_job

    async def relabel(spec: JobSpec, sink: Any, **kwargs: Any) -> Result:
        result = await real(spec, sink, **kwargs)
        if result.exit_code == 0:  # the bug: a job that exited 0 reported killed
            result = attrs.evolve(result, killed=True, reason="max_runtime")
        return result

    monkeypatch.setattr(device_module, "run_job", relabel)
    found = problems(_one_job)
    assert any("exited 0 on its own but was reported killed" in p for p in found), found


# -- an unconfirmed device's labels wiped ------------------------------------------------


def test_an_unconfirmed_devices_labels_wiped_are_reported(monkeypatch: pytest.MonkeyPatch) -> None:
    async def main(fleet: Fleet) -> list[str]:
        await smi_breaks_after_a_good_pass(fleet, SMI_FAILS)
        await fleet.drain()
        return fleet.check()

    assert simulate(main, devices=("gpu0", "gpu1"), nvidia_smi=SMI_OK) == []
    real = worker_module.labels_payload

    def wipe_unconfirmed(result: ProbeResult) -> dict[str, Any]:
        body = real(result)
        for name in result.unconfirmed:  # the bug: an unconfirmed device sent empty
            body["devices"][name] = {}
        return body

    monkeypatch.setattr(worker_module, "labels_payload", wipe_unconfirmed)

    async def broken(fleet: Fleet) -> list[str]:
        with pytest.raises(AssertionError):  # the facts are wiped at the controller
            await smi_breaks_after_a_good_pass(fleet, SMI_FAILS)
        await fleet.drain()
        return fleet.check()

    found = simulate(broken, devices=("gpu0", "gpu1"), nvidia_smi=SMI_OK)
    assert any("although nvidia-smi failed" in p for p in found), found


# -- a dirty device offered --------------------------------------------------------------

ESCAPES = Script((Write(b"x\n"), Fork(Script.sleeping(300), setsid=True), Sleep(2)))


async def _an_escaping_job(fleet: Fleet) -> None:
    fleet.program("escapes", ESCAPES)
    job = fleet.submit(["escapes"])
    await fleet.wait_until(lambda: fleet.store.job(job).terminal)
    await trio.sleep(10)  # the worker polls again, offering what it holds clean


def test_a_dirty_device_offered_is_reported(monkeypatch: pytest.MonkeyPatch) -> None:
    assert problems(_an_escaping_job) == []

    async def looks_away(job_id: str, **kwargs: Any) -> SweepReport:
        await trio.lowlevel.checkpoint()
        return SweepReport(scanned=True)  # the bug: nothing looked for, "clean"

    monkeypatch.setattr(supervise_module, "sweep_job_survivors", looks_away)
    found = problems(_an_escaping_job)
    assert any("offered gpu0 as ready while" in p and "alive" in p for p in found), found


# -- a finish reported twice --------------------------------------------------------------


def test_a_finish_reported_twice_is_reported(monkeypatch: pytest.MonkeyPatch) -> None:
    assert problems(_one_job) == []
    real = ControllerClient.finish

    async def twice(self: ControllerClient, job_id: str, report: Any) -> None:
        await real(self, job_id, report)
        await real(self, job_id, report)  # the bug: the end of the job reported again

    monkeypatch.setattr(ControllerClient, "finish", twice)
    found = problems(_one_job)
    assert any("twice: it already had the final answer" in p for p in found), found


# -- an output byte dropped on retry -------------------------------------------------------


async def _output_retried(fleet: Fleet) -> None:
    fleet.inject("output", Fault.UNAVAILABLE, Fault.REFUSED)
    await _one_job(fleet)


def test_an_output_byte_dropped_on_retry_is_reported(monkeypatch: pytest.MonkeyPatch) -> None:
    assert problems(_output_retried) == []
    real = outbox_module._stream
    tries: set[tuple[str, int]] = set()

    async def dropping(body: Any) -> Any:
        first = True
        async for chunk in body:
            if first and chunk:
                chunk, first = chunk[1:], False  # the bug: one byte lost
            yield chunk

    def drop_on_retry(d: Any, start: int) -> Any:
        key = (d.job_dir.key, start)
        retry = key in tries
        tries.add(key)
        return dropping(real(d, start)) if retry else real(d, start)

    monkeypatch.setattr(outbox_module, "_stream", drop_on_retry)
    found = problems(_output_retried)
    assert any("committed output is not what the worker read" in p for p in found), found


# -- a blind sweep trusted -----------------------------------------------------------------

# A child that leaves the job's session with an environment the worker cannot read.
HIDES = Script(
    (
        Write(b"x\n"),
        Fork(Script((Sleep(300),), environ_readable=False), setsid=True),
        Sleep(2),
    )
)


async def _a_hiding_job(fleet: Fleet) -> None:
    fleet.program("hides", HIDES)
    job = fleet.submit(["hides"])
    await fleet.wait_until(lambda: fleet.store.job(job).terminal)
    await trio.sleep(10)


def test_a_blind_sweep_trusted_is_reported(monkeypatch: pytest.MonkeyPatch) -> None:
    assert problems(_a_hiding_job) == []
    real = claim_decision.unproven

    def trusts_blind(report: SweepReport) -> str | None:
        # The bug: a sweep that could not see a process is taken as proof.
        return None if report.blind and not report.remaining else real(report)

    monkeypatch.setattr(claim_decision, "unproven", trusts_blind)
    found = problems(_a_hiding_job)
    assert any("offered gpu0 as ready while" in p and "alive" in p for p in found), found
