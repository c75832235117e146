"""rc_worker: the device-host agent of the rc GPU job system.

The public API is exactly what this module re-exports (``__all__``), plus
the documented harness in ``rc_worker.testing``; ``tests/test_public_api.py``
pins it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from rc_worker._lazy import lazy_exports
from rc_worker._version import __version__

if TYPE_CHECKING:
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

# Loaded on first use (PEP 562), so that importing one submodule (the `rc` client, the
# config checker) does not load the whole worker and controller first.
_LAZY: dict[str, str] = {
    "load_config": "rc_worker.config_load",
    "Config": "rc_worker.core.config",
    "DeviceConfig": "rc_worker.core.config",
    "GpuHealthConfig": "rc_worker.core.config",
    "HooksConfig": "rc_worker.core.config",
    "AssignmentError": "rc_worker.core.errors",
    "ConfigError": "rc_worker.core.errors",
    "ControllerError": "rc_worker.core.errors",
    "RcWorkerError": "rc_worker.core.errors",
    "UnknownSession": "rc_worker.core.errors",
    "ProbeResult": "rc_worker.core.labels",
    "labels_payload": "rc_worker.core.labels",
    "Lease": "rc_worker.core.lease",
    "VERIFY_REASON_PREFIX": "rc_worker.core.model",
    "Assignment": "rc_worker.core.model",
    "Claim": "rc_worker.core.model",
    "DeviceState": "rc_worker.core.model",
    "IdleBehavior": "rc_worker.core.model",
    "Outcome": "rc_worker.core.model",
    "VerifyResult": "rc_worker.core.model",
    "Host": "rc_worker.host",
    "LinuxHost": "rc_worker.host",
    "ProbePass": "rc_worker.probe",
    "Prober": "rc_worker.probe",
    "SourceOutcome": "rc_worker.probe",
    "JobHandle": "rc_worker.supervise",
    "JobSpec": "rc_worker.supervise",
    "Result": "rc_worker.supervise",
    "run_job": "rc_worker.supervise",
    "SweepReport": "rc_worker.sweep",
    "sweep_job_survivors": "rc_worker.sweep",
    "run_verify": "rc_worker.verify",
    "Worker": "rc_worker.worker",
}


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

__getattr__, __dir__ = lazy_exports(__name__, _LAZY, __all__)
