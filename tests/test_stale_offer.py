"""A stale offer never costs a job (issue: `refused` for the device's state).

A device can stop being offerable after a poll that listed it was sent: a
quarantine raised by the worker, a hold, a release hook, a shutdown. An
assignment the controller makes in that window is answered `refused` with
`stale_offer`, requeued in its place and not counted against the job's
refusals; `rejected` stays for the assignment's own defects.
"""

from __future__ import annotations

from pathlib import Path

import trio
from faults import Fault, FaultyTransport

from rc_worker.controller.messages import FinishRequest
from rc_worker.controller.store import Store, StoreConfig
from rc_worker.testing import LocalSystem, local_system, make_config


async def _session(system: LocalSystem) -> str:
    await system.wait_until(lambda: system.worker.registered.is_set())
    session = system.worker._ctx.client.session if system.worker._ctx else None
    assert session is not None
    return session


async def test_an_assignment_for_a_device_that_became_unofferable_is_refused_and_requeued(
    tmp_path: Path,
) -> None:
    transports: list[FaultyTransport] = []

    def wrap(inner: object) -> FaultyTransport:
        t = FaultyTransport(inner)  # type: ignore[arg-type]
        # No real poll reaches the controller: the test plays the stale one.
        t.outage("poll", Fault.UNAVAILABLE)
        transports.append(t)
        return t

    config = make_config(tmp_path, devices=("gpu0", "gpu1"))
    with trio.fail_after(30):
        async with local_system(config, transport_wrapper=wrap) as system:
            [transport] = transports
            session = await _session(system)
            job = system.submit(["sh", "-c", "echo ran"], device="test-host/gpu0")
            offers = system.store.open_poll("test-host", ["gpu0"])
            now = trio.current_time()
            [stale] = system.store.poll("test-host", session, ["gpu0"], now=now, offers=offers)
            # The device stops being offerable before the answer arrives.
            fault_id = system.worker.devices["gpu0"].raise_fault("dirty", "a health check failed")
            system.worker._dispatch(stale.to_json())
            await system.wait_until(lambda: system.job(job).state == "queued")
            info = system.job(job)
            assert info.attempts[0].note.startswith("refused (stale offer)"), info.attempts
            assert "gpu0 is quarantined" in info.attempts[0].note
            assert system.store._jobs[job].refusals == 0
            # It runs once the device is free again.
            await system.wait_until(
                lambda: fault_id in {f.fault_id for f in system.device("gpu0").faults}
            )
            system.store.clear("test-host", "gpu0")
            transport.restore("poll")
            info = await system.wait_job(job)
            assert info.state == "succeeded"
            assert system.output(job) == b"ran\n"


async def test_a_device_quarantined_while_its_poll_is_parked_costs_no_job(
    tmp_path: Path,
) -> None:
    # End to end: the worker ends its parked poll when a listed device stops
    # being offerable; a job submitted at that moment waits, then runs on the
    # other device that matches.
    config = make_config(tmp_path, devices=("gpu0", "gpu1"))
    with trio.fail_after(30):
        async with local_system(config) as system:
            await _session(system)
            # Both devices listed in a parked poll.
            await system.wait_until(lambda: system.store.stats.polls_parked == 1)
            system.worker.devices["gpu0"].raise_fault("dirty", "a health check failed")
            jobs = [system.submit(["true"]) for _ in range(4)]
            for job in jobs:
                info = await system.wait_job(job)
                assert info.state == "succeeded", info
                assert info.device == "gpu1"


def _stale_refusal(store: Store, session: str, job: str, attempt: int) -> None:
    store.finish(
        job,
        FinishRequest(
            session, attempt, "gpu0", "refused", reason="stale offer: x", stale_offer=True
        ),
        now=0,
    )


def test_a_stale_refusal_requeues_without_a_mark_and_a_plain_one_counts() -> None:
    from controller.storekit import assign, register

    store = Store(StoreConfig(max_refusals=2), instance="t")
    session = register(store)
    job = store.submit(["x"])
    for _ in range(5):
        a = assign(store, session)
        _stale_refusal(store, session, job, a.attempt)
        assert store.job(job).state == "queued"
    assert store._jobs[job].refusals == 0
    for _ in range(2):
        a = assign(store, session)
        store.finish(
            job, FinishRequest(session, a.attempt, "gpu0", "refused", reason="hook"), now=0
        )
    assert store.job(job).state == "error"
    assert store.job(job).reason == "refused 2 times"


def test_a_superseded_poll_is_handed_nothing() -> None:
    from controller.storekit import register

    store = Store(instance="t")
    session = register(store)
    store.submit(["x"])
    old = store.open_poll("box1", ["gpu0"])
    new = store.open_poll("box1", ["gpu0"])
    assert store.poll("box1", session, ["gpu0"], now=0, offers=old) == []
    [a] = store.poll("box1", session, ["gpu0"], now=0, offers=new)
    assert a.device == "gpu0"
