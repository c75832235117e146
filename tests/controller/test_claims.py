"""Protocol 2: what a worker holds, re-asserted at register and in heartbeats, is taken as fact.

The controller here has a fresh, empty store, as after losing its database.
"""

from __future__ import annotations

import logging
from typing import Any

import httpx
import pytest
from hypothesis import assume, event, given
from hypothesis import strategies as st

from rc_worker.controller import Store
from rc_worker.controller.claims import judge_claim, offer_fate
from rc_worker.controller.messages import (
    DeviceDecl,
    DeviceReport,
    JobSpec,
    RegisterRequest,
    RunningClaim,
)
from rc_worker.controller.records import Attempt, Job
from rc_worker.core.selectors import parse_selector

from .helpers import FakeWorker
from .storekit import assign, heartbeat, register, start


def claims(
    faults: list[dict[str, str]] | None = None, running: dict[str, Any] | None = None
) -> dict[str, Any]:
    out: dict[str, Any] = {"faults": faults or []}
    if running is not None:
        out["running"] = running
    return out


async def register_with(
    w: FakeWorker, per_device: dict[str, dict[str, Any]], **extra: Any
) -> dict[str, Any]:
    devices = [{"name": d, "declared_labels": {}, **per_device.get(d, {})} for d in w.devices]
    return await w.register(devices=devices, protocol=2, **extra)


async def test_faults_and_running_attempts_are_adopted(
    client: httpx.AsyncClient, user: httpx.AsyncClient, store: Store
) -> None:
    w = FakeWorker(client, devices=["gpu0", "gpu1"])
    reply = await register_with(
        w,
        {
            "gpu0": claims([{"fault_id": "f-held", "kind": "verify_failed", "reason": "ecc"}]),
            "gpu1": claims(
                running={"job_id": "j-7-gone", "attempt": 2, "output_bytes": 3, "started_at": 1.0}
            ),
        },
    )
    assert reply["protocol"] == 2
    assert reply["devices"]["gpu0"]["state"] == "quarantined"
    assert reply["devices"]["gpu0"]["faults"] == ["f-held"]
    gpu0 = store.device("box1", "gpu0")
    assert (gpu0.state, gpu0.faults[0].kind, gpu0.faults[0].detail) == (
        "quarantined",
        "verify_failed",
        "ecc",
    )
    job = store.job("j-7-gone")
    assert (job.state, job.attempt, job.adopted) == ("running", 2, True)
    assert store.device("box1", "gpu1").state == "busy"
    a = {"job_id": "j-7-gone", "attempt": 2, "device": "gpu1"}
    # The worker resends from the controller's committed offset (0): nothing is dropped.
    assert (await w.output(a, 3, b"late")).json()["committed"] == 0
    assert (await w.output(a, 0, b"abcdef")).json() == {"committed": 6}
    r = await w.finish(a, "succeeded", output_bytes=6)
    assert r.status_code == 200, r.text
    assert store.job("j-7-gone").state == "succeeded"
    assert store.output("j-7-gone") == b"abcdef"
    types = [e.type for e in store.events()]
    assert "job_adopted" in types
    assert "fault_adopted" in types

    # An adopted fault is lifted by `rc clear` like any other.
    r = await user.post("/v1/devices/box1/gpu0/clear")
    assert r.json()["cleared"] == ["f-held"]
    r = await w.heartbeat({"gpu0": {"state": "quarantined", "faults": ["f-held"]}})
    assert r.json()["cleared"] == {"gpu0": ["f-held"]}


