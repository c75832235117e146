"""Direct (sans-IO) drivers for the store, shared by the store tests."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from rc_worker.controller.messages import (
    Assignment,
    DeviceDecl,
    DeviceReport,
    FinishRequest,
    HeartbeatReply,
    HeartbeatRequest,
    LabelsUpdate,
    Recovery,
    RegisterRequest,
    StartRequest,
    Verify,
)
from rc_worker.controller.store import Store


def register(
    store: Store,
    host: str = "box1",
    devices: Sequence[str] = ("gpu0",),
    *,
    boot: str = "boot-1",
    now: float = 0.0,
    recovery: Sequence[Recovery] = (),
    manual: bool = False,
    labels: LabelsUpdate | None = None,
    pid: int | None = None,
    instance: str | None = None,
) -> str:
    reply = store.register(
        host,
        RegisterRequest(
            boot_id=boot,
            devices=tuple(DeviceDecl(d) for d in devices),
            labels=labels or LabelsUpdate(),
            recovery=tuple(recovery),
            require_manual_clear=manual,
            pid=pid,
            instance_id=instance,
        ),
        now=now,
    )
    return reply.session


def assign(
    store: Store, session: str, host: str = "box1", ready: Sequence[str] = ("gpu0",), now: float = 0
) -> Assignment:
    [a] = store.poll(host, session, list(ready), now=now)
    return a


def start(store: Store, session: str, a: Assignment, boot: str = "boot-1", now: float = 0) -> None:
    store.start(a.job_id, StartRequest(session, a.attempt, a.device, boot), now=now)


def finish(
    store: Store,
    session: str,
    a: Assignment,
    outcome: str = "succeeded",
    *,
    now: float = 0,
    fault_id: str | None = None,
    verify: Verify | None = None,
    exit_code: int | None = None,
    remaining: Sequence[int] = (),
) -> None:
    store.finish(
        a.job_id,
        FinishRequest(
            session=session,
            attempt=a.attempt,
            device=a.device,
            outcome=outcome,
            exit_code=exit_code
            if exit_code is not None
            else (0 if outcome == "succeeded" else None),
            killed=outcome == "killed",
            fault_id=fault_id,
            verify=verify,
            sweep={"scanned": True, "found": [], "remaining": list(remaining), "blind": False},
        ),
        now=now,
    )


def heartbeat(
    store: Store,
    session: str,
    host: str = "box1",
    now: float = 0,
    devices: Mapping[str, DeviceReport] | None = None,
) -> HeartbeatReply:
    return store.heartbeat(host, HeartbeatRequest(session, dict(devices or {})), now=now)


def event_types(store: Store) -> list[str]:
    return [e.type for e in store.events()]
