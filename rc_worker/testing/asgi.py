"""An ASGI call per request, for a fleet simulation: ``httpx.ASGITransport`` with less
around it.

Every simulated request reaches the controller's ASGI app (its routes, middleware,
handlers and protocol converter, as under ``rc serve``) exactly as through
``httpx.ASGITransport``: the same scope, the request body streamed to the app chunk by
chunk as the app reads it, the app's exceptions raised to the caller, and a
``http.disconnect`` only once the response is complete. What differs is the answer: it
is handed back already read, so the transport above it and the worker's client read it
from memory instead of through an async stream each.

A Starlette app with no middleware of its own (the fleet's controller) is called one
layer further in, through :class:`DirectRoutes`: the route a request goes to is found
once per method and path, and its handler called, without Starlette's route search and
the two middleware layers around it on the way of every request. A handler that raises
goes through those very layers (built as the app builds them), so that every error is
answered, logged and raised as the app itself does; a request that finds no route, or a
route that is not a plain handler, goes through the app.
"""

from __future__ import annotations

import inspect
import itertools
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

import httpx
import trio
from starlette.applications import Starlette
from starlette.middleware.errors import ServerErrorMiddleware
from starlette.middleware.exceptions import ExceptionMiddleware
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Match, Route

__all__ = ["DirectRoutes", "InProcessTransport"]

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
App = Callable[[Scope, Receive, Send], Awaitable[None]]
Handler = Callable[[Request], Awaitable[Response]]

_CLIENT = ("127.0.0.1", 123)  # what httpx.ASGITransport reports as the peer
_ROUTE_CACHE_SIZE = 4096  # paths (one per host and job); past this the cache starts again

Found = tuple[Route, Handler, dict[str, Any]]
"""The route a request goes to, its handler and its path parameters."""

# What the router chose for a method and path (the index of the route, and the path's
# parameters; None: not a plain handler's), by route table: every fleet builds its own
# controller, with the same routes, so what one found holds for the next.
_chosen: dict[tuple[int, str, str], tuple[int, dict[str, Any]] | None] = {}
# Route tables by what decides a match (each route's path, methods and kind): a number
# for each, so that a lookup does not hash the whole table.
_tables: dict[object, int] = {}
_numbers = itertools.count()


class DirectRoutes:
    """Calls the handler of a Starlette app's route without the app's route search and
    middleware, for a request that succeeds; a handler's exception goes through the
    app's own middleware layers, so it is answered exactly as the app answers it.

    Only for an app whose middleware stack is Starlette's own two layers around its
    router (:meth:`of` gives ``None`` for any other), and only for a route that is a
    plain ``async def`` handler with no middleware of its own (:meth:`find` gives
    ``None`` for any other: the request then goes through the app).
    """

    def __init__(self, app: Starlette, errors: ServerErrorMiddleware) -> None:
        self.app = app
        self._errors = errors  # the app's stack, its router replaced by _raise
        exceptions = errors.app
        assert isinstance(exceptions, ExceptionMiddleware)
        exceptions.app = _raise
        self._handlers = (exceptions._exception_handlers, exceptions._status_handlers)
        self._routes: list[Any] | None = None  # the table numbered, and how long it was
        self._count = 0
        self._table = 0

    @classmethod
    def of(cls, app: object) -> DirectRoutes | None:
        """For ``app``, or ``None`` where its requests must go through it whole."""
        if type(app) is not Starlette or app.user_middleware:
            return None
        stack = app.build_middleware_stack()  # new layers, as the app builds its own
        if (
            type(stack) is not ServerErrorMiddleware
            or type(stack.app) is not ExceptionMiddleware
            or stack.app.app is not app.router
        ):
            return None  # more layers than Starlette's own (a body limit, say)
        return cls(app, stack)

    def find(self, scope: Scope) -> Found | None:
        """The route the router would hand ``scope`` to, if a plain handler's."""
        routes = self.app.router.routes
        if routes is not self._routes or len(routes) != self._count:
            # The first time, or routes added since.
            self._routes, self._count, self._table = routes, len(routes), _table_of(routes)
        key = (self._table, scope["method"], scope["path"])
        try:
            chosen = _chosen[key]
        except KeyError:
            chosen = _choose(routes, scope)
            if len(_chosen) >= _ROUTE_CACHE_SIZE:
                _chosen.clear()
            _chosen[key] = chosen
        if chosen is None:
            return None
        route = routes[chosen[0]]
        assert isinstance(route, Route)
        return route, route.endpoint, chosen[1]

    async def call(
        self,
        found: Found,
        scope: Scope,
        receive: Receive,
        send: Send,
        started: Callable[[], Message | None],
    ) -> None:
        """Handle the request as the app would route it to ``found``; ``started()``
        gives the response's start message once ``send`` has taken it."""
        route, handler, params = found
        scope["app"] = self.app
        scope["starlette.exception_handlers"] = self._handlers
        scope["router"] = self.app.router
        scope["route"] = route
        scope["endpoint"] = handler
        scope["path_params"] = dict(params)
        try:
            response = await handler(Request(scope, receive, send))
            await response(scope, receive, send)
        except Exception as exc:
            await self._failed(exc, scope, receive, send, started())

    async def _failed(
        self, exc: Exception, scope: Scope, receive: Receive, send: Send, start: Message | None
    ) -> None:
        """What the app's layers do with ``exc``: they meet it as from its router (the
        route's own handling of it is theirs too: the same handlers, looked up alike)."""
        scope["rc.direct"] = (exc, start)

        async def passed_on(message: Message) -> None:
            if message is not start:  # already sent: the layers only needed to see it
                await send(message)

        await self._errors(scope, receive, passed_on)


