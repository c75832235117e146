"""GPU health end to end: a worker, the reference controller and a fake nvidia-smi on PATH.

The fake (tests/probe_helpers/fake_gpu_smi.py) answers every query the worker
makes from a JSON table the test edits between checks; a plain file stands in
for the kernel log. Real processes, real clock; every wait is bounded.
"""

from __future__ import annotations

import json
import logging
import sys
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import attrs
import httpx
import pytest
import trio

from rc_worker.controller import create_app, rc_cli
from rc_worker.core.config import DeviceConfig, GpuHealthConfig
from rc_worker.testing import USER_TOKEN, LocalSystem, local_system, make_config

if TYPE_CHECKING:
    from rc_worker.core.mig_share import RunningJob
    from rc_worker.gpu_health_run import DeviceVerdict, GpuHealthMonitor

FAKE = Path(__file__).parent / "probe_helpers" / "fake_gpu_smi.py"
UUID0 = "GPU-0f3c2a51-8d4e-4b7a-a1c9-3e5d7f9b2c01"
UUID1 = "GPU-3c906eb4-5d8f-413a-a04c-7ebf2d916034"
MIG1 = "MIG-a25704ba-3a06-5299-a795-fd7cf4d13973"
MIG2 = "MIG-50f1c4c9-1508-5e8d-bb06-d08145b22e01"
HEALTHY = {
    "ecc.errors.corrected.volatile.total": "0",
    "ecc.errors.uncorrected.volatile.total": "0",
    "remapped_rows.correctable": "0",
    "remapped_rows.uncorrectable": "0",
    "remapped_rows.pending": "No",
    "remapped_rows.failure": "No",
}


class Gpus:
    """The fake's table, written through on every change."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.table: dict[str, Any] = {
            "gpus": [
                {
                    "index": 0,
                    "uuid": UUID0,
                    "pci.bus_id": "00000000:18:00.0",
                    "fields": dict(HEALTHY),
                },
                {
                    "index": 1,
                    "uuid": UUID1,
                    "pci.bus_id": "00000000:3B:00.0",
                    "fields": dict(HEALTHY),
                },
            ],
            "apps": [],
        }
        self.write()

    def write(self) -> None:
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.table))
        tmp.replace(self.path)  # the fake never reads half a table

    def set(self, key: str, value: Any) -> None:
        self.table[key] = value
        self.write()

    def gpu(self, index: int) -> dict[str, Any]:
        gpu: dict[str, Any] = self.table["gpus"][index]
        return gpu


@pytest.fixture
def gpus(tmp_path: Path) -> Gpus:
    return Gpus(tmp_path / "gpus.json")


def environ(tmp_path: Path, gpus: Gpus) -> dict[str, str]:
    bindir = tmp_path / "bin"
    bindir.mkdir(exist_ok=True)
    for tool in ("nvidia-smi", "lspci"):
        wrapper = bindir / tool
        wrapper.write_text(f'#!/bin/sh\nexec {sys.executable} {FAKE} {tool} "$@"\n')
        wrapper.chmod(0o755)
    return {
        "PATH": f"{bindir}:/usr/bin:/bin",
        "FAKE_GPU_TABLE": str(gpus.path),
        "FAKE_GPU_LOG": str(tmp_path / "calls.log"),
    }


def config(tmp_path: Path, *devices: DeviceConfig | str, interval: float = 0.3, **kw: Any):  # type: ignore[no-untyped-def]
    health = GpuHealthConfig(
        enabled="true", interval=interval, kernel_log=str(tmp_path / "kmsg"), check_timeout=8.0
    )
    (tmp_path / "kmsg").touch()
    fields: dict[str, Any] = {
        "heartbeat_interval": 0.2,
        "gpu_health": health,
        "probe_interval": 3600.0,
    }
    fields.update(kw)
    return make_config(tmp_path, devices=devices or ("gpu0", "gpu1"), **fields)


def kernel(tmp_path: Path, line: str) -> None:
    with (tmp_path / "kmsg").open("a") as f:
        f.write(line + "\n")


async def rc_json(system: LocalSystem, *argv: str) -> Any:
    """``rc ... --json`` against the system's controller, its stdout parsed."""
    app = create_app(store=system.store, user_tokens=[f"{USER_TOKEN}=ops:admin"])
    out: list[str] = []
    orig = rc_cli._out
    rc_cli._out = out.append  # type: ignore[assignment]
    try:
        status = await rc_cli.amain(
            [*argv, "--json"],
            env={"RC_URL": "http://rc", "RC_USER_TOKEN": USER_TOKEN},
            transport=httpx.ASGITransport(app=app),
        )
    finally:
        rc_cli._out = orig  # type: ignore[assignment]
    assert status == 0
    return json.loads("".join(out))


def lease(system: LocalSystem, name: str) -> Any:
    return system.worker.devices[name].lease


def faults(system: LocalSystem, name: str) -> list[Any]:
    return list(system.device(name).faults)


async def wait_fault(system: LocalSystem, name: str, kind: str) -> Any:
    await system.wait_until(lambda: any(f.kind == kind for f in faults(system, name)))
    return next(f for f in faults(system, name) if f.kind == kind)


def labels(system: LocalSystem, name: str) -> dict[str, str]:
    return dict(system.device(name).facts)


# -- healthy ---------------------------------------------------------------------


async def test_healthy_gpus_run_jobs_and_say_so_in_labels(tmp_path: Path, gpus: Gpus) -> None:
    with trio.fail_after(60):
        async with local_system(config(tmp_path), environ=environ(tmp_path, gpus)) as system:
            job = system.submit(["true"], device="test-host/gpu1")
            assert (await system.wait_job(job)).state == "succeeded"
            await system.wait_until(lambda: labels(system, "gpu0").get("gpu_health") == "ok")
            facts = labels(system, "gpu0")
            assert facts["ecc_uncorrected_volatile"] == "0"
            assert facts["remapped_rows_pending"] == "no"
            assert facts["ecc_corrected_volatile"] == "0"
            assert system.device("gpu0").state == "free"
            metrics = system.worker.metrics.registry.get_sample_value(
                "rc_worker_gpu_health_checks_total", {"check": "memory", "result": "ok"}
            )
            assert metrics is not None
            assert metrics >= 1
    calls = (tmp_path / "calls.log").read_text()
    assert "--query-compute-apps=" in calls  # before the assignment, at least


# -- resident processes -----------------------------------------------------------


