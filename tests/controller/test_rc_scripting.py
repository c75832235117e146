"""``rc`` as scripts use it, as real processes: --json, exit 3, reconnecting, pending reasons."""

from __future__ import annotations

import base64
import json
import os
import subprocess
from collections.abc import AsyncIterator, Awaitable, Callable

import httpx
import pytest
import trio

from rc_worker.controller import rc_cli

from .helpers import FakeWorker
from .rc_procs import RC, USER, WORKER, DroppingProxy, Standby, rc_client, rc_env, rc_serve

H100 = {"host": {}, "devices": {"gpu0": {"product": "H100"}}}


@pytest.fixture
async def served() -> AsyncIterator[str]:
    """The controller served in-process on a free port (the clients are real processes)."""
    argv = [
        "--listen",
        "127.0.0.1:0",
        "--worker-token",
        f"{WORKER}=box1",
        "--user-token",
        f"{USER}=ops:admin",
        "--memory",
    ]
    async with trio.open_nursery() as nursery:
        [url] = await nursery.start(
            lambda task_status: rc_cli.run_serve(argv, env={}, task_status=task_status)
        )
        yield url
        nursery.cancel_scope.cancel()


async def rc_run(url: str, *argv: str) -> subprocess.CompletedProcess[bytes]:
    return await trio.run_process(
        [RC, *argv], env=rc_env(url), capture_stdout=True, capture_stderr=True, check=False
    )


async def rc_into_closed_pipe(
    url: str, *argv: str, stdin: bytes | None = None
) -> subprocess.CompletedProcess[bytes]:
    """``rc ARGV | head -c 0``: stdout a pipe whose reader is gone before rc writes."""
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        return await trio.run_process(
            [RC, *argv],
            env=rc_env(url),
            stdin=stdin,
            stdout=write_end,
            capture_stderr=True,
            check=False,
        )
    finally:
        os.close(write_end)


async def rc_stdout_not_open(
    url: str, *argv: str, stdin: bytes | None = None
) -> subprocess.CompletedProcess[bytes]:
    """``rc ARGV >&-``: started with no stdout at all."""
    return await trio.run_process(
        ["sh", "-c", 'exec "$0" "$@" >&-', RC, *argv],
        env=rc_env(url),
        stdin=stdin,
        capture_stderr=True,
        check=False,
    )


@pytest.mark.parametrize(
    "argv",
    [
        ["ps"],
        ["ps", "--json"],
        ["ps", "--all"],
        ["show", "{job}"],
        ["show", "--json", "{job}"],
        ["events"],
        ["events", "--json"],
        ["devices"],
        ["devices", "--json"],
        ["pool"],
        ["sheet", "box1/gpu0"],
        ["idle", "box1/gpu0", "run"],
        ["host", "resume", "box1"],
        ["submit", "--", "x"],
        ["submit", "--json", "--", "x"],
        ["cancel", "{job}"],
        ["completion", "bash"],
    ],
    ids=" ".join,
)
@pytest.mark.parametrize("closed", [rc_into_closed_pipe, rc_stdout_not_open])
async def test_every_command_into_a_closed_pipe_stops_quietly(
    served: str,
    argv: list[str],
    closed: Callable[..., Awaitable[subprocess.CompletedProcess[bytes]]],
) -> None:
    # `rc ps --json | head -1`: as `rc logs`, every command but `rc run` stops with status 0
    # and says nothing (they said "rc: [Errno 32] Broken pipe" and exited 1; `rc completion`
    # printed a traceback). So does one started with no stdout (`rc ps >&-`), which said the
    # controller "answered something rc cannot read (AttributeError ...)" and exited 1.
    async with httpx.AsyncClient(base_url=served) as http:
        with trio.fail_after(60):
            await FakeWorker(http, token=WORKER).register()
            submitted = await rc_run(served, "submit", "--", "x")
            job = submitted.stdout.decode().strip()
            done = await closed(served, *(arg.format(job=job) for arg in argv))
    assert done.stderr == b""
    assert done.returncode == 0


