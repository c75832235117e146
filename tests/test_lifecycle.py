"""Device lifecycle with real scripts: hooks, verify, quarantine, linger, cancel, idle behaviour."""

from __future__ import annotations

import errno
import os
from pathlib import Path
from typing import Any

import pytest
import trio

from rc_worker.core.config import DeviceConfig
from rc_worker.core.model import VERIFY_REASON_PREFIX, VerifyResult
from rc_worker.testing import LocalSystem, local_system, make_config


def script(path: Path, body: str) -> str:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("#!/bin/sh\n" + body + "\n")
    path.chmod(0o755)
    return str(path)


def lines(path: Path) -> list[str]:
    return path.read_text().splitlines() if path.exists() else []


def config(tmp_path: Path, *devices: DeviceConfig | str, **overrides: object):  # type: ignore[no-untyped-def]
    fields: dict[str, object] = {"heartbeat_interval": 0.2}
    fields.update(overrides)
    return make_config(tmp_path, devices=devices or ("gpu0",), **fields)


async def wait_device(system: LocalSystem, name: str, state: str) -> None:
    await system.wait_until(lambda: system.device(name).state == state)


async def wait_worker_state(system: LocalSystem, name: str, state: str) -> None:
    await system.wait_until(lambda: system.worker.devices[name].lease.state == state)


# -- acquire ------------------------------------------------------------------


async def test_acquire_hook_runs_before_the_job_with_its_environment(tmp_path: Path) -> None:
    log = tmp_path / "hook.log"
    acquire = script(
        tmp_path / "acquire.sh",
        f'echo "$RC_HOOK $RC_DEVICE $RC_JOB_ID $RC_HOST" >> {log}',
    )
    dev = DeviceConfig(name="gpu0", on_acquire=acquire, release_linger=0.0)
    with trio.fail_after(30):
        async with local_system(config(tmp_path, dev)) as system:
            job_id = system.submit(["sh", "-c", f"echo job >> {log}"])
            info = await system.wait_job(job_id)
            assert info.state == "succeeded"
    assert lines(log) == [f"on_acquire gpu0 {job_id} test-host", "job"]


async def test_failed_acquire_refuses_the_job_and_quarantines_the_device(tmp_path: Path) -> None:
    acquire = script(tmp_path / "acquire.sh", 'echo "no lease for you" >&2; exit 4')
    dev = DeviceConfig(name="gpu0", on_acquire=acquire)
    ran = tmp_path / "ran"
    with trio.fail_after(30):
        async with local_system(config(tmp_path, dev)) as system:
            job_id = system.submit(["touch", str(ran)])
            await wait_device(system, "gpu0", "quarantined")
            # Refused is not terminal: the controller requeues it as a new attempt.
            await system.wait_until(lambda: system.job(job_id).state == "queued")
            info = system.job(job_id)
            assert info.attempts[0].note.startswith("refused")
            assert "on_acquire" in info.attempts[0].note
            assert "no lease for you" in info.attempts[0].note
            fault = system.device("gpu0").faults[0]
            assert fault.kind == "hook_failed"
            assert "exited 4" in fault.reason + fault.detail
            assert system.worker.devices["gpu0"].lease.state == "quarantined"
            system.store.cancel(job_id)
    assert not ran.exists()


async def test_acquire_hook_past_its_timeout_is_killed_and_fails(tmp_path: Path) -> None:
    acquire = script(tmp_path / "acquire.sh", "exec sleep 30")
    dev = DeviceConfig(name="gpu0", on_acquire=acquire, timeout=0.5)
    with trio.fail_after(30):
        async with local_system(config(tmp_path, dev)) as system:
            job_id = system.submit(["true"])
            await wait_device(system, "gpu0", "quarantined")
            await system.wait_until(lambda: system.job(job_id).state == "queued")
            assert "timed out" in system.job(job_id).attempts[0].note
            system.store.cancel(job_id)


