"""The controller's keep-alive timer for hypercorn connections (``serve._KeepAliveTimer``):
one task per connection whose deadline moves, closing exactly as hypercorn's timer did."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import trio
import trio.testing

from rc_worker.controller.serve import _KeepAliveTimer

TIMEOUT = 75.0


class FakeServer:
    """What the timer uses of hypercorn's TCPServer: the config, the worker context's
    ``terminated`` event, and the close it starts when the timer fires."""

    def __init__(self) -> None:
        self.config = SimpleNamespace(keep_alive_timeout=TIMEOUT)
        self.terminated = trio.Event()
        self.context = SimpleNamespace(terminated=self.terminated)
        self.closed = 0

    async def _initiate_server_close(self) -> None:
        self.closed += 1


class CountingGroup:
    """hypercorn's TaskGroup as the timer sees it (``spawn``), counting tasks spawned."""

    def __init__(self, nursery: trio.Nursery) -> None:
        self.spawned = 0
        self._nursery = nursery

    def spawn(self, fn: Any, *args: Any) -> None:
        self.spawned += 1
        self._nursery.start_soon(fn, *args)


def timer_for(server: FakeServer) -> _KeepAliveTimer:
    return _KeepAliveTimer(server)  # type: ignore[arg-type]


async def test_requests_move_one_deadline_and_an_idle_connection_is_closed_after_it(
    autojump_clock: trio.testing.MockClock,
) -> None:
    server = FakeServer()
    async with trio.open_nursery() as nursery:
        group = CountingGroup(nursery)
        timer = timer_for(server)
        await timer.restart(group, None)  # the connection opens idle
        for _ in range(5):  # five requests, each well inside the timeout
            await trio.sleep(TIMEOUT - 1)
            await timer.stop()  # a request begins: no timeout while it runs...
            await trio.sleep(3 * TIMEOUT)  # ...however long it takes (a long poll)
            assert server.closed == 0
            await timer.restart(group, None)  # the response is out: idle again
        assert group.spawned == 1  # one task for the connection's whole life
        await trio.sleep(TIMEOUT - 1)
        assert server.closed == 0
        await trio.sleep(2)
        assert server.closed == 1  # idle for the whole timeout: closed, once


async def test_a_finished_connection_ends_the_timer_without_closing_or_rearming(
    autojump_clock: trio.testing.MockClock,
) -> None:
    server = FakeServer()
    with trio.fail_after(1):  # the nursery exits: the timer's task ended by itself
        async with trio.open_nursery() as nursery:
            group = CountingGroup(nursery)
            timer = timer_for(server)
            await timer.restart(group, None)
            await timer.stop()
            timer.finish()  # the peer is gone
            await timer.restart(group, None)  # a response that ends after that
    assert server.closed == 0
    assert group.spawned == 1


async def test_server_shutdown_closes_an_idle_connection_at_once(
    autojump_clock: trio.testing.MockClock,
) -> None:
    server = FakeServer()
    async with trio.open_nursery() as nursery:
        timer = timer_for(server)
        await timer.restart(CountingGroup(nursery), None)
        await trio.sleep(1)
        server.terminated.set()
        await trio.sleep(0.001)
        assert server.closed == 1


async def test_the_timer_runs_in_hypercorns_own_task_group(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Through the TaskGroup hypercorn gives a connection (``spawn``), not a stand-in: a
    hypercorn release that changed it fails here, not in production."""
    from hypercorn.trio.task_group import TaskGroup

    server = FakeServer()
    async with TaskGroup() as group:
        timer = timer_for(server)
        await timer.restart(group, None)
        await trio.sleep(TIMEOUT + 1)
        assert server.closed == 1
