"""A clear or an idle behaviour change reaches the worker through the host watch, not at
its next heartbeat (issue 14: "a cancel, clear or idle change wakes that host").

The heartbeat is an hour in these tests: a change that waited for it would leave the
device waiting until the test's guard fails it. No timing is asserted.
"""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
import trio
from workerproc import TOKEN, serve_controller, wait_store, worker_process, write_config

from rc_worker.controller.store import Store, StoreConfig
from rc_worker.core.config import DeviceConfig
from rc_worker.core.model import IdleBehavior
from rc_worker.testing import LocalSystem, local_system, make_config

HOUR = 3600.0


def _config(tmp_path: Path, *devices: DeviceConfig | str):  # type: ignore[no-untyped-def]
    return make_config(
        tmp_path, devices=devices or ("gpu0",), heartbeat_interval=HOUR, poll_wait=HOUR
    )


async def _quarantined(system: LocalSystem) -> str:
    fault_id = system.worker.devices["gpu0"].raise_fault("test", "raised by the test")
    await system.wait_until(lambda: fault_id in {f.fault_id for f in system.device("gpu0").faults})
    return fault_id


async def test_a_clear_frees_a_quarantined_device_without_a_heartbeat(tmp_path: Path) -> None:
    with trio.fail_after(60):
        async with local_system(_config(tmp_path)) as system:
            await _quarantined(system)
            job_id = system.submit(["true"])
            system.store.clear("test-host", "gpu0")
            assert (await system.wait_job(job_id)).state == "succeeded"
            assert not system.worker.devices["gpu0"].lease.faults


async def test_a_host_clear_reaches_every_device_without_a_heartbeat(tmp_path: Path) -> None:
    with trio.fail_after(60):
        async with local_system(_config(tmp_path, "gpu0", "gpu1")) as system:
            for name in ("gpu0", "gpu1"):
                system.worker.devices[name].raise_fault("test", "raised by the test")
            await system.wait_until(
                lambda: all(system.device(n).state == "quarantined" for n in ("gpu0", "gpu1"))
            )
            for name in ("gpu0", "gpu1"):
                system.store.clear("test-host", name)
            ids = [system.submit(["true"], device=f"test-host/{n}") for n in ("gpu0", "gpu1")]
            for job_id in ids:
                assert (await system.wait_job(job_id)).state == "succeeded"


async def test_hold_and_resume_reach_the_worker_without_a_heartbeat(tmp_path: Path) -> None:
    with trio.fail_after(60):
        async with local_system(_config(tmp_path)) as system:
            # A job keeps the watch open; the hold set meanwhile reaches the worker by it.
            first = system.submit(["sleep", "0.5"])
            await system.wait_until(lambda: system.job(first).state == "running")
            system.store.set_idle_behavior("test-host", "gpu0", "hold")
            await system.wait_until(
                lambda: system.worker.devices["gpu0"].lease.idle_behavior == "hold"
            )
            assert (await system.wait_job(first)).state == "succeeded"
            second = system.submit(["true"])
            await trio.sleep(0.5)
            assert system.job(second).state == "queued"
            # The device is held, offered nowhere: only the watch can bring `run`.
            system.store.set_idle_behavior("test-host", "gpu0", "run")
            assert (await system.wait_job(second)).state == "succeeded"
            assert system.worker.devices["gpu0"].lease.idle_behavior == "run"


async def test_drain_releases_a_lingering_device_without_a_heartbeat(tmp_path: Path) -> None:
    log = tmp_path / "hooks.log"
    release = tmp_path / "release.sh"
    release.write_text(f"#!/bin/sh\necho release >> {log}\n")
    release.chmod(0o755)
    dev = DeviceConfig(name="gpu0", on_release=str(release), release_linger=HOUR)
    with trio.fail_after(60):
        async with local_system(_config(tmp_path, dev)) as system:
            assert (await system.wait_job(system.submit(["true"]))).state == "succeeded"
            await system.wait_until(
                lambda: system.worker.devices["gpu0"].lease.state == "lingering"
            )
            system.store.set_host_idle_behavior("test-host", "drain")
            await system.wait_until(lambda: system.worker.devices["gpu0"].lease.state == "free")
            assert log.read_text().splitlines() == ["release"]


