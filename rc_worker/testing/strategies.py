"""Hypothesis strategies of fault plans for fleet simulations.

:func:`fault_plans` draws a :class:`~rc_worker.testing.plans.FleetPlan`: jobs with
scripted behaviour (output at drawn times, exit codes, SIGTERM policies,
escaping children, children holding stdout, uninterruptible sleep, limits),
controller outages and injected faults per endpoint, crashes with and without a
reboot, stops and drains, restarts, re-registrations, full disks, failing verify
scripts and hooks, cancels, idle-behaviour changes, health faults, a failing
``nvidia-smi``. :meth:`Fleet.run_plan <rc_worker.testing.fleet.Fleet.run_plan>` plays it::

    @settings(deadline=None)
    @given(plan=fault_plans(), seed=st.integers(0, 2**32))
    def test_the_fleet_keeps_its_invariants(plan: FleetPlan, seed: int) -> None:
        note(replay_line(plan, seed))
        assert replay(plan, seed).problems == []

Needs hypothesis (the ``test`` extra).
"""

from __future__ import annotations

import functools
from typing import Any

import attrs
from hypothesis import strategies as st

from rc_worker.testing.plans import (
    DISK_FAULTS,
    ENDPOINTS,
    FAULTS,
    REGISTER_FAULTS,
    CancelPlan,
    CrashPlan,
    DiskPlan,
    FleetPlan,
    HooksPlan,
    IdlePlan,
    InjectPlan,
    JobPlan,
    OutagePlan,
    SmiPlan,
    UnofferPlan,
)
from rc_worker.testing.sim import Fork, Hang, OnSigterm, Script, Sleep, Step, Write
from rc_worker.testing.transport import Fault

__all__ = ["fault_plans", "fleet_plans", "job_plans", "job_scripts", "seconds"]


@functools.cache
def seconds(low: float, high: float) -> st.SearchStrategy[float]:
    """Half-second steps: readable plans, and instants that coincide now and then."""
    return st.integers(int(low * 2), int(high * 2)).map(lambda n: n / 2)


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


WRITTEN = st.lists(st.tuples(seconds(0, 15), WRITES), max_size=4)
EXTRAS = {
    extras: st.lists(
        st.sampled_from(["escape", "holder", "hang", "hung child"] if extras else []),
        max_size=2,
        unique=True,
    )
    for extras in (True, False)
}
EXIT_CODES = st.sampled_from([0, 0, 1, 3])


@st.composite
def job_scripts(draw: st.DrawFn, *, extras: bool = True) -> Script:
    """A job's script: output at drawn times, an exit code, a SIGTERM policy and, with
    ``extras``, escaping children, children holding stdout, uninterruptible sleep."""
    steps: list[Step] = []
    for gap, write in draw(WRITTEN):
        if gap:
            steps.append(Sleep(gap))
        steps.append(write)
    tail = draw(seconds(0, 30))
    if tail:
        steps.append(Sleep(tail))
    for kind in draw(EXTRAS[extras]):
        where = draw(_integers(0, len(steps)))
        steps.insert(where, draw(_extra(kind)))
    return Script(steps, exit_code=draw(EXIT_CODES), on_sigterm=draw(SIGTERM_POLICIES))


_integers = functools.cache(st.integers)


@functools.cache
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


_SCRIPTS = {extras: job_scripts(extras=extras) for extras in (True, False)}


@st.composite
def job_plans(draw: st.DrawFn, *, extras: bool = True) -> JobPlan:
    """A job: when it is submitted, its script, a grace and maybe limits."""
    fields: dict[str, Any] = {"grace_s": draw(seconds(0, 15))}
    if draw(st.booleans()):
        fields["max_runtime_s"] = draw(seconds(1, 60))
    if draw(st.booleans()):
        fields["idle_timeout_s"] = draw(seconds(1, 30))
    return JobPlan(draw(seconds(0, 60)), draw(_SCRIPTS[extras]), fields)


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


@attrs.frozen
class _Kinds:
    """The strategies of a fleet's size, built once: hypothesis validates every
    new strategy object, which cost a third of drawing a plan when they were
    built afresh for each one."""

    outages: st.SearchStrategy[list[OutagePlan]]
    injections: st.SearchStrategy[list[InjectPlan]]
    crashes: st.SearchStrategy[list[CrashPlan]]
    idles: st.SearchStrategy[list[IdlePlan]]
    unoffers: st.SearchStrategy[list[UnofferPlan]]
    smi: st.SearchStrategy[list[SmiPlan]]
    disks: st.SearchStrategy[list[DiskPlan]]


