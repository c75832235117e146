"""A fault report the disk refused, held in memory, is written at a stop.

A device's fault raised while the disk is full is held in memory to send. If
the controller does not take it before the worker is stopped, the stop writes
it (the disk has room again): the next worker sends it, and the controller
quarantines the device. Lost instead, the next worker would not know the
device is quarantined, and would offer it.
"""

from __future__ import annotations

import trio

from rc_worker.testing import Fault
from rc_worker.testing.fleet import Fleet, simulate
from rc_worker.testing.plans import disk_fault


def _fault_while_full_then_stop() -> tuple[str, list[str]]:
    async def scenario(fleet: Fleet) -> tuple[str, list[str]]:
        node = fleet.nodes["h0"]
        await fleet.wait_until(
            lambda: any(d.name == "gpu0" and d.state == "free" for d in fleet.store.devices())
        )
        assert node.worker is not None
        fleet.outage("fault", Fault.UNAVAILABLE)
        repair = disk_fault(fleet, "h0", "full")
        fault_id = node.worker.devices["gpu0"].raise_fault("damaged_state", "a test fault")
        await trio.sleep(1.0)
        repair()  # room again before the stop
        await fleet.stop("h0", drain=False)
        fleet.restart("h0")
        fleet.restore("fault")
        await trio.sleep(30.0)  # the new worker registers and sends what is on disk
        device = fleet.store.device("h0", "gpu0")
        return device.state, [fault_id, *(f.fault_id for f in device.faults)]

    return simulate(scenario, hosts=1, devices=("gpu0",), seed=3)


def test_a_fault_held_in_memory_is_written_at_a_stop_and_sent_after() -> None:
    state, (raised, *known) = _fault_while_full_then_stop()
    assert state == "quarantined"
    assert raised in known
