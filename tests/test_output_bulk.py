"""A backlog of output goes out as requests of declared length; a short read falls back.

With the spool ahead of what the controller holds, the worker sends each request's
bytes with a ``Content-Length`` rather than as a chunked stream (h11 copies each chunk
of a chunked body to frame it). These tests check the framing the worker chooses, that
every byte still arrives once and in order (in process, through the fault transport,
and over a real socket to the real HTTP server), and that a spool giving back fewer
bytes than it holds never sends a body shorter than it declared: the worker streams
instead.
"""

from __future__ import annotations

import errno
import logging
import tempfile
from pathlib import Path

import httpx
import pytest
import trio
from faults import TRANSIENT_FAULTS, Fault, FaultyTransport, fault_plans
from hypothesis import HealthCheck, given, settings
from test_delivery import (
    JOB_OUTPUT,
    Wrap,
    assert_delivered_once,
    run_one_job,
    spool_file,
    steady_store,
    wait_for,
)

from rc_worker import client as client_module
from rc_worker import outbox as outbox_module
from rc_worker.controller import Store
from rc_worker.spool import OutputSpool
from rc_worker.testing import local_system, make_config

SIZE = 600_000
REQUEST = 64 * 1024


@pytest.fixture(autouse=True)
def small_sizes(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(client_module, "RETRY_BASE_S", 0.005)
    monkeypatch.setattr(client_module, "RETRY_CAP_S", 0.05)
    monkeypatch.setattr(outbox_module, "CHUNK", 16 * 1024)
    monkeypatch.setattr(outbox_module, "REQUEST_MAX", REQUEST)
    monkeypatch.setattr(outbox_module, "BULK_MIN", 32 * 1024)


class Recording(Wrap):
    """The fault transport, keeping the framing of each output request the worker made:
    its Content-Length and Transfer-Encoding headers."""

    def __init__(self) -> None:
        super().__init__()
        self.framing: list[tuple[str | None, str | None]] = []

    def __call__(self, inner: httpx.AsyncBaseTransport) -> FaultyTransport:
        t = super().__call__(inner)
        t.on_send = self._record
        return t

    def _record(self, endpoint: str, request: httpx.Request) -> httpx.Request:
        if endpoint == "output":
            headers = request.headers
            self.framing.append((headers.get("content-length"), headers.get("transfer-encoding")))
        return request


async def _backlog_then_ship(tmp_path: Path, wrap: Wrap) -> tuple[Store, str, bytes]:
    """A job writes ``SIZE`` bytes while output is refused, so that they pile up in the
    spool; then output is let through and the job is waited for."""
    go = tmp_path / "go"
    command = [
        "sh",
        "-c",
        f"echo first; while [ ! -e {go} ]; do sleep 0.01; done; "
        f"head -c {SIZE} /dev/urandom | od -An -v -tx1 | head -c {SIZE}; echo last",
    ]
    store = steady_store()
    job_id = store.submit(command)
    config = make_config(tmp_path)
    with trio.fail_after(60):
        async with local_system(config, store=store, transport_wrapper=wrap) as system:
            await wait_for(system, lambda: store.committed(job_id) == len(b"first\n"))
            wrap.t.outage("output", Fault.REFUSED)
            go.touch()
            spool = spool_file(config, job_id)
            await wait_for(system, lambda: spool.stat().st_size == 6 + SIZE + 5)
            expected = spool.read_bytes()
            wrap.t.restore("output")
            info = await system.wait_job(job_id)
    assert_delivered_once(info, store, config, expected)
    return store, job_id, expected


async def test_a_backlog_is_sent_in_requests_of_declared_length(tmp_path: Path) -> None:
    wrap = Recording()
    await _backlog_then_ship(tmp_path, wrap)
    declared = [int(n) for n, chunked in wrap.framing if n is not None and chunked is None]
    # The backlog left after the outage goes as whole requests of REQUEST_MAX bytes...
    assert declared.count(REQUEST) >= (SIZE - 2 * REQUEST) // REQUEST, wrap.framing
    # ...and no request both declares a length and is chunked.
    assert all(n is None or chunked is None for n, chunked in wrap.framing), wrap.framing


async def test_a_short_read_of_the_spool_falls_back_to_a_streamed_body(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The spool gives back one byte less, once, in the middle of a request of declared
    length: that request breaks off (never a body shorter than declared, which the
    controller would take as whole), the worker logs it and streams the rest; every
    byte arrives once."""
    real_read = OutputSpool.read
    shorted: list[int] = []

    def read(self: OutputSpool, offset: int, limit: int) -> bytes:
        data = real_read(self, offset, limit)
        # Well into the backlog, which only requests of declared length carry.
        if not shorted and offset >= len(b"first\n") + REQUEST and len(data) == limit > 1:
            shorted.append(offset)
            return data[:-1]
        return data

    monkeypatch.setattr(OutputSpool, "read", read)
    wrap = Recording()
    caplog.set_level(logging.WARNING, logger="rc_worker.outbox")
    await _backlog_then_ship(tmp_path, wrap)
    assert shorted, "the short read never happened"
    assert any("streaming its output instead" in r.getMessage() for r in caplog.records)
    framing = wrap.framing
    # The request that met the short read declared its length; none after it does.
    broken = max(i for i, (n, chunked) in enumerate(framing) if n is not None and n != "0")
    later = framing[broken + 1 :]
    assert later, framing
    assert all(chunked == "chunked" for _, chunked in later), framing


# -- faults on requests of declared length ------------------------------------------

# JOB_OUTPUT in one write (printf's stdout is buffered to its exit): a backlog of 35 bytes
# at once, over the BULK_MIN these tests set.
ONE_WRITE = ["printf", JOB_OUTPUT.decode().replace("\n", "\\n")]


@pytest.fixture
def tiny_bulk(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Requests of declared length for any backlog of 8 bytes or more, read 8 bytes at a
    time; returns the lengths of the bodies declared."""
    monkeypatch.setattr(outbox_module, "CHUNK", 8)
    monkeypatch.setattr(outbox_module, "BULK_MIN", 8)
    declared: list[int] = []
    real = outbox_module._exactly

    def counting(d: object, start: int, length: int) -> object:
        declared.append(length)
        return real(d, start, length)  # type: ignore[arg-type]

    monkeypatch.setattr(outbox_module, "_exactly", counting)
    return declared


async def test_every_fault_on_a_request_of_declared_length_loses_and_doubles_nothing(
    tmp_path: Path, tiny_bulk: list[int]
) -> None:
    """503, 503 with Retry-After, refused, timed out, and applied-but-answer-lost on the
    output requests: each retry declares the length from the controller's offset."""
    with trio.fail_after(30):
        info, store, faults, config = await run_one_job(
            tmp_path, {"output": TRANSIENT_FAULTS}, wait_for_faults=["output"], command=ONE_WRITE
        )
    assert_delivered_once(info, store, config)
    met = [e.fault for e in faults.log if e.endpoint == "output" and e.fault is not Fault.OK]
    assert met == list(TRANSIENT_FAULTS)
    assert tiny_bulk
    assert tiny_bulk[0] == len(JOB_OUTPUT)


@settings(
    max_examples=8,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(plan=fault_plans())
async def test_any_mix_of_faults_with_declared_lengths_loses_and_doubles_nothing(
    tmp_path: Path, tiny_bulk: list[int], plan: dict[str, list[Fault]]
) -> None:
    tiny_bulk.clear()
    with trio.fail_after(30):
        info, store, _, config = await run_one_job(
            Path(tempfile.mkdtemp(dir=tmp_path)),
            plan,
            wait_for_faults=[e for e in plan if e == "heartbeat"],
            command=ONE_WRITE,
        )
    assert_delivered_once(info, store, config)
    assert tiny_bulk


@pytest.mark.parametrize("how", ["short", "EIO"])
async def test_a_spool_that_reads_back_short_for_good_ends_the_delivery(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, how: str
) -> None:
    """Past some offset the spool gives back nothing, for good (its file cut under the
    worker), or fails to read (a failing disk): resending an empty body would loop for
    ever and the finish never go, and an exception would take the worker down. The
    delivery says so once, and the job's finish goes with the output it could send."""
    cut = 100_000
    real_read = OutputSpool.read

    def read(self: OutputSpool, offset: int, limit: int) -> bytes:
        if offset < cut:
            return real_read(self, offset, min(limit, cut - offset))
        if how == "EIO":
            raise OSError(errno.EIO, "Input/output error")
        return b""

    monkeypatch.setattr(OutputSpool, "read", read)
    store = steady_store()
    job_id = store.submit(["head", "-c", "200000", "/dev/zero"])
    wrap = Recording()
    caplog.set_level(logging.WARNING, logger="rc_worker.outbox")
    with trio.fail_after(30):
        async with local_system(make_config(tmp_path), store=store, transport_wrapper=wrap) as s:
            info = await s.wait_job(job_id)
    assert info.state == "succeeded"
    assert store.committed(job_id) == cut
    said = [r.getMessage() for r in caplog.records if "cannot be read past" in r.getMessage()]
    assert len(said) == 1
    assert f"offset {cut}" in said[0]
    assert len(wrap.t.exchanges("output")) < 20  # no loop of empty bodies
