"""Benchmark: what supervision costs, against a raw baseline measured in the same run.

1. Spawn overhead: N back-to-back ``run_job(["true"])`` against a raw Trio
   spawn-and-wait loop of the same command with the same plumbing (its own
   session, stdout a pipe read to EOF, stdin /dev/null), and, for reference,
   a plain synchronous ``subprocess.run``. Target: at most 2x the raw Trio loop.
2. Output throughput: a job writing 1 GiB (``head -c 1G /dev/zero``) into a
   discarding sink, against a raw blocking ``os.read`` loop on the same
   pipe. Target: at least half the raw rate.
3. The worker's peak RSS while doing each (VmHWM, reset between phases).

Repetitions are interleaved (raw, supervised, raw, ...), so a noisy neighbour
on shared cores hurts both sides of each pair alike; the median of the
per-pair ratios is the figure, with their range to show the spread, and the
CPU time this process spent, which contention distorts far less than the
wall clock.

    python bench/bench_supervise.py [--spawns N] [--bytes SIZE] [--reps R] [--json]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, TypeVar

import attrs
import trio

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from rc_worker.supervise import CHUNK_SIZE, JobSpec, run_job

T = TypeVar("T")

ENV = {"PATH": os.environ.get("PATH", os.defpath)}


def peak_rss_mib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def reset_peak_rss() -> None:
    with contextlib.suppress(OSError):
        Path("/proc/self/clear_refs").write_text("5")


async def _discard(_: bytes) -> None:
    pass


# -- spawn --------------------------------------------------------------------


async def spawn_raw_trio(n: int) -> None:
    for _ in range(n):
        proc = await trio.lowlevel.open_process(
            ["true"],
            env=ENV,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        assert proc.stdout is not None
        while await proc.stdout.receive_some(CHUNK_SIZE):
            pass
        await proc.wait()
        await proc.stdout.aclose()


async def spawn_supervised(n: int) -> None:
    spec = JobSpec(["true"], env=ENV)
    for _ in range(n):
        result = await run_job(spec, _discard)
        assert result.exit_code == 0, result


def spawn_raw_subprocess(n: int) -> None:
    for _ in range(n):
        subprocess.run(["true"], env=ENV, stdin=subprocess.DEVNULL, check=True)


# -- throughput ---------------------------------------------------------------


def output_raw(size: str) -> int:
    total = 0
    with subprocess.Popen(["head", "-c", size, "/dev/zero"], env=ENV, stdout=subprocess.PIPE) as p:
        assert p.stdout is not None
        fd = p.stdout.fileno()
        while chunk := os.read(fd, CHUNK_SIZE):
            total += len(chunk)
    return total


async def output_supervised(size: str) -> int:
    total = 0

    async def count(data: bytes) -> None:
        nonlocal total
        total += len(data)

    result = await run_job(JobSpec(["head", "-c", size, "/dev/zero"], env=ENV), count)
    assert result.exit_code == 0, result
    return total


# -- driver -------------------------------------------------------------------


@attrs.frozen
class Sample:
    wall: float  # seconds
    cpu: float  # seconds of this process's user + system time


def _cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def timed_sync(fn: Callable[[], T]) -> tuple[Sample, T]:
    wall, cpu = time.perf_counter(), _cpu()
    value = fn()
    return Sample(time.perf_counter() - wall, _cpu() - cpu), value


def timed_trio(fn: Callable[[], Awaitable[T]]) -> tuple[Sample, T]:
    async def main() -> tuple[Sample, T]:
        wall, cpu = time.perf_counter(), _cpu()
        value = await fn()
        return Sample(time.perf_counter() - wall, _cpu() - cpu), value

    return trio.run(main)


def _median(samples: list[Sample], field: str) -> float:
    return statistics.median(float(getattr(s, field)) for s in samples)


def measure(args: argparse.Namespace) -> dict[str, Any]:
    n, size, reps = args.spawns, args.bytes, args.reps
    s_trio: list[Sample] = []
    s_sub: list[Sample] = []
    s_sup: list[Sample] = []
    spawn_ratios: list[float] = []
    rss_spawn = 0.0
    for _ in range(reps):
        s_trio.append(timed_trio(lambda: spawn_raw_trio(n))[0])
        s_sub.append(timed_sync(lambda: spawn_raw_subprocess(n))[0])
        reset_peak_rss()
        s_sup.append(timed_trio(lambda: spawn_supervised(n))[0])
        rss_spawn = max(rss_spawn, peak_rss_mib())
        spawn_ratios.append(s_sup[-1].wall / s_trio[-1].wall)

    o_raw: list[Sample] = []
    o_sup: list[Sample] = []
    output_ratios: list[float] = []
    rss_output = 0.0
    nbytes = 0
    for _ in range(reps):
        o_raw.append(timed_sync(lambda: output_raw(size))[0])
        reset_peak_rss()
        sample, nbytes = timed_trio(lambda: output_supervised(size))
        o_sup.append(sample)
        rss_output = max(rss_output, peak_rss_mib())
        output_ratios.append(o_raw[-1].wall / o_sup[-1].wall)

    gib = nbytes / (1 << 30)
    return {
        "date": time.strftime("%Y-%m-%d"),
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, Linux {platform.release()}",
        "load_average": os.getloadavg()[0],
        "python": platform.python_version(),
        "trio": trio.__version__,
        "reps": reps,
        "spawns": n,
        "spawn_raw_trio_ms": 1000 * _median(s_trio, "wall") / n,
        "spawn_raw_subprocess_ms": 1000 * _median(s_sub, "wall") / n,
        "spawn_supervised_ms": 1000 * _median(s_sup, "wall") / n,
        "spawn_ratio": statistics.median(spawn_ratios),
        "spawn_ratio_range": [min(spawn_ratios), max(spawn_ratios)],
        "spawn_ratio_vs_subprocess": _median(s_sup, "wall") / _median(s_sub, "wall"),
        "spawn_cpu_ratio": _median(s_sup, "cpu") / _median(s_trio, "cpu"),
        "output_bytes": nbytes,
        "output_raw_gib_s": gib / _median(o_raw, "wall"),
        "output_supervised_gib_s": gib / _median(o_sup, "wall"),
        "output_ratio": statistics.median(output_ratios),
        "output_ratio_range": [min(output_ratios), max(output_ratios)],
        "output_raw_cpu_s_per_gib": _median(o_raw, "cpu") / gib,
        "output_supervised_cpu_s_per_gib": _median(o_sup, "cpu") / gib,
        "peak_rss_spawn_mib": rss_spawn,
        "peak_rss_output_mib": rss_output,
    }


def report(r: dict[str, Any]) -> str:
    spawn_ok = r["spawn_ratio"] <= 2.0
    output_ok = r["output_ratio"] >= 0.5
    lo, hi = r["spawn_ratio_range"]
    olo, ohi = r["output_ratio_range"]
    return "\n".join(
        [
            f"bench_supervise  {r['date']}  {r['machine']}  load {r['load_average']:.1f}  "
            f"Python {r['python']}  trio {r['trio']}",
            f"spawn x{r['spawns']} (`true`), median of {r['reps']} interleaved runs, per job:",
            f"  raw trio spawn+wait     {r['spawn_raw_trio_ms']:6.2f} ms",
            f"  raw subprocess.run      {r['spawn_raw_subprocess_ms']:6.2f} ms",
            f"  run_job                 {r['spawn_supervised_ms']:6.2f} ms",
            f"  run_job / raw trio      {r['spawn_ratio']:6.2f}x  (runs {lo:.2f}-{hi:.2f}; "
            f"target <= 2x: {'met' if spawn_ok else 'MISSED'})",
            f"  run_job / subprocess    {r['spawn_ratio_vs_subprocess']:6.2f}x",
            f"  CPU, run_job / raw trio {r['spawn_cpu_ratio']:6.2f}x",
            f"output {r['output_bytes'] / (1 << 30):.0f} GiB (`head -c 1G /dev/zero`), "
            f"median of {r['reps']} interleaved runs:",
            f"  raw os.read loop        {r['output_raw_gib_s']:6.2f} GiB/s  "
            f"{r['output_raw_cpu_s_per_gib']:.2f} CPU s/GiB",
            f"  run_job, counting sink  {r['output_supervised_gib_s']:6.2f} GiB/s  "
            f"{r['output_supervised_cpu_s_per_gib']:.2f} CPU s/GiB",
            f"  rate run_job / raw      {r['output_ratio']:6.2f}   (runs {olo:.2f}-{ohi:.2f}; "
            f"target >= 0.5: {'met' if output_ok else 'MISSED'})",
            f"peak RSS: {r['peak_rss_spawn_mib']:.1f} MiB spawning, "
            f"{r['peak_rss_output_mib']:.1f} MiB streaming 1 GiB",
        ]
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--spawns", type=int, default=200, help="jobs per spawn run (200)")
    parser.add_argument("--bytes", default="1G", help="output size for head -c (1G)")
    parser.add_argument("--reps", type=int, default=5, help="interleaved repetitions (5)")
    parser.add_argument("--json", action="store_true", help="print the figures as JSON")
    args = parser.parse_args()
    figures = measure(args)
    print(json.dumps(figures, indent=2) if args.json else report(figures))
    return 0


if __name__ == "__main__":
    sys.exit(main())
