"""Every message of docs/protocol.md as a frozen attrs class, and the one converter (sans-IO).

The worker and the controller both read and write the wire through
:data:`converter` (:func:`structure`, :func:`unstructure`); nothing else parses
or builds protocol JSON. Unknown keys are ignored and ``null`` means "absent",
as the protocol promises; a malformed body is one :class:`ProtocolError` naming
the field (``assignments[2].limits.runtime: expected a number or null``), which
the controller answers as ``400 bad_request`` and the worker as a rejection.

The checks here are of shape only (types, required keys). Each side's own rules
about values (a selector that parses, a duration below a year, a ``stdin.url``
on the controller's origin) stay with that side: a value one side refuses may be
one the other must still carry.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Final, TypeAlias, TypeVar

import attrs

from rc_worker.core.jsonconv import (
    EXPECTED,
    IF_NULL,
    KEY,
    LOCAL,
    OMIT,
    JsonObject,
    ProtocolError,
    make_converter,
    plain,
)

__all__ = [
    "NO_SESSION",
    "Assignment",
    "AssignmentIdentity",
    "CancelOrder",
    "CancelRequest",
    "ClearReply",
    "DeregisterRequest",
    "DeviceDecl",
    "DeviceInfo",
    "DeviceReport",
    "DeviceStatus",
    "DevicesReply",
    "ErrorReply",
    "Event",
    "EventsPage",
    "FaultInfo",
    "FaultRequest",
    "FinishRequest",
    "HealthReply",
    "HeartbeatReply",
    "HeartbeatRequest",
    "HeldFault",
    "HostClearReply",
    "IdleBehaviorRequest",
    "JobInfo",
    "JobSpec",
    "JobsPage",
    "JsonObject",
    "KnownCancel",
    "LabelsRequest",
    "LabelsUpdate",
    "Message",
    "OkReply",
    "OutputReply",
    "PollReply",
    "PollRequest",
    "ProtocolError",
    "Recovery",
    "RegisterReply",
    "RegisterRequest",
    "RetireReply",
    "RetireRequest",
    "RunningClaim",
    "SheetInfo",
    "SheetsRequest",
    "SheetsUpdate",
    "StartRequest",
    "StateReply",
    "StdinRef",
    "StdinReply",
    "SubmitReply",
    "SubmitRequest",
    "Sweep",
    "Verify",
    "converter",
    "structure",
    "to_wire",
    "unstructure",
]

T = TypeVar("T")

TERMINAL_STATES: Final = frozenset({"succeeded", "failed", "killed", "error", "rejected", "lost"})
"""Job outcomes that end a job. ``refused`` is an outcome too, but it requeues."""

OUTCOMES: Final = TERMINAL_STATES | {"refused"}
JOB_STATES: Final = frozenset({"queued", "assigned", "running"}) | TERMINAL_STATES
IDLE_BEHAVIORS: Final = frozenset({"run", "hold", "drain"})
RECOVERY_CLAIMS: Final = frozenset({"gone", "alive", "unknown"})

NO_SESSION: Final = ""
"""The ``session`` of a request built before it is sent: the client fills in its live
session at every try (it changes when the worker registers again), so the body
left unsent on disk never carries a stale one. An empty session is left out."""

_SESSION: Final = {OMIT: NO_SESSION}


def _kind_or_fault(kind: str) -> str:
    # Any kind is kept (refusing an unfamiliar one would lose a quarantine); none reads "fault".
    return kind or "fault"


def _claim(claim: str) -> str:
    # A claim this side does not know proves nothing: it reads as unknown.
    return claim if claim in RECOVERY_CLAIMS else "unknown"


def _protocol(version: int) -> int:
    return version or 1


def _cancel_reason(reason: str) -> str:
    return reason or "cancelled"


def _args(command: Iterable[str]) -> tuple[str, ...]:
    return tuple(command)


# --- job submission (a user's request, and the spec a job view shows) ----------------------


@attrs.frozen
class JobSpec:
    """What a user asked to run: the body of ``POST /v1/jobs``."""

    command: tuple[str, ...] = attrs.field(
        converter=_args, metadata={EXPECTED: "a non-empty list of strings"}
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


# --- worker requests ------------------------------------------------------------------------


@attrs.frozen
class HeldFault:
    """A fault a worker says it holds on a device (``register``, protocol 2)."""

    fault_id: str
    kind: str = attrs.field(default="fault", converter=_kind_or_fault)
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
    faults: tuple[HeldFault, ...] | None = attrs.field(
        default=None, metadata={IF_NULL: (), OMIT: None}
    )
    """None: the worker did not say (protocol 1); else every fault it holds."""
    running: RunningClaim | None = attrs.field(default=None, metadata={OMIT: None})


@attrs.frozen
class Recovery:
    """One ``recovery`` entry of a registration: a job the previous worker process left running."""

    device: str
    job_id: str
    attempt: int | None = None
    boot_id: str | None = None
    claim: str = attrs.field(default="unknown", converter=_claim)
    sweep: JsonObject | None = attrs.field(default=None, hash=False)


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
    devices: tuple[DeviceDecl, ...] = ()
    worker_version: str = ""
    pid: int | None = None
    # A per-process id the worker picks at start and keeps in memory only:
    # the one thing that tells "the same live process again" from "a new one".
    instance_id: str | None = None
    labels: LabelsUpdate = LabelsUpdate()
    sheets: SheetsUpdate = SheetsUpdate()
    recovery: tuple[Recovery, ...] = ()
    require_manual_clear: bool = False
    protocol: int = attrs.field(default=1, converter=_protocol)


@attrs.frozen
class DeviceReport:
    """One device of a heartbeat, as the worker sees it."""

    state: str
    job_id: str | None = attrs.field(default=None, metadata={OMIT: None})
    attempt: int | None = attrs.field(default=None, metadata={OMIT: None})
    faults: tuple[str, ...] = attrs.field(default=(), metadata={OMIT: ()})
    held_for_health: str | None = attrs.field(default=None, metadata={OMIT: None})
    """Why the worker's GPU checks hold the device (not offered, not quarantined)."""


