"""Fault injection between a worker and the reference controller.

:class:`FaultyTransport` wraps the transport a worker talks through (the
:class:`~rc_worker.testing.asgi.InProcessTransport` of a fleet, or the
``httpx.ASGITransport`` of :func:`rc_worker.testing.local_system`)
and answers each request with a :class:`Fault`, per endpoint: queued ones in
order (:meth:`~FaultyTransport.inject`), or one held until restored
(:meth:`~FaultyTransport.outage`). Every exchange is logged, so a test can
wait for "the worker tried to finish" and check what the controller acknowledged.

One transport serves both the fleet simulations (virtual time, hooks that check
invariants) and the worker's own tests on the real clock (``timeout_s=0``).
"""

from __future__ import annotations

import enum
import json
import re
from collections.abc import AsyncIterator, Callable, Iterator, Mapping, Sequence
from typing import Any

import attrs
import httpx
import trio

from rc_worker.changed import Changed

__all__ = ["ENDPOINTS", "TIMEOUT_S", "Exchange", "Fault", "FaultyTransport", "endpoint_of"]

TIMEOUT_S = 5.0
"""Seconds a ``Fault.TIMEOUT`` takes before the worker sees it (virtual, in a fleet)."""

# The worker's endpoints, by the path's shape: ``/v1/hosts/{h}/{name}``,
# ``/v1/hosts/{h}/devices/{d}/fault`` and ``/v1/jobs/{id}/{name}``. A split and
# a table lookup: this runs on every request of every simulated worker.
_HOST_ENDPOINTS = ("register", "heartbeat", "poll", "labels", "sheets", "deregister")
_JOB_ENDPOINTS = ("start", "output", "finish", "stdin")

ENDPOINTS: Mapping[str, re.Pattern[str]] = {
    name: re.compile(pattern)
    for name, pattern in {
        "register": r"^/v1/hosts/[^/]+/register$",
        "heartbeat": r"^/v1/hosts/[^/]+/heartbeat$",
        "poll": r"^/v1/hosts/[^/]+/poll$",
        "labels": r"^/v1/hosts/[^/]+/labels$",
        "sheets": r"^/v1/hosts/[^/]+/sheets$",
        "fault": r"^/v1/hosts/[^/]+/devices/[^/]+/fault$",
        "start": r"^/v1/jobs/[^/]+/start$",
        "output": r"^/v1/jobs/[^/]+/output$",
        "finish": r"^/v1/jobs/[^/]+/finish$",
        "stdin": r"^/v1/jobs/[^/]+/stdin$",
        "deregister": r"^/v1/hosts/[^/]+/deregister$",
    }.items()
}
"""The worker's endpoints by name, as fault plans address them (:func:`endpoint_of`
finds the same without the patterns)."""


def endpoint_of(path: str) -> str:
    """The endpoint a request path goes to (``other`` for none of the worker's)."""
    parts = path.split("/")
    # ['', 'v1', 'hosts', h, name] / ['', 'v1', 'hosts', h, 'devices', d, 'fault'] / jobs
    if len(parts) < 5 or parts[0] or parts[1] != "v1" or not parts[3]:
        return "other"
    if parts[2] == "hosts":
        if len(parts) == 5 and parts[4] in _HOST_ENDPOINTS:
            return parts[4]
        if len(parts) == 7 and parts[4] == "devices" and parts[5] and parts[6] == "fault":
            return "fault"
    elif parts[2] == "jobs" and len(parts) == 5 and parts[4] in _JOB_ENDPOINTS:
        return parts[4]
    return "other"


class Fault(enum.Enum):
    """What the controller's side of one request does."""

    OK = "ok"
    UNAVAILABLE = "503"
    RETRY_AFTER = "503 retry-after"
    """A 503 carrying ``Retry-After: 0``, nothing applied."""
    UNKNOWN_SESSION = "409 unknown_session"
    REFUSED = "connection refused"
    TIMEOUT = "timeout"
    LOST = "applied, answer lost"

    def __repr__(self) -> str:
        # Evaluable, so that a printed fault plan can be pasted back to replay it.
        return f"Fault.{self.name}"


