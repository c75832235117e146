"""The typed protocol (rc_worker/core/protocol.py): every message round-trips through JSON,
unknown keys are ignored, and a malformed field is one error that names it."""

from __future__ import annotations

import json
import typing
from collections.abc import Mapping
from typing import Any

import attrs
import pytest
from hypothesis import given
from hypothesis import strategies as st

from rc_worker.core import protocol
from rc_worker.core.jsonconv import JsonObject, wire_fields
from rc_worker.core.protocol import ProtocolError, structure, unstructure

MESSAGES: list[type] = sorted(
    (
        obj
        for name in protocol.__all__
        if attrs.has(obj := getattr(protocol, name)) and isinstance(obj, type)
    ),
    key=lambda cls: cls.__name__,
)

JSON_SCALARS = st.none() | st.booleans() | st.integers(-(2**53), 2**53) | st.text(max_size=8)
JSON = st.recursive(
    JSON_SCALARS,
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3)
    ),
    max_leaves=6,
)
FINITE = st.floats(allow_nan=False, allow_infinity=False)


def _for_type(t: Any) -> st.SearchStrategy[Any]:
    """Values of a message field's type, any a peer could send."""
    args = typing.get_args(t)
    origin = typing.get_origin(t)
    if t is str:
        return st.text(max_size=10)
    if t is bool:
        return st.booleans()
    if t is int:
        return st.integers(-(2**63), 2**63 - 1)
    if t is float:
        return FINITE
    if t is object:
        return JSON
    if t == JsonObject or (origin in (dict, Mapping) and args[1] is object):
        return st.dictionaries(st.text(max_size=5), JSON, max_size=3)
    if type(None) in args:
        (inner,) = (a for a in args if a is not type(None))
        return st.none() | _for_type(inner)
    if origin is tuple:
        return st.lists(_for_type(args[0]), max_size=3).map(tuple)
    if origin in (dict, Mapping):
        return st.dictionaries(st.text(max_size=6), _for_type(args[1]), max_size=3)
    if attrs.has(t):
        return messages(t)
    raise AssertionError(f"no strategy for {t!r}")


@st.composite
def messages(draw: st.DrawFn, cls: type) -> Any:
    kwargs: dict[str, Any] = {}
    for f in wire_fields(cls):
        if f.local:
            continue
        if f.name == "session":
            # An empty session is the client's to fill in: it is not sent.
            kwargs[f.name] = draw(st.text(min_size=1, max_size=10))
        elif cls is protocol.Event and f.name == "data":
            kwargs[f.name] = draw(
                st.dictionaries(
                    st.text(max_size=5).filter(lambda k: k not in {"seq", "type", "time"}),
                    JSON,
                    max_size=3,
                )
            )
        else:
            kwargs[f.name] = draw(_for_type(f.type))
    if cls is protocol.SheetsUpdate and not kwargs["host_given"]:
        # A sheet the request did not mention is not there to carry.
        kwargs["host"] = None
    return cls(**kwargs)


def _through_json(value: object) -> object:
    return json.loads(json.dumps(value, allow_nan=False))


IRREGULAR = (protocol.SubmitRequest, protocol.SheetsRequest, protocol.SheetsUpdate, protocol.Event)
"""Messages whose JSON is not one key per field (their own hooks in the protocol module)."""

ANY_MESSAGE = st.sampled_from(MESSAGES).flatmap(lambda cls: messages(cls).map(lambda m: (cls, m)))


def test_every_request_and_reply_is_covered() -> None:
    names = {cls.__name__ for cls in MESSAGES}
    for name in (
        "RegisterRequest",
        "RegisterReply",
        "HeartbeatRequest",
        "HeartbeatReply",
        "PollRequest",
        "PollReply",
        "Assignment",
        "DeregisterRequest",
        "StartRequest",
        "FinishRequest",
        "FaultRequest",
        "LabelsRequest",
        "SheetsRequest",
        "SubmitRequest",
        "CancelRequest",
        "IdleBehaviorRequest",
        "RetireRequest",
        "JobInfo",
        "DeviceInfo",
        "SheetInfo",
        "Event",
        "EventsPage",
        "JobsPage",
        "ErrorReply",
        "OutputReply",
        "StateReply",
    ):
        assert name in names


