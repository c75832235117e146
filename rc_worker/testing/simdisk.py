"""A simulated disk: the :class:`~rc_worker.statestore.StateStore` port in memory.

Every file of a :class:`~rc_worker.testing.sim.SimHost` lives here: the
worker's state directory (journals, output spools, reports, the lock), and
the drop-ins, verify scripts and tools the host's programs stand for. Nothing
touches the real file system and an fsync costs nothing, so a fleet
simulation spends its time on the worker's logic.

Crash semantics (what :meth:`SimDisk.power_loss` keeps), as a strict POSIX
file system promises them:

- a file's data survives up to its last fsync (``write_synced``); what was
  appended since (an output spool is never fsynced) is lost, or, with
  :attr:`SimDisk.torn_writes`, partly there: the first half of what was
  written since the fsync (a torn write);
- a name (a file created, renamed into place or removed) survives once its
  directory was fsynced after it (``fsync_dir``); until then the directory
  comes back as it was at its last fsync;
- a new directory survives at once (a simplification: a journalling file
  system commits a ``mkdir`` with the next fsync of anything, and the worker
  always fsyncs a file in a directory it creates); with
  :attr:`SimDisk.strict_dirs`, as strict POSIX has it, only once its parent
  was fsynced after it, like any other name.

What a dead worker's code still does (``SimHost.worker_died``: its shielded
cleanup runs while it is cancelled) changes nothing on the disk, as a SIGKILLed
process writes nothing. A process crash and a clean reboot
(``SimHost.reboot``, which syncs the disks first as ``reboot`` does) lose
nothing; only a power loss does.

Injectable faults:

- :attr:`SimDisk.capacity`: bytes the disk holds; a write past it fails with
  ``ENOSPC`` (an append takes what fits first). :meth:`SimDisk.fill` makes
  the disk full now; ``capacity = None`` frees it.
- :attr:`SimDisk.torn_writes`: a power loss leaves half of each un-fsynced write.
- :meth:`SimDisk.vanish`: a directory and everything in it are gone at once
  (an operator's ``rm -rf``, a lost mount): later writes into it fail with ``ENOENT``.
"""

from __future__ import annotations

import errno
import functools
import os
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path, PurePosixPath
from typing import TypeAlias

from rc_worker.statelock import LOCK_NAME, StateDirLocked
from rc_worker.statestore import AppendFile, Entry

__all__ = ["SimDisk"]

AnyPath: TypeAlias = Path | PurePosixPath | str


class _File:
    __slots__ = ("data", "executable", "synced")

    def __init__(self, executable: bool = False) -> None:
        self.data = bytearray()
        self.synced = b""
        self.executable = executable


class _Dir:
    __slots__ = ("durable", "entries")

    def __init__(self) -> None:
        self.entries: dict[str, _File | _Dir] = {}
        self.durable: dict[str, _File | _Dir] = {}


def _error(code: int, path: AnyPath) -> OSError:
    return OSError(code, os.strerror(code), str(path))


def _parts(path: AnyPath) -> tuple[str, ...]:
    return _split(os.fspath(path))


@functools.lru_cache(maxsize=4096)
def _split(path: str) -> tuple[str, ...]:
    # Cached: the worker names the same few dozen paths over and over.
    return tuple(p for p in os.path.normpath(os.path.join("/", path)).split("/") if p)


class _Append:
    def __init__(self, disk: SimDisk, node: _File) -> None:
        self._disk = disk
        self._node = node
        self._closed = False

    def write(self, data: memoryview) -> int:
        if self._closed:
            raise _error(errno.EBADF, "closed spool")
        if self._disk.frozen:
            return len(data)
        room = self._disk.room()
        n = len(data) if room is None else min(len(data), room)
        if n <= 0 and len(data):
            raise _error(errno.ENOSPC, "output")
        self._node.data += data[:n]
        return n

    def size(self) -> int:
        return len(self._node.data)

    def close(self) -> None:
        self._closed = True


