"""Where the GPU checks meet the devices: the gate, the idle loop, slices and labels.

``GpuHealthCoordinator`` is the worker's side of issue 15. It asks
``GpuHealthMonitor`` for verdicts and applies them to the device
supervisors:

- before every assignment and after every job (``gate``, called by the
  device through ``WorkerContext.health_gate``);
- every ``gpu_health.interval`` for idle devices (``run``), where the Xid
  and PCI-count checks run for every GPU device;
- a fault of a physical GPU quarantines every MIG slice of it, each slice's
  fault naming the parent's (``parent_fault``), so clearing the parent at
  the controller clears them; a memory fault, a missing GPU or an Xid read
  through a slice is the physical GPU's and goes the same way, in the same
  check (``core/mig_share.py``);
- a host-level fault (the PCI count) is raised on every GPU device under one
  fault id with ``scope: host``, cleared once with ``rc clear HOST``.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import TYPE_CHECKING

import trio

from rc_worker.core.gpu_health import (
    CHECK_RESIDENT,
    ComputeApp,
    Fault,
    health_label,
)
from rc_worker.core.mig_share import (
    GpuFaultPlan,
    HeldHealthFault,
    RunningJob,
    gpu_fault_plan,
    gpu_fault_steps,
    known_jobs,
)
from rc_worker.core.model import DeviceState
from rc_worker.gpu_health_run import CheckFailed, DeviceVerdict, GpuHealthMonitor, mig_parent
from rc_worker.sweep import EXEC_SETTLE, JOB_ID_VAR, sweep_job_survivors

if TYPE_CHECKING:
    from rc_worker.context import WorkerContext
    from rc_worker.core.config import Config
    from rc_worker.device import DeviceSupervisor

log = logging.getLogger("rc_worker.gpu_health")

EXITING_WAITS = (0.05, 0.1, 0.2, 0.4)
"""Pauses before listing a device's compute apps again while one is exiting."""


