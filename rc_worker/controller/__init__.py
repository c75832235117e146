"""The reference controller: the whole rc system on one box with nothing else installed.

Tests and simulations run it in-process through ``httpx.ASGITransport(app=create_app(...))``;
``rc serve`` serves it with hypercorn on Trio. It implements docs/protocol.md.

- :func:`create_app` builds the Starlette app; its :class:`Store` (``app.state.store``)
  holds all state and can be driven and inspected directly (``store.submit(...)``,
  ``store.job(job_id)``, ``store.output(job_id)``, ``store.device(host, name)``, ...).
- :func:`~rc_worker.controller.serve.serve` serves an app; ``rc`` is the client.
"""

from __future__ import annotations

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
