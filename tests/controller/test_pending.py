"""Why a queued job waits: the pure explain(), each cause, and the store keeping it current."""

from __future__ import annotations

import httpx
import pytest
from hypothesis import given
from hypothesis import strategies as st

from rc_worker.controller import Store
from rc_worker.controller.pending import Candidate, explain
from rc_worker.core.selectors import parse_selector

from .helpers import USER_TOKEN, FakeWorker, auth

H100 = {"product": "H100", "memory": "80G"}
A100 = {"product": "A100", "memory": "40G"}


def dev(address: str, labels: dict[str, str] | None = None, **kw: object) -> Candidate:
    return Candidate(address=address, labels=labels or {}, **kw)  # type: ignore[arg-type]


def test_no_device_at_all() -> None:
    why = explain(parse_selector(""), None, [])
    assert (why.code, why.reason) == ("no_match", "no device is registered")


def test_no_match_names_the_first_term_nothing_satisfies() -> None:
    devices = [dev("b/g0", H100), dev("b/g1", A100)]
    why = explain(parse_selector("memory>=40G,product=V100,zone=x"), None, devices)
    assert why.code == "no_match"
    assert why.reason == "no registered device satisfies 'product=V100'"


def test_no_match_when_terms_hold_only_on_different_devices() -> None:
    devices = [dev("b/g0", H100), dev("b/g1", A100)]
    why = explain(parse_selector("product=A100,memory>=80G"), None, devices)
    assert why.code == "no_match"
    assert why.reason == (
        "no registered device that satisfies 'product=A100' also satisfies 'memory>=80G'"
    )


def test_absent_devices_do_not_count_as_registered() -> None:
    why = explain(parse_selector("product=H100"), None, [dev("b/g0", H100, present=False)])
    assert why.code == "no_match"


@pytest.mark.parametrize(
    ("kw", "code", "words"),
    [
        ({"fault": "verify_failed: ECC errors"}, "device_quarantined", "ECC errors"),
        ({"idle_behavior": "hold"}, "device_held", "rc idle b/g0 run"),
        ({"idle_behavior": "drain"}, "device_draining", "draining"),
        ({"present": False}, "device_absent", "absent"),
        ({"host_lost": True}, "host_lost", "lost host"),
        ({"job_id": "j-9"}, "busy", "busy with j-9"),
    ],
)
def test_pinned_device_causes(kw: dict[str, object], code: str, words: str) -> None:
    why = explain(parse_selector(""), "b/g0", [dev("b/g0", H100, **kw), dev("b/g1", H100)])
    assert why.code == code
    assert why.reason.startswith("the pinned device b/g0 is ")
    assert words in why.reason


def test_pinned_device_unknown_or_not_matching() -> None:
    assert explain(parse_selector(""), "b/g7", [dev("b/g0")]).code == "device_absent"
    why = explain(parse_selector("product=A100"), "b/g0", [dev("b/g0", H100), dev("b/g1", A100)])
    assert why.code == "no_match"
    assert why.reason == "the pinned device b/g0 does not satisfy 'product=A100'"


def test_pinned_device_free_waits_for_its_worker() -> None:
    why = explain(parse_selector(""), "b/g0", [dev("b/g0", worker_state="verifying")])
    assert why.code == "waiting_for_worker"
    assert "b/g0 is free" in why.reason
    assert "(worker: verifying)" in why.reason
    idle = explain(parse_selector(""), "b/g0", [dev("b/g0", worker_state="free")])
    assert "worker:" not in idle.reason


def test_every_matching_device_busy() -> None:
    devices = [dev("b/g0", H100, job_id="j-1"), dev("b/g1", H100, job_id="j-2"), dev("b/g2", A100)]
    why = explain(parse_selector("product=H100"), None, devices)
    assert why.code == "busy"
    assert why.reason == "every matching device is busy: b/g0 (j-1), b/g1 (j-2)"


