"""The reference controller as a Starlette app: the route table and the error format.

Handlers live in :mod:`~rc_worker.controller.worker_api` and
:mod:`~rc_worker.controller.user_api`; both reach the shared state through the
:class:`~rc_worker.controller.context.Controller` on ``app.state.controller``.
All decisions are the store's; the app parses, authenticates, waits and streams.
Every error is ``{"error": code, "message": sentence}``.
"""

from __future__ import annotations

import logging
import secrets
from collections.abc import Callable, Collection, Mapping, Sequence

import attrs
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from rc_worker.controller import user_api, worker_api
from rc_worker.controller.context import Controller, User
from rc_worker.controller.durable import Durability, DurableMiddleware
from rc_worker.controller.errors import ApiError, StoreUnavailable
from rc_worker.controller.metrics import metrics_endpoint
from rc_worker.controller.store import Store
from rc_worker.core.model import PROTOCOL_VERSION
from rc_worker.core.protocol import ErrorReply, HealthReply, unstructure

__all__ = ["create_app"]

log = logging.getLogger("rc_worker.controller")


def _error_response(status: int, code: str, message: str, **extra: object) -> JSONResponse:
    headers = {"WWW-Authenticate": "Bearer"} if status == 401 else None
    body = {**unstructure(ErrorReply(code, message)), **extra}
    return JSONResponse(body, status, headers=headers)


async def _api_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, ApiError)
    body = exc.to_json()
    headers = {"WWW-Authenticate": "Bearer"} if exc.status == 401 else {}
    if isinstance(exc, StoreUnavailable):
        # Raised by a handler too (a read the store could not answer), not only by the
        # middleware: the client honours Retry-After on every 503 it gets.
        headers["Retry-After"] = str(exc.retry_after_s)
    return JSONResponse(body, exc.status, headers=headers)


async def _http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    codes = {404: "not_found", 405: "method_not_allowed"}
    return _error_response(exc.status_code, codes.get(exc.status_code, "http_error"), exc.detail)


async def _internal_error(request: Request, exc: Exception) -> Response:
    # A bug, never a bad request (those are 400s): log it under an id the client can quote.
    error_id = secrets.token_hex(6)
    log.error(
        "internal error %s in %s %s", error_id, request.method, request.url.path, exc_info=exc
    )
    return _error_response(
        500,
        "internal",
        f"the controller failed (error id {error_id}); see its log",
        error_id=error_id,
    )


async def _health(request: Request) -> Response:
    ctl: Controller = request.app.state.controller
    d = ctl.durability
    store = "memory" if d is None else ("failing" if d.failed else "ok")
    # The store's own health: what it is, whether writes work, what the last one cost.
    reply = HealthReply(PROTOCOL_VERSION, store, ok=store != "failing")
    if d is not None:
        reply = attrs.evolve(
            reply,
            store_backend=d.backend.description,
            store_error=d.failed,
            store_pending=d.dirty(),
            last_commit_s=d.last_commit_s,
        )
    return JSONResponse(unstructure(reply))


def create_app(
    *,
    store: Store | None = None,
    worker_tokens: Mapping[str, str] | None = None,
    user_tokens: Collection[str] | Mapping[str, User] = (),
    clock: Callable[[], float] | None = None,
    webhooks: Sequence[str] = (),
    durability: Durability | None = None,
) -> Starlette:
    """Build the reference controller.

    ``worker_tokens`` maps a worker token to the host it may act as (``"*"``:
    any host); ``user_tokens`` are the tokens of people (the ``rc`` client): each
    ``TOKEN=NAME[:admin]`` or a bare ``TOKEN`` (a plain user with a derived name),
    or a mapping of token to :class:`~rc_worker.controller.context.User`.
    With no tokens nobody is let in. ``webhooks`` are URLs each event is POSTed
    to by :func:`rc_worker.controller.serve.deliver_webhooks` (run by ``rc
    serve``; in-process users run it themselves if they want deliveries).
    The store is on ``app.state.store``, the :class:`Controller` on
    ``app.state.controller``. With ``durability`` (a store opened on a database,
    :mod:`rc_worker.controller.persist`), a request that changes state is
    answered only once the change is stored, and ``503`` while it cannot be.
    """
    store = store if store is not None else Store()
    ctl = Controller(
        store,
        worker_tokens=worker_tokens or {},
        user_tokens=user_tokens,
        clock=clock,
        webhooks=webhooks,
    )
    ctl.durability = durability
    routes = [
        Route("/v1/health", _health, methods=["GET"]),
        Route("/metrics", metrics_endpoint(store), methods=["GET"]),
        *worker_api.routes(),
        *user_api.routes(),
    ]
    app = Starlette(
        routes=routes,
        exception_handlers={
            ApiError: _api_error,
            HTTPException: _http_error,
            Exception: _internal_error,
        },
        middleware=[]
        if durability is None
        else [Middleware(DurableMiddleware, durability=durability)],
    )
    app.state.controller = ctl
    app.state.store = store
    return app