async def test_a_resident_process_quarantines_naming_it_until_cleared(
    tmp_path: Path, gpus: Gpus
) -> None:
    gpus.set(
        "apps", [{"gpu_uuid": UUID0, "pid": 4242, "process_name": "python3", "used_memory": 2566}]
    )
    with trio.fail_after(60):
        async with local_system(config(tmp_path), environ=environ(tmp_path, gpus)) as system:
            fault = await wait_fault(system, "gpu0", "gpu_resident_process")
            assert "pid 4242 (python3, 2566 MiB)" in fault.detail
            assert (fault.severity, fault.action) == ("warning", "clear")
            assert faults(system, "gpu1") == []
            body = await rc_json(system, "devices")
            [gpu0] = [d for d in body["devices"] if d["device"] == "gpu0"]
            assert gpu0["faults"][0]["action"] == "clear"
            assert gpu0["faults"][0]["severity"] == "warning"
            assert gpu0["faults"][0]["kind"] == "gpu_resident_process"
            # The operator kills it, then clears: the device is offered again.
            gpus.set("apps", [])
            await rc_json(system, "clear", "test-host/gpu0")
            job = system.submit(["true"], device="test-host/gpu0")
            assert (await system.wait_job(job)).state == "succeeded"


async def test_a_process_left_after_a_job_quarantines_before_verify(
    tmp_path: Path, gpus: Gpus
) -> None:
    # The job puts a process (not its own) on the GPU: the check after the
    # sweep finds it. The idle check is slow here, so only the gate sees it.
    apps = json.dumps([{"gpu_uuid": UUID0, "pid": 1, "process_name": "leftover", "used_memory": 7}])
    script = (
        f"import json; p={str(gpus.path)!r}; t=json.load(open(p)); t['apps']={apps};"
        "json.dump(t, open(p + '.new', 'w')); import os; os.replace(p + '.new', p)"
    )
    with trio.fail_after(60):
        async with local_system(
            config(tmp_path, interval=3600.0), environ=environ(tmp_path, gpus)
        ) as system:
            job = system.submit([sys.executable, "-c", script], device="test-host/gpu0")
            info = await system.wait_job(job)
            assert info.state == "succeeded"  # the outcome is the job's own
            fault = await wait_fault(system, "gpu0", "gpu_resident_process")
            assert "leftover" in fault.detail
            assert fault.job_id == job


async def test_a_gpu_process_of_the_job_is_swept_not_quarantined(
    tmp_path: Path, gpus: Gpus
) -> None:
    # A process carrying the job's RC_JOB_ID, outside its process group, holding
    # GPU memory: swept like any escapee, so nothing is left resident.
    gate = tmp_path / "go"
    with trio.fail_after(60):
        async with local_system(
            config(tmp_path, interval=3600.0), environ=environ(tmp_path, gpus)
        ) as system:
            job = system.submit(
                ["sh", "-c", f"while [ ! -e {gate} ]; do sleep 0.05; done"], device="test-host/gpu0"
            )
            await system.wait_until(lambda: system.job(job).state == "running")
            escapee = await trio.lowlevel.open_process(
                ["sleep", "300"],
                env={"RC_JOB_ID": job, "PATH": "/usr/bin:/bin"},
                start_new_session=True,
            )
            try:
                gpus.set(
                    "apps",
                    [
                        {
                            "gpu_uuid": UUID0,
                            "pid": escapee.pid,
                            "process_name": "sleep",
                            "used_memory": 64,
                            "live": True,
                        }
                    ],
                )
                gate.touch()
                info = await system.wait_job(job)
                assert info.state == "succeeded"
                with trio.fail_after(10):
                    await escapee.wait()  # reaped: the sweep killed it
                assert escapee.returncode is not None
                assert escapee.returncode < 0
                assert faults(system, "gpu0") == []
                follow = system.submit(["true"], device="test-host/gpu0")
                assert (await system.wait_job(follow)).state == "succeeded"
            finally:
                if escapee.returncode is None:
                    escapee.kill()
                    with trio.move_on_after(5, shield=True):
                        await escapee.wait()


# -- fail closed -------------------------------------------------------------------


@pytest.mark.parametrize(
    ("mode", "kind", "says"),
    [
        ("hang", "query-gpu-health", "timed out after 8s"),
        ("fail", "query-gpu-health", "exit status 3"),
        ("garbage", "query-gpu-health", "no column"),
        ("hang", "compute-apps", "timed out after 8s"),
        ("garbage", "compute-apps", "no column"),
    ],
)
async def test_a_check_that_cannot_run_holds_the_device_and_lifts_by_itself(
    tmp_path: Path, gpus: Gpus, mode: str, kind: str, says: str
) -> None:
    gpus.set(mode, [kind])
    with trio.fail_after(60):
        async with local_system(config(tmp_path), environ=environ(tmp_path, gpus)) as system:
            await system.wait_until(lambda: bool(lease(system, "gpu0").health_hold))
            reason = system.worker.devices["gpu0"].health_reason()
            assert says in reason
            job = system.submit(["true"], device="test-host/gpu0")
            # Held: not offered, and not quarantined either.
            await system.wait_until(lambda: labels(system, "gpu0").get("gpu_health") == "held")
            assert not system.worker.devices["gpu0"].ready()
            assert system.job(job).state == "queued"
            assert system.device("gpu0").faults == ()
            status = system.worker.status()["devices"]["gpu0"]
            assert says in status["held_for_health"]
            # The controller shows it too, from the heartbeat.
            await system.wait_until(lambda: says in (system.device("gpu0").held_for_health or ""))
            body = await rc_json(system, "devices")
            [gpu0] = [d for d in body["devices"] if d["device"] == "gpu0"]
            assert says in gpu0["held_for_health"]
            assert gpu0["faults"] == []  # held, not quarantined
            # The check works again: the hold lifts and the job runs.
            gpus.set(mode, [])
            assert (await system.wait_job(job)).state == "succeeded"
            assert lease(system, "gpu0").health_hold == {}
            errors = system.worker.metrics.registry.get_sample_value(
                "rc_worker_gpu_health_checks_total",
                {"check": "memory" if "health" in kind else "resident", "result": "error"},
            )
            assert errors is not None
            assert errors >= 1


# -- memory ---------------------------------------------------------------------------