class GpuHealthCoordinator:
    def __init__(
        self,
        config: Config,
        monitor: GpuHealthMonitor,
        ctx: WorkerContext,
        devices: Mapping[str, DeviceSupervisor],
    ) -> None:
        self._config = config
        self.monitor = monitor
        self._ctx = ctx
        self._devices = devices
        self.slices: dict[str, list[str]] = {}
        for dev in config.devices:
            parent = mig_parent(config, dev)
            if parent is not None:
                self.slices.setdefault(parent, []).append(dev.name)
        for parent in self.slices:
            if parent in devices:
                devices[parent].carries_slices = True
        self._host_fault: str | None = None
        # Devices some check has run for: before that, no gpu_health label
        # (nothing is known, and "ok" would be a guess).
        self._checked: set[str] = set()

    # -- what the checks need from the probe ----------------------------------

    def _labels(self) -> tuple[dict[str, str], dict[str, str]]:
        uuids: dict[str, str] = {}
        buses: dict[str, str] = {}
        for name, facts in self._ctx.device_labels.items():
            if "uuid" in facts and not facts.get("mig_uuid"):
                uuids[name] = facts["uuid"]
            if "pci_bus_id" in facts:
                buses[name] = facts["pci_bus_id"]
        return uuids, buses

    def sync_slice_labels(self) -> None:
        """A slice's labels: its parent's, plus its MIG UUID (its CUDA_VISIBLE_DEVICES)."""
        for parent, names in self.slices.items():
            base = dict(self._ctx.device_labels.get(parent, {}))
            for name in names:
                facts = dict(base)
                facts.pop("uuid", None)
                if base.get("uuid"):
                    facts["parent_uuid"] = base["uuid"]
                facts["mig_parent"] = parent
                mig = self.monitor.mig_uuids.get(name)
                if mig:
                    facts["mig_uuid"] = mig
                self._ctx.device_labels[name] = facts

    def health_labels(self, device: str) -> dict[str, str]:
        """The labels selectors can use: ``gpu_health`` and the ECC facts."""
        target = self.monitor.targets.get(device)
        dev = self._devices.get(device)
        if target is None or dev is None or device not in self._checked:
            return {}
        out = dict(self.monitor.ecc_labels.get(target.index, {}))
        out["gpu_health"] = health_label(bool(dev.lease.health_hold), dev.health_faulted())
        return out

    # -- the gate --------------------------------------------------------------

    async def gate(self, device: str, job_id: str | None, grace: float) -> str | None:
        if device not in self.monitor.targets or not self.monitor.enabled():
            return None
        if job_id is not None:
            await self._after_job(device, job_id, grace)
            return None
        uuids, buses = self._labels()
        verdicts = await self.monitor.check(
            [device], expected_uuid=uuids, bus_ids=buses, jobs=self.running_jobs
        )
        self._apply(verdicts)
        dev = self._devices[device]
        if dev.lease.faults:
            return "GPU health check failed; the device is quarantined"
        if dev.lease.health_hold:
            return f"held for health: {dev.health_reason()}"
        return None

    async def _after_job(self, device: str, job_id: str, grace: float) -> None:
        """Resident processes once the job's tree is gone: the job's own are swept
        like any escapee; anything left quarantines the device."""
        dev = self._devices[device]
        uuids, _ = self._labels()
        unknown = self.monitor.uuid_unknown(device, uuids)
        if unknown is not None:
            dev.set_health_hold({CHECK_RESIDENT: unknown}, ())
            return
        before = list(self.running_jobs().values())
        try:
            apps = await self._resident(device, uuids)
            if any([await self._of_job(a.pid, job_id) for a in apps]):
                await sweep_job_survivors(job_id, grace=grace, host=self._ctx.host)
                apps = await self._resident(device, uuids)
        except CheckFailed as e:
            self.monitor.metrics.gpu_health_checks.labels(CHECK_RESIDENT, "error").inc()
            dev.set_health_hold({CHECK_RESIDENT: str(e)}, ())
            return
        self.monitor.metrics.gpu_health_checks.labels(CHECK_RESIDENT, "ok").inc()
        dev.set_health_hold({}, (CHECK_RESIDENT,))
        seen = known_jobs(before, self.running_jobs().values())
        fault = self.monitor.residents(device, apps, uuids, seen).fault()
        if fault is not None:
            self._raise(device, fault, job_id=job_id)

    async def _resident(self, device: str, uuids: Mapping[str, str]) -> list[ComputeApp]:
        """The compute apps on ``device``, once none of them is on its way out.

        A process that was just killed (by the job's sweep, say) has already
        lost its memory map but may still be listed while the kernel finishes
        its exit and the driver lets go of it; it is not resident. Listed
        again, 50 ms to 400 ms apart (750 ms at most), while any of them is.
        """
        apps = self.monitor.resident_on(device, await self.monitor.list_apps(), uuids)
        for delay in EXITING_WAITS:
            if not any(self._exiting(a.pid) for a in apps):
                break
            await trio.sleep(delay)
            apps = self.monitor.resident_on(device, await self.monitor.list_apps(), uuids)
        return apps

    def _exiting(self, pid: int) -> bool:
        try:
            self._ctx.host.environ(pid)
        except ProcessLookupError:
            return True  # gone, a zombie, or in the middle of its exit
        except OSError:
            return False
        return False

    async def _of_job(self, pid: int, job_id: str) -> bool:
        # Caught between execve(2) and the setup of its new image, a process shows
        # an empty environment for a moment (as the sweep knows), longer on a loaded
        # machine: look again a few times, 5 ms to 40 ms apart (75 ms at most).
        delay = EXEC_SETTLE
        for _ in range(5):
            try:
                env = self._ctx.host.environ(pid)
            except OSError:
                return False
            if env:
                return env.get(JOB_ID_VAR) == job_id
            await trio.sleep(delay)
            delay *= 2
        return False

    # -- the idle loop -----------------------------------------------------------

    async def run(self) -> None:
        """Every ``interval``: Xids and the PCI count for all GPU devices; memory,
        presence and residency for the idle ones (a busy GPU's processes are its job's)."""
        while True:
            if self.monitor.enabled():
                await self.check_idle()
            await trio.sleep(self._config.gpu_health.interval)

    async def check_idle(self) -> None:
        targets = list(self.monitor.targets)
        uuids, buses = self._labels()
        verdicts = await self.monitor.check(
            targets, expected_uuid=uuids, bus_ids=buses, resident=False, pci=True
        )
        idle = [d for d in targets if self._idle(d)]
        if idle:
            # Asked for after the lock is taken, before and after the listing: a
            # sibling's job that begins or ends meanwhile is still known.
            resident = await self.monitor.check(
                idle,
                expected_uuid=uuids,
                bus_ids=buses,
                memory=False,
                xids=False,
                jobs=self.running_jobs,
            )
            for name, v in resident.items():
                if not self._idle(name):
                    # Taken while the listing ran: its processes may be its job's.
                    continue
                verdicts[name].faults.extend(v.faults)
                verdicts[name].held.update(v.held)
                verdicts[name].passed.update(v.passed)
        self._apply(verdicts)
        self.sync_slice_labels()

    def running_jobs(self) -> dict[str, RunningJob]:
        """The jobs running now, by device, with what tells their processes: a
        sibling slice's listed under the GPU's UUID are not an idle slice's leftovers."""
        out: dict[str, RunningJob] = {}
        for name, dev in self._devices.items():
            if dev.lease.job is not None:
                out[name] = RunningJob(name, dev.lease.job[0], dev.job_pid)
        return out

    def _idle(self, device: str) -> bool:
        dev = self._devices[device]
        return dev.idle() or dev.lease.state is DeviceState.LINGERING

    # -- applying verdicts ---------------------------------------------------------

    def _apply(self, verdicts: Mapping[str, DeviceVerdict]) -> None:
        host_faults = [f for v in verdicts.values() for f in v.faults if f.host_level]
        for name, v in verdicts.items():
            self._checked.add(name)
            self._devices[name].set_health_hold(v.held, v.passed)
            for fault in v.faults:
                if not fault.host_level:
                    self._raise(name, fault)
            for fault in v.gpu_faults:
                self._raise_gpu(name, fault)
        if host_faults:
            self._raise_host(host_faults[0])

    def _raise(self, device: str, fault: Fault, *, job_id: str | None = None) -> None:
        self._raise_plan(GpuFaultPlan(device, tuple(self.slices.get(device, ()))), fault, job_id)

    def _raise_gpu(self, device: str, fault: Fault) -> None:
        """A fault of ``device``'s physical GPU: on the GPU's device and all its slices
        (and on ``device`` itself whatever its GPU: fail closed)."""
        parent = self.monitor.targets[device].parent
        plan = gpu_fault_plan(parent, self.slices.get(parent, ()), self._devices, reader=device)
        if plan is not None:
            self._raise_plan(plan, fault, None)

    def _raise_plan(self, plan: GpuFaultPlan, fault: Fault, job_id: str | None) -> None:
        held: dict[str, HeldHealthFault] = {}
        for name in (plan.holder, *plan.children):
            h = self._devices[name].health_fault(fault.kind)
            if h is not None:
                held[name] = h
        steps = gpu_fault_steps(plan, held)
        fault_id = steps.link
        if fault_id is None:
            fault_id = self._devices[plan.holder].raise_health_fault(fault, job_id=job_id)
        if fault_id is None:
            return
        for name in steps.children:
            self._devices[name].raise_health_fault(
                Fault(
                    fault.kind,
                    f"parent {plan.holder}: {fault.reason}",
                    fault.severity,
                    fault.action,
                ),
                parent_fault=fault_id,
            )

    def _raise_host(self, fault: Fault) -> None:
        """One fault id for the whole host, on every GPU device (slices included)."""
        held = self._host_fault
        if held is not None and any(held in d.lease.faults for d in self._devices.values()):
            return
        from rc_worker.device import new_fault_id

        self._host_fault = fault_id = new_fault_id(self._ctx.rng)
        for name in self.monitor.targets:
            self._devices[name].raise_health_fault(fault, fault_id=fault_id)
