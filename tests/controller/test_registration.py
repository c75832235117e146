"""The register rules for interrupted jobs and the devices they ran on."""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from rc_worker.controller.errors import BadRequest, StaleAttempt
from rc_worker.controller.messages import (
    DeviceDecl,
    DeviceReport,
    FinishRequest,
    Recovery,
    RegisterReply,
    RegisterRequest,
)
from rc_worker.controller.store import Store, StoreConfig

from .storekit import assign, finish, heartbeat, register, start


def interrupted(
    claim: str | None = None, *, manual: bool = False, boot: str = "boot-1"
) -> tuple[Store, str, RegisterReply]:
    """A host with a running job whose worker restarts: (store, job id, register reply)."""
    store = Store(instance="t")
    session = register(store, boot="boot-1")
    job = store.submit(["x"])
    a = assign(store, session)
    start(store, session, a, boot="boot-1")
    recovery = [] if claim is None else [Recovery("gpu0", job, 1, "boot-1", claim)]
    reply = store.register(
        "box1",
        _request(recovery, boot=boot, manual=manual),
        now=1,
    )
    return store, job, reply


def _request(
    recovery: Sequence[Recovery],
    *,
    boot: str,
    manual: bool = False,
    devices: Sequence[str] = ("gpu0",),
) -> RegisterRequest:
    return RegisterRequest(
        boot_id=boot,
        devices=tuple(DeviceDecl(d) for d in devices),
        recovery=tuple(recovery),
        require_manual_clear=manual,
    )


def test_proven_reboot_frees_the_device() -> None:
    store, job, reply = interrupted(None, boot="boot-2")
    assert reply.devices["gpu0"].state == "free"
    assert store.job(job).state == "lost"  # not reported: finished lost
    assert store.device("box1", "gpu0").state == "free"


def test_gone_claim_frees_the_device_and_the_worker_owes_the_finish() -> None:
    store, job, reply = interrupted("gone")
    assert reply.devices["gpu0"].state == "free"
    assert store.job(job).state == "running"  # reported: the worker sends its lost
    session = reply.session
    store.finish(job, FinishRequest(session, 1, "gpu0", "lost", reason="worker restarted"), now=2)
    assert store.job(job).state == "lost"
    assert store.device("box1", "gpu0").state == "free"


@pytest.mark.parametrize("claim", ["unknown", "alive"])
def test_unproven_claims_keep_the_device_quarantined(claim: str) -> None:
    store, _job, reply = interrupted(claim)
    status = reply.devices["gpu0"]
    assert (status.state, status.reason) == ("quarantined", "interrupted")
    assert status.fault_id is not None
    d = store.device("box1", "gpu0")
    assert (d.state, d.fault_id) == ("quarantined", status.fault_id)
    assert store.poll("box1", reply.session, ["gpu0"], now=2) == []
    assert store.clear("box1", "gpu0") == [status.fault_id]
    assert store.device("box1", "gpu0").state == "busy"  # still holding the adopted job


def test_not_reported_and_not_rebooted_is_lost_and_quarantined() -> None:
    store, job, reply = interrupted(None)
    assert store.job(job).state == "lost"
    assert reply.devices["gpu0"].state == "quarantined"


def test_require_manual_clear_never_frees_by_claim() -> None:
    _store, _, reply = interrupted("gone", manual=True)
    assert reply.devices["gpu0"].state == "quarantined"


def test_require_manual_clear_still_frees_on_a_proven_reboot() -> None:
    _store, _, reply = interrupted("unknown", manual=True, boot="boot-2")
    assert reply.devices["gpu0"].state == "free"


