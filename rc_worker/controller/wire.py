"""JSON bodies in, request messages out: every type check, each error naming its field.

Unknown fields are ignored, so a newer worker or client can add fields
without breaking an older controller; a known field of the wrong type is a
``400 bad_request`` whose message names the field (``recovery[0].claim``).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from rc_worker.controller import validate
from rc_worker.controller.errors import BadRequest
from rc_worker.controller.messages import (
    OUTCOMES,
    RECOVERY_CLAIMS,
    DeviceDecl,
    DeviceReport,
    FaultRequest,
    FinishRequest,
    HeartbeatRequest,
    HeldFault,
    LabelsUpdate,
    Recovery,
    RegisterRequest,
    RunningClaim,
    SheetsUpdate,
    StartRequest,
    Verify,
)

_MISSING: Any = object()


def decode(body: bytes, *, empty_ok: bool = False) -> Fields:
    """Parse a request body as a JSON object."""
    if not body.strip() and empty_ok:
        return Fields({}, "body")
    return Fields(validate.loads(body), "body")


class Fields:
    """Typed access to one JSON object; every error names the field's path."""

    def __init__(self, value: object, where: str) -> None:
        if not isinstance(value, dict):
            raise BadRequest(f"{where}: expected a JSON object")
        self._d: dict[str, object] = value
        self._where = where

    def _path(self, key: str) -> str:
        return key if self._where == "body" else f"{self._where}.{key}"

    def _get(self, key: str, required: bool) -> object:
        value = self._d.get(key, _MISSING)
        if value is _MISSING or value is None:
            if required:
                raise BadRequest(f"{self._path(key)}: required")
            return None
        return value

    def required(self, key: str) -> object:
        return self._get(key, True)

    def _bad(self, key: str, expected: str) -> BadRequest:
        return BadRequest(f"{self._path(key)}: expected {expected}")

    def has(self, key: str) -> bool:
        return key in self._d

    def req_str(self, key: str) -> str:
        value = self._get(key, True)
        if not isinstance(value, str):
            raise self._bad(key, "a string")
        return value

    def opt_str(self, key: str) -> str | None:
        value = self._get(key, False)
        if value is not None and not isinstance(value, str):
            raise self._bad(key, "a string or null")
        return value

    def req_int(self, key: str) -> int:
        value = self.opt_int(key)
        if value is None:
            raise BadRequest(f"{self._path(key)}: required")
        return value

    def opt_int(self, key: str) -> int | None:
        value = self._get(key, False)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
            raise self._bad(key, "an integer or null")
        return value

    def opt_num(self, key: str) -> float | None:
        value = self._get(key, False)
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise self._bad(key, "a number or null")
        try:
            number = float(value)
        except OverflowError:
            number = math.inf
        if not math.isfinite(number):
            raise BadRequest(f"{self._path(key)}: must be a finite number")
        return number

    def flag(self, key: str, default: bool = False) -> bool:
        value = self._get(key, False)
        if value is None:
            return default
        if not isinstance(value, bool):
            raise self._bad(key, "true or false")
        return value

    def str_list(self, key: str) -> list[str]:
        value = self._get(key, False)
        if value is None:
            return []
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise self._bad(key, "a list of strings")
        return list(value)

    def str_map(self, key: str) -> dict[str, str] | None:
        value = self._get(key, False)
        if value is None:
            return None
        return _str_map(value, self._path(key))

    def obj(self, key: str) -> Fields | None:
        value = self._get(key, False)
        return None if value is None else Fields(value, self._path(key))

    def objs(self, key: str) -> list[Fields]:
        value = self._get(key, False)
        if value is None:
            return []
        if not isinstance(value, list):
            raise self._bad(key, "a list of objects")
        return [Fields(v, f"{self._path(key)}[{i}]") for i, v in enumerate(value)]

    def items(self, key: str) -> list[tuple[str, object, str]]:
        """The entries of a nested object, each with its own path, for per-key parsing."""
        value = self._get(key, False)
        if value is None:
            return []
        if not isinstance(value, dict):
            raise self._bad(key, "a JSON object")
        return [(k, v, f"{self._path(key)}.{k}") for k, v in value.items()]

    def raw_obj(self, key: str) -> Mapping[str, object] | None:
        value = self._get(key, False)
        if value is not None and not isinstance(value, dict):
            raise self._bad(key, "a JSON object or null")
        return value


def _str_map(value: object, where: str) -> dict[str, str]:
    if not isinstance(value, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in value.items()
    ):
        raise BadRequest(f"{where}: expected an object of string values")
    return dict(value)


# --- worker requests ------------------------------------------------------------------------


def labels_update(f: Fields) -> LabelsUpdate:
    devices = {name: _str_map(v, path) for name, v, path in f.items("devices")}
    return LabelsUpdate(host=f.str_map("host"), devices=devices)


def sheets_update(f: Fields) -> SheetsUpdate:
    devices: dict[str, str | None] = {}
    for name, v, path in f.items("devices"):
        if v is not None and not isinstance(v, str):
            raise BadRequest(f"{path}: expected a string or null")
        devices[name] = v
    return SheetsUpdate(host=f.opt_str("host"), host_given=f.has("host"), devices=devices)