async def _raise(scope: Scope, receive: Receive, send: Send) -> None:
    """In place of the router: the response start already sent, then the handler's error."""
    exc, start = scope.pop("rc.direct")
    if start is not None:
        await send(start)  # so that each layer knows the response had started
    raise exc


def _choose(routes: list[Any], scope: Scope) -> tuple[int, dict[str, Any]] | None:
    """The index of the route the router hands ``scope`` to, and its path parameters,
    if a plain handler's (as Router.app chooses: the first full match)."""
    for i, route in enumerate(routes):
        match, child = route.matches(scope)
        if match is Match.FULL:
            return (i, child["path_params"]) if _plain(route) else None
    return None


def _table_of(routes: list[Any]) -> int:
    """A number for the route table: the same for tables that match alike."""
    if not all(type(r) is Route for r in routes):
        return next(_numbers)  # not one to share: a number of its own
    shape = tuple((r.path, frozenset(r.methods or ()), _plain(r)) for r in routes)
    number = _tables.get(shape)
    if number is None:
        number = _tables[shape] = next(_numbers)
    return number


def _plain(route: object) -> bool:
    """A Route around an ``async def`` handler, with no middleware of its own."""
    return (
        type(route) is Route
        and inspect.iscoroutinefunction(route.endpoint)
        and getattr(route.app, "__qualname__", "") == "request_response.<locals>.app"
    )


class InProcessTransport(httpx.AsyncBaseTransport):
    """Calls ``app`` for each request, in the caller's task (no sockets)."""

    def __init__(self, app: App) -> None:
        self.app = app
        self.direct = DirectRoutes.of(app)

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        assert isinstance(request.stream, httpx.AsyncByteStream)
        url = request.url
        raw_path = url.raw_path
        scope: Scope = {
            "type": "http",
            "asgi": {"version": "3.0"},
            "http_version": "1.1",
            "method": request.method,
            "headers": [(k.lower(), v) for (k, v) in request.headers.raw],
            "scheme": url.scheme,
            "path": url.path,
            "raw_path": raw_path.split(b"?")[0] if b"?" in raw_path else raw_path,
            "query_string": url.query,
            "server": (url.host, url.port),
            "client": _CLIENT,
            "root_path": "",
        }
        chunks = request.stream.__aiter__()
        request_complete = False
        start: Message | None = None
        body: list[bytes] = []
        complete = False
        # Made only if the app asks for more after the whole body (a streaming
        # response listening for a disconnect): it waits for the response's end.
        done: trio.Event | None = None

        async def receive() -> Message:
            nonlocal request_complete, done
            if request_complete:
                if not complete:
                    if done is None:
                        done = trio.Event()
                    await done.wait()
                return {"type": "http.disconnect"}
            try:
                chunk = await chunks.__anext__()
            except StopAsyncIteration:
                request_complete = True
                return {"type": "http.request", "body": b"", "more_body": False}
            return {"type": "http.request", "body": chunk, "more_body": True}

        async def send(message: Message) -> None:
            nonlocal start, complete
            if message["type"] == "http.response.start":
                assert start is None
                start = message
            elif message["type"] == "http.response.body":
                assert not complete
                data = message.get("body", b"")
                if data and request.method != "HEAD":
                    body.append(data)
                if not message.get("more_body", False):
                    complete = True
                    if done is not None:
                        done.set()

        found = None if self.direct is None else self.direct.find(scope)
        if found is None:
            await self.app(scope, receive, send)
        else:
            assert self.direct is not None
            await self.direct.call(found, scope, receive, send, lambda: start)
        assert complete
        assert start is not None
        status: int = start["status"]
        headers = list(start.get("headers", []))
        content = b"".join(body)
        response = httpx.Response(status, headers=headers, stream=httpx.ByteStream(content))
        if any(k.lower() == b"content-encoding" for k, _ in headers):
            response.read()  # decoded as httpx decodes it
        else:
            # What read() would keep, without its decoder and chunker: an answer with
            # no Content-Encoding is its own content (the controller compresses none).
            response._content = content
        return response
