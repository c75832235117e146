"""The worker pool's view (second seed): counts per state, free devices per class,
running attempts with their end times; host drain, resume and retire; /metrics."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest
import trio
from hypothesis import given
from hypothesis import strategies as st
from starlette.applications import Starlette

from rc_worker.controller.errors import Conflict, NotFound
from rc_worker.controller.messages import (
    DeviceDecl,
    DeviceInfo,
    JobInfo,
    JobSpec,
    RegisterRequest,
    RunningClaim,
)
from rc_worker.controller.persist.codec import host_doc, load_host
from rc_worker.controller.pool import DEVICE_STATES, device_state, host_states, pool_view
from rc_worker.controller.store import Store, StoreConfig

from .helpers import USER_TOKEN, FakeWorker
from .storekit import assign, finish, register, start
from .test_rc_cli import rc


@pytest.fixture
def transport(app: Starlette) -> httpx.ASGITransport:
    return httpx.ASGITransport(app=app)


def dev(
    host: str = "h",
    name: str = "gpu0",
    state: str = "free",
    idle: str = "run",
    product: str | None = "H100",
    host_state: str = "up",
    present: bool = True,
) -> DeviceInfo:
    labels = {} if product is None else {"product": product}
    return DeviceInfo(
        host=host,
        name=name,
        state=state,
        reason=None,
        fault_id=None,
        faults=(),
        labels=labels,
        facts={},
        declared_labels={},
        idle_behavior=idle,
        present=present,
        host_state=host_state,
    )


def job(job_id: str, state: str, finished_at: float | None = None) -> JobInfo:
    return JobInfo(
        job_id=job_id,
        state=state,
        attempt=1,
        spec=JobSpec(command=("x",)),
        host="h",
        device="gpu0",
        finished_at=finished_at,
        outcome=state if finished_at is not None else None,
    )


def test_counts_held_devices_draining_hosts_and_free_classes() -> None:
    devices = [
        dev("a", "gpu0"),
        dev("a", "gpu1", product="A100"),
        dev("a", "gpu2", idle="hold"),
        dev("b", "gpu0", idle="drain"),
        dev("b", "gpu1", state="busy", idle="drain"),
        dev("c", "gpu0", state="quarantined", host_state="lost"),
        dev("c", "gpu1", state="absent", present=False, host_state="lost"),
    ]
    view = pool_view(devices, [], now=0.0)
    assert view["hosts"] == {
        "unknown": 0,
        "up": 1,
        "draining": 1,
        "lost": 1,
        "retired": 0,
        "left": 0,
    }
    assert view["devices"] == {"free": 2, "busy": 1, "held": 2, "quarantined": 1, "absent": 1}
    assert view["idle_behavior"] == {"run": 3, "hold": 1, "drain": 2}
    assert view["free_by_class"] == {"A100": 1, "H100": 1}


def test_running_attempts_carry_an_ended_placeholder_for_recent_ends() -> None:
    jobs = [
        job("j-1", "running"),
        job("j-2", "assigned"),
        job("j-3", "succeeded", finished_at=950.0),
        job("j-4", "failed", finished_at=100.0),  # long ago: forgotten
        job("j-5", "queued"),
    ]
    view = pool_view([], jobs, now=1000.0, recent_s=300.0)
    assert [(r["job_id"], r["ended_at"]) for r in view["running"]] == [
        ("j-1", None),
        ("j-2", None),
        ("j-3", 950.0),
    ]


DEVICES = st.builds(
    dev,
    host=st.sampled_from(["a", "b", "c"]),
    name=st.sampled_from(["gpu0", "gpu1"]),
    state=st.sampled_from(["free", "busy", "quarantined", "absent"]),
    idle=st.sampled_from(["run", "hold", "drain"]),
    product=st.sampled_from(["H100", "A100", None]),
    host_state=st.sampled_from(["up", "lost", "unknown", "left"]),
)


@given(st.lists(DEVICES, max_size=30))
def test_every_device_is_counted_once_and_free_ones_by_class(devices: list[DeviceInfo]) -> None:
    view = pool_view(devices, [], now=0.0)
    assert sum(view["devices"].values()) == len(devices)
    assert set(view["devices"]) == set(DEVICE_STATES)
    assert sum(view["free_by_class"].values()) == view["devices"]["free"]
    assert sum(view["hosts"].values()) == len(host_states(devices))
    held = [d for d in devices if device_state(d) == "held"]
    assert all(d.state == "free" and d.idle_behavior != "run" for d in held)
    # Free means work can go there: a live host's device, taking work.
    free = [d for d in devices if device_state(d) == "free"]
    assert all(d.host_state == "up" and d.idle_behavior == "run" for d in free)


# -- the store: drain, resume, retire ------------------------------------------------


def test_a_drained_host_gets_no_work_until_resumed() -> None:
    store = Store(instance="t")
    session = register(store, devices=("gpu0", "gpu1"))
    store.set_host_idle_behavior("box1", "drain")
    store.submit(["x"])
    assert store.poll("box1", session, ["gpu0", "gpu1"], now=0) == []
    assert store.pool()["hosts"]["draining"] == 1
    assert store.pool()["devices"]["held"] == 2
    store.set_host_idle_behavior("box1", "run")
    [a] = store.poll("box1", session, ["gpu0", "gpu1"], now=0)
    assert a.device == "gpu0"
    assert [e.type for e in store.events()].count("host_idle_behavior") == 2


def test_retire_refuses_a_busy_host_unless_forced_and_keeps_the_jobs_records() -> None:
    store = Store(instance="t")
    session = register(store, devices=("gpu0",))
    job_id = store.submit(["x"])
    start(store, session, assign(store, session))
    with pytest.raises(Conflict, match="--force"):
        store.retire_host("box1")
    assert store.retire_host("box1", force=True) == [job_id]
    assert store.devices() == []
    assert store.job(job_id).state == "lost"
    assert "retired" in store.job(job_id).reason
    with pytest.raises(NotFound):
        store.retire_host("box1")
    assert store.pool()["hosts"]["retired"] == 1  # a host state too (issue 14)
    # Back again: a new host, registered afresh.
    register(store, devices=("gpu0",))
    assert [d.address for d in store.devices()] == ["box1/gpu0"]
    assert store.pool()["hosts"]["retired"] == 0


async def test_a_forced_retire_of_a_live_worker_leaves_its_running_device_quarantined(
    client: httpx.AsyncClient, user: httpx.AsyncClient, store: Store
) -> None:
    """Was free: the worker, still alive, registered again as a new host and ran the job
    to its end, while rc devices and the pool counted the device it ran on as free
    capacity. It is quarantined as a lost host's is, naming the job, until cleared."""
    w = FakeWorker(client)

    async def register_running(job_id: str) -> dict[str, Any]:
        decl = {"name": "gpu0", "declared_labels": {}, "running": {"job_id": job_id, "attempt": 1}}
        return await w.register(devices=[decl], protocol=2, instance_id="i-1")

    with trio.fail_after(10):
        await w.register(protocol=2, instance_id="i-1")
        job_id = store.submit(["x"])
        [a] = await w.poll(wait_s=0)
        assert (await w.start(a)).status_code == 200
        r = await user.post("/v1/hosts/box1/retire", json={"force": True})
        assert r.json()["jobs_lost"] == [job_id]
        r = await w.heartbeat({"gpu0": {"state": "running", "job_id": job_id, "attempt": 1}})
        assert r.json()["error"] == "unknown_session"
        # The same live process registers again, still running the job, and says so.
        reply = await register_running(job_id)
        said = reply["devices"]["gpu0"]
        assert (said["state"], said["reason"]) == ("quarantined", "interrupted")
        [device] = (await user.get("/v1/devices")).json()["devices"]
        assert (device["state"], device["host_state"]) == ("quarantined", "up")
        [fault] = device["faults"]
        assert (fault["job_id"], fault["raised_by"]) == (job_id, "controller")
        assert "host box1 retired" in fault["detail"]
        assert (await user.get("/v1/pool")).json()["devices"]["free"] == 0
        # Registering again (another unknown_session) raises no second fault.
        await register_running(job_id)
        assert len(store.device("box1", "gpu0").faults) == 1
        # The job ends there: it stays lost, and the device quarantined until cleared.
        assert (await w.finish(a, "succeeded")).status_code == 200
        assert store.job(job_id).state == "lost"
        assert store.device("box1", "gpu0").state == "quarantined"
        assert (await user.post("/v1/devices/box1/gpu0/clear", json={})).status_code == 200
        assert store.device("box1", "gpu0").state == "free"