def test_adopted_job_not_finished_in_time_is_lost() -> None:
    store = Store(StoreConfig(report_timeout_s=60, heartbeat_interval_s=10), instance="t")
    session = register(store)
    job = store.submit(["x"])
    a = assign(store, session)
    start(store, session, a)
    session = store.register(
        "box1", _request([Recovery("gpu0", job, 1, "boot-1", "gone")], boot="boot-1"), now=10
    ).session
    # The host beats on, never mentioning the job: only the job's report timeout ends it.
    heartbeat(store, session, now=35)
    heartbeat(store, session, now=65)
    store.tick(69)
    assert store.job(job).state == "running"
    store.tick(70)
    assert store.job(job).state == "lost"


def test_an_adopted_job_of_a_live_worker_at_a_long_heartbeat_interval_is_not_lost() -> None:
    # A fleet's --heartbeat-rate can tell a host to beat every 100 s: a job the same live
    # process carried over a registration is mentioned in each beat, so it lives as long
    # as its host does, not report_timeout_s (60 s) after a beat.
    store = Store(StoreConfig(report_timeout_s=60, heartbeat_interval_s=100), instance="t")
    session = register(store, instance="w1")
    store.submit(["x"])
    a = assign(store, session)
    start(store, session, a)
    session = register(store, instance="w1", now=10)  # same process, after unknown_session
    mention = {"gpu0": DeviceReport("running", job_id=a.job_id, attempt=a.attempt)}
    heartbeat(store, session, now=100, devices=mention)
    store.tick(170)
    assert store.job(a.job_id).state == "running"
    heartbeat(store, session, now=200, devices=mention)
    store.tick(399)
    assert store.job(a.job_id).state == "running"
    # Silent for three intervals: the host is lost, and the job with it.
    store.tick(500)
    assert store.device("box1", "gpu0").host_state == "lost"
    assert store.job(a.job_id).state == "lost"


def test_host_lost_then_back_after_reboot() -> None:
    store = Store(StoreConfig(heartbeat_interval_s=10), instance="t")
    session = register(store, devices=("gpu0", "gpu1"), boot="boot-1", now=0)
    job = store.submit(["x"])
    a = assign(store, session)
    start(store, session, a)
    store.tick(30)
    assert store.device("box1", "gpu0").reason == "interrupted"
    reply = store.register("box1", _request([], boot="boot-2", devices=("gpu0", "gpu1")), now=40)
    assert {n: s.state for n, s in reply.devices.items()} == {"gpu0": "free", "gpu1": "free"}
    assert store.job(job).state == "lost"
    cleared = [e.data for e in store.events() if e.type == "device_cleared"]
    assert {(c["device"], c["by"]) for c in cleared} == {("gpu0", "reboot"), ("gpu1", "register")}


def test_host_lost_then_back_without_proof_keeps_the_job_device_quarantined() -> None:
    store = Store(StoreConfig(heartbeat_interval_s=10), instance="t")
    session = register(store, devices=("gpu0", "gpu1"), boot="boot-1", now=0)
    job = store.submit(["x"])
    a = assign(store, session)
    start(store, session, a)
    store.tick(30)
    reply = store.register("box1", _request([], boot="boot-1", devices=("gpu0", "gpu1")), now=40)
    # gpu1 ran nothing, so nothing of ours can be on it; gpu0 ran the job.
    assert reply.devices["gpu0"].state == "quarantined"
    assert reply.devices["gpu1"].state == "free"
    # A later registration that proves the job gone lifts it.
    recovery = [Recovery("gpu0", job, 1, "boot-1", "gone")]
    reply = store.register(
        "box1", _request(recovery, boot="boot-1", devices=("gpu0", "gpu1")), now=41
    )
    assert reply.devices["gpu0"].state == "free"


def test_recovery_for_a_job_the_controller_does_not_know() -> None:
    # The controller restarted too: it knows nothing, so only the worker's word counts.
    store = Store(instance="new")
    alive = _request([Recovery("gpu0", "j-9-old", 1, "boot-1", "alive")], boot="boot-1")
    assert store.register("box1", alive, now=0).devices["gpu0"].state == "quarantined"
    store2 = Store(instance="new2")
    gone = _request([Recovery("gpu0", "j-9-old", 1, "boot-1", "gone")], boot="boot-1")
    assert store2.register("box1", gone, now=0).devices["gpu0"].state == "free"
    store3 = Store(instance="new3")
    rebooted = _request([Recovery("gpu0", "j-9-old", 1, "boot-0", "unknown")], boot="boot-1")
    assert store3.register("box1", rebooted, now=0).devices["gpu0"].state == "free"


