"""Fault plans for fleet simulations: what a plan says, and how it is played.

A plan says which jobs (scripts and limits) are submitted when, which
controller endpoints fail when and how, which workers crash when (and for
how long, and whether the host reboots, or stop as their service manager
stops them), which disks fail, which jobs are cancelled, which idle
behaviours change. :meth:`Fleet.run_plan <rc_worker.testing.fleet.Fleet.run_plan>`
plays one, then every fault is lifted, every worker brought back, a careful
operator clears clean quarantines until every job has ended, the workers
drain, and the fleet's invariant checks say what went wrong.

:func:`rc_worker.testing.fault_plans` draws plans with hypothesis
(:mod:`rc_worker.testing.strategies`); this module needs no hypothesis.
A plan is frozen attrs data whose ``repr`` is Python that builds it again:
:func:`replay` plays a pasted plan with its seed, exactly as it ran::

    from rc_worker.testing.plans import *  # every name a plan's repr uses
    assert replay(FleetPlan(hosts=1, ...), seed=3).problems == []
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import attrs
import trio

from rc_worker.controller.errors import NotFound
from rc_worker.core.config import DeviceConfig
from rc_worker.testing.sim import EchoStdin, Fork, Hang, OnSigterm, Script, Sleep, Write
from rc_worker.testing.transport import Fault

if TYPE_CHECKING:
    from rc_worker.testing.fleet import Fleet

__all__ = [
    "ACQUIRE",
    "RELEASE",
    "TIME_LIMIT",
    "CancelPlan",
    "CrashPlan",
    "DiskPlan",
    "EchoStdin",
    "Fault",
    "FleetPlan",
    "Fork",
    "Hang",
    "HooksPlan",
    "IdlePlan",
    "InjectPlan",
    "JobPlan",
    "OnSigterm",
    "OutagePlan",
    "PlanRun",
    "Script",
    "Sleep",
    "SmiPlan",
    "UnofferPlan",
    "Write",
    "describe",
    "disk_fault",
    "parse_plan",
    "play",
    "replay",
    "replay_line",
]

T = TypeVar("T")

ENDPOINTS = ("register", "heartbeat", "poll", "start", "output", "finish", "labels", "fault")
FAULTS = (Fault.UNAVAILABLE, Fault.REFUSED, Fault.TIMEOUT, Fault.LOST, Fault.UNKNOWN_SESSION)
# A register has no session to forget: no controller answers it unknown_session.
REGISTER_FAULTS = tuple(f for f in FAULTS if f is not Fault.UNKNOWN_SESSION)
REREG_S = 45.0
ACQUIRE = "/sim/hooks/acquire"
RELEASE = "/sim/hooks/release"
TIME_LIMIT = 4 * 3600.0
"""Virtual seconds a played plan may take (invariant 6, everything ends)."""


@attrs.frozen
class JobPlan:
    """A job submitted at ``at`` (virtual seconds): its script and ``Store.submit`` fields."""

    at: float
    script: Script
    fields: dict[str, Any] = attrs.field(factory=dict, hash=False)


@attrs.frozen
class OutagePlan:
    """Every request to ``endpoint`` meets ``fault`` from ``at`` for ``duration``."""

    at: float
    duration: float
    endpoint: str
    fault: Fault
    host: str | None  # None: every host


@attrs.frozen
class InjectPlan:
    """At ``at``, the next requests to ``endpoint`` meet ``faults``, one each."""

    at: float
    endpoint: str
    faults: tuple[Fault, ...]
    host: str | None


@attrs.frozen
class CrashPlan:
    """The worker of ``host`` goes down at ``at`` (``how``), and comes back ``down_for`` later."""

    at: float
    host: str
    down_for: float
    # kill (SIGKILL), reboot, drain (SIGTERM), stop (two signals), or rereg: a kill
    # while `output` answers unknown_session, which lasts REREG_S after the
    # restart, so the new worker re-registers again and again with recovery
    # entries it cannot yet deliver while it runs other jobs; or torn: a kill, then
    # a power loss with torn writes (what DiskPlan(how="torn") plays as).
    how: str


@attrs.frozen
class CancelPlan:
    """The ``job``-th job of the plan is cancelled at ``at`` (if submitted by then)."""

    at: float
    job: int


@attrs.frozen
class IdlePlan:
    """An operator sets a device's idle behaviour at ``at``, back to ``run`` later."""

    at: float
    duration: float
    host: str
    device: str
    behavior: str  # hold or drain, then back to run


@attrs.frozen
class UnofferPlan:
    """A device made unofferable by its worker at an instant (a health fault), very
    likely while a poll listing it is parked at the controller."""

    at: float
    host: str
    device: str


