"""An output body of declared length, over a real socket to the real HTTP server.

The worker sends a backlog of output with a ``Content-Length`` (``outbox.BULK_MIN``);
the in-process tests (``tests/test_output_bulk.py``) check when it does. Here the real
server (hypercorn, h11) and the worker's real client: every byte is appended, and a body
that breaks off before its declared end leaves at most a correct prefix, from which the
next request resumes.
"""

from __future__ import annotations

import logging
import random
from collections.abc import AsyncIterator

import httpx
import pytest
import trio

from rc_worker.client import ControllerClient
from rc_worker.controller import Store, create_app
from rc_worker.controller.serve import serve
from rc_worker.core.errors import ControllerError

from .helpers import USER_TOKENS, WORKER_TOKEN, WORKER_TOKENS, FakeWorker

MIB = 1 << 20


class BrokeOff(Exception):
    pass


async def test_a_body_of_declared_length_is_appended_and_a_broken_one_leaves_a_prefix(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO)
    store = Store(instance="t")
    app = create_app(store=store, worker_tokens=WORKER_TOKENS, user_tokens=USER_TOKENS)
    payload = random.Random(7).randbytes(3 * MIB + 12345)
    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            [url] = await nursery.start(serve, app, "127.0.0.1:0")
            async with httpx.AsyncClient(base_url=url) as http:
                w = FakeWorker(http)
                await w.register()
                job = store.submit(["x"])
                [a] = await w.poll(wait_s=1)
                await w.start(a)
                client = ControllerClient(http, host=w.host, token=WORKER_TOKEN)
                client.session = w.session
                attempt = a["attempt"]

                async def breaks_off() -> AsyncIterator[bytes]:
                    yield payload[:MIB]
                    raise BrokeOff

                with pytest.raises(BrokeOff):
                    await client.output(job, attempt, 0, breaks_off, length=len(payload))
                # The controller notices the broken body in its own time: said in one line,
                # not as its internal error with a traceback.
                for _ in range(500):  # bounded: 5 s
                    if any("broke off its output" in r.getMessage() for r in caplog.records):
                        break
                    await trio.sleep(0.01)
                assert any("broke off its output" in r.getMessage() for r in caplog.records)
                assert [r for r in caplog.records if r.levelno >= logging.ERROR] == []
                held = store.committed(job)
                # One that breaks off beyond what the controller holds (a gap): it stops
                # storing, reads the rest to answer 409, and meets the hang-up there.
                said = len(caplog.records)
                with pytest.raises((BrokeOff, ControllerError)):
                    await client.output(job, attempt, held + 5, breaks_off, length=len(payload))
                gone = "hung up while its refused output was read"
                for _ in range(500):  # bounded: the controller's side ends in its own time
                    if any(gone in r.getMessage() for r in caplog.records[said:]):
                        break
                    await trio.sleep(0.01)
                assert any(gone in r.getMessage() for r in caplog.records[said:])
                assert [r for r in caplog.records[said:] if r.levelno >= logging.ERROR] == []
                assert store.committed(job) == held
                assert held <= MIB
                assert store.output(job) == payload[:held]

                async def rest() -> AsyncIterator[bytes]:
                    for i in range(held, len(payload), MIB):
                        yield payload[i : i + MIB]

                committed = await client.output(
                    job, attempt, held, rest, length=len(payload) - held
                )
                assert committed == len(payload)
                assert store.output(job) == payload
            nursery.cancel_scope.cancel()
