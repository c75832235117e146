"""Benchmark: a fleet simulation's speed, on the in-memory disk against the real one.

The scenario (issue 9's speed target): one simulated host with 8 devices, 500
jobs of about a virtual minute each (three lines of output, at 10, 30 and 55
virtual seconds), run to the end and drained: about a virtual hour. Target:
under 2 s of wall time on the project's 2-core machine.

The baseline, measured in the same run, is the same scenario with the
simulated hosts' files on the real disk (a temporary directory, real fsyncs:
what ``SimHost`` did before its ``SimDisk``), so the ratio shows what the
in-memory disk saves. Repetitions are interleaved (real, memory, real, ...),
so a noisy neighbour on shared cores hurts both sides alike; the median of
the per-pair ratios is the figure, with the CPU time, which contention
distorts far less than the wall clock. ``--profile`` prints where the
in-memory run spends its time (cProfile, top 25 by own time).

    python bench/bench_sim.py [--jobs N] [--devices D] [--reps R] [--profile] [--json]
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import json
import os
import platform
import pstats
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import attrs
import trio

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from rc_worker.statestore import LinuxStore
from rc_worker.testing.fleet import Fleet, simulate
from rc_worker.testing.sim import Script, SimHost

TRAIN = Script.printing((10, b"epoch 1\n"), (30, b"epoch 2\n"), (55, b"done\n"))
ACTIVE = ("queued", "assigned", "running")


@attrs.frozen
class Sample:
    wall: float
    cpu: float
    virtual: float
    requests: int


@contextlib.contextmanager
def real_disk() -> Iterator[None]:
    """Every SimHost built meanwhile keeps its files on the real disk, as before."""
    original = SimHost.__init__

    def patched(self: SimHost, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        self.store = LinuxStore()

    SimHost.__init__ = patched  # type: ignore[method-assign]
    try:
        yield
    finally:
        SimHost.__init__ = original  # type: ignore[method-assign]


def run_once(jobs: int, devices: int, *, memory: bool) -> Sample:
    names = tuple(f"gpu{i}" for i in range(devices))

    async def scenario(fleet: Fleet) -> tuple[float, int]:
        fleet.program("train", TRAIN)
        ids = [fleet.submit(["train"]) for _ in range(jobs)]

        def done() -> bool:
            counts = fleet.store.job_state_counts()
            return not any(counts.get(s) for s in ACTIVE)

        # Not fleet.settle(): its predicate builds every job's view at every change.
        await fleet.wait_until(done, interval=60)
        await fleet.drain()
        states = {fleet.store.job(j).state for j in ids}
        if states != {"succeeded"}:
            raise SystemExit(f"bench_sim: jobs ended {sorted(states)}, expected all succeeded")
        requests = sum(len(n.transport.log) for n in fleet.nodes.values())
        return trio.current_time(), requests

    context = contextlib.nullcontext() if memory else real_disk()
    with context, tempfile.TemporaryDirectory(prefix="rc-bench-sim-") as root:
        wall0, cpu0 = time.perf_counter(), time.process_time()
        virtual, requests = simulate(
            scenario,
            hosts=1,
            devices=names,
            seed=1,
            root=root,
            time_limit=24 * 3600,
            wall_limit=600,
        )
        return Sample(time.perf_counter() - wall0, time.process_time() - cpu0, virtual, requests)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=500)
    parser.add_argument("--devices", type=int, default=8)
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()

    memory: list[Sample] = []
    real: list[Sample] = []
    ratios: list[float] = []
    for _ in range(args.reps):
        real.append(run_once(args.jobs, args.devices, memory=False))
        memory.append(run_once(args.jobs, args.devices, memory=True))
        ratios.append(memory[-1].wall / real[-1].wall)

    def med(samples: list[Sample], field: str) -> float:
        return statistics.median(getattr(s, field) for s in samples)

    r: dict[str, Any] = {
        "bench": "bench_sim",
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "machine": f"{platform.machine()} {os.cpu_count()} cpus, "
        f"python {platform.python_version()}",
        "load_average": os.getloadavg()[0],
        "jobs": args.jobs,
        "devices": args.devices,
        "virtual_s": med(memory, "virtual"),
        "requests": memory[0].requests,
        "memory_wall_s": med(memory, "wall"),
        "memory_cpu_s": med(memory, "cpu"),
        "real_wall_s": med(real, "wall"),
        "real_cpu_s": med(real, "cpu"),
        "ratio": statistics.median(ratios),
        "ratio_range": [min(ratios), max(ratios)],
        "cpu_ratio": med(memory, "cpu") / med(real, "cpu"),
        "target_wall_s": 2.0,
    }
    if args.json:
        print(json.dumps(r, indent=2))
    else:
        ok = r["memory_wall_s"] < r["target_wall_s"]
        lo, hi = r["ratio_range"]
        print(
            f"bench_sim  {r['date']}  {r['machine']}  load {r['load_average']:.1f}\n"
            f"  scenario             {r['jobs']} jobs on {r['devices']} devices, "
            f"{r['virtual_s']:.0f} virtual s, {r['requests']} requests\n"
            f"  in-memory disk       {r['memory_wall_s']:6.2f} s wall  "
            f"{r['memory_cpu_s']:6.2f} s cpu   (target < 2 s wall: {'met' if ok else 'NOT met'})\n"
            f"  real disk            {r['real_wall_s']:6.2f} s wall  {r['real_cpu_s']:6.2f} s cpu\n"
            f"  memory / real        {r['ratio']:6.2f}x wall (runs {lo:.2f}-{hi:.2f}), "
            f"{r['cpu_ratio']:.2f}x cpu"
        )
    if args.profile:
        profiler = cProfile.Profile()
        profiler.enable()
        run_once(args.jobs, args.devices, memory=True)
        profiler.disable()
        pstats.Stats(profiler).sort_stats("tottime").print_stats(25)


if __name__ == "__main__":
    main()
