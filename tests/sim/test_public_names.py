"""The simulation harness's public names, pinned (STYLE rule 1): renaming one breaks users."""

from __future__ import annotations

import rc_worker.testing.fleet
import rc_worker.testing.guard
import rc_worker.testing.invariants
import rc_worker.testing.plans
import rc_worker.testing.sim
import rc_worker.testing.strategies
import rc_worker.testing.transport

SIM = {
    "DEFAULT_PIPE_CAPACITY",
    "EchoStdin",
    "Fork",
    "Hang",
    "HostFacts",
    "OnSigterm",
    "Script",
    "SimHost",
    "SimPipe",
    "SimProcess",
    "Sleep",
    "Step",
    "Write",
}
FLEET = {
    "ENDPOINTS",
    "Exchange",
    "Fault",
    "FaultyTransport",
    "Fleet",
    "SimNode",
    "SimulationStalled",
    "SimulationTimedOut",
    "open_fleet",
    "simulate",
}


TRANSPORT = {"ENDPOINTS", "TIMEOUT_S", "Exchange", "Fault", "FaultyTransport", "endpoint_of"}
INVARIANTS = {"Watch", "check", "job_processes", "worker_scripts"}
GUARD = {"STALL_STEPS", "WALL_LIMIT", "SimulationStalled", "SimulationTimedOut", "StallGuard"}
STRATEGIES = {"fault_plans", "fleet_plans", "job_plans", "job_scripts", "seconds"}
PLAN_KINDS = {
    "CancelPlan",
    "CrashPlan",
    "DiskPlan",
    "FleetPlan",
    "HooksPlan",
    "IdlePlan",
    "InjectPlan",
    "JobPlan",
    "OutagePlan",
    "PlanRun",
    "SmiPlan",
    "UnofferPlan",
}
PLAN_FUNCTIONS = {"describe", "disk_fault", "parse_plan", "play", "replay", "replay_line"}


def test_the_split_modules_export() -> None:
    assert set(rc_worker.testing.transport.__all__) == TRANSPORT
    assert set(rc_worker.testing.invariants.__all__) == INVARIANTS
    assert set(rc_worker.testing.guard.__all__) == GUARD
    assert set(rc_worker.testing.strategies.__all__) == STRATEGIES
    # A plan's repr names these: `from rc_worker.testing.plans import *` must give them all.
    names = set(rc_worker.testing.plans.__all__)
    assert names >= PLAN_KINDS | PLAN_FUNCTIONS
    assert {"Fault", "Script", "Sleep", "Write", "Hang", "Fork", "OnSigterm"} <= names
    for module, public in (
        (rc_worker.testing.transport, TRANSPORT - {"ENDPOINTS", "TIMEOUT_S"}),
        (rc_worker.testing.invariants, INVARIANTS),
        (rc_worker.testing.guard, GUARD - {"STALL_STEPS", "WALL_LIMIT"}),
        (rc_worker.testing.strategies, STRATEGIES),
        (rc_worker.testing.plans, PLAN_KINDS | PLAN_FUNCTIONS),
    ):
        for name in public:
            assert getattr(module, name).__doc__, f"{module.__name__}.{name} has no docstring"


def test_the_simulated_host_exports() -> None:
    assert set(rc_worker.testing.sim.__all__) == SIM


def test_the_fleet_harness_exports() -> None:
    assert set(rc_worker.testing.fleet.__all__) == FLEET


def test_every_public_class_and_function_is_documented() -> None:
    for module, names in ((rc_worker.testing.sim, SIM), (rc_worker.testing.fleet, FLEET)):
        for name in names - {"DEFAULT_PIPE_CAPACITY", "ENDPOINTS", "Step"}:
            assert getattr(module, name).__doc__, f"{module.__name__}.{name} has no docstring"