def test_a_host_lost_while_cut_off_keeps_one_fault_when_its_worker_claims_the_job() -> None:
    # The lost-host window the forced retire now matches: the fault raised at host loss
    # is the one the device keeps, whether or not the registration claims the job.
    store = Store(StoreConfig(heartbeat_interval_s=10), instance="t")
    session = register(store, devices=("gpu0",), now=0)
    job_id = store.submit(["x"])
    start(store, session, assign(store, session))
    store.tick(31)
    assert store.job(job_id).state == "lost"
    [before] = store.device("box1", "gpu0").faults
    decl = DeviceDecl("gpu0", running=RunningClaim(job_id, 1))
    store.register("box1", RegisterRequest(boot_id="boot-1", devices=(decl,)), now=32)
    d = store.device("box1", "gpu0")
    assert (d.state, [f.fault_id for f in d.faults]) == ("quarantined", [before.fault_id])


# -- end to end through rc --------------------------------------------------------------


async def test_rc_pool_and_rc_host_in_process(
    transport: httpx.ASGITransport,
    client: httpx.AsyncClient,
    store: Store,
    capsys: pytest.CaptureFixture[str],
) -> None:
    w = FakeWorker(client, labels={"host": {}, "devices": {"gpu0": {"product": "H100"}}})
    with trio.fail_after(10):
        await w.register()
        assert await rc("pool", "--json", token=USER_TOKEN, transport=transport) == 0
        view = json.loads(capsys.readouterr().out)
        assert view["devices"]["free"] == 1
        assert view["free_by_class"] == {"H100": 1}
        assert await rc("pool", token=USER_TOKEN, transport=transport) == 0
        text = capsys.readouterr().out
        assert "free 1" in text
        assert "H100" in text
        assert await rc("host", "drain", "box1", token=USER_TOKEN, transport=transport) == 0
        assert "draining" in capsys.readouterr().out
        assert store.device("box1", "gpu0").idle_behavior == "drain"
        assert await rc("host", "resume", "box1", token=USER_TOKEN, transport=transport) == 0
        assert store.device("box1", "gpu0").idle_behavior == "run"
        job_id = store.submit(["x"])
        [a] = await w.poll(wait_s=0)
        await w.start(a)
        assert await rc("host", "retire", "box1", token=USER_TOKEN, transport=transport) == 1
        assert "--force" in capsys.readouterr().err
        assert (
            await rc("host", "retire", "box1", "--force", token=USER_TOKEN, transport=transport)
            == 0
        )
        assert job_id in capsys.readouterr().out
        assert store.devices() == []


