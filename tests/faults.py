"""Fault injection between the worker and the reference controller, on the real clock.

The transport is the fleet simulations' own, :class:`rc_worker.testing.FaultyTransport`
(one transport for both): it wraps the transport the worker talks through (the
ASGI transport of ``rc_worker.testing.local_system``) and, per endpoint, answers
requests with the faults of a plan, in order, before it lets them through:

- ``UNAVAILABLE``: a 503, nothing applied;
- ``RETRY_AFTER``: a 503 carrying ``Retry-After: 0``, nothing applied;
- ``REFUSED``: ``httpx.ConnectError``, as a down controller gives;
- ``TIMEOUT``: ``httpx.ReadTimeout`` before the request reaches the controller
  (at once here: these tests run on the real clock);
- ``LOST``: the request is forwarded and applied, then ``httpx.ReadTimeout``
  (the answer never arrived): the case only idempotency saves;
- ``UNKNOWN_SESSION``: a 409 ``unknown_session``, nothing applied.

``outage(endpoint, fault)`` answers every request to an endpoint with one
fault until ``restore(endpoint)``: a controller outage of any length.
Every exchange is logged, so a test can wait for "the worker tried to
finish" and check what the controller acknowledged.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import httpx
from hypothesis import strategies as st

from rc_worker.testing import transport
from rc_worker.testing.transport import Exchange, Fault, endpoint_of

__all__ = [
    "TRANSIENT_FAULTS",
    "WORKER_ENDPOINTS",
    "Exchange",
    "Fault",
    "FaultyTransport",
    "endpoint_of",
    "fault_plans",
]

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


class FaultyTransport(transport.FaultyTransport):
    """The fleet's transport on the real clock: a ``TIMEOUT`` fails at once, and a
    streamed body is read whole before it goes on (the tests count on each output
    request being over before the next fault applies)."""

    def __init__(
        self,
        inner: httpx.AsyncBaseTransport,
        plan: Mapping[str, Sequence[Fault]] | None = None,
    ) -> None:
        super().__init__(inner, plan, timeout_s=0.0, buffer_streams=True)


WORKER_ENDPOINTS = ("register", "heartbeat", "poll", "labels", "start", "output", "finish")


def fault_plans(max_faults: int = 3) -> st.SearchStrategy[dict[str, list[Fault]]]:
    """Per endpoint, the faults its first few requests meet (OK lets one through)."""
    one = st.sampled_from((Fault.OK, *TRANSIENT_FAULTS))
    return st.dictionaries(
        st.sampled_from(WORKER_ENDPOINTS),
        st.lists(one, min_size=1, max_size=max_faults),
        max_size=len(WORKER_ENDPOINTS),
    )
