"""The worker's ``httpx.AsyncClient`` in a fleet simulation, without the per-request
machinery an in-process controller does not need.

A simulated worker makes thousands of requests a virtual hour, and through a plain
``httpx.AsyncClient`` each one pays for what only a network needs: the request's URL
parsed and merged with the base URL afresh, an authentication flow and a redirect loop
(both generators), and the answer's cookies read into a ``http.cookiejar`` (which parses
the URL again): about a seventh of a fault plan's time, sampled (docs/performance.md).

:class:`SimClient` is the same client for what the worker uses of it (``stream``,
``build_request``, ``send``, ``base_url``): a relative path is merged with the base URL
once and the merged URL is reused, and a request goes straight to the transport (the
fleet's :class:`~rc_worker.testing.transport.FaultyTransport`), which still sees every
request and answers it through the controller's ASGI app: the same routes, middleware,
handlers and protocol converter as under ``rc serve``. What it leaves out cannot happen
with the reference controller: it sets no cookies, sends no redirects, and the worker's
client has no ``auth`` or event hooks. A client built with any of those, or a request with
``data``, ``files`` or ``cookies``, goes through ``httpx.AsyncClient`` unchanged.

The real worker (``rc-worker run``) keeps its plain ``httpx.AsyncClient``.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from contextlib import AbstractAsyncContextManager
from json import JSONEncoder
from types import TracebackType
from typing import Any

import httpx
from httpx._client import USE_CLIENT_DEFAULT, UseClientDefault
from httpx._types import (
    AuthTypes,
    CookieTypes,
    HeaderTypes,
    QueryParamTypes,
    RequestContent,
    RequestData,
    RequestExtensions,
    RequestFiles,
    TimeoutTypes,
)

__all__ = ["SimClient"]

log = logging.getLogger("httpx")  # httpx's own request log line, kept as it was

# Merged URLs, by base URL and path, shared by every client of the process: one per
# path (a job's start, output and finish each have one), and the same job ids come
# back in every fleet of a seeded run. Past this many the cache starts again.
_URL_CACHE_SIZE = 4096
_urls: dict[tuple[str, str], httpx.URL] = {}
# Set by a JSON body: a call's header of one of these names takes httpx's own path.
_BODY_HEADERS = frozenset({"content-length", "content-type", "transfer-encoding"})
# What httpx's json= encoding calls json.dumps with, as one encoder: json.dumps with
# arguments builds a new one for every document.
_ENCODER = JSONEncoder(ensure_ascii=False, separators=(",", ":"), allow_nan=False)
# A request's timeout by the seconds it was given (a long poll's differ by its wait):
# what httpx.Timeout makes of them, as the request's extension holds it.
_TIMEOUT_CACHE_SIZE = 256
_timeouts: dict[float, dict[str, float | None]] = {}


def _ascii(value: str | bytes) -> bytes:
    return value if isinstance(value, bytes) else value.encode("ascii")


class SimClient(httpx.AsyncClient):
    """An ``httpx.AsyncClient`` over an in-process transport, with less work per request."""

    def __init__(self, *, transport: httpx.AsyncBaseTransport, base_url: str) -> None:
        super().__init__(transport=transport, base_url=base_url)
        self._sim_transport = transport
        self._sim_base = self.base_url
        self._sim_base_text = str(self.base_url)
        self._sim_own = self.headers.raw
        self._sim_head = self._head()

    def _head(self) -> tuple[list[tuple[bytes, bytes]], frozenset[str]]:
        """What every request starts with (``Host``, then the client's own headers),
        and their names in lower case."""
        raw = [(b"Host", self.base_url.netloc), *self._sim_own]
        return raw, frozenset(k.decode("latin-1").lower() for k, _ in raw) | _BODY_HEADERS

    def _lean(self) -> bool:
        """Whether nothing configured on the client needs httpx's full machinery."""
        return (
            self.auth is None
            and not self.follow_redirects
            and not any(self.event_hooks.values())
            and not self.cookies
            and not self.params
        )

    def build_request(
        self,
        method: str,
        url: httpx.URL | str,
        *,
        content: RequestContent | None = None,
        data: RequestData | None = None,
        files: RequestFiles | None = None,
        json: Any | None = None,
        params: QueryParamTypes | None = None,
        headers: HeaderTypes | None = None,
        cookies: CookieTypes | None = None,
        timeout: TimeoutTypes | UseClientDefault = USE_CLIENT_DEFAULT,
        extensions: RequestExtensions | None = None,
    ) -> httpx.Request:
        if (
            not isinstance(url, str)
            or data is not None
            or files is not None
            or cookies is not None
            or extensions is not None
            or not self._lean()
        ):
            return super().build_request(
                method,
                url,
                content=content,
                data=data,
                files=files,
                json=json,
                params=params,
                headers=headers,
                cookies=cookies,
                timeout=timeout,
                extensions=extensions,
            )
        return self._lean_request(method, url, content, json, params, headers, timeout)

    def _lean_request(
        self,
        method: str,
        url: str,
        content: RequestContent | None,
        json: Any | None,
        params: QueryParamTypes | None,
        headers: HeaderTypes | None,
        timeout: TimeoutTypes | UseClientDefault,
    ) -> httpx.Request:
        """:meth:`build_request` for a client and a call that :meth:`_lean` allows."""
        own = self.headers.raw
        if self.base_url is not self._sim_base or own != self._sim_own:
            # Another controller (a fail-over sets base_url), or the client's own
            # headers changed: start from them from now on.
            self._sim_base = self.base_url
            self._sim_base_text = str(self.base_url)
            self._sim_own = own
            self._sim_head = self._head()
        key = (self._sim_base_text, url)
        merged = _urls.get(key)
        if merged is None:
            if len(_urls) >= _URL_CACHE_SIZE:
                _urls.clear()
            merged = _urls[key] = self._merge_url(url)
        extensions = {"timeout": self._timeout_of(timeout)}
        if json is None or content is not None or params is not None:
            return self._plain_request(method, merged, headers, extensions, content, json, params)
        # A JSON body, the most common request: what httpx.Request(json=...) makes (the
        # same encoding, the same headers in the same order), without working out again
        # what every request of this client has in common. Headers of the call that
        # would replace one of those take httpx's own path.
        head, names = self._sim_head
        raw = list(head)
        if headers:
            if not isinstance(headers, Mapping) or any(
                not isinstance(k, str) or k.lower() in names for k in headers
            ):
                return self._plain_request(method, merged, headers, extensions, json=json)
            raw.extend((_ascii(k), _ascii(v)) for k, v in headers.items())
        text = _ENCODER.encode(json)
        body = text.encode("utf-8")
        raw.append((b"Content-Length", str(len(body)).encode("ascii")))
        raw.append((b"Content-Type", b"application/json"))
        request = httpx.Request(
            method, merged, headers=raw, stream=httpx.ByteStream(body), extensions=extensions
        )
        request.read()
        return request

    def _timeout_of(self, timeout: TimeoutTypes | UseClientDefault) -> dict[str, float | None]:
        """The request's ``timeout`` extension, as httpx makes it from ``timeout``."""
        if isinstance(timeout, UseClientDefault):
            return self.timeout.as_dict()
        if type(timeout) is not float:
            return httpx.Timeout(timeout).as_dict()
        known = _timeouts.get(timeout)
        if known is None:
            if len(_timeouts) >= _TIMEOUT_CACHE_SIZE:
                _timeouts.clear()
            known = _timeouts[timeout] = httpx.Timeout(timeout).as_dict()
        return dict(known)

    def _plain_request(
        self,
        method: str,
        url: httpx.URL,
        headers: HeaderTypes | None,
        extensions: dict[str, Any],
        content: RequestContent | None = None,
        json: Any | None = None,
        params: QueryParamTypes | None = None,
    ) -> httpx.Request:
        """The request as httpx builds it, from the merged URL (what build_request does)."""
        merged_headers = httpx.Headers(self.headers)
        merged_headers.update(headers)
        return httpx.Request(
            method,
            url,
            content=content,
            json=json,
            params=params,
            headers=merged_headers,
            extensions=extensions,
        )

    async def send(
        self,
        request: httpx.Request,
        *,
        stream: bool = False,
        auth: AuthTypes | UseClientDefault | None = USE_CLIENT_DEFAULT,
        follow_redirects: bool | UseClientDefault = USE_CLIENT_DEFAULT,
    ) -> httpx.Response:
        if (
            not isinstance(auth, UseClientDefault)
            or not isinstance(follow_redirects, UseClientDefault)
            or not self._lean()
        ):
            return await super().send(
                request, stream=stream, auth=auth, follow_redirects=follow_redirects
            )
        return await self._lean_send(request, stream)

    async def _lean_send(self, request: httpx.Request, stream: bool) -> httpx.Response:
        """:meth:`send` for a client and a call that :meth:`_lean` allows."""
        if self.is_closed:
            raise RuntimeError("Cannot send a request, as the client has been closed.")
        if "timeout" not in request.extensions:
            request.extensions["timeout"] = self.timeout.as_dict()
        response = await self._sim_transport.handle_async_request(request)
        response.request = request
        try:
            if not stream:
                await response.aread()
        except BaseException:
            await response.aclose()
            raise
        if log.isEnabledFor(logging.INFO):
            log.info(
                'HTTP Request: %s %s "%s %d %s"',
                request.method,
                request.url,
                response.http_version,
                response.status_code,
                response.reason_phrase,
            )
        return response

    # httpx's stream() is a generator-based context manager; this one is a plain object
    # (the worker makes every request through stream()), used as httpx's is.
    def stream(  # type: ignore[override]
        self,
        method: str,
        url: httpx.URL | str,
        *,
        content: RequestContent | None = None,
        data: RequestData | None = None,
        files: RequestFiles | None = None,
        json: Any | None = None,
        params: QueryParamTypes | None = None,
        headers: HeaderTypes | None = None,
        cookies: CookieTypes | None = None,
        auth: AuthTypes | UseClientDefault | None = USE_CLIENT_DEFAULT,
        follow_redirects: bool | UseClientDefault = USE_CLIENT_DEFAULT,
        timeout: TimeoutTypes | UseClientDefault = USE_CLIENT_DEFAULT,
        extensions: RequestExtensions | None = None,
    ) -> AbstractAsyncContextManager[httpx.Response]:
        if (
            not isinstance(url, str)
            or data is not None
            or files is not None
            or cookies is not None
            or extensions is not None
            or not isinstance(auth, UseClientDefault)
            or not isinstance(follow_redirects, UseClientDefault)
            or not self._lean()
        ):
            return super().stream(
                method,
                url,
                content=content,
                data=data,
                files=files,
                json=json,
                params=params,
                headers=headers,
                cookies=cookies,
                auth=auth,
                follow_redirects=follow_redirects,
                timeout=timeout,
                extensions=extensions,
            )
        return _Streamed(self, (method, url, content, json, params, headers, timeout))


_LeanCall = tuple[
    str,
    str,
    "RequestContent | None",
    Any,
    "QueryParamTypes | None",
    "HeaderTypes | None",
    "TimeoutTypes | UseClientDefault",
]


class _Streamed(AbstractAsyncContextManager[httpx.Response]):
    """What ``httpx.AsyncClient.stream`` does, entered and left: the request built and
    sent on entry (its answer not read), the answer closed on the way out."""

    __slots__ = ("_call", "_client", "_response")

    def __init__(self, client: SimClient, call: _LeanCall) -> None:
        self._client = client
        self._call = call
        self._response: httpx.Response | None = None

    async def __aenter__(self) -> httpx.Response:
        request = self._client._lean_request(*self._call)
        self._response = await self._client._lean_send(request, stream=True)
        return self._response

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        response = self._response
        assert response is not None
        if type(response.stream) is httpx.ByteStream and not response.is_closed:
            # All that aclose() does for an answer held in memory (its stream's own
            # aclose does nothing), without its error-wrapping context manager.
            response.is_closed = True
        else:
            await response.aclose()