@attrs.frozen
class SmiPlan:
    """nvidia-smi breaks (fails, or hangs past the probe timeout) at ``at`` for
    ``duration``, with a probe pass forced at once: the GPUs' facts must be kept."""

    at: float
    duration: float
    how: str  # fails or hangs


@attrs.frozen
class DiskPlan:
    """The disk of ``host`` fails at ``at`` for ``duration``.

    ``how``: ``full`` (every write fails with ``ENOSPC`` until repaired);
    ``vanish`` (the directory of a job the worker holds, with everything in it, is
    gone for good, as after an operator's ``rm -rf``: writes into it fail with
    ``ENOENT``); ``torn`` (a torn write at a crash: the worker is killed and the host
    loses power; its disk keeps what was fsynced, and half of each write since; the
    worker comes back ``duration`` later, played in turn with the host's crashes).
    Applied through :func:`disk_fault`, the one place that knows how a disk is made to fail.
    """

    at: float
    duration: float
    host: str
    how: str = "full"


SMI_OK = Script(
    (
        Write(
            b"0, NVIDIA H100 80GB HBM3, GPU-5c1a9e3b-7f2d-4e8a-9b61-0d3f2a7c4e15, 81559, "
            b"590.48.01, 00000000:00:09.0, 9.0, Disabled, 41, 0\n"
            b"1, NVIDIA H100 80GB HBM3, GPU-6d2b0f4c-8a3e-4f9b-ac72-1e4a3b8d5f26, 81559, "
            b"590.48.01, 00000000:00:0A.0, 9.0, Disabled, 40, 0\n"
        ),
    )
)
SMI_BROKEN = {
    "fails": Script((Write(b"NVIDIA-SMI has failed because it couldn't communicate\n"),), 9),
    "hangs": Script((Sleep(3600),)),
}


@attrs.frozen
class HooksPlan:
    """Every device's lease hooks (``None``: none), linger and hook timeout."""

    acquire: Script | None
    release: Script | None
    linger: float
    timeout: float


@attrs.frozen
class FleetPlan:
    """A whole fault plan: the fleet's size and settings, and every fault, with its time.

    Frozen data whose ``repr`` is the Python that builds it again (:func:`parse_plan`);
    :meth:`fleet_args` gives :func:`~rc_worker.testing.fleet.open_fleet` its arguments.
    """

    hosts: int = 1
    devices: int = 1
    jobs: tuple[JobPlan, ...] = ()
    outages: tuple[OutagePlan, ...] = ()
    injections: tuple[InjectPlan, ...] = ()
    crashes: tuple[CrashPlan, ...] = ()
    cancels: tuple[CancelPlan, ...] = ()
    idles: tuple[IdlePlan, ...] = ()
    unoffers: tuple[UnofferPlan, ...] = ()
    smi: tuple[SmiPlan, ...] = ()
    hooks: HooksPlan | None = None
    verify: Script | None = None
    require_manual_clear: bool = False
    foreign_process: bool = False  # another user's daemon, unreadable: older than every job
    cgroups: bool = False  # a cgroup per job (exact sweeps) instead of the RC_JOB_ID sweep
    disks: tuple[DiskPlan, ...] = ()

    def fleet_args(self) -> dict[str, Any]:
        names = [f"gpu{i}" for i in range(self.devices)]
        devices: list[str | DeviceConfig] = list(names)
        if self.hooks is not None:
            devices = [
                DeviceConfig(
                    name,
                    on_acquire=None if self.hooks.acquire is None else ACQUIRE,
                    on_release=None if self.hooks.release is None else RELEASE,
                    release_linger=self.hooks.linger,
                    timeout=self.hooks.timeout,
                )
                for name in names
            ]
        return {
            "hosts": self.hosts,
            "devices": tuple(devices),
            "require_manual_clear": self.require_manual_clear,
            "cgroups": self.cgroups,
            "nvidia_smi": SMI_OK if self.smi else None,
        }


# -- playing a plan -----------------------------------------------------------------