@attrs.frozen
class HeartbeatRequest:
    session: str = attrs.field(metadata=_SESSION)
    devices: Mapping[str, DeviceReport] = attrs.field(factory=dict, hash=False)


@attrs.frozen
class KnownCancel:
    job_id: str
    attempt: int


@attrs.frozen
class PollRequest:
    session: str = attrs.field(metadata=_SESSION)
    ready: tuple[str, ...] = ()
    wait_s: float | None = None
    withdrawn: tuple[str, ...] = ()
    watch_cancels: bool = False
    known_cancels: tuple[KnownCancel, ...] = ()


@attrs.frozen
class DeregisterRequest:
    session: str = attrs.field(metadata=_SESSION)


@attrs.frozen
class StartRequest:
    session: str = attrs.field(metadata=_SESSION)
    attempt: int
    device: str
    boot_id: str | None = None


@attrs.frozen
class Verify:
    ok: bool = True
    reason: str = ""


@attrs.frozen
class FinishRequest:
    session: str = attrs.field(metadata=_SESSION)
    attempt: int
    device: str
    outcome: str
    exit_code: int | None = None
    killed: bool = False
    reason: str = ""
    error: str | None = None
    output_bytes: int | None = None
    sweep: JsonObject | None = attrs.field(default=None, hash=False)
    verify: Verify | None = None
    fault_id: str | None = None
    # With ``refused``: the offer was stale (the device stopped being offerable
    # between the poll and its answer), so the refusal is no mark against the job.
    stale_offer: bool = attrs.field(default=False, metadata={OMIT: False})
    usage: object = attrs.field(default=None, hash=False, metadata={OMIT: None})
    """The job's cgroup accounting (``cpu_usec``, …); the controller accepts and ignores it."""


@attrs.frozen
class FaultRequest:
    session: str = attrs.field(metadata=_SESSION)
    fault_id: str
    kind: str = attrs.field(default="fault", converter=_kind_or_fault)
    reason: str = ""
    job_id: str | None = attrs.field(default=None, metadata={OMIT: None})
    severity: str | None = attrs.field(default=None, metadata={OMIT: None})
    action: str | None = attrs.field(default=None, metadata={OMIT: None})
    scope: str | None = attrs.field(default=None, metadata={OMIT: None})
    """``host``: a fault of the whole host, raised on each of its GPU devices."""
    parent_fault: str | None = attrs.field(default=None, metadata={OMIT: None})
    """For a MIG slice: the fault id of its physical GPU's fault."""


@attrs.frozen
class LabelsRequest:
    """``PUT labels``: the session, and the facts to replace."""

    session: str = attrs.field(metadata=_SESSION)
    host: Mapping[str, str] | None = attrs.field(default=None, hash=False)
    devices: Mapping[str, Mapping[str, str]] = attrs.field(factory=dict, hash=False)

    @property
    def update(self) -> LabelsUpdate:
        return LabelsUpdate(host=self.host, devices=self.devices)


