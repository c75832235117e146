"""The controller's messages: parsed requests, replies, and read-only views.

Requests are what :mod:`rc_worker.controller.wire` builds from validated JSON
and what the store consumes; replies and views are what the store returns and
what ``to_json`` turns back into the wire form of docs/protocol.md. All are
frozen: the store never hands out its live records.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Final

import attrs

JsonObject = dict[str, object]

TERMINAL_STATES: Final = frozenset({"succeeded", "failed", "killed", "error", "rejected", "lost"})
"""Job outcomes that end a job. ``refused`` is an outcome too, but it requeues."""

OUTCOMES: Final = TERMINAL_STATES | {"refused"}
JOB_STATES: Final = frozenset({"queued", "assigned", "running"}) | TERMINAL_STATES
IDLE_BEHAVIORS: Final = frozenset({"run", "hold", "drain"})
RECOVERY_CLAIMS: Final = frozenset({"gone", "alive", "unknown"})


# --- job submission -------------------------------------------------------------------------


@attrs.frozen
class JobSpec:
    """What a user asked to run: the body of ``POST /v1/jobs``."""

    command: tuple[str, ...]
    select: str = ""
    device: str | None = None
    env: Mapping[str, str] = attrs.field(factory=dict, hash=False)
    cwd: str | None = None
    max_runtime_s: float | None = None
    idle_timeout_s: float | None = None
    grace_s: float = 10.0
    pty: bool = False
    stdin: bool = False

    def to_json(self) -> JsonObject:
        return {
            "command": list(self.command),
            "select": self.select,
            "device": self.device,
            "env": dict(self.env),
            "cwd": self.cwd,
            "max_runtime_s": self.max_runtime_s,
            "idle_timeout_s": self.idle_timeout_s,
            "grace_s": self.grace_s,
            "pty": self.pty,
            "stdin": self.stdin,
        }


# --- worker requests ------------------------------------------------------------------------


@attrs.frozen
class HeldFault:
    """A fault a worker says it holds on a device (``register``, protocol 2)."""

    fault_id: str
    kind: str = "fault"
    reason: str = ""


@attrs.frozen
class RunningClaim:
    """The attempt a worker says a device runs (``register``, protocol 2)."""

    job_id: str
    attempt: int
    output_bytes: int | None = None
    started_at: float | None = None


@attrs.frozen
class DeviceDecl:
    name: str
    declared_labels: Mapping[str, str] = attrs.field(factory=dict, hash=False)
    faults: tuple[HeldFault, ...] | None = None
    """None: the worker did not say (protocol 1); else every fault it holds."""
    running: RunningClaim | None = None


@attrs.frozen
class Recovery:
    """One ``recovery`` entry of a registration: a job the previous worker process left running."""

    device: str
    job_id: str
    attempt: int | None
    boot_id: str | None
    claim: str
    sweep: Mapping[str, object] | None = attrs.field(default=None, hash=False)


@attrs.frozen
class LabelsUpdate:
    """Facts to replace: the host's (``None`` keeps them) and those of each device present."""

    host: Mapping[str, str] | None = attrs.field(default=None, hash=False)
    devices: Mapping[str, Mapping[str, str]] = attrs.field(factory=dict, hash=False)


@attrs.frozen
class SheetsUpdate:
    """Usage sheets to replace; ``host_given`` is false when the request did not mention it."""

    host: str | None = None
    host_given: bool = False
    devices: Mapping[str, str | None] = attrs.field(factory=dict, hash=False)


@attrs.frozen
class RegisterRequest:
    boot_id: str
    devices: tuple[DeviceDecl, ...]
    worker_version: str = ""
    pid: int | None = None
    # A per-process id the worker picks at start and keeps in memory only:
    # the one thing that tells "the same live process again" from "a new one".
    instance_id: str | None = None
    labels: LabelsUpdate = LabelsUpdate()
    sheets: SheetsUpdate = SheetsUpdate()
    recovery: tuple[Recovery, ...] = ()
    require_manual_clear: bool = False
    protocol: int = 1


@attrs.frozen
class DeviceReport:
    """One device of a heartbeat, as the worker sees it."""

    state: str
    job_id: str | None = None
    attempt: int | None = None
    faults: tuple[str, ...] = ()
    held_for_health: str | None = None
    """Why the worker's GPU checks hold the device (not offered, not quarantined)."""


@attrs.frozen
class HeartbeatRequest:
    session: str
    devices: Mapping[str, DeviceReport] = attrs.field(factory=dict, hash=False)


@attrs.frozen
class StartRequest:
    session: str
    attempt: int
    device: str
    boot_id: str | None = None