@given(ANY_MESSAGE)
def test_every_message_round_trips_through_json(case: tuple[type, Any]) -> None:
    cls, message = case
    wire = _through_json(unstructure(message))
    assert structure(wire, cls) == message


@given(ANY_MESSAGE, st.dictionaries(st.text(min_size=1, max_size=8), JSON, max_size=3))
def test_unknown_keys_are_ignored(case: tuple[type, Any], extra: dict[str, Any]) -> None:
    cls, message = case
    if cls is protocol.Event:
        return  # an event's own fields are open-ended: every key is its data
    wire = unstructure(message)
    known = {f.key for f in wire_fields(cls)} | {"address", "strict", "host", "devices"}
    wire.update({k: v for k, v in extra.items() if k not in known and k not in wire})
    assert structure(_through_json(wire), cls) == message


def _wrong_for(t: Any) -> object:
    """A JSON value that is not of type ``t``."""
    inner = [a for a in typing.get_args(t) if a is not type(None)]
    base = inner[0] if type(None) in typing.get_args(t) else t
    return 3 if base is str else "three"


@given(ANY_MESSAGE, st.data())
def test_a_malformed_field_is_one_error_naming_it(
    case: tuple[type, Any], data: st.DataObject
) -> None:
    cls, message = case
    checked = [
        f
        for f in wire_fields(cls)
        if not f.local and f.type is not object and f.omit is not False and f.key != "data"
    ]
    if not checked or cls in IRREGULAR:
        return  # their own hooks, tested by name below
    field = data.draw(st.sampled_from(checked))
    wire = unstructure(message)
    wire[field.key] = _wrong_for(field.type)
    with pytest.raises(ProtocolError) as caught:
        structure(_through_json(wire), cls)
    assert caught.value.path == (field.key,)
    assert str(caught.value).startswith(f"{field.key}: ")


def test_a_missing_required_field_is_named() -> None:
    with pytest.raises(ProtocolError, match=r"^session: required$"):
        structure({"attempt": 1, "device": "gpu0", "outcome": "lost"}, protocol.FinishRequest)


@pytest.mark.parametrize(
    ("cls", "body", "message"),
    [
        (protocol.RegisterRequest, [], "body: expected a JSON object"),
        (
            protocol.RegisterRequest,
            {"boot_id": "b", "recovery": [{"device": "g", "job_id": "j"}, {"device": 3}]},
            "recovery[1].device: expected a string",
        ),
        (
            protocol.RegisterRequest,
            {"boot_id": "b", "recovery": [{"device": "g", "job_id": "j", "claim": 5}]},
            "recovery[0].claim: expected a string or null",
        ),
        (
            protocol.RegisterRequest,
            {"boot_id": "b", "devices": [{"name": "g", "running": {"job_id": "j"}}]},
            "devices[0].running.attempt: required",
        ),
        (
            protocol.HeartbeatRequest,
            {"session": "s", "devices": {"gpu0": {"state": 1}}},
            "devices.gpu0.state: expected a string",
        ),
        (
            protocol.PollRequest,
            {"session": "s", "ready": ["gpu0", 1]},
            "ready: expected a list of strings",
        ),
        (
            protocol.PollRequest,
            {"session": "s", "known_cancels": [{"job_id": "j", "attempt": True}]},
            "known_cancels[0].attempt: expected an integer or null",
        ),
        (
            protocol.LabelsRequest,
            {"session": "s", "devices": {"gpu0": {"a": 1}}},
            "devices.gpu0: expected an object of string values",
        ),
        (
            protocol.FinishRequest,
            {"session": "s", "attempt": 1, "device": "g", "outcome": "lost", "sweep": []},
            "sweep: expected a JSON object or null",
        ),
        (
            protocol.SubmitRequest,
            {"command": "ls"},
            "command: expected a non-empty list of strings",
        ),
        (
            protocol.SubmitRequest,
            {"command": ["ls"], "strict": 1},
            "strict: expected true or false",
        ),
        (protocol.SheetsRequest, {"host": "# h"}, "session: required"),
        (protocol.SheetsRequest, {"session": "s", "host": 5}, "host: expected a string or null"),
        (
            protocol.SheetsRequest,
            {"session": "s", "devices": {"gpu0": 5}},
            "devices.gpu0: expected a string or null",
        ),
        (protocol.Event, {"seq": "1", "type": "t", "time": 0}, "seq: expected an integer or null"),
        (
            protocol.SubmitRequest,
            {"command": ["x"], "grace_s": 1e400},
            "grace_s: must be a finite number",
        ),
    ],
)
def test_errors_name_the_path(cls: type, body: object, message: str) -> None:
    with pytest.raises(ProtocolError) as caught:
        structure(body, cls)
    assert str(caught.value) == message


