"""Drop-in directories: executables run in name order (probe.d, verify.d).

Dot-files are skipped silently (editor backups, ``.keep``); directories and
files without the execute bit are skipped and logged, so an operator who
forgot ``chmod +x`` finds out from the log rather than from a silent no-op.
"""

from __future__ import annotations

import logging
from pathlib import Path

from rc_worker.statestore import LINUX_STORE, StateStore

log = logging.getLogger("rc_worker.dropins")


def list_executables(directory: str | Path, store: StateStore = LINUX_STORE) -> list[Path]:
    """The executables in ``directory`` in name order; a missing directory has none."""
    root = Path(directory)
    try:
        entries = [root / name for name in store.listdir(root)]
    except FileNotFoundError:
        return []
    except NotADirectoryError:
        log.warning("%s is not a directory; no drop-ins run from it", root)
        return []
    found = []
    for entry in entries:
        if entry.name.startswith("."):
            continue
        try:
            found_entry = store.entry(entry)
        except OSError:
            found_entry = None
        if found_entry is not None and found_entry.kind == "dir":
            log.warning("skipping %s: it is a directory", entry)
        elif found_entry is None or not found_entry.executable:
            log.warning("skipping %s: it is not executable (chmod +x to enable it)", entry)
        else:
            found.append(entry)
    return found


class TailBuffer:
    """A sink that keeps only the last ``limit`` bytes written to it."""

    def __init__(self, limit: int = 4096) -> None:
        self._limit = limit
        self._data = bytearray()

    async def __call__(self, data: bytes) -> None:
        self._data += data
        if len(self._data) > self._limit:
            del self._data[: len(self._data) - self._limit]

    def text(self, limit: int = 300) -> str:
        """The tail as one short line, for a log line or a reason field."""
        text = self._data.decode("utf-8", "replace").strip()
        text = " | ".join(line.strip() for line in text.splitlines() if line.strip())
        return text[-limit:]
