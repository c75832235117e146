"""JSON bodies in, request messages out, through the protocol's one converter.

Shapes are the protocol's (:mod:`rc_worker.core.protocol`): unknown fields are
ignored, so a newer worker or client can add fields without breaking an older
controller, and a known field of the wrong type is a ``400 bad_request`` whose
message names the field (``recovery[0].claim``). What is left here are the
controller's own rules about values (an outcome it knows, a wait it can honour,
a command that is not empty).
"""

from __future__ import annotations

from typing import Any, TypeVar

from rc_worker.controller import validate
from rc_worker.controller.errors import BadRequest
from rc_worker.core import protocol
from rc_worker.core.protocol import (
    OUTCOMES,
    CancelRequest,
    FaultRequest,
    FinishRequest,
    HeartbeatRequest,
    IdleBehaviorRequest,
    JobSpec,
    LabelsRequest,
    PollRequest,
    ProtocolError,
    RegisterRequest,
    RetireRequest,
    SheetsRequest,
    StartRequest,
    SubmitRequest,
)

T = TypeVar("T")


def decode(body: bytes, *, empty_ok: bool = False) -> object:
    """Parse a request body as JSON (bounded; see :func:`validate.loads`)."""
    if not body.strip() and empty_ok:
        return {}
    return validate.loads(body)


def parse(body: object, cls: type[T]) -> T:
    """``body`` as a ``cls``; a malformed one is a ``400`` naming the field."""
    try:
        return protocol.structure(body, cls)
    except ProtocolError as e:
        raise BadRequest(str(e)) from None


# --- worker requests ------------------------------------------------------------------------


def register(body: object) -> RegisterRequest:
    return parse(body, RegisterRequest)


def heartbeat(body: object) -> HeartbeatRequest:
    return parse(body, HeartbeatRequest)


def poll(body: object) -> PollRequest:
    req = parse(body, PollRequest)
    if req.wait_s is not None:
        validate.finite_number(req.wait_s, "wait_s")
    return req


def start(body: object) -> StartRequest:
    return parse(body, StartRequest)


def finish(body: object) -> FinishRequest:
    req = parse(body, FinishRequest)
    if req.outcome not in OUTCOMES:
        raise BadRequest(f"outcome: {req.outcome!r} is not one of {', '.join(sorted(OUTCOMES))}")
    return req


def fault(body: object) -> FaultRequest:
    return parse(body, FaultRequest)


def labels(body: object) -> LabelsRequest:
    return parse(body, LabelsRequest)


def sheets(body: object) -> SheetsRequest:
    return parse(body, SheetsRequest)


# --- user requests --------------------------------------------------------------------------


def submit(body: object) -> SubmitRequest:
    req = parse(body, SubmitRequest)
    if not req.spec.command:
        raise BadRequest("command: must not be empty")
    return req


def submit_kwargs(spec: JobSpec) -> dict[str, Any]:
    """The keyword arguments of :meth:`Store.submit` for ``spec``."""
    return {
        "command": list(spec.command),
        "select": spec.select,
        "device": spec.device,
        "env": dict(spec.env),
        "cwd": spec.cwd,
        "max_runtime_s": spec.max_runtime_s,
        "idle_timeout_s": spec.idle_timeout_s,
        "grace_s": spec.grace_s,
        "pty": spec.pty,
        "stdin": spec.stdin,
    }


def cancel(body: object) -> CancelRequest:
    return parse(body, CancelRequest)


def idle_behavior(body: object) -> IdleBehaviorRequest:
    return parse(body, IdleBehaviorRequest)


def retire(body: object) -> RetireRequest:
    return parse(body, RetireRequest)
