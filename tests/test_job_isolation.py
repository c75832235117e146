"""Jobs never act as the worker (issue 12), with a real ``rc-worker run`` process.

A job must not find the worker's token (not in its environment, not in the
worker's ``/proc/PID/environ``), must not inherit any ``RC_*`` variable the
worker had, and must not learn another job's id from ``/status``. With
``job_user`` set and the worker running as root, jobs run as that user and
cannot read the worker's state either.
"""

from __future__ import annotations

import os
import pwd
import shutil
import signal
import sys
import tempfile
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path

import pytest
import trio

from rc_worker.controller import create_app
from rc_worker.controller.serve import serve
from rc_worker.controller.store import Store, StoreConfig

RC_WORKER = str(Path(sys.executable).parent / "rc-worker")
TOKEN = "isolation-worker-token-0123456789"
USER_SECRET = "isolation-user-token-abcdef"

SPY = r"""
echo "uid=$(id -u)"
env | sort | sed 's/^/env:/'
if tr '\0' '\n' < /proc/$PPID/environ > /dev/null 2>&1; then
  tr '\0' '\n' < /proc/$PPID/environ | sed 's/^/parent:/'
else
  echo "parent: unreadable"
fi
ls "$STATE" > /dev/null 2>&1 && echo "state: readable" || echo "state: unreadable"
ls "$PUBLIC" > /dev/null 2>&1 && echo "public: readable" || echo "public: unreadable"
python3 -c "import urllib.request as u,sys; print('status:', u.urlopen(sys.argv[1]).read())" \
  "$STATUS"
"""


async def _wait(store: Store, predicate: Callable[[], bool]) -> None:
    while not predicate():
        changed = trio.Event()
        unsubscribe = store.subscribe(changed.set)
        try:
            await changed.wait()
        finally:
            unsubscribe()


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@asynccontextmanager
async def worker_process(tmp_path: Path, extra: str) -> AsyncIterator[tuple[Store, str]]:
    store = Store(StoreConfig(heartbeat_interval_s=0.5, poll_wait_s=2.0))
    app = create_app(store=store, worker_tokens={TOKEN: "iso-host"})
    status = f"127.0.0.1:{_free_port()}"
    async with trio.open_nursery() as nursery:
        binds = await nursery.start(serve, app, "127.0.0.1:0")
        config = tmp_path / "worker.yaml"
        config.write_text(
            f"controller_url: {binds[0]}\n"
            "host: iso-host\n"
            "devices: [gpu0, gpu1]\n"
            f"state_dir: {tmp_path / 'state'}\n"
            f"probe_dir: {tmp_path / 'probe.d'}\n"
            f"verify_dir: {tmp_path / 'verify.d'}\n"
            f"sheet_dir: {tmp_path / 'sheets'}\n"
            f"status_listen: {status}\n"
            "heartbeat_interval: 0.5s\n"
            "poll_wait: 2s\n" + extra
        )
        env = {
            **os.environ,
            "RC_TOKEN": TOKEN,
            "RC_USER_TOKEN": USER_SECRET,
            "RC_URL": "http://elsewhere:1",
        }
        proc = await trio.lowlevel.open_process(
            [RC_WORKER, "run", "--config", str(config)], env=env
        )
        try:
            await _wait(store, lambda: any(d.host == "iso-host" for d in store.devices()))
            yield store, f"http://{status}/status"
        finally:
            # Shielded: a guard that fired must not leave the worker (and its
            # jobs) running because the waits below were cancelled too.
            with trio.CancelScope(shield=True):
                if proc.returncode is None:
                    proc.send_signal(signal.SIGQUIT)
                    with trio.move_on_after(15):
                        await proc.wait()
                    if proc.returncode is None:
                        proc.kill()
                        await proc.wait()
            nursery.cancel_scope.cancel()


async def _spy(store: Store, tmp_path: Path, status: str) -> tuple[str, str]:
    (tmp_path / "public").mkdir(mode=0o755, exist_ok=True)
    (tmp_path / "public").chmod(0o755)
    victim = store.submit(["sleep", "60"], device="iso-host/gpu0", grace_s=0.5)
    await _wait(store, lambda: store.job(victim).state == "running")
    spy = store.submit(
        ["sh", "-c", SPY],
        device="iso-host/gpu1",
        cwd="/",
        env={
            "STATE": str(tmp_path / "state"),
            "PUBLIC": str(tmp_path / "public"),
            "STATUS": status,
        },
    )
    await _wait(store, lambda: store.job(spy).terminal)
    store.cancel(victim)
    await _wait(store, lambda: store.job(victim).terminal)
    return victim, store.output(spy).decode()


async def test_a_job_finds_neither_token_nor_rc_variables(tmp_path: Path) -> None:
    with trio.fail_after(20):
        async with worker_process(tmp_path, "") as (store, status):
            victim, out = await _spy(store, tmp_path, status)
    env_lines = [line for line in out.splitlines() if line.startswith("env:RC_")]
    assert sorted(line.split("=")[0] for line in env_lines) == [
        "env:RC_DEVICE",
        "env:RC_HOST",
        "env:RC_JOB_ID",
    ]
    assert TOKEN not in out  # neither in its environment nor in the worker's /proc environ
    assert USER_SECRET not in out
    assert "http://elsewhere:1" not in out
    assert "status:" in out
    assert victim not in out  # /status over TCP lists no job ids


@pytest.mark.skipif(os.geteuid() != 0, reason="switching users needs a root worker")
async def test_job_user_runs_jobs_unprivileged() -> None:
    nobody = pwd.getpwnam("nobody")
    # Not under pytest's tmp_path: its base (/tmp/pytest-of-root) is 0700, so the
    # job's user could read nothing there whatever the state dir allowed, and the
    # state check below could not fail. Here only state_dir itself is closed (0700).
    base = Path(tempfile.mkdtemp(prefix="rc-isolation-"))
    try:
        os.chmod(base, 0o755)
        with trio.fail_after(20):
            async with worker_process(base, "job_user: nobody\n") as (store, status):
                victim, out = await _spy(store, base, status)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    assert f"uid={nobody.pw_uid}" in out
    assert "parent: unreadable" in out
    assert "public: readable" in out  # the control: nobody does reach what is open
    assert "state: unreadable" in out
    assert TOKEN not in out
    assert victim not in out