class SimDisk:
    """Files in memory with honest crash semantics and injectable faults (module doc)."""

    def __init__(self) -> None:
        self._root = _Dir()
        self.capacity: int | None = None
        """Bytes the disk holds (``None``: no limit); past it writes fail with ``ENOSPC``."""
        self.torn_writes = False
        """A power loss leaves the first half of each write not yet fsynced."""
        self.strict_dirs = False
        """A new directory survives a power loss only once its parent was fsynced
        after it (strict POSIX); by default at once (module doc)."""
        self._locks: dict[tuple[str, ...], int] = {}
        self.fsyncs = 0
        """How many fsyncs (files and directories) were asked for: free here, counted."""
        self.frozen = False
        """While the worker is dead (``SimHost.worker_died`` until ``worker_started``),
        what its dying code still writes has no effect: a SIGKILLed process writes nothing."""

    # -- faults ---------------------------------------------------------------

    def fill(self) -> None:
        """The disk is full from now on (until ``capacity = None``)."""
        self.capacity = self.used()

    def used(self) -> int:
        """Bytes in the files now."""
        return sum(len(f.data) for f in self._files(self._root))

    def room(self) -> int | None:
        """Bytes that can still be written (``None``: no limit)."""
        if self.capacity is None:
            return None
        return max(self.capacity - self.used(), 0)

    def vanish(self, path: AnyPath) -> None:
        """Remove the directory ``path`` and all in it at once, durably (it is gone)."""
        parent, name = self._parent(path)
        parent.entries.pop(name, None)
        parent.durable.pop(name, None)

    def power_loss(self) -> None:
        """The machine lost power: keep only what was durable (module doc)."""
        self._locks.clear()
        seen: set[int] = set()
        self._restore(self._root, seen)

    def _restore(self, directory: _Dir, seen: set[int]) -> None:
        if id(directory) in seen:
            return
        seen.add(id(directory))
        directory.entries = dict(directory.durable)
        for node in directory.entries.values():
            if isinstance(node, _Dir):
                self._restore(node, seen)
            elif id(node) not in seen:
                seen.add(id(node))
                node.data = bytearray(self._survivor(node))

    def _survivor(self, node: _File) -> bytes:
        if not self.torn_writes or bytes(node.data) == node.synced:
            return node.synced
        if node.data.startswith(node.synced):
            tail = node.data[len(node.synced) :]
            return node.synced + bytes(tail[: len(tail) // 2])
        # Rewritten since its last fsync (truncated, then written): half of the new data.
        return bytes(node.data[: len(node.data) // 2])

    def install(self, path: AnyPath, data: bytes = b"", *, executable: bool = True) -> None:
        """Put a file (an executable by default) at ``path``, its directories too, durably."""
        self.mkdir(Path(path).parent, parents=True)
        parent, name = self._parent(path)
        node = _File(executable)
        node.data = bytearray(data)
        node.synced = bytes(data)
        parent.entries[name] = parent.durable[name] = node

    # -- lookups --------------------------------------------------------------

    def _lookup(self, path: AnyPath) -> _File | _Dir | None:
        return self._walk(_parts(path))

    def _walk(self, parts: tuple[str, ...]) -> _File | _Dir | None:
        node: _File | _Dir = self._root
        for part in parts:
            if not isinstance(node, _Dir):
                return None
            found = node.entries.get(part)
            if found is None:
                return None
            node = found
        return node

    def _parent(self, path: AnyPath) -> tuple[_Dir, str]:
        parts = _parts(path)
        if not parts:
            raise _error(errno.EBUSY, path)
        parent = self._walk(parts[:-1])
        if parent is None:
            raise _error(errno.ENOENT, path)
        if not isinstance(parent, _Dir):
            raise _error(errno.ENOTDIR, path)
        return parent, parts[-1]

    def _file(self, path: AnyPath) -> _File:
        node = self._lookup(path)
        if node is None:
            raise FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), str(path))
        if isinstance(node, _Dir):
            raise IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR), str(path))
        return node

    def _files(self, directory: _Dir) -> Iterator[_File]:
        for node in directory.entries.values():
            if isinstance(node, _Dir):
                yield from self._files(node)
            else:
                yield node

    # -- the StateStore port --------------------------------------------------

    def mkdir(self, path: Path, *, parents: bool = False, mode: int = 0o700) -> None:
        if self.frozen:
            return
        node: _Dir = self._root
        parts = _parts(path)
        for i, part in enumerate(parts):
            found = node.entries.get(part)
            if found is None:
                if not parents and i < len(parts) - 1:
                    raise FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), str(path))
                found = node.entries[part] = _Dir()
                if not self.strict_dirs:
                    node.durable[part] = found
            elif not isinstance(found, _Dir):
                raise FileExistsError(errno.EEXIST, os.strerror(errno.EEXIST), str(path))
            node = found

    def chmod(self, path: Path, mode: int) -> None:
        if self.frozen:
            return
        node = self._lookup(path)
        if node is None:
            raise FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), str(path))
        if isinstance(node, _File):
            node.executable = bool(mode & 0o111)

    def exists(self, path: Path) -> bool:
        return self._lookup(path) is not None

    def is_dir(self, path: Path) -> bool:
        return isinstance(self._lookup(path), _Dir)

    def entry(self, path: Path) -> Entry | None:
        node = self._lookup(path)
        if node is None:
            return None
        if isinstance(node, _Dir):
            return Entry("dir")
        return Entry("file", len(node.data), node.executable)

    def listdir(self, path: Path) -> list[str]:
        node = self._lookup(path)
        if node is None:
            raise FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), str(path))
        if not isinstance(node, _Dir):
            raise NotADirectoryError(errno.ENOTDIR, os.strerror(errno.ENOTDIR), str(path))
        return sorted(node.entries)

    def size(self, path: Path) -> int:
        return len(self._file(path).data)

    def read(self, path: Path, offset: int = 0, limit: int = -1) -> bytes:
        data = self._file(path).data
        end = len(data) if limit < 0 else offset + limit
        return bytes(data[offset:end])

    def write_synced(self, path: Path, data: bytes, mode: int = 0o600) -> None:
        if self.frozen:
            return
        node = self._writable(path, mode)
        node.data = bytearray()  # truncated first (O_TRUNC): its bytes are free again
        room = self.room()
        if room is not None and len(data) > room:
            # What fitted is written, the rest refused: the caller removes the file.
            node.data = bytearray(data[:room])
            raise _error(errno.ENOSPC, path)
        node.data = bytearray(data)
        node.synced = bytes(data)
        self.fsyncs += 1

    def replace(self, src: Path, dst: Path) -> None:
        if self.frozen:
            return
        src_parent, src_name = self._parent(src)
        node = src_parent.entries.get(src_name)
        if node is None:
            raise FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), str(src))
        dst_parent, dst_name = self._parent(dst)
        if isinstance(dst_parent.entries.get(dst_name), _Dir) and not isinstance(node, _Dir):
            raise IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR), str(dst))
        del src_parent.entries[src_name]
        dst_parent.entries[dst_name] = node

    def fsync_dir(self, path: Path) -> None:
        if self.frozen:
            return
        node = self._lookup(path)
        if node is None:
            raise FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), str(path))
        if not isinstance(node, _Dir):
            raise NotADirectoryError(errno.ENOTDIR, os.strerror(errno.ENOTDIR), str(path))
        node.durable = dict(node.entries)
        self.fsyncs += 1

    def touch(self, path: Path, mode: int = 0o600) -> None:
        if self.frozen:
            return
        parent, name = self._parent(path)
        if name not in parent.entries:
            parent.entries[name] = _File(bool(mode & 0o111))

    def unlink(self, path: Path) -> None:
        if self.frozen:
            return
        try:
            parent, name = self._parent(path)
        except FileNotFoundError:
            return
        except OSError as e:
            if e.errno == errno.ENOENT:
                return
            raise
        node = parent.entries.get(name)
        if isinstance(node, _Dir):
            raise IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR), str(path))
        parent.entries.pop(name, None)

    def rmtree(self, path: Path) -> None:
        if self.frozen:
            return
        try:
            parent, name = self._parent(path)
        except OSError:
            return
        if isinstance(parent.entries.get(name), _Dir):
            del parent.entries[name]

    def _writable(self, path: Path, mode: int) -> _File:
        """The file at ``path`` to write, created (with ``mode``'s executable bit) if absent;
        ``IsADirectoryError`` for a directory, as ``open`` for writing says."""
        parent, name = self._parent(path)
        node = parent.entries.get(name)
        if isinstance(node, _Dir):
            raise IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR), str(path))
        if node is None:
            node = parent.entries[name] = _File(bool(mode & 0o111))
        return node

    def open_append(self, path: Path, mode: int = 0o600) -> AppendFile:
        if self.frozen:
            return _Append(self, _File())  # nothing it writes lands
        node = self._writable(path, mode)
        return _Append(self, node)

    def tree_bytes(self, path: Path) -> int:
        node = self._lookup(path)
        if not isinstance(node, _Dir):
            return 0  # as os.walk sees a file: nothing under it
        return sum(len(f.data) for f in self._files(node))

    @contextmanager
    def _held(self, key: tuple[str, ...], pid: int) -> Iterator[object]:
        try:
            yield self
        finally:
            # A dead holder's lock went with it (release_locks): the next one's stays.
            if self._locks.get(key) == pid:
                del self._locks[key]

    def release_locks(self, pid: int) -> None:
        """The process ``pid`` died: the kernel drops its locks."""
        for key in [k for k, holder in self._locks.items() if holder == pid]:
            del self._locks[key]

    def sync(self) -> None:
        """Everything written so far is durable (``sync``, as a clean reboot does)."""
        self._sync(self._root)

    def _sync(self, directory: _Dir) -> None:
        directory.durable = dict(directory.entries)
        for node in directory.entries.values():
            if isinstance(node, _Dir):
                self._sync(node)
            else:
                node.synced = bytes(node.data)

    def lock(self, root: Path, *, pid: int) -> AbstractContextManager[object]:
        key = _parts(root)
        if not self.is_dir(root):
            raise FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), str(root))
        if key in self._locks:
            raise StateDirLocked(root, self._locks[key])
        self._locks[key] = pid
        # The file a real lock leaves, with the holder's pid in it.
        parent, name = self._parent(root / LOCK_NAME)
        node = parent.entries.get(name)
        if not isinstance(node, _File):
            node = parent.entries[name] = _File()
        node.data = bytearray(f"{pid}\n".encode())
        return self._held(key, pid)

    def which(self, name: str, path: str) -> str | None:
        if "/" in name:
            entry = self.entry(Path(name))
            return name if entry is not None and entry.executable else None
        for directory in path.split(os.pathsep):
            candidate = os.path.join(directory or ".", name)
            entry = self.entry(Path(candidate))
            if entry is not None and entry.kind == "file" and entry.executable:
                return candidate
        return None