@pytest.mark.parametrize("closed", [rc_into_closed_pipe, rc_stdout_not_open])
@pytest.mark.parametrize("json_mode", [False, True])
async def test_rc_submit_stdin_with_stdout_closed_still_uploads_it(
    served: str,
    closed: Callable[..., Awaitable[subprocess.CompletedProcess[bytes]]],
    json_mode: bool,
) -> None:
    # Only the job's id cannot be printed: the job waits for its stdin, so rc uploads it,
    # then stops quietly as for any closed stdout (it stopped at once and the job never got
    # its input; with `>&-` it also said the controller answered something unreadable).
    async with httpx.AsyncClient(base_url=served) as http:
        w = FakeWorker(http, token=WORKER)
        with trio.fail_after(60):
            await w.register()
            argv = ["submit", "--stdin", *(["--json"] if json_mode else []), "--", "cat"]
            done = await closed(served, *argv, stdin=b"the job's input\n")
            assert (done.returncode, done.stderr) == (0, b"")
            [a] = await w.poll(wait_s=10)
            await w.start(a)
            got = await http.get(a["stdin"]["url"], headers=w.headers)
    assert got.status_code == 200
    assert got.content == b"the job's input\n"


@pytest.mark.parametrize("command", ["submit", "run"])
async def test_stdin_with_no_stdin_open_is_refused_before_anything_is_queued(
    served: str, command: str
) -> None:
    # `rc submit --stdin -- cat <&-`: there is no input to upload (Python has sys.stdin
    # None). It is bad usage, refused before the job is submitted (the job was queued, then
    # rc said the controller "answered something rc cannot read (AttributeError ...)").
    with trio.fail_after(60):
        done = await trio.run_process(
            ["sh", "-c", 'exec "$0" "$@" <&-', RC, command, "--stdin", "--", "cat"],
            env=rc_env(served),
            capture_stdout=True,
            capture_stderr=True,
            check=False,
        )
        listed = await rc_run(served, "ps", "--json")
    assert (done.returncode, done.stdout) == (2, b"")
    assert done.stderr.decode() == (
        f"rc: rc {command} --stdin: standard input is not open (rc was started with <&-); "
        "give the job's input on it (< FILE, or a pipe), or leave out --stdin\n"
    )
    assert json.loads(listed.stdout)["jobs"] == []  # nothing was queued


@pytest.mark.parametrize(
    ("closed", "why"), [(rc_into_closed_pipe, "Broken pipe"), (rc_stdout_not_open, "not open")]
)
@pytest.mark.parametrize("json_mode", [False, True])
async def test_rc_run_into_a_closed_pipe_says_so(
    served: str,
    json_mode: bool,
    closed: Callable[..., Awaitable[subprocess.CompletedProcess[bytes]]],
    why: str,
) -> None:
    # rc run's status is the job's: a quiet 0 would say it succeeded. So a closed stdout is
    # one line and status 1, whether it was to carry the output or (--json) the record.
    # (Started with no stdout, `>&-`, it said the controller "answered something rc cannot
    # read".)
    async with httpx.AsyncClient(base_url=served) as http:
        w = FakeWorker(http, token=WORKER)
        with trio.fail_after(60):
            await w.register()
            async with trio.open_nursery() as nursery:
                done: list[subprocess.CompletedProcess[bytes]] = []

                async def run() -> None:
                    argv = ["run", *(["--json"] if json_mode else []), "--", "x"]
                    done.append(await closed(served, *argv))

                nursery.start_soon(run)
                a = await w.run_one(output=b"out\n")
    [proc] = done
    err = proc.stderr.decode()
    assert proc.returncode == 1, err
    job = a["job_id"]
    assert err.splitlines()[0] == f"rc: job {job}"
    if json_mode:
        assert err.splitlines()[1:] == [
            "out",  # the job's output, on stderr with --json
            f"rc: cannot write the record of job {job} to stdout ({why}); it ended "
            f"succeeded: rc show --json {job}",
        ]
    else:
        assert err.splitlines()[1:] == [
            f"rc: cannot write the output to stdout ({why}); 4 bytes were not written"
        ]


