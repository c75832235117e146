"""rc given bad input, or a controller URL where no rc controller answers: one line on
stderr and an exit status, never a traceback, a hang or a request to another path."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable

import httpx
import pytest

from rc_worker.controller import rc_cli, rc_follow
from rc_worker.controller.rc_input import path_segment, token_problem, url_problem

Handler = Callable[[httpx.Request], httpx.Response]


async def rc(
    capsys: pytest.CaptureFixture[str],
    *argv: str,
    handler: Handler | None = None,
    env: dict[str, str] | None = None,
    usage: bool = False,
) -> tuple[int, str]:
    """Run ``rc ARGV`` against ``handler``; its status and its stderr, which must be one
    line with no traceback (argparse's, with ``usage``, one after the usage line)."""
    env = {"RC_URL": "http://rc", "RC_USER_TOKEN": "ut"} if env is None else env
    transport = None if handler is None else httpx.MockTransport(handler)
    status = await rc_cli.amain(list(argv), env=env, transport=transport)
    err = capsys.readouterr().err
    assert "Traceback" not in err
    lines = err.strip().splitlines()
    assert usage or len(lines) == 1, err
    return status, lines[-1]


def never_called(request: httpx.Request) -> httpx.Response:
    raise AssertionError(f"rc sent {request.url} for input it should have refused")


@pytest.mark.parametrize(
    "url",
    [
        "",
        "  ",
        "notaurl",
        "127.0.0.1:8080",
        "ftp://x",
        "http://",
        "http://[::1",
        "http://h:abc",
        "http://127.0.0.1:99999",
        "http://h:0",
        "http://ftp://x",  # was taken as host "ftp", port 80: "cannot reach", exit 3
        "http://h:/",
    ],
)
async def test_a_url_that_is_not_a_controller_url_is_usage(
    capsys: pytest.CaptureFixture[str], url: str
) -> None:
    status, err = await rc(capsys, "ps", "--url", url, handler=never_called)
    assert status == 2
    assert err.startswith("rc: --url: ")
    assert "e.g. http://127.0.0.1:8080" in err


async def test_a_url_with_an_empty_port_is_named(capsys: pytest.CaptureFixture[str]) -> None:
    status, err = await rc(capsys, "ps", "--url", "http://ftp://x", handler=never_called)
    assert (status, err) == (
        2,
        "rc: --url: 'http://ftp://x' has no port number after 'ftp:'; "
        "give the controller's URL, e.g. http://127.0.0.1:8080",
    )


async def test_a_bad_rc_url_names_rc_url(capsys: pytest.CaptureFixture[str]) -> None:
    status, err = await rc(
        capsys, "ps", handler=never_called, env={"RC_URL": "box1:8080", "RC_USER_TOKEN": "ut"}
    )
    assert status == 2
    assert err.startswith("rc: RC_URL: 'box1:8080' is not a controller URL")


@pytest.mark.parametrize("token", ["ut\n", "üt", "a\tb", "a b"])
async def test_a_token_that_cannot_go_in_a_header_is_usage(
    capsys: pytest.CaptureFixture[str], token: str
) -> None:
    status, err = await rc(capsys, "ps", "--token", token, handler=never_called)
    assert status == 2
    assert "cannot be sent in an HTTP header" in err
    status, err = await rc(
        capsys, "ps", handler=never_called, env={"RC_URL": "http://rc", "RC_USER_TOKEN": token}
    )
    assert status == 2
    assert err.startswith("rc: RC_USER_TOKEN: ")


async def test_an_empty_flag_is_not_quietly_the_default(
    capsys: pytest.CaptureFixture[str],
) -> None:
    status, err = await rc(capsys, "ps", "--token", "", handler=never_called)
    assert status == 2
    assert "--token is empty" in err


@pytest.mark.parametrize(
    ("argv", "what"),
    [
        (["show", ""], "the job id is empty"),
        (["show", "../../v1/pool"], "has '/' in it"),
        (["logs", "a/b"], "has '/' in it"),
        (["cancel", ""], "the job id is empty"),
        (["host", "drain", ""], "the host is empty"),
        (["host", "retire", "a/b"], "has '/' in it"),
    ],
)
async def test_an_id_that_cannot_be_one_is_usage(
    capsys: pytest.CaptureFixture[str], argv: list[str], what: str
) -> None:
    status, err = await rc(capsys, *argv, handler=never_called, usage=True)
    assert status == 2
    assert what in err


async def test_ids_are_one_path_segment_each(capsys: pytest.CaptureFixture[str]) -> None:
    seen: list[str] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request.url.raw_path.decode())
        return httpx.Response(404, json={"error": "unknown_job", "message": "no such job"})

    for argv in (["show", "a?b=c"], ["show", ".."], ["cancel", "a#b"], ["clear", "x?y/gpu0"]):
        status, _ = await rc(capsys, *argv, handler=handler)
        assert status == 1
    assert seen == [
        "/v1/jobs/a%3Fb%3Dc",
        "/v1/jobs/%2E%2E",
        "/v1/jobs/a%23b/cancel",
        "/v1/devices/x%3Fy/gpu0/clear",
    ]