@attrs.frozen
class Exchange:
    """One request a worker made, as the transport saw it."""

    at: float
    host: str
    endpoint: str
    path: str
    fault: Fault
    status: int | None  # None: no answer reached the worker
    body_bytes: int = 0
    body: str = ""  # the request's JSON text; empty for output (raw bytes)

    @property
    def job_id(self) -> str | None:
        """The job of a ``/v1/jobs/{id}/...`` request."""
        parts = self.path.split("/")
        return parts[3] if len(parts) > 4 and parts[2] == "jobs" else None


RequestHook = Callable[[str, httpx.Request], httpx.Request]
AnswerHook = Callable[[str, httpx.Request, int, Mapping[str, Any]], None]
"""``(endpoint, request, status, body)`` for every answer that reached the worker."""


class FaultyTransport(httpx.AsyncBaseTransport):
    """Between one worker and the controller: planned faults, outages, a log.

    ``plan``: per endpoint, the faults its first requests meet, in order
    (``Fault.OK`` lets one through). ``timeout_s``: how long a ``TIMEOUT`` keeps the
    request before it fails (0 on the real clock). ``on_request(endpoint, request)``
    sees every request that reaches the controller, and returns the one to send;
    ``on_send(endpoint, request)`` sees every request the worker makes, faulted or
    not; ``on_answer`` every answer that reaches the worker, with its JSON body.
    ``buffer_streams``: a streamed body (output) is read whole before it goes on,
    as through a buffering proxy; by default it streams through.
    While ``down`` (the worker process is dead) nothing is sent at all.
    """

    def __init__(
        self,
        inner: httpx.AsyncBaseTransport,
        plan: Mapping[str, Sequence[Fault]] | None = None,
        *,
        name: str = "",
        on_request: RequestHook | None = None,
        timeout_s: float = TIMEOUT_S,
        buffer_streams: bool = False,
    ) -> None:
        self._inner = inner
        self.buffer_streams = buffer_streams
        self.name = name
        self.on_request = on_request
        self.on_send: RequestHook | None = None
        self.on_answer: AnswerHook | None = None
        self.timeout_s = timeout_s
        self.down = False
        self.log: list[Exchange] = []
        self._queued: dict[str, list[Fault]] = {}
        self._outages: dict[str, Fault] = {}
        self._changed = Changed()
        for endpoint, faults in (plan or {}).items():
            self.inject(endpoint, *faults)

    # -- what tests drive --

    def inject(self, endpoint: str, *faults: Fault) -> None:
        """The next requests to ``endpoint`` meet ``faults``, one each, in order."""
        for fault in faults:
            _check_fault(endpoint, fault)
        self._queued.setdefault(endpoint, []).extend(faults)

    def pending(self, endpoint: str) -> int:
        """How many queued faults for ``endpoint`` no request has met yet."""
        return len(self._queued.get(endpoint, ()))

    def outage(self, endpoint: str, fault: Fault = Fault.UNAVAILABLE) -> None:
        """Every request to ``endpoint`` meets ``fault`` until :meth:`restore`."""
        _check_fault(endpoint, fault)
        self._outages[endpoint] = fault

    def restore(self, endpoint: str | None = None) -> None:
        """End the outage of ``endpoint`` (all, when ``None``) and drop queued faults."""
        for table in (self._outages, self._queued):
            if endpoint is None:
                table.clear()
            else:
                table.pop(endpoint, None)

    def exchanges(self, endpoint: str, job_id: str | None = None) -> list[Exchange]:
        """The logged exchanges with ``endpoint`` (of ``job_id``'s requests, if given)."""
        return [
            e for e in self.log if e.endpoint == endpoint and (job_id is None or e.job_id == job_id)
        ]

    async def wait_until(self, predicate: Callable[[], bool]) -> None:
        """Wait until ``predicate()`` holds, re-checked after every exchange."""
        while True:
            changed = self._changed.watch()  # before looking: no change slips between
            if predicate():
                return
            await changed.wait()

    # -- the transport --

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        # One checkpoint per request, whatever the fault: a loop that only makes
        # requests then still yields, and a simulation's stall guard sees it spin.
        await trio.lowlevel.checkpoint()
        if self.down:
            # A dead process sends nothing; its code may still be unwinding.
            raise httpx.ConnectError("the worker process is gone", request=request)
        endpoint = endpoint_of(request.url.path)
        if self.on_send is not None:
            request = self.on_send(endpoint, request)
        fault = self._outages.get(endpoint)
        if fault is None:
            queue = self._queued.get(endpoint)
            fault = queue.pop(0) if queue else Fault.OK
        if self.on_request is not None and fault in (Fault.OK, Fault.LOST):
            request = self.on_request(endpoint, request)
        counted: _Counted | None = None
        try:
            content = request.content
        except httpx.RequestNotRead:
            # A streamed body (output). Buffered: read whole before it goes on,
            # as a buffering proxy does (httpx keeps what was read). Otherwise
            # counted as the controller reads it, so that it still streams.
            content = await request.aread() if self.buffer_streams else b""
            if not self.buffer_streams and isinstance(request.stream, httpx.AsyncByteStream):
                counted = _Counted(request.stream)
                request.stream = counted
        status: int | None = None
        try:
            response = await self._answer(request, fault)
            status = response.status_code
            if self.on_answer is not None:
                await response.aread()
                self.on_answer(endpoint, request, status, _LazyJson(response.content))
            return response
        finally:
            text = "" if endpoint == "output" else content.decode("utf-8", "replace")
            self.log.append(
                Exchange(
                    trio.current_time(),
                    self.name,
                    endpoint,
                    request.url.path,
                    fault,
                    status,
                    len(content) if counted is None else counted.count,
                    text,
                )
            )
            self._changed.notify()

    async def _answer(self, request: httpx.Request, fault: Fault) -> httpx.Response:
        if fault is Fault.OK:
            return await self._inner.handle_async_request(request)
        if fault is Fault.LOST:
            response = await self._inner.handle_async_request(request)
            await response.aread()
            await response.aclose()
            raise httpx.ReadTimeout("injected: applied, but the answer was lost", request=request)
        if fault is Fault.TIMEOUT:
            await trio.sleep(self.timeout_s)
            raise httpx.ReadTimeout("injected: no answer", request=request)
        await trio.lowlevel.checkpoint()
        if fault is Fault.REFUSED:
            raise httpx.ConnectError("injected: connection refused", request=request)
        if fault is Fault.UNKNOWN_SESSION:
            return _error(409, "unknown_session", "injected: register again")
        if fault is Fault.RETRY_AFTER:
            return _error(
                503, "unavailable", "injected: come back later", headers={"Retry-After": "0"}
            )
        return _error(503, "unavailable", "injected: the controller is unavailable")

    async def aclose(self) -> None:
        # The controller outlives any one worker process: leave it open.
        await trio.lowlevel.checkpoint()


