"""A physical GPU shared by MIG slices (sans-IO): where its faults go, whose its processes are."""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

from hypothesis import given
from hypothesis import strategies as st

from rc_worker.core.gpu_health import ComputeApp, parse_compute_apps
from rc_worker.core.mig_share import (
    GpuFaultPlan,
    GpuFaultSteps,
    HeldHealthFault,
    ProcessFacts,
    Residents,
    RunningJob,
    gpu_fault_plan,
    gpu_fault_steps,
    job_of,
    known_jobs,
    residents,
)

NAMES = st.sampled_from(["gpu0", "gpu0-mig0", "gpu0-mig1", "gpu0-mig2", "gpu1"])


def test_the_gpu_device_holds_the_fault_and_every_slice_names_it() -> None:
    plan = gpu_fault_plan("gpu0", ["gpu0-mig1", "gpu0-mig2"], {"gpu0", "gpu0-mig1", "gpu0-mig2"})
    assert plan == GpuFaultPlan("gpu0", ("gpu0-mig1", "gpu0-mig2"))


def test_without_the_gpu_device_the_first_slice_holds_it_for_its_siblings() -> None:
    # Clearing gpu0-mig1 at the controller then clears gpu0-mig2's child too.
    plan = gpu_fault_plan("gpu0", ["gpu0-mig1", "gpu0-mig2"], {"gpu0-mig1", "gpu0-mig2"})
    assert plan == GpuFaultPlan("gpu0-mig1", ("gpu0-mig2",))


def test_a_whole_gpu_without_slices_holds_its_own_fault() -> None:
    assert gpu_fault_plan("gpu1", [], {"gpu0", "gpu1"}) == GpuFaultPlan("gpu1", ())
    assert gpu_fault_plan("gpu1", [], {"gpu0"}) is None


@given(
    parent=NAMES,
    slices=st.lists(NAMES, unique=True, max_size=4),
    devices=st.sets(NAMES),
)
def test_every_device_of_the_gpu_is_quarantined_once(
    parent: str, slices: list[str], devices: set[str]
) -> None:
    plan = gpu_fault_plan(parent, slices, devices)
    of_gpu = {parent, *slices} & devices
    if plan is None:
        assert of_gpu == set()
        return
    named = [plan.holder, *plan.children]
    assert sorted(named) == sorted(of_gpu)  # each of them, none twice, nothing else
    if parent in devices:
        assert plan.holder == parent


@given(
    parent=NAMES,
    slices=st.lists(NAMES, unique=True, max_size=4),
    devices=st.sets(NAMES),
    reader=NAMES,
)
def test_the_device_that_read_a_gpu_fault_is_always_quarantined(
    parent: str, slices: list[str], devices: set[str], reader: str
) -> None:
    """Fail closed: were the reader neither the GPU's device nor a slice of it (its GPU
    not known for sure), it is quarantined all the same, besides the GPU's devices."""
    plan = gpu_fault_plan(parent, slices, devices, reader=reader)
    of_gpu = {parent, *slices, reader} & devices
    if plan is None:
        assert of_gpu == set()
        return
    named = [plan.holder, *plan.children]
    assert sorted(named) == sorted(of_gpu)
    if parent in devices:
        assert plan.holder == parent


# -- which devices need a new fault, given what they hold ---------------------------

PLAN = GpuFaultPlan("gpu0", ("gpu0-mig1", "gpu0-mig2"))


def test_nothing_held_the_holder_raises_and_every_slice_gets_a_child() -> None:
    assert gpu_fault_steps(PLAN, {}) == GpuFaultSteps(None, ("gpu0-mig1", "gpu0-mig2"))


def test_a_condition_that_persists_raises_nothing_new() -> None:
    held = {
        "gpu0": HeldHealthFault("f-1"),
        "gpu0-mig1": HeldHealthFault("f-2", "f-1"),
        "gpu0-mig2": HeldHealthFault("f-3", "f-1"),
    }
    assert gpu_fault_steps(PLAN, held) == GpuFaultSteps("f-1", ())


def test_a_slice_cleared_alone_gets_a_child_of_the_fault_the_gpu_still_holds() -> None:
    held = {"gpu0": HeldHealthFault("f-1"), "gpu0-mig2": HeldHealthFault("f-3", "f-1")}
    assert gpu_fault_steps(PLAN, held) == GpuFaultSteps("f-1", ("gpu0-mig1",))


def test_a_slice_holding_its_own_or_an_older_copy_gets_a_child_naming_the_gpus() -> None:
    # Clearing gpu0 would not clear f-7 (its own) nor f-8 (a copy of a cleared f-0).
    held = {
        "gpu0": HeldHealthFault("f-1"),
        "gpu0-mig1": HeldHealthFault("f-7"),
        "gpu0-mig2": HeldHealthFault("f-8", "f-0"),
    }
    assert gpu_fault_steps(PLAN, held) == GpuFaultSteps("f-1", ("gpu0-mig1", "gpu0-mig2"))


