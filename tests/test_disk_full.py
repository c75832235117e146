"""A full disk costs one job's output, never the worker (issue 12).

Runs on a small tmpfs the test mounts as ``state_dir``, so it needs root
(skipped otherwise). Real processes write real output until the disk is
full.
"""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
import trio

from rc_worker.spool import DISK_ERROR_MARKER
from rc_worker.testing import local_system, make_config

pytestmark = pytest.mark.skipif(
    not hasattr(os, "geteuid") or os.geteuid() != 0, reason="mounting a tmpfs needs root"
)


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    mount = tmp_path / "small"
    mount.mkdir()
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mount)],
        capture_output=True,
        check=False,
    )
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.decode().strip()}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


async def test_a_job_that_fills_the_disk_costs_only_its_output(
    tmp_path: Path, small_disk: Path
) -> None:
    config = make_config(small_disk, devices=("gpu0",))
    with trio.fail_after(60):
        async with local_system(config) as system:
            # 4 MB into a 1 MiB disk, then proof the job ran on to its end.
            flood = system.submit(
                ["sh", "-c", "head -c 4000000 /dev/zero | tr '\\0' x; echo; echo end >&2; exit 3"]
            )
            info = await system.wait_job(flood)
            assert info.state == "failed"  # its own exit status, not an error of the worker
            assert info.exit_code == 3
            output = system.output(flood)
            # The spool's own marker, built from its template, with the disk's error.
            marker = DISK_ERROR_MARKER.split("{why}")[0].encode()
            assert marker + b"ENOSPC" in output
            assert output.endswith(b"]\n")
            assert len(output) < 1_100_000
            # The worker carries on, on the same device, once that job's spool is gone.
            after = system.submit(["echo", "still here"])
            assert (await system.wait_job(after)).state == "succeeded"
            assert system.output(after) == b"still here\n"
            assert system.device("gpu0").state == "free"


def _fill(path: Path) -> None:
    """Fill the disk to the last byte."""
    with open(path, "wb", buffering=0) as f:
        try:
            while True:
                f.write(b"\0" * 4096)
        except OSError:
            pass


async def test_recovery_on_a_full_disk_starts_and_quarantines(
    tmp_path: Path, small_disk: Path
) -> None:
    state = small_disk / "state"
    job_dir = state / "jobs" / "j-7.1"
    job_dir.mkdir(parents=True)
    journal = {"job_id": "j-7", "attempt": 1, "device": "gpu0", "boot_id": "old", "spawned": True}
    (job_dir / "journal.json").write_text(json.dumps(journal))
    (job_dir / "output").write_bytes(b"before the crash\n")
    (state / "lock").write_text("1\n")  # from the run before the crash
    for sub in ("faults", "damaged"):
        (state / sub).mkdir()
    _fill(small_disk / "filler")
    config = make_config(small_disk, devices=("gpu0", "gpu1"))
    with trio.fail_after(60):
        async with local_system(config) as system:

            def kinds(name: str) -> list[str]:
                return [f.kind for f in system.device(name).faults]

            await system.wait_until(lambda: "damaged_state" in kinds("gpu0"))
            assert system.worker.registered.is_set()
            assert kinds("gpu1") == []
            ok = system.submit(["true"], device="test-host/gpu1")
            # gpu1 has no disk to spool to either, but the job is reported, never a crash:
            # it ran (its output needs no disk) or it ended an error naming the disk.
            info = await system.wait_job(ok)
            assert info.state in ("succeeded", "error"), info
            if info.state == "error":
                assert "state_dir" in (info.error or ""), info


async def test_a_job_the_disk_cannot_journal_is_an_error_not_a_quarantine(
    small_disk: Path,
) -> None:
    config = make_config(small_disk, devices=("gpu0",))
    with trio.fail_after(60):
        async with local_system(config) as system:
            await trio.to_thread.run_sync(_fill, small_disk / "filler")
            refused = system.submit(["echo", "never"])
            info = await system.wait_job(refused)
            assert info.state == "error"
            assert "state_dir refused it" in (info.error or "")
            assert system.output(refused) == b""
            # Nothing ran, so nothing is quarantined: the device takes work once there is room.
            assert system.device("gpu0").faults == ()
            await trio.Path(small_disk / "filler").unlink()
            ok = system.submit(["echo", "room again"])
            assert (await system.wait_job(ok)).state == "succeeded"