async def test_hook_that_backgrounds_a_process_is_a_successful_hook(tmp_path: Path) -> None:
    acquire = script(tmp_path / "acquire.sh", "sleep 30 &\nexit 0")
    dev = DeviceConfig(name="gpu0", on_acquire=acquire, release_linger=0.0)
    with trio.fail_after(30):
        async with local_system(config(tmp_path, dev)) as system:
            job_id = system.submit(["echo", "ran"])
            info = await system.wait_job(job_id)
            assert info.state == "succeeded"
            assert system.output(job_id) == b"ran\n"


# -- linger and release -------------------------------------------------------


async def test_linger_reuses_the_lease_then_releases_once(tmp_path: Path) -> None:
    log = tmp_path / "hooks.log"
    acquire = script(tmp_path / "acquire.sh", f"echo acquire >> {log}")
    release = script(tmp_path / "release.sh", f'echo "release $RC_JOB_ID" >> {log}')
    dev = DeviceConfig(name="gpu0", on_acquire=acquire, on_release=release, release_linger=1.5)
    with trio.fail_after(30):
        async with local_system(config(tmp_path, dev)) as system:
            first = system.submit(["echo", "1"])
            assert (await system.wait_job(first)).state == "succeeded"
            await wait_worker_state(system, "gpu0", "lingering")
            second = system.submit(["echo", "2"])
            assert (await system.wait_job(second)).state == "succeeded"
            await wait_worker_state(system, "gpu0", "free")
    assert lines(log) == ["acquire", f"release {second}"]


async def test_failed_release_hook_quarantines_the_device(tmp_path: Path) -> None:
    release = script(tmp_path / "release.sh", "echo stuck >&2; exit 1")
    dev = DeviceConfig(name="gpu0", on_release=release, release_linger=0.0)
    with trio.fail_after(30):
        async with local_system(config(tmp_path, dev)) as system:
            job_id = system.submit(["true"])
            assert (await system.wait_job(job_id)).state == "succeeded"
            await wait_device(system, "gpu0", "quarantined")
            fault = system.device("gpu0").faults[0]
            assert fault.kind == "hook_failed"
            assert "on_release" in fault.reason + fault.detail


# -- verify -------------------------------------------------------------------


async def test_verify_pass_runs_in_name_order_with_the_exit_code(tmp_path: Path) -> None:
    log = tmp_path / "verify.log"
    vdir = tmp_path / "verify.d"
    script(vdir / "20-second", f'echo "second $RC_JOB_EXIT_CODE" >> {log}')
    script(vdir / "10-first", f'echo "first $RC_DEVICE $RC_JOB_ID" >> {log}')
    (vdir / ".hidden").write_text("#!/bin/sh\nexit 1\n")
    (vdir / "30-not-executable").write_text("#!/bin/sh\nexit 1\n")
    with trio.fail_after(30):
        async with local_system(config(tmp_path)) as system:
            job_id = system.submit(["sh", "-c", "exit 3"])
            info = await system.wait_job(job_id)
            assert info.state == "failed"
            assert info.verify is not None
            assert info.verify.ok
            assert system.device("gpu0").state != "quarantined"
    assert lines(log) == [f"first gpu0 {job_id}", "second 3"]


async def test_failed_verify_keeps_the_outcome_and_quarantines_until_cleared(
    tmp_path: Path,
) -> None:
    vdir = tmp_path / "verify.d"
    flag = tmp_path / "broken"
    flag.touch()
    script(vdir / "10-gpu-clean", f'if [ -e {flag} ]; then echo "ecc errors: 3" >&2; exit 1; fi')
    with trio.fail_after(30):
        async with local_system(config(tmp_path)) as system:
            job_id = system.submit(["echo", "fine"])
            info = await system.wait_job(job_id)
            assert info.state == "succeeded"
            assert info.verify is not None
            assert not info.verify.ok
            assert info.verify.reason.startswith(VERIFY_REASON_PREFIX + "10-gpu-clean")
            assert "ecc errors: 3" in info.verify.reason
            assert info.fault_id is not None
            await wait_device(system, "gpu0", "quarantined")
            assert system.device("gpu0").reason == "fault"
            events = [e.type for e in system.store.events()]
            assert "verify_failed" in events
            # Not offered while quarantined: a new job waits.
            waiting = system.submit(["echo", "next"])
            await trio.sleep(1.0)
            assert system.job(waiting).state == "queued"
            flag.unlink()
            system.store.clear("test-host", "gpu0")
            assert (await system.wait_job(waiting)).state == "succeeded"


