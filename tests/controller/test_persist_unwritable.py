"""A state directory that stops taking writes while ``rc serve`` runs: ``503`` with
``Retry-After``, no ``200`` for anything it did not store, and recovery once it can
write again. Real: a real ``rc serve`` over a socket, a real SQLite, a real file system.

Why a full file system rather than ``chmod``: SQLite holds the database and its WAL
open, and permissions are checked only when a file is opened (and never for root,
which CI is), so a directory made read-only mid-run changes nothing for a controller
already running: it goes on storing, correctly. Remounting the file system read-only
is refused (``EBUSY``) while files are open for writing. A full file system is the
failure that does reach a running controller: the next write that needs space fails,
through the open descriptors, for root too. ``rc serve`` gets a small tmpfs of its own
(a private mount namespace: ``unshare -m``, or ``unshare -rm`` when not root), and the
test fills it through ``/proc/PID/root``.
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import signal
import subprocess
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest
import trio

from rc_worker.controller.persist.opening import open_backend, open_store
from rc_worker.controller.persist.sqlite import DB_NAME

from .helpers import FakeWorker, auth, wait_listening
from .rc_procs import RC

GUARD = 90
TMPFS_SIZE = 4 * 1024 * 1024
CHUNK = 256 * 1024


def _unshare() -> list[str]:
    """The command that gives ``rc serve`` a mount namespace of its own, or a test failure."""
    for argv in (["unshare", "-m"], ["unshare", "-r", "-m"]):
        if shutil.which("unshare") is None:
            break
        probe = subprocess.run([*argv, "true"], capture_output=True, check=False)
        if probe.returncode == 0:
            return argv
    pytest.fail(
        "this test gives rc serve a small tmpfs in a private mount namespace: run it as root, "
        "or where unprivileged user namespaces are allowed (unshare -rm)"
    )


@contextlib.asynccontextmanager
async def serve_on_small_tmpfs(state_dir: Path) -> AsyncIterator[tuple[trio.Process, str]]:
    mount = f'mount -t tmpfs -o size={TMPFS_SIZE},mode=0700 rc-test-state "$0" && exec "$@"'
    proc = await trio.lowlevel.open_process(
        [
            *_unshare(),
            "sh",
            "-c",
            mount,
            str(state_dir),
            RC,
            "serve",
            "--listen",
            "127.0.0.1:0",
            "--worker-token",
            "wt=box1",
            "--user-token",
            "ut=ops:admin",
            "--state-dir",
            str(state_dir),
        ],
        stderr=subprocess.PIPE,
    )
    try:
        with trio.fail_after(30):
            url = await wait_listening(proc)
        yield proc, url
    finally:
        if proc.returncode is None:
            proc.send_signal(signal.SIGKILL)
        with trio.move_on_after(10, shield=True):
            await proc.wait()


def fill(directory: Path) -> Path:
    """Take every free byte of the file system ``directory`` is on; the filler's path."""
    filler = directory / "filler"
    block = b"\0" * 65536
    with open(filler, "wb", buffering=0) as f:
        for _ in range(2 * TMPFS_SIZE // len(block)):  # bounded: the tmpfs is smaller
            try:
                f.write(block)
            except OSError as e:
                if e.errno != errno.ENOSPC:
                    raise
                break
        else:
            raise AssertionError(f"{directory} never filled up")
    return filler


async def test_a_full_state_directory_answers_503_and_recovers(tmp_path: Path) -> None:
    state_dir = tmp_path / "state"
    state_dir.mkdir()
    copy = tmp_path / "copy"
    copy.mkdir()
    with trio.fail_after(GUARD):
        async with serve_on_small_tmpfs(state_dir) as (proc, url):
            # The server's view of its state directory: its own tmpfs.
            seen = Path(f"/proc/{proc.pid}/root") / str(state_dir).lstrip("/")
            async with (
                httpx.AsyncClient(base_url=url, timeout=20) as bare,
                httpx.AsyncClient(base_url=url, headers=auth("ut"), timeout=20) as user,
            ):
                w = FakeWorker(bare, token="wt")
                await w.register()
                r = await user.post("/v1/jobs", json={"command": ["echo", "before"]})
                assert r.status_code == 200
                before = r.json()["job_id"]
                [a] = await w.poll()
                assert (await w.start(a)).status_code == 200
                first = os.urandom(CHUNK)
                assert (await w.output(a, 0, first)).json() == {"committed": CHUNK}

                filler = fill(seen)
                second = os.urandom(CHUNK)
                r = await w.output(a, CHUNK, second)
                assert r.status_code == 503, r.text
                assert r.headers["Retry-After"] == "2"
                assert r.json()["error"] == "store_unavailable"
                # Every later change is refused at once; nothing unstored is acknowledged.
                r = await user.post("/v1/jobs", json={"command": ["echo", "during"]})
                assert r.status_code == 503
                assert "Retry-After" in r.headers
                assert (await w.finish(a, output_bytes=2 * CHUNK)).status_code == 503
                # Reads still work, and health says the store is failing.
                assert (await user.get(f"/v1/jobs/{before}")).status_code == 200
                assert (await bare.get("/v1/health")).json()["store"] == "failing"

                filler.unlink()  # space again: the controller retries on its own
                for _ in range(300):  # bounded; the guard above stops it sooner
                    if (await bare.get("/v1/health")).json()["store"] == "ok":
                        break
                    await trio.sleep(0.2)
                r = await w.output(a, CHUNK, second)
                assert r.json() == {"committed": 2 * CHUNK}
                assert (await w.finish(a, output_bytes=2 * CHUNK)).status_code == 200
                r = await user.post("/v1/jobs", json={"command": ["echo", "after"]})
                assert r.status_code == 200
                after = r.json()["job_id"]
                # Quiet now: take a copy of the directory to open after the server is gone
                # (its tmpfs goes with its mount namespace).
                shutil.copytree(seen, copy, dirs_exist_ok=True)
    assert (copy / DB_NAME).exists()
    backend = open_backend(state_dir=copy)
    try:
        store, had = open_store(backend, now=0.0, recovery_grace_s=None)
        assert had
        assert store.in_memory(after)  # queued
        row = backend.read_job(before)
        assert row is not None
        assert '"state":"succeeded"' in row[0]
        assert row[1] == 2 * CHUNK
        assert backend.read_output(before, 0, None) == first + second
    finally:
        backend.close()