def test_null_means_absent() -> None:
    req = structure(
        {
            "session": "s",
            "attempt": 1,
            "device": "g",
            "outcome": "lost",
            "reason": None,
            "killed": None,
        },
        protocol.FinishRequest,
    )
    assert (req.reason, req.killed, req.verify) == ("", False, None)


def test_the_normalisations_of_the_decoder_are_kept() -> None:
    reg = structure(
        {
            "boot_id": "b",
            "protocol": 0,
            "devices": [
                {"name": "g", "faults": [{"fault_id": "f", "kind": ""}]},
                {"name": "h", "faults": None},
            ],
            "recovery": [{"device": "g", "job_id": "j", "claim": "maybe"}],
            "sheets": {"host": None},
        },
        protocol.RegisterRequest,
    )
    assert reg.protocol == 1
    assert reg.devices[0].faults == (protocol.HeldFault("f", "fault", ""),)
    # "faults": null still says something (none held); a device that leaves it out says nothing.
    assert reg.devices[1].faults == ()
    assert structure({"name": "x"}, protocol.DeviceDecl).faults is None
    assert reg.recovery[0].claim == "unknown"
    assert reg.sheets.host_given
    assert reg.sheets.host is None


def test_wire_keys_are_as_documented() -> None:
    spec = protocol.JobSpec(("python", "train.py"), env={"SEED": "1"}, stdin=True)
    assert unstructure(protocol.Assignment.offer("j-18", 1, "gpu0", spec)) == {
        "job_id": "j-18",
        "attempt": 1,
        "device": "gpu0",
        "command": ["python", "train.py"],
        "cwd": None,
        "env": {"SEED": "1"},
        "max_runtime_s": None,
        "idle_timeout_s": None,
        "grace_s": 10.0,
        "stdin": {"url": "/v1/jobs/j-18/stdin?attempt=1"},
        "pty": False,
    }
    finish = protocol.FinishRequest(protocol.NO_SESSION, 1, "gpu0", "succeeded")
    # The session is the client's to fill in; ``stale_offer`` and ``usage`` only when set.
    assert set(unstructure(finish)) == {
        "attempt",
        "device",
        "outcome",
        "exit_code",
        "killed",
        "reason",
        "error",
        "output_bytes",
        "sweep",
        "verify",
        "fault_id",
    }
    device = protocol.DeviceInfo("box1", "gpu0", "free", None, None, (), {}, {}, {})
    wire = unstructure(device)
    assert (wire["device"], wire["address"]) == ("gpu0", "box1/gpu0")
    assert "cleared_pending" not in wire
    assert "name" not in wire


def test_the_worker_wording_of_an_error() -> None:
    with pytest.raises(ProtocolError) as caught:
        structure(
            {"job_id": "j", "attempt": 1, "device": "g", "command": ["x"], "pty": "no"},
            protocol.Assignment,
        )
    assert caught.value.sentence == "pty must be true or false"
    with pytest.raises(ProtocolError) as caught:
        structure(
            {"job_id": "j", "attempt": 1, "device": "g", "command": ["x"], "stdin": "yes"},
            protocol.Assignment,
        )
    assert caught.value.sentence == 'stdin must be null or {"url": "..."}'


def test_the_protocol_is_importable_by_its_first_name_too() -> None:
    """Issue 9 names ``rc_worker/protocol.py``; the protocol lives in the pure core. Both
    imports give the same classes and the same converter."""
    import rc_worker.core.protocol as core_protocol
    import rc_worker.protocol as protocol

    assert sorted(protocol.__all__) == sorted(core_protocol.__all__)
    for name in core_protocol.__all__:
        assert getattr(protocol, name) is getattr(core_protocol, name), name
