"""The controller at fleet scale: a synthetic swarm of workers against a real ``rc serve``.

One process holds every host's connections on 127.0.0.1 (trio, HTTP/1.1 by hand): N hosts
with 8 devices each register, heartbeat at the interval the controller tells
them, and keep a long poll parked for their free devices, as ``rc-worker``
does (labels are sent at register only: an unchanged probe pass sends nothing).
A job the swarm is offered is started, sent one output chunk and finished at
once. For each fleet size it measures, from ``/proc/<pid>/stat`` of the
controller process:

- idle: the controller's CPU (share of one core) while the fleet only heartbeats
  and long-polls (target at 1,000 hosts: under 25 %);
- the controller CPU of one submit that matches nothing, one ``clear`` of a
  quarantined device, and one output chunk, each the mean of ``--ops`` done one
  after another, net of the idle rate (the issue's target: at most linear in the
  number of hosts; the ratio to the smallest fleet of the same run is printed);
- dispatch: ``--rate`` jobs per second submitted for ``--load-s`` seconds, and the
  controller CPU per job (its whole cycle: submit, offer, start, output, finish); latency
  from just before the submit to the worker's ``start`` being answered, p50 and
  p99 (targets 20 ms and 100 ms at 1,000 hosts), and how many hosts the
  controller declared lost meanwhile (target: none).

Bounded (every phase has a deadline, the whole run too) and clean: the
controller is killed and its state directory removed even on failure.

Under each load figure, a second line says where the latency went: each stage's p50 and
p99 (``submit`` answered, the job in a poll's reply, ``start`` answered), the share of the
load phase the controller and the swarm spent runnable but waiting for a core (the machine
is shared: a tail there is the run queue, not the controller), and how late the swarm's
own event loop ran at worst (that lateness is counted as the controller's). ``--trace
FILE`` writes every job's stage times for a closer look. ``$RC_SWARM_RC`` replaces the
``rc`` command line (say, ``py-spy record -o prof.svg -- rc``) to profile the controller.

    python bench/bench_swarm.py [--hosts 10,100,1000,2000] [--store memory|sqlite|postgres|both]
                                [--idle-s 15] [--load-s 10] [--rate 100] [--ops 200]
                                [--trace FILE]
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import math
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import zlib
from collections.abc import AsyncIterator, Iterator, Sequence
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import attrs
import trio

RC = str(Path(sys.executable).parent / "rc")
WORKER_TOKEN = "swarm-worker"
USER_TOKEN = "swarm-user"
DEVICES = 8
RUN_LIMIT_S = 3600.0
"""The whole run stops by itself after this long, whatever it was asked."""
CLK_TCK = os.sysconf("SC_CLK_TCK")
CONNECT_TRIES = 8
LOOP_PROBE_S = 0.005
TRANSPORT_ERRORS = (OSError, trio.BrokenResourceError, trio.ClosedResourceError, EOFError)


def schedstat(pid: int) -> tuple[float, float]:
    """Seconds process ``pid``'s main thread has run, and has waited to run (runnable, but
    every core busy), from ``/proc/<pid>/schedstat``."""
    with open(f"/proc/{pid}/schedstat") as f:
        ran, waited = f.read().split()[:2]
    return int(ran) / 1e9, int(waited) / 1e9


def cpu_seconds(pid: int) -> float:
    """User + system CPU of process ``pid`` so far."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


