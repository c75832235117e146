"""The simulation harness's public names, pinned (STYLE rule 1): renaming one breaks users."""

from __future__ import annotations

import rc_worker.testing.fleet
import rc_worker.testing.sim

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


def test_the_simulated_host_exports() -> None:
    assert set(rc_worker.testing.sim.__all__) == SIM


def test_the_fleet_harness_exports() -> None:
    assert set(rc_worker.testing.fleet.__all__) == FLEET


def test_every_public_class_and_function_is_documented() -> None:
    for module, names in ((rc_worker.testing.sim, SIM), (rc_worker.testing.fleet, FLEET)):
        for name in names - {"DEFAULT_PIPE_CAPACITY", "ENDPOINTS", "Step"}:
            assert getattr(module, name).__doc__, f"{module.__name__}.{name} has no docstring"
