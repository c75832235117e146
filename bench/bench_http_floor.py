"""Benchmark: what the HTTP stack alone costs, and the ceilings that puts on the hot path.

The hot path's ratio targets (``bench_hotpath.py``) compare real ``rc serve`` and
``rc-worker run`` with raw loops that speak no HTTP. This measures the floor under
any design built on the stack the project uses (hypercorn + starlette serving,
httpx calling, both on Trio): a handler that does nothing, and a client that keeps
nothing, with the controller's own connection handling (``rc_worker.controller.serve``
installs it) and the ``rc`` command's read size. No state, no store, no fsync, no
job: whatever the controller and worker do beyond this only adds to it.

1. **One request**: sequential small JSON POSTs over one keep-alive connection, the
   wall time and each side's CPU per request, interleaved with the raw loop of
   ``bench_hotpath.py`` (spawn ``true``, two write+fsync, two loopback round
   trips), 1 loop and 8. Eight run as threads (as ``bench_hotpath.py`` runs them)
   and as processes (no shared GIL), each round in new directories.
2. **Ceilings for one device**: a job on one device is serial: at least the raw
   loop's spawn and fsyncs, plus ``k`` requests on its critical path (today
   ``start``, ``finish`` and the next ``poll``: 3; a ``finish`` whose answer carries
   the next job would make 2). The ceiling is the raw loop's time per job over
   (its time less its two raw round trips, plus ``k`` bare requests). For eight
   devices, which share the cores, a job costs at least the raw loop's CPU a job
   plus its ``k`` requests' CPU on both sides: the ceiling is the cores over that,
   against the faster of the two eight-loop figures. Both are printed again for a
   server that costs nothing: httpx's own CPU a request, which any server would
   leave, bounds them by itself.
3. **Output**: 1 GiB (``--bytes``) streamed up to a server that drops it, and
   streamed down from a server to a client that drops it, each side's CPU per
   GiB, against ``head -c`` through a pipe into a file. Worker → controller →
   ``rc logs -f`` passes every byte through both, so on ``os.cpu_count()`` cores
   the rate can be at most cores / (the four sides' CPU per GiB), with perfect
   overlap and nothing else to do. Counting also the job's pipe (``head -c``
   writing, a 64 KiB reader) and the files durability needs (the worker's spool
   written and read back, the controller's store written and read back for the
   follower, the file ``rc logs`` writes, as the raw pipe's reader does),
   measured as plain writes and reads of the same size, the ceiling is lower again.

    python bench/bench_http_floor.py [--requests N] [--jobs N] [--bytes SIZE] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import trio
from bench_hotpath import cpu_seconds, durability_loop, echo_server, raw_pipe, raw_rate

PIECE = bytes(1 << 20)  # what the client sends and the server streams, 1 MiB at a time
SMALL_PIECE = PIECE[: 64 * 1024]


async def pieces(size: int) -> AsyncIterator[bytes]:
    """``size`` bytes, 1 MiB at a time, from one buffer (nothing to read or copy)."""
    left = size
    while left > 0:
        yield PIECE[: min(left, len(PIECE))]
        left -= len(PIECE)


def per_gib(size: int, wall: float, client_cpu: float, server_cpu: float) -> dict[str, float]:
    gib = size / float(1 << 30)
    return {
        "gib_s": gib / wall,
        "client_cpu_s_per_gib": client_cpu / gib,
        "server_cpu_s_per_gib": server_cpu / gib,
    }


# -- the server, run as ``bench_http_floor.py --serve PORT [--down BYTES]`` ---------------


def serve(port: int) -> None:
    """hypercorn with the controller's connection handling, three do-nothing routes."""
    from hypercorn.config import Config
    from hypercorn.trio import serve as hypercorn_serve
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import JSONResponse, StreamingResponse
    from starlette.routing import Route

    import rc_worker.controller.serve as controller_serve

    if controller_serve.CONNECTION_FIXES_OFF is not None:
        print(f"note: {controller_serve.CONNECTION_FIXES_OFF}", file=sys.stderr)

    async def call(request: Request) -> JSONResponse:
        await request.body()
        return JSONResponse({"ok": True})

    async def upload(request: Request) -> JSONResponse:
        got = 0
        async for piece in request.stream():
            got += len(piece)
        return JSONResponse({"received": got})

    async def download(request: Request) -> StreamingResponse:
        size = int(request.query_params["bytes"])
        return StreamingResponse(pieces(size), media_type="application/octet-stream")

    app = Starlette(
        routes=[
            Route("/call", call, methods=["POST"]),
            Route("/upload", upload, methods=["POST"]),
            Route("/download", download, methods=["GET"]),
        ]
    )
    config = Config()
    config.bind = [f"127.0.0.1:{port}"]
    config.accesslog = None
    config.errorlog = None
    trio.run(hypercorn_serve, app, config)  # type: ignore[arg-type]


