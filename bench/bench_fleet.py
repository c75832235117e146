"""Benchmark: hypothesis fault plans a minute for a 2 x 2 fleet (target: at least 1,000).

Each plan is drawn by ``rc_worker.testing.fault_plans(hosts=2, devices=2)`` with a
seed, played in a fresh virtual-time fleet (``replay``: play, lift every fault,
bring every worker back, settle, drain) and checked against the invariants, as
a hypothesis test does; drawing is included in the cost. The plans are
derandomized, so two runs of this script measure the same plans.

The baseline, measured in the same run: plans with one job and no fault (what a
fleet costs to start, run one job and drain), so that a busy machine shows in
both figures alike. The CPU time this process spent is reported too: contention
with other processes distorts it far less than the wall clock.

    python bench/bench_fleet.py [--plans N] [--baseline N] [--json] [--profile FILE]
"""

from __future__ import annotations

import argparse
import cProfile
import json
import logging
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import trio
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from rc_worker.testing import fault_plans
from rc_worker.testing.plans import FleetPlan, JobPlan, Script, replay

TARGET_PER_MIN = 1000.0
TRAIN = Script.printing((1, b"epoch 1\n"), (5, b"done\n"))


def run_plans(n: int) -> dict[str, Any]:
    """Draw and play ``n`` fault plans; wall and CPU seconds, and each plan's wall time."""
    each: list[float] = []
    failures: list[str] = []

    @settings(
        max_examples=n,
        deadline=None,
        database=None,
        derandomize=True,
        suppress_health_check=list(HealthCheck),
        phases=[Phase.generate],  # no shrinking, no replaying a database
    )
    @given(plan=fault_plans(hosts=2, devices=2), seed=st.integers(0, 2**32 - 1))
    def one(plan: FleetPlan, seed: int) -> None:
        start = time.perf_counter()
        problems = replay(plan, seed).problems
        each.append(time.perf_counter() - start)
        if problems:
            failures.append(f"seed {seed}: {problems[0]}")

    wall, cpu = time.perf_counter(), time.process_time()
    one()
    return {
        "wall_s": time.perf_counter() - wall,
        "cpu_s": time.process_time() - cpu,
        "plans": len(each),
        "each": each,
        "failures": failures,
    }


def run_baseline(n: int) -> dict[str, Any]:
    plan = FleetPlan(hosts=2, devices=2, jobs=(JobPlan(0.0, TRAIN),))
    wall, cpu = time.perf_counter(), time.process_time()
    for seed in range(n):
        assert replay(plan, seed).problems == []
    return {"wall_s": time.perf_counter() - wall, "cpu_s": time.process_time() - cpu, "plans": n}


def measure(args: argparse.Namespace) -> dict[str, Any]:
    load = os.getloadavg()[0]
    base = run_baseline(args.baseline)
    plans = run_plans(args.plans)
    per_min = 60 * plans["plans"] / plans["wall_s"]
    per_min_cpu = 60 * plans["plans"] / plans["cpu_s"]
    base_per_min = 60 * base["plans"] / base["wall_s"]
    each = sorted(plans["each"])
    return {
        "date": time.strftime("%Y-%m-%d"),
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, Linux {platform.release()}",
        "load_average": load,
        "load_average_after": os.getloadavg()[0],
        "python": platform.python_version(),
        "trio": trio.__version__,
        "plans": plans["plans"],
        "plans_per_min": per_min,
        "plans_per_min_cpu": per_min_cpu,
        "target_ratio": per_min / TARGET_PER_MIN,
        "plan_ms_median": 1000 * statistics.median(each),
        "plan_ms_p90": 1000 * each[int(0.9 * (len(each) - 1))],
        "baseline_plans": base["plans"],
        "baseline_per_min": base_per_min,
        "baseline_per_min_cpu": 60 * base["plans"] / base["cpu_s"],
        "ratio_to_baseline": per_min / base_per_min,
        "failures": plans["failures"],
    }


def report(r: dict[str, Any]) -> str:
    ok = r["plans_per_min"] >= TARGET_PER_MIN
    lines = [
        f"bench_fleet  {r['date']}  {r['machine']}  load {r['load_average']:.1f} "
        f"(after {r['load_average_after']:.1f})  Python {r['python']}  trio {r['trio']}",
        f"{r['plans']} hypothesis fault plans, 2 hosts x 2 devices, each drawn, played, checked:",
        f"  plans a minute (wall)     {r['plans_per_min']:8.0f}   target >= {TARGET_PER_MIN:.0f}: "
        f"{'met' if ok else 'MISSED'} ({r['target_ratio']:.2f}x)",
        f"  plans a minute (CPU)      {r['plans_per_min_cpu']:8.0f}",
        f"  per plan                  {r['plan_ms_median']:8.1f} ms median, "
        f"{r['plan_ms_p90']:.1f} ms p90",
        f"baseline: {r['baseline_plans']} plans of one job and no fault:",
        f"  plans a minute (wall)     {r['baseline_per_min']:8.0f}   "
        f"(CPU {r['baseline_per_min_cpu']:.0f})",
        f"  fault plans / baseline    {r['ratio_to_baseline']:8.2f}x",
    ]
    if r["failures"]:
        lines.append(f"INVARIANT VIOLATIONS in {len(r['failures'])} plans: {r['failures'][:3]}")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--plans", type=int, default=300, help="fault plans to play (300)")
    parser.add_argument("--baseline", type=int, default=50, help="baseline plans (50)")
    parser.add_argument("--json", action="store_true", help="print the figures as JSON")
    parser.add_argument("--profile", help="write a cProfile of the fault plans to this file")
    args = parser.parse_args()
    logging.disable(logging.CRITICAL)  # the workers' warnings: faults are the point here
    if args.profile:
        profiler = cProfile.Profile()
        profiler.enable()
        figures = measure(args)
        profiler.disable()
        profiler.dump_stats(args.profile)
    else:
        figures = measure(args)
    print(json.dumps(figures, indent=2) if args.json else report(figures))
    return 1 if figures["failures"] else 0


if __name__ == "__main__":
    sys.exit(main())
