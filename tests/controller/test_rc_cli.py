"""The rc command: against a controller served on 127.0.0.1:0, and in-process."""

from __future__ import annotations

import json
import subprocess
from collections.abc import AsyncIterator
from pathlib import Path
from urllib.parse import quote

import httpx
import pytest
import trio
from starlette.applications import Starlette

from rc_worker.controller import Store, rc_cli

from .helpers import USER_TOKEN, FakeWorker, wait_listening


@pytest.fixture
async def served() -> AsyncIterator[str]:
    """``rc serve`` on a free port; yields its URL."""
    argv = [
        "--listen",
        "127.0.0.1:0",
        "--worker-token",
        "wt=box1",
        "--user-token",
        "ut=ann:admin",
        "--memory",
    ]
    async with trio.open_nursery() as nursery:
        [url] = await nursery.start(
            lambda task_status: rc_cli.run_serve(argv, env={}, task_status=task_status)
        )
        yield url
        nursery.cancel_scope.cancel()


async def rc(*argv: str, url: str = "http://rc", token: str = "ut", **kw: object) -> int:
    env = {"RC_URL": url, "RC_USER_TOKEN": token}
    return await rc_cli.amain(list(argv), env=env, **kw)  # type: ignore[arg-type]


async def test_rc_against_a_served_controller(
    served: str, capsys: pytest.CaptureFixture[str]
) -> None:
    async with httpx.AsyncClient(base_url=served) as http:
        w = FakeWorker(http, "box1", token="wt")
        with trio.fail_after(30):
            await w.register()
            status: list[int] = []

            async def run() -> None:
                status.append(
                    await rc("run", "--env", "A=1", "--", "sh", "-c", "exit 3", url=served)
                )

            async with trio.open_nursery() as nursery:
                nursery.start_soon(run)
                [a] = await w.poll(wait_s=10)
                assert a["command"] == ["sh", "-c", "exit 3"]
                assert a["env"] == {"A": "1"}
                await w.start(a)
                await w.output(a, 0, b"working\n")
                await w.finish(a, "failed", exit_code=3, output_bytes=8)
            assert status == [3]
            out = capsys.readouterr()
            assert out.out == "working\n"
            assert f"job {a['job_id']}" in out.err

            assert await rc("ps", url=served) == 0
            table = capsys.readouterr().out
            assert table.splitlines()[0].split() == [
                "JOB",
                "STATE",
                "ATTEMPT",
                "DEVICE",
                "COMMAND",
                "NOTE",
            ]
            assert a["job_id"] in table
            assert "failed (3)" in table

            assert await rc("logs", a["job_id"], url=served) == 0
            assert capsys.readouterr().out == "working\n"
            assert await rc("devices", "--json", url=served) == 0
            [device] = json.loads(capsys.readouterr().out)["devices"]
            assert device["address"] == "box1/gpu0"


async def test_rc_serve_usage_errors(capsys: pytest.CaptureFixture[str]) -> None:
    with trio.fail_after(10):
        assert await rc_cli.amain(["serve", "--listen", "127.0.0.1:0"], env={}) == 2
        assert "--worker-token" in capsys.readouterr().err
        assert (
            await rc_cli.amain(
                ["serve", "--listen", "nowhere", "--worker-token", "w", "--user-token", "u"], env={}
            )
            == 2
        )
        assert "HOST:PORT" in capsys.readouterr().err


def test_worker_tokens_from_args_and_env() -> None:
    args = rc_cli.build_parser().parse_args(
        ["serve", "--worker-token", "abc=box1", "--worker-token", "any", "--user-token", "u"]
    )
    worker, users = rc_cli.serve_settings(
        args, {"RC_WORKER_TOKENS": "e1=box2, e2", "RC_USER_TOKENS": "u2,u3"}
    )
    assert worker == {"e1": "box2", "e2": "*", "abc": "box1", "any": "*"}
    assert list(users) == ["u2", "u3", "u"]
    assert all(not u.admin and u.name.startswith("user-") for u in users.values())
    assert rc_cli.parse_worker_token("tok==box1") == ("tok=", "box1")
    assert rc_cli.parse_worker_token("padded==") == ("padded==", "*")