# -- the measurements ---------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def own_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


async def requests(url: str, server_pid: int, n: int) -> dict[str, float]:
    async with httpx.AsyncClient(base_url=url) as client:
        for _ in range(10):  # warm the connection
            (await client.post("/call", json={"warm": True})).raise_for_status()
        s0, c0, t0 = cpu_seconds(server_pid), own_cpu(), time.monotonic()
        for _ in range(n):
            r = await client.post("/call", json={"session": "s", "job": "j", "attempt": 1})
            r.raise_for_status()
            r.json()
        wall = time.monotonic() - t0
        return {
            "wall_ms": 1000 * wall / n,
            "client_cpu_ms": 1000 * (own_cpu() - c0) / n,
            "server_cpu_ms": 1000 * (cpu_seconds(server_pid) - s0) / n,
        }


async def upload(url: str, server_pid: int, size: int) -> dict[str, float]:
    async with httpx.AsyncClient(base_url=url, timeout=300) as client:
        s0, c0, t0 = cpu_seconds(server_pid), own_cpu(), time.monotonic()
        r = await client.post("/upload", content=pieces(size))
        wall = time.monotonic() - t0
        if r.json()["received"] != size:
            raise RuntimeError(f"the server received {r.json()['received']} of {size}")
    return per_gib(size, wall, own_cpu() - c0, cpu_seconds(server_pid) - s0)


async def download(url: str, server_pid: int, size: int) -> dict[str, float]:
    from rc_worker.controller.rc_follow import read_up_to_a_mebibyte

    read_up_to_a_mebibyte()  # as the rc command reads
    async with httpx.AsyncClient(base_url=url, timeout=300) as client:
        s0, c0, t0 = cpu_seconds(server_pid), own_cpu(), time.monotonic()
        got = 0
        async with client.stream("GET", "/download", params={"bytes": size}) as r:
            async for piece in r.aiter_raw():
                got += len(piece)
        wall = time.monotonic() - t0
        if got != size:
            raise RuntimeError(f"the client received {got} of {size}")
    return per_gib(size, wall, own_cpu() - c0, cpu_seconds(server_pid) - s0)


async def wait_ready(url: str) -> None:
    async with httpx.AsyncClient(base_url=url) as client:
        for _ in range(400):  # 20 s at most
            try:
                await client.post("/call", json={})
                return
            except httpx.TransportError:
                await trio.sleep(0.05)
    raise RuntimeError(f"the floor server at {url} did not come up")


def ceiling(raw_per_job_ms: float, raw_rtt_ms: float, http_ms: float, k: int) -> float:
    """The best ratio to the raw loop one device could reach with ``k`` requests a job."""
    floor = raw_per_job_ms - 2 * raw_rtt_ms + k * http_ms
    return raw_per_job_ms / floor


def write_file(path: Path, size: int) -> float:
    """CPU seconds to write ``size`` bytes to a new file, 64 KiB at a time (no fsync).

    64 KiB as the raw pipe's reader writes: into new pages, larger writes cost more a
    byte on the development VM (1 MiB ones four times as much), so they would
    overstate the floor.
    """
    c0 = own_cpu()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        left = size
        while left > 0:
            left -= os.write(fd, SMALL_PIECE[: min(left, len(SMALL_PIECE))])
    finally:
        os.close(fd)
    return own_cpu() - c0


