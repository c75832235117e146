"""The user endpoints' messages, and the job and device views both sides show (sans-IO).

Part of :mod:`rc_worker.core.protocol`, which names every message; read and write them
through its converter.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Final

import attrs

from rc_worker.core.jsonconv import (
    EXPECTED,
    KEY,
    LOCAL,
    JsonObject,
    ProtocolError,
    converter,
    plain,
    unstructure,
)

TERMINAL_STATES: Final = frozenset({"succeeded", "failed", "killed", "error", "rejected", "lost"})
"""Job outcomes that end a job. ``refused`` is an outcome too, but it requeues."""

OUTCOMES: Final = TERMINAL_STATES | {"refused"}
JOB_STATES: Final = frozenset({"queued", "assigned", "running"}) | TERMINAL_STATES
IDLE_BEHAVIORS: Final = frozenset({"run", "hold", "drain"})
RECOVERY_CLAIMS: Final = frozenset({"gone", "alive", "unknown"})


def _cancel_reason(reason: str) -> str:
    return reason or "cancelled"


def as_args(command: Iterable[str]) -> tuple[str, ...]:
    return tuple(command)


# --- job submission (a user's request, and the spec a job view shows) ----------------------


@attrs.frozen
class JobSpec:
    """What a user asked to run: the body of ``POST /v1/jobs``."""

    command: tuple[str, ...] = attrs.field(
        converter=as_args, metadata={EXPECTED: "a non-empty list of strings"}
    )
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
        return unstructure(self)


@attrs.frozen
class SubmitRequest:
    """``POST /v1/jobs``: the spec, and whether a job nothing can run is refused."""

    spec: JobSpec
    strict: bool = False


@attrs.frozen
class CancelRequest:
    reason: str = attrs.field(default="cancelled", converter=_cancel_reason)


@attrs.frozen
class IdleBehaviorRequest:
    idle_behavior: str


@attrs.frozen
class RetireRequest:
    force: bool = False


# --- read-only views ------------------------------------------------------------------------


@attrs.frozen
class Verify:
    ok: bool = True
    reason: str = ""


@attrs.frozen
class AttemptInfo:
    attempt: int
    host: str
    device: str
    status: str
    """``assigned``, ``running``, ``requeued`` or ``finished``."""
    note: str = ""

    def to_json(self) -> JsonObject:
        return unstructure(self)


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
    sweep: JsonObject | None = attrs.field(default=None, hash=False)
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
        return unstructure(self)


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
        return unstructure(self)


@attrs.frozen
class DeviceInfo:
    """A snapshot of a device.

    ``state`` is ``free``, ``busy`` (a job is assigned or running), ``quarantined``
    (at least one fault is not cleared) or ``absent`` (not in the host's latest
    registration). ``labels`` is what selectors see.
    """

    host: str
    name: str = attrs.field(metadata={KEY: "device"})
    state: str = attrs.field()
    reason: str | None = attrs.field()
    fault_id: str | None = attrs.field()
    faults: tuple[FaultInfo, ...] = attrs.field()
    labels: Mapping[str, str] = attrs.field(hash=False)
    facts: Mapping[str, str] = attrs.field(hash=False)
    declared_labels: Mapping[str, str] = attrs.field(hash=False)
    idle_behavior: str = "run"
    job_id: str | None = None
    attempt: int | None = None
    present: bool = True
    host_state: str = "up"
    worker_state: str | None = None
    cleared_pending: tuple[str, ...] = attrs.field(default=(), metadata={LOCAL: True})
    held_for_health: str | None = None
    last_job: str | None = None
    """The job running there now, else the last one that did (null: none since known)."""
    last_busy: float | None = None
    """Wall clock: when a job last took or left the device; null if none has since known."""

    @property
    def address(self) -> str:
        return f"{self.host}/{self.name}"

    def to_json(self) -> JsonObject:
        return unstructure(self)


@attrs.frozen
class SheetInfo:
    host: str
    device: str
    host_sheet: str | None
    device_sheet: str | None

    def to_json(self) -> JsonObject:
        return unstructure(self)


@attrs.frozen
class Event:
    """One entry of the event log. ``time`` is wall-clock seconds, for people only."""

    seq: int
    type: str
    time: float
    data: Mapping[str, object] = attrs.field(hash=False)

    def to_json(self) -> JsonObject:
        return unstructure(self)


# --- envelopes ------------------------------------------------------------------------------


@attrs.frozen
class SubmitReply:
    job_id: str
    pending_reason: str | None = None
    pending_code: str | None = None


@attrs.frozen
class JobsPage:
    jobs: tuple[JobInfo, ...] = ()
    next: int | None = None


@attrs.frozen
class DevicesReply:
    """``GET /v1/devices``, and host drain and resume."""

    devices: tuple[DeviceInfo, ...] = ()
    next: str | None = None
    """The cursor of the next page (``after``), or null on the last one."""


@attrs.frozen
class ClearReply:
    cleared: tuple[str, ...]
    device: DeviceInfo


@attrs.frozen
class HostClearReply:
    host: str
    cleared: Mapping[str, tuple[str, ...]] = attrs.field(hash=False)
    devices: tuple[DeviceInfo, ...] = ()
    next: str | None = None
    """The cursor of the next page (``after``), or null on the last one."""


@attrs.frozen
class RetireReply:
    host: str
    jobs_lost: tuple[str, ...] = ()
    retired: bool = True


@attrs.frozen
class StdinReply:
    accepted: int


@attrs.frozen
class EventsPage:
    events: tuple[Event, ...] = ()
    last: int = 0


# --- the hooks of the messages whose JSON is not one key per field ----------------------------


def _structure_submit(value: object, _: object) -> SubmitRequest:
    # The spec's fields are the body's own, beside ``strict``.
    spec = converter.structure(value, JobSpec)
    assert isinstance(value, dict)
    try:
        strict = converter.structure(value.get("strict") or False, bool)
    except ProtocolError as e:
        raise e.under("strict") from None
    return SubmitRequest(spec=spec, strict=strict)


def _unstructure_submit(s: SubmitRequest) -> JsonObject:
    return {**unstructure(s.spec), "strict": s.strict}


def _structure_event(value: object, _: object) -> Event:
    if not isinstance(value, dict):
        raise ProtocolError("expected a JSON object")
    head = converter.structure({k: value.get(k) for k in ("seq", "type", "time")}, _EventHead)
    data = {k: v for k, v in value.items() if k not in ("seq", "type", "time")}
    return Event(seq=head.seq, type=head.type, time=head.time, data=data)


@attrs.frozen
class _EventHead:
    seq: int
    type: str
    time: float


def _unstructure_event(e: Event) -> JsonObject:
    return {"seq": e.seq, "type": e.type, "time": e.time, **plain(converter, dict(e.data))}  # type: ignore[dict-item]


def _unstructure_device(d: DeviceInfo) -> JsonObject:
    out = _device_fields(d)
    # ``address`` is derived, for people; readers that parse a DeviceInfo ignore it.
    return {"host": out.pop("host"), "device": out.pop("device"), "address": d.address, **out}


_device_fields = converter.get_unstructure_hook(DeviceInfo)

converter.register_structure_hook(SubmitRequest, _structure_submit)
converter.register_unstructure_hook(SubmitRequest, _unstructure_submit)
converter.register_structure_hook(Event, _structure_event)
converter.register_unstructure_hook(Event, _unstructure_event)
converter.register_unstructure_hook(DeviceInfo, _unstructure_device)
