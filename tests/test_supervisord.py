"""``examples/supervisord.conf`` under a real supervisord: stop, start, restart, a job running.

The example's ``[program:rc-worker]`` section is used as shipped, with only its
paths pointed at this checkout and a temporary directory; supervisord's own
sections (socket, pid file, log) are added around it. The worker talks HTTP to
the reference controller served in the test.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path

import pytest
import trio
from workerproc import RC_WORKER, TOKEN, serve_controller, wait_store, write_config

from rc_worker.controller.store import Store, StoreConfig

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "supervisord.conf"
BIN = Path(sys.executable).parent


def _supervisord() -> tuple[str, str]:
    here = BIN / "supervisord", BIN / "supervisorctl"
    if all(p.exists() for p in here):
        return str(here[0]), str(here[1])
    found = shutil.which("supervisord"), shutil.which("supervisorctl")
    if found[0] is None or found[1] is None:
        pytest.skip("supervisor is not installed (pip install -e '.[test]' installs it)")
    return found[0], found[1]


def _program_section(worker_config: Path, log: Path) -> str:
    """The example's program section, its paths pointed here."""
    text = EXAMPLE.read_text()
    section = text[text.index("[program:rc-worker]") :]
    section = section.replace("/opt/rc-worker/bin/rc-worker", RC_WORKER)
    section = section.replace("/etc/rc/worker.yaml", str(worker_config))
    section = section.replace("/var/log/rc-worker.log", str(log))
    if os.geteuid() != 0:
        section = section.replace("user=root\n", "")
    return section


class Supervisor:
    def __init__(self, ctl: str, conf: Path) -> None:
        self.ctl = ctl
        self.conf = conf

    async def ctl_run(self, *args: str) -> str:
        done = await trio.run_process(
            [self.ctl, "-c", str(self.conf), *args],
            capture_stdout=True,
            capture_stderr=True,
            check=False,
        )
        return (done.stdout + done.stderr).decode()

    async def pid(self) -> int:
        text = (await self.ctl_run("pid", "rc-worker")).strip()
        return int(text) if text.isdigit() else 0

    async def wait_state(self, done: Callable[[str], bool]) -> str:
        """Ask until the program's state satisfies ``done`` (the caller bounds it)."""
        while True:
            state = await self.state()
            if done(state):
                return state
            await trio.sleep(0.1)

    async def state(self) -> str:
        words = (await self.ctl_run("status", "rc-worker")).split()
        return words[1] if len(words) > 1 and words[0] == "rc-worker" else ""


@asynccontextmanager
async def supervisord(worker_config: Path) -> AsyncIterator[Supervisor]:
    daemon, ctl = _supervisord()
    # A short directory: the control socket's path must fit in sun_path.
    home = Path(tempfile.mkdtemp(prefix="rcsv-", dir="/tmp"))
    try:
        conf = home / "supervisord.conf"
        conf.write_text(
            "[unix_http_server]\n"
            f"file={home}/sv.sock\n"
            "[supervisord]\n"
            f"logfile={home}/supervisord.log\n"
            f"pidfile={home}/supervisord.pid\n"
            f"childlogdir={home}\n"
            "[rpcinterface:supervisor]\n"
            "supervisor.rpcinterface_factory = supervisor.rpcinterface:make_main_rpcinterface\n"
            "[supervisorctl]\n"
            f"serverurl=unix://{home}/sv.sock\n\n" + _program_section(worker_config, home / "w.log")
        )
        proc = await trio.lowlevel.open_process(
            [daemon, "-n", "-c", str(conf)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )
        sv = Supervisor(ctl, conf)
        try:
            await sv.wait_state(lambda s: s not in ("", "STARTING"))
            yield sv
        finally:
            with trio.CancelScope(shield=True):
                # Stop the worker the quick way (SIGQUIT: its jobs too), then supervisord.
                with trio.move_on_after(20):
                    pid = await sv.pid()
                    if pid:
                        os.kill(pid, signal.SIGQUIT)
                        await sv.wait_state(lambda s: s != "RUNNING")
                if proc.returncode is None:
                    proc.terminate()
                    with trio.move_on_after(20):
                        await proc.wait()
                if proc.returncode is None:
                    proc.kill()
                    await proc.wait()
    finally:
        # Also when the config cannot be written or supervisord not started.
        shutil.rmtree(home, ignore_errors=True)


async def test_the_example_supervisord_program_stops_and_restarts_with_a_job_running(
    tmp_path: Path,
) -> None:
    store = Store(StoreConfig(heartbeat_interval_s=0.5, poll_wait_s=2.0))
    with trio.fail_after(100):
        async with trio.open_nursery() as nursery:
            url = await serve_controller(nursery, store, {TOKEN: "op-host"})
            config = write_config(tmp_path, url, extra=f"token: {TOKEN}\n")
            async with supervisord(config) as sv:
                await wait_store(store, lambda: any(d.host == "op-host" for d in store.devices()))
                first_pid = await sv.pid()
                # Stop with a job running: supervisorctl waits while the worker drains it.
                job1 = store.submit(["sh", "-c", "echo a; sleep 1; echo b"])
                await wait_store(store, lambda: store.output(job1) == b"a\n")
                answer = await sv.ctl_run("stop", "rc-worker")
                assert "stopped" in answer, answer
                assert store.job(job1).state == "succeeded"
                assert store.output(job1) == b"a\nb\n"
                assert await sv.state() == "STOPPED"  # exit 0: not restarted
                # Start it again; restart with a job running drains it the same way.
                assert "started" in await sv.ctl_run("start", "rc-worker")
                second_pid = await sv.pid()
                assert second_pid not in (0, first_pid)
                job2 = store.submit(["sh", "-c", "echo c; sleep 1; echo d"])
                await wait_store(store, lambda: store.output(job2) == b"c\n")
                answer = await sv.ctl_run("restart", "rc-worker")
                assert "started" in answer, answer
                assert store.job(job2).state == "succeeded"
                assert await sv.pid() not in (0, second_pid)
                assert await sv.state() == "RUNNING"
                # And the restarted worker takes work.
                job3 = store.submit(["echo", "e"])
                await wait_store(store, lambda: store.job(job3).state == "succeeded")
            nursery.cancel_scope.cancel()


async def test_the_example_supervisord_program_is_not_restarted_after_exit_2(
    tmp_path: Path,
) -> None:
    store = Store(StoreConfig(heartbeat_interval_s=0.5, poll_wait_s=2.0))
    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            # The controller knows no such token: 401 at register, exit 2.
            url = await serve_controller(nursery, store, {"another-token": "op-host"})
            config = write_config(tmp_path, url, extra=f"token: {TOKEN}\n")
            async with supervisord(config) as sv:
                state = await sv.wait_state(lambda s: s not in ("RUNNING", "STARTING"))
                assert state == "EXITED"
                # It stays exited: supervisord does not start it again.
                await trio.sleep(1.5)
                assert await sv.state() == "EXITED"
                log = (sv.conf.parent / "w.log").read_text()
                assert "401 unauthorized" in log
                assert "Traceback" not in log
            nursery.cancel_scope.cancel()
