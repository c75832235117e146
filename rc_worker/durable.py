"""Durable JSON writes, off the event loop and in groups (group commit).

Every file the worker must have on disk before it tells the controller
something (``journal.json`` before a spawn, ``finish.json`` before a finish is
sent, a fault file before the fault is sent, a recovery claim) goes through
one :class:`Committer`:

- The blocking part (write a temporary file, fsync it, rename it into place,
  fsync the directory) runs through ``run_blocking``: worker threads on a real
  host (``Host.run_blocking``), so heartbeats, polls and the other devices
  never wait behind a disk; inline on the simulated host, whose disk is
  instant in virtual time.
- Writes issued while a flush is under way wait together and go in the next
  flush (group commit): their temporary files are written and fsynced in
  parallel threads (the filesystem's journal commits concurrent fsyncs
  together), renamed into place, and each directory they touch is fsynced
  once for all of them. Writes issued in the same scheduler tick (several
  devices finishing, a batch of rejected assignments) share a flush too.

Ordering guarantees (what callers may rely on):

1. ``await write(...)`` returns only once the file is whole on disk under its
   name: its data and its directory entry are fsynced. That is what
   ``spool.write_json_durably`` promised; the durability rules of
   docs/operations.md are unchanged. A caller that needs A on disk before B
   exists awaits A before it issues B. A write with a ``before`` (which makes
   the directory the file goes in) also has that directory's own entry in its
   parent fsynced: a new directory is a name too, and strict POSIX keeps it
   only once its parent is fsynced. That fsync is shared like the others: one
   per parent per flush, however many directories the group made there.
2. Flushes run one at a time; within a flush, files are renamed into place in
   the order their writes were issued. A write issued after another is never
   visible before it while the host runs; after a crash only what was awaited
   is promised.
3. ``write_all`` puts its files in one flush, renamed in the order given.
4. A write that fails raises in its own caller only (an ``OSError`` naming
   its path); the rest of its group is unaffected, except writes whose shared
   directory fsync failed, which fail with it. A flush that fails otherwise
   (a bug) fails every write of its group (``EIO``): a caller is never told
   a file is durable that may not be.
5. Two writes of the same path in one flush: the one issued later wins, and
   both callers return once it is durable. It is renamed at the place of the
   first (whose ``before`` may make the directory of writes issued between
   them), so it may be visible before those: the exception to 2.
6. Cancelling a caller does not cancel its write: a flush, once begun, always
   completes (the blocking calls cannot be interrupted anyway), so a group's
   other callers are never left waiting on an abandoned flush.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import json
import logging
from collections.abc import Awaitable, Callable, Iterable, Mapping
from pathlib import Path
from typing import Any, TypeVar

import attrs
import trio

from rc_worker.statestore import LINUX_STORE, StateStore

T = TypeVar("T")

log = logging.getLogger("rc_worker.durable")

RunBlocking = Callable[[Callable[[], Any]], Awaitable[Any]]

# Threads one flush uses for its temporary files. Concurrent fsyncs are what
# lets the filesystem's journal commit a group at once; a handful is enough.
PARALLEL = 4


async def in_thread(fn: Callable[[], T]) -> T:
    """Run blocking file-system work in a Trio worker thread."""
    return await trio.to_thread.run_sync(fn)


@attrs.define(eq=False)
class _Write:
    path: Path
    data: bytes
    before: Callable[[], object] | None = None
    error: OSError | None = None


@attrs.define(eq=False)
class _Group:
    writes: list[_Write] = attrs.field(factory=list)
    done: trio.Event = attrs.field(factory=trio.Event)


class Committer:
    """Group commit of durable JSON writes (see the module doc for the guarantees)."""

    def __init__(
        self,
        run_blocking: RunBlocking | None = None,
        *,
        parallel: int = PARALLEL,
        store: StateStore | None = None,
    ):
        self._run: RunBlocking = run_blocking or in_thread
        self.store: StateStore = store if store is not None else LINUX_STORE
        """Where the files go: the host's (``Host.store``); the real disk by default."""
        self._parallel = max(1, parallel)
        self._open: _Group | None = None
        self._flushing = trio.Lock()
        # Counters: what group commit saved is visible to tests and benches.
        self.flushes = 0
        self.files = 0
        self.dir_syncs = 0

    async def run_blocking(self, fn: Callable[[], T]) -> T:
        """Other state-directory work off the event loop (creating or removing
        a job's directory: an unlink can take a millisecond on a busy disk)."""
        result: T = await self._run(fn)
        return result

    async def write(
        self,
        path: Path,
        data: Mapping[str, Any],
        *,
        before: Callable[[], object] | None = None,
    ) -> None:
        """Write ``data`` as JSON to ``path``; returns once it is durable.

        ``before`` runs in the flush's thread first (creating the directory
        the file goes in), saving a thread hop of its own; that directory's
        entry in its parent is then fsynced with the flush (guarantee 1).
        """
        await self.write_all([(path, data)], before=before)

    async def write_all(
        self,
        items: Iterable[tuple[Path, Mapping[str, Any]]],
        *,
        before: Callable[[], object] | None = None,
    ) -> None:
        """Write several files in one flush, renamed in the order given;
        ``before`` runs in the flush's thread before the first is written."""
        # Encoded here, not in the thread: a value JSON cannot encode is the
        # caller's bug and raises in the caller, before anything is queued.
        writes = [_Write(path, _encode(data)) for path, data in items]
        if writes:
            writes[0].before = before
        group = self._open
        if group is None:
            group = self._open = _Group()
            group.writes.extend(writes)
            await self._lead(group)
        else:
            group.writes.extend(writes)
            await group.done.wait()
        for w in writes:
            if w.error is not None:
                raise OSError(w.error.errno, w.error.strerror, str(w.path))

    async def _lead(self, group: _Group) -> None:
        # Shielded: the group's other writers wait on this flush, and the
        # thread calls cannot be interrupted anyway.
        with trio.CancelScope(shield=True):
            # One pass of the scheduler first, so writes issued in the same
            # tick join; then the group keeps gathering while the flush
            # before it (if any) is under way.
            await trio.lowlevel.checkpoint()
            async with self._flushing:
                if self._open is group:
                    self._open = None
                try:
                    await self._flush(group.writes)
                except Exception as exc:
                    # Not an OSError of one file (those are recorded per
                    # write): a bug, or the thread machinery failing. Nothing
                    # in this group may be taken for durable: every writer,
                    # this one too, gets an I/O error naming what happened.
                    log.exception("a group of %d durable writes failed", len(group.writes))
                    _fail_all(group.writes, exc)
                except BaseException as exc:
                    _fail_all(group.writes, exc)
                    raise
                finally:
                    group.done.set()

    async def _flush(self, writes: list[_Write]) -> None:
        self.flushes += 1
        # The last write of a path wins; earlier ones share its outcome.
        last: dict[Path, _Write] = {}
        for w in writes:
            last[w.path] = w
        unique = list(last.values())
        # A superseded write's ``before`` (creating a directory) still runs,
        # as part of the write that replaces it.
        for w in writes:
            if w is not last[w.path] and w.before is not None and last[w.path].before is None:
                last[w.path].before = w.before
        self.files += len(unique)
        if len(unique) <= 1 or self._parallel == 1:
            self.dir_syncs += await self._run(functools.partial(_commit, self.store, unique, True))
        else:
            # One directory's files stay in one thread, in issue order: a
            # write's ``before`` creates the directory its neighbours go in.
            by_dir: dict[Path, list[_Write]] = {}
            for w in unique:
                by_dir.setdefault(w.path.parent, []).append(w)
            slices: list[list[_Write]] = [[] for _ in range(self._parallel)]
            for i, members in enumerate(by_dir.values()):
                slices[i % self._parallel].extend(members)
            async with trio.open_nursery() as nursery:
                for part in slices:
                    if part:
                        nursery.start_soon(
                            self._run, functools.partial(_prepare_all, self.store, part)
                        )
            self.dir_syncs += await self._run(functools.partial(_commit, self.store, unique, False))
        for w in writes:
            if w is not last[w.path]:
                w.error = last[w.path].error