@attrs.frozen
class Verify:
    ok: bool
    reason: str = ""


@attrs.frozen
class FinishRequest:
    session: str
    attempt: int
    device: str
    outcome: str
    exit_code: int | None = None
    killed: bool = False
    reason: str = ""
    error: str | None = None
    output_bytes: int | None = None
    sweep: Mapping[str, object] | None = attrs.field(default=None, hash=False)
    verify: Verify | None = None
    fault_id: str | None = None
    # With ``refused``: the offer was stale (the device stopped being offerable
    # between the poll and its answer), so the refusal is no mark against the job.
    stale_offer: bool = False


@attrs.frozen
class FaultRequest:
    session: str
    fault_id: str
    kind: str
    reason: str = ""
    job_id: str | None = None
    severity: str | None = None
    action: str | None = None
    scope: str | None = None
    """``host``: a fault of the whole host, raised on each of its GPU devices."""
    parent_fault: str | None = None
    """For a MIG slice: the fault id of its physical GPU's fault."""


# --- replies --------------------------------------------------------------------------------


@attrs.frozen
class DeviceStatus:
    """A device's state as the register reply gives it."""

    state: str
    reason: str | None
    fault_id: str | None
    faults: tuple[str, ...]
    idle_behavior: str

    def to_json(self) -> JsonObject:
        return {
            "state": self.state,
            "reason": self.reason,
            "fault_id": self.fault_id,
            "faults": list(self.faults),
            "idle_behavior": self.idle_behavior,
        }


@attrs.frozen
class RegisterReply:
    session: str
    heartbeat_interval_s: float
    poll_wait_s: float
    devices: Mapping[str, DeviceStatus] = attrs.field(hash=False)
    protocol: int = 2

    def to_json(self) -> JsonObject:
        return {
            "protocol": self.protocol,
            "session": self.session,
            "heartbeat_interval_s": self.heartbeat_interval_s,
            "poll_wait_s": self.poll_wait_s,
            "devices": {name: d.to_json() for name, d in self.devices.items()},
        }


@attrs.frozen
class CancelOrder:
    job_id: str
    attempt: int
    reason: str

    def to_json(self) -> JsonObject:
        return {"job_id": self.job_id, "attempt": self.attempt, "reason": self.reason}


@attrs.frozen
class HeartbeatReply:
    cancel: tuple[CancelOrder, ...]
    idle_behavior: Mapping[str, str] = attrs.field(hash=False)
    cleared: Mapping[str, tuple[str, ...]] = attrs.field(hash=False)

    def to_json(self) -> JsonObject:
        return {
            "cancel": [c.to_json() for c in self.cancel],
            "idle_behavior": dict(self.idle_behavior),
            "cleared": {d: list(ids) for d, ids in self.cleared.items()},
        }


@attrs.frozen
class Assignment:
    job_id: str
    attempt: int
    device: str
    spec: JobSpec

    @property
    def stdin_url(self) -> str | None:
        if not self.spec.stdin:
            return None
        return f"/v1/jobs/{self.job_id}/stdin?attempt={self.attempt}"

    def to_json(self) -> JsonObject:
        url = self.stdin_url
        return {
            "job_id": self.job_id,
            "attempt": self.attempt,
            "device": self.device,
            "command": list(self.spec.command),
            "cwd": self.spec.cwd,
            "env": dict(self.spec.env),
            "max_runtime_s": self.spec.max_runtime_s,
            "idle_timeout_s": self.spec.idle_timeout_s,
            "grace_s": self.spec.grace_s,
            "stdin": None if url is None else {"url": url},
            "pty": self.spec.pty,
        }


# --- read-only views ------------------------------------------------------------------------


@attrs.frozen
class AttemptInfo:
    attempt: int
    host: str
    device: str
    status: str
    """``assigned``, ``running``, ``requeued`` or ``finished``."""
    note: str = ""

    def to_json(self) -> JsonObject:
        return {
            "attempt": self.attempt,
            "host": self.host,
            "device": self.device,
            "status": self.status,
            "note": self.note,
        }