async def test_a_slices_claimed_copy_of_a_gpu_fault_goes_with_the_gpus(
    client: httpx.AsyncClient, user: httpx.AsyncClient, store: Store
) -> None:
    """A slice's copy of its GPU's fault, claimed at registration, is linked to the GPU's
    as a ``fault`` report links it: clearing the GPU lifts it, and one claimed after the
    GPU's was cleared is lifted at once (``by: parent_cleared``), as a late report is."""
    w = FakeWorker(client, devices=["gpu0", "gpu0-mig1", "gpu0-mig2"])
    gpu = {"fault_id": "f-gpu", "kind": "gpu_xid"}
    copy = {"kind": "gpu_xid", "parent_fault": "f-gpu"}
    await register_with(
        w,
        {"gpu0": claims([gpu]), "gpu0-mig1": claims([{"fault_id": "f-c1", **copy}])},
    )
    assert store.device("box1", "gpu0-mig1").faults[0].parent_fault == "f-gpu"
    r = await user.post("/v1/devices/box1/gpu0/clear")
    assert r.json()["cleared"] == ["f-gpu"]
    assert store.device("box1", "gpu0-mig1").state == "free"
    # The other slice's copy, claimed only now (its worker restarted before sending it).
    reply = await register_with(w, {"gpu0-mig2": claims([{"fault_id": "f-c2", **copy}])})
    assert reply["devices"]["gpu0-mig2"]["state"] == "free"
    lifted = [e.data for e in store.events() if e.type == "device_cleared"]
    assert (lifted[-1]["device"], lifted[-1]["fault_ids"], lifted[-1]["by"]) == (
        "gpu0-mig2",
        ["f-c2"],
        "parent_cleared",
    )
    r = await w.heartbeat({"gpu0-mig2": {"state": "quarantined", "faults": ["f-c2"]}})
    assert r.json()["cleared"]["gpu0-mig2"] == ["f-c2"]


async def test_a_device_its_worker_holds_quarantined_is_never_assigned(
    client: httpx.AsyncClient, user: httpx.AsyncClient, store: Store
) -> None:
    w = FakeWorker(client)
    await register_with(w, {"gpu0": claims([{"fault_id": "f-1", "kind": "dirty"}])})
    await user.post("/v1/devices/box1/gpu0/clear")
    assert store.device("box1", "gpu0").state == "free"
    job_id = store.submit(["echo"])
    # The store says free, but the worker still holds the fault: no assignment.
    assert await w.poll(["gpu0"]) == []
    await w.heartbeat({"gpu0": {"state": "quarantined", "faults": ["f-1"]}})
    assert await w.poll(["gpu0"]) == []
    # Registering again with the cleared fault still held: not re-raised, cleared re-sent.
    await register_with(w, {"gpu0": claims([{"fault_id": "f-1", "kind": "dirty"}])})
    assert store.device("box1", "gpu0").state == "free"
    r = await w.heartbeat({"gpu0": {"state": "quarantined", "faults": ["f-1"]}})
    assert r.json()["cleared"] == {"gpu0": ["f-1"]}
    await w.heartbeat({"gpu0": {"state": "free", "faults": []}})
    [a] = await w.poll(["gpu0"])
    assert a["job_id"] == job_id


async def test_a_heartbeat_naming_an_unknown_running_attempt_adopts_it(
    client: httpx.AsyncClient, store: Store
) -> None:
    w = FakeWorker(client)
    await w.register()
    r = await w.heartbeat({"gpu0": {"state": "running", "job_id": "j-3-old", "attempt": 1}})
    assert r.status_code == 200
    assert r.json()["cancel"] == []
    assert store.job("j-3-old").state == "running"
    a = {"job_id": "j-3-old", "attempt": 1, "device": "gpu0"}
    assert (await w.output(a, 0, b"x")).json() == {"committed": 1}


async def test_unknown_job_remains_for_ids_nobody_claims(client: httpx.AsyncClient) -> None:
    w = FakeWorker(client)
    await w.register()
    a = {"job_id": "j-never", "attempt": 1, "device": "gpu0"}
    r = await w.output(a, 0, b"x")
    assert (r.status_code, r.json()["error"]) == (404, "unknown_job")


async def test_a_version_mismatch_is_one_line_at_register(
    client: httpx.AsyncClient, caplog: pytest.LogCaptureFixture
) -> None:
    w = FakeWorker(client)
    with caplog.at_level(logging.WARNING, logger="rc_worker.controller"):
        reply = await w.register()  # a version-1 worker: no `protocol`, no claims
    assert reply["protocol"] == 2
    [line] = [r.getMessage() for r in caplog.records if "protocol" in r.getMessage()]
    assert "protocol 1" in line
    assert "speaks 2" in line