def _fail_all(writes: list[_Write], exc: BaseException) -> None:
    for w in writes:
        if w.error is None:
            w.error = OSError(errno.EIO, f"durable write failed: {exc!r}")


def _encode(data: Mapping[str, Any]) -> bytes:
    return json.dumps(data, sort_keys=True).encode()


def _tmp(path: Path) -> Path:
    return path.with_name(path.name + ".tmp")


def _prepare(store: StateStore, w: _Write) -> None:
    """Write and fsync ``w``'s temporary file (blocking)."""
    tmp = _tmp(w.path)
    try:
        if w.before is not None:
            w.before()
        store.write_synced(tmp, w.data)
    except OSError as e:
        w.error = e
        _unlink_quietly(store, tmp)


def _prepare_all(store: StateStore, writes: list[_Write]) -> None:
    for w in writes:
        _prepare(store, w)


def _commit(store: StateStore, writes: list[_Write], prepare: bool) -> int:
    """Rename each prepared file into place in order, then fsync each directory once,
    then the parent of each directory a ``before`` made, once; how many fsyncs that was."""
    if prepare:
        for w in writes:
            _prepare(store, w)
    dirs: dict[Path, list[_Write]] = {}
    for w in writes:
        if w.error is not None:
            continue
        try:
            store.replace(_tmp(w.path), w.path)
        except OSError as e:
            w.error = e
            _unlink_quietly(store, _tmp(w.path))
            continue
        dirs.setdefault(w.path.parent, []).append(w)
    synced = _fsync_dirs(store, dirs)
    # A directory a ``before`` made (a job's, for its journal) is an entry of its
    # parent, not yet durable: fsyncing the files and the directory itself does not
    # keep the directory's name after a power loss by POSIX (ext4 happens to commit
    # it with them; other file systems need not). Fsynced here, in this thread and
    # after the directories below it, once per parent for the whole group: jobs that
    # start together share the fsync of ``jobs/``.
    made = {w.path.parent for w in writes if w.before is not None}
    parents: dict[Path, list[_Write]] = {}
    for directory, members in dirs.items():
        if directory in made:
            parents.setdefault(directory.parent, []).extend(w for w in members if w.error is None)
    # A parent whose every write failed has nothing to make durable.
    return synced + _fsync_dirs(store, {p: ms for p, ms in parents.items() if ms})


def _fsync_dirs(store: StateStore, dirs: dict[Path, list[_Write]]) -> int:
    """Fsync each directory once; a failure is the error of the writes it held. How many
    fsyncs succeeded."""
    synced = 0
    for directory, members in dirs.items():
        try:
            store.fsync_dir(directory)
            synced += 1
        except OSError as e:
            for w in members:
                w.error = e
    return synced


def _unlink_quietly(store: StateStore, path: Path) -> None:
    with contextlib.suppress(OSError):
        store.unlink(path)