@attrs.frozen
class JobInfo:
    """A snapshot of a job. ``host``/``device`` say where the current attempt is placed."""

    job_id: str
    state: str
    attempt: int
    spec: JobSpec
    host: str | None = None
    device: str | None = None
    submitted_at: float | None = None
    submitted_by: str | None = None
    started_at: float | None = None
    finished_at: float | None = None
    outcome: str | None = None
    exit_code: int | None = None
    killed: bool = False
    reason: str = ""
    error: str | None = None
    output_bytes: int | None = None
    committed_bytes: int = 0
    cancel_requested: str | None = None
    fault_id: str | None = None
    verify: Verify | None = None
    sweep: Mapping[str, object] | None = attrs.field(default=None, hash=False)
    attempts: tuple[AttemptInfo, ...] = ()
    adopted: bool = False
    output_truncated: bool = False
    pending_reason: str | None = None
    """Why a queued job is not running yet (None unless ``queued``); see controller/pending.py."""
    pending_code: str | None = None

    @property
    def terminal(self) -> bool:
        return self.state in TERMINAL_STATES

    def to_json(self) -> JsonObject:
        return {
            "job_id": self.job_id,
            "state": self.state,
            "attempt": self.attempt,
            "host": self.host,
            "device": self.device,
            "spec": self.spec.to_json(),
            "submitted_at": self.submitted_at,
            "submitted_by": self.submitted_by,
            "started_at": self.started_at,
            "finished_at": self.finished_at,
            "outcome": self.outcome,
            "exit_code": self.exit_code,
            "killed": self.killed,
            "reason": self.reason,
            "error": self.error,
            "output_bytes": self.output_bytes,
            "committed_bytes": self.committed_bytes,
            "cancel_requested": self.cancel_requested,
            "fault_id": self.fault_id,
            "verify": None
            if self.verify is None
            else {"ok": self.verify.ok, "reason": self.verify.reason},
            "sweep": None if self.sweep is None else dict(self.sweep),
            "attempts": [a.to_json() for a in self.attempts],
            "adopted": self.adopted,
            "output_truncated": self.output_truncated,
            "pending_reason": self.pending_reason,
            "pending_code": self.pending_code,
        }


@attrs.frozen
class FaultInfo:
    fault_id: str
    kind: str
    reason: str
    detail: str
    job_id: str | None
    raised_by: str
    """``worker`` or ``controller``."""
    severity: str = "error"
    """``warning``, ``error`` or ``fatal``."""
    action: str = "clear"
    """The recommended step: ``clear``, ``reset``, ``reboot`` or ``replace``."""
    scope: str = "device"
    parent_fault: str | None = None

    def to_json(self) -> JsonObject:
        return {
            "fault_id": self.fault_id,
            "kind": self.kind,
            "reason": self.reason,
            "detail": self.detail,
            "job_id": self.job_id,
            "raised_by": self.raised_by,
            "severity": self.severity,
            "action": self.action,
            "scope": self.scope,
            "parent_fault": self.parent_fault,
        }


@attrs.frozen
class DeviceInfo:
    """A snapshot of a device.

    ``state`` is ``free``, ``busy`` (a job is assigned or running), ``quarantined``
    (at least one fault is not cleared) or ``absent`` (not in the host's latest
    registration). ``labels`` is what selectors see.
    """

    host: str
    name: str
    state: str
    reason: str | None
    fault_id: str | None
    faults: tuple[FaultInfo, ...]
    labels: Mapping[str, str] = attrs.field(hash=False)
    facts: Mapping[str, str] = attrs.field(hash=False)
    declared_labels: Mapping[str, str] = attrs.field(hash=False)
    idle_behavior: str = "run"
    job_id: str | None = None
    attempt: int | None = None
    present: bool = True
    host_state: str = "up"
    worker_state: str | None = None
    cleared_pending: tuple[str, ...] = ()
    held_for_health: str | None = None

    @property
    def address(self) -> str:
        return f"{self.host}/{self.name}"

    def to_json(self) -> JsonObject:
        return {
            "host": self.host,
            "device": self.name,
            "address": self.address,
            "state": self.state,
            "reason": self.reason,
            "fault_id": self.fault_id,
            "faults": [f.to_json() for f in self.faults],
            "labels": dict(self.labels),
            "facts": dict(self.facts),
            "declared_labels": dict(self.declared_labels),
            "idle_behavior": self.idle_behavior,
            "job_id": self.job_id,
            "attempt": self.attempt,
            "present": self.present,
            "host_state": self.host_state,
            "worker_state": self.worker_state,
            "held_for_health": self.held_for_health,
        }


@attrs.frozen
class SheetInfo:
    host: str
    device: str
    host_sheet: str | None
    device_sheet: str | None

    def to_json(self) -> JsonObject:
        return {
            "host": self.host,
            "device": self.device,
            "host_sheet": self.host_sheet,
            "device_sheet": self.device_sheet,
        }


@attrs.frozen
class Event:
    """One entry of the event log. ``time`` is wall-clock seconds, for people only."""

    seq: int
    type: str
    time: float
    data: Mapping[str, object] = attrs.field(hash=False)

    def to_json(self) -> JsonObject:
        return {"seq": self.seq, "type": self.type, "time": self.time, **self.data}
