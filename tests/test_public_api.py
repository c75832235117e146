"""The public API is exactly what rc_worker re-exports; this pins it.

Other programs and an acceptance suite import these names: removing or
renaming one is a breaking change, and must show up here first.
"""

from __future__ import annotations

import rc_worker
import rc_worker.testing

PUBLIC = {
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
}


def test_public_api_is_pinned() -> None:
    assert set(rc_worker.__all__) == PUBLIC
    for name in PUBLIC:
        assert getattr(rc_worker, name) is not None


def test_every_public_name_is_documented_where_it_is_defined() -> None:
    for name in PUBLIC - {"__version__", "VERIFY_REASON_PREFIX"}:
        assert getattr(rc_worker, name).__doc__, f"{name} has no docstring"


def test_testing_harness_exports() -> None:
    assert set(rc_worker.testing.__all__) == {
        "USER_TOKEN",
        "WORKER_TOKEN",
        "EchoStdin",
        "Fault",
        "FaultyTransport",
        "Fleet",
        "FleetPlan",
        "Fork",
        "Hang",
        "LocalSystem",
        "OnSigterm",
        "Script",
        "SimHost",
        "Sleep",
        "Write",
        "fault_plans",
        "local_system",
        "make_config",
        "open_fleet",
        "replay",
        "simulate",
    }


def test_config_error_is_the_documented_exception() -> None:
    assert issubclass(rc_worker.ConfigError, rc_worker.RcWorkerError)
    assert rc_worker.VERIFY_REASON_PREFIX == "verify failed: "