async def test_verify_script_past_its_timeout_fails_the_pass(tmp_path: Path) -> None:
    script(tmp_path / "verify.d" / "10-slow", "exec sleep 30")
    with trio.fail_after(30):
        async with local_system(config(tmp_path, verify_timeout=0.5)) as system:
            info = await system.wait_job(system.submit(["true"]))
            assert info.verify is not None
            assert not info.verify.ok
            assert "10-slow timed out" in info.verify.reason


async def test_verify_pass_budget_bounds_the_whole_pass(
    tmp_path: Path,
) -> None:
    vdir = tmp_path / "verify.d"
    script(vdir / "10-slow", "sleep 0.8")
    script(vdir / "20-never", "exit 0")
    overrides = {"verify_timeout": 5.0, "verify_pass_budget": 0.5}
    with trio.fail_after(30):
        async with local_system(config(tmp_path, **overrides)) as system:
            info = await system.wait_job(system.submit(["true"]))
            assert info.verify is not None
            assert not info.verify.ok
            # The first script is cut off by the pass budget, not its own timeout,
            # and the second is never started.
            assert "10-slow: stopped when the pass budget of 0.5s ran out" in info.verify.reason


async def test_missing_verify_dir_is_ok(tmp_path: Path) -> None:
    with trio.fail_after(30):
        async with local_system(config(tmp_path)) as system:
            info = await system.wait_job(system.submit(["true"]))
            assert info.verify is not None
            assert info.verify.ok


# -- cancel ---------------------------------------------------------------------


async def test_cancel_a_running_job_kills_it_with_the_reason(tmp_path: Path) -> None:
    with trio.fail_after(30):
        async with local_system(config(tmp_path)) as system:
            job_id = system.submit(["sh", "-c", "echo started; exec sleep 30"], grace_s=1)
            await system.wait_until(lambda: system.output(job_id) == b"started\n")
            system.store.cancel(job_id, "cancelled by alice")
            info = await system.wait_job(job_id)
            assert info.state == "killed"
            assert info.killed is True
            assert info.reason.startswith("cancelled")
            assert "alice" in info.reason


async def test_cancel_during_the_acquire_hook_never_starts_the_job(tmp_path: Path) -> None:
    started = tmp_path / "acquire-started"
    ran = tmp_path / "job-ran"
    acquire = script(tmp_path / "acquire.sh", f"touch {started}; exec sleep 30")
    dev = DeviceConfig(name="gpu0", on_acquire=acquire, timeout=60.0, release_linger=0.0)
    with trio.fail_after(30):
        async with local_system(config(tmp_path, dev)) as system:
            job_id = system.submit(["touch", str(ran)])
            await system.wait_until(started.exists)
            system.store.cancel(job_id, "changed my mind")
            # The controller learns of a cancel for an unstarted job at once;
            # the worker learns it from the next heartbeat and kills the hook.
            await wait_worker_state(system, "gpu0", "free")
            assert system.job(job_id).state == "killed"
            assert system.device("gpu0").state != "quarantined"
    assert not ran.exists()


async def test_cancel_during_the_verify_pass_keeps_the_real_outcome(tmp_path: Path) -> None:
    verifying = tmp_path / "verifying"
    script(tmp_path / "verify.d" / "10-slow", f"touch {verifying}; sleep 1")
    with trio.fail_after(30):
        async with local_system(config(tmp_path)) as system:
            job_id = system.submit(["echo", "done"])
            await system.wait_until(verifying.exists)
            system.store.cancel(job_id, "too late")
            info = await system.wait_job(job_id)
            assert info.state == "succeeded"
            assert info.verify is not None
            assert info.verify.ok


# -- idle behaviour and drain ---------------------------------------------------


async def test_hold_takes_no_new_work_and_run_resumes(tmp_path: Path) -> None:
    with trio.fail_after(30):
        async with local_system(config(tmp_path)) as system:
            system.store.set_idle_behavior("test-host", "gpu0", "hold")
            await system.wait_until(
                lambda: system.worker.devices["gpu0"].lease.idle_behavior == "hold"
            )
            job_id = system.submit(["true"])
            await trio.sleep(1.0)
            assert system.job(job_id).state == "queued"
            system.store.set_idle_behavior("test-host", "gpu0", "run")
            assert (await system.wait_job(job_id)).state == "succeeded"


