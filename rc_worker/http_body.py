"""Reading an HTTP answer's body whole, bounded in size.

The worker's controller client and ``rc`` both read answers whole (a JSON body, an
error answer to a streamed request). The other end may be anything a URL points at: an
endless answer would grow the reader until it is killed. Each caller says what passing
the bound means to it (a transient failure for the worker, a one-line error for ``rc``).
"""

from __future__ import annotations

import httpx


async def read_bounded(response: httpx.Response, limit: int) -> bytes | None:
    """The body of the streamed ``response``, or None as soon as it passes ``limit``
    bytes: never more than ``limit`` and one chunk held."""
    data = bytearray()
    async for chunk in response.aiter_bytes():
        data += chunk
        if len(data) > limit:
            return None
    return bytes(data)