@asynccontextmanager
async def rc_serve(store: str, state_dir: Path) -> AsyncIterator[tuple[trio.Process, str]]:
    """A real ``rc serve`` on a free port; killed (and waited for) on the way out.

    ``store``: ``memory``, ``sqlite`` (in ``state_dir``) or a ``postgresql://`` URI.
    """
    if store == "memory":
        where = ["--memory"]
    elif store.startswith("postgresql://"):
        where = ["--db", store]
    else:
        where = ["--state-dir", str(state_dir)]
    rc = os.environ.get("RC_SWARM_RC", RC).split()  # a profiler's command line, say
    proc = await trio.lowlevel.open_process(
        [
            *rc,
            "serve",
            "--listen",
            "127.0.0.1:0",
            "--worker-token",
            WORKER_TOKEN,
            "--user-token",
            f"{USER_TOKEN}=bench:admin",
            *where,
        ],
        stderr=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
    )
    try:
        assert proc.stderr is not None
        said = b""
        with trio.fail_after(30):
            while b"listening on " not in said or not said.endswith(b"\n"):
                chunk = await proc.stderr.receive_some(4096)
                if not chunk:
                    raise RuntimeError(f"rc serve ended before listening: {said.decode()!r}")
                said += chunk
        url = said.split(b"listening on ", 1)[1].split()[0].decode().rstrip(",")

        async def drain() -> None:  # keep its stderr from filling the pipe
            assert proc.stderr is not None
            while await proc.stderr.receive_some(65536):
                pass

        async with trio.open_nursery() as nursery:
            nursery.start_soon(drain)
            yield proc, url
            nursery.cancel_scope.cancel()
    finally:
        if proc.returncode is None:
            proc.send_signal(signal.SIGKILL)
        with trio.move_on_after(10, shield=True):
            await proc.wait()


