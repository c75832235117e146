"""Benchmark: the hot path end to end, real ``rc serve`` + ``rc-worker run`` over HTTP,
against raw baselines measured in the same run.

Everything runs as real processes on 127.0.0.1 with the default heartbeat
(10 s) and poll wait (30 s), so a lost wake-up or a blocked event loop shows.

1. **submit → running** for a job printing ``date +%s.%N``: the job's own
   clock reading minus the submit time, against a raw ``subprocess`` spawn of
   the same command. Target: p50 ≤ raw + 10 ms, p99 ≤ 50 ms. Each job is
   submitted to an idle device (the worker's long poll parked, per
   ``rc_controller_long_polls_parked``); a second series submits each job the
   moment the previous one ended, racing the worker's next poll, and is printed
   beside it.
2. **submit → finished** for the same job (the end of ``GET output?follow``).
   Target: p99 ≤ 100 ms.
3. **back-to-back, 1 device**: jobs/s for M ``true`` jobs submitted at once,
   against a loop doing what durability needs: spawn ``true``, two
   write+fsync of a small file, two loopback TCP round trips.
   Target: ≥ 0.5× that loop.
4. **back-to-back, 8 devices**: the same with 8 devices against 8 such loops
   in parallel threads. Target: ≥ 0.5×, and ≥ 4× the 1-device figure.
5. **output**: a job writing SIZE bytes, read with ``rc logs -f`` into a
   file, against ``head -c SIZE /dev/zero`` read through a pipe into a file
   (the mean of a raw run before and after). Target: ≥ 0.3×; worker and
   controller RSS growth < 64 MiB each. Also, worker → controller alone:
   from submit until the controller has committed every byte.
6. **idle**: CPU and RSS of the worker with 8 idle devices over a few
   seconds, against a bare interpreter with the same imports.
   Target: < 0.5% of a core, < 80 MiB.

Every figure is printed with the machine's load average; see
docs/performance.md for recorded runs.

    python bench/bench_hotpath.py [--jobs N] [--bytes SIZE] [--idle S] [--json]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

import httpx

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
WORKER_TOKEN = "bench-worker-token"
USER_TOKEN = "bench-user-token"
ENV = {"PATH": os.environ.get("PATH", os.defpath)}
TICK = os.sysconf("SC_CLK_TCK")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def proc_status(pid: int, key: str) -> float:
    """A ``/proc/<pid>/status`` field in MiB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) / 1024
    return float("nan")


def reset_peak(pid: int) -> None:
    with contextlib.suppress(OSError):
        Path(f"/proc/{pid}/clear_refs").write_text("5")


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICK


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def _profiled(program: str, name: str) -> list[str]:
    """The command line of ``program``, under cProfile when $RC_BENCH_PROFILE names a dir."""
    where = os.environ.get("RC_BENCH_PROFILE")
    if not where:
        return [str(BIN / program)]
    out = str(Path(where) / f"{name}.prof")
    return [sys.executable, "-m", "cProfile", "-o", out, str(BIN / program)]


# -- the system under test ------------------------------------------------------------