async def test_unreachable_controller_is_one_line_and_exit_3(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with trio.fail_after(30):
        assert await rc("ps", url="http://127.0.0.1:9") == rc_cli.EXIT_CONTROLLER_GONE == 3
    err = capsys.readouterr().err
    assert err.startswith("rc: cannot reach the controller at http://127.0.0.1:9")
    assert "Traceback" not in err


async def test_main_entry_point_returns_a_status(capsys: pytest.CaptureFixture[str]) -> None:
    with trio.fail_after(30):
        status = await trio.to_thread.run_sync(rc_cli.main, ["idle", "box1/gpu0", "nap"])
    assert status == 2
    assert "invalid choice" in capsys.readouterr().err


@pytest.fixture
def transport(app: Starlette) -> httpx.ASGITransport:
    return httpx.ASGITransport(app=app)


async def test_client_commands_in_process(
    transport: httpx.ASGITransport,
    client: httpx.AsyncClient,
    store: Store,
    capsys: pytest.CaptureFixture[str],
) -> None:
    w = FakeWorker(client, labels={"host": {}, "devices": {"gpu0": {"product": "H100"}}})
    with trio.fail_after(10):
        await w.register()
        assert (
            await rc(
                "submit",
                "--select",
                "product=H100",
                "--max-runtime",
                "1m",
                "--",
                "nvidia-smi",
                token=USER_TOKEN,
                transport=transport,
            )
            == 0
        )
        job = capsys.readouterr().out.strip()
        assert store.job(job).spec.max_runtime_s == 60
        assert (
            await rc(
                "submit",
                "--json",
                "--device",
                "box1/gpu0",
                "--",
                "x",
                token=USER_TOKEN,
                transport=transport,
            )
            == 0
        )
        pinned = json.loads(capsys.readouterr().out)["job_id"]
        assert await rc("show", job, token=USER_TOKEN, transport=transport) == 0
        assert "nvidia-smi" in capsys.readouterr().out
        assert await rc("cancel", pinned, token=USER_TOKEN, transport=transport) == 0
        assert "killed" in capsys.readouterr().out
        await w.post(
            "/v1/hosts/box1/devices/gpu0/fault",
            {"session": w.session, "fault_id": "f-1", "kind": "dirty"},
        )
        assert await rc("devices", token=USER_TOKEN, transport=transport) == 0
        assert "quarantined" in capsys.readouterr().out
        assert await rc("clear", "box1/gpu0", token=USER_TOKEN, transport=transport) == 0
        assert "cleared f-1" in capsys.readouterr().out
        assert await rc("idle", "box1/gpu0", "drain", token=USER_TOKEN, transport=transport) == 0
        assert "drain" in capsys.readouterr().out
        assert await rc("sheet", "box1/gpu0", token=USER_TOKEN, transport=transport) == 0
        assert "no usage sheet" in capsys.readouterr().out
        assert await rc("events", "--after", "0", token=USER_TOKEN, transport=transport) == 0
        lines = capsys.readouterr().out.splitlines()
        assert [line.split()[3] for line in lines] == [
            "job_submitted",
            "job_submitted",
            "job_cancel_requested",
            "job_finished",
            "device_quarantined",
            "device_cleared",
            "idle_behavior_set",
        ]
        # The event log says who did what.
        assert all("alice" in line for line in lines if "submitted" in line or "cleared" in line)


async def test_client_errors_in_process(
    transport: httpx.ASGITransport, capsys: pytest.CaptureFixture[str]
) -> None:
    with trio.fail_after(10):
        assert await rc("show", "j-nope", token=USER_TOKEN, transport=transport) == 1
        assert "unknown_job" in capsys.readouterr().err
        assert await rc("ps", token="wrong", transport=transport) == 1
        assert "401" in capsys.readouterr().err
        assert await rc("submit", token=USER_TOKEN, transport=transport) == 2
        assert "give the command after --" in capsys.readouterr().err
        assert await rc("submit", "--max-runtime", "soon", "--", "x", transport=transport) == 2
        assert await rc("clear", "box1/gpu0/x", transport=transport) == 2
        err = capsys.readouterr().err
        assert "HOST/DEVICE" in err
        assert "Traceback" not in err
        # A negative offset is bad usage (2), said before asking the controller (which
        # answered 400, and rc exited 1 as if the controller had refused something).
        for follow in ([], ["--follow"]):
            assert await rc("logs", "j-1", "--offset", "-5", *follow, transport=transport) == 2
            err = capsys.readouterr().err
            assert "--offset: -5 is negative" in err
            assert "Traceback" not in err
        # A bare name is a HOST (issue 15: `rc clear HOST`); an unknown one says so.
        assert await rc("clear", "nohost", token=USER_TOKEN, transport=transport) == 1
        err = capsys.readouterr().err
        assert "unknown_host" in err
        assert "Traceback" not in err


async def test_a_job_id_is_one_path_segment_whatever_it_holds(
    transport: httpx.ASGITransport,
    client: httpx.AsyncClient,
    store: Store,
    capsys: pytest.CaptureFixture[str],
) -> None:
    # An adopted job's id comes from its worker; `?`, `#` and `%` in it cut the path
    # short (GET /v1/jobs/j?...), so rc read another job, or another resource, than the
    # one named: `rc logs 'J?offset=5'` printed J's record as its output, status 0.
    w = FakeWorker(client)
    odd = "j-9?offset=5#x%41"
    with trio.fail_after(10):
        await w.register()
        r = await w.heartbeat({"gpu0": {"state": "running", "job_id": odd, "attempt": 1}})
        assert r.status_code == 200
        r = await client.post(
            f"/v1/jobs/{quote(odd, safe='')}/output",
            params={"attempt": 1, "offset": 0},
            content=b"adopted output\n",
            headers=w.headers,
        )
        assert r.json() == {"committed": 15}
        body = {
            "session": w.session,
            "attempt": 1,
            "device": "gpu0",
            "outcome": "succeeded",
            "exit_code": 0,
            "output_bytes": 15,
        }
        r = await client.post(
            f"/v1/jobs/{quote(odd, safe='')}/finish", json=body, headers=w.headers
        )
        assert r.status_code == 200, r.text
        capsys.readouterr()
        for follow in ([], ["--follow"]):
            assert await rc("logs", odd, *follow, token=USER_TOKEN, transport=transport) == 0
            assert capsys.readouterr().out == "adopted output\n"
        assert await rc("show", odd, "--json", token=USER_TOKEN, transport=transport) == 0
        assert json.loads(capsys.readouterr().out)["job_id"] == odd
        # A known job's id with a query after it names no job.
        known = store.submit(["x"])
        assert await rc("logs", f"{known}?offset=5", token=USER_TOKEN, transport=transport) == 1
        captured = capsys.readouterr()
        assert captured.out == ""
        assert f"no job '{known}?offset=5'" in captured.err


@pytest.mark.parametrize(
    ("job", "status"),
    [
        ({"state": "succeeded", "exit_code": 0}, 0),
        ({"state": "failed", "exit_code": 7}, 7),
        ({"state": "failed", "exit_code": None}, 1),
        ({"state": "killed", "exit_code": None}, rc_cli.EXIT_KILLED),
        ({"state": "lost", "exit_code": None}, rc_cli.EXIT_NOT_RUN),
        ({"state": "rejected", "exit_code": None}, rc_cli.EXIT_NOT_RUN),
    ],
)
def test_run_exit_status(job: dict[str, object], status: int) -> None:
    assert rc_cli.run_exit_status(job) == status


async def test_rc_serve_exits_on_sigterm(tmp_path: Path) -> None:
    """A real `rc serve` process: SIGTERM stops it, with status 0. With no store option its
    state is an SQLite database in $XDG_STATE_HOME/rc, a directory only its owner may read."""
    import os
    import signal
    import sys

    rc = str(Path(sys.executable).parent / "rc")
    env = {k: v for k, v in os.environ.items() if k not in ("RC_STATE_DIR", "RC_DB")}
    env["XDG_STATE_HOME"] = str(tmp_path)
    proc = await trio.lowlevel.open_process(
        [rc, "serve", "--listen", "127.0.0.1:0", "--user-token", "u", "--worker-token", "w"],
        stderr=subprocess.PIPE,
        env=env,
    )
    try:
        with trio.fail_after(30):
            await wait_listening(proc)
            proc.send_signal(signal.SIGTERM)
            assert await proc.wait() == 0
            assert proc.stderr is not None
            said = b""
            while chunk := await proc.stderr.receive_some():
                said += chunk
        # Why it went, and that it went: one line each, after the listening line.
        assert said.decode().splitlines() == [
            "rc: SIGTERM: finishing the requests in flight, then stopping",
            "rc: controller stopped",
        ]
        assert (tmp_path / "rc" / "controller.db").is_file()
        assert (tmp_path / "rc").stat().st_mode & 0o777 == 0o700
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()


async def test_tables_stay_one_row_per_job_and_devices_show_the_fault(
    transport: httpx.ASGITransport,
    client: httpx.AsyncClient,
    store: Store,
    capsys: pytest.CaptureFixture[str],
) -> None:
    w = FakeWorker(client)
    with trio.fail_after(10):
        await w.register()
        store.submit(["sh", "-c", "echo one\necho two\r\n\techo three\x1b[31m"])
        store.submit(["python", "-c", "x" * 500])
        store.submit(["true"], env={"A": "1"})
        assert await rc("ps", token=USER_TOKEN, transport=transport) == 0
        lines = capsys.readouterr().out.splitlines()
        assert len(lines) == 4  # a header and one row per job
        assert "sh -c 'echo one\\necho two\\r\\n\\techo three\\x1b[3…" in lines[1]
        assert all(len(line) < 250 for line in lines)
        assert "…" in lines[2]
        await w.post(
            "/v1/hosts/box1/devices/gpu0/fault",
            {
                "session": w.session,
                "fault_id": "f-1",
                "kind": "verify_failed",
                "reason": "10-ecc.sh: 3 uncorrectable\nECC errors",
            },
        )
        assert await rc("devices", token=USER_TOKEN, transport=transport) == 0
        [header, row] = capsys.readouterr().out.splitlines()
        assert header.split()[:3] == ["DEVICE", "STATE", "REASON"]
        assert "verify_failed: 10-ecc.sh: 3 uncorrectable\\nECC errors" in row
        assert await rc("show", store.jobs()[0].job_id, token=USER_TOKEN, transport=transport) == 0
        show = capsys.readouterr().out
        assert "waiting    the pinned" not in show
        assert "waiting    no matching device is available: box1/gpu0 quarantined" in show


def test_one_line_escapes_what_would_break_a_row() -> None:
    from rc_worker.controller.rc_format import one_line

    assert one_line("plain é ✓") == "plain é ✓"
    assert one_line("a\nb\tc\x00d\u2028") == "a\\nb\\tc\\x00d\\u2028"


def test_errors_from_rc_runs_nursery_become_one_error() -> None:
    nested = ExceptionGroup("outer", [ExceptionGroup("inner", [httpx.ReadError("boom")])])
    error = rc_cli._translate(nested)
    assert (error.status, str(error)) == (3, "cannot reach the controller: ReadError: boom")
    refused = rc_cli._translate(ExceptionGroup("g", [rc_cli.CliError("nope", 1)]))
    assert (refused.status, str(refused)) == (1, "nope")
    other = rc_cli._translate(ExceptionGroup("g", [httpx.DecodingError("bad gzip")]))
    assert (other.status, str(other)) == (1, "DecodingError: bad gzip")
