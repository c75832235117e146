"""Following a job through a controller that answers 503 for a while: the retry schedule
(:func:`rc_follow.retry_delay`) and ``rc logs -f`` in-process on a virtual clock."""

from __future__ import annotations

import io
import sys
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
import trio
import trio.testing
from hypothesis import example, given
from hypothesis import strategies as st

from rc_worker.controller import rc_cli, rc_follow

ENV = {"RC_URL": "http://rc", "RC_USER_TOKEN": "ut"}
NOT_FOUND = {"error": "not_found", "message": "no job j-1"}
STORE_UNAVAILABLE = {
    "error": "store_unavailable",
    "message": "the controller could not read this output (disk I/O error)",
}


def streamed(data: bytes) -> httpx.Response:
    """A 200 answer that is streamed, as a followed output is (rc reads it raw)."""

    async def body() -> AsyncIterator[bytes]:
        yield data

    return httpx.Response(200, content=body())


seconds = st.floats(min_value=0, max_value=1e6, allow_nan=False)


@given(
    failures=st.integers(min_value=1, max_value=1000),
    left=seconds,
    retry_after=st.none() | seconds,
)
def test_the_delay_honours_retry_after_but_never_passes_the_window(
    failures: int, left: float, retry_after: float | None
) -> None:
    delay = rc_follow.retry_delay(failures, left, retry_after)
    assert 0 <= delay <= left
    assert delay <= max(rc_follow.RETRY_MAX_S, retry_after or 0)
    if retry_after is not None:
        assert delay >= min(retry_after, left)  # a floor, up to the window's end
    # Without Retry-After, the usual backoff: never shorter after more failures.
    assert rc_follow.retry_delay(failures + 1, left) >= rc_follow.retry_delay(failures, left)


async def test_a_503_is_waited_out_at_its_retry_after_and_the_output_resumes(
    autojump_clock: trio.testing.MockClock, capsys: pytest.CaptureFixture[str]
) -> None:
    # The controller's store cannot be read for a while (503 store_unavailable with
    # Retry-After), on the output and on the job's record: rc logs -f waits it out, trying
    # again when told, and resumes at the offset it has (it stopped at the first 503).
    asked: list[tuple[float, str, str | None]] = []
    unavailable = {"output": 2, "record": 1}

    def handler(request: httpx.Request) -> httpx.Response:
        offset = request.url.params.get("offset")
        asked.append((trio.current_time(), request.url.path, offset))
        what = "output" if request.url.path.endswith("/output") else "record"
        if offset == "0":  # the first request: part of the output, then the stream drops
            return streamed(b"part one\n")
        if unavailable[what]:
            unavailable[what] -= 1
            return httpx.Response(503, json=STORE_UNAVAILABLE, headers={"Retry-After": "7"})
        if what == "output":
            return streamed(b"part two\n")
        return httpx.Response(
            200, json={"job_id": "j-1", "state": "succeeded", "committed_bytes": 18}
        )

    start = trio.current_time()
    argv = ["logs", "-f", "--reconnect", "1m", "j-1"]
    status = await rc_cli.amain(argv, env=ENV, transport=httpx.MockTransport(handler))
    out, err = capsys.readouterr()
    assert (status, err) == (0, "")
    assert out == "part one\npart two\n"  # resumed at byte 9: nothing twice, nothing lost
    output, record = "/v1/jobs/j-1/output", "/v1/jobs/j-1"
    assert [(t - start, path, offset) for t, path, offset in asked] == [
        (0, output, "0"),
        (0, record, None),  # the stream ended: is the job over? (it was not: 503)
        (7, record, None),  # ended, with 18 bytes of output: read the rest
        (7, output, "9"),
        (14, output, "9"),
        (21, output, "9"),
        (21, record, None),
    ]


async def test_a_controller_unavailable_for_the_whole_window_is_exit_3(
    autojump_clock: trio.testing.MockClock, capsys: pytest.CaptureFixture[str]
) -> None:
    # A Retry-After longer than what is left of --reconnect: the last try is at the window's
    # end, not an hour later; then the one line of a lost controller, status 3.
    asked: list[float] = []

    def handler(request: httpx.Request) -> httpx.Response:
        asked.append(trio.current_time())
        headers = {"Retry-After": "10" if len(asked) < 3 else "3600"}
        return httpx.Response(503, json=STORE_UNAVAILABLE, headers=headers)

    start = trio.current_time()
    argv = ["logs", "-f", "--reconnect", "25s", "j-1"]
    status = await rc_cli.amain(argv, env=ENV, transport=httpx.MockTransport(handler))
    out, err = capsys.readouterr()
    assert status == rc_cli.EXIT_CONTROLLER_GONE
    assert out == ""
    assert [t - start for t in asked] == [0, 10, 20, 25]
    assert err == (
        "rc: lost the controller at http://rc while following job j-1 (unavailable for 25s; "
        f"503 store_unavailable: {STORE_UNAVAILABLE['message']}); "
        "the job may still run: rc logs -f j-1\n"
    )


def proxy_answer(status: int) -> httpx.Response:
    """What a reverse proxy answers while the controller behind it is down: its own page."""
    page = f"<html><head><title>{status}</title></head><body>nginx</body></html>\r\n"
    return httpx.Response(status, content=page.encode(), headers={"Content-Type": "text/html"})


