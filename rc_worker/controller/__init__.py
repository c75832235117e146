"""The reference controller: the whole rc system on one box with nothing else installed.

Tests and simulations run it in-process through ``httpx.ASGITransport(app=create_app(...))``;
``rc serve`` serves it with hypercorn on Trio. It implements docs/protocol.md.

- :func:`create_app` builds the Starlette app; its :class:`Store` (``app.state.store``)
  holds all state and can be driven and inspected directly (``store.submit(...)``,
  ``store.job(job_id)``, ``store.output(job_id)``, ``store.device(host, name)``, ...).
- :func:`~rc_worker.controller.serve.serve` serves an app; ``rc`` is the client.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from rc_worker._lazy import lazy_exports

if TYPE_CHECKING:
    from rc_worker.controller import store
    from rc_worker.controller.app import create_app
    from rc_worker.controller.errors import ApiError
    from rc_worker.controller.messages import (
        Assignment,
        DeviceInfo,
        Event,
        FaultInfo,
        JobInfo,
        JobSpec,
        SheetInfo,
    )
    from rc_worker.controller.store import Store, StoreConfig
    from rc_worker.core.selectors import Selector, SelectorError, parse_selector, parse_size

# Loaded on first use (PEP 562): the `rc` client imports modules of this package and must
# not load the server (Starlette, the store) to print a job list.
_LAZY: dict[str, str] = {
    "store": "rc_worker.controller.store",
    "create_app": "rc_worker.controller.app",
    "ApiError": "rc_worker.controller.errors",
    **dict.fromkeys(
        ("Assignment", "DeviceInfo", "Event", "FaultInfo", "JobInfo", "JobSpec", "SheetInfo"),
        "rc_worker.controller.messages",
    ),
    "Store": "rc_worker.controller.store",
    "StoreConfig": "rc_worker.controller.store",
    **dict.fromkeys(
        ("Selector", "SelectorError", "parse_selector", "parse_size"), "rc_worker.core.selectors"
    ),
}


__all__ = [
    "ApiError",
    "Assignment",
    "DeviceInfo",
    "Event",
    "FaultInfo",
    "JobInfo",
    "JobSpec",
    "Selector",
    "SelectorError",
    "SheetInfo",
    "Store",
    "StoreConfig",
    "create_app",
    "parse_selector",
    "parse_size",
    "store",
]

__getattr__, __dir__ = lazy_exports(__name__, _LAZY, __all__)
