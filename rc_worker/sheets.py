"""Usage sheets: the operator's markdown about this host and its devices.

``<sheet_dir>/host.md`` and ``<sheet_dir>/host.d/<device>.md``, each capped
at 64 KiB. An unreadable or oversized file is logged and skipped, never
fatal: documentation must not stop a worker from serving.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from rc_worker.statestore import LINUX_STORE, StateStore

log = logging.getLogger("rc_worker.sheets")

SHEET_CAP = 64 * 1024


def read_sheet(path: Path, store: StateStore = LINUX_STORE) -> str | None:
    """The sheet at ``path``, or None when absent, unreadable or too big (logged)."""
    try:
        data = store.read(path, 0, SHEET_CAP + 1)
    except FileNotFoundError:
        return None
    except OSError as e:
        log.warning("skipping sheet %s: %s", path, e.strerror or e)
        return None
    if len(data) > SHEET_CAP:
        log.warning("skipping sheet %s: larger than %d bytes", path, SHEET_CAP)
        return None
    return data.decode("utf-8", "replace")


class SheetReader:
    """Reads the sheets and notices when they change."""

    def __init__(
        self, sheet_dir: str, devices: Iterable[str], store: StateStore = LINUX_STORE
    ) -> None:
        self._store = store
        self._dir = Path(sheet_dir)
        self._devices = tuple(devices)
        self._last: dict[str, Any] | None = None

    def read(self) -> dict[str, Any]:
        sheets: dict[str, Any] = {
            "host": read_sheet(self._dir / "host.md", self._store),
            "devices": {},
        }
        for name in self._devices:
            text = read_sheet(self._dir / "host.d" / f"{name}.md", self._store)
            if text is not None:
                sheets["devices"][name] = text
        self._last = sheets
        return sheets

    def changed(self) -> bool:
        """Whether the files differ from what ``read`` last returned."""
        before = self._last
        return self.read() != before
