"""What a sweep saw, and THE rule that reads it (sans-IO).

``sweep.py`` (the RC_JOB_ID scan) and ``cgroup.py`` (the cgroup kill)
produce a :class:`SweepReport`; :func:`unproven` says whether it proves the
job left nothing. Kept apart from the scan so that the pure decisions that
read a report (``lease.py``, ``claim_decision.py``) import no I/O.
"""

from __future__ import annotations

import attrs

METHOD_ENVIRON = "environ"
METHOD_CGROUP = "cgroup"


@attrs.frozen
class SweepReport:
    """What the sweep saw and did. A report, never an outcome.

    ``scanned``: the job's processes could be looked for at all ("found
    nothing" and "could not look" are opposite answers). ``found``: every
    live process of the job seen after its group was torn down. ``remaining``:
    what was still alive after SIGTERM, the grace window, SIGKILL and a short
    wait (non-empty means the host is still dirty). ``blind``: the answer is
    incomplete: some process could not be inspected (EACCES on its
    environment: a worker not running as root), listed in ``blind_pids``, or
    the table stopped being readable half-way. ``method``: ``cgroup`` (the
    job's own cgroup was read: exact, never blind) or ``environ`` (the
    process table was searched for the job's RC_JOB_ID).
    """

    scanned: bool
    found: tuple[int, ...] = ()
    remaining: tuple[int, ...] = ()
    blind: bool = False
    blind_pids: tuple[int, ...] = ()
    method: str = METHOD_ENVIRON

    @property
    def clean(self) -> bool:
        """Whether the sweep *proved* nothing of the job is left running (see :func:`unproven`)."""
        return unproven(self) is None


def unproven(report: SweepReport) -> str | None:
    """THE rule (invariant 1): why ``report`` does not prove the job left nothing, or ``None``.

    Proven clean means: it looked, it could see everything it looked at, and
    it either found nothing or removed everything it found. An empty
    ``found`` alone is not this claim. The device supervisor (at a job's end:
    not proven means the device is quarantined ``dirty``) and recovery (not
    proven means the claim is not ``gone``) both decide with this function,
    so a sweep the worker could not see through never offers a device at
    one moment and refuses to at another.
    """
    if not report.scanned:
        return "the job's processes could not be looked for (the process table was unreadable)"
    if report.remaining:
        return f"processes {list(report.remaining)} survived SIGKILL"
    if report.blind:
        which = f"processes {list(report.blind_pids)}" if report.blind_pids else "some processes"
        return (
            f"the sweep could not inspect {which} (environment unreadable: a worker that is not "
            "root); a process of the job may still be alive. Run the worker as root or give "
            "it a delegated cgroup (cgroup: auto)"
        )
    return None


NOT_SWEPT = SweepReport(scanned=False)
"""The report of a job that asked for no sweep: nothing looked, nothing proved."""

NOTHING_STARTED = SweepReport(scanned=True)
"""The report of a job whose process was never created: nothing can be left of it."""
