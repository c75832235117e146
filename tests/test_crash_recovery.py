"""A real ``rc-worker run`` process killed with SIGKILL in the middle of a job, and started again.

The reference controller is served over HTTP on 127.0.0.1 (port 0) in the
test's own nursery; the worker is the installed ``rc-worker`` command, run
as a subprocess exactly as an operator runs it. The job keeps running after
its worker dies (it is in its own session), so the restarted worker must find
it by its RC_JOB_ID, remove it, ship the output spooled before the crash,
finish the job ``lost`` and claim what it proved at register; the controller
then frees the device or keeps it quarantined as the rules say.

Every process a test starts is killed on the way out, even on failure: the
workers by their pid, the job's leftovers by the test's own unique job id.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import signal
import subprocess
import sys
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any, BinaryIO

import trio
from hypercorn.trio import serve as hypercorn_serve

from rc_worker.controller import Store, StoreConfig, create_app
from rc_worker.controller.serve import hypercorn_config
from rc_worker.core.config import WORKER_ENV_VARS
from rc_worker.host import LinuxHost
from rc_worker.testing import wait_until

HOST = "crash-host"
RC_WORKER = Path(sys.executable).with_name("rc-worker")


class OutputGate:
    """ASGI middleware: while closed, output appends get a 503 (nothing is committed),
    and an output request already under way is held: the rest of its (streamed) body is
    not read until the gate opens again.

    Holds output back at the controller so that, at the moment of the crash,
    the worker's spool holds bytes the controller has not got yet.
    """

    def __init__(self, app: Any) -> None:
        self.app = app
        self._closed = False
        self._opened = trio.Event()
        self._opened.set()

    @property
    def closed(self) -> bool:
        return self._closed

    @closed.setter
    def closed(self, value: bool) -> None:
        self._closed = value
        if value and self._opened.is_set():
            self._opened = trio.Event()
        elif not value:
            self._opened.set()

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        output = scope["type"] == "http" and scope["path"].endswith("/output")
        if output and not self.closed:

            async def held_receive() -> Any:
                message = await receive()
                # Held after it arrived: a receive already waiting when the
                # gate closed must not slip its bytes through.
                await self._opened.wait()
                return message

            await self.app(scope, held_receive, send)
            return
        if self.closed and output:
            await send(
                {
                    "type": "http.response.start",
                    "status": 503,
                    "headers": [(b"content-type", b"application/json")],
                }
            )
            await send(
                {
                    "type": "http.response.body",
                    "body": b'{"error": "unavailable", "message": "held back by the test"}',
                }
            )
            return
        await self.app(scope, receive, send)


async def poll_until(predicate: Callable[[], bool]) -> None:
    # For facts nothing can notify us about (another process's files, the
    # process table), a short poll is the honest mechanism.
    while not predicate():  # noqa: ASYNC110
        await trio.sleep(0.02)


def job_pids(job_id: str) -> list[int]:
    """Live processes whose environment carries exactly ``RC_JOB_ID=<job_id>``."""
    needle = f"RC_JOB_ID={job_id}".encode()
    pids = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            environ = Path(f"/proc/{name}/environ").read_bytes()
            stat = Path(f"/proc/{name}/stat").read_bytes()
        except OSError:
            continue
        state = stat.rpartition(b")")[2].split()[:1]
        if needle in environ.split(b"\0") and state not in ([b"Z"], [b"X"]):
            pids.append(int(name))
    return sorted(pids)


def kill_job_processes(job_id: str) -> None:
    # Only processes that carry this test's own, unique job id.
    for pid in job_pids(job_id):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def _create(path: Path) -> BinaryIO:
    return open(path, "wb")  # a local file, created empty: no need for a thread


class Harness:
    def __init__(
        self, tmp_path: Path, store: Store, gate: OutputGate, url: str, token: str
    ) -> None:
        self.tmp_path = tmp_path
        self.store = store
        self.gate = gate
        self.token = token
        self.job_ids: list[str] = []  # every job submitted: their leftovers are killed at the end
        self.config = tmp_path / "worker.yaml"
        self.state = tmp_path / "state"
        self.config.write_text(
            f"controller_url: {url}\n"
            f"host: {HOST}\n"
            "devices: [gpu0]\n"
            f"state_dir: {self.state}\n"
            f"probe_dir: {tmp_path / 'probe.d'}\n"
            f"verify_dir: {tmp_path / 'verify.d'}\n"
            f"sheet_dir: {tmp_path / 'sheets'}\n"
            "probe_timeout: 5s\n"
            "shutdown_grace: 20s\n"
        )
        self.workers: list[trio.Process] = []
        self.logs: list[Path] = []

    async def start_worker(self, **extra_env: str) -> trio.Process:
        log = self.tmp_path / f"worker-{len(self.workers)}.log"
        self.logs.append(log)
        # The worker's own settings come from the test alone, never from
        # whatever environment the test suite happens to run in.
        inherited = {k: v for k, v in os.environ.items() if k not in WORKER_ENV_VARS}
        env = {**inherited, "RC_TOKEN": self.token, **extra_env}
        with _create(log) as out:
            proc = await trio.lowlevel.open_process(
                [str(RC_WORKER), "--log-level", "debug", "run", "--config", str(self.config)],
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                env=env,
            )
        self.workers.append(proc)
        return proc

    def log_text(self) -> str:
        return "\n".join(f"--- {log.name}\n{log.read_text(errors='replace')}" for log in self.logs)

    async def stop_all(self) -> None:
        for proc in self.workers:
            if proc.returncode is None:
                proc.kill()
            await proc.wait()


@contextlib.asynccontextmanager
async def crash_harness(tmp_path: Path) -> AsyncIterator[Harness]:
    """A served reference controller, and cleanup of every process started."""
    token = secrets.token_urlsafe(24)
    # A host is lost only after a minute of silence: the restart here takes
    # seconds, so the register rules, not host loss, decide the device.
    store = Store(StoreConfig(heartbeat_interval_s=0.5, missed_heartbeats=120, poll_wait_s=5.0))
    app = create_app(store=store, worker_tokens={token: HOST}, user_tokens=[])
    gate = OutputGate(app)
    async with trio.open_nursery() as nursery:
        binds = await nursery.start(
            lambda task_status: hypercorn_serve(
                gate, hypercorn_config("127.0.0.1:0"), task_status=task_status
            )
        )
        harness = Harness(tmp_path, store, gate, binds[0], token)
        try:
            yield harness
        finally:
            with trio.move_on_after(10, shield=True):
                await harness.stop_all()
                for job_id in harness.job_ids:
                    kill_job_processes(job_id)
            print(harness.log_text())
            nursery.cancel_scope.cancel()


async def crash_mid_job(h: Harness) -> tuple[str, list[int]]:
    """Run a job, hold its second line back at the controller, SIGKILL the worker.

    Returns the job id and the job's processes, still alive after the crash.
    """
    go = h.tmp_path / "go"
    job_id = h.store.submit(
        ["sh", "-c", f"echo one; while [ ! -e {go} ]; do sleep 0.02; done; echo two; sleep 300"]
    )
    h.job_ids.append(job_id)
    worker = await h.start_worker()
    await wait_until(h.store, lambda: h.store.committed(job_id) == len(b"one\n"))
    # The journal was on disk before the job's process existed.
    journal = json.loads((h.state / "jobs" / f"{job_id}.1" / "journal.json").read_text())
    assert journal["job_id"] == job_id
    assert journal["attempt"] == 1
    assert journal["device"] == "gpu0"
    assert journal["boot_id"] == LinuxHost().boot_id()
    assert isinstance(journal["started_at"], float)
    h.gate.closed = True
    go.touch()
    spool = h.state / "jobs" / f"{job_id}.1" / "output"
    await poll_until(lambda: spool.read_bytes() == b"one\ntwo\n")
    # The shell and its `sleep 300`, both carrying the job's id.
    await poll_until(lambda: len(job_pids(job_id)) == 2)
    worker.kill()  # SIGKILL, this pid only
    await worker.wait()
    leftovers = job_pids(job_id)
    assert len(leftovers) == 2, "the job must outlive its worker"
    assert h.store.job(job_id).state == "running"
    assert h.store.committed(job_id) == len(b"one\n")
    h.gate.closed = False
    return job_id, leftovers


def device(h: Harness) -> Any:
    return h.store.device(HOST, "gpu0")


async def stop_cleanly(h: Harness, worker: trio.Process) -> None:
    worker.send_signal(signal.SIGTERM)
    assert await worker.wait() == 0
    assert not list((h.state / "jobs").iterdir()), "the spool outlived an acknowledged finish"
    assert h.token not in h.log_text()


async def test_a_sigkilled_workers_leftover_is_removed_and_its_device_freed(
    tmp_path: Path,
) -> None:
    with trio.fail_after(60):
        async with crash_harness(tmp_path) as h:
            job_id, leftovers = await crash_mid_job(h)
            worker = await h.start_worker()
            await wait_until(h.store, lambda: h.store.job(job_id).terminal)
            info = h.store.job(job_id)
            assert info.state == "lost"
            assert info.sweep is not None
            assert set(leftovers) <= set(info.sweep["found"])  # type: ignore[call-overload]
            assert info.sweep["remaining"] == []
            assert job_pids(job_id) == []
            # Every byte written before the crash, once, in order.
            await wait_until(h.store, lambda: h.store.committed(job_id) == len(b"one\ntwo\n"))
            assert h.store.output(job_id) == b"one\ntwo\n"
            # Claim gone: the device is free, and takes work again.
            assert device(h).state == "free"
            after = h.store.submit(["echo", "after"])
            h.job_ids.append(after)
            await wait_until(h.store, lambda: h.store.job(after).terminal)
            assert h.store.job(after).state == "succeeded"
            assert h.store.job(after).device == "gpu0"
            assert not [e for e in h.store.events() if e.type == "device_quarantined"]
            await stop_cleanly(h, worker)


async def test_after_a_sigkill_an_empty_cgroup_proves_the_job_gone(tmp_path: Path) -> None:
    # The job ends while no worker runs. With a cgroup (root, CI) the journal
    # names it, and an empty cgroup is proof: gone, the device free.
    with trio.fail_after(60):
        async with crash_harness(tmp_path) as h:
            job_id, leftovers = await crash_mid_job(h)
            journal = json.loads((h.state / "jobs" / f"{job_id}.1" / "journal.json").read_text())
            for pid in leftovers:  # the job's own processes, which this test started
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            await poll_until(lambda: job_pids(job_id) == [])
            worker = await h.start_worker()
            await wait_until(h.store, lambda: h.store.job(job_id).terminal)
            info = h.store.job(job_id)
            assert info.state == "lost"
            assert info.sweep is not None
            assert info.sweep["found"] == []
            assert info.sweep["method"] == ("cgroup" if journal["cgroup"] else "environ")
            assert device(h).state == "free"
            await stop_cleanly(h, worker)


async def test_with_manual_clear_the_device_stays_quarantined_until_cleared(
    tmp_path: Path,
) -> None:
    with trio.fail_after(60):
        async with crash_harness(tmp_path) as h:
            job_id, leftovers = await crash_mid_job(h)
            worker = await h.start_worker(RC_REQUIRE_MANUAL_CLEAR="1")
            await wait_until(h.store, lambda: h.store.job(job_id).terminal)
            info = h.store.job(job_id)
            assert info.state == "lost"
            # It still looked and removed what it found; it just claims nothing.
            assert info.sweep is not None
            assert set(leftovers) <= set(info.sweep["found"])  # type: ignore[call-overload]
            assert job_pids(job_id) == []
            await wait_until(h.store, lambda: h.store.committed(job_id) == len(b"one\ntwo\n"))
            assert h.store.output(job_id) == b"one\ntwo\n"
            assert device(h).state == "quarantined"
            assert device(h).reason == "interrupted"
            waiting = h.store.submit(["echo", "after"])
            h.job_ids.append(waiting)
            # The worker has told the controller it holds the quarantine; no
            # offer was made, and none will be while the fault stands.
            await wait_until(h.store, lambda: device(h).worker_state == "quarantined")
            assert h.store.job(waiting).state == "queued"
            h.store.clear(HOST, "gpu0")
            await wait_until(h.store, lambda: h.store.job(waiting).terminal)
            assert h.store.job(waiting).state == "succeeded"
            await stop_cleanly(h, worker)
