"""A deadline heap for the store's timers: host loss, recovery grace, unanswered offers.

Scanning every host and every live job on each request costs the controller
O(fleet) per heartbeat; a heap costs O(log n) per armed timer and O(1) to ask
whether anything is due. Entries are lazy: the store re-arms a timer only when
its deadline moves *earlier* (a host told a shorter interval); a deadline that
moves later (every heartbeat) is found when its stale entry comes due, and the
store re-arms it then with the real one (:meth:`Deadlines.due` returns keys,
the store decides). At most one live entry per key, so the heap stays as large
as the number of armed timers plus the stale entries not yet popped.
Sans-IO: plain data, no Trio.
"""

from __future__ import annotations

import heapq
import itertools

__all__ = ["Deadlines", "TimerKey"]

TimerKey = tuple[str, str]
"""``("host", name)`` or ``("job", job_id)``."""


class Deadlines:
    """Keys with a deadline each; the earliest first."""

    def __init__(self) -> None:
        self._heap: list[tuple[float, int, TimerKey]] = []
        self._at: dict[TimerKey, float] = {}
        self._seq = itertools.count()

    def __len__(self) -> int:
        return len(self._at)

    def arm(self, key: TimerKey, deadline: float) -> None:
        """Make sure ``key`` comes due no later than ``deadline``."""
        held = self._at.get(key)
        if held is not None and held <= deadline:
            return
        self._at[key] = deadline
        heapq.heappush(self._heap, (deadline, next(self._seq), key))

    def disarm(self, key: TimerKey) -> None:
        self._at.pop(key, None)  # its entry is skipped when it surfaces

    def earliest(self) -> float | None:
        """The first armed deadline (possibly earlier than the real one: entries are lazy)."""
        self._drop_stale()
        return self._heap[0][0] if self._heap else None

    def due(self, now: float) -> list[TimerKey]:
        """Pop and return every key due at ``now``, earliest first (disarmed as returned)."""
        out: list[TimerKey] = []
        while True:
            self._drop_stale()
            if not self._heap or self._heap[0][0] > now:
                return out
            _, _, key = heapq.heappop(self._heap)
            del self._at[key]
            out.append(key)

    def _drop_stale(self) -> None:
        heap = self._heap
        while heap and self._at.get(heap[0][2]) != heap[0][0]:
            heapq.heappop(heap)