async def rc_stderr_closed(url: str, *argv: str, how: str) -> subprocess.CompletedProcess[bytes]:
    """``rc ARGV 2>&-`` (``how`` "not open"), or stderr a pipe whose reader has gone."""
    if how == "not open":
        return await trio.run_process(
            ["sh", "-c", 'exec "$0" "$@" 2>&-', RC, *argv],
            env=rc_env(url),
            capture_stdout=True,
            check=False,
        )
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        return await trio.run_process(
            [RC, *argv], env=rc_env(url), capture_stdout=True, stderr=write_end, check=False
        )
    finally:
        os.close(write_end)


@pytest.mark.parametrize("how", ["closed pipe", "not open"])
async def test_a_closed_stderr_leaves_json_on_stdout_alone(served: str, how: str) -> None:
    # rc's notes (`rc: job J`, warnings) are best effort on a closed stderr: rc run --json
    # --quiet still prints the record and exits with the job's status (it exited 1 at the
    # note), and with `2>&-` no note lands on stdout, in the JSON (print's default).
    async with httpx.AsyncClient(base_url=served) as http:
        w = FakeWorker(http, token=WORKER)
        with trio.fail_after(60):
            await w.register()
            submit = await rc_stderr_closed(
                served, "submit", "--json", "--select", "product=V100", "--", "x", how=how
            )
            assert submit.returncode == 0
            assert json.loads(submit.stdout)["job_id"]  # the whole of stdout, the warning not in it
            async with trio.open_nursery() as nursery:
                done: list[subprocess.CompletedProcess[bytes]] = []

                async def run() -> None:
                    argv = ["run", "--json", "--quiet", "--", "y"]
                    done.append(await rc_stderr_closed(served, *argv, how=how))

                nursery.start_soon(run)
                a = await w.run_one(output=b"out\n", exit_code=5)
    [proc] = done
    assert proc.returncode == 5
    record = json.loads(proc.stdout)
    assert (record["job_id"], record["state"]) == (a["job_id"], "failed")


async def test_run_json_prints_only_the_final_record(served: str) -> None:
    async with httpx.AsyncClient(base_url=served) as http:
        w = FakeWorker(http, token=WORKER)
        with trio.fail_after(60):
            await w.register()
            async with rc_client(["run", "--json", "--", "sh", "-c", "echo out"], served) as (
                proc,
                out,
                err,
            ):
                await w.run_one(output=b"out\n{not json\n", exit_code=4)
        assert proc.returncode == 4
        job = json.loads(out.data)  # the whole of stdout is one JSON object
        assert job["state"] == "failed"
        assert job["exit_code"] == 4
        assert job["committed_bytes"] == len(b"out\n{not json\n")
        assert b"out\n{not json\n" in err.data  # the job's output went to stderr

        with trio.fail_after(60):
            async with rc_client(["run", "--json", "--quiet", "--", "true"], served) as (
                proc,
                out,
                err,
            ):
                a = await w.run_one(output=b"secret output\n")
        assert proc.returncode == 0
        assert json.loads(out.data)["job_id"] == a["job_id"]
        assert b"secret output" not in err.data + out.data


async def test_logs_json_is_one_object_per_chunk(served: str) -> None:
    async with httpx.AsyncClient(base_url=served) as http:
        w = FakeWorker(http, token=WORKER)
        with trio.fail_after(60):
            await w.register()
            submitted = await rc_run(served, "submit", "--", "x")
            job = submitted.stdout.decode().strip()
            [a] = await w.poll(wait_s=5)
            await w.start(a)
            await w.output(a, 0, b"first \xff\n")
            async with rc_client(["logs", "-f", "--json", job], served) as (proc, out, _):
                await out.until(b"\n")
                await w.output(a, 8, b"second\n")
                await w.finish(a, output_bytes=15)
            assert proc.returncode == 0
            chunks = [json.loads(line) for line in out.data.splitlines()]
            assert len(chunks) >= 2
            data = b""
            for chunk in chunks:
                assert chunk["offset"] == len(data)
                piece = base64.b64decode(chunk["data"])
                assert chunk["length"] == len(piece)
                data += piece
            assert data == b"first \xff\nsecond\n"
            whole = await rc_run(served, "logs", "--json", "--offset", "8", job)
            [line] = whole.stdout.splitlines()
            assert json.loads(line)["offset"] == 8
            assert base64.b64decode(json.loads(line)["data"]) == b"second\n"