async def test_drain_behaviour_releases_a_lingering_device(tmp_path: Path) -> None:
    log = tmp_path / "hooks.log"
    release = script(tmp_path / "release.sh", f"echo release >> {log}")
    dev = DeviceConfig(name="gpu0", on_release=release, release_linger=60.0)
    with trio.fail_after(30):
        async with local_system(config(tmp_path, dev)) as system:
            assert (await system.wait_job(system.submit(["true"]))).state == "succeeded"
            await wait_worker_state(system, "gpu0", "lingering")
            system.store.set_idle_behavior("test-host", "gpu0", "drain")
            await wait_worker_state(system, "gpu0", "free")
            assert lines(log) == ["release"]


async def test_worker_drain_lets_the_running_job_finish_and_releases(tmp_path: Path) -> None:
    log = tmp_path / "hooks.log"
    release = script(tmp_path / "release.sh", f"echo release >> {log}")
    dev = DeviceConfig(name="gpu0", on_release=release, release_linger=60.0)
    with trio.fail_after(30):
        async with local_system(config(tmp_path, dev)) as system:
            job_id = system.submit(["sh", "-c", "echo a; sleep 1; echo b"])
            await system.wait_until(lambda: system.output(job_id) == b"a\n")
            system.worker.drain()
            info = await system.wait_job(job_id)
            assert info.state == "succeeded"
            assert system.output(job_id) == b"a\nb\n"
    # Leaving local_system waited for the drain to complete: released.
    assert lines(log) == ["release"]


async def test_worker_stop_cancels_the_running_job_and_reports_it(tmp_path: Path) -> None:
    with trio.fail_after(30):
        async with local_system(config(tmp_path)) as system:
            job_id = system.submit(["sh", "-c", "echo a; exec sleep 30"], grace_s=1)
            await system.wait_until(lambda: system.output(job_id) == b"a\n")
            system.worker.stop()
            info = await system.wait_job(job_id)
            assert info.state == "killed"
            assert "shutting down" in info.reason


# -- environment ------------------------------------------------------------------


async def test_token_and_worker_settings_never_reach_children(tmp_path: Path) -> None:
    out = tmp_path / "envs"
    out.mkdir()
    acquire = script(tmp_path / "acquire.sh", f"env > {out}/acquire")
    release = script(tmp_path / "release.sh", f"env > {out}/release")
    script(tmp_path / "verify.d" / "10-env", f"env > {out}/verify")
    script(tmp_path / "probe.d" / "10-env", f"env > {out}/probe; echo '{{}}'")
    dev = DeviceConfig(name="gpu0", on_acquire=acquire, on_release=release, release_linger=0.0)
    environ = {
        **os.environ,
        "RC_TOKEN": "sekrit-token-from-env",
        "RC_WORKER_CONFIG": "/etc/rc/worker.yaml",
        "RC_CONTROLLER_URL": "http://example.invalid",
    }
    with trio.fail_after(30):
        async with local_system(config(tmp_path, dev), environ=environ) as system:
            job_id = system.submit(["env"], env={"SEED": "1"})
            assert (await system.wait_job(job_id)).state == "succeeded"
            await wait_worker_state(system, "gpu0", "free")
            job_env = system.output(job_id).decode()
            token = system.config.token
    assert token is not None
    texts = [job_env] + [p.read_text() for p in sorted(out.iterdir())]
    assert len(texts) == 5
    for text in texts:
        assert token not in text
        assert "sekrit-token-from-env" not in text
        assert "RC_WORKER_CONFIG" not in text
        assert "RC_CONTROLLER_URL" not in text
    assert "SEED=1" in job_env
    assert f"RC_JOB_ID={job_id}" in job_env
    assert "RC_DEVICE=gpu0" in job_env
    assert "RC_HOST=test-host" in job_env
    assert "CUDA_VISIBLE_DEVICES=0" in job_env


