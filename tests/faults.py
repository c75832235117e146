"""Fault injection between the worker and the reference controller.

``FaultyTransport`` wraps the transport the worker talks through (the ASGI
transport of ``rc_worker.testing.local_system``) and, per endpoint, answers
requests with the faults of a plan, in order, before it lets them through:

- ``UNAVAILABLE``: a 503, nothing applied;
- ``RETRY_AFTER``: a 503 carrying ``Retry-After: 0``, nothing applied;
- ``REFUSED``: ``httpx.ConnectError``, as a down controller gives;
- ``TIMEOUT``: ``httpx.ReadTimeout`` before the request reaches the controller;
- ``LOST``: the request is forwarded and applied, then ``httpx.ReadTimeout``
  (the answer never arrived): the case only idempotency saves;
- ``UNKNOWN_SESSION``: a 409 ``unknown_session``, nothing applied.

``outage(endpoint, fault)`` answers every request to an endpoint with one
fault until ``restore(endpoint)``: a controller outage of any length.
Every exchange is logged, so a test can wait for "the worker tried to
finish" and check what the controller acknowledged.
"""

from __future__ import annotations

import enum
import re
from collections.abc import Callable, Mapping, Sequence

import attrs
import httpx
import trio
from hypothesis import strategies as st

from rc_worker.changed import Changed

# One table of the worker's endpoints, shared with the fleet harness.
from rc_worker.testing.fleet import ENDPOINTS


class Fault(enum.Enum):
    OK = "ok"
    UNAVAILABLE = "503"
    RETRY_AFTER = "503 retry-after"
    REFUSED = "connection refused"
    TIMEOUT = "timeout"
    LOST = "applied, answer lost"
    UNKNOWN_SESSION = "409 unknown_session"


# The faults every worker endpoint must survive without losing or doubling
# anything. UNKNOWN_SESSION is left out: what a re-registration does to the
# controller's view of running jobs is tested on its own (test_delivery).
TRANSIENT_FAULTS = (
    Fault.UNAVAILABLE,
    Fault.RETRY_AFTER,
    Fault.REFUSED,
    Fault.TIMEOUT,
    Fault.LOST,
)


@attrs.frozen
class Exchange:
    endpoint: str
    path: str
    fault: Fault
    status: int | None  # None: no answer reached the worker
    body_bytes: int
    job_id: str | None
    body: str = ""  # the request's JSON text; empty for output (raw bytes)


def endpoint_of(path: str) -> str:
    for name, pattern in ENDPOINTS.items():
        if pattern.match(path):
            return name
    return "other"


def _job_id(path: str) -> str | None:
    m = re.match(r"^/v1/jobs/([^/]+)/", path)
    return m.group(1) if m else None


class FaultyTransport(httpx.AsyncBaseTransport):
    """Delegates to ``inner``, injecting the planned faults per endpoint."""

    def __init__(
        self,
        inner: httpx.AsyncBaseTransport,
        plan: Mapping[str, Sequence[Fault]] | None = None,
    ) -> None:
        unknown = set(plan or {}) - set(ENDPOINTS)
        assert not unknown, f"no such endpoints: {unknown}"
        self._inner = inner
        self._plan = {name: list(faults) for name, faults in (plan or {}).items()}
        self._outages: dict[str, Fault] = {}
        self.log: list[Exchange] = []
        self._changed = Changed()

    # -- what tests drive ----------------------------------------------------

    def inject(self, endpoint: str, *faults: Fault) -> None:
        """Queue ``faults`` for the next requests to ``endpoint``."""
        assert endpoint in ENDPOINTS
        self._plan.setdefault(endpoint, []).extend(faults)

    def pending(self, endpoint: str) -> int:
        """How many planned faults for ``endpoint`` no request has met yet."""
        return len(self._plan.get(endpoint, ()))

    def outage(self, endpoint: str, fault: Fault = Fault.UNAVAILABLE) -> None:
        assert endpoint in ENDPOINTS
        self._outages[endpoint] = fault

    def restore(self, endpoint: str) -> None:
        self._outages.pop(endpoint, None)

    def exchanges(self, endpoint: str, job_id: str | None = None) -> list[Exchange]:
        return [
            e for e in self.log if e.endpoint == endpoint and (job_id is None or e.job_id == job_id)
        ]

    async def wait_until(self, predicate: Callable[[], bool]) -> None:
        """Wait until ``predicate()`` holds, re-checked after every exchange."""
        while not predicate():
            await self._changed.wait()

    # -- the transport -------------------------------------------------------

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        path = request.url.path
        endpoint = endpoint_of(path)
        fault = self._outages.get(endpoint)
        if fault is None:
            queue = self._plan.get(endpoint)
            fault = queue.pop(0) if queue else Fault.OK
        try:
            content = request.content
        except httpx.RequestNotRead:
            # A streamed body (output): read it here to log its size; httpx
            # keeps what was read, so the controller still gets all of it.
            content = await request.aread()
        text = "" if endpoint == "output" else content.decode("utf-8", "replace")
        status: int | None = None
        try:
            response = await self._answer(request, fault)
            status = response.status_code
            return response
        finally:
            self.log.append(
                Exchange(endpoint, path, fault, status, len(content), _job_id(path), text)
            )
            self._changed.notify()

    async def _answer(self, request: httpx.Request, fault: Fault) -> httpx.Response:
        if fault is Fault.OK:
            return await self._inner.handle_async_request(request)
        if fault is Fault.UNAVAILABLE:
            await trio.lowlevel.checkpoint()
            return _error(503, "unavailable", "injected: the controller is unavailable")
        if fault is Fault.RETRY_AFTER:
            await trio.lowlevel.checkpoint()
            return _error(
                503, "unavailable", "injected: come back later", headers={"Retry-After": "0"}
            )
        if fault is Fault.UNKNOWN_SESSION:
            await trio.lowlevel.checkpoint()
            return _error(409, "unknown_session", "injected: register again")
        if fault is Fault.REFUSED:
            await trio.lowlevel.checkpoint()
            raise httpx.ConnectError("injected: connection refused", request=request)
        if fault is Fault.TIMEOUT:
            await trio.lowlevel.checkpoint()
            raise httpx.ReadTimeout("injected: timed out before it arrived", request=request)
        assert fault is Fault.LOST
        response = await self._inner.handle_async_request(request)
        await response.aread()
        await response.aclose()
        raise httpx.ReadTimeout("injected: applied, but the answer was lost", request=request)

    async def aclose(self) -> None:
        await self._inner.aclose()


def _error(
    status: int, code: str, message: str, headers: Mapping[str, str] | None = None
) -> httpx.Response:
    return httpx.Response(status, json={"error": code, "message": message}, headers=headers)


WORKER_ENDPOINTS = ("register", "heartbeat", "poll", "labels", "start", "output", "finish")


def fault_plans(max_faults: int = 3) -> st.SearchStrategy[dict[str, list[Fault]]]:
    """Per endpoint, the faults its first few requests meet (OK lets one through)."""
    one = st.sampled_from((Fault.OK, *TRANSIENT_FAULTS))
    return st.dictionaries(
        st.sampled_from(WORKER_ENDPOINTS),
        st.lists(one, min_size=1, max_size=max_faults),
        max_size=len(WORKER_ENDPOINTS),
    )