class System:
    """``rc serve`` and ``rc-worker run`` with ``devices`` devices, as subprocesses."""

    def __init__(self, tmp: Path, devices: int, store: str = "sqlite") -> None:
        self.tmp = tmp
        self.store = store
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.devices = devices
        self.serve: subprocess.Popen[bytes] | None = None
        self.worker: subprocess.Popen[bytes] | None = None
        self.logs: list[IO[bytes]] = []
        self.http = httpx.Client(
            base_url=self.url, headers={"Authorization": f"Bearer {USER_TOKEN}"}, timeout=60
        )

    def __enter__(self) -> System:
        try:
            return self._start()
        except BaseException:
            self.__exit__()  # what started before the failure is stopped, not leaked
            raise

    def _start(self) -> System:
        log = self._log("serve.log")
        self.serve = subprocess.Popen(
            [
                *_profiled("rc", f"serve{self.devices}"),
                "serve",
                "--listen",
                f"127.0.0.1:{self.port}",
                "--worker-token",
                WORKER_TOKEN,
                "--user-token",
                USER_TOKEN,
                *self._store_args(),
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        self._wait(lambda: self.http.get("/v1/health").status_code == 200)
        state = self.tmp / f"state{self.devices}"
        config = self.tmp / f"worker{self.devices}.yaml"
        names = "".join(f"  - gpu{i}\n" for i in range(self.devices))
        config.write_text(
            f"controller_url: {self.url}\ntoken: {WORKER_TOKEN}\nhost: bench\n"
            f"devices:\n{names}state_dir: {state}\nprobe_dir: {self.tmp}/probe.d\n"
            f"verify_dir: {self.tmp}/verify.d\nsheet_dir: {self.tmp}/sheets\n"
        )
        wlog = self._log(f"worker{self.devices}.log")
        self.worker = subprocess.Popen(
            [*_profiled("rc-worker", f"worker{self.devices}"), "run", "--config", str(config)],
            stdout=wlog,
            stderr=subprocess.STDOUT,
        )
        self._wait(self._all_free)
        return self

    def _store_args(self) -> list[str]:
        """SQLite by default: what an operator runs, and where output goes as it is read."""
        if self.store == "memory":
            return ["--memory"]
        return ["--state-dir", str(self.tmp / f"controller{self.devices}")]

    def _log(self, name: str) -> IO[bytes]:
        f = open(self.tmp / name, "wb")  # noqa: SIM115 - closed in __exit__
        self.logs.append(f)
        return f

    def __exit__(self, *exc: object) -> None:
        self.http.close()
        for proc in (self.worker, self.serve):
            if proc is not None and proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(20)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
        for f in self.logs:
            f.close()

    def _all_free(self) -> bool:
        r = self.http.get("/v1/devices")
        devices = r.json().get("devices", []) if r.status_code == 200 else []
        free = [d for d in devices if d.get("host") == "bench" and d.get("state") == "free"]
        return len(free) == self.devices

    def _wait(self, ready: Any, limit: float = 30.0, step: float = 0.05) -> None:
        deadline = time.monotonic() + limit
        while time.monotonic() < deadline:
            with contextlib.suppress(httpx.HTTPError):
                if ready():
                    return
            time.sleep(step)
        raise RuntimeError(f"not ready after {limit}s; see the logs in {self.tmp}")

    def submit(self, command: list[str]) -> str:
        r = self.http.post("/v1/jobs", json={"command": command})
        r.raise_for_status()
        job_id: str = r.json()["job_id"]
        return job_id

    def follow(self, job_id: str) -> bytes:
        """The job's whole output; returns when the job has ended."""
        with self.http.stream("GET", f"/v1/jobs/{job_id}/output", params={"follow": "1"}) as r:
            return r.read()

    def state(self, job_id: str) -> str:
        state: str = self.http.get(f"/v1/jobs/{job_id}").json()["state"]
        return state

    def wait_for_parked_poll(self) -> None:
        """Until the worker's long poll is parked at the controller (bounded: 5 s)."""

        def parked() -> bool:
            for line in self.http.get("/metrics").text.splitlines():
                if line.startswith("rc_controller_long_polls_parked "):
                    return float(line.split()[1]) >= 1
            raise RuntimeError("/metrics has no rc_controller_long_polls_parked")

        self._wait(parked, limit=5.0, step=0.001)


# -- 1, 2: latency ------------------------------------------------------------------


DATE = ["date", "+%s.%N"]


def raw_spawn_to_running() -> float:
    t0 = time.time()
    out = subprocess.run(DATE, stdout=subprocess.PIPE, env=ENV, check=True).stdout
    return float(out) - t0


def latency(system: System, n: int) -> dict[str, Any]:
    """Submit -> running and -> finished for ``n`` jobs, each submitted to an idle device
    (the worker's long poll parked, as a user submitting to an idle fleet finds it), and
    for ``n`` more each submitted the moment the previous one ended, racing the worker's
    next poll (its finish acknowledged, the device offered again: about 2.5 ms)."""
    out: dict[str, Any] = {}
    raw: list[float] = []
    for mode in ("idle", "after_finish"):
        running: list[float] = []
        finished: list[float] = []
        for _ in range(n):
            raw.append(raw_spawn_to_running())
            if mode == "idle":
                system.wait_for_parked_poll()
            t0 = time.time()
            job_id = system.submit(DATE)
            date = system.follow(job_id)
            finished.append(time.time() - t0)
            running.append(float(date) - t0)
        key = "" if mode == "idle" else "after_finish_"
        out[f"{key}running_p50_ms"] = statistics.median(running) * 1000
        out[f"{key}running_p99_ms"] = pct(running, 0.99) * 1000
        out[f"{key}finished_p50_ms"] = statistics.median(finished) * 1000
        out[f"{key}finished_p99_ms"] = pct(finished, 0.99) * 1000
    out["raw_p50_ms"] = statistics.median(raw) * 1000
    return out


# -- 3, 4: throughput ---------------------------------------------------------------


@contextlib.contextmanager
def echo_server() -> Iterator[int]:
    """A loopback TCP echo server in a thread (one connection per client)."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(16)
    stop = threading.Event()

    def serve(conn: socket.socket) -> None:
        with conn:
            while data := conn.recv(4096):
                conn.sendall(data)

    def accept() -> None:
        while not stop.is_set():
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            threading.Thread(target=serve, args=(conn,), daemon=True).start()

    threading.Thread(target=accept, daemon=True).start()
    try:
        yield listener.getsockname()[1]
    finally:
        stop.set()
        # close() alone leaves the accept thread blocked for good; shutdown wakes it.
        with contextlib.suppress(OSError):
            listener.shutdown(socket.SHUT_RDWR)
        listener.close()


def durability_loop(directory: Path, port: int, n: int) -> None:
    """What one job minimally costs: spawn, two fsynced writes, two round trips."""
    with socket.create_connection(("127.0.0.1", port)) as conn:
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        for i in range(n):
            subprocess.run(["true"], env=ENV, check=True)
            for name in ("journal", "finish"):
                fd = os.open(directory / f"{name}.{i}", os.O_WRONLY | os.O_CREAT, 0o600)
                os.write(fd, b'{"job_id": "j"}')
                os.fsync(fd)
                os.close(fd)
            for _ in range(2):
                conn.sendall(b"x" * 200)
                got = 0
                while got < 200:
                    got += len(conn.recv(4096))


def raw_rate(tmp: Path, loops: int, n: int) -> float:
    dirs = []
    for k in range(loops):
        d = tmp / f"raw{loops}.{k}"
        d.mkdir(exist_ok=True)
        dirs.append(d)
    with echo_server() as port:
        threads = [threading.Thread(target=durability_loop, args=(d, port, n)) for d in dirs]
        t0 = time.monotonic()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return loops * n / (time.monotonic() - t0)


def system_rate(system: System, n: int) -> dict[str, float]:
    """Jobs/s for ``n`` jobs submitted at once, and the CPU each process spent per job."""
    assert system.worker is not None
    assert system.serve is not None
    w0, c0 = cpu_seconds(system.worker.pid), cpu_seconds(system.serve.pid)
    t0 = time.monotonic()
    ids = [system.submit(["true"]) for _ in range(n)]
    for job_id in ids:
        system.follow(job_id)
    elapsed = time.monotonic() - t0
    bad = [j for j in ids if system.state(j) != "succeeded"]
    if bad:
        raise RuntimeError(f"jobs did not succeed: {bad[:5]}")
    return {
        "rate": n / elapsed,
        "worker_cpu_ms_per_job": 1000 * (cpu_seconds(system.worker.pid) - w0) / n,
        "controller_cpu_ms_per_job": 1000 * (cpu_seconds(system.serve.pid) - c0) / n,
    }


# -- 5: output ------------------------------------------------------------------------


def raw_pipe(tmp: Path, size: int) -> float:
    target = tmp / "raw-output"
    t0 = time.monotonic()
    head = subprocess.Popen(["head", "-c", str(size), "/dev/zero"], stdout=subprocess.PIPE)
    assert head.stdout is not None
    fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        while data := os.read(head.stdout.fileno(), 65536):
            os.write(fd, data)
    finally:
        os.close(fd)
    head.wait()
    elapsed = time.monotonic() - t0
    target.unlink()
    return size / elapsed


def commit_rate(system: System, size: int) -> float:
    """Worker -> controller alone: from submit until the controller holds every byte."""
    t0 = time.monotonic()
    job_id = system.submit(["head", "-c", str(size), "/dev/zero"])
    while True:
        info = system.http.get(f"/v1/jobs/{job_id}").json()
        if info.get("committed_bytes") == size:
            return size / (time.monotonic() - t0)
        if info["state"] not in ("queued", "assigned", "running", "succeeded"):
            raise RuntimeError(f"output job ended {info['state']}")
        time.sleep(0.01)


def output(system: System, size: int) -> dict[str, Any]:
    assert system.worker is not None
    assert system.serve is not None
    target = system.tmp / "logs-output"
    w_before = proc_status(system.worker.pid, "VmRSS")
    c_before = proc_status(system.serve.pid, "VmRSS")
    reset_peak(system.worker.pid)
    reset_peak(system.serve.pid)
    w_cpu, c_cpu = cpu_seconds(system.worker.pid), cpu_seconds(system.serve.pid)
    t0 = time.monotonic()
    job_id = system.submit(["head", "-c", str(size), "/dev/zero"])
    with open(target, "wb") as out:
        logs = subprocess.Popen(
            [str(BIN / "rc"), "logs", "-f", job_id, "--url", system.url, "--token", USER_TOKEN],
            stdout=out,
        )
        _, status, usage = os.wait4(logs.pid, 0)
        logs.returncode = os.waitstatus_to_exitcode(status)
    elapsed = time.monotonic() - t0
    gib = size / float(1 << 30)
    w_cpu = (cpu_seconds(system.worker.pid) - w_cpu) / gib
    c_cpu = (cpu_seconds(system.serve.pid) - c_cpu) / gib
    logs_cpu = (usage.ru_utime + usage.ru_stime) / gib
    got = target.stat().st_size
    target.unlink()
    if got != size:
        raise RuntimeError(f"rc logs -f printed {got} bytes, expected {size}")
    return {
        "rate": size / elapsed,
        "worker_rss_growth_mib": proc_status(system.worker.pid, "VmHWM") - w_before,
        "controller_rss_growth_mib": proc_status(system.serve.pid, "VmHWM") - c_before,
        "rc_logs_peak_mib": usage.ru_maxrss / 1024,
        "cpu_s_per_gib": {"worker": w_cpu, "controller": c_cpu, "rc_logs": logs_cpu},
    }


# -- 6: idle -------------------------------------------------------------------------


def idle(system: System, seconds: float) -> dict[str, Any]:
    assert system.worker is not None
    pid = system.worker.pid
    c0, t0 = cpu_seconds(pid), time.monotonic()
    time.sleep(seconds)
    share = (cpu_seconds(pid) - c0) / (time.monotonic() - t0)
    bare = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import trio, httpx, rc_worker.worker, rc_worker.cli, time; time.sleep(30)",
        ]
    )
    try:
        time.sleep(min(seconds, 3.0))
        bare_rss = proc_status(bare.pid, "VmRSS")
    finally:
        bare.kill()
        bare.wait()
    return {
        "cpu_pct": 100 * share,
        "rss_mib": proc_status(pid, "VmRSS"),
        "bare_rss_mib": bare_rss,
    }


# -- main -----------------------------------------------------------------------------


def _print_latency(lat: dict[str, Any]) -> None:
    print(
        f"submit -> running: p50 {lat['running_p50_ms']:.1f} ms, p99 {lat['running_p99_ms']:.1f} ms"
        f" (raw spawn -> running p50 {lat['raw_p50_ms']:.1f} ms;"
        " target p50 <= raw + 10 ms, p99 <= 50 ms)"
    )
    print(
        f"submit -> finished: p50 {lat['finished_p50_ms']:.1f} ms,"
        f" p99 {lat['finished_p99_ms']:.1f} ms (target p99 <= 100 ms)"
    )
    print(
        "  submitted as the previous job ended (racing the worker's next poll):"
        f" running p50 {lat['after_finish_running_p50_ms']:.1f} ms,"
        f" p99 {lat['after_finish_running_p99_ms']:.1f} ms;"
        f" finished p50 {lat['after_finish_finished_p50_ms']:.1f} ms,"
        f" p99 {lat['after_finish_finished_p99_ms']:.1f} ms"
    )


def _print_rates(results: dict[str, Any]) -> None:
    r1, r8 = results["rate_1"]["rate"], results["rate_8"]["rate"]
    print(
        f"back-to-back, 1 device: {r1:.1f} jobs/s vs raw loop {results['raw_rate_1']:.1f}/s"
        f" = {r1 / results['raw_rate_1']:.2f}x (target >= 0.5x)"
    )
    print(
        f"back-to-back, 8 devices: {r8:.1f} jobs/s vs 8 raw loops {results['raw_rate_8']:.1f}/s"
        f" = {r8 / results['raw_rate_8']:.2f}x (target >= 0.5x); {r8 / r1:.1f}x one device"
        " (target >= 4x)"
    )
    for k in ("rate_1", "rate_8"):
        r = results[k]
        print(
            f"  CPU per job ({k[-1]} device(s)): worker {r['worker_cpu_ms_per_job']:.1f} ms,"
            f" controller {r['controller_cpu_ms_per_job']:.1f} ms"
        )


def _print_output(results: dict[str, Any]) -> None:
    out = results["output"]
    gib = float(1 << 30)
    raw_pipe_rate = statistics.mean([results["raw_pipe"], results["raw_pipe_2"]])
    print(
        f"output via rc logs -f: {out['rate'] / gib:.3f} GiB/s vs raw pipe"
        f" {raw_pipe_rate / gib:.3f} GiB/s = {out['rate'] / raw_pipe_rate:.3f}x"
        " (target >= 0.3x)"
    )
    print(
        f"  worker -> controller alone (committed): {results['commit_rate'] / gib:.3f} GiB/s"
        f" = {results['commit_rate'] / raw_pipe_rate:.3f}x raw pipe"
    )
    print(
        f"  RSS growth: worker {out['worker_rss_growth_mib']:.1f} MiB,"
        f" controller {out['controller_rss_growth_mib']:.1f} MiB (target < 64 MiB each);"
        f" rc logs peak {out['rc_logs_peak_mib']:.1f} MiB"
    )
    cpu = out["cpu_s_per_gib"]
    print(
        f"  CPU per GiB: worker {cpu['worker']:.2f} s, controller {cpu['controller']:.2f} s,"
        f" rc logs {cpu['rc_logs']:.2f} s"
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--jobs", type=int, default=40, help="jobs per phase (default 40)")
    parser.add_argument(
        "--bytes", type=int, default=256 << 20, help="output size (default 256 MiB)"
    )
    parser.add_argument("--idle", type=float, default=5.0, help="idle seconds (default 5)")
    parser.add_argument(
        "--store",
        choices=("sqlite", "memory"),
        default="sqlite",
        help="the controller's store (default sqlite, as an operator runs it)",
    )
    parser.add_argument(
        "--phases",
        default="latency,rate,idle,output",
        help="comma-separated subset of latency,rate,idle,output (default all)",
    )
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    phases = set(args.phases.split(","))
    if not phases <= {"latency", "rate", "idle", "output"}:
        parser.error(f"--phases: unknown phase in {args.phases!r}")
    load = os.getloadavg()[0]
    results: dict[str, Any] = {"load_before": load, "store": args.store}
    with tempfile.TemporaryDirectory(prefix="rc-bench-") as name:
        tmp = Path(name)
        if phases & {"latency", "rate"}:
            with System(tmp, 1, args.store) as one:
                if "latency" in phases:
                    results["latency"] = latency(one, max(10, args.jobs // 2))
                if "rate" in phases:
                    results["raw_rate_1"] = raw_rate(tmp, 1, args.jobs)
                    results["rate_1"] = system_rate(one, args.jobs)
        with System(tmp, 8, args.store) as eight:
            if "idle" in phases:
                results["idle"] = idle(eight, args.idle)
            if "rate" in phases:
                results["raw_rate_8"] = raw_rate(tmp, 8, args.jobs)
                results["rate_8"] = system_rate(eight, 8 * args.jobs)
            if "output" in phases:
                results["raw_pipe"] = raw_pipe(tmp, args.bytes)
                results["output"] = output(eight, args.bytes)
                results["commit_rate"] = commit_rate(eight, args.bytes)
                results["raw_pipe_2"] = raw_pipe(tmp, args.bytes)
    results["load_after"] = os.getloadavg()[0]
    if args.json:
        print(json.dumps(results, indent=2))
        return 0
    print(
        f"store {results['store']}; load average {results['load_before']:.2f} before,"
        f" {results['load_after']:.2f} after"
    )
    if "latency" in results:
        _print_latency(results["latency"])
    if "rate_1" in results:
        _print_rates(results)
    if "output" in results:
        _print_output(results)
    if "idle" in results:
        idl = results["idle"]
        print(
            f"idle, 8 devices: {idl['cpu_pct']:.3f}% of a core, {idl['rss_mib']:.1f} MiB"
            f" (bare interpreter with the same imports {idl['bare_rss_mib']:.1f} MiB;"
            " target < 0.5%, < 80 MiB)"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
