"""``examples/simulate_fleet.py`` runs, and stays within its 40 lines."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

EXAMPLE = Path(__file__).parents[2] / "examples" / "simulate_fleet.py"


def test_the_fleet_example_is_short() -> None:
    assert len(EXAMPLE.read_text().splitlines()) <= 40


def test_the_fleet_example_runs_plans_and_checks_the_invariants() -> None:
    # 3 plans instead of 200: the full run is for people, not the suite.
    done = subprocess.run(
        [sys.executable, str(EXAMPLE), "3"], capture_output=True, text=True, timeout=100
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "3 fault plans on 4 hosts x 4 devices: every invariant held"
