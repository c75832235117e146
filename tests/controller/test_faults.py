"""Quarantine, faults, clearing and lost hosts, driven directly on the store."""

from __future__ import annotations

import pytest

from rc_worker.controller.errors import Conflict, StaleAttempt, UnknownSession
from rc_worker.controller.messages import Assignment, DeviceReport, FaultRequest, Verify
from rc_worker.controller.store import Store, StoreConfig

from .storekit import assign, event_types, finish, heartbeat, register, start


def running_job(store: Store, session: str) -> tuple[str, Assignment]:
    job = store.submit(["x"])
    a = assign(store, session)
    start(store, session, a)
    return job, a


def test_failed_verify_quarantines_with_the_fixed_reason_and_an_event() -> None:
    store = Store(instance="t")
    session = register(store)
    job = store.submit(["x"])
    a = assign(store, session)
    start(store, session, a)
    finish(store, session, a, fault_id="f-7", verify=Verify(False, "verify: 10-ecc.sh: 3 errors"))
    assert store.job(job).state == "succeeded"  # a failed verify does not change the outcome
    d = store.device("box1", "gpu0")
    assert (d.state, d.reason, d.fault_id) == ("quarantined", "fault", "f-7")
    [event] = [e for e in store.events() if e.type == "verify_failed"]
    assert event.data["reason"] == "verify: 10-ecc.sh: 3 errors"
    assert event.data["fault_id"] == "f-7"
    assert store.poll("box1", session, ["gpu0"], now=0) == []


def test_survivors_quarantine_as_dirty() -> None:
    store = Store(instance="t")
    session = register(store)
    store.submit(["x"])
    a = assign(store, session)
    start(store, session, a)
    finish(store, session, a, fault_id="f-1", remaining=[4242])
    [fault] = store.device("box1", "gpu0").faults
    assert (fault.kind, fault.reason, fault.raised_by) == ("dirty", "fault", "worker")


def test_clear_and_cleared_ids_in_heartbeats_until_the_worker_stops_reporting_them() -> None:
    store = Store(instance="t")
    session = register(store)
    for fid in ("f-1", "f-2"):
        store.raise_fault("box1", "gpu0", FaultRequest(session, fid, "hook_failed", "boom"), now=0)
    assert [f.fault_id for f in store.device("box1", "gpu0").faults] == ["f-1", "f-2"]
    assert heartbeat(store, session).cleared == {}
    assert store.clear("box1", "gpu0") == ["f-1", "f-2"]
    assert store.device("box1", "gpu0").state == "free"
    quarantined = DeviceReport("quarantined", faults=("f-1", "f-2"))
    # A stale heartbeat (built before the worker knew the faults) does not lose the clear.
    assert heartbeat(store, session, devices={"gpu0": DeviceReport("free")}).cleared == {
        "gpu0": ("f-1", "f-2")
    }
    reply = heartbeat(store, session, devices={"gpu0": quarantined})
    assert reply.cleared == {"gpu0": ("f-1", "f-2")}
    free = {"gpu0": DeviceReport("free")}
    assert heartbeat(store, session, devices=free).cleared == {"gpu0": ("f-1", "f-2")}
    assert heartbeat(store, session).cleared == {"gpu0": ("f-1", "f-2")}  # not mentioned
    assert heartbeat(store, session, devices=free).cleared == {"gpu0": ("f-1", "f-2")}
    assert heartbeat(store, session, devices=free).cleared == {}
    assert store.clear("box1", "gpu0") == []
    assert event_types(store).count("device_cleared") == 1


def test_a_retried_report_cannot_raise_a_cleared_fault_again() -> None:
    store = Store(instance="t")
    session = register(store)
    req = FaultRequest(session, "f-1", "dirty", "pid 7 survived", "j-1")
    store.raise_fault("box1", "gpu0", req, now=0)
    store.clear("box1", "gpu0")
    store.raise_fault("box1", "gpu0", req, now=0)
    assert store.device("box1", "gpu0").state == "free"
    assert event_types(store).count("device_quarantined") == 1


def test_fault_endpoint_with_verify_kind_emits_verify_failed() -> None:
    store = Store(instance="t")
    session = register(store)
    req = FaultRequest(session, "f-3", "verify_failed", "verify: probe hung", None)
    assert store.raise_fault("box1", "gpu0", req, now=0).state == "quarantined"
    assert "verify_failed" in event_types(store)


