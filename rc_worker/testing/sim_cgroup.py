"""The simulated host's cgroup v2 hierarchy: just enough of the unified cgroupfs for the worker.

A mixin of :class:`~rc_worker.testing.sim.SimHost`, kept apart for size. It
models: a tree of cgroups (``cgroup_mkdir`` / ``cgroup_rmdir``, EBUSY while
populated), membership (a spawn names its cgroup, a fork inherits its
parent's, writing ``cgroup.procs`` moves a process), ``cgroup.events``
(``populated`` counts live processes below), ``cgroup.kill``, delegated
controllers (``cgroup.controllers`` / ``cgroup.subtree_control``, the
no-internal-processes rule), limits, ``cpu.stat`` (wall time, in virtual
seconds) and ``memory.peak`` (0). Every call fails once the worker has died,
as every Host call does.
"""

from __future__ import annotations

import errno
import posixpath
import signal
from typing import TYPE_CHECKING

import trio

if TYPE_CHECKING:
    from rc_worker.testing.sim import SimProcess


class SimCgroupFs:
    """The cgroup part of the Host protocol, for :class:`~rc_worker.testing.sim.SimHost`."""

    # What it uses of the SimHost it is part of.
    _table: dict[int, SimProcess]
    _cgroups: dict[str, dict[str, str]]
    history: list[SimProcess]
    worker_pid: int
    worker_alive: bool
    worker_cgroup: str
    service_cgroup: str
    cgroup_v2: bool
    cgroup_controllers: frozenset[str]

    def _deliver(self, proc: SimProcess, sig: int) -> None:
        raise NotImplementedError  # SimHost's

    def members(self, path: str, *, below: bool = False) -> list[SimProcess]:
        """The live processes in cgroup ``path`` (``below``: or any cgroup under it)."""
        return [
            p
            for p in self._table.values()
            if p.alive
            and (p.cgroup == path or (below and p.cgroup.startswith(path.rstrip("/") + "/")))
        ]

    def cgroups(self) -> list[str]:
        """Every cgroup that exists now, for checks."""
        return sorted(self._cgroups)

    def own_cgroup(self) -> str:
        self._alive_or_raise()
        if not self.cgroup_v2:
            raise OSError(errno.ENODEV, "no cgroup2 filesystem in /proc/self/mountinfo")
        return self.worker_cgroup

    def cgroup_read(self, path: str, name: str) -> str:
        files = self._cgroup(path)
        if name == "cgroup.procs":
            pids = [str(p.pid) for p in self.members(path)]
            if self.worker_cgroup == path:
                pids.append(str(self.worker_pid))
            return "".join(f"{pid}\n" for pid in pids)
        if name == "cgroup.events":
            populated = bool(self.members(path, below=True)) or self.worker_cgroup == path
            return f"populated {int(populated)}\nfrozen 0\n"
        if name == "cgroup.controllers":
            return " ".join(sorted(self._controllers(path))) + "\n"
        if name == "cpu.stat":
            now = trio.current_time()
            usec = sum(
                int(((p.ended_at if p.ended_at is not None else now) - p.started_at) * 1e6)
                for p in self.history
                if p.cgroup == path
            )
            return f"usage_usec {usec}\nuser_usec {usec}\nsystem_usec 0\n"
        if name == "io.stat" and "io" in self._controllers(path):
            return "8:0 rbytes=4096 wbytes=0 rios=1 wios=0 dbytes=0 dios=0\n"
        if name == "memory.peak" and "memory" in self._controllers(path):
            return "0\n"
        if name in files:
            return files[name]
        raise FileNotFoundError(errno.ENOENT, f"{path}/{name}: No such file or directory")

    def cgroup_write(self, path: str, name: str, value: str) -> None:
        files = self._cgroup(path)
        if name == "cgroup.procs":
            pid = int(value)
            if pid in (0, self.worker_pid):
                self.worker_cgroup = path
            elif pid in self._table:
                self._table[pid].cgroup = path
            else:
                raise ProcessLookupError(errno.ESRCH, f"no process {pid}")
        elif name == "cgroup.kill":
            for proc in self.members(path, below=True):
                self._deliver(proc, signal.SIGKILL)
        elif name == "cgroup.subtree_control":
            wanted = {word[1:] for word in value.split() if word.startswith("+")}
            if not wanted <= self._controllers(path):
                raise FileNotFoundError(errno.ENOENT, f"{sorted(wanted)} not available")
            if path != "/" and self.members(path):
                raise OSError(errno.EBUSY, "a cgroup with processes cannot delegate")
            files[name] = " ".join(sorted(wanted))
        elif name.split(".", 1)[0] in ("memory", "cpu", "io"):
            if name.split(".", 1)[0] not in self._controllers(path):
                raise FileNotFoundError(errno.ENOENT, f"{path}/{name}: No such file")
            files[name] = value
        else:
            files[name] = value

    def cgroup_mkdir(self, path: str) -> None:
        self._alive_or_raise()
        if path in self._cgroups:
            return
        self._cgroup(posixpath.dirname(path))
        self._cgroups[path] = {}

    def cgroup_rmdir(self, path: str) -> None:
        self._cgroup(path)
        if path == "/" or self.cgroup_children(path) or self.members(path):
            raise OSError(errno.EBUSY, f"{path}: Device or resource busy")
        if self.worker_cgroup == path:
            raise OSError(errno.EBUSY, f"{path}: Device or resource busy")
        del self._cgroups[path]

    def cgroup_children(self, path: str) -> list[str]:
        self._cgroup(path)
        return [
            posixpath.basename(c)
            for c in self._cgroups
            if c != path and posixpath.dirname(c) == path
        ]

    def _cgroup(self, path: str) -> dict[str, str]:
        self._alive_or_raise()
        if not self.cgroup_v2:
            raise OSError(errno.ENODEV, "no cgroup2 filesystem")
        files = self._cgroups.get(path)
        if files is None:
            raise FileNotFoundError(errno.ENOENT, f"{path}: No such file or directory")
        return files

    def _controllers(self, path: str) -> set[str]:
        if path in ("/", self.service_cgroup):
            return set(self.cgroup_controllers)
        parent = self._cgroups.get(posixpath.dirname(path), {})
        return set(parent.get("cgroup.subtree_control", "").split())

    def _reset_cgroups(self) -> None:
        self._cgroups = {"/": {}}
        parts = self.service_cgroup.strip("/").split("/")
        for i in range(1, len(parts) + 1):
            self._cgroups["/" + "/".join(parts[:i])] = {}

    def _alive_or_raise(self) -> None:
        if not self.worker_alive:
            raise OSError(errno.ESRCH, "the worker process is gone (simulated crash)")