@attrs.frozen
class SheetsRequest:
    """``PUT sheets``: the session, and the sheets to replace."""

    session: str = attrs.field(metadata=_SESSION)
    sheets: SheetsUpdate = SheetsUpdate()


# --- replies to the worker ------------------------------------------------------------------


@attrs.frozen
class DeviceStatus:
    """A device's state as the register reply gives it."""

    # A reply that leaves it out quarantines nothing, as before the types.
    state: str = "free"
    reason: str | None = None
    fault_id: str | None = None
    faults: tuple[str, ...] = ()
    idle_behavior: str | None = None

    def to_json(self) -> JsonObject:
        return unstructure(self)


@attrs.frozen
class RegisterReply:
    session: str
    heartbeat_interval_s: float | None = None
    poll_wait_s: float | None = None
    devices: Mapping[str, DeviceStatus] = attrs.field(factory=dict, hash=False)
    protocol: int | None = None
    """The controller's protocol version; ``None`` when it did not say (version 1)."""

    def to_json(self) -> JsonObject:
        return unstructure(self)


@attrs.frozen
class CancelOrder:
    job_id: str
    attempt: int
    reason: str = ""

    def to_json(self) -> JsonObject:
        return unstructure(self)


@attrs.frozen
class HeartbeatReply:
    cancel: tuple[CancelOrder, ...] = ()
    idle_behavior: Mapping[str, str] = attrs.field(factory=dict, hash=False)
    cleared: Mapping[str, tuple[str, ...]] = attrs.field(factory=dict, hash=False)

    def to_json(self) -> JsonObject:
        return unstructure(self)


@attrs.frozen
class StdinRef:
    url: str


_SECONDS: Final = {EXPECTED: "a number of seconds or null"}


@attrs.frozen
class AssignmentIdentity:
    """Where an assignment's answer goes, read from one that may be malformed otherwise: a
    rejection needs it to address its ``finish``."""

    job_id: str
    attempt: int
    device: object = None


@attrs.frozen
class Assignment:
    """One offer of a job to one device: an entry of a poll's ``assignments``."""

    job_id: str
    attempt: int
    device: str
    command: tuple[str, ...] = attrs.field(
        converter=_args, metadata={EXPECTED: "a non-empty list of strings"}
    )
    cwd: str | None = None
    env: Mapping[str, str] = attrs.field(
        factory=dict, hash=False, metadata={EXPECTED: "an object mapping variable names to strings"}
    )
    max_runtime_s: float | None = attrs.field(default=None, metadata=_SECONDS)
    idle_timeout_s: float | None = attrs.field(default=None, metadata=_SECONDS)
    grace_s: float = attrs.field(default=10.0, metadata=_SECONDS)
    stdin: StdinRef | None = attrs.field(
        default=None, metadata={EXPECTED: 'null or {"url": "..."}'}
    )
    pty: bool = False

    @classmethod
    def offer(cls, job_id: str, attempt: int, device: str, spec: JobSpec) -> Assignment:
        """The assignment of ``spec``'s job: the controller's side of a poll."""
        url = f"/v1/jobs/{job_id}/stdin?attempt={attempt}" if spec.stdin else None
        return cls(
            job_id=job_id,
            attempt=attempt,
            device=device,
            command=spec.command,
            cwd=spec.cwd,
            env=dict(spec.env),
            max_runtime_s=spec.max_runtime_s,
            idle_timeout_s=spec.idle_timeout_s,
            grace_s=spec.grace_s,
            stdin=None if url is None else StdinRef(url),
            pty=spec.pty,
        )

    @property
    def stdin_url(self) -> str | None:
        return None if self.stdin is None else self.stdin.url

    def to_json(self) -> JsonObject:
        return unstructure(self)


@attrs.frozen
class Sweep:
    """What was left of a job once its process group was torn down (``finish``, ``recovery``).
    Carried as an object: the controller keeps and shows it as sent."""

    scanned: bool
    found: tuple[int, ...]
    remaining: tuple[int, ...]
    blind: bool
    blind_pids: tuple[int, ...] = ()
    method: str = "environ"


@attrs.frozen
class OutputReply:
    """``output``'s answer, and its ``409 gap``'s: where the controller's copy ends."""

    committed: int


