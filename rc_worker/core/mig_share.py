"""A physical GPU shared by MIG slices: where its faults go, whose its processes are (sans-IO).

Some facts belong to the physical GPU, whichever device read them: its ECC
counters, retired pages and remapped rows count for the whole card, so
growth read through one slice is growth on every slice of it; a GPU gone,
lost or swapped (``gpu_missing``) and an Xid on its PCI bus are the card's
too. Such a fault is raised once, on the GPU's own device, and every slice
of the GPU holds a fault naming it (``parent_fault``), in the same check
whichever device read it, so clearing the GPU's device at the controller
clears them all (docs/operations.md, "GPU health"). A slice that holds none
naming the GPU's current fault (cleared alone while the GPU's is still held)
gets one again at the next check that reads the fault (``gpu_fault_steps``).

Some drivers list a slice's compute apps under the PARENT GPU's UUID
(fixture 09b), so a device cannot tell from the listing alone whether such
a process is its own or a sibling slice's. Counting them all as its own is
cautious but wrong where it matters: an idle slice was quarantined for the
job its busy sibling runs. The worker knows its jobs: a job's main process
leads its own session and process group (its pid is the group's id), and
every process of a job, or of its hooks and verify scripts, carries the
job's ``RC_JOB_ID`` and its device's ``RC_DEVICE`` (both are needed: an
earlier attempt of the same job on another slice carries the same job id).
A process listed under the shared UUID is a sibling's when its process
group or session, or both variables, say so; any other stays resident (fail
closed), and when they could not be read the fault says that it could not
be told.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable, Mapping, Sequence

import attrs

from rc_worker.core.gpu_health import ComputeApp, Fault, decide_resident


@attrs.frozen
class GpuFaultPlan:
    """Which device holds a physical GPU's fault, and which hold one naming it."""

    holder: str
    children: tuple[str, ...] = ()


def gpu_fault_plan(
    parent: str,
    slices: Sequence[str],
    devices: Collection[str],
    *,
    reader: str | None = None,
) -> GpuFaultPlan | None:
    """Where a fault of physical GPU ``parent`` (a device name) goes.

    The GPU's device holds it and each of its ``slices`` gets a child. A
    validated config always declares the GPU's device (``mig_of`` must name
    one), but should the worker have no device by that name, the first slice
    holds the fault in its place: every slice is still quarantined, and
    clearing that slice clears its siblings' children, as clearing the GPU
    would. Only names in ``devices`` are planned for; None when none is.

    ``reader``, the device whose check read the fault, is always in the plan
    (fail closed): were it neither the GPU's device nor one of ``slices`` (its
    GPU not known for sure), it is quarantined too, never left to run a job.
    """
    present = tuple(dict.fromkeys(s for s in slices if s in devices and s != parent))
    if reader is not None and reader in devices and reader != parent and reader not in present:
        present = (*present, reader)
    if parent in devices:
        return GpuFaultPlan(parent, present)
    if not present:
        return None
    return GpuFaultPlan(present[0], present[1:])


@attrs.frozen
class HeldHealthFault:
    """The health fault of one kind a device holds now: its id, and the fault it names."""

    fault_id: str
    parent_fault: str | None = None


@attrs.frozen
class GpuFaultSteps:
    """What raising a fault by a ``GpuFaultPlan`` takes, given what is held already."""

    link: str | None
    """The holder's fault of that kind, which the children name; None: the holder holds
    none, so a new one is raised on it first and its id is the link."""
    children: tuple[str, ...]
    """The planned slices that hold no fault covering the link: each gets a child."""


def gpu_fault_steps(plan: GpuFaultPlan, held: Mapping[str, HeldHealthFault]) -> GpuFaultSteps:
    """Which of ``plan``'s devices need a new fault, ``held`` being each device's
    fault of the same kind (absent: none).

    A condition that persists is not news every check: the holder keeps the
    fault it holds, and a slice that already holds a child naming it, or the
    very same fault (a host-level fault, one id on every GPU device), gets
    nothing. Any other slice gets a child naming the holder's fault, even
    one holding a fault of that kind that names another (an older one the
    controller has cleared and the worker has not yet heard of): clearing
    the GPU's device must clear every slice, and a stale child would not be.
    """
    holder = held.get(plan.holder)
    link = None if holder is None else holder.fault_id
    children = tuple(
        c
        for c in plan.children
        if link is None or (h := held.get(c)) is None or link not in (h.fault_id, h.parent_fault)
    )
    return GpuFaultSteps(link, children)