async def test_a_job_the_store_has_as_queued_takes_the_attempt_a_worker_runs(
    client: httpx.AsyncClient, store: Store
) -> None:
    # The store came back from a copy taken before the job was offered: it says queued,
    # while box1 runs its attempt 1. Offered again, it would go out as attempt 1 a second
    # time, and the two processes' output and finishes would pass for each other's.
    job_id = store.submit(["train"])
    w1 = FakeWorker(client)
    await register_with(w1, {"gpu0": claims(running={"job_id": job_id, "attempt": 1})})
    job = store.job(job_id)
    assert (job.state, job.attempt, job.host, job.device) == ("running", 1, "box1", "gpu0")
    assert store.device("box1", "gpu0").state == "busy"
    w2 = FakeWorker(client, "box2")
    await w2.register()
    assert await w2.poll(["gpu0"]) == []
    a = {"job_id": job_id, "attempt": 1, "device": "gpu0"}
    assert (await w1.output(a, 0, b"ok")).json() == {"committed": 2}
    assert (await w1.finish(a, "succeeded", output_bytes=2)).status_code == 200
    assert store.job(job_id).state == "succeeded"


async def offered_to_box2(
    client: httpx.AsyncClient, store: Store
) -> tuple[str, FakeWorker, dict[str, Any], FakeWorker]:
    """A job offered to box2 as attempt 1, and box1 registered: (job, box2, offer, box1)."""
    job_id = store.submit(["train"])
    w2 = FakeWorker(client, "box2")
    await w2.register()
    [offer] = await w2.poll(["gpu0"])
    w1 = FakeWorker(client)
    await w1.register()
    return job_id, w2, offer, w1


async def test_an_offer_older_than_the_attempt_a_worker_runs_is_superseded(
    client: httpx.AsyncClient, store: Store
) -> None:
    # The restored store's offer is attempt 1 on box2; box1 runs attempt 2.
    job_id, w2, old, w1 = await offered_to_box2(client, store)
    r = await w1.heartbeat({"gpu0": {"state": "running", "job_id": job_id, "attempt": 2}})
    assert r.json()["cancel"] == []
    job = store.job(job_id)
    assert (job.state, job.attempt, job.host) == ("running", 2, "box1")
    assert job.attempts[0].status == "requeued"
    assert store.device("box2", "gpu0").state == "free"
    r = await w2.start(old)
    assert (r.status_code, r.json()["error"]) == (409, "stale_attempt")
    # Each attempt number stays with one process: the next offer would be attempt 3.
    assert {e.data["attempt"] for e in store.events() if e.type == "job_adopted"} == {2}


async def test_output_under_another_hosts_session_is_refused_as_stale(
    client: httpx.AsyncClient, store: Store
) -> None:
    # Tokens here act for any host; the session says which host is sending.
    job_id, w2, a, w1 = await offered_to_box2(client, store)
    r = await w1.output(a, 0, b"not yours", session=True)
    assert (r.status_code, r.json()["error"]) == (409, "stale_attempt")
    assert store.output(job_id) == b""
    assert (await w2.output(a, 0, b"mine", session=True)).json() == {"committed": 4}


async def test_the_same_attempt_number_running_on_another_host_is_cancelled(
    client: httpx.AsyncClient, store: Store
) -> None:
    # The restored store offered box2 attempt 1, the number box1 already runs. Each
    # number stays one process's: box1's report does not pass for box2's offer, and it
    # is cancelled.
    job_id, _w2, offer, w1 = await offered_to_box2(client, store)
    r = await w1.heartbeat({"gpu0": {"state": "running", "job_id": job_id, "attempt": 1}})
    [order] = r.json()["cancel"]
    assert (order["job_id"], order["attempt"]) == (job_id, 1)
    assert "offered to box2/gpu0" in order["reason"]
    job = store.job(job_id)
    assert (job.state, job.attempt, job.host, offer["attempt"]) == ("assigned", 1, "box2", 1)


