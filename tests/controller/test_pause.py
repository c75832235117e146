"""A controller that was itself paused does not declare hosts lost for it (issue 12).

A real ``rc serve`` is stopped with SIGSTOP for twice its host-loss window
while a worker keeps heartbeating into its socket backlog; once resumed it
must read those heartbeats rather than declare the host lost.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
import trio

from rc_worker.controller.context import Controller, User
from rc_worker.controller.store import Store, StoreConfig

from .helpers import FakeWorker, auth, wait_listening

RC = str(Path(sys.executable).parent / "rc")


def test_credit_pause_moves_every_timer() -> None:
    store = Store(StoreConfig(heartbeat_interval_s=1.0, missed_heartbeats=3), instance="t")
    now = [100.0]
    ctl = Controller(
        store,
        worker_tokens={},
        user_tokens={"u": User("u")},
        clock=lambda: now[0],
        webhooks=(),
    )
    from rc_worker.controller.messages import DeviceDecl, RegisterRequest

    store.register("box1", RegisterRequest("b", (DeviceDecl("gpu0"),)), now=100.0)
    ctl.loop_seen = 100.0
    now[0] = 160.0  # a minute in which the loop did not run at all
    ctl.tick()
    assert store.device("box1", "gpu0").host_state == "up"
    # Without the loop watch running, the same silence is real host silence.
    ctl.loop_seen = None
    now[0] = 170.0
    ctl.tick()
    assert store.device("box1", "gpu0").host_state != "up"


class _DownStore:
    """Stands for a Durability whose writes fail (only ``failed`` is read by ``tick``)."""

    failed: str | None = "disk I/O error"


def test_a_store_outage_does_not_lose_hosts_that_could_not_be_heard() -> None:
    # While the store refuses writes every heartbeat is answered 503: the hosts are
    # silent through no fault of theirs, so the outage is credited like a pause.
    store = Store(StoreConfig(heartbeat_interval_s=1.0, missed_heartbeats=3), instance="t")
    now = [100.0]
    ctl = Controller(
        store, worker_tokens={}, user_tokens={"u": User("u")}, clock=lambda: now[0], webhooks=()
    )
    from rc_worker.controller.messages import DeviceDecl, RegisterRequest

    store.register("box1", RegisterRequest("b", (DeviceDecl("gpu0"),)), now=100.0)
    down = _DownStore()
    ctl.durability = down  # type: ignore[assignment]
    now[0] = 101.0  # housekeeping ticks all along: the first tick sees the store down
    ctl.tick()
    now[0] = 160.0
    ctl.tick()
    assert store.device("box1", "gpu0").host_state == "up"
    down.failed = None  # the store works again; the host is heard from now on
    now[0] = 161.0
    ctl.tick()
    assert store.device("box1", "gpu0").host_state == "up"
    now[0] = 165.0  # ordinary silence after the outage still counts
    ctl.tick()
    assert store.device("box1", "gpu0").host_state != "up"


@pytest.mark.skipif(not hasattr(signal, "SIGSTOP"), reason="needs SIGSTOP")
async def test_a_sigstopped_controller_does_not_lose_a_heartbeating_host() -> None:
    proc = await trio.lowlevel.open_process(
        [
            RC,
            "serve",
            "--listen",
            "127.0.0.1:0",
            "--user-token",
            "u=ops:admin",
            "--worker-token",
            "w",
            "--heartbeat-interval",
            "0.5s",
            "--memory",
        ],
        stderr=subprocess.PIPE,
    )
    try:
        with trio.fail_after(60):
            url = await wait_listening(proc)
            async with httpx.AsyncClient(base_url=url, timeout=30) as http:
                w = FakeWorker(http, token="w")
                await w.register()
                async with trio.open_nursery() as nursery:

                    async def beat() -> None:
                        while True:
                            r = await w.heartbeat({"gpu0": {"state": "free"}})
                            assert r.status_code == 200, r.text
                            await trio.sleep(0.2)

                    nursery.start_soon(beat)
                    await trio.sleep(1.0)
                    os.kill(proc.pid, signal.SIGSTOP)
                    await trio.sleep(3.0)  # twice the 1.5 s host-loss window
                    os.kill(proc.pid, signal.SIGCONT)
                    await trio.sleep(1.5)
                    nursery.cancel_scope.cancel()
                r = await http.get("/v1/events", headers=auth("u"))
                types = [e["type"] for e in r.json()["events"]]
                assert "host_lost" not in types
                [d] = (await http.get("/v1/devices", headers=auth("u"))).json()["devices"]
                assert d["host_state"] == "up"
    finally:
        if proc.returncode is None:
            os.kill(proc.pid, signal.SIGCONT)
            proc.terminate()
            with trio.move_on_after(10):
                await proc.wait()
            if proc.returncode is None:
                proc.kill()
                await proc.wait()