@functools.cache
def _kinds(hosts: int, devices: int) -> _Kinds:
    names = [f"h{i}" for i in range(hosts)]
    gpus = [f"gpu{i}" for i in range(devices)]
    outage_plans = st.builds(
        OutagePlan,
        seconds(0, 120),
        seconds(0.5, 60),
        st.sampled_from(ENDPOINTS),
        st.sampled_from(FAULTS),
        st.sampled_from([None, *names]),
    ).filter(lambda o: not (o.endpoint == "register" and o.fault is Fault.UNKNOWN_SESSION))
    injects = {
        endpoint: st.builds(
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
        for endpoint in ENDPOINTS
    }
    inject_plans = st.sampled_from(ENDPOINTS).flatmap(injects.__getitem__)
    crash_plans = st.builds(
        CrashPlan,
        seconds(0, 90),
        st.sampled_from(names),
        seconds(0, 90),
        st.sampled_from(["kill", "kill", "reboot", "drain", "stop", "rereg"]),
    )
    idle_plans = st.builds(
        IdlePlan,
        seconds(0, 90),
        seconds(1, 60),
        st.sampled_from(names),
        st.sampled_from(gpus),
        st.sampled_from(["hold", "drain"]),
    )
    unoffer_plans = st.builds(
        UnofferPlan, seconds(0, 90), st.sampled_from(names), st.sampled_from(gpus)
    )
    smi_plans = st.builds(
        SmiPlan, seconds(0, 90), seconds(1, 60), st.sampled_from(["fails", "hangs"])
    )
    disk_plans = st.builds(
        DiskPlan,
        seconds(0, 90),
        seconds(1, 60),
        st.sampled_from(names),
        st.sampled_from(DISK_FAULTS),
    )
    return _Kinds(
        outages=st.lists(outage_plans, max_size=3),
        injections=st.lists(inject_plans, max_size=3),
        crashes=st.lists(crash_plans, max_size=2),
        idles=st.lists(idle_plans, max_size=2),
        unoffers=st.lists(unoffer_plans, max_size=2),
        smi=st.lists(smi_plans, max_size=2),
        disks=st.lists(disk_plans, max_size=2),
    )


@functools.cache
def _jobs(extras: bool, max_jobs: int) -> st.SearchStrategy[list[JobPlan]]:
    return st.lists(job_plans(extras=extras), min_size=1, max_size=max_jobs)


@functools.cache
def _cancels(jobs: int) -> st.SearchStrategy[list[CancelPlan]]:
    return st.lists(st.builds(CancelPlan, seconds(0, 120), st.integers(0, jobs - 1)), max_size=2)


ONE_OR_TWO = st.integers(1, 2)
MAYBE_HOOKS = st.none() | HOOKS
MAYBE_VERIFY = st.none() | HOOK_SCRIPTS
BOOLEANS = st.booleans()


@st.composite
def fleet_plans(
    draw: st.DrawFn,
    *,
    crashes: bool = True,
    outages: bool = True,
    cancels: bool = True,
    extras: bool = True,
    disks: bool = False,
    hosts: int | None = None,
    devices: int | None = None,
    max_jobs: int = 5,
) -> FleetPlan:
    """Fault plans, each kind switched on or off; ``hosts`` and ``devices`` per host
    fixed, or drawn (one or two) when ``None``. :func:`fault_plans` has every kind on."""
    if hosts is None:
        hosts = draw(ONE_OR_TWO)
    if devices is None:
        devices = draw(ONE_OR_TWO)
    kinds = _kinds(hosts, devices)
    jobs = draw(_jobs(extras, max_jobs))
    hooks = draw(MAYBE_HOOKS) if extras else None
    return FleetPlan(
        hosts=hosts,
        devices=devices,
        jobs=tuple(jobs),
        outages=tuple(draw(kinds.outages)) if outages else (),
        injections=tuple(draw(kinds.injections)) if outages else (),
        crashes=tuple(draw(kinds.crashes)) if crashes else (),
        cancels=tuple(draw(_cancels(len(jobs)))) if cancels else (),
        idles=tuple(draw(kinds.idles)) if extras else (),
        unoffers=tuple(draw(kinds.unoffers)) if extras else (),
        smi=tuple(draw(kinds.smi)) if extras else (),
        hooks=hooks,
        verify=draw(MAYBE_VERIFY) if extras else None,
        require_manual_clear=draw(BOOLEANS),
        foreign_process=draw(BOOLEANS),
        cgroups=draw(BOOLEANS),
        disks=tuple(draw(kinds.disks)) if disks else (),
    )


def fault_plans(
    *, hosts: int | None = None, devices: int | None = None, max_jobs: int = 5
) -> st.SearchStrategy[FleetPlan]:
    """Fault plans of every kind, for ``hosts`` hosts of ``devices`` devices each (one
    or two, drawn, when ``None``), with up to ``max_jobs`` jobs."""
    return fleet_plans(disks=True, hosts=hosts, devices=devices, max_jobs=max_jobs)
