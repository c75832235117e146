"""The status and metrics endpoint on status_listen, and rc-worker status."""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from pathlib import Path

import attrs
import httpx
import pytest
import trio
from hypothesis import given
from hypothesis import strategies as st

from rc_worker import status as status_module
from rc_worker.cli import main
from rc_worker.status import format_status
from rc_worker.testing import local_system, make_config


async def test_status_metrics_and_health_describe_the_worker(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = make_config(tmp_path, devices=("gpu0", "gpu1"), status_listen="127.0.0.1:0")
    with trio.fail_after(30):
        async with local_system(config) as system:
            [url] = system.worker.status_urls
            job_id = system.submit(["echo", "hi"], device="test-host/gpu1")
            assert (await system.wait_job(job_id)).state == "succeeded"
            async with httpx.AsyncClient(base_url=url) as http:
                status = (await http.get("/status")).json()
                metrics = (await http.get("/metrics")).text
                health = await http.get("/healthz")
            code = await trio.to_thread.run_sync(main, ["status", "--url", url, "--json"])
    assert status["host"] == "test-host"
    assert status["registered"] is True
    assert set(status["devices"]) == {"gpu0", "gpu1"}
    assert status["devices"]["gpu0"]["state"] == "free"
    assert status["devices"]["gpu0"]["idle_behavior"] == "run"
    assert status["last_probe"][0]["name"] == "builtin"
    assert health.status_code == 200
    assert 'rc_worker_jobs_finished_total{outcome="succeeded"} 1.0' in metrics
    assert 'rc_worker_devices{state="free"}' in metrics
    assert "rc_worker_job_run_seconds_count 1.0" in metrics
    assert "rc_worker_registered 1.0" in metrics
    assert code == 0
    assert json.loads(capsys.readouterr().out)["host"] == "test-host"


def test_status_table_shows_jobs_and_faults() -> None:
    text = format_status(
        {
            "host": "h1",
            "session": "s-1",
            "draining": True,
            "reports_pending": 2,
            "ready": False,
            "not_ready_reason": "draining: taking no new work",
            "devices": {
                "gpu0": {"state": "running", "idle_behavior": "run", "job_id": "j-1", "attempt": 2},
                "gpu1": {"state": "quarantined", "idle_behavior": "hold", "faults": ["f-7"]},
            },
        }
    )
    assert "(draining)" in text
    assert "j-1#2" in text
    assert "f-7" in text
    assert "reports pending: 2" in text
    assert "not ready: draining: taking no new work" in text


def test_status_without_status_listen_names_the_fix(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "w.yaml"
    path.write_text("devices: [gpu0]\n")
    assert main(["status", "--config", str(path)]) == 2
    assert "set it (e.g. status_listen: 127.0.0.1:9100)" in capsys.readouterr().err


def test_status_of_a_worker_that_is_not_there(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["status", "--url", "http://127.0.0.1:9"]) == 1
    assert "cannot read the worker's status" in capsys.readouterr().err


def test_status_needs_neither_the_token_nor_its_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """An operator without the worker's secret can still ask it how it is."""
    path = tmp_path / "w.yaml"
    path.write_text(
        "devices: [gpu0]\ncontroller_url: http://ctl:8080\n"
        "token_file: /nonexistent/worker.token\nstatus_listen: 127.0.0.1:9\n"
    )
    assert main(["status", "--config", str(path)]) == 1
    err = capsys.readouterr().err
    assert "cannot read the worker's status at http://127.0.0.1:9" in err
    assert "token" not in err


async def test_a_status_address_in_use_is_a_clear_error(tmp_path: Path) -> None:
    from rc_worker.core.errors import ConfigError

    with trio.socket.socket() as taken:
        await taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        config = make_config(tmp_path, status_listen=f"127.0.0.1:{port}")
        with (
            trio.fail_after(30),
            pytest.RaisesGroup(
                pytest.RaisesExc(
                    ConfigError, match=f"status_listen: cannot listen on 127.0.0.1:{port}"
                ),
                flatten_subgroups=True,
            ),
        ):
            async with local_system(config):
                pass


async def test_an_unusable_state_dir_is_a_clear_error(tmp_path: Path) -> None:
    from rc_worker.core.errors import ConfigError

    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    config = attrs.evolve(make_config(tmp_path), state_dir=str(blocker / "state"))
    with (
        trio.fail_after(30),
        pytest.RaisesGroup(
            pytest.RaisesExc(ConfigError, match="state_dir: cannot create or use"),
            flatten_subgroups=True,
        ),
    ):
        async with local_system(config):
            pass


async def test_status_hides_job_ids_unless_private_or_token(tmp_path: Path) -> None:
    sock = tmp_path / "status.sock"
    configs = {
        "tcp": make_config(tmp_path / "a", status_listen="127.0.0.1:0"),
        "token": make_config(tmp_path / "b", status_listen="127.0.0.1:0", status_token="st"),
        "unix": make_config(tmp_path / "c", status_listen=f"unix:{sock}"),
    }
    seen: dict[str, list[object]] = {}
    for kind, config in configs.items():
        with trio.fail_after(30):
            async with local_system(config) as system:
                job_id = system.submit(["sleep", "30"], grace_s=0.1)
                await system.wait_job(job_id, frozenset({"running"}))
                if kind == "unix":
                    transport = httpx.AsyncHTTPTransport(uds=str(sock))
                    async with httpx.AsyncClient(transport=transport, base_url="http://w") as h:
                        answers = [(await h.get("/status")).json()]
                    assert sock.stat().st_mode & 0o077 == 0
                else:
                    [url] = system.worker.status_urls
                    async with httpx.AsyncClient(base_url=url) as h:
                        answers = [
                            (await h.get("/status")).json(),
                            (await h.get("/status", headers={"Authorization": "Bearer st"})).json(),
                        ]
                seen[kind] = [a["devices"]["gpu0"]["job_id"] for a in answers]
                system.store.cancel(job_id)
                await system.wait_job(job_id)
        seen[kind].append(job_id)
    tcp, token, unix = seen["tcp"], seen["token"], seen["unix"]
    assert tcp[:2] == [None, None]  # no status_token: nobody sees ids over TCP
    assert token[0] is None  # shown only with the token
    assert token[1] == token[2]
    assert unix[0] == unix[1]  # a Unix socket is private


async def test_metrics_for_operations(tmp_path: Path) -> None:
    from prometheus_client import generate_latest

    from rc_worker._version import __version__

    config = make_config(
        tmp_path, devices=("gpu0",), status_listen="127.0.0.1:0", spool_max_bytes=100
    )
    with trio.fail_after(30):
        async with local_system(config) as system:
            [url] = system.worker.status_urls
            job_id = system.submit(["sh", "-c", "head -c 500 /dev/zero"])
            assert (await system.wait_job(job_id)).state == "succeeded"
            # The job's directory goes just after its finish is acknowledged.
            await system.wait_until(lambda: system.worker.status()["reports_pending"] == 0)
            async with httpx.AsyncClient(base_url=url) as http:
                metrics = (await http.get("/metrics")).text
            system.worker.drain()
            draining = generate_latest(system.worker.metrics.registry).decode()
    assert f'rc_worker_build_info{{version="{__version__}"}} 1.0' in metrics
    assert "process_resident_memory_bytes" in metrics
    assert "rc_worker_output_truncated_total 1.0" in metrics
    assert 'rc_worker_controller_requests_total{endpoint="register",status="200"} 1.0' in metrics
    assert 'rc_worker_controller_requests_total{endpoint="finish",status="200"} 1.0' in metrics
    [stamp] = [
        line.split()[-1]
        for line in metrics.splitlines()
        if line.startswith("rc_worker_controller_last_success_timestamp_seconds ")
    ]
    assert float(stamp) > 1.7e9
    assert "rc_worker_spool_bytes 0.0" in metrics  # everything delivered, nothing kept
    assert "rc_worker_draining 0.0" in metrics
    assert "rc_worker_draining 1.0" in draining


async def test_spool_bytes_count_what_the_controller_has_not_taken(tmp_path: Path) -> None:
    from faults import FaultyTransport

    config = make_config(tmp_path, devices=("gpu0",), status_listen="127.0.0.1:0")
    transports: list[FaultyTransport] = []

    def wrap(inner: httpx.AsyncBaseTransport) -> FaultyTransport:
        transports.append(FaultyTransport(inner))
        transports[0].outage("output")
        return transports[0]

    with trio.fail_after(30):
        async with local_system(config, transport_wrapper=wrap) as system:
            t = transports[0]
            [url] = system.worker.status_urls
            system.submit(["sh", "-c", "printf 0123456789"])
            await t.wait_until(lambda: len(t.exchanges("output")) > 0)
            async with httpx.AsyncClient(base_url=url) as http:
                metrics = (await http.get("/metrics")).text
            t.restore("output")
    [size] = [
        float(line.split()[-1])
        for line in metrics.splitlines()
        if line.startswith("rc_worker_spool_bytes ")
    ]
    assert size >= 10  # the output, and the journal beside it


# -- what answers at the address might not be a worker -----------------------------

Peer = Callable[[trio.SocketStream], Awaitable[None]]


@asynccontextmanager
async def _peer(handle: Peer, unix: Path | None = None) -> AsyncIterator[str]:
    """Serve ``handle`` on 127.0.0.1 (or the Unix socket ``unix``) while the block runs;
    the address to give ``rc-worker status``."""
    async with trio.open_nursery() as nursery:
        if unix is None:
            listeners = await nursery.start(trio.serve_tcp, handle, 0)
            address = f"http://127.0.0.1:{listeners[0].socket.getsockname()[1]}"
        else:
            sock = trio.socket.socket(trio.socket.AF_UNIX)
            await sock.bind(str(unix))
            sock.listen()
            await nursery.start(trio.serve_listeners, handle, [trio.SocketListener(sock)])
            address = f"unix:{unix}"
        yield address
        nursery.cancel_scope.cancel()


async def _read_head(stream: trio.SocketStream) -> bytes:
    """The request's head (what came of it, if the client hung up first)."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = await stream.receive_some()
        if not chunk:
            break
        data += chunk
    return data


def _answering(body: bytes, status: str = "200 OK", heads: list[bytes] | None = None) -> Peer:
    """A peer that answers every request with ``body``; the requests' heads go to ``heads``."""

    async def handle(stream: trio.SocketStream) -> None:
        head = await _read_head(stream)
        if heads is not None:
            heads.append(head)
        await stream.send_all(
            f"HTTP/1.1 {status}\r\ncontent-type: application/json\r\n"
            f"content-length: {len(body)}\r\nconnection: close\r\n\r\n".encode()
            + body
        )

    return handle


async def _status_cli(argv: list[str]) -> int:
    # A thread, as the command is synchronous; abandoned if it hangs, so the guard fails it.
    with trio.fail_after(60):
        code: int = await trio.to_thread.run_sync(main, argv, abandon_on_cancel=True)
    return code


def _one_line(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    return lines[0]


WORKER_LIKE = {"version": "1.0", "host": "h1", "devices": {}}

NOT_WORKER_ANSWERS = {
    "array": (b"[]", "200 OK", "is a JSON array, not an object"),
    "empty object": (b"{}", "200 OK", 'has no "version" string'),
    "null": (b"null", "200 OK", "is a JSON null"),
    "html": (b"<html>hello</html>", "200 OK", "is not JSON"),
    "not found": (b'{"detail": "Not Found"}', "404 Not Found", "with HTTP 404"),
    "devices a list": (
        json.dumps({**WORKER_LIKE, "devices": []}).encode(),
        "200 OK",
        'has no "devices" object',
    ),
    "device without state": (
        json.dumps({**WORKER_LIKE, "devices": {"gpu0": {"idle_behavior": "run"}}}).encode(),
        "200 OK",
        'has no "state" string for device "gpu0"',
    ),
    "faults not a list": (
        json.dumps(
            {
                **WORKER_LIKE,
                "devices": {"gpu0": {"state": "free", "idle_behavior": "run", "faults": 3}},
            }
        ).encode(),
        "200 OK",
        '"faults" that is not a list of strings for device "gpu0"',
    ),
}


@pytest.mark.parametrize("json_flag", [[], ["--json"]], ids=["table", "json"])
@pytest.mark.parametrize("case", list(NOT_WORKER_ANSWERS))
async def test_an_answer_that_is_not_a_worker_is_one_line(
    case: str, json_flag: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    """Another service at the address: one line saying so and what to check, exit 1 (as for
    a worker that cannot be reached), never a traceback or an empty table with exit 0."""
    body, status, problem = NOT_WORKER_ANSWERS[case]
    async with _peer(_answering(body, status)) as address:
        code = await _status_cli(["status", "--url", address, *json_flag])
    captured = capsys.readouterr()
    line = _one_line(captured.err)
    assert code == 1
    assert f"what answered at {address} is not an rc-worker" in line
    assert problem in line
    assert "check that --url is the address in the worker's status_listen" in line
    assert captured.out == ""


async def test_a_unix_socket_peer_from_the_config_names_status_listen(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    sock = tmp_path / "s.sock"
    path = tmp_path / "w.yaml"
    path.write_text(f"devices: [gpu0]\nstatus_listen: unix:{sock}\n")
    async with _peer(_answering(b"[1, 2]"), unix=sock):
        code = await _status_cli(["status", "--config", str(path)])
    line = _one_line(capsys.readouterr().err)
    assert code == 1
    assert f"what answered at unix:{sock} is not an rc-worker" in line
    assert "check that status_listen in the config is the address" in line


@pytest.mark.parametrize(
    ("in_config", "typed", "sent"),
    [
        ("from-config", ["--token", "typed"], "Bearer typed"),  # was Bearer from-config
        (None, ["--token", "typed"], "Bearer typed"),  # was no header at all
        ("from-config", [], "Bearer from-config"),
        (None, [], None),
    ],
)
async def test_a_token_on_the_command_line_wins_over_the_configs(
    tmp_path: Path, in_config: str | None, typed: list[str], sent: str | None
) -> None:
    """``--token`` without ``--url`` was dropped without a word, and the config's sent."""
    sock = tmp_path / "s.sock"
    path = tmp_path / "w.yaml"
    path.write_text(
        f"devices: [gpu0]\nstatus_listen: unix:{sock}\n"
        + (f"status_token: {in_config}\n" if in_config else "")
    )
    heads: list[bytes] = []

    handle = _answering(json.dumps(WORKER_LIKE).encode(), heads=heads)

    async with _peer(handle, unix=sock):
        code = await _status_cli(["status", "--config", str(path), *typed])
    assert code == 0
    [head] = heads
    lines = head.decode().split("\r\n")
    given = [line.partition(": ")[2] for line in lines if line.lower().startswith("authorization:")]
    assert given == ([] if sent is None else [sent])


@pytest.mark.parametrize("url", [[], ["--url", "http://127.0.0.1:9"]], ids=["config", "url"])
def test_an_empty_token_on_the_command_line_is_bad_usage(
    tmp_path: Path, url: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    """An empty ``--token "$(cat missing)"`` would otherwise silently show the redacted view
    (or, now that --token wins, throw away the config's)."""
    path = tmp_path / "w.yaml"
    path.write_text("devices: [gpu0]\nstatus_listen: 127.0.0.1:9\nstatus_token: st\n")
    assert main(["status", "--config", str(path), *url, "--token", ""]) == 2
    line = _one_line(capsys.readouterr().err)
    assert line.startswith("rc-worker: --token: the status token is empty; "), line


async def test_an_answer_of_a_worker_shape_is_shown(capsys: pytest.CaptureFixture[str]) -> None:
    body = {
        **WORKER_LIKE,
        "session": None,
        "reports_pending": 0,
        "devices": {"gpu0": {"state": "free", "idle_behavior": "run", "job_id": None}},
        "jobs_hidden": True,
    }
    async with _peer(_answering(json.dumps(body).encode())) as address:
        code = await _status_cli(["status", "--url", address])
    assert code == 0
    assert "gpu0" in capsys.readouterr().out


async def test_an_endless_answer_is_cut_at_the_limit(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Read up to ANSWER_MAX_BYTES, not until memory runs out. The peer stops by itself at
    32 times the limit so that a client reading without one ends too."""
    limit = 1 << 20
    monkeypatch.setattr(status_module, "ANSWER_MAX_BYTES", limit, raising=False)
    sent = 0

    async def endless(stream: trio.SocketStream) -> None:
        nonlocal sent
        await _read_head(stream)
        await stream.send_all(
            b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
            b"transfer-encoding: chunked\r\n\r\n"
        )
        chunk = b"0," * 32768
        with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError):
            while sent < 32 * limit:
                await stream.send_all(b"%x\r\n%s\r\n" % (len(chunk), chunk))
                sent += len(chunk)

    async with _peer(endless) as address:
        code = await _status_cli(["status", "--url", address])
    line = _one_line(capsys.readouterr().err)
    assert code == 1
    assert "answer is larger than 1 MiB" in line
    assert "is not an rc-worker" in line
    assert sent < 32 * limit  # it hung up early


@pytest.mark.parametrize("kind", ["silent", "trickle"])
async def test_a_peer_that_does_not_answer_in_time_is_one_line(
    kind: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A peer that accepts and says nothing, or sends a byte now and then (so that no single
    read times out): bounded by ANSWER_TIMEOUT_S over the whole answer. Each peer gives up
    by itself after 20 s so that a client without the bound ends too."""
    monkeypatch.setattr(status_module, "ANSWER_TIMEOUT_S", 0.5, raising=False)

    async def slow(stream: trio.SocketStream) -> None:
        await _read_head(stream)
        with trio.move_on_after(20), contextlib.suppress(trio.BrokenResourceError):
            if kind == "silent":
                await trio.sleep_forever()
            await stream.send_all(
                b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
                b"transfer-encoding: chunked\r\n\r\n"
            )
            while True:
                await stream.send_all(b"1\r\n \r\n")
                await trio.sleep(0.05)

    async with _peer(slow) as address:
        code = await _status_cli(["status", "--url", address])
    line = _one_line(capsys.readouterr().err)
    assert code == 1
    assert f"what listens at {address} did not answer within 0.5s" in line
    assert "not stopped (SIGSTOP) or overloaded" in line


@pytest.mark.parametrize(
    ("url", "problem"),
    [
        ("http://[::1", "'http://[::1' is not a worker status URL"),
        ("http://h:abc", "'http://h:abc' is not a worker status URL"),
        # Was made into http://ftp://x and reported as a host not found, exit 1.
        ("ftp://x", "'ftp://x' is not a worker status URL"),
        ("", "the worker status URL is empty"),
        ("127.0.0.1:99999", "'http://127.0.0.1:99999' is not a worker status URL"),
        ("127.0.0.1:0", "'http://127.0.0.1:0' names port 0"),
        # Were asked as host "ftp" (or "127.0.0.1") on port 80, exit 1.
        ("http://ftp://x", "'http://ftp://x' has no port number after 'ftp:'"),
        ("127.0.0.1:", "'http://127.0.0.1:' has no port number after '127.0.0.1:'"),
        ("http://x y:9", "'http://x y:9' has white space in it"),
    ],
)
def test_an_unusable_url_is_bad_usage(
    url: str, problem: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["status", "--url", url]) == 2
    line = _one_line(capsys.readouterr().err)
    assert line.startswith(f"rc-worker: --url: {problem}"), line
    assert "give HOST:PORT, http://HOST:PORT or unix:/path/to/socket" in line


def test_a_url_whose_scheme_is_upper_case_is_asked_as_given(
    capsys: pytest.CaptureFixture[str],
) -> None:
    # Not http://HTTP://...: a scheme is a scheme, whatever its case.
    assert main(["status", "--url", "HTTP://127.0.0.1:9"]) == 1
    assert "cannot read the worker's status at HTTP://127.0.0.1:9:" in capsys.readouterr().err


@pytest.mark.parametrize("token", ["tökén", "a\nb", "a b"])
def test_a_token_that_cannot_go_in_a_header_is_bad_usage(
    token: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """Was "cannot read the worker's status" (exit 1): the worker blamed for the token."""
    assert main(["status", "--url", "http://127.0.0.1:9", "--token", token]) == 2
    line = _one_line(capsys.readouterr().err)
    assert line.startswith("rc-worker: --token: the status token has "), line
    assert "which cannot be sent in an HTTP header; give the worker's status_token" in line


def test_a_status_token_in_the_config_that_cannot_go_in_a_header_names_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "w.yaml"
    path.write_text(
        "devices: [gpu0]\ncontroller_url: http://ctl:8080\n"
        "status_listen: 127.0.0.1:9\nstatus_token: tökén\n",
        encoding="utf-8",
    )
    assert main(["status", "--config", str(path)]) == 2
    line = _one_line(capsys.readouterr().err)
    # Refused where the config is loaded, as rc-worker run and check-config refuse it.
    assert line.startswith(
        f"rc-worker: {path}:4:15: status_token: the status token has character 'ö' in it, "
        "which cannot be sent in an HTTP header; expected visible ASCII"
    ), line


_json = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(), inner, max_size=3),
    max_leaves=10,
)
_device = st.fixed_dictionaries(
    {"state": st.text() | _json, "idle_behavior": st.text() | _json},
    optional={
        "job_id": st.none() | st.text() | _json,
        "attempt": st.none() | st.integers() | _json,
        "faults": st.lists(st.text()) | _json,
        "held_for_health": st.none() | st.text() | _json,
    },
)
_statusish = st.fixed_dictionaries(
    {
        "version": st.text() | _json,
        "host": st.text() | _json,
        "devices": st.dictionaries(st.text(), _device | _json, max_size=3) | _json,
    },
    optional={
        "session": st.none() | st.text() | _json,
        "reports_pending": st.integers() | _json,
        "not_ready_reason": st.none() | st.text() | _json,
        "ready": _json,
        "draining": _json,
    },
)


@given(st.one_of(_json, _statusish), st.sampled_from([200, 204, 302, 404, 500]))
def test_an_answer_is_refused_in_one_line_or_shown(value: object, code: int) -> None:
    """Whatever answers: either NotAWorker with a one-line reason, or a status that
    format_status shows without failing."""
    from rc_worker.status import NotAWorker, read_answer

    body = json.dumps(value).encode()
    try:
        data = read_answer(code, body)
    except NotAWorker as e:
        problem = str(e)
    else:
        assert 200 <= code < 300
        assert format_status(data).startswith("host ")
        return
    assert problem
    assert "\n" not in problem