async def test_device_max_runtime_is_a_ceiling_on_the_job(tmp_path: Path) -> None:
    dev = DeviceConfig(name="gpu0", max_runtime=0.5)
    with trio.fail_after(30):
        async with local_system(config(tmp_path, dev)) as system:
            info = await system.wait_job(
                system.submit(["sleep", "30"], max_runtime_s=600, grace_s=0.5)
            )
            assert info.state == "killed"
            assert info.reason == "max_runtime"


async def test_a_fault_on_one_device_leaves_the_other_serving(tmp_path: Path) -> None:
    linger = 0.0
    bad = script(tmp_path / "bad-acquire.sh", "exit 1")
    devices = (
        DeviceConfig(name="gpu0", on_acquire=bad, release_linger=linger),
        DeviceConfig(name="gpu1", release_linger=linger),
    )
    with trio.fail_after(30):
        async with local_system(config(tmp_path, *devices)) as system:
            first = system.submit(["true"], device="test-host/gpu0")
            await wait_device(system, "gpu0", "quarantined")
            system.store.cancel(first)
            other = system.submit(["echo", "ok"], device="test-host/gpu1")
            assert (await system.wait_job(other)).state == "succeeded"


async def test_a_bug_while_serving_one_device_quarantines_it_and_spares_the_rest(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import rc_worker.device

    real_verify = rc_worker.device.run_verify

    async def verify_that_breaks_on_gpu0(*args: Any, **kwargs: Any) -> VerifyResult:
        if kwargs["env"]["RC_DEVICE"] == "gpu0":
            raise RuntimeError("boom")
        return await real_verify(*args, **kwargs)

    monkeypatch.setattr(rc_worker.device, "run_verify", verify_that_breaks_on_gpu0)
    with trio.fail_after(30):
        async with local_system(config(tmp_path, "gpu0", "gpu1")) as system:
            broken = system.submit(["echo", "out"], device="test-host/gpu0")
            info = await system.wait_job(broken)
            assert info.state == "error"
            assert info.error is not None
            assert "internal worker error: RuntimeError: boom" in info.error
            assert system.output(broken) == b"out\n"
            await wait_device(system, "gpu0", "quarantined")
            assert system.device("gpu0").faults[0].kind == "dirty"
            fine = system.submit(["echo", "ok"], device="test-host/gpu1")
            assert (await system.wait_job(fine)).state == "succeeded"


async def test_a_bug_after_the_disk_refused_the_output_reports_what_was_delivered(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The disk refuses every append (ENOSPC): the spool holds its marker in memory and
    ships it, so the spool counts those bytes and the output file has none. The finish a
    bug forces must say the spool's count, as every other finish does: before, it said the
    file's size (0), less than the controller was sent."""
    import rc_worker.device
    import rc_worker.statestore

    def full(self: object, data: memoryview) -> int:
        raise OSError(errno.ENOSPC, "No space left on device")

    async def verify_that_breaks(*args: Any, **kwargs: Any) -> VerifyResult:
        raise RuntimeError("boom")

    monkeypatch.setattr(rc_worker.statestore._LinuxAppend, "write", full)
    monkeypatch.setattr(rc_worker.device, "run_verify", verify_that_breaks)
    with trio.fail_after(30):
        async with local_system(config(tmp_path, "gpu0")) as system:
            broken = system.submit(["echo", "out"], device="test-host/gpu0")
            info = await system.wait_job(broken)
            assert info.state == "error"
            assert "internal worker error: RuntimeError: boom" in (info.error or "")
            output = system.output(broken)
            assert b"ENOSPC" in output  # the spool's marker, from memory
            assert info.output_bytes == len(output)


async def test_shutdown_grace_bounds_the_drain(tmp_path: Path) -> None:
    with trio.fail_after(30):
        async with local_system(config(tmp_path, shutdown_grace=0.5)) as system:
            job_id = system.submit(["sh", "-c", "echo a; exec sleep 30"], grace_s=0.5)
            await system.wait_until(lambda: system.output(job_id) == b"a\n")
            system.worker.drain()
            info = await system.wait_job(job_id)
            assert info.state == "killed"
            assert "shutting down" in info.reason
