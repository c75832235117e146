"""read_bounded: an answer's body read whole, but never without bound."""

from __future__ import annotations

from collections.abc import AsyncIterator

import httpx
import pytest

from rc_worker.http_body import read_bounded

CHUNK = 64 * 1024


# httpx leaves its inner generators to the collector when a stream is left unfinished.
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
async def test_an_endless_answer_is_refused_after_the_limit_and_one_chunk() -> None:
    sent = 0

    async def endless() -> AsyncIterator[bytes]:
        nonlocal sent
        while True:
            sent += CHUNK
            yield b"x" * CHUNK

    def answer(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, content=endless())

    async with (
        httpx.AsyncClient(transport=httpx.MockTransport(answer)) as client,
        client.stream("GET", "http://peer/") as response,
    ):
        assert await read_bounded(response, 1 << 20) is None
    assert sent <= (1 << 20) + CHUNK


async def test_an_answer_within_the_limit_is_read_whole() -> None:
    body = bytes(range(256)) * 1000

    def answer(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, content=body)

    async with (
        httpx.AsyncClient(transport=httpx.MockTransport(answer)) as client,
        client.stream("GET", "http://peer/") as response,
    ):
        assert await read_bounded(response, len(body)) == body
