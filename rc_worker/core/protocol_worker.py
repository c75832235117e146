"""The messages between a worker and a controller (sans-IO).

Part of :mod:`rc_worker.core.protocol`, which names every message; read and write them
through its converter.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Final, TypeAlias

import attrs

from rc_worker.core.jsonconv import (
    EXPECTED,
    IF_NULL,
    OMIT,
    JsonObject,
    ProtocolError,
    converter,
    unstructure,
)
from rc_worker.core.protocol_user import RECOVERY_CLAIMS, JobSpec, Verify, as_args

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


# --- worker requests ------------------------------------------------------------------------


@attrs.frozen
class HeldFault:
    """A fault a worker says it holds on a device (``register``, protocol 2)."""

    fault_id: str
    kind: str = attrs.field(default="fault", converter=_kind_or_fault)
    reason: str = ""
    parent_fault: str | None = attrs.field(default=None, metadata={OMIT: None})
    """For a MIG slice's copy of its physical GPU's fault: that fault's id, as the
    ``fault`` report says (so a controller that adopts it links it the same way)."""


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
    known_control: str | None = attrs.field(default=None, metadata={OMIT: None})
    """With ``watch_cancels``: the ``control`` of the last watch answer (``""`` when there
    was none); a controller whose host control differs answers at once."""


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
        converter=as_args, metadata={EXPECTED: "a non-empty list of strings"}
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
    # With ``watch_cancels`` only (the host watch): the heartbeat's idle behaviour and
    # clears, and the token that names this state of them.
    control: str | None = attrs.field(default=None, metadata={OMIT: None})
    idle_behavior: Mapping[str, str] = attrs.field(factory=dict, hash=False, metadata={OMIT: {}})
    cleared: Mapping[str, tuple[str, ...]] = attrs.field(
        factory=dict, hash=False, metadata={OMIT: {}}
    )


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
    """False while writes to the controller's store fail."""
    store_backend: str | None = attrs.field(default=None, metadata={OMIT: None})
    """Where the state is kept (a persisted store only)."""
    store_error: str | None = attrs.field(default=None, metadata={OMIT: None})
    """Why the last write failed; absent while writes work."""
    store_pending: bool | None = attrs.field(default=None, metadata={OMIT: None})
    last_commit_s: float | None = attrs.field(default=None, metadata={OMIT: None})
    role: str | None = attrs.field(default=None, metadata={OMIT: None})
    """``standby`` from a standby controller (with a 503); absent from the active one."""


@attrs.frozen
class ErrorReply:
    """Every error answer: a machine code and a sentence for people (extra fields aside)."""

    error: str = ""
    message: str = ""


# --- the hooks of the messages whose JSON is not one key per field ----------------------------


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


converter.register_structure_hook(SheetsUpdate, _structure_sheets)
converter.register_unstructure_hook(SheetsUpdate, _unstructure_sheets)
converter.register_structure_hook(SheetsRequest, _structure_sheets_request)
converter.register_unstructure_hook(SheetsRequest, _unstructure_sheets_request)


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
