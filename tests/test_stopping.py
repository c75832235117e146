"""Stopping a real worker: with the controller down, and the deregister after a drain."""

from __future__ import annotations

import signal
from pathlib import Path

import trio
from workerproc import (
    TOKEN,
    Outage,
    free_port,
    no_traceback,
    serve_controller,
    wait_store,
    worker_process,
    write_config,
)

from rc_worker.controller.store import Store, StoreConfig


async def test_two_sigterms_stop_with_the_controller_down_and_the_report_goes_out_later(
    tmp_path: Path,
) -> None:
    # A long heartbeat interval: the controller must not declare the host lost
    # during the outage, so the finish the worker kept is still wanted after it.
    store = Store(StoreConfig(heartbeat_interval_s=20.0, poll_wait_s=2.0))
    controller = Outage(store, {TOKEN: "op-host"}, free_port())
    config = write_config(tmp_path, controller.url)
    with trio.fail_after(90):
        async with trio.open_nursery() as nursery:
            await controller.up(nursery)
            async with worker_process(config) as w:
                await wait_store(store, lambda: any(d.host == "op-host" for d in store.devices()))
                job_id = store.submit(["sh", "-c", "echo a; exec sleep 60"], grace_s=1)
                await wait_store(store, lambda: store.output(job_id) == b"a\n")
                await controller.down()
                w.proc.send_signal(signal.SIGTERM)
                await w.wait_for_line(lambda line: "draining" in line)
                assert w.proc.returncode is None  # draining: the job keeps running
                w.proc.send_signal(signal.SIGTERM)
                # Bounded by fail_after: the grace ceiling (1 s) and a few seconds.
                assert await w.wait() == 0
                assert "delivered after the next start" in w.stderr.decode()
                no_traceback(w.stderr.decode())
            assert store.job(job_id).state == "running"  # the controller has not heard yet
            finish = list((tmp_path / "state" / "jobs").glob("*/finish.json"))
            assert len(finish) == 1
            # The controller comes back, and so does the worker: the report goes out.
            await controller.up(nursery)
            async with worker_process(config) as w2:
                await wait_store(store, lambda: store.job(job_id).state != "running")
                w2.proc.send_signal(signal.SIGTERM)
                assert await w2.wait() == 0
            nursery.cancel_scope.cancel()
    info = store.job(job_id)
    assert info.state == "killed"
    assert "shutting down" in (info.reason or "")
    assert not list((tmp_path / "state" / "jobs").glob("*/finish.json"))


async def test_one_sigterm_with_the_controller_down_is_bounded_by_shutdown_grace(
    tmp_path: Path,
) -> None:
    store = Store(StoreConfig(heartbeat_interval_s=20.0, poll_wait_s=2.0))
    controller = Outage(store, {TOKEN: "op-host"}, free_port())
    config = write_config(tmp_path, controller.url, extra="shutdown_grace: 1s\n")
    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            await controller.up(nursery)
            async with worker_process(config) as w:
                await wait_store(store, lambda: any(d.host == "op-host" for d in store.devices()))
                job_id = store.submit(["sh", "-c", "echo a; exec sleep 60"], grace_s=1)
                await wait_store(store, lambda: store.output(job_id) == b"a\n")
                await controller.down()
                w.proc.send_signal(signal.SIGTERM)
                # One signal: the drain gives up on the job after shutdown_grace,
                # stops it, and exits without the controller.
                assert await w.wait() == 0
                text = w.stderr.decode()
            nursery.cancel_scope.cancel()
    assert "drain still running after shutdown_grace (1s); stopping jobs" in text
    assert "delivered after the next start" in text
    no_traceback(text)
    assert len(list((tmp_path / "state" / "jobs").glob("*/finish.json"))) == 1


async def test_a_drained_worker_deregisters_and_its_devices_are_not_quarantined(
    tmp_path: Path,
) -> None:
    store = Store(StoreConfig(heartbeat_interval_s=0.5, poll_wait_s=2.0))
    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            url = await serve_controller(nursery, store, {TOKEN: "op-host"})
            config = write_config(tmp_path, url)
            async with worker_process(config) as w:
                await wait_store(store, lambda: any(d.host == "op-host" for d in store.devices()))
                job_id = store.submit(["echo", "done"])
                await wait_store(store, lambda: store.job(job_id).state == "succeeded")
                w.proc.send_signal(signal.SIGTERM)
                assert await w.wait() == 0
            # Long past the moment a silent host would be declared lost.
            store.tick(store.config.lost_after_s * 10 + 1e6)
            nursery.cancel_scope.cancel()
    [device] = [d for d in store.devices() if d.host == "op-host"]
    # Not quarantined: absent (the pool's word, issue 14, for a free device whose worker
    # left: nothing runs there until it registers again).
    assert device.state == "absent"
    assert device.faults == ()
    assert device.host_state == "left"
    assert not [e for e in store.events(0) if e.type == "host_lost"]
    assert [e.data["host"] for e in store.events(0) if e.type == "host_left"] == ["op-host"]