async def play(fleet: Fleet, plan: FleetPlan) -> list[str]:
    """Play ``plan``, bring everything back, settle, drain; the invariant violations.

    :meth:`Fleet.run_plan <rc_worker.testing.fleet.Fleet.run_plan>` is the same.
    """
    if plan.foreign_process:
        for node in fleet.nodes.values():
            node.host.start(
                Script((Sleep(math.inf),), environ_readable=False),
                environ={"USER": "someone-else"},
                signalable=False,
            )
    if plan.hooks is not None:
        for path, hook in ((ACQUIRE, plan.hooks.acquire), (RELEASE, plan.hooks.release)):
            if hook is not None:
                fleet.program(path, hook)
    if plan.verify is not None:
        fleet.verify_script("check", plan.verify)
    for i, job in enumerate(plan.jobs):
        fleet.program(f"job{i}", job.script)
    submitted: dict[int, str] = {}
    async with trio.open_nursery() as nursery:
        for i, job in enumerate(plan.jobs):
            nursery.start_soon(_submit, fleet, job, i, submitted)
        for outage in plan.outages:
            nursery.start_soon(_outage, fleet, outage)
        for injection in plan.injections:
            nursery.start_soon(_inject, fleet, injection)
        for name in fleet.nodes:
            # A torn write comes with a crash: played in turn with the host's others.
            torn = [
                CrashPlan(d.at, d.host, d.duration, "torn")
                for d in plan.disks
                if d.host == name and d.how == "torn"
            ]
            mine = sorted([c for c in plan.crashes if c.host == name] + torn, key=lambda c: c.at)
            nursery.start_soon(_crashes, fleet, name, mine)
        for cancel in plan.cancels:
            nursery.start_soon(_cancel, fleet, cancel, submitted)
        for idle in plan.idles:
            nursery.start_soon(_idle, fleet, idle)
        for unoffer in plan.unoffers:
            nursery.start_soon(_unoffer, fleet, unoffer)
        for smi in plan.smi:
            nursery.start_soon(_smi, fleet, smi)
        for disk in plan.disks:
            if disk.how != "torn":
                nursery.start_soon(_disk, fleet, disk)
    fleet.restore()
    for name, node in fleet.nodes.items():
        if not node.running:
            fleet.restart(name)
    await fleet.settle()
    await fleet.drain()
    return fleet.check()


async def _submit(fleet: Fleet, job: JobPlan, index: int, submitted: dict[int, str]) -> None:
    await trio.sleep(job.at)
    submitted[index] = fleet.submit([f"job{index}"], **job.fields)


async def _outage(fleet: Fleet, outage: OutagePlan) -> None:
    hosts = None if outage.host is None else [outage.host]
    await trio.sleep(outage.at)
    fleet.outage(outage.endpoint, outage.fault, hosts=hosts)
    await trio.sleep(outage.duration)
    fleet.restore(outage.endpoint, hosts=hosts)


async def _inject(fleet: Fleet, injection: InjectPlan) -> None:
    await trio.sleep(injection.at)
    hosts = None if injection.host is None else [injection.host]
    fleet.inject(injection.endpoint, *injection.faults, hosts=hosts)


async def _crashes(fleet: Fleet, name: str, crashes: Sequence[CrashPlan]) -> None:
    for crash in crashes:
        await trio.sleep_until(max(crash.at, trio.current_time()))
        if crash.how in ("drain", "stop"):
            await fleet.stop(name, drain=crash.how == "drain")
        else:
            if crash.how == "rereg":
                fleet.outage("output", Fault.UNKNOWN_SESSION, hosts=[name])
            await fleet.crash(name, reboot=crash.how == "reboot")
            if crash.how == "torn":
                disk_fault(fleet, name, "torn")
        await trio.sleep(crash.down_for)
        fleet.restart(name)
        if crash.how == "rereg":
            await trio.sleep(REREG_S)
            fleet.restore("output", hosts=[name])


async def _idle(fleet: Fleet, idle: IdlePlan) -> None:
    await trio.sleep(idle.at)
    try:
        fleet.set_idle_behavior(idle.host, idle.device, idle.behavior)
    except NotFound:
        return  # not registered yet (a register outage): nothing for an operator to set
    await trio.sleep(idle.duration)
    fleet.set_idle_behavior(idle.host, idle.device, "run")


async def _smi(fleet: Fleet, plan: SmiPlan) -> None:
    await trio.sleep(plan.at)
    fleet.program_nvidia_smi(SMI_BROKEN[plan.how])
    for node in fleet.nodes.values():
        if node.running and node.worker is not None:
            node.worker.reprobe()
    await trio.sleep(plan.duration)
    fleet.program_nvidia_smi(SMI_OK)


async def _disk(fleet: Fleet, plan: DiskPlan) -> None:
    await trio.sleep(plan.at)
    undo = disk_fault(fleet, plan.host, plan.how)
    if plan.how == "vanish":
        return  # gone for good: nothing to repair
    fleet._note(f"disk of {plan.host}: {plan.how}")
    try:
        await trio.sleep(plan.duration)
    finally:
        undo()
        fleet._note(f"disk of {plan.host} repaired")