async def test_controller_killed_under_rc_run_and_logs_is_exit_3() -> None:
    with trio.fail_after(90):
        async with rc_serve() as served, httpx.AsyncClient(base_url=served.url) as http:
            w = FakeWorker(http, token=WORKER)
            await w.register()
            async with rc_client(
                ["run", "--reconnect", "1s", "--", "sleep", "1000"], served.url
            ) as run:
                [a] = await w.poll(wait_s=10)
                await w.start(a)
                await w.output(a, 0, b"hello\n")
                await run[1].until(b"hello\n")
                async with rc_client(
                    ["logs", "-f", "--reconnect", "1s", a["job_id"]], served.url
                ) as logs:
                    await logs[1].until(b"hello\n")
                    served.proc.kill()
        for proc, out, err in (run, logs):
            assert proc.returncode == rc_cli.EXIT_CONTROLLER_GONE, err.data
            assert out.data == b"hello\n"
            text = err.data.decode()
            assert "Traceback" not in text
            last = text.splitlines()[-1]
            assert last.startswith(f"rc: lost the controller at {served.url} while following")
            assert "no answer for 1s" in last
        # Nothing else on stderr but the job id rc run announced.
        assert run[2].data.decode().splitlines()[:-1] == [f"rc: job {a['job_id']}"]
        assert logs[2].data.decode().count("\n") == 1


async def test_a_restarted_controller_that_forgot_the_job_is_exit_3() -> None:
    with trio.fail_after(90):
        async with rc_serve() as first, httpx.AsyncClient(base_url=first.url) as http:
            w = FakeWorker(http, token=WORKER)
            await w.register()
            async with rc_client(["run", "--", "sleep", "1000"], first.url) as (proc, out, err):
                [a] = await w.poll(wait_s=10)
                await w.start(a)
                await w.output(a, 0, b"hello\n")
                await out.until(b"hello\n")
                first.proc.kill()
                await first.proc.wait()
                async with rc_serve(f"127.0.0.1:{first.port}"):
                    await err.until(b"no longer knows")
                    await proc.wait()
    assert proc.returncode == 3
    last = err.data.decode().splitlines()[-1]
    assert last == (
        f"rc: the controller at {first.url} no longer knows job {a['job_id']} "
        "(it restarted without its stored state)"
    )


async def test_rc_run_resumes_through_dropped_connections(served: str) -> None:
    proxy = DroppingProxy(int(served.rsplit(":", 1)[1]))
    async with trio.open_nursery() as nursery, httpx.AsyncClient(base_url=served) as http:
        proxied = await nursery.start(proxy.serve)
        w = FakeWorker(http, token=WORKER)
        with trio.fail_after(60):
            await w.register()
            async with rc_client(["run", "--", "x"], proxied) as (proc, out, err):
                [a] = await w.poll(wait_s=10)
                await w.start(a)
                await w.output(a, 0, b"part one\n")
                await out.until(b"part one\n")
                proxy.drop()  # cut rc run's stream, and refuse it for a while
                await w.output(a, 9, b"part two\n")
                await proxy.retried.wait()  # rc run tried twice while it was down
                proxy.restore()
                await out.until(b"part two\n")
                await w.finish(a, output_bytes=18)
        nursery.cancel_scope.cancel()
    assert proc.returncode == 0
    assert out.data == b"part one\npart two\n"  # resumed at its offset: nothing twice
    assert b"Traceback" not in err.data


def port_of(url: str) -> int:
    return int(url.rsplit(":", 1)[1])


