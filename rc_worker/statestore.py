"""The state-store port: every file the worker reads or writes goes through it.

The worker's state directory (journals, the output spool, finish and fault
reports, recovery claims, the lock) and the operator's files it reads
(drop-in directories, sheets) are reached only through a :class:`StateStore`,
which the :class:`~rc_worker.host.Host` seam carries as ``host.store``.
:class:`LinuxStore` is the real file system; the simulated host keeps an
in-memory one (``rc_worker.testing.simdisk``) whose fsyncs cost nothing and
whose faults (a full disk, a torn write at a power loss, a directory that
vanishes) can be injected.

The operations are the few the worker's durability rules are written with
(``durable.py``): write a file's data and fsync it, rename it into place,
fsync the directory. Each raises ``OSError`` as the real call does (with
``errno`` set: ``ENOENT``, ``ENOSPC``...), so the callers' error handling is
the same on both.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import stat
from pathlib import Path
from typing import Literal, Protocol

import attrs

Kind = Literal["file", "dir", "other"]


@attrs.frozen
class Entry:
    """What :meth:`StateStore.entry` says of one path (symlinks followed)."""

    kind: Kind
    size: int = 0
    executable: bool = False
    """Whether this process may execute it (``os.access(path, X_OK)``)."""


class AppendFile(Protocol):
    """A file opened for appending (a job's output spool)."""

    def write(self, data: memoryview) -> int:
        """Append what the disk takes of ``data`` (maybe less); ``OSError`` when nothing."""
        ...

    def size(self) -> int:
        """The file's size now."""
        ...

    def close(self) -> None: ...


class StateStore(Protocol):
    """The files of the worker's host (see the module doc)."""

    def mkdir(self, path: Path, *, parents: bool = False, mode: int = 0o700) -> None:
        """Create a directory; one that exists is fine."""
        ...

    def chmod(self, path: Path, mode: int) -> None: ...

    def exists(self, path: Path) -> bool: ...

    def is_dir(self, path: Path) -> bool: ...

    def entry(self, path: Path) -> Entry | None:
        """What ``path`` is; ``None`` when absent. Raises ``OSError`` when it cannot look."""
        ...

    def listdir(self, path: Path) -> list[str]:
        """The names in a directory, sorted. ``FileNotFoundError``, ``NotADirectoryError``."""
        ...

    def size(self, path: Path) -> int:
        """A file's size; ``FileNotFoundError`` when absent."""
        ...

    def read(self, path: Path, offset: int = 0, limit: int = -1) -> bytes:
        """Up to ``limit`` bytes (``-1``: all) from ``offset``; ``FileNotFoundError``."""
        ...

    def write_synced(self, path: Path, data: bytes, mode: int = 0o600) -> None:
        """Create or truncate ``path``, write ``data`` and fsync it (its name is not synced)."""
        ...

    def replace(self, src: Path, dst: Path) -> None:
        """Rename ``src`` to ``dst`` atomically, replacing what was there."""
        ...

    def fsync_dir(self, path: Path) -> None:
        """Make the entries of directory ``path`` (a rename into it) durable."""
        ...

    def touch(self, path: Path, mode: int = 0o600) -> None:
        """Create an empty file unless one exists."""
        ...

    def unlink(self, path: Path) -> None:
        """Remove a file; one already gone is fine."""
        ...

    def rmtree(self, path: Path) -> None:
        """Remove a directory and everything in it, ignoring errors."""
        ...

    def open_append(self, path: Path, mode: int = 0o600) -> AppendFile:
        """Open (creating) ``path`` for appending."""
        ...

    def tree_bytes(self, path: Path) -> int:
        """Bytes in the files under ``path`` (0 when it does not exist)."""
        ...

    def lock(self, root: Path, *, pid: int) -> contextlib.AbstractContextManager[object]:
        """Take the state directory's lock (``statelock.py``) for the process ``pid``;
        ``StateDirLocked`` when another process holds it. Released on leaving the block."""
        ...

    def which(self, name: str, path: str) -> str | None:
        """Where ``name`` is found on the search path ``path`` (``shutil.which``)."""
        ...


class _LinuxAppend:
    def __init__(self, path: Path, mode: int) -> None:
        self._fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, mode)

    def write(self, data: memoryview) -> int:
        return os.write(self._fd, data)

    def size(self) -> int:
        return os.fstat(self._fd).st_size

    def close(self) -> None:
        os.close(self._fd)


class LinuxStore:
    """The real file system."""

    def mkdir(self, path: Path, *, parents: bool = False, mode: int = 0o700) -> None:
        path.mkdir(mode=mode, parents=parents, exist_ok=True)

    def chmod(self, path: Path, mode: int) -> None:
        os.chmod(path, mode)

    def exists(self, path: Path) -> bool:
        return path.exists()

    def is_dir(self, path: Path) -> bool:
        return path.is_dir()

    def entry(self, path: Path) -> Entry | None:
        try:
            st = os.stat(path)
        except FileNotFoundError:
            return None
        if stat.S_ISDIR(st.st_mode):
            return Entry("dir")
        if not stat.S_ISREG(st.st_mode):
            return Entry("other", 0, os.access(path, os.X_OK))
        return Entry("file", st.st_size, os.access(path, os.X_OK))

    def listdir(self, path: Path) -> list[str]:
        return sorted(os.listdir(path))

    def size(self, path: Path) -> int:
        return path.stat().st_size

    def read(self, path: Path, offset: int = 0, limit: int = -1) -> bytes:
        with open(path, "rb") as f:
            if offset:
                f.seek(offset)
            return f.read(limit)

    def write_synced(self, path: Path, data: bytes, mode: int = 0o600) -> None:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
            os.fsync(fd)
        finally:
            os.close(fd)

    def replace(self, src: Path, dst: Path) -> None:
        os.replace(src, dst)

    def fsync_dir(self, path: Path) -> None:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def touch(self, path: Path, mode: int = 0o600) -> None:
        path.touch(mode=mode, exist_ok=True)

    def unlink(self, path: Path) -> None:
        path.unlink(missing_ok=True)

    def rmtree(self, path: Path) -> None:
        shutil.rmtree(path, ignore_errors=True)

    def open_append(self, path: Path, mode: int = 0o600) -> AppendFile:
        return _LinuxAppend(path, mode)

    def tree_bytes(self, path: Path) -> int:
        total = 0
        for folder, _, files in os.walk(path):
            for name in files:
                with contextlib.suppress(OSError):  # removed while we looked: delivered
                    total += os.lstat(os.path.join(folder, name)).st_size
        return total

    def lock(self, root: Path, *, pid: int) -> contextlib.AbstractContextManager[object]:
        from rc_worker.statelock import StateDirLock

        return StateDirLock.acquire(root, pid=pid)

    def which(self, name: str, path: str) -> str | None:
        return shutil.which(name, path=path)


LINUX_STORE = LinuxStore()
"""The real store: the default wherever no host's store is given (tests, tools)."""