async def test_pending_row_remap_quarantines_with_reset(tmp_path: Path, gpus: Gpus) -> None:
    gpus.gpu(1)["fields"]["remapped_rows.pending"] = "Yes"
    gpus.gpu(1)["fields"]["remapped_rows.uncorrectable"] = "4"
    gpus.write()
    with trio.fail_after(60):
        async with local_system(config(tmp_path), environ=environ(tmp_path, gpus)) as system:
            fault = await wait_fault(system, "gpu1", "gpu_memory")
            assert (fault.severity, fault.action) == ("error", "reset")
            assert "4 uncorrectable rows" in fault.detail
            await system.wait_until(
                lambda: labels(system, "gpu1").get("remapped_rows_pending") == "yes"
            )
            assert labels(system, "gpu1")["gpu_health"] == "faulted"
            assert faults(system, "gpu0") == []


async def test_uncorrectable_ecc_growth_quarantines(tmp_path: Path, gpus: Gpus) -> None:
    with trio.fail_after(60):
        async with local_system(config(tmp_path), environ=environ(tmp_path, gpus)) as system:
            await system.wait_until(lambda: labels(system, "gpu0").get("gpu_health") == "ok")
            gpus.gpu(0)["fields"]["ecc.errors.uncorrected.volatile.total"] = "3"
            gpus.write()
            fault = await wait_fault(system, "gpu0", "gpu_memory")
            assert "grew by 3 to 3" in fault.detail
            await system.wait_until(
                lambda: (
                    system.worker.metrics.registry.get_sample_value(
                        "rc_worker_gpu_ecc_errors", {"kind": "uncorrected_volatile"}
                    )
                    == 3
                )
            )


# -- Xid -------------------------------------------------------------------------------


async def test_xid_maps_the_kernel_bus_id_to_the_device(tmp_path: Path, gpus: Gpus) -> None:
    with trio.fail_after(60):
        async with local_system(config(tmp_path), environ=environ(tmp_path, gpus)) as system:
            await system.wait_until(lambda: labels(system, "gpu1").get("gpu_health") == "ok")
            # Ignored (an application's error): counted, not quarantined.
            kernel(
                tmp_path,
                "[ 5.1] NVRM: Xid (PCI:0000:3b:00): 13, pid=77, name=python3, Graphics Exception",
            )
            # The kernel's spelling of gpu1's 00000000:3B:00.0.
            kernel(tmp_path, "[ 6.2] NVRM: Xid (PCI:0000:3b:00): 79, GPU has fallen off the bus.")
            fault = await wait_fault(system, "gpu1", "gpu_xid")
            assert (fault.severity, fault.action) == ("fatal", "reboot")
            assert "79, GPU has fallen off the bus" in fault.detail
            assert [f.kind for f in faults(system, "gpu1")] == ["gpu_xid"]
            assert faults(system, "gpu0") == []
            registry = system.worker.metrics.registry
            assert registry.get_sample_value("rc_worker_gpu_xid_total", {"code": "13"}) == 1
            assert registry.get_sample_value("rc_worker_gpu_xid_total", {"code": "79"}) == 1
            events = [e for e in system.store.events() if e.type == "device_quarantined"]
            assert events[-1].data["action"] == "reboot"
            assert events[-1].data["severity"] == "fatal"
            app = create_app(store=system.store)
            async with httpx.AsyncClient(
                transport=httpx.ASGITransport(app=app), base_url="http://rc"
            ) as http:
                text = (await http.get("/metrics")).text
            assert 'rc_controller_faults_total{action="reboot",kind="gpu_xid"} 1.0' in text
            assert (
                'rc_controller_device_faults_by_action{action="reboot",kind="gpu_xid"} 1.0' in text
            )


async def test_an_unreadable_kernel_log_turns_the_xid_check_off_without_quarantine(
    tmp_path: Path, gpus: Gpus, caplog: pytest.LogCaptureFixture
) -> None:
    cfg = config(tmp_path)
    cfg = attrs.evolve(
        cfg, gpu_health=attrs.evolve(cfg.gpu_health, kernel_log=str(tmp_path / "no" / "kmsg"))
    )
    with trio.fail_after(60):
        async with local_system(cfg, environ=environ(tmp_path, gpus)) as system:
            job = system.submit(["true"], device="test-host/gpu0")
            assert (await system.wait_job(job)).state == "succeeded"
            assert faults(system, "gpu0") == []
    assert sum("kernel log" in r.getMessage() for r in caplog.records) == 1


# -- missing GPUs --------------------------------------------------------------------------


async def test_a_lost_gpu_quarantines_with_gpu_missing(tmp_path: Path, gpus: Gpus) -> None:
    with trio.fail_after(60):
        async with local_system(config(tmp_path), environ=environ(tmp_path, gpus)) as system:
            await system.wait_until(lambda: labels(system, "gpu1").get("gpu_health") == "ok")
            gpus.gpu(1)["lost"] = True
            gpus.write()
            fault = await wait_fault(system, "gpu1", "gpu_missing")
            assert "Unable to determine the device handle" in fault.detail
            assert fault.action == "reboot"
            assert faults(system, "gpu0") == []


async def test_a_swapped_card_quarantines_with_gpu_missing(tmp_path: Path, gpus: Gpus) -> None:
    with trio.fail_after(60):
        async with local_system(config(tmp_path), environ=environ(tmp_path, gpus)) as system:
            await system.wait_until(lambda: labels(system, "gpu0").get("uuid") == UUID0)
            gpus.gpu(0)["uuid"] = "GPU-11111111-2222-3333-4444-555555555555"
            gpus.write()
            fault = await wait_fault(system, "gpu0", "gpu_missing")
            assert f"was {UUID0}" in fault.detail


async def test_fewer_gpus_than_the_pci_bus_is_a_host_fault_cleared_once(
    tmp_path: Path, gpus: Gpus
) -> None:
    gpus.set("lspci_extra", 1)
    with trio.fail_after(60):
        async with local_system(config(tmp_path), environ=environ(tmp_path, gpus)) as system:
            f0 = await wait_fault(system, "gpu0", "gpu_missing")
            f1 = await wait_fault(system, "gpu1", "gpu_missing")
            assert f0.fault_id == f1.fault_id
            assert f0.scope == "host"
            assert "3 NVIDIA GPUs on the PCI bus but nvidia-smi lists 2" in f0.detail
            body = await rc_json(system, "devices")
            for d in body["devices"]:
                assert d["faults"][0]["scope"] == "host"
                assert d["faults"][0]["action"] == "reboot"
            gpus.set("lspci_extra", 0)
            cleared = await rc_json(system, "clear", "test-host")
            assert cleared["cleared"] == {"gpu0": [f0.fault_id], "gpu1": [f0.fault_id]}
            job = system.submit(["true"], device="test-host/gpu1")
            assert (await system.wait_job(job)).state == "succeeded"


# -- MIG -------------------------------------------------------------------------------------


