"""rc_worker: the device-host agent of the rc GPU job system.

The public API is exactly what this module re-exports (``__all__``), plus
the documented harness in ``rc_worker.testing``; ``tests/test_public_api.py``
pins it.
"""

from __future__ import annotations

from rc_worker._version import __version__
from rc_worker.config_load import load_config
from rc_worker.core.config import Config, DeviceConfig, GpuHealthConfig, HooksConfig
from rc_worker.core.errors import (
    AssignmentError,
    ConfigError,
    ControllerError,
    RcWorkerError,
    UnknownSession,
)
from rc_worker.core.labels import ProbeResult, labels_payload
from rc_worker.core.lease import Lease
from rc_worker.core.model import (
    VERIFY_REASON_PREFIX,
    Assignment,
    Claim,
    DeviceState,
    IdleBehavior,
    Outcome,
    VerifyResult,
)
from rc_worker.host import Host, LinuxHost
from rc_worker.probe import ProbePass, Prober, SourceOutcome
from rc_worker.supervise import JobHandle, JobSpec, Result, run_job
from rc_worker.sweep import SweepReport, sweep_job_survivors
from rc_worker.verify import run_verify
from rc_worker.worker import Worker

__all__ = [
    "VERIFY_REASON_PREFIX",
    "Assignment",
    "AssignmentError",
    "Claim",
    "Config",
    "ConfigError",
    "ControllerError",
    "DeviceConfig",
    "DeviceState",
    "GpuHealthConfig",
    "HooksConfig",
    "Host",
    "IdleBehavior",
    "JobHandle",
    "JobSpec",
    "Lease",
    "LinuxHost",
    "Outcome",
    "ProbePass",
    "ProbeResult",
    "Prober",
    "RcWorkerError",
    "Result",
    "SourceOutcome",
    "SweepReport",
    "UnknownSession",
    "VerifyResult",
    "Worker",
    "__version__",
    "labels_payload",
    "load_config",
    "run_job",
    "run_verify",
    "sweep_job_survivors",
]
