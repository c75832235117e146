"""``simulate(..., seed=N)`` replays a run exactly (the architecture issue).

One seed and one scenario give one run: the controller's event log, every
job's output and the harness's log are the same between two runs. The
scenario below has what used to make runs diverge: retries with jitter
(outages), fault ids (a failing verify script), re-registrations (session
tokens) and a crash (a new worker process, new instance id).
"""

from __future__ import annotations

from typing import Any

import trio

from rc_worker.testing.fleet import Fault, Fleet, simulate
from rc_worker.testing.sim import Script

TRAIN = Script.printing((1, b"epoch 1\n"), (7, b"epoch 2\n"), (12, b"done\n"))


async def _busy_run(fleet: Fleet) -> dict[str, Any]:
    fleet.program("train", TRAIN)
    fleet.verify_script("check", Script.sleeping(0.5, exit_code=1))
    jobs = [fleet.submit(["train"]) for _ in range(4)]
    await trio.sleep(3)
    fleet.outage("output", Fault.UNAVAILABLE)
    fleet.inject("heartbeat", Fault.UNKNOWN_SESSION, Fault.TIMEOUT)
    await trio.sleep(20)
    await fleet.crash("h1")
    fleet.restore()
    await trio.sleep(5)
    fleet.restart("h1")
    await fleet.settle()
    await fleet.drain()
    events = [(e.seq, e.type, round(e.time, 6), sorted(e.data.items())) for e in fleet.events()]
    return {
        "events": events,
        "outputs": {j: fleet.store.output(j) for j in jobs},
        "log": fleet.log,
        "problems": fleet.check(),
    }


def test_the_same_seed_replays_the_same_run() -> None:
    first = simulate(_busy_run, seed=7, hosts=2, devices=("gpu0", "gpu1"))
    second = simulate(_busy_run, seed=7, hosts=2, devices=("gpu0", "gpu1"))
    assert first["problems"] == []
    assert any(t == "device_quarantined" for _, t, _, _ in first["events"])  # fault ids drawn
    assert first["events"] == second["events"]
    assert first["outputs"] == second["outputs"]
    assert first["log"] == second["log"]
