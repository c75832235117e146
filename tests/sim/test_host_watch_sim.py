"""The host watch in virtual time: open while a device waits for the controller, quiet
while nothing changes, and a clear that arrives through it frees the device at once."""

from __future__ import annotations

import trio

from rc_worker.testing.fleet import Fault, Fleet, simulate
from rc_worker.testing.sim import Script

from .watches import WatchCount


def test_a_quarantined_device_keeps_a_quiet_watch_and_a_clear_frees_it() -> None:
    async def main(fleet: Fleet) -> None:
        watches = WatchCount(fleet, "h0")
        fleet.program("short", Script.printing((1, b"a\n")))
        # Quarantined by its worker once it is up (False until then).
        await fleet.wait_until(lambda: fleet.quarantine("h0", "gpu0"))
        await fleet.wait_until(lambda: fleet.store.device("h0", "gpu0").state == "quarantined")
        watches.n = 0
        await trio.sleep(300)
        # Answered at its wait (poll_wait) or at a change: a handful, never a loop.
        assert 0 < watches.n < 30
        job_id = fleet.submit(["short"])
        fleet.store.clear("h0", "gpu0")
        started = trio.current_time()
        await fleet.wait_until(lambda: fleet.store.job(job_id).terminal, interval=0.01)
        assert fleet.store.job(job_id).state == "succeeded"
        # Well within a heartbeat: the watch brought the clear (the job itself takes 1 s).
        assert trio.current_time() - started < fleet_heartbeat(fleet) / 2
        await fleet.settle()
        await fleet.drain()
        assert fleet.check() == []

    simulate(main, seed=3, hosts=1, devices=("gpu0",), heartbeat_interval=60.0)


def fleet_heartbeat(fleet: Fleet) -> float:
    return fleet.store.config.heartbeat_interval_s


def test_a_watch_that_meets_unknown_session_backs_off_and_goes_on() -> None:
    """Regression (found by the fleet fault plans): the worker registers again from inside
    the watch's own request when the controller says its session is unknown, and the
    registration dropped the watch in flight, and with it the client's memory that it had
    just registered (which makes the next refusal back off): registrations and refusals at
    one instant, again and again."""

    async def main(fleet: Fleet) -> None:
        watches = WatchCount(fleet, "h0")
        fleet.program("short", Script.printing((1, b"a\n")))
        await fleet.wait_until(lambda: fleet.quarantine("h0", "gpu0"))  # a watch stays open
        await fleet.wait_until(lambda: fleet.store.device("h0", "gpu0").state == "quarantined")
        watches.n = 0
        fleet.outage("poll", Fault.UNKNOWN_SESSION, hosts=["h0"])
        await trio.sleep(15)
        fleet.restore("poll")
        assert watches.n < 100  # backing off between tries: never thousands
        await trio.sleep(60)
        fleet.store.clear("h0", "gpu0")
        job_id = fleet.submit(["short"])
        await fleet.wait_until(lambda: fleet.store.job(job_id).terminal)
        assert fleet.store.job(job_id).state == "succeeded"
        await fleet.settle()
        await fleet.drain()
        assert fleet.check() == []

    simulate(main, seed=5, hosts=1, devices=("gpu0",), heartbeat_interval=10.0)