@pytest.mark.parametrize("command", ["run", "logs"])
async def test_rc_run_and_logs_wait_for_a_standby_and_resume(served: str, command: str) -> None:
    # Behind one address, the controller's stream is cut and a standby answers (503 with
    # Retry-After) until the controller is back: rc waits as for a lost connection and resumes
    # at its offset (it stopped at the first 503, status 1).
    proxy = DroppingProxy(port_of(served))
    standby = Standby()
    async with trio.open_nursery() as nursery, httpx.AsyncClient(base_url=served) as http:
        proxied = await nursery.start(proxy.serve)
        standby_port = port_of(await nursery.start(standby.serve))
        w = FakeWorker(http, token=WORKER)
        with trio.fail_after(60):
            await w.register()
            if command == "run":
                argv = ["run", "--", "x"]
            else:
                job = (await rc_run(served, "submit", "--", "x")).stdout.decode().strip()
                argv = ["logs", "-f", job]
            async with rc_client(argv, proxied) as (proc, out, err):
                [a] = await w.poll(wait_s=10)
                await w.start(a)
                await w.output(a, 0, b"part one\n")
                await out.until(b"part one\n")
                proxy.target_port = standby_port
                proxy.drop()  # cut the stream; new connections reach the standby
                proxy.restore()
                await w.output(a, 9, b"part two\n")
                async with trio.open_nursery() as race:

                    async def rc_ended() -> None:
                        await proc.wait()
                        race.cancel_scope.cancel()

                    race.start_soon(rc_ended)
                    await standby.until(2)  # rc asked the standby twice
                    race.cancel_scope.cancel()
                assert proc.returncode is None, err.data
                proxy.target_port = port_of(served)
                proxy.drop()  # the controller is back at the address
                proxy.restore()
                await out.until(b"part two\n")
                await w.finish(a, output_bytes=18)
        nursery.cancel_scope.cancel()
    assert proc.returncode == 0, err.data
    assert out.data == b"part one\npart two\n"  # resumed at its offset: nothing twice
    notes = [f"rc: job {a['job_id']}"] if command == "run" else []
    assert err.data.decode().splitlines() == notes


async def test_a_standby_that_stays_one_past_reconnect_is_exit_3() -> None:
    standby = Standby()
    async with trio.open_nursery() as nursery:
        url = await nursery.start(standby.serve)
        with trio.fail_after(60):
            done = await rc_run(url, "logs", "-f", "--reconnect", "1s", "j-1")
        nursery.cancel_scope.cancel()
    assert done.returncode == rc_cli.EXIT_CONTROLLER_GONE
    assert done.stdout == b""
    assert done.stderr.decode() == (
        f"rc: lost the controller at {url} while following job j-1 (unavailable for 1s; "
        "503 standby: this controller is a standby; the active one holds the database (try "
        "the next controller_url)); the job may still run: rc logs -f j-1\n"
    )
    assert standby.answered >= 2  # it tried again before giving up


async def test_pending_reasons_end_to_end(served: str) -> None:
    async with httpx.AsyncClient(base_url=served) as http:
        w = FakeWorker(http, token=WORKER, labels=H100)
        with trio.fail_after(60):
            await w.register()
            never = await rc_run(served, "submit", "--select", "product=V100", "--", "x")
            assert never.returncode == 0
            job = never.stdout.decode().strip()
            assert never.stderr.decode() == (
                f"rc: warning: no registered device could ever run job {job}: no registered "
                "device satisfies 'product=V100'; it waits in the queue (--strict refuses such "
                "jobs)\n"
            )
            strict = await rc_run(served, "run", "--strict", "--select", "product=V100", "--", "x")
            assert strict.returncode == 1
            assert strict.stdout == b""
            assert "no_match" in strict.stderr.decode()
            await rc_run(served, "idle", "box1/gpu0", "hold")
            held = (await rc_run(served, "submit", "--device", "box1/gpu0", "--", "y")).stdout
            ps = (await rc_run(served, "ps")).stdout.decode().splitlines()
            assert len(ps) == 3  # the header and one row per job (the strict one was refused)
            assert "no registered device satisfies 'product=V100'" in ps[1]
            assert "the pinned device box1/gpu0 is held (rc idle box1/gpu0 run)" in ps[2]
            show = (await rc_run(served, "show", held.decode().strip())).stdout.decode()
            assert "waiting    the pinned device box1/gpu0 is held" in show
            shown = json.loads((await rc_run(served, "show", "--json", job)).stdout)
            assert shown["pending_code"] == "no_match"