def test_assigned_but_unstarted_jobs_are_offered_again_at_register() -> None:
    store = Store(instance="t")
    session = register(store)
    job = store.submit(["x"])
    a = assign(store, session)
    session = register(store)
    assert store.job(job).state == "queued"
    with pytest.raises(StaleAttempt):
        start(store, session, a)
    assert assign(store, session).attempt == 2


def test_worker_faults_survive_a_registration() -> None:
    store = Store(instance="t")
    session = register(store)
    job = store.submit(["x"])
    a = assign(store, session)
    start(store, session, a)
    finish(store, session, a, fault_id="f-1", remaining=[7])
    reply = store.register("box1", _request([], boot="boot-2"), now=5)
    assert (reply.devices["gpu0"].state, reply.devices["gpu0"].fault_id) == ("quarantined", "f-1")
    assert store.job(job).state == "succeeded"


def test_bad_names() -> None:
    store = Store(instance="t")
    with pytest.raises(BadRequest, match=r"'\.'"):
        store.register("box1", _request([], boot="b", devices=("gpu.0",)), now=0)
    with pytest.raises(BadRequest, match="unique"):
        store.register("box1", _request([], boot="b", devices=("gpu0", "gpu0")), now=0)


def test_the_same_live_process_registering_again_interrupts_nothing() -> None:
    store = Store(StoreConfig(report_timeout_s=60, heartbeat_interval_s=1000), instance="t")
    session = register(store, devices=("gpu0", "gpu1"), pid=77)
    running, offered = store.submit(["r"]), store.submit(["o"])
    a = assign(store, session, ready=["gpu0"])
    start(store, session, a)
    b = assign(store, session, ready=["gpu1"])
    session = register(store, devices=("gpu0", "gpu1"), pid=77, now=5)  # after unknown_session
    assert store.job(running).state == "running"
    assert store.job(offered).state == "assigned"
    assert store.device("box1", "gpu0").state == "busy"
    start(store, session, b)
    # Its heartbeats keep mentioning the job it runs; the finish comes later.
    heartbeat(store, session, now=50, devices={"gpu0": DeviceReport("running", running, 1)})
    store.tick(100)
    finish(store, session, a, now=100)
    assert store.job(running).state == "succeeded"


def test_a_new_process_with_the_same_pid_but_a_journal_is_a_restart() -> None:
    store = Store(instance="t")
    session = register(store, pid=1)
    job = store.submit(["x"])
    a = assign(store, session)
    start(store, session, a)
    register(store, pid=1, recovery=[Recovery("gpu0", job, 1, "boot-1", "unknown")])
    assert store.device("box1", "gpu0").reason == "interrupted"


def test_a_new_pid_is_a_restart() -> None:
    store = Store(instance="t")
    session = register(store, pid=1)
    job = store.submit(["x"])
    a = assign(store, session)
    start(store, session, a)
    register(store, pid=2)
    assert store.job(job).state == "lost"
    assert store.device("box1", "gpu0").reason == "interrupted"


def test_resent_claims_for_jobs_the_worker_finished_change_nothing() -> None:
    store = Store(instance="t")
    session = register(store, pid=5)
    old = store.submit(["old"])
    a = assign(store, session)
    start(store, session, a)
    finish(store, session, a)
    running = store.submit(["new"])
    b = assign(store, session)
    start(store, session, b)
    # The same process registers again and (needlessly) resends an old journal entry.
    session = register(store, pid=5, recovery=[Recovery("gpu0", old, 1, "boot-1", "unknown")])
    assert store.job(running).state == "running"
    assert store.device("box1", "gpu0").faults == ()
    finish(store, session, b)
    assert store.job(running).state == "succeeded"