async def test_a_new_worker_process_claiming_a_later_attempt_keeps_the_job(
    client: httpx.AsyncClient, store: Store
) -> None:
    # The restored store has attempt 1 running here under an older worker process; the
    # live one (a new instance) runs attempt 2. Nothing was interrupted: not lost.
    job_id = store.submit(["train"])
    w1 = FakeWorker(client)
    await w1.register(devices=[{"name": "gpu0", "declared_labels": {}}], instance_id="old")
    [a1] = await w1.poll(["gpu0"])
    assert (await w1.start(a1)).status_code == 200
    await register_with(w1, {"gpu0": claims(running={"job_id": job_id, "attempt": 2})})
    job = store.job(job_id)
    assert (job.state, job.attempt, job.host) == ("running", 2, "box1")
    assert store.device("box1", "gpu0").state == "busy"  # not quarantined `interrupted`
    r = await w1.heartbeat({"gpu0": {"state": "running", "job_id": job_id, "attempt": 2}})
    assert r.json()["cancel"] == []


async def test_a_claim_on_a_device_the_controller_had_running_another_job_ends_that_job(
    client: httpx.AsyncClient, store: Store
) -> None:
    # The restored store has X running on gpu0; the worker runs Y there (X's finish went
    # with the newer copy). X must not stay `running` for ever while gpu0 is offered again.
    x, y = store.submit(["x"]), store.submit(["y"])
    w1 = FakeWorker(client)
    await w1.register()
    [ax] = await w1.poll(["gpu0"])
    assert ax["job_id"] == x
    assert (await w1.start(ax)).status_code == 200
    r = await w1.heartbeat({"gpu0": {"state": "running", "job_id": y, "attempt": 1}})
    assert r.json()["cancel"] == []
    assert (store.job(y).state, store.job(y).device) == ("running", "gpu0")
    assert store.job(x).state == "lost"
    assert f"the worker runs {y} on box1/gpu0" in store.job(x).reason
    ay = {"job_id": y, "attempt": 1, "device": "gpu0"}
    assert (await w1.finish(ay, "succeeded")).status_code == 200
    assert store.device("box1", "gpu0").state == "free"


# -- an offer whose start never reached the controller, claimed running at registration --


async def offer_without_start(
    client: httpx.AsyncClient, store: Store, devices: tuple[str, ...] = ("gpu0",)
) -> tuple[str, FakeWorker, dict[str, Any]]:
    """A job offered to box1 (instance "first") whose start was lost: (job, worker, offer)."""
    job_id = store.submit(["train"])
    w = FakeWorker(client, devices=devices)
    await register_with(w, {}, instance_id="first")
    [offer] = await w.poll([devices[0]])
    assert (offer["job_id"], offer["attempt"]) == (job_id, 1)
    assert store.job(job_id).state == "assigned"
    return job_id, w, offer


@pytest.mark.parametrize("instance", ["second", "first"], ids=["new process", "same process"])
async def test_a_claimed_offer_whose_start_was_lost_runs_on_as_started(
    client: httpx.AsyncClient, user: httpx.AsyncClient, store: Store, instance: str
) -> None:
    # The worker started attempt 1 on gpu0; its start never reached the controller (it
    # restarted before storing it). The registration's claim is that start: requeued and
    # then cancelled as stale, the running job would be killed and run a second time.
    job_id, w, offer = await offer_without_start(client, store)
    running = {"job_id": job_id, "attempt": 1, "started_at": 5.0}
    reply = await register_with(w, {"gpu0": claims(running=running)}, instance_id=instance)
    assert (reply["devices"]["gpu0"]["state"], reply["devices"]["gpu0"]["faults"]) == ("free", [])
    job = store.job(job_id)
    assert (job.state, job.attempt, job.host, job.device) == ("running", 1, "box1", "gpu0")
    assert [a.status for a in job.attempts] == ["running"]
    assert "adopted from the registration" in job.attempts[0].note
    assert store.device("box1", "gpu0").state == "busy"
    [adopted] = [e.data for e in store.events() if e.type == "job_adopted"]
    assert (adopted["job_id"], adopted["adopted_attempt"], adopted["via"]) == (
        job_id,
        1,
        "register",
    )
    r = await w.heartbeat({"gpu0": {"state": "running", "job_id": job_id, "attempt": 1}})
    assert r.json()["cancel"] == []
    # The device is not offered again, to this job or another.
    other = store.submit(["other"])
    assert await w.poll(["gpu0"]) == []
    assert store.job(other).state == "queued"
    # Its output and finish are the attempt's, as after any start.
    assert (await w.output(offer, 0, b"done")).json() == {"committed": 4}
    assert (await w.finish(offer, "succeeded", output_bytes=4)).status_code == 200
    job = store.job(job_id)
    assert (job.state, job.attempt, store.output(job_id)) == ("succeeded", 1, b"done")


