"""``Changed``: every waiter of the moment wakes, none wakes on a stale change, none is lost."""

from __future__ import annotations

import trio
import trio.testing

from rc_worker.changed import Changed


async def test_notify_wakes_every_task_already_waiting(
    autojump_clock: trio.testing.MockClock,
) -> None:
    changed = Changed()
    woke: list[int] = []

    async def waiter(i: int) -> None:
        await changed.wait()
        woke.append(i)

    async with trio.open_nursery() as nursery:
        for i in range(3):
            nursery.start_soon(waiter, i)
        await trio.testing.wait_all_tasks_blocked()
        assert woke == []
        changed.notify()
    assert sorted(woke) == [0, 1, 2]


async def test_a_wait_that_starts_after_a_notify_waits_for_the_next(
    autojump_clock: trio.testing.MockClock,
) -> None:
    changed = Changed()
    changed.notify()  # nobody waiting: nothing stays set for later waiters
    with trio.move_on_after(10) as scope:
        await changed.wait()
    assert scope.cancelled_caught

    woke = False

    async def waiter() -> None:
        nonlocal woke
        await changed.wait()
        woke = True

    async with trio.open_nursery() as nursery:
        nursery.start_soon(waiter)
        await trio.testing.wait_all_tasks_blocked()
        changed.notify()
    assert woke
    # The wake-up was used up: the next wait blocks again.
    with trio.move_on_after(10) as scope:
        await changed.wait()
    assert scope.cancelled_caught


async def test_a_watch_taken_before_looking_loses_no_wake_up(
    autojump_clock: trio.testing.MockClock,
) -> None:
    changed = Changed()
    watched = changed.watch()
    # The change lands between the look and the wait ...
    changed.notify()
    # ... and the wait on what was watched returns at once.
    with trio.fail_after(1):
        await watched.wait()
    # A watch taken after the change waits for the next one.
    later = changed.watch()
    assert not later.is_set()
    with trio.move_on_after(10) as scope:
        await later.wait()
    assert scope.cancelled_caught
    changed.notify()
    assert later.is_set()
