"""The controller's connection reads (``serve._GrowingReads``): 64 KiB while a peer's reads
come back short, up to 256 KiB while it keeps them full, over a real socket pair."""

from __future__ import annotations

import trio
import trio.testing

from rc_worker.controller.serve import _GrowingReads


class Recording(trio.abc.HalfCloseableStream):
    """A stream that hands out what it is given and records each read's size."""

    def __init__(self, inner: trio.abc.HalfCloseableStream) -> None:
        self.inner = inner
        self.reads: list[tuple[int | None, int]] = []  # (asked for, got)

    async def receive_some(self, max_bytes: int | None = None) -> bytes | bytearray:
        data = await self.inner.receive_some(max_bytes)
        self.reads.append((max_bytes, len(data)))
        return data

    async def send_all(self, data: bytes | bytearray | memoryview) -> None:
        await self.inner.send_all(data)

    async def wait_send_all_might_not_block(self) -> None:
        await self.inner.wait_send_all_might_not_block()

    async def send_eof(self) -> None:
        await self.inner.send_eof()

    async def aclose(self) -> None:
        await self.inner.aclose()


async def test_reads_grow_while_full_and_shrink_after_a_short_one() -> None:
    a, b = trio.socket.socketpair()
    ours, peer = trio.SocketStream(a), trio.SocketStream(b)
    recording = Recording(ours)
    reads = _GrowingReads(recording)
    async with peer, recording:
        await peer.send_all(b"x" * 100)  # a heartbeat-sized request
        assert await reads.receive_some(1 << 16) == b"x" * 100
        await peer.send_all(b"y" * (3 << 16))  # a body arriving faster than it is read
        got = await reads.receive_some(1 << 16)
        assert got == b"y" * (1 << 16)  # the first read is still 64 KiB, and comes back full
        rest = b""
        while len(rest) < 2 << 16:
            rest += await reads.receive_some(1 << 16)
        assert rest == b"y" * (2 << 16)
        await peer.send_all(b"z")
        assert await reads.receive_some(1 << 16) == b"z"
        # Sending and closing are the stream's own (hypercorn calls them through this).
        await reads.send_all(b"answer")
        assert await peer.receive_some(100) == b"answer"
    asked = [n for n, _ in recording.reads]
    assert asked[:3] == [1 << 16, 1 << 16, _GrowingReads.LARGE]
    # Every read after a full one asks for the larger size; every read after a short one, 64 KiB.
    for (size, got), (after, _) in zip(recording.reads, recording.reads[1:], strict=False):
        assert after == (_GrowingReads.LARGE if got >= (size or 0) else 1 << 16)
    assert asked[-1] == 1 << 16  # the "z" after the body's last, short, read