async def test_a_heartbeat_running_the_offer_whose_start_was_lost_starts_it(
    client: httpx.AsyncClient, store: Store
) -> None:
    job_id, w, _offer = await offer_without_start(client, store)
    r = await w.heartbeat({"gpu0": {"state": "running", "job_id": job_id, "attempt": 1}})
    assert r.json()["cancel"] == []
    job = store.job(job_id)
    assert (job.state, job.attempt, job.device) == ("running", 1, "gpu0")
    [adopted] = [e.data for e in store.events() if e.type == "job_adopted"]
    assert adopted["via"] == "heartbeat"


async def test_a_claim_of_the_offered_attempt_on_another_device_is_stale(
    client: httpx.AsyncClient, store: Store
) -> None:
    # Attempt 1 was offered to gpu0; the new process says gpu1 runs it. Not the offer:
    # the offer is given back and the claim cancelled, as before.
    job_id, w, _offer = await offer_without_start(client, store, devices=("gpu0", "gpu1"))
    await register_with(
        w, {"gpu1": claims(running={"job_id": job_id, "attempt": 1})}, instance_id="second"
    )
    assert store.job(job_id).state == "queued"
    assert store.device("box1", "gpu1").state == "free"
    r = await w.heartbeat({"gpu1": {"state": "running", "job_id": job_id, "attempt": 1}})
    [order] = r.json()["cancel"]
    assert (order["job_id"], order["attempt"]) == (job_id, 1)
    assert not [e for e in store.events() if e.type == "job_adopted"]


async def test_an_offer_a_new_process_does_not_claim_is_offered_again(
    client: httpx.AsyncClient, store: Store
) -> None:
    # The protocol: offers the host had not started are offered again as a new attempt
    # when a new process registers; its late start is stale.
    job_id, w, offer = await offer_without_start(client, store)
    await register_with(w, {}, instance_id="second")
    assert store.job(job_id).state == "queued"
    r = await w.start(offer)
    assert (r.status_code, r.json()["error"]) == (409, "stale_attempt")
    [again] = await w.poll(["gpu0"])
    assert (again["job_id"], again["attempt"]) == (job_id, 2)


async def test_an_offer_the_same_process_holds_unstarted_stays_valid(
    client: httpx.AsyncClient, store: Store
) -> None:
    # The same live process registering again (after unknown_session) holds its offers:
    # its start, still to come, is accepted.
    job_id, w, offer = await offer_without_start(client, store)
    await register_with(w, {}, instance_id="first")
    r = await w.heartbeat({"gpu0": {"state": "acquiring", "job_id": job_id, "attempt": 1}})
    assert r.json()["cancel"] == []
    assert (await w.start(offer)).status_code == 200
    assert store.job(job_id).state == "running"


# -- the rule, as properties: of the pure decision, and of the store that applies it --------

HOSTS = ("box1", "box2")
DEVICES = ("gpu0", "gpu1")
LAST = {"assigned": "assigned", "running": "running", "requeued": "queued", "finished": "failed"}


@st.composite
def job_records(draw: st.DrawFn) -> Job:
    """A job as a store may hold it: earlier attempts requeued, the last in any status."""
    job = Job("j-1-t", 1, JobSpec(command=("x",)), parse_selector(""), submitted_at=0.0)
    n = draw(st.integers(0, 3))
    for number in range(1, n + 1):
        status = draw(st.sampled_from(list(LAST))) if number == n else "requeued"
        host, device = draw(st.sampled_from(HOSTS)), draw(st.sampled_from(DEVICES))
        job.attempts.append(Attempt(number, host, device, status, 0.0))
    job.state = LAST[job.attempts[-1].status] if job.attempts else "queued"
    return job