def mig_devices() -> Iterator[DeviceConfig | str]:
    yield "gpu0"
    yield DeviceConfig(name="gpu0-mig1", mig_of="gpu0", mig_index=1)
    yield DeviceConfig(name="gpu0-mig2", mig_of="0", mig_uuid=MIG2)


async def test_mig_slices_run_on_their_uuid_and_the_parent_is_not_offered(
    tmp_path: Path, gpus: Gpus
) -> None:
    gpus.gpu(0)["migs"] = [
        {"index": 0, "uuid": "MIG-feb88891-0321-5fef-9c87-d4af3b54259e", "profile": "1g.10gb"},
        {"index": 1, "uuid": MIG1, "profile": "1g.10gb"},
        {"index": 2, "uuid": MIG2, "profile": "1g.10gb"},
    ]
    gpus.write()
    out = tmp_path / "cuda"
    with trio.fail_after(60):
        async with local_system(
            config(tmp_path, *mig_devices()), environ=environ(tmp_path, gpus)
        ) as system:
            await system.wait_until(lambda: labels(system, "gpu0-mig1").get("mig_uuid") == MIG1)
            facts = labels(system, "gpu0-mig1")
            assert facts["parent_uuid"] == UUID0  # the parent's labels come along
            assert facts["product"] == "NVIDIA H100"
            assert not system.worker.devices["gpu0"].ready()
            # Queued first: the worker polls to run the slice's job, and still never
            # offers the parent.
            parent_job = system.submit(["true"], device="test-host/gpu0")
            job = system.submit(
                ["sh", "-c", f'echo "$CUDA_VISIBLE_DEVICES" > {out}'], device="test-host/gpu0-mig1"
            )
            assert (await system.wait_job(job)).state == "succeeded"
            assert out.read_text().strip() == MIG1
            assert system.job(parent_job).state == "queued"
            system.store.cancel(parent_job)


async def test_a_parent_fault_quarantines_every_slice_and_its_clear_clears_them(
    tmp_path: Path, gpus: Gpus
) -> None:
    gpus.gpu(0)["migs"] = [{"index": 1, "uuid": MIG1, "profile": "3g.40gb"}]
    gpus.write()
    with trio.fail_after(60):
        async with local_system(
            config(tmp_path, *mig_devices()), environ=environ(tmp_path, gpus)
        ) as system:
            await system.wait_until(lambda: labels(system, "gpu0-mig2").get("gpu_health") == "ok")
            kernel(tmp_path, "NVRM: Xid (PCI:0000:18:00): 48, An uncorrectable double bit error")
            parent = await wait_fault(system, "gpu0", "gpu_xid")
            for name in ("gpu0-mig1", "gpu0-mig2"):
                child = await wait_fault(system, name, "gpu_xid")
                assert child.parent_fault == parent.fault_id
                assert child.action == "reset"
            await rc_json(system, "clear", "test-host/gpu0")
            await system.wait_until(
                lambda: all(faults(system, n) == [] for n in ("gpu0", "gpu0-mig1", "gpu0-mig2"))
            )
            job = system.submit(["true"], device="test-host/gpu0-mig2")
            assert (await system.wait_job(job)).state == "succeeded"


async def test_ecc_growth_read_through_a_slice_quarantines_the_gpu_and_every_slice(
    tmp_path: Path, gpus: Gpus
) -> None:
    """The ECC counters are the card's: growth first read by one slice's gate (before an
    assignment) quarantined that slice alone, and the growth, then the baseline, was
    gone for its siblings and the GPU's device."""
    gpus.gpu(0)["migs"] = [{"index": 1, "uuid": MIG1, "profile": "3g.40gb"}]
    gpus.write()
    # One idle pass (the baseline), then none: the slice's gate is the first to read.
    cfg = config(tmp_path, *mig_devices(), interval=3600.0)
    with trio.fail_after(60):
        async with local_system(cfg, environ=environ(tmp_path, gpus)) as system:
            await system.wait_until(lambda: labels(system, "gpu0-mig2").get("gpu_health") == "ok")
            gpus.gpu(0)["fields"]["ecc.errors.uncorrected.volatile.total"] = "2"
            gpus.write()
            job = system.submit(["true"], device="test-host/gpu0-mig2")
            child = await wait_fault(system, "gpu0-mig2", "gpu_memory")
            assert child.parent_fault is not None
            parent = await wait_fault(system, "gpu0", "gpu_memory")
            assert "grew by 2 to 2" in parent.detail
            assert child.parent_fault == parent.fault_id
            sibling = await wait_fault(system, "gpu0-mig1", "gpu_memory")
            assert sibling.parent_fault == parent.fault_id
            # The refused job waits; clearing the GPU clears its slices, and it runs.
            await rc_json(system, "clear", "test-host/gpu0")
            assert (await system.wait_job(job)).state == "succeeded"
            assert all(faults(system, n) == [] for n in ("gpu0", "gpu0-mig1", "gpu0-mig2"))


async def gpu_and_slices_faulted(system: LocalSystem, kind: str) -> None:
    """gpu0 holds a ``kind`` fault and each slice one naming it, whatever read it."""
    parent = await wait_fault(system, "gpu0", kind)
    for name in ("gpu0-mig1", "gpu0-mig2"):
        child = await wait_fault(system, name, kind)
        assert child.parent_fault == parent.fault_id, name
        assert f"parent gpu0: {parent.detail}" == child.detail


