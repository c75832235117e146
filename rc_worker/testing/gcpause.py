"""Python's cyclic garbage collector, paused while a simulation runs.

A fleet simulation is a burst of allocations, most of them freed by reference counting.
Left on, the collector runs a young collection every 700 allocations, and, as what a
run keeps alive piles up in the oldest generation, a full one that walks every object
of the process (what the imports and hypothesis hold: 85,000 objects, more under
pytest): about a tenth of a fault plan's time (docs/performance.md). Paused for the
run, the cycles a run leaves are collected by the next young collection after it, and
almost nothing of a run reaches the oldest generation.

A run that allocates for long (a long virtual time) does not grow without bound: past
:data:`YOUNG_LIMIT` objects the young generations are collected, as the collector
would have done.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager

__all__ = ["YOUNG_LIMIT", "collector_paused", "keep_bounded"]

YOUNG_LIMIT = 200_000
"""Objects allocated (and not yet freed) during a run past which its young generations
are collected."""


@contextmanager
def collector_paused() -> Iterator[None]:
    """Pause the collector (if it runs) for the block; call :func:`keep_bounded` now and
    then inside it."""
    if not gc.isenabled():
        yield  # paused by the caller: theirs to manage
        return
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def keep_bounded() -> None:
    """Collect the young generations once they hold :data:`YOUNG_LIMIT` objects (never,
    while the collector runs: it collects them far sooner)."""
    if gc.get_count()[0] > YOUNG_LIMIT:
        gc.collect(1)
