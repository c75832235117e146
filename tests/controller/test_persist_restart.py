"""A controller killed with SIGKILL and restarted forgets nothing (real processes).

``rc serve`` and ``rc-worker run`` are real processes talking HTTP on
127.0.0.1; ``rc`` runs as a subprocess. Each test runs against SQLite and a
real PostgreSQL server (see conftest.py). Jobs wait on files the test creates,
never on time, so nothing here depends on how fast the machine is.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import trio

from .persistkit import StorePlace

BIN = Path(sys.executable).parent
GUARD = 180  # real processes on a shared, loaded machine: generous, never a timing claim
WORKER_TOKEN = "restart-worker"
USER_TOKEN = "restart-user"
HOST = "rbox"


class Controller:
    """One ``rc serve`` process after another, on the same port and store."""

    def __init__(self, place: StorePlace, tmp: Path) -> None:
        self.place = place
        self.tmp = tmp
        self.port = 0
        self.proc: trio.Process | None = None
        self.url = ""

    async def start(self) -> None:
        argv = [
            str(BIN / "rc"),
            "serve",
            "--listen",
            f"127.0.0.1:{self.port}",
            "--worker-token",
            WORKER_TOKEN,
            "--user-token",
            f"{USER_TOKEN}=ops:admin",
            "--heartbeat-interval",
            "2s",
            "--poll-wait",
            "2s",
            *self.place.cli_args(),
        ]
        self.proc = await trio.lowlevel.open_process(argv, stderr=subprocess.PIPE)
        assert self.proc.stderr is not None
        said = b""
        while b"listening on" not in said:
            chunk = await self.proc.stderr.receive_some(4096)
            assert chunk, f"rc serve ended before listening: {said.decode()}"
            said += chunk
        line = said.split(b"listening on ", 1)[1].split(b"\n")[0].decode()
        self.url = line.split(",")[0].strip()
        self.port = int(self.url.rsplit(":", 1)[1])

    async def kill(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGKILL)
        await self.proc.wait()
        if self.proc.stderr is not None:
            await self.proc.stderr.aclose()

    async def stop(self) -> None:
        if self.proc is not None and self.proc.returncode is None:
            self.proc.kill()
            await self.proc.wait()
        if self.proc is not None and self.proc.stderr is not None:
            await self.proc.stderr.aclose()


@asynccontextmanager
async def system(place: StorePlace, tmp: Path) -> AsyncIterator[tuple[Controller, trio.Process]]:
    ctl = Controller(place, tmp)
    worker: trio.Process | None = None
    try:
        await ctl.start()
        verify = tmp / "verify.d"
        verify.mkdir()
        script = verify / "10-gpu1-fails"
        # gpu1 fails its verify pass once the test says so: a quarantine held by the worker.
        script.write_text(
            f'#!/bin/sh\nif [ "$RC_DEVICE" = gpu1 ] && [ -e {tmp}/break-gpu1 ]; then\n'
            '  echo "ecc errors"; exit 1\nfi\nexit 0\n'
        )
        script.chmod(0o755)
        config = tmp / "worker.yaml"
        config.write_text(
            f"controller_url: {ctl.url}\n"
            f"host: {HOST}\n"
            "devices: [gpu0, gpu1, gpu2]\n"
            f"state_dir: {tmp / 'worker-state'}\n"
            f"probe_dir: {tmp / 'probe.d'}\n"
            f"verify_dir: {verify}\n"
            f"sheet_dir: {tmp / 'sheets'}\n"
            "heartbeat_interval: 2s\n"
            "poll_wait: 2s\n"
        )
        env = {**os.environ, "RC_TOKEN": WORKER_TOKEN}
        worker = await trio.lowlevel.open_process(
            [str(BIN / "rc-worker"), "run", "--config", str(config)],
            env=env,
            stderr=subprocess.DEVNULL,
        )
        yield ctl, worker
    finally:
        with trio.CancelScope(shield=True):
            await stop_worker(worker)
            await ctl.stop()


async def stop_worker(worker: trio.Process | None) -> None:
    """SIGQUIT (stop now), then SIGKILL if it is still there after 15 s."""
    if worker is not None and worker.returncode is None:
        worker.send_signal(signal.SIGQUIT)
        with trio.move_on_after(15):
            await worker.wait()
        if worker.returncode is None:
            worker.kill()
            await worker.wait()


async def rc(ctl: Controller, *argv: str) -> subprocess.CompletedProcess[bytes]:
    env = {**os.environ, "RC_URL": ctl.url, "RC_USER_TOKEN": USER_TOKEN}
    return await trio.run_process(
        [str(BIN / "rc"), *argv], env=env, capture_stdout=True, capture_stderr=True, check=False
    )


async def submit(ctl: Controller, *argv: str) -> str:
    done = await rc(ctl, "submit", *argv)
    assert done.returncode == 0, done.stderr
    return done.stdout.decode().strip()


async def get(ctl: Controller, path: str) -> Any:
    """GET through the current controller; retried while it is restarting."""
    async with httpx.AsyncClient(
        base_url=ctl.url, headers={"Authorization": f"Bearer {USER_TOKEN}"}
    ) as c:
        r = await c.get(path)
        r.raise_for_status()
        return r.json()


async def until(ctl: Controller, path: str, check: Callable[[Any], bool]) -> Any:
    """Re-read ``path`` until ``check`` holds (bounded by the test's fail_after)."""
    while True:
        try:
            body = await get(ctl, path)
        except httpx.HTTPError:
            body = None
        if body is not None and check(body):
            return body
        await trio.sleep(0.1)


def state_of(*states: str) -> Callable[[Any], bool]:
    return lambda j: j["state"] in states


def device(body: Any, name: str) -> dict[str, Any]:
    found: dict[str, Any] = next(d for d in body["devices"] if d["address"] == f"{HOST}/{name}")
    return found


async def prepare(ctl: Controller, tmp: Path) -> dict[str, str]:
    """Finished jobs, a quarantined gpu1, gpu2 on hold, a job running on gpu0 and one queued."""
    await until(ctl, "/v1/devices", lambda b: len(b["devices"]) == 3)
    done = await submit(ctl, "--device", f"{HOST}/gpu0", "--", "sh", "-c", "echo finished")
    await until(ctl, f"/v1/jobs/{done}", state_of("succeeded"))
    (tmp / "break-gpu1").touch()
    dirty = await submit(ctl, "--device", f"{HOST}/gpu1", "--", "true")
    await until(ctl, "/v1/devices", lambda b: device(b, "gpu1")["state"] == "quarantined")
    assert (await rc(ctl, "idle", f"{HOST}/gpu2", "hold")).returncode == 0
    go = tmp / "go"
    script = f"echo begin; while [ ! -e {go} ]; do sleep 0.05; done; echo end"
    running = await submit(ctl, "--device", f"{HOST}/gpu0", "--", "sh", "-c", script)
    await until(ctl, f"/v1/jobs/{running}", lambda j: j["committed_bytes"] == len("begin\n"))
    queued = await submit(ctl, "--device", f"{HOST}/gpu0", "--", "echo", "queued")
    pinned = await submit(ctl, "--device", f"{HOST}/gpu1", "--", "echo", "pinned")
    return {"done": done, "dirty": dirty, "running": running, "queued": queued, "pinned": pinned}


async def test_sigkill_and_restart_loses_nothing(store_place: StorePlace, tmp_path: Path) -> None:
    with trio.fail_after(GUARD):
        async with system(store_place, tmp_path) as (ctl, _):
            jobs = await prepare(ctl, tmp_path)
            events = await get(ctl, "/v1/events")
            await ctl.kill()
            await ctl.start()

            assert (await get(ctl, f"/v1/jobs/{jobs['done']}"))["state"] == "succeeded"
            logs = await rc(ctl, "logs", jobs["done"])
            assert logs.stdout == b"finished\n"
            devices = await get(ctl, "/v1/devices")
            assert device(devices, "gpu1")["state"] == "quarantined"
            assert device(devices, "gpu2")["idle_behavior"] == "hold"
            after = await get(ctl, "/v1/events")
            assert after["events"][: len(events["events"])] == events["events"]

            (tmp_path / "go").touch()
            job = await until(
                ctl, f"/v1/jobs/{jobs['running']}", state_of("succeeded", "lost", "failed")
            )
            assert job["state"] == "succeeded"
            assert (await rc(ctl, "logs", jobs["running"])).stdout == b"begin\nend\n"
            await until(ctl, f"/v1/jobs/{jobs['queued']}", state_of("succeeded"))
            # The job pinned to the quarantined device waits until an operator clears it.
            assert (await get(ctl, f"/v1/jobs/{jobs['pinned']}"))["state"] == "queued"
            (tmp_path / "break-gpu1").unlink()
            assert (await rc(ctl, "clear", f"{HOST}/gpu1")).returncode == 0
            await until(ctl, f"/v1/jobs/{jobs['pinned']}", state_of("succeeded"))
            finished = [
                e
                for e in (await get(ctl, "/v1/events?limit=1000"))["events"]
                if e["type"] == "job_finished" and e["job_id"] == jobs["running"]
            ]
            assert len(finished) == 1
            seqs = [e["seq"] for e in (await get(ctl, "/v1/events?limit=1000"))["events"]]
            assert seqs == sorted(set(seqs))


async def test_a_lost_store_is_rebuilt_from_what_the_worker_holds(
    store_place: StorePlace, tmp_path: Path
) -> None:
    with trio.fail_after(GUARD):
        async with system(store_place, tmp_path) as (ctl, _):
            jobs = await prepare(ctl, tmp_path)
            await ctl.kill()
            if store_place.state_dir is not None:
                shutil.rmtree(store_place.state_dir)
            else:
                assert store_place.server is not None
                assert store_place.db is not None
                store_place.server.drop_database(store_place.db)
                store_place.db = store_place.server.new_database()
            await ctl.start()

            # The worker's registration brings back the quarantine and the running job.
            devices = await until(
                ctl,
                "/v1/devices",
                lambda b: len(b["devices"]) == 3 and device(b, "gpu0")["host_state"] == "up",
            )
            assert device(devices, "gpu1")["state"] == "quarantined"
            job = await get(ctl, f"/v1/jobs/{jobs['running']}")
            assert (job["state"], job["adopted"]) == ("running", True)
            (tmp_path / "go").touch()
            await until(ctl, f"/v1/jobs/{jobs['running']}", state_of("succeeded"))
            assert (await rc(ctl, "logs", jobs["running"])).stdout == b"begin\nend\n"
            # A new job pinned to the quarantined device waits for `rc clear`.
            pinned = await submit(ctl, "--device", f"{HOST}/gpu1", "--", "echo", "pinned")
            blocker = await submit(ctl, "--device", f"{HOST}/gpu0", "--", "echo", "after")
            await until(ctl, f"/v1/jobs/{blocker}", state_of("succeeded"))
            assert (await get(ctl, f"/v1/jobs/{pinned}"))["state"] == "queued"
            (tmp_path / "break-gpu1").unlink()
            assert (await rc(ctl, "clear", f"{HOST}/gpu1")).returncode == 0
            await until(ctl, f"/v1/jobs/{pinned}", state_of("succeeded"))