@pytest.mark.parametrize("how", ["lost", "xid"])
async def test_a_gpu_fault_read_through_one_slice_quarantines_the_gpu_and_every_slice(
    tmp_path: Path, gpus: Gpus, how: str
) -> None:
    """A lost GPU (``gpu_missing``) or an Xid on its bus, first read by one slice's gate
    (the GPU's device carries the slices and is never gated), quarantined that slice
    alone, by a fault naming no GPU's: its siblings ran on until a later check raised
    theirs, and ``rc clear HOST/gpu0`` left the slice quarantined. Now the GPU's device
    and every slice are quarantined in that one check, and clearing gpu0 clears them."""
    gpus.gpu(0)["migs"] = [{"index": 1, "uuid": MIG1, "profile": "3g.40gb"}]
    gpus.write()
    # One idle pass, then none: the slice's gate is the only check that reads the fault.
    cfg = config(tmp_path, *mig_devices(), interval=3600.0)
    kind = {"lost": "gpu_missing", "xid": "gpu_xid"}[how]
    with trio.fail_after(60):
        async with local_system(cfg, environ=environ(tmp_path, gpus)) as system:
            await system.wait_until(lambda: labels(system, "gpu0-mig2").get("gpu_health") == "ok")
            passes = system.worker.metrics.registry.get_sample_value(
                "rc_worker_gpu_health_checks_total", {"check": "xid", "result": "ok"}
            )
            if how == "lost":
                gpus.gpu(0)["lost"] = True
                gpus.write()
            else:
                kernel(tmp_path, "NVRM: Xid (PCI:0000:18:00): 79, GPU has fallen off the bus.")
            job = system.submit(["true"], device="test-host/gpu0-mig2")
            await gpu_and_slices_faulted(system, kind)
            # The slice's gate was the only check run meanwhile: one Xid pass.
            assert (
                system.worker.metrics.registry.get_sample_value(
                    "rc_worker_gpu_health_checks_total", {"check": "xid", "result": "ok"}
                )
                == (passes or 0) + 1
            )
            gpus.gpu(0)["lost"] = False
            gpus.write()
            await rc_json(system, "clear", "test-host/gpu0")
            assert (await system.wait_job(job)).state == "succeeded"
            assert all(faults(system, n) == [] for n in ("gpu0", "gpu0-mig1", "gpu0-mig2"))


async def test_a_slice_cleared_alone_is_quarantined_again_while_its_gpu_is_lost(
    tmp_path: Path, gpus: Gpus
) -> None:
    """Clearing one slice alone still clears that slice only; while the GPU is still
    lost the next check quarantines it again, by a fault naming the GPU's (which
    ``rc clear HOST/gpu0`` then clears), not by one of its own that clearing gpu0
    would leave in place."""
    gpus.gpu(0)["migs"] = [{"index": 1, "uuid": MIG1, "profile": "3g.40gb"}]
    gpus.write()
    with trio.fail_after(60):
        async with local_system(
            config(tmp_path, *mig_devices()), environ=environ(tmp_path, gpus)
        ) as system:
            await system.wait_until(lambda: labels(system, "gpu0-mig2").get("gpu_health") == "ok")
            gpus.gpu(0)["lost"] = True
            gpus.write()
            await gpu_and_slices_faulted(system, "gpu_missing")
            parent = await wait_fault(system, "gpu0", "gpu_missing")
            old = await wait_fault(system, "gpu0-mig2", "gpu_missing")
            cleared = await rc_json(system, "clear", "test-host/gpu0-mig2")
            assert cleared["cleared"] == [old.fault_id]
            await system.wait_until(lambda: faults(system, "gpu0-mig2") != [])
            [again] = faults(system, "gpu0-mig2")
            assert again.fault_id != old.fault_id
            assert again.parent_fault == parent.fault_id
            assert [f.fault_id for f in faults(system, "gpu0")] == [parent.fault_id]
            gpus.gpu(0)["lost"] = False
            gpus.write()
            await rc_json(system, "clear", "test-host/gpu0")
            await system.wait_until(
                lambda: all(faults(system, n) == [] for n in ("gpu0", "gpu0-mig1", "gpu0-mig2"))
            )


async def test_a_resident_process_on_a_slice_quarantines_the_slice(
    tmp_path: Path, gpus: Gpus
) -> None:
    gpus.set("apps", [{"gpu_uuid": MIG2, "pid": 99, "process_name": "train", "used_memory": 10}])
    with trio.fail_after(60):
        async with local_system(
            config(tmp_path, *mig_devices()), environ=environ(tmp_path, gpus)
        ) as system:
            fault = await wait_fault(system, "gpu0-mig2", "gpu_resident_process")
            assert "pid 99 (train, 10 MiB)" in fault.detail
            assert faults(system, "gpu0-mig1") == []


def resident_checks(system: LocalSystem) -> float:
    value = system.worker.metrics.registry.get_sample_value(
        "rc_worker_gpu_health_checks_total", {"check": "resident", "result": "ok"}
    )
    return value or 0.0


async def test_a_sibling_slices_job_listed_under_the_parent_uuid_leaves_idle_slices_alone(
    tmp_path: Path, gpus: Gpus
) -> None:
    """nvidia-smi may list a slice's processes under the parent GPU's UUID (fixture 09b):
    the idle slice and the GPU's device counted the busy sibling's job as leftovers and
    were quarantined (the device's fault reaching the busy slice too). A process no job
    owns is still resident."""
    gpus.gpu(0)["migs"] = [{"index": 1, "uuid": MIG1, "profile": "3g.40gb"}]
    gpus.write()
    gate, pidfile = tmp_path / "go", tmp_path / "job.pid"
    script = f"echo $$ > {pidfile}; while [ ! -e {gate} ]; do sleep 0.05; done"
    with trio.fail_after(60):
        async with local_system(
            config(tmp_path, *mig_devices()), environ=environ(tmp_path, gpus)
        ) as system:
            await system.wait_until(lambda: labels(system, "gpu0-mig2").get("gpu_health") == "ok")
            job = system.submit(["sh", "-c", script], device="test-host/gpu0-mig1")
            await system.wait_until(lambda: pidfile.exists() and pidfile.read_text().strip() != "")
            job_pid = int(pidfile.read_text())
            app = {"gpu_uuid": UUID0, "process_name": "train", "used_memory": 64, "live": True}
            gpus.set("apps", [{**app, "pid": job_pid}])
            seen = resident_checks(system)
            # Two more idle listings (one each pass): the second began after the change.
            await system.wait_until(lambda: resident_checks(system) >= seen + 2)
            for name in ("gpu0", "gpu0-mig1", "gpu0-mig2"):
                assert lease(system, name).faults == set(), name
            stray = await trio.lowlevel.open_process(
                ["sleep", "300"], env={"PATH": "/usr/bin:/bin"}, start_new_session=True
            )
            try:
                gpus.set("apps", [{**app, "pid": job_pid}, {**app, "pid": stray.pid}])
                fault = await wait_fault(system, "gpu0-mig2", "gpu_resident_process")
                assert f"pid {stray.pid} (train, 64 MiB)" in fault.detail
                assert f"pid {job_pid} " not in fault.detail
                assert "could not be told" not in fault.detail  # its environment was read
            finally:
                stray.kill()
                with trio.move_on_after(5, shield=True):
                    await stray.wait()
            gate.touch()
            assert (await system.wait_job(job)).state == "succeeded"


