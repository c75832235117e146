"""The on-disk spool: output appended as it arrives, capped with a visible marker."""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path
from typing import Any

import pytest

from rc_worker.spool import (
    TRUNCATION_MARKER,
    JobDir,
    OutputSpool,
    ensure_state_dir,
    job_dirs,
    read_json,
    write_json_durably,
)


def test_state_dir_is_created_private(tmp_path: Path) -> None:
    root = ensure_state_dir(str(tmp_path / "state"))
    assert stat.S_IMODE(os.stat(root).st_mode) == 0o700
    os.chmod(root, 0o755)
    ensure_state_dir(str(root))
    assert stat.S_IMODE(os.stat(root).st_mode) == 0o700


async def test_output_is_appended_to_disk_in_order(tmp_path: Path) -> None:
    root = ensure_state_dir(str(tmp_path))
    jd = JobDir(root, "j-1.1")
    jd.create()
    spool = OutputSpool(jd, cap=1 << 20)
    for i in range(100):
        await spool(f"line {i}\n".encode())
    spool.close()
    expected = "".join(f"line {i}\n" for i in range(100)).encode()
    assert jd.output.read_bytes() == expected
    assert spool.size == len(expected)
    assert jd.read_output(5, 4) == expected[5:9]


async def test_output_past_the_cap_is_dropped_behind_a_marker(tmp_path: Path) -> None:
    root = ensure_state_dir(str(tmp_path))
    jd = JobDir(root, "j-1.1")
    jd.create()
    spool = OutputSpool(jd, cap=10)
    await spool(b"0123456")
    await spool(b"789abcdef")
    await spool(b"more")
    spool.close()
    marker = TRUNCATION_MARKER.format(cap=10).encode()
    assert jd.output.read_bytes() == b"0123456789" + marker
    assert spool.truncated == len(b"abcdef") + len(b"more")


def test_durable_json_round_trips_and_leaves_no_temp_file(tmp_path: Path) -> None:
    path = tmp_path / "finish.json"
    write_json_durably(path, {"outcome": "succeeded", "exit_code": 0})
    assert read_json(path) == {"outcome": "succeeded", "exit_code": 0}
    assert [p.name for p in tmp_path.iterdir()] == ["finish.json"]


def test_unreadable_json_is_none_not_a_crash(tmp_path: Path) -> None:
    path = tmp_path / "journal.json"
    path.write_text("{not json")
    assert read_json(path) is None
    assert read_json(tmp_path / "absent.json") is None


def test_job_dirs_lists_attempt_directories_in_order(tmp_path: Path) -> None:
    root = ensure_state_dir(str(tmp_path))
    for key in ("j-2.1", "j-1.1"):
        JobDir(root, key).create()
    assert [d.key for d in job_dirs(root)] == ["j-1.1", "j-2.1"]
    JobDir(root, "j-1.1").remove()
    assert [d.key for d in job_dirs(root)] == ["j-2.1"]


class _FillingDisk:
    """The spool's file on a disk with ``room`` bytes left: a write takes what fits and
    the next is refused (ENOSPC), as a full disk does; then ``later`` bytes come free (a
    log rotated elsewhere), so part of the next write, the marker's, lands."""

    def __init__(self, real: Any, room: int, later: int) -> None:
        self.real, self.room, self.later = real, room, later

    def write(self, data: memoryview) -> int:
        if self.room == 0:
            self.room, self.later = self.later, 0
            raise OSError(errno.ENOSPC, "No space left on device")
        n = self.real.write(data[: self.room])
        self.room -= n
        return int(n)

    def close(self) -> None:
        self.real.close()


@pytest.mark.parametrize(("room", "later"), [(0, 0), (5, 0), (100, 0), (50, 7), (0, 20)])
async def test_what_the_full_disk_did_not_take_is_read_back_from_memory(
    tmp_path: Path, room: int, later: int
) -> None:
    """Whatever part of the output, then of the disk error's marker, the disk took, the
    spool reads back exactly what it says it holds: the file, then the rest from memory."""
    jd = JobDir(ensure_state_dir(tmp_path), "j-1.1")
    jd.create()
    spool = OutputSpool(jd, cap=1 << 20)
    spool._file = _FillingDisk(spool._file, room, later)  # type: ignore[assignment]
    await spool(b"x" * 100)
    await spool(b"never written")
    spool.close()
    data = spool.read(0, 1 << 20)
    assert len(data) == spool.size
    assert data.startswith(b"x" * room)
    assert b"ENOSPC" in data
    on_disk = jd.output.read_bytes()
    assert len(on_disk) == room + later
    assert data.startswith(on_disk)