@attrs.frozen
class PollReply:
    """A poll's answer. Each assignment stays raw here: the worker checks each on its own,
    so that one malformed offer is rejected without losing the others."""

    assignments: tuple[object, ...] = ()
    cancel: tuple[CancelOrder, ...] = ()


# --- read-only views (the user endpoints) ---------------------------------------------------


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


# --- small replies and envelopes ------------------------------------------------------------


@attrs.frozen
class OkReply:
    """``{"ok": true}``: deregister, start, labels, sheets."""

    ok: bool = True


@attrs.frozen
class StateReply:
    """``finish`` (the job's state) and ``fault`` (the device's) answers."""

    state: str
    ok: bool = True


@attrs.frozen
class HealthReply:
    """``GET /v1/health``."""

    protocol: int
    store: str
    ok: bool = True


@attrs.frozen
class ErrorReply:
    """Every error answer: a machine code and a sentence for people (extra fields aside)."""

    error: str = ""
    message: str = ""


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


@attrs.frozen
class ClearReply:
    cleared: tuple[str, ...]
    device: DeviceInfo


@attrs.frozen
class HostClearReply:
    host: str
    cleared: Mapping[str, tuple[str, ...]] = attrs.field(hash=False)
    devices: tuple[DeviceInfo, ...] = ()


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


# --- the converter --------------------------------------------------------------------------

converter = make_converter()
"""The one converter of the wire: worker and controller both read and write through it."""


def structure(value: object, cls: type[T]) -> T:
    """``value`` (decoded JSON) as a ``cls``; a malformed one raises :class:`ProtocolError`."""
    return converter.structure(value, cls)


def unstructure(message: object) -> JsonObject:
    """``message`` as the JSON object the wire carries."""
    out = converter.unstructure(message)
    assert isinstance(out, dict)
    return out


def to_wire(body: object) -> object:
    """``body`` as JSON-ready data: messages anywhere in it unstructured, the rest as it is."""
    return plain(converter, body)


def _structure_sheets(value: object, _: object) -> SheetsUpdate:
    # ``host`` missing keeps the host's sheet; ``host: null`` removes it.
    if not isinstance(value, dict):
        raise ProtocolError("expected a JSON object")
    try:
        host = converter.structure(value.get("host"), str | None)  # type: ignore[arg-type]
    except ProtocolError as e:
        raise e.under("host") from None
    devices = value.get("devices")
    try:
        devs = {} if devices is None else converter.structure(devices, dict[str, str | None])
    except ProtocolError as e:
        raise e.under("devices") from None
    return SheetsUpdate(host=host, host_given="host" in value, devices=devs)


def _unstructure_sheets(s: SheetsUpdate) -> JsonObject:
    out: JsonObject = {"host": s.host} if s.host_given else {}
    out["devices"] = dict(s.devices)
    return out


def _structure_sheets_request(value: object, _: object) -> SheetsRequest:
    if not isinstance(value, dict):
        raise ProtocolError("expected a JSON object")
    session = value.get("session")
    if session is None:
        raise ProtocolError("required", ("session",))
    if not isinstance(session, str):
        raise ProtocolError("expected a string", ("session",))
    return SheetsRequest(session=session, sheets=_structure_sheets(value, SheetsUpdate))


def _unstructure_sheets_request(s: SheetsRequest) -> JsonObject:
    head: JsonObject = {"session": s.session} if s.session != NO_SESSION else {}
    return {**head, **_unstructure_sheets(s.sheets)}


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

converter.register_structure_hook(SheetsUpdate, _structure_sheets)
converter.register_unstructure_hook(SheetsUpdate, _unstructure_sheets)
converter.register_structure_hook(SheetsRequest, _structure_sheets_request)
converter.register_unstructure_hook(SheetsRequest, _unstructure_sheets_request)
converter.register_structure_hook(SubmitRequest, _structure_submit)
converter.register_unstructure_hook(SubmitRequest, _unstructure_submit)
converter.register_structure_hook(Event, _structure_event)
converter.register_unstructure_hook(Event, _unstructure_event)
converter.register_unstructure_hook(DeviceInfo, _unstructure_device)


Message: TypeAlias = (
    RegisterRequest
    | HeartbeatRequest
    | PollRequest
    | DeregisterRequest
    | StartRequest
    | FinishRequest
    | FaultRequest
    | LabelsRequest
    | SheetsRequest
)
"""A request a worker sends."""