def register(f: Fields) -> RegisterRequest:
    devices = []
    for d in f.objs("devices"):
        faults = None
        if d.has("faults"):
            faults = tuple(
                HeldFault(
                    x.req_str("fault_id"), x.opt_str("kind") or "fault", x.opt_str("reason") or ""
                )
                for x in d.objs("faults")
            )
        r = d.obj("running")
        running = None
        if r is not None:
            running = RunningClaim(
                r.req_str("job_id"),
                r.req_int("attempt"),
                r.opt_int("output_bytes"),
                r.opt_num("started_at"),
            )
        devices.append(
            DeviceDecl(d.req_str("name"), d.str_map("declared_labels") or {}, faults, running)
        )
    recovery = []
    for r in f.objs("recovery"):
        claim = r.opt_str("claim") or "unknown"
        recovery.append(
            Recovery(
                device=r.req_str("device"),
                job_id=r.req_str("job_id"),
                attempt=r.opt_int("attempt"),
                boot_id=r.opt_str("boot_id"),
                # A claim this controller does not know proves nothing: read it as unknown.
                claim=claim if claim in RECOVERY_CLAIMS else "unknown",
                sweep=r.raw_obj("sweep"),
            )
        )
    labels = f.obj("labels")
    sheets = f.obj("sheets")
    return RegisterRequest(
        boot_id=f.req_str("boot_id"),
        devices=tuple(devices),
        worker_version=f.opt_str("worker_version") or "",
        pid=f.opt_int("pid"),
        instance_id=f.opt_str("instance_id"),
        labels=LabelsUpdate() if labels is None else labels_update(labels),
        sheets=SheetsUpdate() if sheets is None else sheets_update(sheets),
        recovery=tuple(recovery),
        require_manual_clear=f.flag("require_manual_clear"),
        protocol=f.opt_int("protocol") or 1,
    )


def heartbeat(f: Fields) -> HeartbeatRequest:
    devices = {}
    for name, value, path in f.items("devices"):
        d = Fields(value, path)
        devices[name] = DeviceReport(
            state=d.req_str("state"),
            job_id=d.opt_str("job_id"),
            attempt=d.opt_int("attempt"),
            faults=tuple(d.str_list("faults")),
            held_for_health=d.opt_str("held_for_health"),
        )
    return HeartbeatRequest(session=f.req_str("session"), devices=devices)


def poll(f: Fields) -> tuple[str, list[str], float | None, list[str]]:
    """``(session, ready, wait_s, withdrawn)`` of a long poll."""
    wait_s = f.opt_num("wait_s")
    if wait_s is not None:
        validate.finite_number(wait_s, "wait_s")
    return f.req_str("session"), f.str_list("ready"), wait_s, f.str_list("withdrawn")


def known_cancels(f: Fields) -> set[tuple[str, int]]:
    """A poll's ``known_cancels``: the cancels the worker already has (an addition)."""
    return {(c.req_str("job_id"), c.req_int("attempt")) for c in f.objs("known_cancels")}


def start(f: Fields) -> StartRequest:
    return StartRequest(
        session=f.req_str("session"),
        attempt=f.req_int("attempt"),
        device=f.req_str("device"),
        boot_id=f.opt_str("boot_id"),
    )


def finish(f: Fields) -> FinishRequest:
    outcome = f.req_str("outcome")
    if outcome not in OUTCOMES:
        raise BadRequest(f"outcome: {outcome!r} is not one of {', '.join(sorted(OUTCOMES))}")
    v = f.obj("verify")
    verify = None if v is None else Verify(ok=v.flag("ok", True), reason=v.opt_str("reason") or "")
    return FinishRequest(
        session=f.req_str("session"),
        attempt=f.req_int("attempt"),
        device=f.req_str("device"),
        outcome=outcome,
        exit_code=f.opt_int("exit_code"),
        killed=f.flag("killed"),
        reason=f.opt_str("reason") or "",
        error=f.opt_str("error"),
        output_bytes=f.opt_int("output_bytes"),
        sweep=f.raw_obj("sweep"),
        verify=verify,
        fault_id=f.opt_str("fault_id"),
        stale_offer=f.flag("stale_offer"),
    )


def fault(f: Fields) -> FaultRequest:
    # Any kind is kept: refusing an unfamiliar one would lose a quarantine.
    return FaultRequest(
        session=f.req_str("session"),
        fault_id=f.req_str("fault_id"),
        kind=f.opt_str("kind") or "fault",
        reason=f.opt_str("reason") or "",
        job_id=f.opt_str("job_id"),
        severity=f.opt_str("severity"),
        action=f.opt_str("action"),
        scope=f.opt_str("scope"),
        parent_fault=f.opt_str("parent_fault"),
    )


# --- user requests --------------------------------------------------------------------------


def submit(f: Fields) -> dict[str, Any]:
    """The keyword arguments of :meth:`Store.submit`."""
    command = f.required("command")
    if not isinstance(command, list) or not all(isinstance(a, str) for a in command):
        raise BadRequest("command: expected a non-empty list of strings")
    if not command:
        raise BadRequest("command: must not be empty")
    grace = f.opt_num("grace_s")
    return {
        "command": command,
        "select": f.opt_str("select") or "",
        "device": f.opt_str("device"),
        "env": f.str_map("env") or {},
        "cwd": f.opt_str("cwd"),
        "max_runtime_s": f.opt_num("max_runtime_s"),
        "idle_timeout_s": f.opt_num("idle_timeout_s"),
        "grace_s": 10.0 if grace is None else grace,
        "pty": f.flag("pty"),
        "stdin": f.flag("stdin"),
    }
