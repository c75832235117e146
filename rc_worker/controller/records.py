"""The store's live, mutable records, and the snapshots it hands out of them.

Only :mod:`rc_worker.controller.store` mutates these; everything else sees the
frozen views of :mod:`rc_worker.controller.messages`.
"""

from __future__ import annotations

import attrs

from rc_worker.controller.messages import (
    TERMINAL_STATES,
    AttemptInfo,
    DeviceInfo,
    FaultInfo,
    JobInfo,
    JobSpec,
    Verify,
)
from rc_worker.controller.pool import view_host_state, view_state
from rc_worker.core.selectors import Selector

# The recommended step of a fault that arrives without one (an older worker,
# or a fault the controller derives from a finish). Mirrors the worker's table.
_FAULT_DEFAULTS: dict[str, tuple[str, str]] = {
    "dirty": ("error", "reboot"),
    "verify_failed": ("error", "clear"),
    "hook_failed": ("error", "clear"),
    "interrupted": ("warning", "clear"),
    "gpu_resident_process": ("warning", "clear"),
    "gpu_memory": ("error", "reset"),
    "gpu_xid": ("error", "reset"),
    "gpu_missing": ("fatal", "reboot"),
}
SEVERITIES = ("warning", "error", "fatal")
ACTIONS = ("clear", "reset", "reboot", "replace")


def fault_defaults(kind: str) -> tuple[str, str]:
    """``(severity, action)`` for a fault of ``kind`` that did not say."""
    return _FAULT_DEFAULTS.get(kind, ("error", "clear"))


@attrs.define(eq=False)
class Fault:
    fault_id: str
    kind: str
    reason: str
    """The device row's reason: ``interrupted`` (raised by the controller) or ``fault``."""
    detail: str
    job_id: str | None
    attempt: int | None
    raised_by: str
    boot_id: str | None = None
    """For ``interrupted``: the host's boot id when the job started, if known."""
    severity: str = ""
    action: str = ""
    scope: str = "device"
    parent_fault: str | None = None

    def __attrs_post_init__(self) -> None:
        # An unknown or missing severity/action reads as the kind's default:
        # a fault must always say what to do.
        severity, action = fault_defaults(self.kind)
        if self.severity not in SEVERITIES:
            self.severity = severity
        if self.action not in ACTIONS:
            self.action = action

    def describe(self) -> str:
        """``kind: detail``, for the one-line reasons people read."""
        return f"{self.kind}: {self.detail}" if self.detail else self.kind

    def info(self) -> FaultInfo:
        return FaultInfo(
            fault_id=self.fault_id,
            kind=self.kind,
            reason=self.reason,
            detail=self.detail,
            job_id=self.job_id,
            raised_by=self.raised_by,
            severity=self.severity,
            action=self.action,
            scope=self.scope,
            parent_fault=self.parent_fault,
        )


@attrs.define(eq=False)
class Attempt:
    number: int
    host: str
    device: str
    status: str
    """``assigned``, ``running``, ``requeued`` or ``finished``."""
    last_heard: float
    """Controller clock: assignment time, then the last heartbeat that mentioned this attempt."""
    start_boot_id: str | None = None
    adopted: bool = False
    """Carried over a registration in ``recovery``: the worker owes its finish."""
    note: str = ""

    def info(self) -> AttemptInfo:
        return AttemptInfo(self.number, self.host, self.device, self.status, self.note)


@attrs.define(eq=False)
class Job:
    job_id: str
    seq: int
    spec: JobSpec
    selector: Selector
    submitted_at: float
    submitted_by: str | None = None
    state: str = "queued"
    attempts: list[Attempt] = attrs.Factory(list)
    cancel_reason: str | None = None
    refusals: int = 0
    stale_refusals: int = 0
    output: bytearray = attrs.Factory(bytearray)
    started_at: float | None = None
    finished_at: float | None = None
    finished_by: str | None = None
    outcome: str | None = None
    exit_code: int | None = None
    killed: bool = False
    reason: str = ""
    error: str | None = None
    output_bytes: int | None = None
    fault_id: str | None = None
    verify: Verify | None = None
    sweep: dict[str, object] | None = None
    adopted: bool = False
    """Recorded from a worker's claim (its registration or heartbeat), not from a submit."""
    output_truncated: bool = False
    """Output past the controller's ``max_output_bytes`` was acknowledged and dropped."""
    dropped_bytes: int = 0
    """How many bytes were dropped that way (the worker's committed count includes them)."""
    output_base: int = 0
    """Where ``output`` starts: bytes below it are stored beneath the store (persisted and
    dropped from memory), and read from there (:class:`OutputElsewhere`)."""

    @property
    def stored_bytes(self) -> int:
        return self.output_base + len(self.output)

    @property
    def terminal(self) -> bool:
        return self.state in TERMINAL_STATES

    @property
    def attempt(self) -> int:
        return len(self.attempts)

    @property
    def current(self) -> Attempt | None:
        """The attempt that requests may still name, or None while (re)queued."""
        if not self.attempts or self.attempts[-1].status == "requeued":
            return None
        return self.attempts[-1]

    def info(self) -> JobInfo:
        cur = self.current
        return JobInfo(
            job_id=self.job_id,
            state=self.state,
            attempt=self.attempt,
            spec=self.spec,
            host=None if cur is None else cur.host,
            device=None if cur is None else cur.device,
            submitted_at=self.submitted_at,
            submitted_by=self.submitted_by,
            started_at=self.started_at,
            finished_at=self.finished_at,
            outcome=self.outcome,
            exit_code=self.exit_code,
            killed=self.killed,
            reason=self.reason,
            error=self.error,
            output_bytes=self.output_bytes,
            committed_bytes=self.stored_bytes,
            cancel_requested=self.cancel_reason,
            fault_id=self.fault_id,
            verify=self.verify,
            sweep=None if self.sweep is None else dict(self.sweep),
            attempts=tuple(a.info() for a in self.attempts),
            adopted=self.adopted,
            output_truncated=self.output_truncated,
        )