def test_a_host_fault_held_by_all_covers_the_slices() -> None:
    # One fault id on every GPU device (``scope: host``): the slices hold the very fault.
    held = {name: HeldHealthFault("f-host") for name in ("gpu0", "gpu0-mig1", "gpu0-mig2")}
    assert gpu_fault_steps(PLAN, held) == GpuFaultSteps("f-host", ())


SLICES = ("gpu0-mig0", "gpu0-mig1", "gpu0-mig2")


class Faults:
    """The worker's devices and the controller's clear, as far as one kind of fault goes."""

    def __init__(self, devices: Sequence[str]) -> None:
        self.devices = list(devices)
        self.held: dict[str, dict[str, str | None]] = {d: {} for d in devices}
        self.latest: dict[str, str] = {}
        self.seen: dict[str, set[str]] = {d: set() for d in devices}
        self.n = 0

    def _raise(self, device: str, parent: str | None) -> str:
        self.n += 1
        fid = f"f-{self.n}"
        self.held[device][fid] = parent
        self.seen[device].add(fid)
        self.latest[device] = fid
        return fid

    def health_fault(self, device: str) -> HeldHealthFault | None:
        fid = self.latest.get(device)
        if fid is None or fid not in self.held[device]:
            return None
        return HeldHealthFault(fid, self.held[device][fid])

    def read(self, reader: str) -> GpuFaultPlan | None:
        """A check of ``reader`` reads a fault of GPU 0 (as ``_raise_gpu`` applies it)."""
        plan = gpu_fault_plan("gpu0", SLICES, self.devices, reader=reader)
        if plan is None:
            return None
        held = {
            d: h for d in (plan.holder, *plan.children) if (h := self.health_fault(d)) is not None
        }
        steps = gpu_fault_steps(plan, held)
        link = steps.link or self._raise(plan.holder, None)
        for child in steps.children:
            self._raise(child, link)
        return plan

    def clear(self, device: str) -> None:
        """``rc clear HOST/device``: its faults, and those naming any it ever held."""
        self.held[device].clear()
        for other in self.devices:
            for fid, parent in list(self.held[other].items()):
                if parent in self.seen[device]:
                    del self.held[other][fid]

    def faulted(self) -> set[str]:
        return {d for d, faults in self.held.items() if faults}


@given(
    devices=st.sets(st.sampled_from(["gpu0", *SLICES, "gpu1"]), min_size=1),
    steps=st.lists(
        st.tuples(st.sampled_from(["read", "clear"]), st.sampled_from(["gpu0", *SLICES])),
        max_size=12,
    ),
)
def test_a_gpu_fault_reaches_exactly_its_gpu_whatever_the_order_of_checks_and_clears(
    devices: set[str], steps: list[tuple[str, str]]
) -> None:
    """Whichever device reads the GPU's fault, in whatever order and between whatever
    clears: after each read, the devices holding it are exactly the GPU's device and
    its slices (never another GPU's), each slice holding one that names the GPU's, so
    that clearing the GPU's device leaves none quarantined."""
    model = Faults(sorted(devices))
    of_gpu = {"gpu0", *SLICES} & devices
    for op, device in steps:
        if device not in devices:
            continue
        if op == "clear":
            model.clear(device)
            continue
        plan = model.read(device)
        assert plan is not None
        assert model.faulted() == of_gpu
        holder = model.health_fault(plan.holder)
        assert holder is not None
        for child in plan.children:
            assert child != plan.holder
            h = model.health_fault(child)
            assert h is not None
            assert h.parent_fault == holder.fault_id
        trial = copy.deepcopy(model)
        trial.clear(plan.holder)
        assert trial.faulted() == set()


# -- whose are the processes listed under the GPU's UUID -----------------------------

SMI = Path(__file__).parent / "fixtures" / "nvidia-smi"
PARENT = "GPU-00000000-0000-0000-0000-000000000000"  # fixture 09b's (masked) parent UUID
OWN = "MIG-a25704ba-3a06-5299-a795-fd7cf4d13973"
SIBLING = RunningJob("gpu0-mig1", "job-a", leader=12249)


def facts_of(table: Mapping[int, ProcessFacts]) -> Callable[[int], ProcessFacts]:
    return lambda pid: table.get(pid, ProcessFacts())


def test_a_sibling_jobs_processes_under_the_parent_uuid_are_not_resident() -> None:
    """Fixture 09b: a loaded MIG GPU lists every slice's processes under its own UUID."""
    apps = parse_compute_apps((SMI / "09b_compute_apps_load_h200_mig.csv").read_text())
    table = {
        12249: ProcessFacts(pgid=12249, sid=12249),  # the job's leader: read without environ
        12250: ProcessFacts(pgid=12249, sid=12249),  # in its group
        12267: ProcessFacts(1, 1, "job-a", environ_read=True, device="gpu0-mig1"),  # setsid'd
    }
    got = residents(apps, shared_uuid=PARENT, jobs=[SIBLING], facts=facts_of(table))
    assert got == Residents()
    assert got.fault() is None