def test_a_mix_of_unavailable_devices_lists_each() -> None:
    devices = [
        dev("b/g0", H100, job_id="j-1"),
        dev("b/g1", H100, fault="dirty: processes left"),
        dev("c/g0", H100, host_lost=True),
        dev("c/g1", H100, idle_behavior="hold"),
    ]
    why = explain(parse_selector("product=H100"), None, devices)
    assert why.code == "unavailable"
    assert why.reason.startswith("no matching device is available: b/g0 busy with j-1, ")
    assert why.reason.endswith("and 1 more")


def test_all_matching_quarantined_has_that_code() -> None:
    devices = [dev("b/g0", H100, fault="dirty"), dev("b/g1", H100, fault="dirty")]
    assert explain(parse_selector(""), None, devices).code == "device_quarantined"


labels = st.dictionaries(st.sampled_from(["a", "b", "c"]), st.sampled_from(["1", "2"]), max_size=3)
candidates = st.builds(
    Candidate,
    address=st.sampled_from(["h/0", "h/1", "k/0"]),
    labels=labels,
    present=st.booleans(),
    host_lost=st.booleans(),
    fault=st.none() | st.just("dirty"),
    idle_behavior=st.sampled_from(["run", "hold", "drain"]),
    job_id=st.none() | st.just("j-1"),
)
selectors = st.lists(
    st.builds(
        lambda k, op, v: f"{k}{op}{v}",
        st.sampled_from("abc"),
        st.sampled_from(["=", "!="]),
        st.sampled_from("12"),
    ),
    max_size=3,
).map(",".join)


@given(selectors, st.lists(candidates, max_size=5))
def test_no_match_exactly_when_no_present_device_matches(
    text: str, devices: list[Candidate]
) -> None:
    selector = parse_selector(text)
    why = explain(selector, None, devices)
    can_match = any(d.present and selector.matches(d.labels) for d in devices)
    assert (why.code == "no_match") == (not can_match)
    free = any(
        d.present
        and selector.matches(d.labels)
        and not d.host_lost
        and d.fault is None
        and d.idle_behavior == "run"
        and d.job_id is None
        for d in devices
    )
    assert (why.code == "waiting_for_worker") == free
    assert "\n" not in why.reason


async def test_store_keeps_the_reason_current(client: httpx.AsyncClient, store: Store) -> None:
    job = store.submit(["x"], select="product=H100")
    assert store.job(job).pending_code == "no_match"
    assert store.job(job).pending_reason == "no device is registered"
    w = FakeWorker(client, labels={"host": {}, "devices": {"gpu0": {"product": "H100"}}})
    await w.register()
    assert store.job(job).pending_code == "waiting_for_worker"
    store.set_idle_behavior("box1", "gpu0", "hold")
    assert store.job(job).pending_code == "device_held"
    store.set_idle_behavior("box1", "gpu0", "run")
    [a] = await w.poll()
    assert store.job(job).pending_reason is None  # assigned: no longer waiting
    other = store.submit(["y"], device="box1/gpu0")
    assert store.job(other).pending_code == "busy"
    [listed] = [j for j in store.jobs("queued") if j.job_id == other]
    assert listed.pending_code == "busy"
    await w.start(a)
    await w.finish(a, "failed", exit_code=1, fault_id="f-1", reason="dirty")
    assert store.job(other).pending_code == "device_quarantined"
    assert store.job(a["job_id"]).to_json()["pending_reason"] is None


async def test_submit_answers_the_reason_and_strict_refuses(
    user: httpx.AsyncClient, store: Store
) -> None:
    r = await user.post("/v1/jobs", json={"command": ["x"], "select": "product=H100"})
    assert r.status_code == 200
    assert r.json()["pending_code"] == "no_match"
    job = r.json()["job_id"]
    assert (await user.get(f"/v1/jobs/{job}")).json()["pending_code"] == "no_match"
    listed = (await user.get("/v1/jobs", headers=auth(USER_TOKEN))).json()["jobs"]
    assert listed[0]["pending_reason"] == "no device is registered"
    r = await user.post("/v1/jobs", json={"command": ["x"], "strict": True})
    assert r.status_code == 409
    assert r.json()["error"] == "no_match"
    assert len(store.jobs()) == 1  # nothing was queued