@attrs.frozen
class RunningJob:
    """A job the worker runs on a device, and what tells its processes."""

    device: str
    job_id: str
    leader: int | None = None
    """The job's main process: its pid, process group id and session id (None: not
    spawned yet, as while its acquire hook runs)."""


@attrs.frozen
class ProcessFacts:
    """What ``/proc`` said of one listed process; ``None``: not read."""

    pgid: int | None = None
    sid: int | None = None
    job_id: str | None = None
    """Its ``RC_JOB_ID``; None when it has none, or its environment was not read."""
    environ_read: bool = False
    """Its environment was read (and was not empty, as while it is caught in an exec)."""
    device: str | None = None
    """Its ``RC_DEVICE``: the device its job (or hook) was started for."""


@attrs.frozen
class Residents:
    """The processes that dirty a device, and those that might be a sibling's job's."""

    apps: tuple[ComputeApp, ...] = ()
    untold: tuple[int, ...] = ()
    """Pids among ``apps``, listed under the GPU's UUID while siblings ran jobs, whose
    environment could not be read: whether they are those jobs' could not be told."""
    busy: tuple[str, ...] = ()
    """The devices of the GPU running jobs then."""

    def fault(self) -> Fault | None:
        """``decide_resident``'s fault; its reason says what could not be told."""
        fault = decide_resident(self.apps)
        if fault is None or not self.untold:
            return fault
        pids = ", ".join(str(p) for p in self.untold)
        which = f"pids {pids} were" if len(self.untold) > 1 else f"pid {pids} was"
        return attrs.evolve(
            fault,
            reason=f"{fault.reason}; {which} listed under the GPU's own UUID and could not "
            f"be told apart from the jobs on {', '.join(self.busy)} (neither a job's "
            "process group or session nor its RC_JOB_ID could be read)",
        )


def known_jobs(before: Iterable[RunningJob], after: Iterable[RunningJob]) -> list[RunningJob]:
    """The jobs running before a process listing or after it, each once: one that ended
    during the listing is still known (its processes may be listed), and so is one that
    began during it or while the check waited for its lock."""
    seen = list(before)
    return seen + [job for job in after if job not in seen]


def job_of(facts: ProcessFacts, jobs: Sequence[RunningJob]) -> RunningJob | None:
    """The running job ``facts`` show the process belongs to, if any."""
    for job in jobs:
        if job.leader is not None and job.leader in (facts.pgid, facts.sid):
            return job
        # By environment only with the device too: an earlier attempt of the same job on
        # another slice (its hook, its leftovers) carries the same RC_JOB_ID, and is not
        # the running job's.
        if facts.job_id is not None and (facts.job_id, facts.device) == (job.job_id, job.device):
            return job
    return None


def residents(
    apps: Sequence[ComputeApp],
    *,
    shared_uuid: str | None,
    jobs: Sequence[RunningJob],
    facts: Callable[[int], ProcessFacts],
) -> Residents:
    """Which of a device's ``apps`` (its own listing, ``resident_on``) dirty it.

    ``jobs`` run on the other devices of the same physical GPU (its sibling
    slices, or the slices of a GPU that carries them). Only a process listed
    under ``shared_uuid``, the physical GPU's, can be theirs: one listed under
    the device's own MIG UUID is its own. ``facts`` is asked only about those
    listed under the shared UUID, and only while some sibling runs a job.
    Never less cautious than counting every app: a process is let go only
    when its facts name one of ``jobs``.
    """
    if not jobs or shared_uuid is None:
        return Residents(tuple(apps))
    kept: list[ComputeApp] = []
    untold: list[int] = []
    for app in apps:
        if app.gpu_uuid != shared_uuid:
            kept.append(app)
            continue
        seen = facts(app.pid)
        if job_of(seen, jobs) is not None:
            continue
        kept.append(app)
        if not seen.environ_read:
            untold.append(app.pid)
    busy = tuple(sorted({j.device for j in jobs})) if untold else ()
    return Residents(tuple(kept), tuple(untold), busy)
