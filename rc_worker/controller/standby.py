"""Standby controllers: several ``rc serve`` on one PostgreSQL database, one of them active.

The active controller holds the database's controllers' lock (a session advisory
lock, :mod:`rc_worker.controller.persist.postgres`). A controller that cannot take
it at start is a **standby**: it listens, answers every request ``503`` with
``Retry-After`` (``/v1/health`` says ``"role": "standby"``), and tries the lock
every :data:`STANDBY_TRY_S`. Once it has the lock it stops the standby listener,
loads the state from the database (every known host starts ``unknown``: the
recovery phase) and serves on the same address. Workers given a list of
``controller_url``\\ s move to the next one on a refused connection or a
standby's ``503``.

The active one checks its lock every :data:`LEAD_CHECK_S` (:func:`guard_lead`);
once it has lost it (its session ended and another controller took the lock, or
led in between), or can no longer show it holds it while the database answers,
it stops serving at once. Writes go through the lock-holding
session, so even before that check notices, a controller without the lock can
store nothing and so answer ``200`` to nothing that changes state: two active
controllers never assign work.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import Final, Protocol

import trio
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from rc_worker.controller.serve import hypercorn_config
from rc_worker.core.model import PROTOCOL_VERSION
from rc_worker.core.protocol import ErrorReply, HealthReply, unstructure
from rc_worker.listen import serve_asgi

__all__ = ["LEAD_CHECK_S", "STANDBY_TRY_S", "Leader", "guard_lead", "standby_app", "wait_to_lead"]

log = logging.getLogger("rc_worker.controller.standby")

STANDBY_TRY_S: Final = 1.0
"""How often a standby tries the lock: about how long a takeover waits after the active dies."""
LEAD_CHECK_S: Final = 1.0
"""How often the active controller checks that its lock's session is alive."""
RETRY_AFTER_S: Final = 1


class Leader(Protocol):
    """What a backend that can be shared by several controllers offers (PostgreSQL)."""

    lost: str | None
    """Why this controller no longer leads, once it does not."""

    def try_lead(self) -> bool: ...

    def check_lead(self) -> bool:
        """Whether this still leads; False only once :attr:`lost` says why."""
        ...


async def _standby_answer(request: Request) -> Response:
    reply: object
    if request.url.path == "/v1/health":
        reply = HealthReply(PROTOCOL_VERSION, "standby", ok=False, role="standby")
    else:
        reply = ErrorReply(
            "standby",
            "this controller is a standby; the active one holds the database "
            "(try the next controller_url)",
        )
    return JSONResponse(unstructure(reply), 503, headers={"Retry-After": str(RETRY_AFTER_S)})


def standby_app() -> Starlette:
    """Answers everything ``503`` (``error: standby``) with ``Retry-After``."""
    methods = ["GET", "POST", "PUT", "DELETE", "PATCH"]
    return Starlette(routes=[Route("/{path:path}", _standby_answer, methods=methods)])


async def wait_to_lead(
    backend: Leader,
    listen: str,
    *,
    shutdown_trigger: Callable[[], Awaitable[None]] | None,
    task_status: trio.TaskStatus[list[str]] = trio.TASK_STATUS_IGNORED,
) -> tuple[str, bool] | None:
    """Serve as a standby on ``listen`` until this controller takes the lock.

    Returns the address to serve on as the active controller (``listen`` with the
    port actually bound) and whether the bound URLs were reported through
    ``task_status`` (they are once a standby listens; not when the lock is free at
    the first try, when nothing listened here); None if ``shutdown_trigger`` fired
    first.
    """
    tries = _Tries(backend)
    if await tries():
        return listen, False
    if tries.said is None:
        log.warning("another controller holds the database: serving as a standby on %s", listen)
    else:  # the reason was just said: no other controller need be leading
        log.warning("cannot lead yet: serving as a standby on %s", listen)
    led = False
    done = trio.Event()
    async with trio.open_nursery() as nursery:

        async def try_lock() -> None:
            nonlocal led
            # Polling is the only way: PostgreSQL tells no one when a session lock frees.
            while not await tries():  # noqa: ASYNC110
                await trio.sleep(STANDBY_TRY_S)
            led = True
            done.set()

        async def stop_on_trigger() -> None:
            if shutdown_trigger is not None:
                await shutdown_trigger()
                done.set()

        async def listener(task_status: trio.TaskStatus[list[str]]) -> None:
            await serve_asgi(
                standby_app(),
                hypercorn_config(listen),
                shutdown_trigger=done.wait,
                task_status=task_status,
            )
            nursery.cancel_scope.cancel()

        binds: list[str] = await nursery.start(listener)
        task_status.started(binds)
        nursery.start_soon(try_lock)
        nursery.start_soon(stop_on_trigger)
    if not led:
        return None
    log.warning("took the database's lock: this controller is now the active one")
    host = listen.rpartition(":")[0]
    port = binds[0].rpartition(":")[2] if binds else listen.rpartition(":")[2]
    return f"{host}:{port}", True


class _Tries:
    """Tries the lock; says why a try failed once for each new reason, not every second.

    A failure is a database down or refusing, or one an operator must fix (a garbled
    ``meta.leader_epoch``): either way this stays a standby and tries again, and the
    operator sees the reason once, as a warning (info would go unseen by default).
    """

    def __init__(self, backend: Leader) -> None:
        self.backend = backend
        self.said: str | None = None
        """The reason last said, until a try gets an answer again."""

    async def __call__(self) -> bool:
        try:
            led = await trio.to_thread.run_sync(self.backend.try_lead)
        except Exception as e:
            text = str(e).strip()
            why = text.splitlines()[0] if text else type(e).__name__
            if why != self.said:
                log.warning("cannot take the controllers' lock: %s", why)
                self.said = why
            return False
        self.said = None
        return led


async def guard_lead(backend: Leader, serving: trio.CancelScope) -> None:
    """Cancel ``serving`` at once when this controller no longer leads; runs until then."""
    # A session that ended is noticed only by using it: ask, now and then.
    while await trio.to_thread.run_sync(backend.check_lead):  # noqa: ASYNC110
        await trio.sleep(LEAD_CHECK_S)
    log.error(
        "lost the controllers' lock (%s); stopping at once", backend.lost or "no reason given"
    )
    serving.cancel()
