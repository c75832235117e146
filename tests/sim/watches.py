"""Counting a simulated worker's host watches (polls with ``watch_cancels``): a watch that
is answered again and again at one instant is a worker burning a core."""

from __future__ import annotations

import httpx

from rc_worker.testing.fleet import Fleet


class WatchCount:
    """How many watch polls ``host``'s worker has sent since it was made (or ``n = 0``)."""

    def __init__(self, fleet: Fleet, host: str) -> None:
        self.n = 0
        node = fleet.nodes[host]
        hook = node.transport.on_request
        assert hook is not None

        def counting(endpoint: str, request: httpx.Request) -> httpx.Request:
            if endpoint == "poll" and b'"watch_cancels":true' in request.content.replace(b" ", b""):
                self.n += 1
            return hook(endpoint, request)

        node.transport.on_request = counting
