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

import contextlib
import errno
import json
import logging
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import trio

from rc_worker.changed import Changed
from rc_worker.core import boundedjson
from rc_worker.statestore import LINUX_STORE, StateStore

log = logging.getLogger("rc_worker.spool")

TRUNCATION_MARKER = "\n[rc-worker: output truncated here: the job wrote more than {cap} bytes]\n"
DISK_ERROR_MARKER = (
    "\n[rc-worker: output truncated here: the worker could not write it to its disk ({why})]\n"
)
DAMAGED_DIR = "damaged"


def move_aside(root: Path, path: Path, why: str, store: StateStore = LINUX_STORE) -> Path | None:
    """Move a damaged file or directory of the state dir to ``state_dir/damaged/`` for an
    operator to look at; never deleted. Returns where it went (None if it could not move)."""
    damaged = root / DAMAGED_DIR
    try:
        store.mkdir(damaged)
        target = damaged / path.name
        n = 1
        while store.exists(target):
            n += 1
            target = damaged / f"{path.name}.{n}"
        store.replace(path, target)
    except OSError as e:
        log.error("damaged state %s (%s) could not be moved aside: %s", path, why, e)
        return None
    log.error("damaged state %s (%s): moved to %s for an operator", path, why, target)
    return target


def make_dirs_durably(path: Path, store: StateStore = LINUX_STORE) -> None:
    """``mkdir -p path``, with each directory it made fsynced into its parent.

    A directory is a name too: by strict POSIX it outlives a power loss only once its
    parent is fsynced, and a job's journal later counts on the state directory being
    there. Fsynced from ``path`` up to the first directory that was there already.
    """
    existing = path
    while not store.exists(existing) and existing.parent != existing:
        existing = existing.parent
    store.mkdir(path, parents=True)
    if existing != path:
        for parent in path.parents:
            store.fsync_dir(parent)
            if parent == existing:
                break


def ensure_state_dir(path: str, store: StateStore = LINUX_STORE) -> Path:
    """Create the state directory (mode 0700) and its subdirectories, durably (once a
    start, before any job: not on the hot path)."""
    root = Path(path)
    make_dirs_durably(root, store)
    # mkdir's mode is masked by the umask and ignored for an existing dir.
    store.chmod(root, 0o700)
    store.mkdir(root / "jobs")
    store.mkdir(root / "faults")
    store.fsync_dir(root)  # jobs/ and faults/, if just made
    return root


def write_json_durably(
    path: Path, data: Mapping[str, Any], store: StateStore = LINUX_STORE
) -> None:
    """Write ``data`` so that after a crash the file is either whole or absent."""
    tmp = path.with_name(path.name + ".tmp")
    store.write_synced(tmp, json.dumps(data, sort_keys=True).encode())
    store.replace(tmp, path)
    store.fsync_dir(path.parent)


MAX_STATE_FILE_BYTES = 1 << 20
"""State files are a few hundred bytes; anything near this is damage, not data."""


def read_json(path: Path, store: StateStore = LINUX_STORE) -> dict[str, Any] | None:
    """The JSON object in ``path``; None when absent or unreadable (logged). Bounded in size
    and depth, so a damaged file can cost neither the worker's memory nor its stack."""
    try:
        raw = store.read(path, 0, MAX_STATE_FILE_BYTES + 1)
        if len(raw) > MAX_STATE_FILE_BYTES:
            raise ValueError(f"larger than {MAX_STATE_FILE_BYTES} bytes")
        data = boundedjson.loads(raw)
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:
        log.error("cannot read %s (%s); leaving it for an operator", path, e)
        return None
    return data if isinstance(data, dict) else None


class JobDir:
    """One job attempt's directory, in ``store`` (the host's; the real disk by default)."""

    def __init__(self, root: Path, key: str, store: StateStore = LINUX_STORE) -> None:
        self.store = store
        self.key = key
        self.path = root / "jobs" / key
        self.journal = self.path / "journal.json"
        self.output = self.path / "output"
        self.finish = self.path / "finish.json"
        # The journal this process wrote here, kept so that a finish whose
        # directory vanished (an operator's rm, a lost mount) can be written
        # back with it: recovery at the next start reports the job from it.
        self.written_journal: dict[str, Any] | None = None

    def create(self) -> None:
        self.store.mkdir(self.path, parents=True)
        self.store.touch(self.output)

    def remove(self) -> None:
        self.store.rmtree(self.path)

    def exists(self) -> bool:
        return self.store.exists(self.path)

    def has_finish(self) -> bool:
        return self.store.exists(self.finish)

    def output_size(self) -> int:
        try:
            return self.store.size(self.output)
        except FileNotFoundError:
            return 0

    def read_output(self, offset: int, limit: int) -> bytes:
        try:
            return self.store.read(self.output, offset, limit)
        except FileNotFoundError:
            return b""


def job_dirs(root: Path, store: StateStore = LINUX_STORE) -> Iterator[JobDir]:
    jobs = root / "jobs"
    if not store.is_dir(jobs):
        return
    for name in store.listdir(jobs):
        if store.is_dir(jobs / name):
            yield JobDir(root, name, store)


class OutputSpool:
    """The sink a running job writes to: appends to the job's ``output`` file.

    Writes are plain ``os.write`` calls: a local append lands in the page
    cache in microseconds, and a thread hop per 64 KiB chunk would cost more
    than it saves. Nothing is kept in memory; the shipper reads the file.
    """

    def __init__(self, job_dir: JobDir, *, cap: int) -> None:
        self._dir = job_dir
        self._file = job_dir.store.open_append(job_dir.output)
        self.size = self._file.size()
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
                n = self._file.write(view)
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
        # What did reach the file stays; the marker follows it, from memory for what of
        # it the disk would not take (a full disk takes part of a write, then refuses).
        self.size = self._on_disk
        written = 0
        with contextlib.suppress(OSError):
            written = self._file.write(memoryview(marker)) or 0
        self._on_disk += written
        self._tail = marker[written:]
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
            self._file.close()
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