class _Counted(httpx.AsyncByteStream):
    """A streamed request body, counting the bytes read from it."""

    def __init__(self, inner: httpx.AsyncByteStream) -> None:
        self._inner = inner
        self.count = 0

    async def __aiter__(self) -> AsyncIterator[bytes]:
        async for chunk in self._inner:
            self.count += len(chunk)
            yield chunk

    async def aclose(self) -> None:
        await self._inner.aclose()


def _error(
    status: int, code: str, message: str, headers: Mapping[str, str] | None = None
) -> httpx.Response:
    return httpx.Response(status, json={"error": code, "message": message}, headers=headers)


def _check_fault(endpoint: str, fault: Fault) -> None:
    if endpoint not in ENDPOINTS:
        raise ValueError(f"no endpoint {endpoint!r}; expected one of {', '.join(ENDPOINTS)}")
    if endpoint == "register" and fault is Fault.UNKNOWN_SESSION:
        # No controller answers a register with unknown_session: it has no
        # session to forget. Simulating one would test a controller that cannot exist.
        raise ValueError(
            "register cannot meet unknown_session (a register has no session to forget); "
            "use Fault.UNAVAILABLE, REFUSED, TIMEOUT or LOST for register"
        )


class _LazyJson(Mapping[str, Any]):
    """An answer's :func:`json_body`, parsed only if a hook looks at it (most do not)."""

    def __init__(self, content: bytes) -> None:
        self._content = content
        self._body: Mapping[str, Any] | None = None

    def _parsed(self) -> Mapping[str, Any]:
        if self._body is None:
            self._body = json_body(self._content)
        return self._body

    def __getitem__(self, key: str) -> Any:
        return self._parsed()[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._parsed())

    def __len__(self) -> int:
        return len(self._parsed())


def json_body(content: bytes) -> Mapping[str, Any]:
    """A JSON object body, or ``{}`` for anything else."""
    try:
        body = json.loads(content or b"{}")
    except ValueError:
        return {}
    return body if isinstance(body, dict) else {}
