"""One worker per state directory (operations issue): ``state_dir/lock``."""

from __future__ import annotations

import fcntl
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import trio
from test_signals import RC_WORKER, TOKEN, _wait, worker_process

from rc_worker.core.errors import ConfigError
from rc_worker.statelock import StateDirLock, StateDirLocked
from rc_worker.testing import local_system, make_config


def test_a_second_lock_is_refused_naming_the_holder(tmp_path: Path) -> None:
    with StateDirLock.acquire(tmp_path, pid=4242) as first:
        assert first.held
        with pytest.raises(StateDirLocked) as caught:
            StateDirLock.acquire(tmp_path)
        assert caught.value.holder == 4242
        message = str(caught.value)
        assert str(tmp_path) in message
        assert "pid 4242" in message
        assert "\n" not in message
        assert isinstance(caught.value, ConfigError)
    # Released: the next one takes it and records its own pid.
    with StateDirLock.acquire(tmp_path):
        assert (tmp_path / "lock").read_text() == f"{os.getpid()}\n"


def test_the_lock_descriptor_is_not_inherited_by_children(tmp_path: Path) -> None:
    # A job that outlives a crashed worker must not keep the lock.
    lock = StateDirLock.acquire(tmp_path)
    try:
        assert lock._fd is not None
        assert fcntl.fcntl(lock._fd, fcntl.F_GETFD) & fcntl.FD_CLOEXEC
    finally:
        lock.release()
    assert not lock.held


def test_the_lock_dies_with_its_process(tmp_path: Path) -> None:
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, time; from pathlib import Path;"
            "from rc_worker.statelock import StateDirLock;"
            f"StateDirLock.acquire(Path({str(tmp_path)!r})); print('held', flush=True);"
            "time.sleep(60)",
        ],
        stdout=subprocess.PIPE,
    )
    try:
        assert holder.stdout is not None
        assert holder.stdout.readline() == b"held\n"
        with pytest.raises(StateDirLocked) as caught:
            StateDirLock.acquire(tmp_path)
        assert caught.value.holder == holder.pid
    finally:
        holder.kill()
        holder.wait()
        if holder.stdout is not None:
            holder.stdout.close()
    with StateDirLock.acquire(tmp_path):
        pass


async def test_an_embedded_worker_on_a_locked_state_dir_fails_to_start(tmp_path: Path) -> None:
    config = make_config(tmp_path)
    with trio.fail_after(30):
        async with local_system(config) as system:
            job = system.submit(["true"])
            await system.wait_job(job)
            with pytest.RaisesGroup(StateDirLocked, flatten_subgroups=True):
                async with local_system(config):
                    pass
            assert system.job(job).state == "succeeded"


async def test_a_second_rc_worker_run_on_the_same_state_dir_exits_2_touching_nothing(
    tmp_path: Path,
) -> None:
    with trio.fail_after(60):
        async with worker_process(tmp_path) as w:
            go = tmp_path / "go"
            # The job waits on a file, never on time: it runs for as long as the test needs.
            script = f"echo a; while [ ! -e {go} ]; do sleep 0.05; done; echo b"
            job_id = w.store.submit(["sh", "-c", script])
            await _wait(w.store, lambda: w.store.output(job_id) == b"a\n")
            jobs_before = sorted(p.name for p in (tmp_path / "state" / "jobs").iterdir())
            second = await trio.run_process(
                [RC_WORKER, "run", "--config", str(tmp_path / "worker.yaml")],
                env={**os.environ, "RC_TOKEN": TOKEN},
                capture_stdout=True,
                capture_stderr=True,
                check=False,
            )
            assert second.returncode == 2
            err = second.stderr.decode().strip()
            assert len(err.splitlines()) == 1, err
            assert str(tmp_path / "state") in err
            assert f"pid {w.proc.pid}" in err
            assert "Traceback" not in err
            # The first worker's job was not touched: it runs to success.
            assert sorted(p.name for p in (tmp_path / "state" / "jobs").iterdir()) == jobs_before
            go.touch()
            await _wait(w.store, lambda: w.store.job(job_id).terminal)
            assert w.store.job(job_id).state == "succeeded"
            assert w.store.output(job_id) == b"a\nb\n"
            w.proc.send_signal(signal.SIGTERM)
            assert await w.proc.wait() == 0
