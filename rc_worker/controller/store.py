"""The reference controller's state: hosts, devices, jobs, attempts, output, faults, events.

Sans-IO: plain synchronous code with no Trio or anyio import. Every method
that makes a time-based decision takes ``now`` (the controller's monotonic or
virtual clock) explicitly, so the whole controller runs under a mock clock and
is property-tested directly. Wall-clock time is read only for the timestamps
shown to people.

Async code waits for a change with :meth:`Store.subscribe`: every mutation
bumps :attr:`Store.version` and calls the subscribers, which the app turns
into an event that wakes long polls and followers at once.

The rules implemented here are written down in docs/protocol.md.
"""

from __future__ import annotations

from rc_worker.controller.state import StoreConfig
from rc_worker.controller.store_devices import DEVICE_STATES, DevicesSide
from rc_worker.controller.store_jobs import JobsSide
from rc_worker.controller.store_worker import WorkerSide

__all__ = ["DEVICE_STATES", "Store", "StoreConfig"]


class Store(WorkerSide, DevicesSide, JobsSide):
    """The reference controller's state and every operation on it (see :class:`StoredState`).

    One class, in three parts by who calls them: jobs as users see them
    (``store_jobs.py``), devices and hosts as operators do (``store_devices.py``),
    and the worker protocol (``store_worker.py``). They share the state and its
    bookkeeping (``state.py``) and never each other's methods.
    """
