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
        self._found: dict[tuple[str, str], tuple[Route, Handler, dict[str, Any]] | None] = {}

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

    def find(self, scope: Scope) -> tuple[Route, Handler, dict[str, Any]] | None:
        """The route the router would hand ``scope`` to, if a plain handler's."""
        key = (scope["method"], scope["path"])
        try:
            return self._found[key]
        except KeyError:
            pass
        found = None
        for route in self.app.router.routes:
            match, child = route.matches(scope)
            if match is Match.FULL:
                # The first full match is the router's choice, as in Router.app.
                if _plain(route):
                    assert isinstance(route, Route)
                    found = (route, route.endpoint, child["path_params"])
                break
        if len(self._found) >= _ROUTE_CACHE_SIZE:
            self._found.clear()
        self._found[key] = found
        return found

    async def call(
        self,
        found: tuple[Route, Handler, dict[str, Any]],
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
        if "content-encoding" in response.headers:
            response.read()  # decoded as httpx decodes it
        else:
            # What read() would keep, without its decoder and chunker: an answer with
            # no Content-Encoding is its own content (the controller compresses none).
            response._content = content
        return response
