"""One worker per state directory: an exclusive ``flock`` on ``state_dir/lock``.

Two workers on one state directory (a copy-pasted supervisord program, a
second ``rc-worker run`` by hand) would each take the other's running jobs for
interrupted ones: the second SIGTERMs the first's job, runs verify against it
and quarantines the device. So the worker takes this lock before it reads the
journal and holds it for the life of ``Worker.run``; a second worker is
refused at once, touching nothing, with the pid of the holder.

``flock`` rather than ``fcntl``/``lockf`` record locks: a record lock is
dropped when *any* descriptor of the file is closed by the process, and is
shared across threads; ``flock`` belongs to the open file description, so
it lives exactly as long as the one descriptor kept here. That descriptor is
close-on-exec (Python's default), so a job that outlives a crashed worker
does not keep the lock, and the kernel drops it when the worker dies by any
means, SIGKILL included: there is no stale lock to clean up by hand.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
from pathlib import Path
from types import TracebackType

from rc_worker.core.errors import ConfigError

LOCK_NAME = "lock"


log = logging.getLogger("rc_worker.statelock")


class StateDirLocked(ConfigError):
    """Another live process holds the state directory's lock.

    A ``ConfigError``: restarting will not fix it (``rc-worker run`` exits 2).
    """

    def __init__(self, root: Path, holder: int | None) -> None:
        who = f"pid {holder}" if holder is not None else "another process"
        super().__init__(
            f"state_dir {root} is in use by another rc-worker ({who}); stop that worker, "
            "or give each worker its own state_dir"
        )
        self.root = root
        self.holder = holder


class StateDirLock:
    """The held lock; ``with StateDirLock.acquire(root): ...`` or ``release()``."""

    def __init__(self, root: Path, fd: int) -> None:
        self.root = root
        self._fd: int | None = fd

    @classmethod
    def acquire(cls, root: Path, *, pid: int | None = None) -> StateDirLock:
        """Take the lock on ``root`` (which must exist) without waiting.

        Raises ``StateDirLocked`` naming the holder's pid when it is taken,
        and ``ConfigError`` when the lock file cannot be opened at all.
        """
        path = root / LOCK_NAME
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        except OSError as e:
            raise ConfigError(
                f"state_dir: cannot open the lock file {path} ({e.strerror}); make {root} "
                "writable by the worker's user, or point state_dir elsewhere"
            ) from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            holder = _read_pid(fd)
            os.close(fd)
            if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise StateDirLocked(root, holder) from None
            raise ConfigError(
                f"state_dir: cannot lock {path} ({e.strerror}); use a local file system "
                "that supports flock for state_dir"
            ) from None
        # Ours now: record who holds it, for the next one to name. Only a courtesy: a full
        # disk must not keep the worker from starting (recovery then reports what it can).
        try:
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{os.getpid() if pid is None else pid}\n".encode(), 0)
        except OSError as e:
            log.warning("cannot record this pid in %s: %s", path, e)
        return cls(root, fd)

    @property
    def held(self) -> bool:
        return self._fd is not None

    def release(self) -> None:
        if self._fd is None:
            return
        fd, self._fd = self._fd, None
        # Closing the only descriptor drops the flock. The file stays: removing
        # it would race a worker that has it open and is about to lock it.
        os.close(fd)

    def __enter__(self) -> StateDirLock:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.release()


def _read_pid(fd: int) -> int | None:
    try:
        text = os.pread(fd, 64, 0).decode("ascii", "replace").strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None