def file_costs(tmp: Path, size: int) -> dict[str, float]:
    """CPU per GiB to write a new file and to read it back."""
    gib = size / float(1 << 30)
    path = tmp / "floor-file"
    written = write_file(path, size)
    c0 = own_cpu()
    fd = os.open(path, os.O_RDONLY)
    try:
        while os.read(fd, len(PIECE)):
            pass
    finally:
        os.close(fd)
    read = own_cpu() - c0
    path.unlink()
    return {"write_cpu_s_per_gib": written / gib, "read_cpu_s_per_gib": read / gib}


def pipe_costs(size: int) -> float:
    """CPU per GiB of a job's pipe: ``head -c`` writing into it and a 64 KiB reader.

    The worker reads each job's output from a pipe as the raw baseline's reader does,
    so both ends count towards any design's output floor.
    """
    c0 = own_cpu()
    head = subprocess.Popen(["head", "-c", str(size), "/dev/zero"], stdout=subprocess.PIPE)
    assert head.stdout is not None
    while os.read(head.stdout.fileno(), 65536):
        pass
    head.stdout.close()
    _, status, usage = os.wait4(head.pid, 0)  # wait4: head's own CPU
    head.returncode = os.waitstatus_to_exitcode(status)
    if head.returncode != 0:
        raise RuntimeError(f"head -c {size} exited {head.returncode}")
    reader = own_cpu() - c0
    return (reader + usage.ru_utime + usage.ru_stime) / (size / float(1 << 30))


def raw_round_trip_ms(n: int = 2000) -> float:
    """One 200-byte round trip over loopback TCP to an echo thread, as the raw loop has."""
    with echo_server() as port, socket.create_connection(("127.0.0.1", port)) as conn:
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        t0 = time.monotonic()
        for _ in range(n):
            conn.sendall(b"x" * 200)
            got = 0
            while got < 200:
                got += len(conn.recv(4096))
        return 1000 * (time.monotonic() - t0) / n


def raw_loop_process(directory: str, n: int) -> None:
    """One raw loop in this process, with its own echo thread (``--raw-loop``): it says
    ``ready`` once started, and runs when a line arrives on its stdin."""
    with echo_server() as port:
        print("ready", flush=True)
        sys.stdin.readline()
        durability_loop(Path(directory), port, n)


def raw_rate_processes(tmp: Path, loops: int, n: int) -> float:
    """The raw loop of bench_hotpath.py, ``loops`` of them as processes (no shared GIL),
    timed from a common start once every interpreter is up."""
    procs = []
    try:
        for k in range(loops):
            d = tmp / f"proc{loops}.{k}"
            d.mkdir()
            procs.append(
                subprocess.Popen(
                    [sys.executable, __file__, "--raw-loop", str(d), str(n)],
                    stdin=subprocess.PIPE,
                    stdout=subprocess.PIPE,
                    text=True,
                )
            )
        for p in procs:
            assert p.stdout is not None
            if p.stdout.readline().strip() != "ready":
                raise RuntimeError("a raw loop process did not start")
        t0 = time.monotonic()
        for p in procs:
            assert p.stdin is not None
            p.stdin.write("go\n")
            p.stdin.close()
        failed = [p.args for p in procs if p.wait() != 0]
        elapsed = time.monotonic() - t0
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    if failed:
        raise RuntimeError(f"raw loops failed: {failed}")
    return loops * n / elapsed


def raw_cpu_ms(tmp: Path, loops: int, n: int) -> tuple[float, float]:
    """bench_hotpath.py's raw loops in threads: their rate, and the CPU a job took (this
    process's and its children's, ``true`` included)."""

    def both() -> float:
        me = resource.getrusage(resource.RUSAGE_SELF)
        kids = resource.getrusage(resource.RUSAGE_CHILDREN)
        return me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime

    c0 = both()
    rate = raw_rate(tmp, loops, n)
    return rate, 1000 * (both() - c0) / (loops * n)