async def resident_check(
    monitor: GpuHealthMonitor,
    device: str,
    jobs: Callable[[], Mapping[str, RunningJob]],
) -> dict[str, DeviceVerdict]:
    """The resident check alone, for ``device`` of GPU 0 (UUID0), with ``jobs`` running."""
    with trio.fail_after(30):
        return await monitor.check(
            [device], expected_uuid={"gpu0": UUID0}, bus_ids={}, memory=False, xids=False, jobs=jobs
        )


async def test_a_process_under_the_parent_uuid_that_cannot_be_told_stays_resident(
    tmp_path: Path, gpus: Gpus
) -> None:
    """While a sibling slice runs a job, a process listed under the parent's UUID is let
    go only when its process group, session or RC_JOB_ID and RC_DEVICE name that job; one whose
    facts cannot be read (here: no such process) quarantines, and the reason says why."""
    from rc_worker.core.mig_share import RunningJob
    from rc_worker.gpu_health_run import GpuHealthMonitor
    from rc_worker.host import LinuxHost
    from rc_worker.metrics import WorkerMetrics

    monitor = GpuHealthMonitor(
        config(tmp_path, *mig_devices()),
        host=LinuxHost(),
        environ=environ(tmp_path, gpus),
        metrics=WorkerMetrics(),
    )
    helper = await trio.lowlevel.open_process(
        ["sleep", "300"],
        env={"RC_JOB_ID": "job-a", "RC_DEVICE": "gpu0-mig1", "PATH": "/usr/bin:/bin"},
    )
    unread = 2**31 - 1  # above any pid_max: no process has it
    try:
        gpus.set(
            "apps",
            [
                {"gpu_uuid": UUID0, "pid": helper.pid, "process_name": "hook", "used_memory": 1},
                {"gpu_uuid": UUID0, "pid": unread, "process_name": "ghost", "used_memory": 2},
            ],
        )
        jobs = {"gpu0-mig1": RunningJob("gpu0-mig1", "job-a", leader=None)}
        verdicts = await resident_check(monitor, "gpu0-mig2", lambda: jobs)
    finally:
        helper.kill()
        with trio.move_on_after(5, shield=True):
            await helper.wait()
    [fault] = verdicts["gpu0-mig2"].faults
    assert fault.kind == "gpu_resident_process"
    assert f"pid {unread} (ghost, 2 MiB)" in fault.reason
    assert f"pid {helper.pid} " not in fault.reason  # its RC_JOB_ID/RC_DEVICE: the sibling's
    assert f"pid {unread} was listed under the GPU's own UUID" in fault.reason
    assert "could not be told apart from the jobs on gpu0-mig1" in fault.reason


async def test_a_sibling_job_that_begins_during_the_listing_is_still_told(
    tmp_path: Path, gpus: Gpus
) -> None:
    """The running jobs are asked for before and after the listing: a sibling's job that
    began while the check waited for its lock, or while nvidia-smi listed, is listed but
    was not running at the first ask. Its process must not dirty the idle slice."""
    from rc_worker.core.mig_share import RunningJob
    from rc_worker.gpu_health_run import GpuHealthMonitor
    from rc_worker.host import LinuxHost
    from rc_worker.metrics import WorkerMetrics

    monitor = GpuHealthMonitor(
        config(tmp_path, *mig_devices()),
        host=LinuxHost(),
        environ=environ(tmp_path, gpus),
        metrics=WorkerMetrics(),
    )
    job = await trio.lowlevel.open_process(["sleep", "300"], start_new_session=True)
    asked: list[int] = []

    def running() -> dict[str, RunningJob]:
        asked.append(len(asked))
        # Nothing yet at the first ask; the job has begun by the second.
        return {} if len(asked) == 1 else {"gpu0-mig1": RunningJob("gpu0-mig1", "j", job.pid)}

    try:
        app = {"gpu_uuid": UUID0, "pid": job.pid, "process_name": "train", "used_memory": 1}
        gpus.set("apps", [app])
        verdicts = await resident_check(monitor, "gpu0-mig2", running)
    finally:
        job.kill()
        with trio.move_on_after(5, shield=True):
            await job.wait()
    assert len(asked) == 2
    assert verdicts["gpu0-mig2"].faults == []


# -- enabled: auto ---------------------------------------------------------------------------


async def test_auto_remembers_nvidia_smi_and_fails_closed_when_it_vanishes(
    tmp_path: Path, gpus: Gpus
) -> None:
    from rc_worker.gpu_health_run import SEEN_MARKER, GpuHealthMonitor
    from rc_worker.host import LinuxHost
    from rc_worker.metrics import WorkerMetrics

    cfg = config(tmp_path)
    cfg = attrs.evolve(cfg, gpu_health=attrs.evolve(cfg.gpu_health, enabled="auto"))
    state = tmp_path / "state"
    state.mkdir()
    bare = {"PATH": "/usr/bin:/bin"}

    def monitor(env: dict[str, str]) -> GpuHealthMonitor:
        return GpuHealthMonitor(
            cfg, host=LinuxHost(), environ=env, metrics=WorkerMetrics(), state_dir=state
        )

    assert not monitor(bare).enabled()  # never seen here: a GPU-less host stays quiet
    assert monitor(environ(tmp_path, gpus)).enabled()
    assert (state / SEEN_MARKER).exists()
    gone = monitor(bare)
    assert gone.enabled()  # seen once: its checks stay on ...
    with trio.fail_after(30):
        verdicts = await gone.check(["gpu0"], expected_uuid={}, bus_ids={})
    # ... and cannot run, so the device is held, never passed.
    assert "nvidia-smi not found on PATH" in verdicts["gpu0"].held["memory"]
    assert "memory" not in verdicts["gpu0"].passed
    assert verdicts["gpu0"].faults == []


def test_auto_looks_for_nvidia_smi_once_seen_and_recorded(tmp_path: Path, gpus: Gpus) -> None:
    """enabled() is asked before and after every job: once nvidia-smi was seen and the
    marker written, no more PATH walks; until then, every time (it may be installed)."""
    from rc_worker.gpu_health_run import GpuHealthMonitor
    from rc_worker.host import LinuxHost
    from rc_worker.metrics import WorkerMetrics

    cfg = config(tmp_path)
    cfg = attrs.evolve(cfg, gpu_health=attrs.evolve(cfg.gpu_health, enabled="auto"))
    state = tmp_path / "state"
    state.mkdir()
    host = LinuxHost()
    walks: list[str] = []
    which = host.store.which

    def counted(tool: str, path: str) -> str | None:
        walks.append(tool)
        return which(tool, path)

    host.store.which = counted  # type: ignore[method-assign,assignment]
    bare = GpuHealthMonitor(
        cfg, host=host, environ={"PATH": "/usr/bin:/bin"}, metrics=WorkerMetrics(), state_dir=state
    )
    assert [bare.enabled() for _ in range(3)] == [False] * 3
    assert len(walks) == 3  # not seen: asked again each time
    walks.clear()
    seen = GpuHealthMonitor(
        cfg, host=host, environ=environ(tmp_path, gpus), metrics=WorkerMetrics(), state_dir=state
    )
    assert [seen.enabled() for _ in range(3)] == [True] * 3
    assert len(walks) == 1


