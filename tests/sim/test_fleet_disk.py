"""Disk faults injected into a simulated fleet: the worker handles them as
``tests/test_disk_full.py`` shows the real one does on a real full disk (which needs
root and a tmpfs there; here it is one attribute of the host's ``SimDisk``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import trio
from hypothesis import HealthCheck, given, note, settings
from hypothesis import strategies as st

from rc_worker.controller.messages import TERMINAL_STATES
from rc_worker.spool import DISK_ERROR_MARKER
from rc_worker.testing.fleet import Fleet, simulate
from rc_worker.testing.sim import Script, Write


def _faults(fleet: Fleet, device: str = "gpu0") -> list[str]:
    return [f.kind for f in fleet.store.device("h0", device).faults]


async def _journalled(fleet: Fleet, host: str) -> None:
    """Until a job is journalled there (so spawned): its directory is on the disk."""
    node = fleet.nodes[host]
    root = Path(node.config.state_dir) / "jobs"
    disk = node.host.disk
    await fleet.wait_until(lambda: disk.is_dir(root) and bool(disk.listdir(root)), interval=0.1)


def test_a_job_the_disk_cannot_journal_is_an_error_not_a_quarantine() -> None:
    async def scenario(fleet: Fleet) -> dict[str, Any]:
        fleet.program("echo", Script.printing((0, b"hello\n")))
        await trio.sleep(2)
        disk = fleet.nodes["h0"].host.disk
        disk.fill()
        refused = fleet.submit(["echo"])
        await fleet.wait_until(lambda: fleet.store.job(refused).state in TERMINAL_STATES)
        info = fleet.store.job(refused)
        faults = _faults(fleet)
        disk.capacity = None  # room again
        ok = fleet.submit(["echo"])
        await fleet.settle()
        await fleet.drain()
        return {
            "refused": (info.state, info.error, fleet.store.output(refused)),
            "faults": faults,
            "ok": (fleet.store.job(ok).state, fleet.store.output(ok)),
            "problems": fleet.check(),
        }

    found = simulate(scenario, hosts=1, devices=("gpu0",), seed=1)
    state, error, output = found["refused"]
    assert state == "error"
    assert "state_dir refused it" in (error or "")
    assert output == b""
    assert found["faults"] == []  # nothing ran, so nothing is quarantined
    assert found["ok"] == ("succeeded", b"hello\n")
    assert found["problems"] == []


def test_a_job_that_fills_the_disk_costs_only_its_output() -> None:
    flood = Script((Write(b"x" * 1000, repeat=400), Write(b"end\n", stderr=True)), exit_code=3)

    async def scenario(fleet: Fleet) -> dict[str, Any]:
        fleet.program("flood", flood)
        fleet.program("echo", Script.printing((0, b"still here\n")))
        await trio.sleep(2)
        disk = fleet.nodes["h0"].host.disk
        disk.capacity = disk.used() + 100_000  # room for a quarter of what it writes
        job = fleet.submit(["flood"])
        await fleet.wait_until(lambda: fleet.store.job(job).state in TERMINAL_STATES)
        disk.capacity = None
        after = fleet.submit(["echo"])
        await fleet.settle()
        await fleet.drain()
        return {
            "flood": (fleet.store.job(job).state, fleet.store.job(job).exit_code),
            "output": fleet.store.output(job),
            "after": (fleet.store.job(after).state, fleet.store.output(after)),
            "faults": _faults(fleet),
            "problems": fleet.check(),
        }

    found = simulate(scenario, hosts=1, devices=("gpu0",), seed=2)
    assert found["flood"] == ("failed", 3)  # its own exit status, not an error of the worker
    marker = DISK_ERROR_MARKER.split("{why}")[0].encode()
    assert marker + b"ENOSPC" in found["output"]
    assert found["output"].endswith(b"]\n")
    assert len(found["output"]) < 110_000
    assert found["after"] == ("succeeded", b"still here\n")
    assert found["faults"] == []
    # check() holds the committed output to what the job wrote; a full disk is the one
    # exception it must name, and nothing else.
    assert all("output" in p for p in found["problems"]), found["problems"]


def test_recovery_on_a_full_disk_starts_and_quarantines() -> None:
    async def scenario(fleet: Fleet) -> dict[str, Any]:
        fleet.program("train", Script.sleeping(1000))
        job = fleet.submit(["train"])
        disk = fleet.nodes["h0"].host.disk
        await _journalled(fleet, "h0")
        await fleet.crash("h0")
        disk.fill()  # the next start cannot write the lost finish it owes
        fleet.restart("h0")
        await fleet.wait_until(lambda: "damaged_state" in _faults(fleet))
        await fleet.wait_until(lambda: fleet.store.job(job).state in TERMINAL_STATES)
        info = fleet.store.job(job)
        return {"faults": _faults(fleet), "job": info.state}

    found = simulate(scenario, hosts=1, devices=("gpu0",), seed=3)
    assert "damaged_state" in found["faults"]
    # Its lost finish could not be written: it is sent from memory all the same.
    assert found["job"] == "lost"


def test_a_power_loss_keeps_every_promise_made_to_the_controller() -> None:
    """After a power loss (torn writes included), the worker recovers from what was
    durable: every job ends once, output committed stays what the job wrote."""

    async def scenario(fleet: Fleet) -> dict[str, Any]:
        fleet.program("train", Script.printing((1, b"epoch 1\n"), (30, b"epoch 2\n")))
        jobs = [fleet.submit(["train"]) for _ in range(4)]
        node = fleet.nodes["h0"]
        node.host.disk.torn_writes = True
        await trio.sleep(10)
        await fleet.crash("h0")
        node.host.power_loss()
        fleet.restart("h0")
        await fleet.settle()
        await fleet.drain()
        return {
            "states": sorted(fleet.store.job(j).state for j in jobs),
            "problems": fleet.check(),
        }

    found = simulate(scenario, hosts=1, devices=("gpu0", "gpu1"), seed=4)
    assert found["problems"] == []
    assert found["states"].count("lost") == 2  # the two running at the power loss
    assert found["states"].count("succeeded") == 2


def test_a_vanished_job_directory_costs_that_job_only() -> None:
    async def scenario(fleet: Fleet) -> dict[str, Any]:
        fleet.program("train", Script.printing((1, b"epoch 1\n"), (5, b"done\n")))
        fleet.program("echo", Script.printing((0, b"hi\n")))
        job = fleet.submit(["train"])
        node = fleet.nodes["h0"]
        root = Path(node.config.state_dir) / "jobs"
        await _journalled(fleet, "h0")
        [key] = node.host.disk.listdir(root)
        node.host.disk.vanish(root / key)
        await fleet.wait_until(lambda: fleet.store.job(job).state in TERMINAL_STATES)
        after = fleet.submit(["echo"])
        await fleet.settle()
        await fleet.drain()
        return {
            "job": fleet.store.job(job).state,
            "output": fleet.store.output(job),
            "after": (fleet.store.job(after).state, fleet.store.output(after)),
        }

    found = simulate(scenario, hosts=1, devices=("gpu0",), seed=5)
    # Its process ran on: its finish, which the disk no longer took, is sent from memory.
    assert found["job"] == "succeeded"
    # What it wrote before its directory vanished at most: the rest could not be read back.
    assert b"epoch 1\ndone\n".startswith(found["output"])
    assert found["after"] == ("succeeded", b"hi\n")


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    at=st.floats(0.5, 80, allow_nan=False).map(lambda t: round(t, 1)),
    torn=st.booleans(),
    down_for=st.sampled_from([0.0, 5.0, 60.0]),
    seed=st.integers(0, 2**16),
)
def test_a_power_loss_at_any_moment_keeps_the_invariants(
    at: float, torn: bool, down_for: float, seed: int
) -> None:
    async def scenario(fleet: Fleet) -> list[str]:
        fleet.program("train", Script.printing((3, b"a\n"), (20, b"b\n"), (40, b"c\n")))
        fleet.program("quick", Script.printing((0, b"q\n")))
        for _ in range(3):
            fleet.submit(["train"])
            fleet.submit(["quick"])
        node = fleet.nodes["h0"]
        node.host.disk.torn_writes = torn
        await trio.sleep(at)
        await fleet.crash("h0")
        node.host.power_loss()
        await trio.sleep(down_for)
        fleet.restart("h0")
        await fleet.settle()
        await fleet.drain()
        note("\n".join(f"{t:8.2f} {line}" for t, line in fleet.log))
        return fleet.check()

    assert simulate(scenario, hosts=1, devices=("gpu0", "gpu1"), seed=seed) == []
