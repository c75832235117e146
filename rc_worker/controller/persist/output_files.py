"""Job output in append-only files beside the SQLite database, one file a job.

Why not rows: SQLite stores a 1 MiB blob as 256 overflow pages of 4 KiB, each
written to the WAL with its checksum and again at the checkpoint. That was most of
the controller's CPU per GiB of output (``bench/bench_output_store.py``: 3.3 s per
GiB in rows, 1.0 s in a file with the same fsyncs). So the bytes go to
``output/<job>`` and the database keeps only each job's committed length
(``output_files``), in the same transaction as the records they belong with.

The rule that makes it crash-safe: **a byte counts once its length is committed**.
A commit writes the bytes at their offsets (``pwrite``: writing the same bytes at
the same offset again, as a retried batch does, changes nothing), fsyncs the files
(and the directory when a file is new), and only then commits the lengths. A crash
in between leaves bytes past a committed length, or a file with no length at all;
:func:`reconcile` (run at every open) cuts the first and removes the second. Bytes
are never read past the committed length.

Deleting (retention) is the other way round: the lengths are deleted in the
database first, the files after the commit; a crash in between leaves files with
no length, removed at the next open.

The decisions (where a job's committed length ends, what an open must repair) are
pure functions; :class:`OutputFiles` does the I/O. Everything here runs in the
backend's thread, never on the event loop.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import os
import re
from collections.abc import Iterable, Mapping
from pathlib import Path

import attrs

__all__ = ["OutputFiles", "Repair", "extend", "file_name", "reconcile"]

_SAFE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
# Never through a link: the directory is the controller's, and what it opens there is its own.
_FLAGS = os.O_CLOEXEC | os.O_NOFOLLOW


def file_name(job_id: str) -> str:
    """The file a job's output lives in: its id when that is a plain name, otherwise
    ``%`` and a hash of it (an adopted job's id comes from a worker, so it may hold
    ``/`` or ``..``; ``%`` never starts a plain name, so the two kinds never meet)."""
    if _SAFE.fullmatch(job_id):
        return job_id
    return "%" + hashlib.sha256(job_id.encode("utf-8", "surrogatepass")).hexdigest()


def extend(length: int, pieces: Iterable[tuple[int, int]]) -> int:
    """A job's committed length after storing ``pieces`` (``(offset, size)``), from
    ``length``: it grows over pieces that start at or below its end, in offset order.

    The store only ever hands out pieces that continue what is committed, so there is
    never a hole; if one came, the length would stop at it rather than count bytes
    that were never written (a read there would return zeros from a sparse file).
    """
    for off, size in sorted(pieces):
        if off > length:
            break
        length = max(length, off + size)
    return length


@attrs.frozen
class Repair:
    """What an open must do to make the files agree with the committed lengths."""

    remove: tuple[str, ...] = ()
    """Files with no committed length (written, then never committed, or deleted), and
    entries that are not plain files."""
    truncate: tuple[tuple[str, int], ...] = ()
    """``(file, length)``: bytes past the committed length were never acknowledged."""
    shortened: tuple[tuple[str, int, int], ...] = ()
    """``(job_id, committed, found)``: a file shorter than its committed length (a backup
    copied out of order, a file removed by hand). Its length becomes what is there."""


def reconcile(lengths: Mapping[str, int], sizes: Mapping[str, int]) -> Repair:
    """Compare the committed ``lengths`` (by job id) with the files found (``sizes``,
    by file name; a negative size is an entry that is not a plain file) and say what to
    repair."""
    named = {file_name(job_id): (job_id, n) for job_id, n in lengths.items()}
    remove = tuple(sorted(name for name in sizes if name not in named))
    truncate, shortened = [], []
    for name, (job_id, n) in sorted(named.items()):
        found = sizes.get(name, 0)
        if found < 0:  # not a plain file (a link): removed, and its bytes are gone
            remove += (name,)
            found = 0
        if found > n:
            truncate.append((name, n))
        elif found < n:
            shortened.append((job_id, n, found))
    return Repair(remove, tuple(truncate), tuple(shortened))


class OutputFiles:
    """The ``output/`` directory of a state directory."""

    def __init__(self, root: Path) -> None:
        self.root = root
        root.mkdir(mode=0o700, exist_ok=True)
        # Its name in the state directory, synced at every open rather than only by the
        # one that made it: that one may have died between the mkdir and the sync.
        _fsync_dir(root.parent)
        self._unsynced = True
        """A file was created here since the directory was last fsynced. Kept across a
        write that failed after creating one: its retry finds the file there, and must
        still make its name durable before a length that points at it is committed. True
        at first: a process killed mid-write left names nobody has synced."""

    def path(self, job_id: str) -> Path:
        return self.root / file_name(job_id)

    def write(
        self, pieces: Iterable[tuple[str, int, bytes]], committed: Mapping[str, int]
    ) -> dict[str, int]:
        """Write each ``(job_id, offset, data)`` at its offset and make it durable: the
        files fsynced, and the directory too if a file is new. Raises ``OSError``.

        ``committed`` is each job's committed length (missing: 0). Returns the jobs whose
        file was gone or shorter than that (removed or cut under a running controller),
        with the length each is recounted at: what the file held, grown over the pieces
        that continue it. A piece past the hole is not written (it would read back as
        zeros, served as output with no error); the caller commits the recounted length,
        and the worker, which keeps its spool until the job's finish is acknowledged,
        resends from there. What a restart's :func:`reconcile` would do, done for that
        job alone as its next output arrives, so that one lost file never stops the rest
        of the store.
        """
        by_job: dict[str, list[tuple[int, bytes]]] = {}
        for job_id, off, data in pieces:
            by_job.setdefault(job_id, []).append((off, data))
        recounted: dict[str, int] = {}
        for job_id, writes in by_job.items():
            path = self.path(job_id)
            held = committed.get(job_id, 0)
            try:
                fd = os.open(path, os.O_WRONLY | _FLAGS)
                created = False
            except FileNotFoundError:
                fd = os.open(path, os.O_WRONLY | os.O_CREAT | _FLAGS, 0o600)
                self._unsynced = True
                created = True
            try:
                found = 0 if created or not held else os.fstat(fd).st_size
                if found < held:
                    recounted[job_id] = _write_from(fd, found, writes)
                else:
                    for off, data in writes:
                        _pwrite_all(fd, data, off)
                os.fsync(fd)
            finally:
                os.close(fd)
        self.sync()
        return recounted

    def sync(self) -> None:
        """Make every name created here durable (an fsync of the directory), if any is new."""
        if self._unsynced:
            _fsync_dir(self.root)
            self._unsynced = False

    def read(self, job_id: str, offset: int, size: int) -> bytes:
        """``size`` bytes from ``offset`` (the caller bounds them by the committed length).
        A file that is not there reads as nothing."""
        if size <= 0:
            return b""
        try:
            fd = os.open(self.path(job_id), os.O_RDONLY | _FLAGS)
        except FileNotFoundError:
            return b""
        try:
            out = os.pread(fd, size, offset)
            if len(out) == size or not out:
                return out
            parts = [out]  # a short read (a signal, a huge size): read on to the end
            got = len(out)
            while got < size:
                more = os.pread(fd, size - got, offset + got)
                if not more:
                    break
                parts.append(more)
                got += len(more)
            return b"".join(parts)
        finally:
            os.close(fd)

    def size(self, job_id: str) -> int:
        """How many bytes the job's file holds now (0: no file)."""
        try:
            return self.path(job_id).stat().st_size
        except FileNotFoundError:
            return 0

    def remove(self, job_ids: Iterable[str]) -> None:
        """Remove jobs' files (after their lengths were deleted). Best effort: a file left
        behind is removed at the next open."""
        for job_id in job_ids:
            with contextlib.suppress(OSError):
                self.path(job_id).unlink()

    def sizes(self) -> dict[str, int]:
        """Every entry here, by name, with its size: a link (which is never written
        through) counts as a file of no bytes, so that it is replaced or removed.
        Raises ``IsADirectoryError`` for a directory: nothing here may be one, and the
        controller will not remove one on its own (what is in it is not its own)."""
        out: dict[str, int] = {}
        with os.scandir(self.root) as it:
            for entry in it:
                if entry.is_file(follow_symlinks=False):
                    out[entry.name] = entry.stat(follow_symlinks=False).st_size
                elif entry.is_dir(follow_symlinks=False):
                    raise IsADirectoryError(
                        errno.EISDIR,
                        "a directory where only job output files belong; move it out",
                        entry.path,
                    )
                else:
                    out[entry.name] = -1
        return out

    def repair(self, repair: Repair) -> None:
        """Carry out :func:`reconcile`'s answer (the database side is the caller's)."""
        for name in repair.remove:
            with contextlib.suppress(FileNotFoundError):
                (self.root / name).unlink()
        for name, length in repair.truncate:
            fd = os.open(self.root / name, os.O_WRONLY | _FLAGS)
            try:
                os.ftruncate(fd, length)
                os.fsync(fd)
            finally:
                os.close(fd)
        if repair.remove:
            self._unsynced = True
        self.sync()


def _write_from(fd: int, length: int, writes: list[tuple[int, bytes]]) -> int:
    """Write the pieces that continue a file of ``length`` bytes, in offset order, and
    return the length they make (:func:`extend`'s rule): none past a hole."""
    for off, data in sorted(writes, key=lambda w: w[0]):
        if off > length:
            break
        _pwrite_all(fd, data, off)
        length = max(length, off + len(data))
    return length


def _pwrite_all(fd: int, data: bytes, offset: int) -> None:
    # One pwrite a piece, as the requests brought them (a join would copy them first).
    # One pwritev of a run of pieces was tried: in bench_output_store.py it cost 0.27 to
    # 2.55 s of CPU a GiB from run to run, against a steady 0.27-0.31 for this.
    view = memoryview(data)
    while view:
        n = os.pwrite(fd, view, offset)
        view, offset = view[n:], offset + n


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    except OSError as e:
        # Some file systems cannot sync a directory (EINVAL: some FUSE and network file
        # systems): SQLite carries on there, and so does this. Any other error is one.
        if e.errno not in (errno.EINVAL, errno.ENOTSUP, errno.EOPNOTSUPP):
            raise
    finally:
        os.close(fd)