async def test_metrics_count_the_pool(client: httpx.AsyncClient, store: Store) -> None:
    w = FakeWorker(client, labels={"host": {}, "devices": {"gpu0": {"product": "H100"}}})
    with trio.fail_after(10):
        await w.register()
        store.submit(["x"])
        r = await client.get("/metrics")
    assert r.status_code == 200
    text = r.text
    assert 'rc_controller_hosts{state="up"} 1.0' in text
    # Every host state is a series, 0 included (an alert on "left" must not see no data).
    assert 'rc_controller_hosts{state="left"} 0.0' in text
    assert 'rc_controller_devices{idle_behavior="run",state="free"} 1.0' in text
    assert 'rc_controller_free_devices{class="H100"} 1.0' in text
    assert 'rc_controller_jobs{state="queued"} 1.0' in text


async def test_metrics_count_jobs_finished_and_faults_cleared(
    client: httpx.AsyncClient, store: Store
) -> None:
    """Issue 14 asks for jobs finished by outcome and faults cleared: counters since the
    controller started (retention does not lower them), and every job state as a series,
    zero included, so an alert on ``queued`` has something to read."""
    w = FakeWorker(client)
    with trio.fail_after(10):
        await w.register()
        store.submit(["x"])
        a = await w.run_one()
        job_id = store.submit(["y"])
        [b] = await w.poll(wait_s=5)
        assert (await w.start(b)).status_code == 200
        r = await w.finish(
            b, "failed", exit_code=3, fault_id="f-1", verify={"ok": False, "reason": "ecc"}
        )
        assert r.status_code == 200, r.text
        assert store.device("box1", "gpu0").state == "quarantined"
        assert store.clear("box1", "gpu0") == ["f-1"]
        text = (await client.get("/metrics")).text
    assert a["job_id"] != job_id
    assert 'rc_controller_jobs_finished_total{outcome="succeeded"} 1.0' in text
    assert 'rc_controller_jobs_finished_total{outcome="failed"} 1.0' in text
    assert 'rc_controller_jobs_finished_total{outcome="lost"} 0.0' in text
    assert 'rc_controller_faults_cleared_total{kind="verify_failed"} 1.0' in text
    assert 'rc_controller_jobs{state="queued"} 0.0' in text
    assert 'rc_controller_jobs{state="running"} 0.0' in text