def test_status_text_shows_a_health_hold() -> None:
    from rc_worker.status import format_status

    data = {
        "host": "box1",
        "devices": {
            "gpu0": {
                "state": "free",
                "idle_behavior": "run",
                "held_for_health": "memory: nvidia-smi --query-gpu=... timed out after 10s",
            }
        },
    }
    assert "held for health: memory: nvidia-smi" in format_status(data)


async def test_a_slice_whose_mig_index_is_not_listed_is_held(tmp_path: Path, gpus: Gpus) -> None:
    # gpu0 lists no MIG device 1: the slice cannot be named in CUDA_VISIBLE_DEVICES.
    gpus.gpu(0)["migs"] = [{"index": 2, "uuid": MIG2, "profile": "1g.10gb"}]
    gpus.write()
    with trio.fail_after(60):
        async with local_system(
            config(tmp_path, *mig_devices()), environ=environ(tmp_path, gpus)
        ) as system:
            await system.wait_until(lambda: "mig" in lease(system, "gpu0-mig1").health_hold)
            assert "no MIG device 1 on GPU 0" in system.worker.devices["gpu0-mig1"].health_reason()
            assert faults(system, "gpu0-mig1") == []
            job = system.submit(["true"], device="test-host/gpu0-mig2")
            assert (await system.wait_job(job)).state == "succeeded"
            # The slice appears: the hold lifts by itself.
            gpus.gpu(0)["migs"].append({"index": 1, "uuid": MIG1, "profile": "1g.10gb"})
            gpus.write()
            await system.wait_until(lambda: lease(system, "gpu0-mig1").health_hold == {})


async def test_lspci_that_fails_holds_every_gpu_device(tmp_path: Path, gpus: Gpus) -> None:
    gpus.set("fail", ["lspci"])
    with trio.fail_after(60):
        async with local_system(config(tmp_path), environ=environ(tmp_path, gpus)) as system:
            for name in ("gpu0", "gpu1"):
                await system.wait_until(lambda n=name: "pci" in lease(system, n).health_hold)
            assert "lspci exit status 3" in system.worker.devices["gpu1"].health_reason()
            gpus.set("fail", [])
            await system.wait_until(
                lambda: all(lease(system, n).health_hold == {} for n in ("gpu0", "gpu1"))
            )


def test_a_slice_without_a_known_uuid_sees_no_gpu(tmp_path: Path) -> None:
    from rc_worker.context import WorkerContext

    cfg = config(tmp_path, *mig_devices())
    ctx = WorkerContext(
        config=cfg,
        host=None,  # type: ignore[arg-type]
        client=None,  # type: ignore[arg-type]
        outbox=None,  # type: ignore[arg-type]
        root=tmp_path,
        boot_id="b",
        environ={},
        poke_poller=lambda: None,
    )
    assert ctx.cuda_visible_devices("gpu0-mig1") == ""  # mig_index not resolved yet
    assert ctx.cuda_visible_devices("gpu0-mig2") == MIG2  # mig_uuid in the config
    ctx.device_labels["gpu0-mig1"] = {"mig_uuid": MIG1}
    assert ctx.cuda_visible_devices("gpu0-mig1") == MIG1


async def test_an_xid_for_another_gpu_read_by_a_job_gate_is_not_lost(
    tmp_path: Path, gpus: Gpus
) -> None:
    # Idle checks are slow here: the gate of a job on gpu0 reads the line for gpu1.
    with trio.fail_after(60):
        async with local_system(
            config(tmp_path, interval=3600.0), environ=environ(tmp_path, gpus)
        ) as system:
            await system.wait_until(lambda: labels(system, "gpu1").get("gpu_health") == "ok")
            kernel(tmp_path, "NVRM: Xid (PCI:0000:3b:00): 48, An uncorrectable double bit error")
            job = system.submit(["true"], device="test-host/gpu0")
            assert (await system.wait_job(job)).state == "succeeded"
            fault = await wait_fault(system, "gpu1", "gpu_xid")
            assert "48, An uncorrectable double bit error" in fault.detail
            assert faults(system, "gpu0") == []


# -- fail closed when the probe has not said (from a review) ------------------------------


def _monitor(tmp_path: Path, gpus: Gpus) -> Any:
    from rc_worker.gpu_health_run import GpuHealthMonitor
    from rc_worker.host import LinuxHost
    from rc_worker.metrics import WorkerMetrics

    return GpuHealthMonitor(
        config(tmp_path), host=LinuxHost(), environ=environ(tmp_path, gpus), metrics=WorkerMetrics()
    )


async def test_resident_processes_are_found_without_a_uuid_label(
    tmp_path: Path, gpus: Gpus
) -> None:
    """No ``uuid`` label (the first probe failed): the GPU's processes were ignored, and
    the resident check passed. Now it is held until the GPU's UUID is known, and then the
    health query's listing says which processes are its."""
    gpus.set("apps", [{"gpu_uuid": UUID0, "pid": 99, "process_name": "train", "used_memory": 7000}])
    monitor = _monitor(tmp_path, gpus)
    with trio.fail_after(30):
        first = await monitor.check(["gpu0"], expected_uuid={}, bus_ids={}, memory=False)
        assert "resident" in first["gpu0"].held
        assert "resident" not in first["gpu0"].passed
        assert first["gpu0"].faults == []
        then = await monitor.check(["gpu0"], expected_uuid={}, bus_ids={})
    assert [f.kind for f in then["gpu0"].faults] == ["gpu_resident_process"]
    assert "pid 99" in then["gpu0"].faults[0].reason


async def test_an_xid_is_mapped_without_a_pci_bus_id_label(tmp_path: Path, gpus: Gpus) -> None:
    """No ``pci_bus_id`` label: the Xid line was read, logged, and dropped for good. The
    health query's listing maps it now."""
    monitor = _monitor(tmp_path, gpus)
    kernel(tmp_path, "[ 6.2] NVRM: Xid (PCI:0000:3b:00): 79, GPU has fallen off the bus.")
    with trio.fail_after(30):
        verdicts = await monitor.check(["gpu0", "gpu1"], expected_uuid={}, bus_ids={})
    # The physical GPU's fault (raised on its device and every slice of it).
    assert [f.kind for f in verdicts["gpu1"].gpu_faults] == ["gpu_xid"]
    assert verdicts["gpu0"].gpu_faults == verdicts["gpu0"].faults == []


