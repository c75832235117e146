"""The store's job rules, driven directly (sans-IO), with hypothesis where a rule is a property."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from rc_worker.controller.errors import BadRequest, Conflict, NotFound, StaleAttempt, UnknownSession
from rc_worker.controller.messages import (
    DeviceReport,
    LabelsUpdate,
    Recovery,
    StartRequest,
)
from rc_worker.controller.store import Store, StoreConfig

from .storekit import assign, event_types, finish, heartbeat, register, start


def test_submit_validates() -> None:
    store = Store(instance="t")
    with pytest.raises(BadRequest, match="command"):
        store.submit([])
    with pytest.raises(BadRequest, match="command"):
        store.submit("echo hi")
    with pytest.raises(BadRequest, match=r"select: .*unknown size suffix"):
        store.submit(["x"], select="disk>=5Q")
    with pytest.raises(BadRequest, match="host/device"):
        store.submit(["x"], device="gpu0")
    with pytest.raises(NotFound, match="box9/gpu0"):
        store.submit(["x"], device="box9/gpu0")
    with pytest.raises(BadRequest, match="max_runtime_s"):
        store.submit(["x"], max_runtime_s=0)
    with pytest.raises(BadRequest, match="env"):
        store.submit(["x"], env={"A=B": "1"})


def test_ids_carry_the_instance_so_two_controllers_never_share_one() -> None:
    a, b = Store(), Store()
    assert a.submit(["x"]) != b.submit(["x"])


def test_fifo_one_assignment_per_ready_device() -> None:
    store = Store(instance="t")
    session = register(store, devices=("gpu0", "gpu1"))
    first, second, third = (store.submit(["job", str(i)]) for i in range(3))
    assignments = store.poll("box1", session, ["gpu0", "gpu1", "gpu0"], now=0)
    assert [(a.job_id, a.device, a.attempt) for a in assignments] == [
        (first, "gpu0", 1),
        (second, "gpu1", 1),
    ]
    assert store.job(first).state == "assigned"
    assert store.job(third).state == "queued"
    assert store.device("box1", "gpu0").state == "busy"
    # A device with a running job gets nothing more, even when (wrongly) reported ready.
    start(store, session, assignments[0])
    assert store.poll("box1", session, ["gpu0"], now=0) == []


def test_selector_sees_host_and_device_facts_and_declared_labels() -> None:
    store = Store(instance="t")
    labels = LabelsUpdate(
        host={"disk_free_bytes": str(60 * 10**9)},
        devices={"gpu0": {"product": "A100"}, "gpu1": {"gpu1.product": "H100"}},
    )
    session = register(store, devices=("gpu0", "gpu1"), labels=labels)
    job = store.submit(["x"], select="disk_free_bytes>=50G,product=H100")
    assert store.poll("box1", session, ["gpu0"], now=0) == []
    [a] = store.poll("box1", session, ["gpu1"], now=0)
    assert (a.job_id, a.device) == (job, "gpu1")
    info = store.device("box1", "gpu1")
    assert info.labels["product"] == "H100"
    assert info.labels["gpu1.product"] == "H100"
    assert info.labels["disk_free_bytes"] == str(60 * 10**9)


def test_pinned_job_goes_only_to_its_device() -> None:
    store = Store(instance="t")
    session = register(store, devices=("gpu0", "gpu1"))
    job = store.submit(["x"], device="box1/gpu1")
    assert store.poll("box1", session, ["gpu0"], now=0) == []
    assert assign(store, session, ready=["gpu1"]).job_id == job


def test_hold_drain_and_quarantine_take_no_work() -> None:
    store = Store(instance="t")
    session = register(store, devices=("gpu0",))
    store.submit(["x"])
    store.set_idle_behavior("box1", "gpu0", "drain")
    assert store.poll("box1", session, ["gpu0"], now=0) == []
    store.set_idle_behavior("box1", "gpu0", "hold")
    assert store.poll("box1", session, ["gpu0"], now=0) == []
    with pytest.raises(BadRequest, match="idle_behavior"):
        store.set_idle_behavior("box1", "gpu0", "nap")
    store.set_idle_behavior("box1", "gpu0", "run")
    assert len(store.poll("box1", session, ["gpu0"], now=0)) == 1


def test_labels_payload_rule() -> None:
    store = Store(instance="t")
    labels = LabelsUpdate(host={"a": "1"}, devices={"gpu0": {"p": "x"}, "gpu1": {"p": "y"}})
    session = register(store, devices=("gpu0", "gpu1"), labels=labels)
    store.put_labels("box1", session, LabelsUpdate(host={"b": "2"}, devices={"gpu0": {}}), now=0)
    assert store.device("box1", "gpu0").facts == {}
    assert store.device("box1", "gpu1").facts == {"p": "y"}  # left out: keeps its facts
    assert store.device("box1", "gpu1").labels["b"] == "2"
    assert "a" not in store.device("box1", "gpu1").labels


def test_refused_requeues_as_a_new_attempt_then_gives_up() -> None:
    store = Store(StoreConfig(max_refusals=3), instance="t")
    session = register(store)
    job = store.submit(["x"])
    for attempt in (1, 2):
        a = assign(store, session)
        assert a.attempt == attempt
        finish(store, session, a, "refused")
        assert store.job(job).state == "queued"
    a = assign(store, session)
    finish(store, session, a, "refused")
    info = store.job(job)
    assert (info.state, info.attempt) == ("error", 3)
    assert "refused 3 times" in info.reason


def test_start_rules() -> None:
    store = Store(instance="t")
    session = register(store)
    job = store.submit(["x"])
    a = assign(store, session)
    with pytest.raises(StaleAttempt):
        store.start(job, StartRequest(session, 2, "gpu0", "boot-1"), now=0)
    with pytest.raises(BadRequest, match="device"):
        store.start(job, StartRequest(session, 1, "gpu1", "boot-1"), now=0)
    start(store, session, a)
    start(store, session, a)  # a retried start is fine
    assert store.job(job).state == "running"


def test_unstarted_assignment_is_offered_again_after_report_timeout() -> None:
    store = Store(StoreConfig(report_timeout_s=60, heartbeat_interval_s=100), instance="t")
    session = register(store)
    job = store.submit(["x"])
    a = assign(store, session, now=0)
    assert store.next_deadline() == 60
    # A heartbeat that mentions the attempt (the acquire hook is running) keeps it alive.
    heartbeat(store, session, now=50, devices={"gpu0": DeviceReport("acquiring", job, 1)})
    store.tick(100)
    assert store.job(job).state == "assigned"
    store.tick(110)
    assert store.job(job).state == "queued"
    with pytest.raises(StaleAttempt):
        start(store, session, a)
    assert assign(store, session, now=111).attempt == 2


def test_ready_again_with_an_unstarted_offer_means_the_offer_was_lost() -> None:
    store = Store(instance="t")
    session = register(store)
    job = store.submit(["x"])
    assert assign(store, session).attempt == 1
    a2 = assign(store, session)
    assert (a2.job_id, a2.attempt) == (job, 2)
    assert [x.status for x in store.job(job).attempts] == ["requeued", "assigned"]


def test_cancel_queued_assigned_running() -> None:
    store = Store(instance="t")
    session = register(store, devices=("gpu0", "gpu1"))
    queued = store.submit(["q"], device="box1/gpu1")
    store.set_idle_behavior("box1", "gpu1", "hold")
    assigned, running = store.submit(["a"]), store.submit(["r"])
    a = assign(store, session, ready=["gpu0"])
    assert a.job_id == assigned
    info = store.cancel(queued, "cancelled by alice")
    assert (info.state, info.reason, info.killed) == ("killed", "cancelled by alice", True)
    store.cancel(assigned)
    assert store.job(assigned).state == "killed"
    with pytest.raises(Conflict) as e:
        start(store, session, a)
    assert e.value.code == "cancelled"
    # The worker, still acquiring for it, is told to stop.
    reply = heartbeat(store, session, devices={"gpu0": DeviceReport("acquiring", assigned, 1)})
    assert [(c.job_id, c.attempt) for c in reply.cancel] == [(assigned, 1)]

    r = assign(store, session, ready=["gpu0"])
    assert r.job_id == running
    start(store, session, r)
    assert store.cancel(running, "stop").state == "running"
    reply = heartbeat(store, session)
    assert [(c.job_id, c.attempt, c.reason) for c in reply.cancel] == [(running, 1, "stop")]
    finish(store, session, r, "killed")
    assert store.job(running).state == "killed"
    assert heartbeat(store, session).cancel == ()
    assert store.cancel(running).state == "killed"  # idempotent on a finished job


def test_output_gap_and_stale() -> None:
    store = Store(instance="t")
    session = register(store)
    job = store.submit(["x"])
    a = assign(store, session)
    start(store, session, a)
    assert store.append_output(job, 1, 0, b"hello") == 5
    with pytest.raises(Conflict) as e:
        store.append_output(job, 1, 7, b"x")
    assert (e.value.code, e.value.extra) == ("gap", {"committed": 5})
    with pytest.raises(StaleAttempt):
        store.append_output(job, 2, 5, b"x")
    assert store.append_output(job, 1, 0, b"") == 5  # "where are you?"


@given(
    data=st.binary(min_size=0, max_size=64),
    sends=st.lists(st.tuples(st.integers(0, 70), st.integers(0, 70)), max_size=30),
)
def test_output_append_is_idempotent_for_any_chunking_and_retries(
    data: bytes, sends: list[tuple[int, int]]
) -> None:
    store = Store(instance="t")
    session = register(store)
    job = store.submit(["x"])
    a = assign(store, session)
    start(store, session, a)
    committed = 0
    for x, y in sends:
        lo, hi = sorted((min(x, len(data)), min(y, len(data))))
        if lo > committed:
            with pytest.raises(Conflict) as e:
                store.append_output(job, 1, lo, data[lo:hi])
            assert e.value.extra == {"committed": committed}
        else:
            committed = max(committed, hi)
            assert store.append_output(job, 1, lo, data[lo:hi]) == committed
        assert store.output(job) == data[:committed]
    # Whatever happened, resending from the committed offset completes it exactly once.
    store.append_output(job, 1, committed, data[committed:])
    store.append_output(job, 1, 0, data)
    assert store.output(job) == data


OUTCOMES = ["succeeded", "failed", "killed", "error", "lost", "refused"]
ACTIONS = st.lists(
    st.one_of(
        st.tuples(
            st.just("finish"),
            st.sampled_from(["succeeded", "failed", "killed", "error", "lost", "refused"]),
        ),
        st.tuples(st.just("cancel"), st.just("")),
        st.tuples(st.just("lose_host"), st.just("")),
        st.tuples(st.just("restart_worker"), st.sampled_from(["reported", "unreported"])),
    ),
    min_size=1,
    max_size=8,
)


@given(actions=ACTIONS)
def test_first_terminal_state_wins_whatever_the_order(actions: list[tuple[str, str]]) -> None:
    store = Store(StoreConfig(heartbeat_interval_s=10, report_timeout_s=10**9), instance="t")
    now = 0.0
    session = register(store, now=now)
    job = store.submit(["x"])
    a = assign(store, session)
    start(store, session, a)
    expected: str | None = None
    for action, arg in actions:
        now += 1
        if action == "finish":
            if store.job(job).state != "running" and expected is None:
                continue
            try:
                finish(store, session, a, arg, now=now)
            except UnknownSession:
                session = register(
                    store, now=now, recovery=[Recovery("gpu0", job, 1, "boot-1", "alive")]
                )
                finish(store, session, a, arg, now=now)
            if expected is None:
                expected = "error" if arg == "refused" else arg
        elif action == "cancel":
            store.cancel(job)
        elif action == "lose_host":
            now += 31
            store.tick(now)
            if expected is None:
                expected = "lost"
            session = register(
                store, now=now, recovery=[Recovery("gpu0", job, 1, "boot-1", "alive")]
            )
        else:
            reported = arg == "reported"
            recovery = [Recovery("gpu0", job, 1, "boot-1", "alive")] if reported else []
            session = register(store, now=now, recovery=recovery)
            if expected is None and not reported:
                expected = "lost"
    info = store.job(job)
    assert info.state == (expected or "running")
    finished = [e for e in store.events() if e.type == "job_finished"]
    assert len(finished) == (0 if expected is None else 1)


def test_events_after_and_limit_and_bound() -> None:
    store = Store(StoreConfig(max_events=3), instance="t")
    for _ in range(5):
        store.cancel(store.submit(["x"]))
    assert [e.seq for e in store.events()] == [3, 4, 5]
    assert [e.seq for e in store.events(after=3)] == [4, 5]
    assert [e.seq for e in store.events(after=0, limit=1)] == [3]
    assert store.events(after=5) == []
    assert store.last_event_seq == 5
    assert event_types(store) == ["job_finished"] * 3


def test_subscribers_hear_every_change() -> None:
    store = Store(instance="t")
    calls: list[int] = []
    unsubscribe = store.subscribe(lambda: calls.append(store.version))
    store.submit(["x"])
    register(store)
    unsubscribe()
    store.submit(["y"])
    assert calls == [1, 2]


def test_a_retried_start_after_a_cancel_ends_the_job() -> None:
    store = Store(instance="t")
    session = register(store)
    job = store.submit(["x"])
    a = assign(store, session)
    start(store, session, a)
    store.cancel(job, "stop")
    with pytest.raises(Conflict) as e:
        start(store, session, a)
    assert e.value.code == "cancelled"
    info = store.job(job)
    assert (info.state, info.reason) == ("killed", "stop")