def measure(args: argparse.Namespace) -> dict[str, Any]:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    server = subprocess.Popen([sys.executable, __file__, "--serve", str(port)])
    results: dict[str, Any] = {"load_before": os.getloadavg()[0], "cores": os.cpu_count()}
    try:
        trio.run(wait_ready, url)
        with tempfile.TemporaryDirectory(prefix="rc-bench-floor-") as name:
            tmp = Path(name)
            runs = []
            for k in range(3):  # interleaved: raw, HTTP, raw, HTTP, ...
                # New directories each round: the raw loops' files are created, as a
                # job's are, never overwritten.
                round_dir = tmp / f"round{k}"
                round_dir.mkdir()
                raw_8, raw_8_cpu_ms = raw_cpu_ms(round_dir, 8, args.jobs)
                run = {
                    "raw_1": raw_rate(round_dir, 1, args.jobs),
                    "raw_8": raw_8,
                    "raw_cpu_ms": raw_8_cpu_ms,
                    "raw_1_process": raw_rate_processes(round_dir, 1, args.jobs),
                    "raw_8_processes": raw_rate_processes(round_dir, 8, args.jobs),
                    "raw_rtt_ms": raw_round_trip_ms(),
                }
                run.update(trio.run(requests, url, server.pid, args.requests))
                runs.append(run)
            results["requests"] = runs
            results["raw_pipe_1"] = raw_pipe(tmp, args.bytes)
            results["upload"] = trio.run(upload, url, server.pid, args.bytes)
            results["download"] = trio.run(download, url, server.pid, args.bytes)
            results["files"] = file_costs(tmp, args.bytes)
            results["pipe_cpu_s_per_gib"] = pipe_costs(args.bytes)
            results["raw_pipe_2"] = raw_pipe(tmp, args.bytes)
    finally:
        server.kill()
        server.wait()
    results["load_after"] = os.getloadavg()[0]
    return results