class Conn:
    """One keep-alive HTTP/1.1 connection, spoken by hand: an httpx request costs the swarm
    about a millisecond of CPU, and at 100 jobs/s the swarm must not be what is measured."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.stream: trio.SocketStream | None = None
        self.buf = bytearray()

    async def request(self, method: str, target: str, body: bytes, headers: bytes) -> Reply:
        head = (
            f"{method} {target} HTTP/1.1\r\nHost: rc\r\nContent-Length: {len(body)}\r\n"
        ).encode()
        for attempt in range(1, CONNECT_TRIES + 1):
            try:
                if self.stream is None:
                    self.stream = await trio.open_tcp_stream("127.0.0.1", self.port)
                    self.buf.clear()
                await self.stream.send_all(head + headers + b"\r\n" + body)
                return await self._response()
            except (OSError, trio.BrokenResourceError, trio.ClosedResourceError, EOFError):
                # An idle keep-alive connection the server closed, or a connection reset
                # while a thousand others opened at once (the listen backlog): again, on a
                # new connection, after a pause. Every request of the swarm is idempotent.
                await self.close()
                if attempt == CONNECT_TRIES:
                    raise
                await trio.sleep(min(2.0, 0.05 * 2**attempt))
        raise AssertionError("unreachable")

    async def _fill(self) -> None:
        assert self.stream is not None
        chunk = await self.stream.receive_some(65536)
        if not chunk:
            raise EOFError
        self.buf += chunk

    async def _response(self) -> Reply:
        while (end := self.buf.find(b"\r\n\r\n")) < 0:
            await self._fill()
        lines = bytes(self.buf[:end]).split(b"\r\n")
        del self.buf[: end + 4]
        status = int(lines[0].split()[1])
        length = 0
        chunked = False
        for line in lines[1:]:
            name, _, value = line.partition(b":")
            name = name.strip().lower()
            if name == b"content-length":
                length = int(value)
            elif name == b"transfer-encoding" and b"chunked" in value.lower():
                chunked = True
        if not chunked:
            while len(self.buf) < length:
                await self._fill()
            data = bytes(self.buf[:length])
            del self.buf[:length]
            return Reply(status, data)
        data = b""
        while True:
            while (eol := self.buf.find(b"\r\n")) < 0:
                await self._fill()
            size = int(bytes(self.buf[:eol]).split(b";")[0], 16)
            while len(self.buf) < eol + 2 + size + 2:
                await self._fill()
            data += bytes(self.buf[eol + 2 : eol + 2 + size])
            del self.buf[: eol + 2 + size + 2]
            if size == 0:
                return Reply(status, data)

    async def close(self) -> None:
        if self.stream is not None:
            with contextlib.suppress(Exception):
                await self.stream.aclose()
        self.stream = None


@attrs.frozen
class Reply:
    status: int
    body: bytes

    def json(self) -> Any:
        return json.loads(self.body)


class Client:
    """A pool of :class:`Conn`: one per request in flight, kept for the next."""

    def __init__(self, url: str) -> None:
        self.port = int(url.rsplit(":", 1)[1])
        self.idle: list[Conn] = []
        self.opened: list[Conn] = []

    async def call(
        self, method: str, target: str, token: str, body: bytes = b"", json_body: bool = True
    ) -> Reply:
        conn = self.idle.pop() if self.idle else self._new()
        kind = b"application/json" if json_body else b"application/octet-stream"
        headers = b"Authorization: Bearer " + token.encode() + b"\r\nContent-Type: " + kind
        headers += b"\r\n"
        try:
            reply = await conn.request(method, target, body, headers)
        except BaseException:
            await conn.close()
            raise
        self.idle.append(conn)
        return reply

    def _new(self) -> Conn:
        conn = Conn(self.port)
        self.opened.append(conn)
        return conn

    async def post(self, target: str, token: str, obj: Any) -> Reply:
        return await self.call("POST", target, token, json.dumps(obj).encode())

    async def get(self, target: str, token: str) -> Reply:
        return await self.call("GET", target, token)

    async def aclose(self) -> None:
        for conn in self.opened:
            await conn.close()


class Host:
    """One synthetic worker: registers, heartbeats, long-polls its free devices, runs jobs."""

    def __init__(self, swarm: Swarm, name: str) -> None:
        self.swarm = swarm
        self.name = name
        self.devices = [f"g{i}" for i in range(DEVICES)]
        self.free = set(self.devices)
        self.session = ""
        self.interval = 10.0
        self.listed: set[str] = set()
        self.nursery: trio.Nursery

    async def post(self, path: str, body: dict[str, Any]) -> Reply:
        return await self.swarm.client.post(path, WORKER_TOKEN, body)

    async def register(self) -> None:
        body = {
            "worker_version": "bench",
            "boot_id": f"boot-{self.name}",
            "pid": 1,
            "instance_id": f"i-{self.name}",
            "devices": [
                {"name": d, "declared_labels": {"rack": self.name[-1]}} for d in self.devices
            ],
            "labels": {
                "host": {"mem_total_bytes": "1Ti"},
                "devices": {d: {"product": "H100"} for d in self.devices},
            },
            "sheets": {"host": None, "devices": {}},
            "recovery": [],
            "require_manual_clear": False,
        }
        r = await self.post(f"/v1/hosts/{self.name}/register", body)
        if r.status != 200:
            raise RuntimeError(f"register {self.name}: {r.status} {r.body!r}")
        reply = r.json()
        self.session = reply["session"]
        self.interval = float(reply["heartbeat_interval_s"])

    async def heartbeats(self) -> None:
        # Spread over the interval, as hosts started at different times are.
        await trio.sleep(self.swarm.rng_offset(self.name) * self.interval)
        while True:
            devices = {d: {"state": "idle" if d in self.free else "running"} for d in self.devices}
            try:
                r = await self.post(
                    f"/v1/hosts/{self.name}/heartbeat",
                    {"session": self.session, "devices": devices},
                )
                if r.status in (401, 404, 409):
                    await self.reregister()
                self.swarm.errors += r.status != 200
            except TRANSPORT_ERRORS:
                self.swarm.errors += 1
            await trio.sleep(self.interval)

    def kick(self, nursery: trio.Nursery) -> None:
        """Poll for the free devices no poll in flight lists, as a worker does when a
        device settles (a device is never listed by two polls in flight)."""
        self.nursery = nursery
        nursery.start_soon(self.poll_loop)

    async def poll_loop(self) -> None:
        while True:
            ready = sorted(self.free - self.listed)
            if not ready:
                return  # every free device is in a poll in flight; a finish kicks a new one
            self.listed.update(ready)
            try:
                r = await self.post(
                    f"/v1/hosts/{self.name}/poll",
                    {"session": self.session, "ready": ready, "wait_s": 30},
                )
            except TRANSPORT_ERRORS:
                r = Reply(0, b"")
            finally:
                self.listed.difference_update(ready)
            assignments = r.json().get("assignments", []) if r.status == 200 else []
            if r.status != 200:
                self.swarm.errors += 1
                if r.status in (401, 404, 409):
                    await self.reregister()  # lost meanwhile: register again, as a worker does
                await trio.sleep(1)
            now = time.perf_counter()
            if r.status == 200 and not assignments:
                self.swarm.empty_polls.append(now)  # the long poll's wait ran out
            for a in assignments:
                self.swarm.trace.setdefault(a["job_id"], {})["offer"] = now
                self.free.discard(a["device"])
                self.nursery.start_soon(self.run_job, a)

    async def reregister(self) -> None:
        self.swarm.reregistered += 1
        with contextlib.suppress(*TRANSPORT_ERRORS, RuntimeError):
            await self.register()

    async def run_job(self, a: dict[str, Any]) -> None:
        try:
            await self._run_job(a)
        except TRANSPORT_ERRORS:
            self.swarm.errors += 1
            self.free.add(a["device"])
            self.kick(self.nursery)

    async def _run_job(self, a: dict[str, Any]) -> None:
        job_id = a["job_id"]
        body = {
            "session": self.session,
            "attempt": a["attempt"],
            "device": a["device"],
            "boot_id": f"boot-{self.name}",
        }
        self.swarm.trace.setdefault(job_id, {})["start_sent"] = time.perf_counter()
        r = await self.post(f"/v1/jobs/{job_id}/start", body)
        if r.status != 200:
            # Offered again meanwhile (the controller fell so far behind that the offer timed
            # out, say): as a worker does, run nothing and take the device back.
            self.swarm.stale += 1
            self.free.add(a["device"])
            self.kick(self.nursery)
            return
        self.swarm.started[job_id] = time.perf_counter()
        self.swarm.progress.set()
        self.swarm.progress = trio.Event()
        if a["command"][0] == "hold":
            held = self.swarm.held[job_id] = trio.Event()
            self.swarm.progress.set()
            self.swarm.progress = trio.Event()
            await held.wait()
        else:
            await self.output(a, 0, b"done\n")
        await self.post(
            f"/v1/jobs/{job_id}/finish",
            {
                "session": self.session,
                "attempt": a["attempt"],
                "device": a["device"],
                "outcome": "succeeded",
                "exit_code": 0,
                "killed": False,
                "reason": "",
                "error": None,
                "output_bytes": 5,
                "sweep": {"scanned": True, "found": [], "remaining": [], "blind": False},
                "verify": {"ok": True, "reason": ""},
                "fault_id": None,
            },
        )
        self.free.add(a["device"])
        self.kick(self.nursery)

    async def output(self, a: dict[str, Any], offset: int, data: bytes) -> None:
        target = f"/v1/jobs/{a['job_id']}/output?attempt={a['attempt']}&offset={offset}"
        r = await self.swarm.client.call("POST", target, WORKER_TOKEN, data, json_body=False)
        if r.status != 200:
            self.swarm.stale += 1


class Swarm:
    def __init__(self, url: str, n: int) -> None:
        self.client = Client(url)
        self.hosts = [Host(self, f"h{i:05d}") for i in range(n)]
        self.started: dict[str, float] = {}
        self.held: dict[str, trio.Event] = {}
        self.errors = 0
        self.stale = 0
        self.reregistered = 0
        """Starts and output chunks refused as stale (the job was offered again meanwhile)."""
        self.progress = trio.Event()
        """Set (and replaced) whenever a job starts."""
        self.trace: dict[str, dict[str, float]] = {}
        """Per job, when (``time.perf_counter``) it reached each stage: ``planned``, ``sent``,
        ``answered`` (the submit), ``offer`` (in a poll's reply), ``start_sent``."""
        self.lags: list[tuple[float, float]] = []
        """The swarm's own event loop running late: (when, by how long), over 5 ms."""
        self.empty_polls: list[float] = []
        """When each long poll came back empty (its wait ran out)."""

    async def watch_loop(self) -> None:
        """Note when the swarm's own loop runs late (its lateness would be counted as the
        controller's latency)."""
        while True:
            t = time.perf_counter()
            await trio.sleep(LOOP_PROBE_S)
            late = time.perf_counter() - t - LOOP_PROBE_S
            if late > LOOP_PROBE_S:
                self.lags.append((t, late))

    @staticmethod
    def rng_offset(name: str) -> float:
        return (zlib.crc32(name.encode()) % 1000) / 1000

    async def submit(self, command: list[str], **extra: Any) -> str:
        r = await self.client.post("/v1/jobs", USER_TOKEN, {"command": command, **extra})
        if r.status != 200:
            raise RuntimeError(f"submit: {r.status} {r.body!r}")
        job_id: str = r.json()["job_id"]
        return job_id


SWARM_GC: list[tuple[float, int, float]] = []
"""The swarm's own garbage collections over 5 ms: (when, generation, how long)."""
_gc_started = [0.0]


def _note_gc(phase: str, info: dict[str, Any]) -> None:
    if phase == "start":
        _gc_started[0] = time.perf_counter()
    elif (took := time.perf_counter() - _gc_started[0]) > 0.005:
        SWARM_GC.append((_gc_started[0], info["generation"], took))


def _stages(
    swarm: Swarm,
    sent: dict[str, float],
    sched: list[tuple[float, float, float, float, float]],
    load_started: float,
    out: dict[str, float],
) -> None:
    """Where the latency went, per stage (p50 and p99 in ms): ``submit`` (sent → answered),
    ``offer`` (answered → in a poll's reply), ``start`` (sent → answered); the share of the
    load phase the controller and the swarm waited for a core; the swarm's own worst lag."""
    stages = {"submit": ("sent", "answered"), "offer": ("answered", "offer")}
    stages["start"] = ("start_sent", "started")
    for name, (a, b) in stages.items():
        spans = [
            t[b] - t[a]
            for job_id in sent
            if a in (t := {**swarm.trace.get(job_id, {}), "started": swarm.started.get(job_id)})
            and t.get(b) is not None
        ]
        if spans:
            out[f"{name}_p50_ms"] = statistics.median(spans) * 1000
            out[f"{name}_p99_ms"] = pct(spans, 0.99) * 1000
    if len(sched) >= 2:
        (t0, _, cw0, _, sw0), (t1, _, cw1, _, sw1) = sched[0], sched[-1]
        out["ctl_wait"] = (cw1 - cw0) / (t1 - t0)
        out["swarm_wait"] = (sw1 - sw0) / (t1 - t0)
    out["swarm_lag_ms"] = max((late for t, late in swarm.lags if t >= load_started), default=0)
    out["swarm_lag_ms"] *= 1000


def _commits(metrics: Reply) -> tuple[float, float]:
    """The controller's group commits so far: how many, and their seconds in all."""
    count = total = 0.0
    for line in metrics.body.decode().splitlines():
        if line.startswith("rc_controller_store_commit_seconds_count"):
            count = float(line.split()[-1])
        elif line.startswith("rc_controller_store_commit_seconds_sum"):
            total = float(line.split()[-1])
    return count, total


def _stage_line(r: dict[str, float]) -> str:
    nan = math.nan
    stages = "  ".join(
        f"{k} {r.get(f'{k}_p50_ms', nan):.1f}/{r.get(f'{k}_p99_ms', nan):.1f}"
        for k in ("submit", "offer", "start")
    )
    return (
        f"{'':13}stages p50/p99 ms: {stages}; waiting for a core: controller "
        f"{r.get('ctl_wait', nan):.0%}, swarm {r.get('swarm_wait', nan):.0%}; "
        f"swarm loop late by up to {r['swarm_lag_ms']:.0f} ms; "
        f"{r['commits_per_s']:.0f} commits/s of {r['commit_ms']:.1f} ms"
    )


def pct(values: Sequence[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


async def measure(store: str, n: int, args: argparse.Namespace) -> dict[str, float]:
    out: dict[str, float] = {}
    with tempfile.TemporaryDirectory(prefix="rc-swarm-") as tmp, _database(store) as where:
        async with rc_serve(where, Path(tmp) / "state") as (proc, url):
            swarm = Swarm(url, n)
            try:
                await _measure_fleet(swarm, proc, n, args, out)
            finally:
                await swarm.client.aclose()
    return out


async def _measure_fleet(
    swarm: Swarm, proc: trio.Process, n: int, args: argparse.Namespace, out: dict[str, float]
) -> None:
    async with trio.open_nursery() as nursery:
        t0 = time.perf_counter()
        limiter = trio.CapacityLimiter(32)

        async def register(h: Host) -> None:
            async with limiter:
                await h.register()

        async with trio.open_nursery() as reg:
            for h in swarm.hosts:
                reg.start_soon(register, h)
        out["register_s"] = time.perf_counter() - t0
        for i, h in enumerate(swarm.hosts):
            nursery.start_soon(h.heartbeats)
            h.kick(nursery)
            if i % 50 == 49:
                await trio.sleep(0.1)  # not a thousand connections at once
        await trio.sleep(3)  # every poll parked
        # The swarm stands for a thousand worker processes, each with its own collector; in
        # one process, a full collection over all their state would stall every one of them
        # at once, and that stall would be counted as the controller's latency.
        gc.collect()
        gc.freeze()

        # Idle: heartbeats and parked polls only.
        c0, w0 = cpu_seconds(proc.pid), time.perf_counter()
        await trio.sleep(args.idle_s)
        idle_rate = (cpu_seconds(proc.pid) - c0) / (time.perf_counter() - w0)
        out["idle_cpu"] = idle_rate

        async def per_op(label: str, ops: Any) -> None:
            c0, w0 = cpu_seconds(proc.pid), time.perf_counter()
            await ops()
            elapsed = time.perf_counter() - w0
            net = cpu_seconds(proc.pid) - c0 - idle_rate * elapsed
            out[f"{label}_ms"] = max(net, 0.0) / args.ops * 1000

        unmatched: list[str] = []

        async def submits() -> None:
            for _ in range(args.ops):
                unmatched.append(await swarm.submit(["x"], select="product=none"))

        await per_op("submit", submits)
        for job_id in unmatched:
            await swarm.client.post(f"/v1/jobs/{job_id}/cancel", USER_TOKEN, {})

        targets = [(swarm.hosts[i % n], f"g{(i // n) % DEVICES}") for i in range(args.ops)]
        for i, (h, dev) in enumerate(targets):
            r = await h.post(
                f"/v1/hosts/{h.name}/devices/{dev}/fault",
                {
                    "session": h.session,
                    "fault_id": f"bench-{i}",
                    "kind": "fault",
                    "reason": "bench",
                },
            )
            assert r.status == 200, r.body

        async def clears() -> None:
            for h, dev in targets:
                r = await swarm.client.post(f"/v1/devices/{h.name}/{dev}/clear", USER_TOKEN, {})
                assert r.status == 200, r.body

        await per_op("clear", clears)

        held = await swarm.submit(["hold"], device=f"{swarm.hosts[-1].name}/g7")
        with trio.fail_after(60):
            while held not in swarm.held:
                await swarm.progress.wait()
        host = swarm.hosts[-1]
        attempt = {"job_id": held, "attempt": 1}

        async def chunks() -> None:
            for i in range(args.ops):
                await host.output(attempt, i * 1024, b"o" * 1024)

        await per_op("output", chunks)
        swarm.held[held].set()

        # Dispatch under load.
        latencies: list[float] = []
        sent: dict[str, float] = {}

        submitting = trio.CapacityLimiter(16)

        async def one(t: float) -> None:
            # At most 16 submits in flight, like a few busy users; a submit queued here
            # behind a slow controller still counts from its planned time ``t``.
            async with submitting:
                try:
                    t_sent = time.perf_counter()
                    job_id = await swarm.submit(["true"], select="product=H100")
                    swarm.trace.setdefault(job_id, {}).update(
                        planned=t, sent=t_sent, answered=time.perf_counter()
                    )
                except (OSError, trio.BrokenResourceError, EOFError, RuntimeError):
                    swarm.errors += 1  # not retried: a submit is not idempotent
                    return
            sent[job_id] = t

        nursery.start_soon(swarm.watch_loop)
        sched: list[tuple[float, float, float, float, float]] = []

        async def note_sched() -> None:
            # Whether the controller (and the swarm) got a core when it wanted one: on a
            # shared machine the tail is often the run queue, not the controller's work.
            while True:
                sched.append((time.perf_counter(), *schedstat(proc.pid), *schedstat(os.getpid())))
                await trio.sleep(0.05)

        nursery.start_soon(note_sched)
        commits0 = _commits(await swarm.client.get("/metrics", USER_TOKEN))
        c0, w0 = cpu_seconds(proc.pid), time.perf_counter()
        jobs = int(args.rate * args.load_s)
        async with trio.open_nursery() as load:
            for k in range(jobs):
                due = w0 + k / args.rate
                await trio.sleep(max(0.0, due - time.perf_counter()))
                load.start_soon(one, time.perf_counter())
        waiting = list(sent)
        with trio.move_on_after(60):
            while waiting := [j for j in waiting if j not in swarm.started]:
                await swarm.progress.wait()
        load_cpu = cpu_seconds(proc.pid) - c0
        out["load_cpu"] = load_cpu / (time.perf_counter() - w0)
        # Net of the fleet's own background (heartbeats, poll timeouts), as the costs above.
        net = load_cpu - idle_rate * (time.perf_counter() - w0)
        out["job_ms"] = max(net, 0.0) / max(len(sent), 1) * 1000
        latencies = [swarm.started[j] - t for j, t in sent.items() if j in swarm.started]
        out["dispatched"] = len(latencies) / max(len(sent), 1)
        if latencies:
            out["p50_ms"] = statistics.median(latencies) * 1000
            out["p99_ms"] = pct(latencies, 0.99) * 1000
        reply = await swarm.client.get("/metrics", USER_TOKEN)
        (n0, s0), (n1, s1) = commits0, _commits(reply)
        out["commits_per_s"] = (n1 - n0) / (time.perf_counter() - w0)
        out["commit_ms"] = (s1 - s0) / max(n1 - n0, 1) * 1000
        metrics = reply.body.decode()
        lost = 0.0
        for line in metrics.splitlines():
            if line.startswith('rc_controller_hosts{state="lost"}'):
                lost = float(line.split()[-1])
        out["hosts_lost"] = lost
        _stages(swarm, sent, sched, w0, out)
        if args.trace:
            for job_id in sent:
                swarm.trace[job_id]["started"] = swarm.started.get(job_id, math.nan)
            trace = {
                "load_started": w0,
                "jobs": {job_id: swarm.trace[job_id] for job_id in sent},
                "swarm_loop_late": swarm.lags,
                "swarm_gc": SWARM_GC,
                "empty_polls": swarm.empty_polls,
                "schedstat": sched,
            }
            await trio.Path(args.trace).write_text(json.dumps(trace))
        out["client_errors"] = swarm.errors
        out["stale"] = swarm.stale
        out["reregistered"] = swarm.reregistered
        nursery.cancel_scope.cancel()


@contextlib.contextmanager
def _database(store: str) -> Iterator[str]:
    """For ``postgres``: a private server (initdb + pg_ctl on a Unix socket, as the tests
    start one) and a fresh database, its URI given; stopped and removed on the way out."""
    if store != "postgres":
        yield store
        return
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from tests.controller import pgserver

    with pgserver.running_server() as server:
        url = server.new_database()
        try:
            yield url
        finally:
            server.drop_database(url)


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--hosts", default="10,100,1000,2000", help="fleet sizes, comma-separated")
    p.add_argument("--store", choices=["memory", "sqlite", "postgres", "both"], default="both")
    p.add_argument("--idle-s", type=float, default=15.0)
    p.add_argument("--load-s", type=float, default=10.0)
    p.add_argument("--rate", type=float, default=100.0, help="jobs per second under load")
    p.add_argument("--ops", type=int, default=200, help="operations per cost measurement")
    p.add_argument(
        "--trace",
        metavar="FILE",
        help="write the load phase's per-job stage times, the swarm's loop lags and GC "
        "pauses, when long polls came back empty, and both processes' scheduler samples "
        "to FILE (JSON; the last fleet size)",
    )
    args = p.parse_args(argv)
    sizes = [int(x) for x in args.hosts.split(",") if x]
    stores = ["memory", "sqlite"] if args.store == "both" else [args.store]
    print(
        f"swarm: {os.cpu_count()} CPUs; {DEVICES} devices per host; idle {args.idle_s:.0f}s; "
        f"{args.rate:.0f} jobs/s for {args.load_s:.0f}s; {args.ops} ops per cost",
        flush=True,
    )
    header = (
        f"{'store':<7}{'hosts':>6}{'reg s':>7}{'idle cpu':>9}{'submit ms':>10}{'clear ms':>9}"
        f"{'chunk ms':>9}{'load cpu':>9}{'job ms':>7}{'p50 ms':>8}{'p99 ms':>8}"
        f"{'lost':>5}{'done':>6}{'stale':>6}{'rereg':>6}{'errs':>6}"
    )

    async def run() -> None:
        with trio.fail_after(RUN_LIMIT_S):
            for store in stores:
                print(header, flush=True)
                base: dict[str, float] | None = None
                for n in sizes:
                    r = await measure(store, n, args)
                    base = base or r
                    print(
                        f"{store:<7}{n:>6}{r['register_s']:>7.1f}{r['idle_cpu']:>8.1%} "
                        f"{r['submit_ms']:>9.2f}{r['clear_ms']:>9.2f}{r['output_ms']:>9.2f}"
                        f"{r['load_cpu']:>8.1%} {r['job_ms']:>6.2f}"
                        f"{r.get('p50_ms', math.nan):>8.1f}"
                        f"{r.get('p99_ms', math.nan):>8.1f}{r['hosts_lost']:>5.0f}"
                        f"{r['dispatched']:>6.0%}{r['stale']:>6.0f}"
                        f"{r['reregistered']:>6.0f}{r['client_errors']:>6.0f}",
                        flush=True,
                    )
                    print(_stage_line(r), flush=True)
                    if n != sizes[0]:
                        ratios = ", ".join(
                            f"{k.removesuffix('_ms')} {r[k] / base[k]:.1f}x"
                            for k in ("submit_ms", "clear_ms", "output_ms")
                            if base[k] > 0
                        )
                        print(f"{'':13}vs {sizes[0]} hosts ({n / sizes[0]:.0f}x): {ratios}")

    gc.callbacks.append(_note_gc)
    trio.run(run)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
