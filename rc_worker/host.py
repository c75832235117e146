"""The Host seam: everything the worker does to the operating system.

``LinuxHost`` is the real one. The simulated host in ``rc_worker.testing``
implements the same protocol so the worker's logic runs unchanged in
virtual time.
"""

from __future__ import annotations

import os
import platform
import socket
from pathlib import Path
from typing import Protocol

BOOT_ID_PATH = Path("/proc/sys/kernel/random/boot_id")


class Host(Protocol):
    """What the worker needs from the machine it runs on."""

    def hostname(self) -> str: ...

    def boot_id(self) -> str: ...

    def kernel(self) -> str: ...

    def cpu_count(self) -> int: ...

    def mem_total_bytes(self) -> int: ...

    def disk_free_bytes(self, path: str) -> int: ...


class LinuxHost:
    """The real host: /proc, os and signals."""

    def hostname(self) -> str:
        return socket.gethostname()

    def boot_id(self) -> str:
        return BOOT_ID_PATH.read_text().strip()

    def kernel(self) -> str:
        return platform.release()

    def cpu_count(self) -> int:
        return os.cpu_count() or 1

    def mem_total_bytes(self) -> int:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) * 1024
        raise OSError("MemTotal missing from /proc/meminfo")

    def disk_free_bytes(self, path: str) -> int:
        # The nearest existing ancestor: the state dir may not exist yet on
        # a first start, and its filesystem is still the one jobs write to.
        p = Path(path).absolute()
        while not p.exists() and p != p.parent:
            p = p.parent
        st = os.statvfs(p)
        return st.f_bavail * st.f_frsize
