"""The worker's on-disk state: one directory per job attempt, and pending faults.

::

    state_dir/                       mode 0700
      jobs/<job_id>.<attempt>/
        journal.json                 written and fsynced before the job is spawned
        output                       the job's combined output, appended as it arrives
        finish.json                  the finish report, written before its first send
      faults/<device>.<fault_id>.json

A job's directory is removed once its ``finish`` is acknowledged, so after a
crash whatever is left under ``jobs/`` is exactly the work not yet reported.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import shutil
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import trio

from rc_worker import boundedjson
from rc_worker.changed import Changed

log = logging.getLogger("rc_worker.spool")

TRUNCATION_MARKER = "\n[rc-worker: output truncated here: the job wrote more than {cap} bytes]\n"
DISK_ERROR_MARKER = (
    "\n[rc-worker: output truncated here: the worker could not write it to its disk ({why})]\n"
)
DAMAGED_DIR = "damaged"


def move_aside(root: Path, path: Path, why: str) -> Path | None:
    """Move a damaged file or directory of the state dir to ``state_dir/damaged/`` for an
    operator to look at; never deleted. Returns where it went (None if it could not move)."""
    damaged = root / DAMAGED_DIR
    try:
        damaged.mkdir(mode=0o700, exist_ok=True)
        target = damaged / path.name
        n = 1
        while target.exists():
            n += 1
            target = damaged / f"{path.name}.{n}"
        os.replace(path, target)
    except OSError as e:
        log.error("damaged state %s (%s) could not be moved aside: %s", path, why, e)
        return None
    log.error("damaged state %s (%s): moved to %s for an operator", path, why, target)
    return target


def ensure_state_dir(path: str) -> Path:
    """Create the state directory (mode 0700) and its subdirectories."""
    root = Path(path)
    root.mkdir(mode=0o700, parents=True, exist_ok=True)
    # mkdir's mode is masked by the umask and ignored for an existing dir.
    os.chmod(root, 0o700)
    (root / "jobs").mkdir(mode=0o700, exist_ok=True)
    (root / "faults").mkdir(mode=0o700, exist_ok=True)
    return root


def write_json_durably(path: Path, data: Mapping[str, Any]) -> None:
    """Write ``data`` so that after a crash the file is either whole or absent."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(data, f, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(path.parent)


MAX_STATE_FILE_BYTES = 1 << 20
"""State files are a few hundred bytes; anything near this is damage, not data."""


def read_json(path: Path) -> dict[str, Any] | None:
    """The JSON object in ``path``; None when absent or unreadable (logged). Bounded in size
    and depth, so a damaged file can cost neither the worker's memory nor its stack."""
    try:
        with open(path, "rb") as f:
            raw = f.read(MAX_STATE_FILE_BYTES + 1)
        if len(raw) > MAX_STATE_FILE_BYTES:
            raise ValueError(f"larger than {MAX_STATE_FILE_BYTES} bytes")
        data = boundedjson.loads(raw)
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:
        log.error("cannot read %s (%s); leaving it for an operator", path, e)
        return None
    return data if isinstance(data, dict) else None


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class JobDir:
    """One job attempt's directory."""

    def __init__(self, root: Path, key: str) -> None:
        self.key = key
        self.path = root / "jobs" / key
        self.journal = self.path / "journal.json"
        self.output = self.path / "output"
        self.finish = self.path / "finish.json"

    def create(self) -> None:
        self.path.mkdir(mode=0o700, parents=True, exist_ok=True)
        self.output.touch(mode=0o600, exist_ok=True)

    def remove(self) -> None:
        shutil.rmtree(self.path, ignore_errors=True)

    def output_size(self) -> int:
        try:
            return self.output.stat().st_size
        except FileNotFoundError:
            return 0

    def read_output(self, offset: int, limit: int) -> bytes:
        try:
            with open(self.output, "rb") as f:
                f.seek(offset)
                return f.read(limit)
        except FileNotFoundError:
            return b""


def job_dirs(root: Path) -> Iterator[JobDir]:
    jobs = root / "jobs"
    if not jobs.is_dir():
        return
    for entry in sorted(jobs.iterdir()):
        if entry.is_dir():
            yield JobDir(root, entry.name)


class OutputSpool:
    """The sink a running job writes to: appends to the job's ``output`` file.

    Writes are plain ``os.write`` calls: a local append lands in the page
    cache in microseconds, and a thread hop per 64 KiB chunk would cost more
    than it saves. Nothing is kept in memory; the shipper reads the file.
    """

    def __init__(self, job_dir: JobDir, *, cap: int) -> None:
        self._dir = job_dir
        self._fd = os.open(job_dir.output, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        self.size = os.fstat(self._fd).st_size
        self._cap = cap
        self.truncated = 0
        # Whether the marker is written: decided by what was cut, not by the
        # size, so a job that writes exactly ``cap`` bytes and then more still
        # gets its marker, and the marker itself never counts against the cap.
        self._marked = False
        self.closed = False
        self._changed = Changed()
        # Set when the disk refused a write (ENOSPC, EIO, EDQUOT...): the job keeps running,
        # its further output is dropped, and a marker (held here if the disk refuses that
        # too) ends what the controller gets.
        self.disk_error: str | None = None
        self._tail = b""
        self._on_disk = self.size

    async def __call__(self, data: bytes) -> None:
        if self.closed or not data:
            return
        if self._marked:
            self.truncated += len(data)
            await trio.lowlevel.checkpoint()
            return
        room = self._cap - self.size
        if len(data) > room:
            room = max(room, 0)
            self.truncated += len(data) - room
            data = data[:room] + TRUNCATION_MARKER.format(cap=self._cap).encode()
            self._marked = True
        self._write_all(data)
        self._notify()
        await trio.lowlevel.checkpoint()

    def _write_all(self, data: bytes) -> None:
        view = memoryview(data)
        try:
            while view:
                n = os.write(self._fd, view)
                view = view[n:]
                self._on_disk += n
        except OSError as e:
            self._disk_failed(e, len(view))
            return
        self.size += len(data)

    def _disk_failed(self, error: OSError, lost: int) -> None:
        """Stop spooling this job (only this job) after the disk refused a write."""
        why = errno.errorcode.get(error.errno or 0, "error") + f": {error.strerror or error}"
        self.disk_error = why
        self.truncated += lost
        self._marked = True
        marker = DISK_ERROR_MARKER.format(why=why).encode()
        # What did reach the file stays; the marker follows it, from memory if need be.
        self.size = self._on_disk
        try:
            os.write(self._fd, marker)
            self._on_disk += len(marker)
        except OSError:
            self._tail = marker
        self.size += len(marker)
        log.error(
            "job %s: spooling stopped, the disk refused its output (%s); the job runs on, "
            "its further output is dropped",
            self._dir.key,
            why,
        )

    def read(self, offset: int, limit: int) -> bytes:
        """Spooled output from ``offset``: the file, then a marker the disk would not take."""
        data = self._dir.read_output(offset, min(limit, max(self._on_disk - offset, 0)))
        if len(data) < limit and self._tail and offset + len(data) >= self._on_disk:
            start = offset + len(data) - self._on_disk
            data += self._tail[start : start + limit - len(data)]
        return data

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            os.close(self._fd)
            if self.truncated:
                log.warning(
                    "job %s: %d bytes of output dropped past the spool cap of %d bytes",
                    self._dir.key,
                    self.truncated,
                    self._cap,
                )
            self._notify()

    def _notify(self) -> None:
        self._changed.notify()

    async def wait_changed(self) -> None:
        await self._changed.wait()
