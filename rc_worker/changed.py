"""``Changed``: "something changed, look again", for any number of waiters.

A ``trio.Event`` can be set only once. The pattern this replaces was written
out by hand in several places: set the event to wake every task waiting now,
then put a fresh one in its place so the next wait blocks until the next
change. Getting it wrong loses wake-ups (a waiter that checked its condition,
then took the *new* event, sleeps through the change that just happened) or
spins (a waiter that keeps seeing an old, already-set event).

The rule for a waiter that checks a condition first: take :meth:`watch`
BEFORE looking, then wait on what it returned. A change between the look and
the wait has then already set that event, so the wait returns at once.
"""

from __future__ import annotations

import trio


class Changed:
    """A set-and-replace event: :meth:`notify` wakes every current waiter, once."""

    __slots__ = ("_event",)

    def __init__(self) -> None:
        self._event = trio.Event()

    def notify(self) -> None:
        """Wake every task waiting now; a wait that starts after this blocks again."""
        self._event.set()
        self._event = trio.Event()

    def watch(self) -> trio.Event:
        """The event the next :meth:`notify` sets: take it before checking, wait after."""
        return self._event

    async def wait(self) -> None:
        """Block until the next :meth:`notify` (a checkpoint even when it never blocks)."""
        await self._event.wait()