async def test_a_clear_reaches_a_real_worker_process_without_a_heartbeat(tmp_path: Path) -> None:
    """``rc-worker run`` against a served controller, over real sockets: a verify pass
    that fails quarantines the device, and the operator's clear frees it at once."""
    verify = tmp_path / "verify.d"
    verify.mkdir()
    marker = tmp_path / "failed-once"
    script = verify / "10-once"
    script.write_text(f"#!/bin/sh\n[ -e {marker} ] && exit 0\ntouch {marker}\nexit 1\n")
    script.chmod(0o755)
    store = Store(StoreConfig(heartbeat_interval_s=HOUR, poll_wait_s=HOUR))
    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            url = await serve_controller(nursery, store, {TOKEN: "op-host"})
            async with worker_process(write_config(tmp_path, url)):
                await wait_store(store, lambda: any(d.host == "op-host" for d in store.devices()))
                first = store.submit(["true"])
                await wait_store(
                    store, lambda: store.device("op-host", "gpu0").state == "quarantined"
                )
                assert store.job(first).state == "succeeded"
                second = store.submit(["true"])
                store.clear("op-host", "gpu0")
                await wait_store(store, lambda: store.job(second).state == "succeeded")
            nursery.cancel_scope.cancel()


class _LateHeartbeat(httpx.AsyncBaseTransport):
    """Delivers one heartbeat's answer, computed at once by the controller, only when
    ``gate`` is set: an answer overtaken by a later change (armed by ``armed``)."""

    def __init__(self, inner: httpx.AsyncBaseTransport) -> None:
        self.inner = inner
        self.armed = False
        self.computed = trio.Event()
        self.gate = trio.Event()

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        response = await self.inner.handle_async_request(request)
        if self.armed and request.url.path.endswith("/heartbeat"):
            self.armed = False
            await response.aread()
            self.computed.set()
            await self.gate.wait()
        return response


async def test_a_late_heartbeat_answer_does_not_undo_what_the_watch_brought(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A heartbeat answer says ``hold``; before it lands, the operator resumes the device
    and the watch brings ``run``. Applied late, the answer puts ``hold`` back: the watch
    must ask again at once, not leave the device held until the next heartbeat."""
    late: list[_LateHeartbeat] = []

    def wrap(inner: httpx.AsyncBaseTransport) -> httpx.AsyncBaseTransport:
        late.append(_LateHeartbeat(inner))
        return late[0]

    with trio.fail_after(60):
        async with local_system(_config(tmp_path), transport_wrapper=wrap) as system:
            hb, dev = late[0], system.worker.devices["gpu0"]
            applied: list[str] = []  # every idle behaviour handed to the device
            original = dev.set_idle_behavior

            def spy(behavior: IdleBehavior) -> bool:
                applied.append(str(behavior))
                return original(behavior)

            monkeypatch.setattr(dev, "set_idle_behavior", spy)
            system.store.set_idle_behavior("test-host", "gpu0", "hold")
            system.worker._heartbeat_now.set()  # an idle `run` device keeps no watch
            await system.wait_until(lambda: dev.lease.idle_behavior == "hold")
            hb.armed = True
            system.worker._heartbeat_now.set()
            await hb.computed.wait()  # its answer says `hold`, and waits
            system.store.set_idle_behavior("test-host", "gpu0", "run")
            await system.wait_until(lambda: dev.lease.idle_behavior == "run")
            mark = len(applied)
            hb.gate.set()
            await system.wait_until(lambda: "hold" in applied[mark:])  # put back
            job_id = system.submit(["true"])
            assert (await system.wait_job(job_id)).state == "succeeded"
            assert dev.lease.idle_behavior == "run"