def report(results: dict[str, Any]) -> None:
    print(
        f"load average {results['load_before']:.2f} before, {results['load_after']:.2f} after;"
        f" {results['cores']} cores"
    )
    print("one bare request (hypercorn + starlette, httpx, keep-alive, 127.0.0.1):")
    for run in results["requests"]:
        per_job = 1000 / run["raw_1"]
        print(
            f"  {run['wall_ms']:.3f} ms wall, CPU client {run['client_cpu_ms']:.3f} ms +"
            f" server {run['server_cpu_ms']:.3f} ms; raw round trip {run['raw_rtt_ms']:.3f} ms"
        )
        print(
            f"    raw loop {run['raw_1']:.0f} jobs/s ({per_job:.3f} ms a job; as a process"
            f" {run['raw_1_process']:.0f}/s); 8 raw loops {run['raw_8']:.0f}/s in threads"
            f" ({run['raw_8'] / run['raw_1']:.2f}x one), {run['raw_8_processes']:.0f}/s as"
            f" processes ({run['raw_8_processes'] / run['raw_1']:.2f}x one)"
        )
        marks = ", ".join(
            f"k={k}: {ceiling(per_job, run['raw_rtt_ms'], run['wall_ms'], k):.2f}x"
            for k in (3, 2, 1)
        )
        print(f"    ceiling for 1 device with k bare requests a job: {marks} (target 0.5x)")
        # The same with a server that costs nothing (hypercorn replaced by anything):
        # httpx, the client the project is built on, still spends its CPU on each
        # request, serially on the job's critical path.
        marks_free = ", ".join(
            f"k={k}: {ceiling(per_job, run['raw_rtt_ms'], run['client_cpu_ms'], k):.2f}x"
            for k in (3, 2, 1)
        )
        print(f"      with a server that costs nothing, the client alone: {marks_free}")
        # Eight devices share the cores: each job costs at least a raw job's CPU plus
        # its k requests' (both sides), so the rate is at most cores / that.
        request_cpu = run["client_cpu_ms"] + run["server_cpu_ms"]
        marks8 = ", ".join(
            f"k={k}: {results['cores'] * 1000 / (run['raw_cpu_ms'] + k * request_cpu) / best:.2f}x"
            for k in (3, 2, 1)
            for best in [max(run["raw_8"], run["raw_8_processes"])]
        )
        print(
            f"    a raw job's CPU {run['raw_cpu_ms']:.3f} ms; ceiling for 8 devices on"
            f" {results['cores']} cores with k bare requests a job: {marks8} of the faster 8 raw"
            " loops (target 0.5x)"
        )
        best8 = max(run["raw_8"], run["raw_8_processes"])
        cores = results["cores"]
        marks8_free = ", ".join(
            f"k={k}: {cores * 1000 / (run['raw_cpu_ms'] + k * run['client_cpu_ms']) / best8:.2f}x"
            for k in (3, 2, 1)
        )
        print(f"      with a server that costs nothing, the client alone: {marks8_free}")
        need = 2 * run["raw_1"]
        print(
            f"    8 devices at >= 4x one device and one device at >= 0.5x need {need:.0f} jobs/s;"
            f" 8 raw loops reached {best8:.0f}/s ({best8 / need:.2f}x that)"
        )
    raw = (results["raw_pipe_1"] + results["raw_pipe_2"]) / 2 / float(1 << 30)
    up, down = results["upload"], results["download"]
    sides = (
        up["client_cpu_s_per_gib"]
        + up["server_cpu_s_per_gib"]
        + down["client_cpu_s_per_gib"]
        + down["server_cpu_s_per_gib"]
    )
    best = results["cores"] / sides
    print(
        f"output: raw pipe {raw:.3f} GiB/s; bare upload {up['gib_s']:.3f} GiB/s (CPU client"
        f" {up['client_cpu_s_per_gib']:.2f} s/GiB, server {up['server_cpu_s_per_gib']:.2f});"
        f" bare download {down['gib_s']:.3f} GiB/s (CPU server"
        f" {down['server_cpu_s_per_gib']:.2f} s/GiB, client {down['client_cpu_s_per_gib']:.2f})"
    )
    print(
        f"  the four sides: {sides:.2f} CPU s/GiB; on {results['cores']} cores at most"
        f" {best:.3f} GiB/s = {best / raw:.2f}x the raw pipe (target 0.3x)"
    )
    files, pipe = results["files"], results["pipe_cpu_s_per_gib"]
    # The job writes into a pipe the worker reads; the worker spools every byte and reads
    # it back, the controller appends it to its store and reads it back for the follower,
    # rc logs writes it out (as the raw pipe's reader does).
    durable = sides + pipe + 3 * files["write_cpu_s_per_gib"] + 2 * files["read_cpu_s_per_gib"]
    best = results["cores"] / durable
    print(
        f"  the job's pipe (both ends) {pipe:.2f} CPU s/GiB; a file write"
        f" {files['write_cpu_s_per_gib']:.2f}, a read back {files['read_cpu_s_per_gib']:.2f}"
    )
    print(
        f"  with the pipe, the worker's spool, the controller's store and rc logs' file:"
        f" {durable:.2f} CPU s/GiB, at most {best:.3f} GiB/s = {best / raw:.2f}x the raw pipe"
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--serve", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--raw-loop", nargs=2, help=argparse.SUPPRESS)
    parser.add_argument("--requests", type=int, default=2000, help="requests a run (2000)")
    parser.add_argument("--jobs", type=int, default=200, help="raw loop jobs a run (200)")
    parser.add_argument(
        "--bytes", type=int, default=1 << 30, help="output size each way (default 1 GiB)"
    )
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    if args.serve is not None:
        serve(args.serve)
        return 0
    if args.raw_loop is not None:
        raw_loop_process(args.raw_loop[0], int(args.raw_loop[1]))
        return 0
    results = measure(args)
    if args.json:
        print(json.dumps(results, indent=2))
    else:
        report(results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
