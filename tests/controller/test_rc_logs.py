"""``rc logs`` writes everything or fails loudly (issue 12), as a real process."""

from __future__ import annotations

import fcntl
import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
import trio

from rc_worker.controller import Store, StoreConfig, create_app
from rc_worker.controller.serve import serve

from .helpers import USER_TOKEN, USER_TOKENS, WORKER_TOKENS, FakeWorker

RC = str(Path(sys.executable).parent / "rc")


async def test_rc_logs_through_a_non_blocking_pipe_writes_every_byte() -> None:
    store = Store(instance="t")
    app = create_app(store=store, worker_tokens=WORKER_TOKENS, user_tokens=USER_TOKENS)
    payload = bytes(range(256)) * 8192  # 2 MiB, every byte value
    with trio.fail_after(60):
        async with httpx.AsyncClient(
            transport=httpx.ASGITransport(app=app), base_url="http://rc"
        ) as http:
            w = FakeWorker(http)
            await w.register()
            job = store.submit(["x"])
            [a] = await w.poll(wait_s=1)
            await w.start(a)
            step = 1 << 20
            for offset in range(0, len(payload), step):
                await w.output(a, offset, payload[offset : offset + step])
            await w.finish(a, "succeeded", exit_code=0, output_bytes=len(payload))
        async with trio.open_nursery() as nursery:
            [url] = await nursery.start(serve, app, "127.0.0.1:0")
            read_end, write_end = os.pipe()
            # The reader's side made the pipe non-blocking (as some pagers and shells do).
            flags = fcntl.fcntl(write_end, fcntl.F_GETFL)
            fcntl.fcntl(write_end, fcntl.F_SETFL, flags | os.O_NONBLOCK)
            env = {**os.environ, "RC_URL": url, "RC_USER_TOKEN": USER_TOKEN}
            proc = await trio.lowlevel.open_process(
                [RC, "logs", job], stdout=write_end, stderr=subprocess.PIPE, env=env
            )
            os.close(write_end)
            got = bytearray()
            reader = trio.lowlevel.FdStream(read_end)
            try:
                while True:
                    await trio.sleep(0.001)  # a slow reader: the pipe fills again and again
                    chunk = await reader.receive_some(4096)
                    if not chunk:
                        break
                    got += chunk
                assert await proc.wait() == 0
            finally:
                await reader.aclose()
                if proc.returncode is None:
                    proc.kill()
                    await proc.wait()
            nursery.cancel_scope.cancel()
    assert len(got) == len(payload)
    assert bytes(got) == payload


def test_rc_logs_fails_loudly_when_stdout_refuses(tmp_path: Path) -> None:
    # /dev/full refuses every write with ENOSPC: the error must be reported, not dropped.
    script = (
        "import sys\n"
        "from rc_worker.controller import rc_follow\n"
        "try:\n"
        "    rc_follow.write_all(sys.stdout, b'x' * 100000)\n"
        "except rc_follow.CliError as e:\n"
        "    print(e, file=sys.stderr)\n"
        "    sys.exit(e.status)\n"
    )
    with open("/dev/full", "wb") as full:
        proc = subprocess.run(
            [sys.executable, "-c", script], stdout=full, stderr=subprocess.PIPE, check=False
        )
    assert proc.returncode == 1
    assert b"cannot write the output to stdout (No space left on device)" in proc.stderr


@pytest.mark.parametrize(
    "argv",
    [
        ["logs", "{job}"],
        ["logs", "--follow", "{job}"],
        ["logs", "--json", "{job}"],
        ["logs", "--json", "--follow", "{job}"],
        # Nothing from that offset: only the last line saying the output was capped.
        ["logs", "{job}", "--offset", "2000000"],
        ["logs", "--json", "--follow", "{job}", "--offset", "2000000"],
    ],
)
@pytest.mark.parametrize("stdout", ["closed pipe", "not open"])
async def test_rc_logs_into_a_closed_pipe_stops_quietly(argv: list[str], stdout: str) -> None:
    # `rc logs J | head -c 10`: once the reader has gone, rc stops with status 0 and says
    # nothing (it used to say "cannot write the output to stdout" and exit 1, or with
    # --json print "[Errno 32] Broken pipe"). So does `rc logs J >&-`, started without a
    # stdout (it said the controller "answered something rc cannot read").
    store = Store(StoreConfig(max_output_bytes=1 << 20), instance="t")
    app = create_app(store=store, worker_tokens=WORKER_TOKENS, user_tokens=USER_TOKENS)
    with trio.fail_after(60):
        async with httpx.AsyncClient(
            transport=httpx.ASGITransport(app=app), base_url="http://rc"
        ) as http:
            w = FakeWorker(http)
            await w.register()
            job = store.submit(["x"])
            # 1 MiB kept (more than a pipe holds), then the job's output is capped.
            await w.run_one(b"z" * (3 << 20))
        assert store.job(job).output_truncated
    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            [url] = await nursery.start(serve, app, "127.0.0.1:0")
            read_end, write_end = os.pipe()
            os.close(read_end)  # the reader is gone before rc writes anything
            env = {**os.environ, "RC_URL": url, "RC_USER_TOKEN": USER_TOKEN}
            command = [RC, *(arg.format(job=job) for arg in argv)]
            if stdout == "not open":
                command = ["sh", "-c", 'exec "$0" "$@" >&-', *command]
            try:
                proc = await trio.run_process(
                    command,
                    stdout=write_end,
                    capture_stderr=True,
                    env=env,
                    check=False,
                )
            finally:
                os.close(write_end)
            nursery.cancel_scope.cancel()
    assert proc.stderr == b""
    assert proc.returncode == 0