claims_of = st.tuples(st.sampled_from(HOSTS), st.sampled_from(DEVICES), st.integers(0, 5))


@given(job=job_records(), claim=claims_of, same_process=st.booleans())
def test_only_the_offer_itself_is_started(
    job: Job, claim: tuple[str, str, int], same_process: bool
) -> None:
    host, device, attempt = claim
    cur = job.current
    is_offer = (
        cur is not None
        and cur.status == "assigned"
        and (cur.number, cur.host, cur.device) == (attempt, host, device)
    )
    assert (judge_claim(job, host, device, attempt) == "offer") == is_offer
    fate = offer_fate(job, (device, attempt), host, same_process=same_process)
    assert (fate == "start") == is_offer
    if attempt > job.attempt and not job.terminal:
        assert fate == "keep"  # superseded by the newer attempt the claims adopt


@given(
    offers=st.integers(1, 3),
    offered_to=st.tuples(st.sampled_from(HOSTS), st.sampled_from(DEVICES)),
    started=st.booleans(),
    claim=st.tuples(st.sampled_from(HOSTS), st.sampled_from(DEVICES), st.integers(-1, 1)),
    new_process=st.booleans(),
)
def test_a_claim_matching_the_offer_runs_on_and_no_other_is_adopted(
    offers: int,
    offered_to: tuple[str, str],
    started: bool,
    claim: tuple[str, str, int],
    new_process: bool,
) -> None:
    # Any placement of the job's current attempt (offered `offers` times, the last to
    # `offered_to`, started or not), and a registration claiming an attempt near it.
    store = Store(instance="t")
    sessions = {h: register(store, h, DEVICES, instance="first") for h in HOSTS}
    job_id = store.submit(["train"])
    host_o, device_o = offered_to
    for _ in range(offers):  # each poll with the device ready again offers it anew
        a = assign(store, sessions[host_o], host_o, ready=[device_o])
    assert a.attempt == offers
    if started:
        start(store, sessions[host_o], a)
    host_c, device_c, delta = claim
    number = offers + delta
    assume(number >= 1)
    matches = not started and (host_c, device_c, number) == (host_o, device_o, offers)
    events_before = len(store.events())
    running = RunningClaim(job_id, number)
    session = store.register(
        host_c,
        RegisterRequest(
            boot_id="boot-1",
            devices=tuple(
                DeviceDecl(d, faults=(), running=running if d == device_c else None)
                for d in DEVICES
            ),
            instance_id="second" if new_process else "first",
            protocol=2,
        ),
        now=1.0,
    ).session
    report = {device_c: DeviceReport("running", job_id=job_id, attempt=number)}
    cancels = {(c.job_id, c.attempt) for c in heartbeat(store, session, host_c, 2.0, report).cancel}
    adopted = [e for e in store.events()[events_before:] if e.type == "job_adopted"]
    job = store.job(job_id)
    event("matching" if matches else f"delta {delta}")
    if matches:
        # The offer, claimed running: started there, never requeued nor cancelled.
        assert (job.state, job.attempt, job.host, job.device) == ("running", offers, *offered_to)
        assert [x.status for x in job.attempts] == ["requeued"] * (offers - 1) + ["running"]
        assert (job_id, number) not in cancels
        assert store.device(host_c, device_c).job_id == job_id
        assert len(adopted) == 1
    elif number <= offers and not (started and (host_c, device_c) == offered_to and delta == 0):
        # Not the offer, nor the attempt running there: never adopted, cancelled.
        assert adopted == []
        assert (job_id, number) in cancels
        placed = (job.state, job.host, job.device, job.attempt)
        assert placed != ("running", host_c, device_c, number)
    elif number > offers:
        # A newer attempt than any recorded: the worker's, adopted where it runs.
        assert (job.state, job.host, job.device, job.attempt) == (
            "running",
            host_c,
            device_c,
            number,
        )
        assert (job_id, number) not in cancels