# -- heartbeats scale with the fleet ------------------------------------------------------


def test_with_a_heartbeat_rate_a_large_fleet_is_told_a_longer_interval() -> None:
    store = Store(StoreConfig(heartbeat_interval_s=1.0, heartbeat_rate=10.0), instance="t")
    told = []
    for i in range(50):
        reply = store.register(
            f"h{i}", RegisterRequest(boot_id="b", devices=(DeviceDecl("gpu0"),)), now=0
        )
        told.append(reply.heartbeat_interval_s)
    # Ten hosts at 1 s are ten a second; past that each new host is told hosts / rate.
    assert told[:10] == [1.0] * 10
    assert told[-1] == pytest.approx(5.0)
    assert told == sorted(told)
    # A host is lost after missed heartbeats of the interval it was told.
    store.tick(3.5)  # the first host (1 s, 3 missed) is lost; the last (5 s) is not
    assert store.device("h0", "gpu0").host_state == "lost"
    assert store.device("h49", "gpu0").host_state == "up"
    store.tick(15.5)
    assert store.device("h49", "gpu0").host_state == "lost"


def test_without_a_rate_every_host_is_told_the_configured_interval() -> None:
    store = Store(StoreConfig(heartbeat_interval_s=2.0), instance="t")
    for i in range(30):
        reply = store.register(
            f"h{i}", RegisterRequest(boot_id="b", devices=(DeviceDecl("gpu0"),)), now=0
        )
        assert reply.heartbeat_interval_s == 2.0


def test_a_host_that_left_counts_apart_and_its_free_devices_as_absent() -> None:
    devices = [
        dev("a", "gpu0"),
        dev("d", "gpu0", host_state="left"),
        dev("d", "gpu1", state="quarantined", host_state="left"),
    ]
    view = pool_view(devices, [], now=0.0)
    assert view["hosts"]["left"] == 1
    assert view["hosts"]["up"] == 1
    assert view["devices"]["free"] == 1
    assert view["devices"]["absent"] == 1
    assert view["devices"]["quarantined"] == 1
    assert view["free_by_class"] == {"H100": 1}


def test_devices_show_their_last_job_and_when_they_were_last_busy() -> None:
    """The seed's pool shows ``last_busy`` and ``last_container_uuid`` beside the idle
    behaviour: how long a device has been idle, and what ran there last."""
    wall = [1000.0]
    store = Store(instance="t", wall_clock=lambda: wall[0])
    session = register(store, devices=("gpu0", "gpu1"))
    fresh = store.device("box1", "gpu0")
    assert (fresh.last_job, fresh.last_busy) == (None, None)
    job_id = store.submit(["x"])
    a = assign(store, session)
    assert (store.device("box1", "gpu0").last_job, store.device("box1", "gpu0").last_busy) == (
        job_id,
        1000.0,
    )
    start(store, session, a)
    wall[0] = 1060.0
    finish(store, session, a)
    done = store.device("box1", "gpu0")
    assert (done.state, done.last_job, done.last_busy) == ("free", job_id, 1060.0)
    assert store.device("box1", "gpu1").last_job is None
    # Stored with the host: a controller loaded from the store shows them.
    h = store.known_host("box1")
    assert h is not None
    again = load_host(json.loads(json.dumps(host_doc(h))), now=0.0)
    assert (again.devices["gpu0"].last_job, again.devices["gpu0"].last_busy) == (job_id, 1060.0)


