"""Benchmark: a sweep after a job on a busy host, against a bare /proc scan in the same run.

The host runs ``--others`` unrelated processes (5,000 ``sleep``s, started
before the job, as a busy machine's daemons and other users' jobs are). A
job then runs and ends; what does finding what is left of it cost?

- **baseline**: a bare /proc scan, ``LinuxHost.processes()``: list /proc and
  read every ``/proc/<pid>/stat``. Any sweep that walks the table pays this.
- **cgroup**: the sweep of the job's cgroup (``cgroup.sweep_cgroup``), which
  reads the job's ``cgroup.events`` / ``cgroup.procs`` and nothing else.
  Target: at most **0.2×** the baseline.
- **environ, windowed**: the RC_JOB_ID sweep as the worker runs it without a
  cgroup: with the pid mark taken before the job (``core/pid_window.py``),
  only the rows of pids handed out since are read. Target: at most **0.2×**.
- **environ, filtered**: the start-time filter alone (``since`` = the job's
  start): one table walk, but environments read only for processes started
  since the job.
- **environ, unfiltered**: the same sweep before this change (``since=None``):
  every process's environment read too.

Each is measured with nothing left of the job (the usual case). Repetitions
are interleaved (baseline, cgroup, filtered, unfiltered, baseline, ...) so a
noisy neighbour hurts all alike; the figure is the median of per-repetition
ratios to the baseline, with their range.

Needs root (or a delegated cgroup) for the cgroup case; without one it is
reported as skipped.

    python bench/bench_sweep.py [--others N] [--reps R] [--json]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import signal
import statistics
import subprocess
import sys
import time
import uuid
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import trio

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from rc_worker.cgroup import CgroupUnavailable, set_up, sweep_cgroup
from rc_worker.cgroup import remove as remove_cgroup
from rc_worker.host import LinuxHost
from rc_worker.supervise import JobSpec, run_job
from rc_worker.sweep import sweep_job_survivors

JOB_ID = f"bench-{uuid.uuid4().hex[:8]}"
ENV = {"PATH": os.environ.get("PATH", os.defpath), "RC_JOB_ID": JOB_ID}


@contextlib.contextmanager
def others(n: int) -> Iterator[list[subprocess.Popen[bytes]]]:
    """``n`` unrelated sleeping processes, killed (by pid, ours only) afterwards."""
    procs: list[subprocess.Popen[bytes]] = []
    try:
        for _ in range(n):
            procs.append(subprocess.Popen(["sleep", "3600"], env={"PATH": ENV["PATH"]}))
        yield procs
    finally:
        for p in procs:
            with contextlib.suppress(ProcessLookupError):
                p.send_signal(signal.SIGKILL)
        for p in procs:
            p.wait()


async def timed(fn: Callable[[], Awaitable[object]]) -> float:
    began = time.perf_counter()
    await fn()
    return time.perf_counter() - began


async def sink(_: bytes) -> None:
    pass


async def measure(reps: int) -> dict[str, Any]:
    host = LinuxHost()
    try:
        containment, _ = set_up(host, tag=f"bench-{uuid.uuid4().hex[:8]}")
    except CgroupUnavailable as e:
        print(f"cgroup case skipped: {e}", file=sys.stderr)
        containment = None
    try:
        # The job: it ends at once and leaves nothing. Its start is the filter's bound.
        since = host.boot_ticks()
        mark = host.pid_mark()
        path = None
        if containment is not None:
            host.containment = containment
            path = containment.leaf("job")
            result = await run_job(
                JobSpec(["true"], env=ENV, cgroup=path, sweep_job_id=JOB_ID), sink, host=host
            )
            host.cgroup_mkdir(path)  # swept and removed: make it again to sweep it again
        else:
            result = await run_job(JobSpec(["true"], env=ENV, sweep_job_id=JOB_ID), sink, host=host)
        assert result.sweep.clean, result.sweep

        async def baseline() -> None:
            host.processes()
            await trio.lowlevel.checkpoint()

        async def by_cgroup() -> None:
            assert path is not None
            report = await sweep_cgroup(host, path, grace=1.0)
            assert report.clean

        async def windowed() -> None:
            report = await sweep_job_survivors(JOB_ID, grace=1.0, host=host, since=since, mark=mark)
            assert report.clean
            assert not report.found

        async def filtered() -> None:
            report = await sweep_job_survivors(JOB_ID, grace=1.0, host=host, since=since)
            assert report.clean
            assert not report.found

        async def unfiltered() -> None:
            report = await sweep_job_survivors(JOB_ID, grace=1.0, host=host)
            assert not report.found

        cases: dict[str, Callable[[], Awaitable[None]]] = {"baseline": baseline}
        if path is not None:
            cases["cgroup"] = by_cgroup
        if mark is not None:
            cases["environ_windowed"] = windowed
        else:
            print("windowed case skipped: this host cannot take a pid mark", file=sys.stderr)
        cases["environ_filtered"] = filtered
        cases["environ_unfiltered"] = unfiltered
        times: dict[str, list[float]] = {name: [] for name in cases}
        cpu: dict[str, float] = dict.fromkeys(cases, 0.0)
        for _ in range(reps):
            for name, fn in cases.items():
                c0 = time.process_time()
                times[name].append(await timed(fn))
                cpu[name] += time.process_time() - c0
        out: dict[str, Any] = {
            "median_s": {k: statistics.median(v) for k, v in times.items()},
            "cpu_s_per_sweep": {k: v / reps for k, v in cpu.items()},
        }
        ratios = {}
        for name in cases:
            if name == "baseline":
                continue
            per = [t / b for t, b in zip(times[name], times["baseline"], strict=True)]
            ratios[name] = {"median": statistics.median(per), "min": min(per), "max": max(per)}
        out["ratio_to_baseline"] = ratios
        return out
    finally:
        if containment is not None:
            remove_cgroup(host, containment.tree)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--others", type=int, default=5000)
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    with others(args.others):
        figures = trio.run(measure, args.reps)
    figures["setup"] = {
        "others": args.others,
        "processes_in_table": len(os.listdir("/proc")),
        "kernel": platform.release(),
        "python": platform.python_version(),
        "load": os.getloadavg(),
    }
    if args.json:
        print(json.dumps(figures, indent=2))
        return 0
    load = ", ".join(f"{x:.2f}" for x in figures["setup"]["load"])
    print(f"{args.others} unrelated processes, {args.reps} interleaved repetitions, load {load}")
    base = figures["median_s"]["baseline"]
    cpu = figures["cpu_s_per_sweep"]
    print(f"  baseline (bare /proc scan): {base * 1e3:8.2f} ms, CPU {cpu['baseline'] * 1e3:.2f} ms")
    for name, r in figures["ratio_to_baseline"].items():
        ms = figures["median_s"][name] * 1e3
        print(
            f"  {name:<20}: {ms:8.2f} ms  {r['median']:.3f}x baseline "
            f"({r['min']:.3f}-{r['max']:.3f}), CPU {cpu[name] * 1e3:.2f} ms "
            f"({cpu[name] / cpu['baseline']:.3f}x)"
        )
    for name in ("cgroup", "environ_windowed"):
        r = figures["ratio_to_baseline"].get(name)
        if r is not None:
            verdict = "met" if r["median"] <= 0.2 else "NOT met"
            print(f"target: {name} sweep <= 0.2x baseline: {verdict}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
