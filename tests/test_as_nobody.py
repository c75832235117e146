"""A worker that is not root, for real: the sweep and recovery run in a child
that dropped to ``nobody`` (uid 65534), against processes and cgroups root made.

The test process must be root to arrange it (CI's case); the child is forked
from it, so nothing has to be importable by ``nobody``. Sync tests: each
child runs its own ``trio.run``.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import tempfile
import time
import traceback
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import trio

from rc_worker.cgroup import CgroupUnavailable, set_up
from rc_worker.cgroup import remove as remove_cgroup
from rc_worker.core.model import Claim
from rc_worker.host import LinuxHost
from rc_worker.recovery import recover
from rc_worker.spool import JobDir, write_json_durably
from rc_worker.sweep import sweep_job_survivors, unproven

NOBODY = 65534
GUARD = 60

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root to drop to nobody")


def as_nobody(fn: Callable[[], Any]) -> Any:
    """Run ``fn`` in a forked child as uid/gid 65534; its JSON-able result."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        code = 1
        try:
            os.close(read)
            os.setgroups([])
            os.setgid(NOBODY)
            os.setuid(NOBODY)
            with os.fdopen(write, "w") as out:
                json.dump(fn(), out)
            code = 0
        except BaseException:
            traceback.print_exc()  # shown with the failure
        finally:
            os._exit(code)
    os.close(write)
    with os.fdopen(read) as f:
        text = f.read()
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0, "the child as nobody failed"
    return json.loads(text)


@contextlib.contextmanager
def root_process(job_id: str) -> Iterator[subprocess.Popen[bytes]]:
    proc = subprocess.Popen(
        ["sleep", "300"], env={"PATH": os.defpath, "RC_JOB_ID": job_id}, start_new_session=True
    )
    try:
        yield proc
    finally:
        proc.kill()
        proc.wait()


def test_a_sweep_as_nobody_is_blind_to_roots_newer_process_and_names_it() -> None:
    job_id = f"j-{uuid.uuid4().hex[:8]}"
    host = LinuxHost()
    with root_process(job_id) as older:
        time.sleep(0.05)  # two clock ticks: the job starts strictly later
        since = host.boot_ticks()
        with root_process(job_id) as newer:

            def sweep() -> dict[str, Any]:
                report = trio.run(
                    lambda: sweep_job_survivors(job_id, grace=0.1, host=LinuxHost(), since=since)
                )
                return {"blind_pids": report.blind_pids, "doubt": unproven(report)}

            seen = as_nobody(sweep)
            assert newer.poll() is None  # it could not even see it
    assert newer.pid in seen["blind_pids"]
    # Older than the job: not inspected, so not a reason for blindness.
    assert older.pid not in seen["blind_pids"]
    assert str(newer.pid) in seen["doubt"]


@pytest.fixture
def state_dir() -> Iterator[Path]:
    """A state directory nobody can reach (pytest's tmp_path is under a root-only one)."""
    with tempfile.TemporaryDirectory(prefix="rc-nobody-") as name:
        os.chown(name, NOBODY, NOBODY)
        yield Path(name)


def test_recovery_as_nobody_proves_gone_from_an_empty_cgroup(state_dir: Path) -> None:
    tmp_path = state_dir
    host = LinuxHost()
    try:
        containment, _ = set_up(host, tag=f"test-{uuid.uuid4().hex[:8]}")
    except CgroupUnavailable as e:
        pytest.skip(f"no cgroup v2 hierarchy this test may use: {e}")
    try:
        path = containment.leaf("j-1.1")
        host.cgroup_mkdir(path)
        # The job ran in it and ended while the worker was down.
        done = subprocess.run(
            ["sh", "-c", f"echo $$ > {host._path(path, 'cgroup.procs')}; exit 0"], check=False
        )
        assert done.returncode == 0
        job_id = f"j-{uuid.uuid4().hex}"  # an id nothing else carries
        job_dir = JobDir(tmp_path, f"{job_id}.1")
        job_dir.create()
        write_json_durably(
            job_dir.journal,
            {
                "job_id": job_id,
                "attempt": 1,
                "device": "gpu0",
                "boot_id": host.boot_id(),
                "spawned": True,
                "cgroup": path,
            },
        )
        for p in tmp_path.rglob("*"):
            os.chown(p, NOBODY, NOBODY)

        def recovered() -> dict[str, Any]:
            [entry] = trio.run(
                lambda: recover(
                    tmp_path, boot_id=LinuxHost().boot_id(), require_manual_clear=False,
                    host=LinuxHost(),
                )
            )  # fmt: skip
            return {"claim": str(entry.claim), "method": entry.sweep.method}

        seen = as_nobody(recovered)
        assert seen == {"claim": str(Claim.GONE), "method": "cgroup"}
    finally:
        remove_cgroup(host, containment.tree)
