"""An ASGI call per request, for a fleet simulation: ``httpx.ASGITransport`` with less
around it.

Every simulated request reaches the controller's ASGI app (its routes, middleware,
handlers and protocol converter, as under ``rc serve``) exactly as through
``httpx.ASGITransport``: the same scope, the request body streamed to the app chunk by
chunk as the app reads it, the app's exceptions raised to the caller, and a
``http.disconnect`` only once the response is complete. What differs is the answer: it
is handed back already read, so the transport above it and the worker's client read it
from memory instead of through an async stream each.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

import httpx
import trio

__all__ = ["InProcessTransport"]

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
App = Callable[[Scope, Receive, Send], Awaitable[None]]

_CLIENT = ("127.0.0.1", 123)  # what httpx.ASGITransport reports as the peer


class InProcessTransport(httpx.AsyncBaseTransport):
    """Calls ``app`` for each request, in the caller's task (no sockets)."""

    def __init__(self, app: App) -> None:
        self.app = app

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
        status: int | None = None
        headers: list[tuple[bytes, bytes]] = []
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
            nonlocal status, headers, complete
            if message["type"] == "http.response.start":
                assert status is None
                status = message["status"]
                headers = list(message.get("headers", []))
            elif message["type"] == "http.response.body":
                assert not complete
                data = message.get("body", b"")
                if data and request.method != "HEAD":
                    body.append(data)
                if not message.get("more_body", False):
                    complete = True
                    if done is not None:
                        done.set()

        await self.app(scope, receive, send)
        assert complete
        assert status is not None
        content = b"".join(body)
        response = httpx.Response(status, headers=headers, stream=httpx.ByteStream(content))
        if "content-encoding" in response.headers:
            response.read()  # decoded as httpx decodes it
        else:
            # What read() would keep, without its decoder and chunker: an answer with
            # no Content-Encoding is its own content (the controller compresses none).
            response._content = content
        return response
