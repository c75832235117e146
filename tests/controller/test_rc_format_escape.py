"""The controller's text as ``rc`` shows it: escaped in error lines and tables, so a hostile or
garbled answer can neither add lines nor send the terminal escape sequences; a job's own
output (``rc logs``) passes through as the job wrote it."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from typing import Any

import httpx
import pytest
import trio
import trio.testing
from hypothesis import example, given
from hypothesis import strategies as st

from rc_worker.controller import rc_cli
from rc_worker.controller import rc_format as fmt

ENV = {"RC_URL": "http://rc", "RC_USER_TOKEN": "ut"}
HOSTILE = "bad\x1b[2J\x1b]0;owned\x07\r\nrc: a line rc never wrote\x9b31m\u2028end"
SHOWN = "bad\\x1b[2J\\x1b]0;owned\\x07\\r\\nrc: a line rc never wrote\\x9b31m\\u2028end"


def controls(text: str) -> set[str]:
    """The C0 and C1 control characters (and DEL) in ``text``."""
    return {ch for ch in text if ord(ch) < 0x20 or 0x7F <= ord(ch) < 0xA0}


@given(st.text())
@example(HOSTILE)
def test_one_line_leaves_no_control_and_keeps_printable_text(text: str) -> None:
    shown = fmt.one_line(text)
    assert shown.isprintable()
    assert not controls(shown)
    if text.isprintable():
        assert shown == text


@given(st.text())
@example(HOSTILE)
def test_a_text_block_keeps_only_its_lines_and_tabs(text: str) -> None:
    shown = fmt.text_block(text)
    assert controls(shown) <= {"\n", "\t"}
    assert shown.count("\n") == text.replace("\r\n", "\n").count("\n")


def test_one_line_escapes_as_repr_does() -> None:
    assert fmt.one_line(HOSTILE) == SHOWN
    assert fmt.one_line("\U000e0001x") == "\\U000e0001x"  # not \ue0001, which reads as \ue000 1


def error_answer(status: int = 400) -> httpx.Response:
    return httpx.Response(status, json={"error": "bad_request", "message": HOSTILE})


async def rc(handler: Callable[[httpx.Request], httpx.Response], *argv: str) -> int:
    return await rc_cli.amain(list(argv), env=ENV, transport=httpx.MockTransport(handler))


async def test_an_error_message_is_one_escaped_line(capsys: pytest.CaptureFixture[str]) -> None:
    # It was printed as sent: the terminal cleared, its title set, and a second line that
    # looked like rc's own.
    assert await rc(lambda request: error_answer(), "show", "j-1") == 1
    assert capsys.readouterr().err == f"rc: the controller answered 400: bad_request: {SHOWN}\n"


async def test_a_lost_controllers_last_answer_is_one_escaped_line(
    autojump_clock: trio.testing.MockClock, capsys: pytest.CaptureFixture[str]
) -> None:
    assert (
        await rc(lambda request: error_answer(503), "logs", "-f", "--reconnect", "1s", "j-1") == 3
    )
    assert capsys.readouterr().err == (
        "rc: lost the controller at http://rc while following job j-1 (unavailable for 1s; "
        f"503 bad_request: {SHOWN}); the job may still run: rc logs -f j-1\n"
    )


def streamed(data: bytes) -> httpx.Response:
    async def body() -> AsyncIterator[bytes]:
        yield data

    return httpx.Response(200, content=body())


async def test_rc_runs_notes_escape_the_jobs_id_and_reasons(
    capsys: pytest.CaptureFixture[str],
) -> None:
    # The id, the pending reason and the reason a job ended are the controller's text too.
    # The job's output is its own bytes: passed through as they are.
    job_id = "j-1\x1b[8m"
    ended = {"job_id": job_id, "state": "error", "reason": HOSTILE}

    def handler(request: httpx.Request) -> httpx.Response:
        if request.method == "POST":
            submitted = {"job_id": job_id, "pending_code": "no_match", "pending_reason": HOSTILE}
            return httpx.Response(200, json=submitted)
        if request.url.path.endswith("/output"):
            return streamed(b"\x1b[31mred\x1b[0m\n")
        return httpx.Response(200, json=ended)

    assert await rc(handler, "run", "--", "x") == rc_cli.EXIT_NOT_RUN
    out, err = capsys.readouterr()
    assert out == "\x1b[31mred\x1b[0m\n"
    assert err.splitlines() == [
        f"rc: warning: no registered device could ever run job j-1\\x1b[8m: {SHOWN}; it waits "
        "in the queue (--strict refuses such jobs)",
        "rc: job j-1\\x1b[8m",
        f"rc: job j-1\\x1b[8m ended error: {SHOWN}",
    ]


async def test_rc_logs_passes_the_jobs_bytes_through(capsys: pytest.CaptureFixture[str]) -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path.endswith("/output"):
            return streamed(b"\x1b[31mred\x1b[0m\r\n\x07")
        return httpx.Response(200, json={"job_id": "j-1", "state": "succeeded"})

    assert await rc(handler, "logs", "j-1") == 0
    assert capsys.readouterr().out == "\x1b[31mred\x1b[0m\r\n\x07"


JOB: dict[str, Any] = {
    "job_id": "j-1\nj-2",
    "state": "running\x1b[2J",
    "attempt": 1,
    "host": "box1\n",
    "device": "gpu0",
    "spec": {"command": ["x"], "select": "product=H100\nfake: line", "device": "box1/\ngpu0"},
    "reason": None,
    "attempts": [{"attempt": "1\n", "host": "box1", "device": "gpu0", "status": "ok\n"}],
}
DEVICE: dict[str, Any] = {
    "address": "box1/gpu0",
    "state": "busy\n",
    "faults": [],
    "idle_behavior": "run\r",
    "job_id": "j-1\nj-2",
    "host_state": "up\x1b[8m",
}


@pytest.mark.parametrize(
    ("shown", "lines"),
    [
        (fmt.jobs_table([JOB, JOB]), 3),
        (fmt.job_details(JOB), len(fmt.job_details({**JOB, "attempts": []}).splitlines()) + 1),
        (fmt.devices_table([DEVICE]), 2),
        (fmt.event_line({"seq": 1, "type": "job\nsubmitted", "job_id": "j\n"}), 1),
        (fmt.cancel_result({**JOB, "state": "killed", "reason": HOSTILE}), 1),
        (fmt.clear_result({"device": {**DEVICE, "address": "b\n"}, "cleared": ["f\n"]}), 1),
        (fmt.clear_host_result({"host": "b\n", "cleared": {"g\n": ["f\n"]}}), 1),
        (fmt.host_result("retire", "box1", {"jobs_lost": ["j\nk"]}), 1),
        (fmt.pool_summary({"hosts": {"up\n": 1}, "free_by_class": {"H\n100": 2}}), 5),
        (fmt.pool_summary({"running": [{**JOB, "state": "x\n"}]}), 5),
        (fmt.sheet({"host": "b\n", "device": "g", "host_sheet": "one\n\ttwo\x1b[2J\r\n"}), 4),
    ],
    ids=lambda value: str(value)[:24] if isinstance(value, str) else str(value),
)
def test_the_controllers_text_cannot_add_lines_or_escape_sequences(shown: str, lines: int) -> None:
    # A newline in a job's selector or id, a device's state, an event's type, broke the row
    # (a line of its own that looked like another job), and an escape sequence reached the
    # terminal. A usage sheet keeps its own lines and tabs, nothing else.
    assert len(shown.splitlines()) == lines, shown
    assert controls(shown) <= {"\n", "\t"}
    assert "\x1b" not in shown