COMMANDS = [
    ["ps"],
    ["ps", "--all"],
    ["show", "j-1"],
    ["cancel", "j-1"],
    ["devices"],
    ["sheet", "a/b"],
    ["clear", "a"],
    ["clear", "a/b"],
    ["idle", "a/b", "run"],
    ["events"],
    ["submit", "--", "true"],
    ["run", "--reconnect", "0", "--", "true"],
    ["logs", "--follow", "--reconnect", "0", "j-1"],
]


@pytest.mark.parametrize("body", [b"{}", b"[1, 2]", b"null", b'{"jobs": 5, "devices": "x"}'])
@pytest.mark.parametrize("argv", COMMANDS, ids=" ".join)
async def test_an_answer_of_the_wrong_shape_is_one_line(
    capsys: pytest.CaptureFixture[str], argv: list[str], body: bytes
) -> None:
    async def streamed() -> AsyncIterator[bytes]:
        yield body

    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, content=streamed())

    status, err = await rc(capsys, *argv, handler=handler)
    assert status == 1
    assert "check that --url / RC_URL is an rc controller (rc serve)" in err


# httpx leaves its inner generators to the collector when a stream is left unfinished.
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
async def test_an_endless_answer_is_refused_not_read_into_memory(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(rc_follow, "ANSWER_MAX_BYTES", 1 << 20)

    async def endless() -> AsyncIterator[bytes]:
        yield b'{"jobs": ['
        while True:
            yield b'{"a": 1},' * 1000

    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, content=endless())

    status, err = await rc(capsys, "ps", handler=handler)
    assert status == 1
    assert "is larger than 1 MiB" in err


