"""A job's standard input: from a user's ``PUT /v1/jobs/{id}/stdin`` to the worker's ``GET``.

Memory is bounded: the pipe holds at most :data:`PIPE_BOUND` bytes, and the
user's upload waits (backpressure) until the worker reads. The stream is
one-shot, not replayable: bytes handed to one ``GET`` are gone, and a second
``GET`` for the same attempt carries on from where the pipe is. The pipe ends
(EOF) when the upload ends, or when the user's connection drops; it is
dropped when the job ends, and a waiting upload is then answered
``409 finished``.
"""

from __future__ import annotations

from collections.abc import AsyncIterable, AsyncIterator
from typing import TYPE_CHECKING, Final

import attrs

from rc_worker.controller.errors import Conflict

if TYPE_CHECKING:
    from rc_worker.controller.context import Changes, Controller

PIPE_BOUND: Final = 1024 * 1024
"""Big enough to absorb a burst of typing or a small file; small enough for many jobs at once."""
CHUNK: Final = 64 * 1024


@attrs.define
class _Pipe:
    buffer: bytearray = attrs.Factory(bytearray)
    eof: bool = False
    writing: bool = False
    accepted: int = 0


class StdinPipes:
    def __init__(self, changes: Changes) -> None:
        self._pipes: dict[str, _Pipe] = {}
        self._changes = changes

    def _pipe(self, job_id: str) -> _Pipe:
        return self._pipes.setdefault(job_id, _Pipe())

    def _drop_if_over(self, ctl: Controller, job_id: str) -> None:
        if ctl.store.job(job_id).terminal:
            self._pipes.pop(job_id, None)

    async def feed(self, ctl: Controller, job_id: str, body: AsyncIterable[bytes]) -> int:
        """Push an upload into the job's pipe; returns the bytes accepted."""
        job = ctl.store.job(job_id)
        if not job.spec.stdin:
            raise Conflict(f"job {job_id} was not submitted with stdin", code="no_stdin")
        if job.terminal:
            raise Conflict(f"job {job_id} already ended ({job.state})", code="finished")
        pipe = self._pipe(job_id)
        if pipe.writing:
            raise Conflict(f"job {job_id}: another upload is in progress", code="stdin_busy")
        if pipe.eof:
            raise Conflict(f"job {job_id}: its stdin was already closed", code="stdin_closed")
        pipe.writing = True
        try:
            async for chunk in body:
                for i in range(0, len(chunk), CHUNK):
                    await self._wait_for_room(ctl, job_id, pipe)
                    pipe.buffer += chunk[i : i + CHUNK]
                    pipe.accepted += len(chunk[i : i + CHUNK])
                    self._changes.poke()
        finally:
            # A dropped upload ends the input too: the job sees EOF rather than hanging.
            pipe.writing = False
            pipe.eof = True
            self._changes.poke()
            self._drop_if_over(ctl, job_id)
        return pipe.accepted

    async def _wait_for_room(self, ctl: Controller, job_id: str, pipe: _Pipe) -> None:
        while len(pipe.buffer) >= PIPE_BOUND:
            seen = ctl.changes.version
            ctl.tick()
            job = ctl.store.job(job_id)
            if job.terminal:
                raise Conflict(
                    f"job {job_id} ended ({job.state}) before reading all of its stdin; "
                    f"{pipe.accepted - len(pipe.buffer)} bytes were delivered",
                    code="finished",
                )
            await ctl.wait_change(seen, None)

    async def drain(self, ctl: Controller, job_id: str, attempt: int) -> AsyncIterator[bytes]:
        """Yield the pipe's bytes as they come, until EOF, the job ends, or the attempt is stale."""
        pipe = self._pipe(job_id)
        try:
            while True:
                seen = ctl.changes.version
                ctl.tick()
                if pipe.buffer:
                    data = bytes(pipe.buffer[:CHUNK])
                    del pipe.buffer[:CHUNK]
                    self._changes.poke()
                    yield data
                    continue
                job = ctl.store.job(job_id)
                if pipe.eof or job.terminal or job.attempt != attempt:
                    return
                await ctl.wait_change(seen, None)
        finally:
            self._drop_if_over(ctl, job_id)