# -- the instance id: "same process or new" from who the process is, not its journal ---


def _running_pair(store: Store, instance: str) -> tuple[str, str, str]:
    """A restarted worker (``instance``) adopted ``old`` from its journal, then started
    ``new`` on gpu1: (session, old job, new job)."""
    session = register(store, devices=("gpu0", "gpu1"), instance="first")
    old = store.submit(["old"], device="box1/gpu0")
    start(store, session, assign(store, session, ready=["gpu0"]))
    entry = Recovery("gpu0", old, 1, "boot-1", "unknown")
    session = register(store, devices=("gpu0", "gpu1"), instance=instance, recovery=[entry])
    new = store.submit(["new"], device="box1/gpu1")
    start(store, session, assign(store, session, ready=["gpu1"]))
    return session, old, new


def test_a_resent_recovery_entry_from_the_same_instance_loses_no_running_job() -> None:
    store = Store(instance="t")
    _session, old, new = _running_pair(store, "second")
    entry = Recovery("gpu0", old, 1, "boot-1", "unknown")
    # The same process (its output answered unknown_session) registers again,
    # resending the entry whose lost finish it could not yet deliver.
    for now in (5, 6, 7):
        register(store, devices=("gpu0", "gpu1"), instance="second", recovery=[entry], now=now)
    assert store.job(new).state == "running"
    assert store.job(old).state == "running"  # adopted: the worker owes its finish
    assert store.device("box1", "gpu1").state == "busy"


def test_a_resent_recovery_entry_does_not_requarantine_a_cleared_device() -> None:
    store = Store(instance="t")
    _session, old, _new = _running_pair(store, "second")
    [fault] = store.device("box1", "gpu0").faults
    assert store.job(old).state == "running"  # adopted; its lost finish not yet delivered
    store.clear("box1", "gpu0")  # the operator looked and cleared it
    entry = Recovery("gpu0", old, 1, "boot-1", "unknown")
    register(store, devices=("gpu0", "gpu1"), instance="second", recovery=[entry], now=9)
    assert store.device("box1", "gpu0").faults == ()
    assert fault.fault_id not in {f.fault_id for f in store.device("box1", "gpu0").faults}


def test_a_new_instance_with_the_same_pid_and_no_journal_is_a_restart() -> None:
    store = Store(instance="t")
    session = register(store, pid=1, instance="a")
    job = store.submit(["x"])
    start(store, session, assign(store, session))
    register(store, pid=1, instance="b")
    assert store.job(job).state == "lost"
    assert store.device("box1", "gpu0").reason == "interrupted"


def test_the_same_instance_on_a_new_boot_is_a_new_process() -> None:
    store = Store(instance="t")
    session = register(store, instance="a", boot="boot-1")
    job = store.submit(["x"])
    start(store, session, assign(store, session))
    register(store, instance="a", boot="boot-2")
    assert store.job(job).state == "lost"


def test_a_report_from_another_host_does_not_keep_an_unstarted_offer_alive() -> None:
    # box1 reports running attempt 1 (a store restored from an older copy offered that
    # number again, to box2). Only box2 can speak for box2's offer: unstarted after
    # report_timeout_s, it is offered again, however often box1 names the number.
    store = Store(StoreConfig(report_timeout_s=60, heartbeat_interval_s=100), instance="t")
    box2 = register(store, "box2")
    box1 = register(store, "box1")
    store.submit(["x"])
    a = assign(store, box2, host="box2")
    mention = {"gpu0": DeviceReport("running", job_id=a.job_id, attempt=a.attempt)}
    heartbeat(store, box1, now=50, devices=mention)
    heartbeat(store, box2, "box2", now=50)
    store.tick(61)
    assert store.job(a.job_id).state == "queued"