def test_an_unaccounted_process_under_the_parent_uuid_stays_resident() -> None:
    apps = parse_compute_apps((SMI / "09b_compute_apps_load_h200_mig.csv").read_text())
    table = {
        12249: ProcessFacts(pgid=12249, sid=12249),
        12250: ProcessFacts(pgid=12249, sid=12249),
        12267: ProcessFacts(pgid=5, sid=5, job_id="an-old-job", environ_read=True),
    }
    got = residents(apps, shared_uuid=PARENT, jobs=[SIBLING], facts=facts_of(table))
    assert [a.pid for a in got.apps] == [12267]
    assert got.untold == ()
    fault = got.fault()
    assert fault is not None
    assert fault.reason == "processes resident on the GPU: pid 12267 (./gpu_burn, 13526 MiB)"


def test_a_process_that_cannot_be_told_stays_resident_and_the_reason_says_so() -> None:
    apps = parse_compute_apps((SMI / "09b_compute_apps_load_h200_mig.csv").read_text())
    table = {12249: ProcessFacts(pgid=12249, sid=12249)}  # 12250, 12267: nothing read
    got = residents(apps, shared_uuid=PARENT, jobs=[SIBLING], facts=facts_of(table))
    assert [a.pid for a in got.apps] == [12250, 12267]
    assert got.untold == (12250, 12267)
    fault = got.fault()
    assert fault is not None
    assert "pid 12267 (./gpu_burn, 13526 MiB)" in fault.reason
    assert "pids 12250, 12267 were listed under the GPU's own UUID" in fault.reason
    assert "could not be told apart from the jobs on gpu0-mig1" in fault.reason
    assert (fault.severity, fault.action) == ("warning", "clear")


def test_an_earlier_attempts_leftover_on_another_slice_stays_resident() -> None:
    # Attempt 1 of job-a ran on gpu0-mig2 and left a process; attempt 2 runs on gpu0-mig1.
    # The leftover carries RC_JOB_ID=job-a too, but not the running job's device or group.
    app = ComputeApp(PARENT, 500, "leftover", 100)
    old = ProcessFacts(500, 500, "job-a", environ_read=True, device="gpu0-mig2")
    got = residents([app], shared_uuid=PARENT, jobs=[SIBLING], facts=facts_of({500: old}))
    assert got.apps == (app,)


def test_a_process_on_the_slices_own_uuid_is_its_own_whatever_it_carries() -> None:
    app = ComputeApp(OWN, 12249, "train", 10)
    mine = ProcessFacts(pgid=12249, sid=12249, job_id="job-a", environ_read=True)
    got = residents([app], shared_uuid=PARENT, jobs=[SIBLING], facts=facts_of({12249: mine}))
    assert got.apps == (app,)


PIDS = st.integers(1, 6)
APPS = st.lists(
    st.builds(ComputeApp, st.sampled_from([PARENT, OWN]), PIDS, st.just("p"), st.just(1)),
    max_size=6,
)
JOBS = st.lists(
    st.builds(
        RunningJob,
        st.sampled_from(["gpu0-mig1", "gpu0-mig2"]),
        st.sampled_from(["job-a", "job-b"]),
        st.none() | PIDS,
    ),
    max_size=3,
)
FACTS = st.dictionaries(
    PIDS,
    st.builds(
        ProcessFacts,
        st.none() | PIDS,
        st.none() | PIDS,
        st.none() | st.sampled_from(["job-a", "job-b", "job-c"]),
        st.booleans(),
        st.none() | st.sampled_from(["gpu0-mig1", "gpu0-mig2"]),
    ),
)


@given(apps=APPS, jobs=JOBS, table=FACTS)
def test_only_a_process_a_running_job_owns_is_let_go(
    apps: list[ComputeApp], jobs: list[RunningJob], table: dict[int, ProcessFacts]
) -> None:
    got = residents(apps, shared_uuid=PARENT, jobs=jobs, facts=facts_of(table))
    for app in apps:
        facts = table.get(app.pid, ProcessFacts())
        owned = app.gpu_uuid == PARENT and job_of(facts, jobs) is not None
        assert (app in got.apps) is not owned  # fail closed: nothing else is let go
        if app in got.apps and app.gpu_uuid == PARENT and jobs and not facts.environ_read:
            assert app.pid in got.untold
    assert set(got.untold) <= {a.pid for a in got.apps if a.gpu_uuid == PARENT}
    assert bool(got.busy) == bool(got.untold)
    if not jobs:
        assert got == Residents(tuple(apps))  # no sibling runs a job: as before


JOBS = st.builds(
    RunningJob, device=NAMES, job_id=st.sampled_from(["j-1", "j-2", "j-3"]), leader=st.none()
)


@given(st.lists(JOBS, unique=True, max_size=4), st.lists(JOBS, unique=True, max_size=4))
def test_the_jobs_known_around_a_listing_are_both_sides_each_once(
    before: list[RunningJob], after: list[RunningJob]
) -> None:
    """A job that ended during the listing, or began during it, is still known; none twice."""
    known = known_jobs(before, after)
    assert set(known) == set(before) | set(after)
    assert len(known) == len(set(known))
    assert known[: len(before)] == before