# httpx leaves its inner generators to the collector when a stream is left unfinished.
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
@pytest.mark.parametrize(
    ("argv", "large"),
    [
        # The job's record, read when the followed output ends.
        (["logs", "--follow", "j-1"], "record"),
        (["run", "--", "x"], "record"),
        # An error answer to the request for the output.
        (["logs", "j-1"], "error"),
        (["logs", "--follow", "j-1"], "error"),
        (["run", "--", "x"], "error"),
    ],
    ids=lambda v: " ".join(v) if isinstance(v, list) else v,
)
async def test_every_answer_rc_reads_whole_is_bounded(
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    argv: list[str],
    large: str,
) -> None:
    # Following a job read its record with an unbounded r.json(), and error answers to the
    # output request with an unbounded aread(): an endless answer grew rc until killed.
    monkeypatch.setattr(rc_follow, "ANSWER_MAX_BYTES", 1 << 20, raising=False)
    record_timeouts: list[object] = []

    async def too_large() -> AsyncIterator[bytes]:
        # Endless but for a test that must end even where rc reads it all: 3 MiB.
        for _ in range(3 * 1024):
            yield b" " * 1024

    async def nothing() -> AsyncIterator[bytes]:
        return
        yield b""

    def handler(request: httpx.Request) -> httpx.Response:
        if request.method == "POST":
            return httpx.Response(200, json={"job_id": "j-1"})
        if request.url.path.endswith("/output"):
            if large == "error":
                return httpx.Response(500, content=too_large())
            return httpx.Response(200, content=nothing())  # no output; the job has ended
        record_timeouts.append(request.extensions["timeout"]["read"])
        return httpx.Response(200, content=too_large())

    env = {"RC_URL": "http://rc", "RC_USER_TOKEN": "ut"}
    status = await rc_cli.amain(argv, env=env, transport=httpx.MockTransport(handler))
    err = capsys.readouterr().err
    assert status == 1
    assert "Traceback" not in err
    last = err.strip().splitlines()[-1]
    assert last.startswith("rc: the answer to GET /v1/jobs/j-1"), err
    assert last.endswith(
        "is larger than 1 MiB, which no rc controller sends; check that "
        "--url / RC_URL is an rc controller (rc serve)"
    ), err
    # A record that never comes is reported too (or retried while following), not waited on.
    assert record_timeouts in ([], [rc_follow.ANSWER_TIMEOUT_S])


async def test_an_answer_that_never_comes_is_reported(
    capsys: pytest.CaptureFixture[str],
) -> None:
    timeouts: list[object] = []

    def handler(request: httpx.Request) -> httpx.Response:
        timeouts.append(request.extensions["timeout"]["read"])
        raise httpx.ReadTimeout("timed out", request=request)

    status, err = await rc(capsys, "ps", handler=handler)
    assert status == 3
    assert "did not answer in time" in err
    assert timeouts == [rc_follow.ANSWER_TIMEOUT_S]


@pytest.mark.parametrize(
    ("extra", "what"),
    [
        (["--heartbeat-rate", "-1"], "--heartbeat-rate"),
        (["--heartbeat-rate", "nan"], "--heartbeat-rate"),
        (["--heartbeat-interval", "0"], "--heartbeat-interval"),
        (["--poll-wait", "0"], "--poll-wait"),
        (["--webhook", "notaurl"], "--webhook"),
        (["--worker-token", ""], "--worker-token"),
        (["--worker-token", "=box1"], "--worker-token"),
        # Tokens no client could send (rc and rc-worker refuse them): nothing would get in.
        (["--worker-token", "a b=box1"], "--worker-token"),
        (["--worker-token", "tök"], "--worker-token"),
        (["--user-token", "u\r"], "--user-token"),
        (["--user-token", "a b=alice"], "--user-token"),
    ],
)
async def test_rc_serve_refuses_bad_settings_in_one_line(
    capsys: pytest.CaptureFixture[str], extra: list[str], what: str
) -> None:
    argv = ["serve", "--listen", "127.0.0.1:0", "--memory", "--user-token", "ut"]
    argv += ["--worker-token", "wt", *extra]
    status = await rc_cli.amain(argv, env={})
    err = capsys.readouterr().err
    assert status == 2
    assert "Traceback" not in err
    assert what in err
    assert err.strip().splitlines()[-1].startswith(("rc: rc serve: ", "rc serve: error: "))


def test_the_input_checks() -> None:
    assert url_problem("http://127.0.0.1:8080") is None
    assert url_problem("https://rc.example/base") is None
    assert token_problem("abc-DEF_123.~+/=") is None
    assert path_segment("job id", "j-1-3fa9c1") == "j-1-3fa9c1"
    assert path_segment("host", "a b%") == "a%20b%25"
    with pytest.raises(ValueError, match="rc ps lists them"):
        path_segment("job id", "")