DISK_FAULTS = ("full", "vanish", "torn")


def disk_fault(fleet: Fleet, host: str, how: str) -> Callable[[], None]:
    """Make the disk of ``host`` fail as ``how`` says; returns the repair.

    The one place that knows how. ``full`` fills the host's in-memory disk
    (:meth:`SimDisk.fill <rc_worker.testing.simdisk.SimDisk.fill>`: every write
    past what it holds now fails with ``ENOSPC``), and the repair frees it.
    ``vanish`` removes the directory of the first job the worker holds on disk
    (:meth:`SimDisk.vanish <rc_worker.testing.simdisk.SimDisk.vanish>`), for good;
    nothing if it holds none. ``torn`` is a power loss with torn writes
    (:meth:`SimHost.power_loss <rc_worker.testing.sim.SimHost.power_loss>` with
    ``disk.torn_writes``): call it with the worker down (:meth:`Fleet.crash`).
    Neither has a repair: what is gone stays gone.
    """
    if how not in DISK_FAULTS:
        raise ValueError(f"no disk fault {how!r}; expected one of {', '.join(DISK_FAULTS)}")
    node = fleet.nodes[host]
    disk = node.host.disk
    if how == "full":
        disk.fill()
        window = [trio.current_time(), math.inf]
        node.full_disk.append(window)

        def repair() -> None:
            disk.capacity = None
            window[1] = trio.current_time()

        return repair
    if how == "vanish":
        root = Path(node.config.state_dir) / "jobs"
        keys = sorted(disk.listdir(root)) if disk.is_dir(root) else []
        if keys:
            disk.vanish(root / keys[0])
            # Its spool went with it: what was not yet sent is lost (invariants.check).
            node.vanished.add(keys[0].rsplit(".", 1)[0])
            fleet._note(f"{host}: the directory of {keys[0]} vanished")
        else:
            fleet._note(f"{host}: no job directory to vanish")
    else:
        if node.running:
            raise RuntimeError(f"a power loss of {host} needs its worker down; crash it first")
        disk.torn_writes = True
        node.host.power_loss()
        disk.torn_writes = False
        node.power_losses.append(trio.current_time())
        fleet._note(f"{host}: power loss, torn writes")
    return lambda: None


async def _unoffer(fleet: Fleet, plan: UnofferPlan) -> None:
    await trio.sleep(plan.at)
    fleet.quarantine(plan.host, plan.device)


async def _cancel(fleet: Fleet, cancel: CancelPlan, submitted: dict[int, str]) -> None:
    await trio.sleep(cancel.at)
    if cancel.job in submitted:
        fleet.cancel(submitted[cancel.job])


@attrs.frozen
class PlanRun:
    """What :func:`replay` saw: the invariant violations (``[]`` is a pass) and the story."""

    problems: list[str]
    story: str


def replay(plan: FleetPlan, seed: int | None = None, **simulate_args: Any) -> PlanRun:
    """Play ``plan`` in a fleet of its own (:func:`~rc_worker.testing.fleet.simulate`).

    With ``seed``, the run is the same, byte for byte, every time: a failing
    example's printed plan and seed, pasted back here, replay it.
    """
    from rc_worker.testing.fleet import simulate

    async def scenario(fleet: Fleet) -> PlanRun:
        problems = await play(fleet, plan)
        return PlanRun(problems, describe(fleet))

    simulate_args.setdefault("time_limit", TIME_LIMIT)
    return simulate(scenario, seed=seed, **simulate_args, **plan.fleet_args())


def replay_line(plan: FleetPlan, seed: int | None) -> str:
    """The line to paste to replay ``plan`` (after ``from rc_worker.testing.plans import *``)."""
    return f"replay({plan!r}, seed={seed})"


def parse_plan(text: str) -> FleetPlan:
    """A plan from its ``repr`` (as a failing example printed it)."""
    names: dict[str, Any] = {name: globals()[name] for name in __all__}
    names["inf"] = math.inf
    plan = eval(text, {"__builtins__": {}}, names)
    if not isinstance(plan, FleetPlan):
        raise ValueError(f"not a FleetPlan: {text[:60]!r}...")
    return plan


def describe(fleet: Fleet) -> str:
    """The harness's log and the controller's jobs, for a failing example."""
    lines = [f"{t:9.3f}  {text}" for t, text in fleet.log]
    for info in fleet.jobs():
        lines.append(
            f"{info.job_id}: {info.state} on {info.host}/{info.device} exit {info.exit_code} "
            f"killed {info.killed} {info.reason!r}"
        )
    return "\n".join(lines)
