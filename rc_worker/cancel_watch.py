"""The cancel watch: a long poll kept open while jobs are held, answered early by a cancel.

The heartbeat carries cancels too, but only every heartbeat interval (10 s by
default); the watch (``watch_cancels`` on a poll with an empty ``ready``, see
docs/protocol.md) brings one to the job within a round trip of the user's
request. ``known_cancels`` lists what the worker already has, so a cancel it
acted on does not make the controller answer again at once while the job
winds down.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import trio

from rc_worker.client import ControllerClient
from rc_worker.core.errors import ControllerError
from rc_worker.core.protocol import CancelOrder

log = logging.getLogger("rc_worker.cancel_watch")

JobRef = tuple[str, int]


async def watch_cancels(
    client: ControllerClient,
    *,
    held: Callable[[], set[JobRef]],
    apply: Callable[[CancelOrder], None],
    changed: Callable[[], trio.Event],
    wait_s: Callable[[], float],
    pause_s: Callable[[], float],
) -> None:
    """Run until cancelled.

    ``held``: the attempts the devices hold now; ``apply``: hand a cancel to
    them; ``changed``: the event set at the next change of the devices (a job
    taken, say); ``wait_s``: the long poll's wait; ``pause_s``: how long to
    wait after the controller refused the watch for good.
    """
    known: set[JobRef] = set()
    while True:
        wake = changed()
        holding = held()
        known &= holding
        if not holding:
            await wake.wait()
            continue
        try:
            cancels = await client.watch_cancels(sorted(known), wait_s())
        except ControllerError as e:
            log.error("cancel watch refused: %s; retrying after the heartbeat interval", e)
            await trio.sleep(pause_s())
            continue
        for cancel in cancels:
            known.add((cancel.job_id, cancel.attempt))
            apply(cancel)