@attrs.define(eq=False)
class Device:
    host: str
    name: str
    present: bool = True
    declared: dict[str, str] = attrs.Factory(dict)
    facts: dict[str, str] = attrs.Factory(dict)
    sheet: str | None = None
    idle_behavior: str = "run"
    faults: dict[str, Fault] = attrs.Factory(dict)
    seen_faults: set[str] = attrs.Factory(set)
    """Every fault id ever raised here, so a retried report cannot re-raise a cleared fault."""
    cleared_pending: dict[str, int] = attrs.Factory(dict)
    """Lifted fault ids still listed in heartbeat ``cleared``, each with how many heartbeats
    in a row have reported this device without it."""
    job: Job | None = None
    """The job holding this device in the controller's view (assigned or running)."""
    worker_state: str | None = None
    worker_faults: set[str] = attrs.Factory(set)
    """Fault ids the worker said it holds (registration, heartbeats): never assigned while
    any is held, whatever the controller's own records say."""
    held_for_health: str | None = None
    """From the worker's last heartbeat: why its GPU checks hold the device."""
    last_job: str | None = None
    """The job that last held the device (the seed's ``last_container_uuid``)."""
    last_busy: float | None = None
    """Wall clock: when a job last took or left the device (the seed's ``last_busy``)."""

    def occupy(self, job: Job, wall: float) -> None:
        """``job`` holds the device now (assigned, running, adopted)."""
        self.job = job
        self.last_job, self.last_busy = job.job_id, wall

    def vacate(self, job: Job, wall: float) -> None:
        """``job`` let the device go (finished, requeued, lost)."""
        if self.job is job:
            self.job = None
            self.last_job, self.last_busy = job.job_id, wall

    @property
    def state(self) -> str:
        if not self.present:
            return "absent"
        if self.faults:
            return "quarantined"
        if self.job is not None:
            return "busy"
        return "free"

    def first_fault(self) -> Fault | None:
        return next(iter(self.faults.values()), None)

    def labels(self, host: Host) -> dict[str, str]:
        """What a selector sees: host facts, then device facts, then the operator's labels."""
        own = {**self.facts, **self.declared}
        view = {**host.facts, **own}
        view.update({f"{self.name}.{k}": v for k, v in own.items()})
        view.setdefault("host", host.name)
        view.setdefault("device", self.name)
        return view

    def view_state(self, host: Host) -> str:
        """The state ``GET /v1/devices`` shows: the pool's (``held``, ``absent`` for a
        free device of a host with no session: deregistered, lost or unknown), not the
        record's own."""
        return view_state(self.state, self.idle_behavior, host.view_state())

    def info(self, host: Host) -> DeviceInfo:
        first = self.first_fault()
        cur = None if self.job is None else self.job.current
        host_state = host.view_state()
        return DeviceInfo(
            host=self.host,
            name=self.name,
            state=view_state(self.state, self.idle_behavior, host_state),
            reason=None if first is None else first.reason,
            fault_id=None if first is None else first.fault_id,
            faults=tuple(f.info() for f in self.faults.values()),
            labels=self.labels(host),
            facts=dict(self.facts),
            declared_labels=dict(self.declared),
            idle_behavior=self.idle_behavior,
            job_id=None if self.job is None else self.job.job_id,
            attempt=None if cur is None else cur.number,
            present=self.present,
            host_state=host_state,
            worker_state=self.worker_state,
            cleared_pending=tuple(self.cleared_pending),
            held_for_health=self.held_for_health,
            last_job=self.last_job if self.job is None else self.job.job_id,
            last_busy=self.last_busy,
        )


@attrs.define(eq=False)
class Host:
    name: str
    boot_id: str
    last_seen: float
    session: str | None = None
    lost: bool = False
    left: bool = False
    """Deregistered by a draining worker: gone on purpose, not lost."""
    pid: int | None = None
    instance_id: str | None = None
    heartbeat_interval_s: float | None = None
    """The interval this host's worker was told at its last registration."""
    worker_version: str = ""
    require_manual_clear: bool = False
    facts: dict[str, str] = attrs.Factory(dict)
    sheet: str | None = None
    devices: dict[str, Device] = attrs.Factory(dict)
    recovering_until: float | None = None
    """Set when a controller restarts on a stored state: the host is ``unknown`` until its
    worker registers again, or until this controller-clock time, when it is lost."""

    @property
    def state(self) -> str:
        if self.recovering_until is not None:
            return "unknown"
        return "lost" if self.lost else "left" if self.left else "up"

    def view_state(self) -> str:
        """The state ``GET /v1/devices`` and the pool show: ``draining`` too."""
        return view_host_state(
            self.state, (d.idle_behavior for d in self.devices.values() if d.present)
        )