def test_devices_show_the_pools_states_held_absent_and_draining() -> None:
    """Issue 14: a device is free, busy, held, quarantined or absent; a host unknown, up,
    draining, lost or retired. The device list says what the pool counts."""
    store = Store(instance="t")
    session = register(store, devices=("gpu0", "gpu1", "gpu2"))
    store.set_idle_behavior("box1", "gpu1", "hold")
    store.set_idle_behavior("box1", "gpu2", "drain")
    held, _ = store.devices_page(state="held")
    assert [(d.name, d.state, d.idle_behavior) for d in held] == [
        ("gpu1", "held", "hold"),
        ("gpu2", "held", "drain"),
    ]
    free, _ = store.devices_page(state="free")
    assert [d.name for d in free] == ["gpu0"]
    assert store.pool()["devices"]["held"] == 2
    assert {d.host_state for d in store.devices()} == {"up"}
    store.set_host_idle_behavior("box1", "drain")
    assert {d.host_state for d in store.devices()} == {"draining"}
    assert store.pool()["hosts"]["draining"] == 1
    # A worker that deregistered after its drain: its free devices are absent.
    store.deregister("box1", session, now=0)
    assert {(d.state, d.host_state) for d in store.devices()} == {("absent", "left")}
    assert [d.name for d in store.devices_page(state="absent")[0]] == ["gpu0", "gpu1", "gpu2"]


def test_free_devices_of_lost_and_unknown_hosts_are_not_counted_free() -> None:
    """A device the record calls free on a host with no session (lost, or ``unknown`` in a
    restarted controller's recovery grace) can take no work: the pool counts it ``absent``,
    as a deregistered host's, so neither ``free`` nor ``free_by_class`` offers capacity that
    is not there. Busy and quarantined devices there keep saying so."""
    devices = [
        dev("a", "gpu0"),
        dev("c", "gpu0", host_state="lost"),
        dev("c", "gpu1", idle="hold", host_state="lost"),
        dev("c", "gpu2", state="quarantined", host_state="lost"),
        dev("u", "gpu0", host_state="unknown"),
        dev("u", "gpu1", state="busy", host_state="unknown"),
    ]
    assert [device_state(d) for d in devices] == [
        "free",
        "absent",
        "absent",
        "quarantined",
        "absent",
        "busy",
    ]
    view = pool_view(devices, [], now=0.0)
    assert view["devices"] == {"free": 1, "busy": 1, "held": 0, "quarantined": 1, "absent": 3}
    assert view["free_by_class"] == {"H100": 1}


async def test_a_lost_hosts_cleared_devices_are_not_free_in_the_pool_devices_and_metrics(
    client: httpx.AsyncClient, user: httpx.AsyncClient, store: Store
) -> None:
    w = FakeWorker(client, labels={"host": {}, "devices": {"gpu0": {"product": "H100"}}})
    with trio.fail_after(10):
        await w.register()
        store.tick(1e9)  # far past any missed-heartbeat limit: the host is lost
        assert store.device("box1", "gpu0").state == "quarantined"  # ``interrupted``
        # An operator clears the fault while the host is still down: the record's device is
        # free again, but nothing can run there until its worker registers.
        assert len(store.clear("box1", "gpu0")) == 1
        assert store.device("box1", "gpu0").host_state == "lost"
        pool = (await user.get("/v1/pool")).json()
        assert (pool["devices"]["free"], pool["devices"]["absent"]) == (0, 1)
        assert pool["free_by_class"] == {}
        lost = (await user.get("/v1/devices", params={"state": "absent"})).json()["devices"]
        free = (await user.get("/v1/devices", params={"state": "free"})).json()["devices"]
        text = (await client.get("/metrics")).text
    assert [(d["address"], d["state"], d["host_state"]) for d in lost] == [
        ("box1/gpu0", "absent", "lost")
    ]
    assert free == []
    assert 'rc_controller_devices{idle_behavior="run",state="free"} 0.0' in text
    assert 'rc_controller_devices{idle_behavior="run",state="absent"} 1.0' in text
    assert 'rc_controller_free_devices{class="H100"}' not in text
