"""The controller's messages: parsed requests, replies, and read-only views.

They are the protocol's own types (:mod:`rc_worker.core.protocol`), named here
for the controller's modules: requests are what :mod:`rc_worker.controller.wire`
structures from a body and what the store consumes; replies and views are what
the store returns and what the protocol's converter turns back into the wire
form of docs/protocol.md. All are frozen: the store never hands out its live
records.
"""

from __future__ import annotations

from rc_worker.core.protocol import (
    IDLE_BEHAVIORS,
    JOB_STATES,
    OUTCOMES,
    RECOVERY_CLAIMS,
    TERMINAL_STATES,
    Assignment,
    AttemptInfo,
    CancelOrder,
    DeviceDecl,
    DeviceInfo,
    DeviceReport,
    DeviceStatus,
    Event,
    FaultInfo,
    FaultRequest,
    FinishRequest,
    HeartbeatReply,
    HeartbeatRequest,
    HeldFault,
    JobInfo,
    JobSpec,
    JsonObject,
    LabelsUpdate,
    PollReply,
    Recovery,
    RegisterReply,
    RegisterRequest,
    RunningClaim,
    SheetInfo,
    SheetsUpdate,
    StartRequest,
    Verify,
)

__all__ = [
    "IDLE_BEHAVIORS",
    "JOB_STATES",
    "OUTCOMES",
    "RECOVERY_CLAIMS",
    "TERMINAL_STATES",
    "Assignment",
    "AttemptInfo",
    "CancelOrder",
    "DeviceDecl",
    "DeviceInfo",
    "DeviceReport",
    "DeviceStatus",
    "Event",
    "FaultInfo",
    "FaultRequest",
    "FinishRequest",
    "HeartbeatReply",
    "HeartbeatRequest",
    "HeldFault",
    "JobInfo",
    "JobSpec",
    "JsonObject",
    "LabelsUpdate",
    "PollReply",
    "Recovery",
    "RegisterReply",
    "RegisterRequest",
    "RunningClaim",
    "SheetInfo",
    "SheetsUpdate",
    "StartRequest",
    "Verify",
]