def test_a_stale_finish_still_records_its_fault() -> None:
    store = Store(instance="t")
    session = register(store)
    job = store.submit(["x"])
    a1 = assign(store, session)
    assign(store, session)  # offered again: attempt 1 is stale
    with pytest.raises(StaleAttempt):
        finish(store, session, a1, "refused", fault_id="f-9")
    assert store.device("box1", "gpu0").fault_id == "f-9"
    assert store.job(job).attempt == 2


def test_later_finishes_change_nothing_but_a_new_fault_is_kept() -> None:
    store = Store(instance="t")
    session = register(store)
    job, a = running_job(store, session)
    finish(store, session, a, "failed", exit_code=3)
    finish(store, session, a, "succeeded")
    info = store.job(job)
    assert (info.state, info.exit_code) == ("failed", 3)
    finish(store, session, a, "succeeded", fault_id="f-5")
    assert store.job(job).state == "failed"
    assert store.device("box1", "gpu0").fault_id == "f-5"


def test_host_lost_after_three_missed_heartbeats() -> None:
    store = Store(StoreConfig(heartbeat_interval_s=10), instance="t")
    session = register(store, devices=("gpu0", "gpu1", "gpu2"), now=0)
    store.set_idle_behavior("box1", "gpu2", "hold")
    job, _a = running_job(store, session)
    queued = store.submit(["q"])
    offered = assign(store, session, ready=["gpu1"])
    assert offered.job_id == queued
    heartbeat(store, session, now=25)
    store.tick(54.9)
    assert store.device("box1", "gpu0").host_state == "up"
    assert store.next_deadline() == 55
    store.tick(55)
    assert store.job(job).state == "lost"
    assert store.job(queued).state == "queued"  # never started: offered again elsewhere
    for name in ("gpu0", "gpu1", "gpu2"):
        d = store.device("box1", name)
        assert (d.state, d.reason, d.host_state) == ("quarantined", "interrupted", "lost")
    assert store.device("box1", "gpu0").faults[0].job_id == job
    [lost] = [e for e in store.events() if e.type == "host_lost"]
    assert lost.data == {"host": "box1", "jobs": [job], "requeued": [queued]}
    with pytest.raises(UnknownSession):
        heartbeat(store, session, now=56)
    with pytest.raises(UnknownSession):
        store.poll("box1", session, ["gpu0"], now=56)


def test_unknown_session_for_another_host() -> None:
    store = Store(instance="t")
    session = register(store, "box1")
    register(store, "box2")
    with pytest.raises(UnknownSession):
        heartbeat(store, session, host="box2")


def test_a_job_lost_while_its_worker_was_cut_off_runs_on_unless_cancelled() -> None:
    store = Store(StoreConfig(heartbeat_interval_s=10), instance="t")
    session = register(store, now=0, pid=9)
    job, a = running_job(store, session)
    store.tick(30)
    assert store.job(job).state == "lost"
    # The worker was only cut off; it comes back, still running the job, and says so.
    session = register(store, now=31, pid=9)
    running = {"gpu0": DeviceReport("running", job, 1)}
    assert heartbeat(store, session, now=31, devices=running).cancel == ()
    store.append_output(job, 1, 0, b"still going")  # its output is still taken
    store.cancel(job, "stop it")  # ...but a user's cancel still reaches it
    reply = heartbeat(store, session, now=32, devices=running)
    assert [(c.job_id, c.reason) for c in reply.cancel] == [(job, "stop it")]
    finish(store, session, a, "killed")
    assert store.job(job).state == "lost"
    assert store.output(job) == b"still going"


def test_register_supersedes_the_old_session() -> None:
    store = Store(instance="t")
    old = register(store)
    new = register(store)
    assert old != new
    with pytest.raises(Conflict) as e:
        heartbeat(store, old)
    assert e.value.code == "unknown_session"
    heartbeat(store, new)


def test_devices_missing_from_a_registration_are_absent() -> None:
    store = Store(instance="t")
    register(store, devices=("gpu0", "gpu1"))
    store.submit(["x"], device="box1/gpu1")
    session = register(store, devices=("gpu0",))
    assert store.device("box1", "gpu1").state == "absent"
    assert store.poll("box1", session, ["gpu1"], now=0) == []
    assert [d.name for d in store.devices()] == ["gpu0", "gpu1"]
