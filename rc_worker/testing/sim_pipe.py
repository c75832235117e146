"""Simulated pipes: a small buffer, one reader, any number of writers.

A writer blocks while the pipe is full and gets EPIPE (``_BrokenPipe``, which the
simulated host turns into SIGPIPE) once its reader has gone.
"""

from __future__ import annotations

import trio

__all__ = ["DEFAULT_PIPE_CAPACITY", "SimPipe"]

DEFAULT_PIPE_CAPACITY = 4096
"""Bytes a simulated pipe holds: small, so that backpressure is exercised."""


class _BrokenPipe(Exception):
    """The reader has gone: EPIPE, which a writer's default disposition turns into SIGPIPE."""


class SimPipe:
    """A pipe with a small buffer: one reader, any number of writers.

    ``written`` is every byte that got into the pipe and ``read`` every byte
    the reader took out, both in order: what a job printed, and what the
    worker saw of it. ``lost_in_reader`` is the end of ``read`` that the reader
    took out in the instant it was killed (:meth:`sever`), before its read
    returned: a read(2) whose process was SIGKILLed before its next step, the
    bytes gone with its memory.
    """

    def __init__(self, capacity: int = DEFAULT_PIPE_CAPACITY) -> None:
        if capacity <= 0:
            raise ValueError(f"a pipe's capacity must be at least 1 byte, got {capacity}")
        self.capacity = capacity
        self.written = bytearray()
        self.read = bytearray()
        self._buffer = bytearray()
        self._writers = 0
        self._reader_open = True
        self._severed = False
        self._taking = b""
        self.lost_in_reader = b""
        self._lot = trio.lowlevel.ParkingLot()

    @property
    def writers(self) -> int:
        """How many ends are open for writing."""
        return self._writers

    def add_writer(self) -> None:
        self._writers += 1

    def close_writer(self) -> None:
        self._writers -= 1
        self._lot.unpark_all()

    def close_reader(self) -> None:
        self._reader_open = False
        self._buffer.clear()
        self._lot.unpark_all()

    def sever(self) -> None:
        """The reading process died: writers get SIGPIPE, its old end reads EOF."""
        self.lost_in_reader = self._taking
        self._severed = True
        self.close_reader()

    async def write(self, data: bytes) -> None:
        """Put all of ``data`` in, blocking while full. Raises ``_BrokenPipe``."""
        await trio.lowlevel.checkpoint_if_cancelled()
        view = memoryview(data)
        while view:
            if not self._reader_open:
                raise _BrokenPipe
            room = self.capacity - len(self._buffer)
            if room <= 0:
                await self._lot.park()
                continue
            piece = bytes(view[:room])
            view = view[room:]
            self._buffer += piece
            self.written += piece
            self._lot.unpark_all()
        await trio.lowlevel.cancel_shielded_checkpoint()

    async def receive(self, max_bytes: int) -> bytes:
        """Up to ``max_bytes``; ``b""`` at end of file (every writer gone)."""
        await trio.lowlevel.checkpoint_if_cancelled()
        while True:
            if self._severed:
                piece = b""
                break
            if not self._reader_open:
                raise trio.ClosedResourceError("this end of the pipe was already closed")
            if self._buffer:
                piece = bytes(self._buffer[:max_bytes])
                del self._buffer[:max_bytes]
                self.read += piece
                self._taking = piece
                self._lot.unpark_all()
                break
            if self._writers <= 0:
                piece = b""
                break
            await self._lot.park()
        # Taken before this point, so a cancellation here must not lose it; a kill
        # here does (`sever`), as a SIGKILL between a read(2) and the caller's next step.
        await trio.lowlevel.cancel_shielded_checkpoint()
        self._taking = b""
        return piece


class _PipeReader(trio.abc.ReceiveStream):
    def __init__(self, pipe: SimPipe) -> None:
        self._pipe = pipe
        self._closed = False

    async def receive_some(self, max_bytes: int | None = None) -> bytes:
        if self._closed:
            raise trio.ClosedResourceError("the stream was already closed")
        return await self._pipe.receive(max_bytes or 65536)

    async def aclose(self) -> None:
        if not self._closed:
            self._closed = True
            self._pipe.close_reader()
        await trio.lowlevel.checkpoint()


class _PipeWriter(trio.abc.SendStream):
    def __init__(self, pipe: SimPipe) -> None:
        self._pipe = pipe
        self._closed = False

    async def send_all(self, data: bytes | bytearray | memoryview) -> None:
        if self._closed:
            raise trio.ClosedResourceError("the stream was already closed")
        try:
            await self._pipe.write(bytes(data))
        except _BrokenPipe:
            raise trio.BrokenResourceError("the process no longer reads its input") from None

    async def wait_send_all_might_not_block(self) -> None:
        await trio.lowlevel.checkpoint()

    def drop(self) -> None:
        if not self._closed:
            self._closed = True
            self._pipe.close_writer()

    async def aclose(self) -> None:
        self.drop()
        await trio.lowlevel.checkpoint()