@pytest.mark.parametrize("status", [502, 504])
async def test_a_proxys_502_or_504_is_waited_out_and_the_output_resumes(
    autojump_clock: trio.testing.MockClock, capsys: pytest.CaptureFixture[str], status: int
) -> None:
    # A reverse proxy in front of the controller answers 502 (connection refused) or 504
    # (no answer in time) while the controller restarts, on the output and on the record:
    # rc logs -f waits it out as a 503 and resumes at the offset it has (it stopped at once
    # with "the controller answered 502: HTTP 502", status 1).
    asked: list[tuple[str, str | None]] = []
    gateway = {"output": 2, "record": 2}

    def handler(request: httpx.Request) -> httpx.Response:
        offset = request.url.params.get("offset")
        asked.append((request.url.path, offset))
        what = "output" if request.url.path.endswith("/output") else "record"
        if offset == "0":
            return streamed(b"part one\n")
        if gateway[what]:
            gateway[what] -= 1
            return proxy_answer(status)
        if what == "output":
            return streamed(b"part two\n")
        return httpx.Response(
            200, json={"job_id": "j-1", "state": "succeeded", "committed_bytes": 18}
        )

    argv = ["logs", "-f", "--reconnect", "1m", "j-1"]
    status_ = await rc_cli.amain(argv, env=ENV, transport=httpx.MockTransport(handler))
    out, err = capsys.readouterr()
    assert (status_, err) == (0, "")
    assert out == "part one\npart two\n"
    output, record = "/v1/jobs/j-1/output", "/v1/jobs/j-1"
    assert asked == [
        (output, "0"),
        *[(record, None)] * 3,  # two answered by the proxy, then the record (ended)
        *[(output, "9")] * 3,
        (record, None),
    ]


@pytest.mark.parametrize("status", [502, 504])
async def test_a_proxy_answering_for_the_whole_window_is_exit_3_naming_its_status(
    autojump_clock: trio.testing.MockClock, capsys: pytest.CaptureFixture[str], status: int
) -> None:
    phrase = {502: "Bad Gateway", 504: "Gateway Timeout"}[status]
    argv = ["logs", "-f", "--reconnect", "10s", "j-1"]
    transport = httpx.MockTransport(lambda request: proxy_answer(status))
    got = await rc_cli.amain(argv, env=ENV, transport=transport)
    out, err = capsys.readouterr()
    assert (got, out) == (rc_cli.EXIT_CONTROLLER_GONE, "")
    assert err == (
        "rc: lost the controller at http://rc while following job j-1 (unavailable for 10s; "
        f"{status} {phrase}); the job may still run: rc logs -f j-1\n"
    )


async def test_a_404_after_a_proxys_502_is_a_controller_that_forgot_the_job(
    autojump_clock: trio.testing.MockClock, capsys: pytest.CaptureFixture[str]
) -> None:
    # A 502 says the controller was not reachable, as a lost connection does: one that
    # comes back without the job (its state was in memory) is exit 3, not "answered 404".
    answers = iter([proxy_answer(502), httpx.Response(404, json=NOT_FOUND)])
    argv = ["logs", "-f", "j-1"]
    transport = httpx.MockTransport(lambda request: next(answers))
    got = await rc_cli.amain(argv, env=ENV, transport=transport)
    assert got == rc_cli.EXIT_CONTROLLER_GONE
    assert capsys.readouterr().err == (
        "rc: the controller at http://rc no longer knows job j-1 "
        "(it restarted without its stored state)\n"
    )


@pytest.mark.parametrize("status", [500, 501, 505, 507])
async def test_the_controllers_own_5xx_is_not_waited_out(
    autojump_clock: trio.testing.MockClock, capsys: pytest.CaptureFixture[str], status: int
) -> None:
    # 500 is the controller's own error: asking again gets the same; it ends rc at once.
    asked: list[float] = []

    def handler(request: httpx.Request) -> httpx.Response:
        asked.append(trio.current_time())
        return httpx.Response(status, json={"error": "internal", "message": "it broke"})

    argv = ["logs", "-f", "--reconnect", "1m", "j-1"]
    got = await rc_cli.amain(argv, env=ENV, transport=httpx.MockTransport(handler))
    assert (got, len(asked)) == (1, 1)
    assert capsys.readouterr().err == f"rc: the controller answered {status}: internal: it broke\n"


@given(status=st.integers(min_value=100, max_value=599))
@example(status=500)
@example(status=502)
@example(status=503)
@example(status=504)
def test_only_gateway_answers_are_waited_out(status: int) -> None:
    assert rc_follow.waited_out(status) is (status in (502, 503, 504))


class ClosedStderr(io.TextIOBase):
    """A stderr whose reader has gone: every write fails with EPIPE. What rc tried to say on
    it is kept, to read what it would have said."""

    def __init__(self) -> None:
        self.tried: list[str] = []
        self.buffer = self

    def write(self, text: Any) -> int:
        self.tried.append(text if isinstance(text, str) else text.decode())
        raise BrokenPipeError(32, "Broken pipe")

    def flush(self) -> None:
        pass


# httpx leaves its inner generators to the collector when a stream is left unfinished.
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
async def test_rc_run_json_names_stderr_when_the_output_cannot_go_there(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    # With --json the job's output goes to stderr: when that fails, the one line says so
    # (it said "cannot write the output to stdout"), and nothing is on stdout (rc failed).
    def handler(request: httpx.Request) -> httpx.Response:
        if request.method == "POST":
            return httpx.Response(200, json={"job_id": "j-1", "state": "queued"})
        if request.url.path.endswith("/output"):
            return streamed(b"out\n")
        return httpx.Response(200, json={"job_id": "j-1", "state": "succeeded"})

    stderr = ClosedStderr()
    monkeypatch.setattr(sys, "stderr", stderr)
    argv = ["run", "--json", "--", "x"]
    status = await rc_cli.amain(argv, env=ENV, transport=httpx.MockTransport(handler))
    assert status == 1
    assert capsys.readouterr().out == ""
    assert "".join(stderr.tried).splitlines()[-1] == (
        "rc: cannot write the output to stderr (Broken pipe); 4 bytes were not written"
    )