async def test_an_idle_check_that_raises_does_not_take_the_worker_down(
    tmp_path: Path, gpus: Gpus, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    from rc_worker.gpu_health_coord import GpuHealthCoordinator

    real = GpuHealthCoordinator.check_idle
    raised: list[int] = []

    async def once(self: GpuHealthCoordinator) -> None:
        if not raised:
            raised.append(1)
            raise RuntimeError("output no check foresaw")
        await real(self)

    monkeypatch.setattr(GpuHealthCoordinator, "check_idle", once)
    caplog.set_level(logging.ERROR, logger="rc_worker.worker")
    with trio.fail_after(60):
        async with local_system(config(tmp_path), environ=environ(tmp_path, gpus)) as system:
            await system.wait_until(lambda: bool(raised))
            job = system.submit(["true"])
            info = await system.wait_job(job)  # the worker is still there
    assert info.state == "succeeded"
    assert any("idle GPU health check failed" in r.getMessage() for r in caplog.records)


async def test_an_xid_read_before_any_bus_id_is_known_is_kept_until_it_is(
    tmp_path: Path, gpus: Gpus
) -> None:
    """No ``pci_bus_id`` label and the health query failing: no GPU's bus id is known, so
    an Xid line matched no device, was logged and dropped, and once the query answered
    the hold lifted and the Xid was gone for good. Now the devices whose bus is unknown
    stay held while it waits, and it is raised once the bus id is known."""
    monitor = _monitor(tmp_path, gpus)
    gpus.set("fail", ["query-gpu-health"])
    kernel(tmp_path, "[ 6.2] NVRM: Xid (PCI:0000:3b:00): 48, An uncorrectable double bit error")
    with trio.fail_after(30):
        first = await monitor.check(["gpu0", "gpu1"], expected_uuid={}, bus_ids={}, resident=False)
        for name in ("gpu0", "gpu1"):
            assert "xid" in first[name].held, name
            assert "xid" not in first[name].passed, name
            assert first[name].gpu_faults == []
        gpus.set("fail", [])
        then = await monitor.check(["gpu0", "gpu1"], expected_uuid={}, bus_ids={}, resident=False)
    assert [f.kind for f in then["gpu1"].gpu_faults] == ["gpu_xid"]
    assert "48, An uncorrectable double bit error" in then["gpu1"].gpu_faults[0].reason
    assert then["gpu0"].gpu_faults == []
    assert "xid" in then["gpu0"].passed
    assert "xid" in then["gpu1"].passed


async def test_an_xid_on_a_bus_no_declared_gpu_has_is_only_logged(
    tmp_path: Path, gpus: Gpus, caplog: pytest.LogCaptureFixture
) -> None:
    """A bus id that no declared GPU has, once every declared GPU's is known: another
    card (one this worker does not manage), not a reason to hold anything."""
    monitor = _monitor(tmp_path, gpus)
    kernel(tmp_path, "[ 6.2] NVRM: Xid (PCI:0000:af:00): 48, An uncorrectable double bit error")
    with trio.fail_after(30):
        verdicts = await monitor.check(
            ["gpu0", "gpu1"], expected_uuid={}, bus_ids={}, resident=False
        )
    for name in ("gpu0", "gpu1"):
        assert verdicts[name].gpu_faults == [], name
        assert verdicts[name].held == {}, name
        assert "xid" in verdicts[name].passed
    assert any("no device has that pci_bus_id" in r.getMessage() for r in caplog.records)


# -- a worker restart: what registration says of a slice's fault (from a review) -----------


async def test_a_restarted_worker_registers_its_slices_faults_linked_to_the_gpus(
    tmp_path: Path, gpus: Gpus
) -> None:
    """The GPU's fault and its slices' copies were raised, then the worker died before
    the controller heard them. The next worker claimed them at registration without
    ``parent_fault``: the controller adopted the slices' as faults of their own, the
    reports (which carry it) then counted as repeats, and clearing the GPU no longer
    cleared its slices. Now the claims say which GPU fault each copy stands for."""
    from faults import Fault as Wire
    from faults import FaultyTransport

    from rc_worker.controller import Store, StoreConfig

    gpus.gpu(0)["migs"] = [{"index": 1, "uuid": MIG1, "profile": "3g.40gb"}]
    gpus.write()
    cfg = config(tmp_path, *mig_devices())
    store = Store(StoreConfig(heartbeat_interval_s=0.2, missed_heartbeats=300, poll_wait_s=5.0))
    made: list[FaultyTransport] = []

    def wrap(inner: httpx.AsyncBaseTransport) -> httpx.AsyncBaseTransport:
        made.append(FaultyTransport(inner))
        made[0].outage("fault", Wire.UNAVAILABLE)
        return made[0]

    slices = ("gpu0-mig1", "gpu0-mig2")
    pending = Path(cfg.state_dir) / "faults"
    with trio.fail_after(60):
        async with local_system(
            cfg, store=store, environ=environ(tmp_path, gpus), transport_wrapper=wrap
        ) as system:
            await system.wait_until(lambda: labels(system, "gpu0-mig2").get("gpu_health") == "ok")
            kernel(tmp_path, "NVRM: Xid (PCI:0000:18:00): 48, An uncorrectable double bit error")
            await system.wait_until(lambda: pending.is_dir() and len(list(pending.iterdir())) == 3)
            assert all(faults(system, n) == [] for n in ("gpu0", *slices))
            await system.crash()
        (tmp_path / "kmsg").write_text("")  # the kernel log is not read again after a restart
        async with local_system(cfg, store=store, environ=environ(tmp_path, gpus)) as system:
            parent = await wait_fault(system, "gpu0", "gpu_xid")
            for name in slices:
                child = await wait_fault(system, name, "gpu_xid")
                assert child.parent_fault == parent.fault_id, name
            await rc_json(system, "clear", "test-host/gpu0")
            await system.wait_until(lambda: all(faults(system, n) == [] for n in ("gpu0", *slices)))
            events = [e for e in store.events() if e.type == "device_cleared"]
            assert {e.data["device"] for e in events} == {"gpu0", *slices}
            job = system.submit(["true"], device="test-host/gpu0-mig2")
            assert (await system.wait_job(job)).state == "succeeded"
