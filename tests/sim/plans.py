"""Fault plans for fleet simulations: what hypothesis draws, and how a plan is played.

A plan says which jobs (scripts and limits) are submitted when, which
controller endpoints fail when and how, which workers crash when (and for
how long, and whether the host reboots), and which jobs are cancelled. It is
played against a :class:`~rc_worker.testing.fleet.Fleet`, then every fault
is lifted, every worker brought back, a careful operator clears clean
quarantines until every job has ended, the workers drain, and the fleet's
invariant checks say what went wrong.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import attrs
import trio
from hypothesis import strategies as st

from rc_worker.controller.errors import NotFound
from rc_worker.core.config import DeviceConfig
from rc_worker.testing.fleet import Fault, Fleet
from rc_worker.testing.sim import Fork, Hang, OnSigterm, Script, Sleep, Step, Write

ENDPOINTS = ("register", "heartbeat", "poll", "start", "output", "finish", "labels", "fault")
FAULTS = (Fault.UNAVAILABLE, Fault.REFUSED, Fault.TIMEOUT, Fault.LOST, Fault.UNKNOWN_SESSION)
# A register has no session to forget: no controller answers it unknown_session.
REGISTER_FAULTS = tuple(f for f in FAULTS if f is not Fault.UNKNOWN_SESSION)
REREG_S = 45.0
ACQUIRE = "/sim/hooks/acquire"
RELEASE = "/sim/hooks/release"


def seconds(low: float, high: float) -> st.SearchStrategy[float]:
    """Half-second steps: readable plans, and instants that coincide now and then."""
    return st.integers(int(low * 2), int(high * 2)).map(lambda n: n / 2)


@attrs.frozen
class JobPlan:
    at: float
    script: Script
    fields: dict[str, Any] = attrs.field(factory=dict, hash=False)


@attrs.frozen
class OutagePlan:
    at: float
    duration: float
    endpoint: str
    fault: Fault
    host: str | None  # None: every host


@attrs.frozen
class InjectPlan:
    at: float
    endpoint: str
    faults: tuple[Fault, ...]
    host: str | None


@attrs.frozen
class CrashPlan:
    at: float
    host: str
    down_for: float
    # kill (SIGKILL), reboot, drain (SIGTERM), stop (two signals), or rereg: a kill
    # while `output` answers unknown_session, which lasts REREG_S after the
    # restart, so the new worker re-registers again and again with recovery
    # entries it cannot yet deliver while it runs other jobs.
    how: str


@attrs.frozen
class CancelPlan:
    at: float
    job: int


@attrs.frozen
class IdlePlan:
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
    acquire: Script | None
    release: Script | None
    linger: float
    timeout: float


@attrs.frozen
class FleetPlan:
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


# -- strategies -----------------------------------------------------------------

SIGTERM_POLICIES = st.one_of(
    st.just(OnSigterm()),
    st.just(OnSigterm(ignore=True)),
    st.builds(OnSigterm, delay=seconds(0.5, 15), exit_code=st.sampled_from([0, 1, None])),
)

WRITES = st.one_of(
    st.builds(Write, st.binary(min_size=1, max_size=16)),
    # Past the pipe's capacity: the writer blocks until the worker reads.
    st.builds(Write, st.just(b"0123456789abcdef\n"), repeat=st.integers(250, 550)),
)


@st.composite
def job_scripts(draw: st.DrawFn, *, extras: bool = True) -> Script:
    steps: list[Step] = []
    for gap, write in draw(st.lists(st.tuples(seconds(0, 15), WRITES), max_size=4)):
        if gap:
            steps.append(Sleep(gap))
        steps.append(write)
    tail = draw(seconds(0, 30))
    if tail:
        steps.append(Sleep(tail))
    kinds = ["escape", "holder", "hang", "hung child"] if extras else []
    for kind in draw(st.lists(st.sampled_from(kinds), max_size=2, unique=True)):
        where = draw(st.integers(0, len(steps)))
        steps.insert(where, draw(_extra(kind)))
    return Script(
        steps,
        exit_code=draw(st.sampled_from([0, 0, 1, 3])),
        on_sigterm=draw(SIGTERM_POLICIES),
    )


def _extra(kind: str) -> st.SearchStrategy[Step]:
    if kind == "escape":
        # A child that calls setsid(2): out of the group, still carrying RC_JOB_ID.
        child = st.builds(
            Script,
            st.tuples(st.builds(Sleep, seconds(1, 60))),
            on_sigterm=SIGTERM_POLICIES,
        )
        return st.builds(Fork, child, setsid=st.just(True), holds_output=st.booleans())
    if kind == "holder":
        # A child that keeps stdout open after the main process has gone.
        child = st.builds(
            lambda at, sigterm: attrs.evolve(Script.printing((at, b"late\n")), on_sigterm=sigterm),
            seconds(0, 20),
            SIGTERM_POLICIES,
        )
        return st.builds(Fork, child)
    if kind == "hang":
        return st.builds(Hang, seconds(1, 40))
    child = st.builds(lambda s: Script((Hang(s),)), seconds(1, 40))
    return st.builds(Fork, child, setsid=st.booleans())


@st.composite
def job_plans(draw: st.DrawFn, *, extras: bool = True) -> JobPlan:
    fields: dict[str, Any] = {"grace_s": draw(seconds(0, 15))}
    if draw(st.booleans()):
        fields["max_runtime_s"] = draw(seconds(1, 60))
    if draw(st.booleans()):
        fields["idle_timeout_s"] = draw(seconds(1, 30))
    return JobPlan(draw(seconds(0, 60)), draw(job_scripts(extras=extras)), fields)


HOOK_SCRIPTS = st.one_of(
    st.builds(Script.sleeping, seconds(0, 3)),
    st.builds(Script.sleeping, seconds(0, 40), exit_code=st.sampled_from([0, 1])),
)

HOOKS = st.builds(
    HooksPlan,
    st.none() | HOOK_SCRIPTS,
    st.none() | HOOK_SCRIPTS,
    seconds(0, 20),
    seconds(1, 30),
)


@st.composite
def fleet_plans(
    draw: st.DrawFn,
    *,
    crashes: bool = True,
    outages: bool = True,
    cancels: bool = True,
    extras: bool = True,
) -> FleetPlan:
    hosts = draw(st.integers(1, 2))
    names = [f"h{i}" for i in range(hosts)]
    outage_plans = st.builds(
        OutagePlan,
        seconds(0, 120),
        seconds(0.5, 60),
        st.sampled_from(ENDPOINTS),
        st.sampled_from(FAULTS),
        st.sampled_from([None, *names]),
    ).filter(lambda o: not (o.endpoint == "register" and o.fault is Fault.UNKNOWN_SESSION))
    inject_plans = st.sampled_from(ENDPOINTS).flatmap(
        lambda endpoint: st.builds(
            InjectPlan,
            seconds(0, 120),
            st.just(endpoint),
            st.lists(
                st.sampled_from(REGISTER_FAULTS if endpoint == "register" else FAULTS),
                min_size=1,
                max_size=3,
            ).map(tuple),
            st.sampled_from([None, *names]),
        )
    )
    crash_plans = st.builds(
        CrashPlan,
        seconds(0, 90),
        st.sampled_from(names),
        seconds(0, 90),
        st.sampled_from(["kill", "kill", "reboot", "drain", "stop", "rereg"]),
    )
    devices = draw(st.integers(1, 2))
    idle_plans = st.builds(
        IdlePlan,
        seconds(0, 90),
        seconds(1, 60),
        st.sampled_from(names),
        st.sampled_from([f"gpu{i}" for i in range(devices)]),
        st.sampled_from(["hold", "drain"]),
    )
    unoffer_plans = st.builds(
        UnofferPlan,
        seconds(0, 90),
        st.sampled_from(names),
        st.sampled_from([f"gpu{i}" for i in range(devices)]),
    )
    smi_plans = st.builds(
        SmiPlan, seconds(0, 90), seconds(1, 60), st.sampled_from(["fails", "hangs"])
    )
    jobs = draw(st.lists(job_plans(extras=extras), min_size=1, max_size=5))
    hooks = draw(st.none() | HOOKS) if extras else None
    return FleetPlan(
        hosts=hosts,
        devices=devices,
        jobs=tuple(jobs),
        outages=tuple(draw(st.lists(outage_plans, max_size=3))) if outages else (),
        injections=tuple(draw(st.lists(inject_plans, max_size=3))) if outages else (),
        crashes=tuple(draw(st.lists(crash_plans, max_size=2))) if crashes else (),
        cancels=tuple(
            draw(
                st.lists(
                    st.builds(CancelPlan, seconds(0, 120), st.integers(0, len(jobs) - 1)),
                    max_size=2,
                )
            )
        )
        if cancels
        else (),
        idles=tuple(draw(st.lists(idle_plans, max_size=2))) if extras else (),
        unoffers=tuple(draw(st.lists(unoffer_plans, max_size=2))) if extras else (),
        smi=tuple(draw(st.lists(smi_plans, max_size=2))) if extras else (),
        hooks=hooks,
        verify=draw(st.none() | HOOK_SCRIPTS) if extras else None,
        require_manual_clear=draw(st.booleans()),
        foreign_process=draw(st.booleans()),
        cgroups=draw(st.booleans()),
    )


# -- playing a plan -----------------------------------------------------------------


async def play(fleet: Fleet, plan: FleetPlan) -> list[str]:
    """Play ``plan``, bring everything back, settle, drain; the invariant violations."""
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
            mine = sorted((c for c in plan.crashes if c.host == name), key=lambda c: c.at)
            nursery.start_soon(_crashes, fleet, name, mine)
        for cancel in plan.cancels:
            nursery.start_soon(_cancel, fleet, cancel, submitted)
        for idle in plan.idles:
            nursery.start_soon(_idle, fleet, idle)
        for unoffer in plan.unoffers:
            nursery.start_soon(_unoffer, fleet, unoffer)
        for smi in plan.smi:
            nursery.start_soon(_smi, fleet, smi)
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


async def _unoffer(fleet: Fleet, plan: UnofferPlan) -> None:
    await trio.sleep(plan.at)
    fleet.quarantine(plan.host, plan.device)


async def _cancel(fleet: Fleet, cancel: CancelPlan, submitted: dict[int, str]) -> None:
    await trio.sleep(cancel.at)
    if cancel.job in submitted:
        fleet.cancel(submitted[cancel.job])


def describe(fleet: Fleet) -> str:
    """The harness's log and the controller's jobs, for a failing example."""
    lines = [f"{t:9.3f}  {text}" for t, text in fleet.log]
    for info in fleet.jobs():
        lines.append(
            f"{info.job_id}: {info.state} on {info.host}/{info.device} exit {info.exit_code} "
            f"killed {info.killed} {info.reason!r}"
        )
    return "\n".join(lines)
