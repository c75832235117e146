"""The host watch at the controller: a poll with ``watch_cancels`` and ``known_control``
is answered at once by an idle behaviour change or a clear, and carries them."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import httpx
import trio

from rc_worker.controller import Store
from rc_worker.controller.messages import CancelOrder, PollReply
from rc_worker.controller.worker_api import _Watch

from .helpers import FakeWorker


async def _watch(w: FakeWorker, known_control: str | None, wait_s: float) -> dict[str, Any]:
    body: dict[str, Any] = {
        "session": w.session,
        "ready": [],
        "wait_s": wait_s,
        "watch_cancels": True,
    }
    if known_control is not None:
        body["known_control"] = known_control
    r = await w.post(f"/v1/hosts/{w.host}/poll", body)
    assert r.status_code == 200, r.text
    answer: dict[str, Any] = r.json()
    return answer


async def test_a_watch_knowing_nothing_is_answered_at_once_with_the_orders(
    client: httpx.AsyncClient, store: Store
) -> None:
    w = FakeWorker(client, devices=["gpu0", "gpu1"])
    with trio.fail_after(10):
        await w.register()
        store.set_idle_behavior(w.host, "gpu1", "hold")
        answer = await _watch(w, "", wait_s=60)
    assert answer["control"] == store.control_token(w.host)
    assert answer["idle_behavior"] == {"gpu0": "run", "gpu1": "hold"}
    assert "cleared" not in answer  # nothing cleared: left out
    assert answer["assignments"] == []
    assert answer["cancel"] == []


async def _answer_to_a_parked_watch(w: FakeWorker, change: Callable[[], object]) -> dict[str, Any]:
    """Park a watch that knows the host's token, make ``change``, and return the answer
    (the caller bounds the wait: a change that does not answer the watch times out)."""
    token = (await _watch(w, "", wait_s=60))["control"]
    answers: list[dict[str, Any]] = []

    async def parked() -> None:
        answers.append(await _watch(w, token, wait_s=60))

    async with trio.open_nursery() as nursery:
        nursery.start_soon(parked)
        await trio.sleep(0.2)  # parked by now, or answered below all the same
        change()
    [answer] = answers
    assert answer["control"] != token
    return answer


async def _fault(w: FakeWorker, fault_id: str) -> None:
    r = await w.post(
        f"/v1/hosts/{w.host}/devices/gpu0/fault",
        {"session": w.session, "fault_id": fault_id, "reason": "dirty"},
    )
    assert r.status_code == 200, r.text


async def test_an_idle_change_answers_a_parked_watch(
    client: httpx.AsyncClient, store: Store
) -> None:
    w = FakeWorker(client, devices=["gpu0"])
    with trio.fail_after(10):
        await w.register()
        answer = await _answer_to_a_parked_watch(
            w, lambda: store.set_idle_behavior(w.host, "gpu0", "drain")
        )
    assert answer["idle_behavior"] == {"gpu0": "drain"}


async def test_a_clear_answers_a_parked_watch_with_the_ids(
    client: httpx.AsyncClient, store: Store
) -> None:
    w = FakeWorker(client, devices=["gpu0"])
    with trio.fail_after(10):
        await w.register()
        await _fault(w, "f-1")
        answer = await _answer_to_a_parked_watch(w, lambda: store.clear(w.host, "gpu0"))
    assert answer["cleared"] == {"gpu0": ["f-1"]}


async def test_the_token_moves_only_with_idle_changes_and_clears(
    client: httpx.AsyncClient, store: Store
) -> None:
    w = FakeWorker(client, devices=["gpu0"])
    with trio.fail_after(10):
        await w.register()
        token = store.control_token(w.host)
        # Heartbeats, polls, jobs and labels are no news for the watch.
        assert (await w.heartbeat({"gpu0": {"state": "free"}})).status_code == 200
        store.submit(["true"])
        [a] = await w.poll(wait_s=0)
        assert (await w.start(a)).status_code == 200
        assert store.control_token(w.host) == token
        # Setting what is already set is no change either.
        store.set_idle_behavior(w.host, "gpu0", "run")
        assert store.control_token(w.host) == token
        store.set_host_idle_behavior(w.host, "hold")
        held = store.control_token(w.host)
        assert held != token
        store.set_host_idle_behavior(w.host, "run")
        assert store.control_token(w.host) not in (token, held)


async def test_a_poll_that_is_no_watch_carries_no_orders(
    client: httpx.AsyncClient, store: Store
) -> None:
    w = FakeWorker(client, devices=["gpu0"])
    with trio.fail_after(10):
        await w.register()
        r = await w.poll_raw(wait_s=0)
    assert r.json() == {"assignments": [], "cancel": []}


def test_a_restarted_controller_never_repeats_a_token() -> None:
    # A restart on a stored state keeps the store's instance (persist/codec.py): the
    # token must differ all the same, or a watch would miss the new process's changes.
    assert Store(instance="a").control_token("h") != Store(instance="a").control_token("h")


def test_what_is_news_for_a_watch() -> None:
    cancel = CancelOrder("j-1", 1, "stop")
    answer = PollReply(cancel=(cancel,), control="t.2")
    assert _Watch(set(), "t.2").news(answer)  # a cancel it does not know
    assert not _Watch({("j-1", 1)}, "t.2").news(answer)
    assert _Watch({("j-1", 1)}, "t.1").news(answer)  # a token it does not know
    assert _Watch({("j-1", 1)}, "").news(answer)
    # An older worker sends no token: answered at its wait, never at once again and again.
    assert not _Watch({("j-1", 1)}, None).news(answer)


async def test_a_heartbeat_that_no_longer_holds_a_fault_wakes_the_parked_poll(
    client: httpx.AsyncClient, store: Store
) -> None:
    """The device stays off while a heartbeat last reported the fault (issue 10: a worker's
    word is fact); the heartbeat that reports it gone must bring the waiting job at once,
    not at the parked poll's wait."""
    w = FakeWorker(client, devices=["gpu0"])
    got: list[list[dict[str, Any]]] = []
    with trio.fail_after(10):
        await w.register()
        await _fault(w, "f-1")
        await w.heartbeat({"gpu0": {"state": "quarantined", "faults": ["f-1"]}})
        store.clear(w.host, "gpu0")
        job_id = store.submit(["true"])
        assert await w.poll(["gpu0"], wait_s=0) == []  # the worker still holds f-1

        async def parked() -> None:
            got.append(await w.poll(["gpu0"], wait_s=3600))

        async with trio.open_nursery() as nursery:
            nursery.start_soon(parked)
            await trio.sleep(0.2)
            await w.heartbeat({"gpu0": {"state": "free", "faults": []}})
    [[a]] = got
    assert a["job_id"] == job_id


async def test_a_watch_without_a_token_is_answered_as_before(
    client: httpx.AsyncClient, store: Store
) -> None:
    """An older worker's watch: the answer it always had, and no early answer to spin on."""
    w = FakeWorker(client, devices=["gpu0"])
    with trio.fail_after(10):
        await w.register()
        store.set_idle_behavior(w.host, "gpu0", "hold")
        answer = await _watch(w, None, wait_s=0)
    assert answer == {"assignments": [], "cancel": []}
