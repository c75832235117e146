"""rc_worker: the device-host agent of the rc GPU job system."""

from __future__ import annotations

from rc_worker.errors import (
    AssignmentError,
    ConfigError,
    ControllerError,
    RcWorkerError,
    UnknownSession,
)
from rc_worker.host import Host, LinuxHost

__version__ = "0.1.0"

__all__ = [
    "AssignmentError",
    "ConfigError",
    "ControllerError",
    "Host",
    "LinuxHost",
    "RcWorkerError",
    "UnknownSession",
    "__version__",
]
