"""The host watch: a long poll kept open while jobs are held or a device waits for the
controller, answered early by a cancel, a clear or an idle behaviour change.

The heartbeat carries cancels too, but only every heartbeat interval (10 s by
default); the watch (``watch_cancels`` on a poll with an empty ``ready``, see
docs/protocol.md) brings one to the job within a round trip of the user's
request. ``known_cancels`` lists what the worker already has (every cancel the
last answer carried), so a cancel it acted on does not make the controller
answer again at once while the job winds down. ``known_control`` does the same
for idle behaviours and clears: the token of the last answer's.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator

import trio

from rc_worker.client import ControllerClient
from rc_worker.core.errors import ControllerError
from rc_worker.core.protocol import CancelOrder, PollReply

log = logging.getLogger("rc_worker.cancel_watch")

JobRef = tuple[str, int]


class Orders:
    """The token (``control``) of the idle behaviours and clears the watch last applied.

    A heartbeat's answer may be older than a watch's (computed before an operator's
    change, delivered after the watch brought it): applied, it puts the old state back,
    and a watch that still sent the newer token would wait its whole ``wait_s`` before
    anybody corrected it. So when a heartbeat changed anything, the worker calls
    :meth:`forget`: the watch in flight is dropped and asked again at once with ``""``,
    and the controller answers with what stands now.
    """

    def __init__(self) -> None:
        # "" at first: the first watch is answered at once, with the orders.
        self.token = ""
        self._asking: trio.CancelScope | None = None

    def forget(self, *, ask_again: bool = True) -> None:
        """The orders applied may not be the watch's: its next request sends ``""``.
        ``ask_again``: drop the request in flight, so that the next goes at once. Not
        from a registration: that may run inside the watch's own request (the client
        registers again when a request meets an unknown session), and dropping it would
        drop the registration, again and again."""
        self.token = ""
        if ask_again and self._asking is not None:
            self._asking.cancel()

    @contextlib.contextmanager
    def asking(self) -> Iterator[trio.CancelScope]:
        """The scope of one watch request, which :meth:`forget` cancels while it runs."""
        with trio.CancelScope() as scope:
            self._asking = scope
            try:
                yield scope
            finally:
                self._asking = None


async def watch_cancels(
    client: ControllerClient,
    *,
    held: Callable[[], set[JobRef]],
    apply: Callable[[CancelOrder], None],
    changed: Callable[[], trio.Event],
    wait_s: Callable[[], float],
    pause_s: Callable[[], float],
    waiting: Callable[[], bool] = lambda: False,
    apply_control: Callable[[PollReply], object] = lambda reply: None,
    orders: Orders | None = None,
) -> None:
    """Run until cancelled.

    ``held``: the attempts the devices hold now; ``apply``: hand a cancel to
    them; ``changed``: the event set at the next change of the devices (a job
    taken, say); ``wait_s``: the long poll's wait; ``pause_s``: how long to
    wait after the controller refused the watch for good. ``waiting``: whether
    some device waits for the controller (a clear, an idle behaviour); the watch
    stays open then too, and ``apply_control`` takes each answer's idle
    behaviours and clears. ``orders``: the token of those last applied, which a
    heartbeat that changed anything forgets.
    """
    # What the controller listed at its last answer. Not narrowed to the attempts
    # held here: the controller keeps listing the cancel of an attempt that ended
    # here until its finish is acknowledged (an outage on finish, say), and a
    # cancel left out of ``known_cancels`` is answered again at once, so the
    # watch would poll in a loop without ever waiting.
    # A cancel whose attempt no device holds yet (offered, the poll's answer not
    # yet read) reaches it by the heartbeat, or by ``start``'s ``409 cancelled``.
    known: set[JobRef] = set()
    # An older controller answers with no token and ignores the one sent: sending ""
    # again costs nothing there, and a newer one taking over answers it at once.
    orders = orders or Orders()
    while True:
        wake = changed()
        if not held() and not waiting():
            await wake.wait()
            continue
        answer = None
        try:
            with orders.asking():
                answer = await client.watch(sorted(known), orders.token, wait_s())
        except ControllerError as e:
            log.error("cancel watch refused: %s; retrying after the heartbeat interval", e)
            await trio.sleep(pause_s())
            continue
        if answer is None:
            continue  # asked again: a heartbeat changed the orders meanwhile
        # The answer lists every cancel the controller still has for this host:
        # one it leaves out is done with (its job ended there).
        known = {(c.job_id, c.attempt) for c in answer.cancel}
        for cancel in answer.cancel:
            apply(cancel)
        orders.token = answer.control or ""
        apply_control(answer)
