"""Fault simulations of whole fleets: one reference controller, N workers, virtual time.

Every worker runs unchanged on its own :class:`~rc_worker.testing.sim.SimHost`
and its own state directory, against one in-process reference controller
(``httpx.ASGITransport``, no sockets), all in one Trio run under
``trio.testing.MockClock(autojump_threshold=0)``: hours of virtual time cost
milliseconds, so hypothesis can drive thousands of scenarios::

    def test_crash_during_a_job() -> None:
        async def scenario(fleet: Fleet) -> None:
            fleet.program("train", Script.printing((5.0, b"done\\n")))
            job = fleet.submit(["train"])
            await trio.sleep(2)
            await fleet.crash("h0")
            fleet.restart("h0")
            await fleet.settle()
            await fleet.drain()
            assert fleet.check() == []

        simulate(scenario, hosts=1)

Faults: :meth:`Fleet.crash` (optionally with a reboot) and :meth:`Fleet.restart`;
controller faults per endpoint (:class:`Fault`: a 503, a refused connection,
a timeout, or a request applied whose answer is lost), queued with
:meth:`Fleet.inject` or held with :meth:`Fleet.outage` until :meth:`Fleet.restore`.

Invariants (ARCHITECTURE.md) are checked as the run goes, where they must be
seen at the moment (a device offered ready while a process of its job lives;
a ``gone`` claim under ``require_manual_clear``), and by :meth:`Fleet.check`
at the end (exactly one terminal state, output committed once and in order,
a job that exited 0 reported succeeded). :meth:`Fleet.check` returns the
violations as sentences; an empty list is a pass.
"""

from __future__ import annotations

import collections
import enum
import functools
import json
import math
import random
import re
import tempfile
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Mapping, Sequence
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any, TypeVar

import attrs
import httpx
import trio
import trio.testing

from rc_worker.controller import create_app
from rc_worker.controller.messages import Event, JobInfo
from rc_worker.controller.serve import housekeeping
from rc_worker.controller.store import Store, StoreConfig
from rc_worker.core.config import Config, DeviceConfig
from rc_worker.core.gpu_query import gpu_scope
from rc_worker.testing.sim import Script, SimHost, SimProcess
from rc_worker.worker import Worker

__all__ = [
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
]

T = TypeVar("T")

USER_TOKEN = "rc-sim-user-token"

# A PATH that finds no nvidia-smi (the probe pass looks on the real disk), and
# no probe, verify or sheet directory: the probe pass reports built-in facts only.
WORKER_ENVIRON: Mapping[str, str] = {"PATH": "/nonexistent/rc-sim/bin", "HOME": "/nonexistent"}

TIMEOUT_S = 5.0
"""Virtual seconds a ``Fault.TIMEOUT`` takes before the worker sees it."""

ENDPOINTS: Mapping[str, re.Pattern[str]] = {
    name: re.compile(pattern)
    for name, pattern in {
        "register": r"^/v1/hosts/[^/]+/register$",
        "heartbeat": r"^/v1/hosts/[^/]+/heartbeat$",
        "poll": r"^/v1/hosts/[^/]+/poll$",
        "labels": r"^/v1/hosts/[^/]+/labels$",
        "sheets": r"^/v1/hosts/[^/]+/sheets$",
        "fault": r"^/v1/hosts/[^/]+/devices/[^/]+/fault$",
        "start": r"^/v1/jobs/[^/]+/start$",
        "output": r"^/v1/jobs/[^/]+/output$",
        "finish": r"^/v1/jobs/[^/]+/finish$",
        "stdin": r"^/v1/jobs/[^/]+/stdin$",
        "deregister": r"^/v1/hosts/[^/]+/deregister$",
    }.items()
}
"""The worker's endpoints by name, as fault plans address them."""


class Fault(enum.Enum):
    """What the controller's side of one request does."""

    OK = "ok"
    UNAVAILABLE = "503"
    UNKNOWN_SESSION = "409 unknown_session"
    REFUSED = "connection refused"
    TIMEOUT = "timeout"
    LOST = "applied, answer lost"


@attrs.frozen
class Exchange:
    """One request a worker made, as the transport saw it."""

    at: float
    host: str
    endpoint: str
    path: str
    fault: Fault
    status: int | None  # None: no answer reached the worker


def endpoint_of(path: str) -> str:
    for name, pattern in ENDPOINTS.items():
        if pattern.match(path):
            return name
    return "other"


RequestHook = Callable[[str, httpx.Request], httpx.Request]
AnswerHook = Callable[[str, httpx.Request, int, Mapping[str, Any]], None]
"""``(endpoint, request, status, body)`` for every answer that reached the worker."""


class FaultyTransport(httpx.AsyncBaseTransport):
    """Between one worker and the controller: planned faults, outages, a log.

    ``on_request(endpoint, request)`` sees every request that reaches the
    wire, and returns the one to send; ``on_send(endpoint, request)`` sees
    every request the worker makes, faulted or not; ``on_answer`` every answer
    that reaches the worker, with its JSON body. While ``down`` (the worker
    process is dead) nothing is sent at all.
    """

    def __init__(
        self,
        inner: httpx.AsyncBaseTransport,
        *,
        name: str = "",
        on_request: RequestHook | None = None,
    ) -> None:
        self._inner = inner
        self.name = name
        self.on_request = on_request
        self.on_send: RequestHook | None = None
        self.on_answer: AnswerHook | None = None
        self.down = False
        self.log: list[Exchange] = []
        self._queued: dict[str, list[Fault]] = {}
        self._outages: dict[str, Fault] = {}

    def inject(self, endpoint: str, *faults: Fault) -> None:
        """The next requests to ``endpoint`` meet ``faults``, one each, in order."""
        for fault in faults:
            _check_fault(endpoint, fault)
        self._queued.setdefault(endpoint, []).extend(faults)

    def outage(self, endpoint: str, fault: Fault = Fault.UNAVAILABLE) -> None:
        """Every request to ``endpoint`` meets ``fault`` until :meth:`restore`."""
        _check_fault(endpoint, fault)
        self._outages[endpoint] = fault

    def restore(self, endpoint: str | None = None) -> None:
        """End the outage of ``endpoint`` (all, when ``None``) and drop queued faults."""
        for table in (self._outages, self._queued):
            if endpoint is None:
                table.clear()
            else:
                table.pop(endpoint, None)

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        # One checkpoint per request, whatever the fault: a loop that only makes
        # requests then still yields, and the stall guard sees it spin.
        await trio.lowlevel.checkpoint()
        if self.down:
            # A dead process sends nothing; its code may still be unwinding.
            raise httpx.ConnectError("the worker process is gone", request=request)
        endpoint = endpoint_of(request.url.path)
        if self.on_send is not None:
            request = self.on_send(endpoint, request)
        fault = self._outages.get(endpoint)
        if fault is None:
            queue = self._queued.get(endpoint)
            fault = queue.pop(0) if queue else Fault.OK
        if self.on_request is not None and fault in (Fault.OK, Fault.LOST):
            request = self.on_request(endpoint, request)
        status: int | None = None
        try:
            response = await self._answer(request, fault)
            status = response.status_code
            if self.on_answer is not None:
                await response.aread()
                self.on_answer(endpoint, request, status, _json_body(response.content))
            return response
        finally:
            self.log.append(
                Exchange(trio.current_time(), self.name, endpoint, request.url.path, fault, status)
            )

    async def _answer(self, request: httpx.Request, fault: Fault) -> httpx.Response:
        if fault is Fault.OK:
            return await self._inner.handle_async_request(request)
        if fault is Fault.LOST:
            response = await self._inner.handle_async_request(request)
            await response.aread()
            await response.aclose()
            raise httpx.ReadTimeout("injected: applied, but the answer was lost", request=request)
        if fault is Fault.TIMEOUT:
            await trio.sleep(TIMEOUT_S)
            raise httpx.ReadTimeout("injected: no answer", request=request)
        await trio.lowlevel.checkpoint()
        if fault is Fault.REFUSED:
            raise httpx.ConnectError("injected: connection refused", request=request)
        if fault is Fault.UNKNOWN_SESSION:
            body = {"error": "unknown_session", "message": "injected: register again"}
            return httpx.Response(409, json=body)
        return httpx.Response(
            503, json={"error": "unavailable", "message": "injected: the controller is unavailable"}
        )

    async def aclose(self) -> None:
        # The controller outlives any one worker process: leave it open.
        await trio.lowlevel.checkpoint()


def _check_endpoint(endpoint: str) -> None:
    if endpoint not in ENDPOINTS:
        raise ValueError(f"no endpoint {endpoint!r}; expected one of {', '.join(ENDPOINTS)}")


def _check_fault(endpoint: str, fault: Fault) -> None:
    _check_endpoint(endpoint)
    if endpoint == "register" and fault is Fault.UNKNOWN_SESSION:
        # No controller answers a register with unknown_session: it has no
        # session to forget. Simulating one would test a controller that cannot exist.
        raise ValueError(
            "register cannot meet unknown_session (a register has no session to forget); "
            "use Fault.UNAVAILABLE, REFUSED, TIMEOUT or LOST for register"
        )


def _json_body(content: bytes) -> Mapping[str, Any]:
    try:
        body = json.loads(content or b"{}")
    except ValueError:
        return {}
    return body if isinstance(body, dict) else {}


def _json(request: httpx.Request) -> dict[str, Any]:
    return dict(_json_body(request.content))


def _with_json(request: httpx.Request, body: Mapping[str, Any]) -> httpx.Request:
    headers = [(k, v) for k, v in request.headers.raw if k.lower() != b"content-length"]
    return httpx.Request(
        request.method, request.url, headers=headers, json=body, extensions=request.extensions
    )


# -- the fleet -------------------------------------------------------------------


@attrs.define(eq=False)
class SimNode:
    """One host of the fleet: its SimHost, config, transport and current worker."""

    name: str
    host: SimHost
    config: Config
    transport: FaultyTransport
    worker: Worker | None = None
    incarnations: int = 0
    crashes: list[float] = attrs.Factory(list)
    """Virtual times of crashes (reboots included)."""
    running: bool = False
    _scope: trio.CancelScope = attrs.Factory(trio.CancelScope)
    _started: trio.Event = attrs.Factory(trio.Event)
    _done: trio.Event = attrs.Factory(trio.Event)


class Fleet:
    """A controller and its simulated workers; built by :func:`open_fleet`."""

    def __init__(self, store: Store, nodes: dict[str, SimNode], nursery: trio.Nursery) -> None:
        self.store = store
        self.nodes = nodes
        self._nursery = nursery
        self.log: list[tuple[float, str]] = []
        """What the harness did and saw, with virtual times, for reading a failure."""
        self.violations: list[str] = []
        """Invariant violations seen as they happened (see also :meth:`check`)."""
        self.seed: int | None = None
        """The seed of :func:`open_fleet`, if any."""
        self.worker_environ: Mapping[str, str] = WORKER_ENVIRON
        """The environment every worker process starts with (``PATH`` is the fleet's bin)."""
        self._bin: Path | None = None
        # Finishes a worker process has sent and not yet had a final answer to,
        # by (host, device): such a device must not be listed ready.
        self._unacked: dict[tuple[str, str], set[str]] = collections.defaultdict(set)

    # -- driving --

    def program(self, name: str, script: Script) -> None:
        """Register ``name`` on every host (see :meth:`SimHost.program`)."""
        for node in self.nodes.values():
            node.host.program(name, script)

    def verify_script(self, name: str, script: Script) -> None:
        """Add ``name`` to every worker's verify pass, running ``script``.

        The pass lists the executables of ``verify_dir`` on the real disk, so
        an empty executable stands there; the SimHost runs ``script`` for its path.
        """
        for node in self.nodes.values():
            path = Path(node.config.verify_dir) / name
            path.parent.mkdir(parents=True, exist_ok=True)
            path.touch(mode=0o755)
            path.chmod(0o755)
            node.host.program(str(path), script)

    def program_nvidia_smi(self, script: Script) -> None:
        """``nvidia-smi`` on every host runs ``script`` from now on.

        An empty executable stands on the real disk, in the fleet's ``PATH``, where
        the worker looks for it; the SimHosts run ``script`` for its path. Give it
        to :func:`open_fleet` to have it there from the start, as on a GPU host.
        """
        assert self._bin is not None
        path = self._bin / "nvidia-smi"
        path.touch(mode=0o755)
        path.chmod(0o755)
        for node in self.nodes.values():
            node.host.program(str(path), script)
        self._note("nvidia-smi reprogrammed")

    def probe_script(self, name: str, script: Script) -> None:
        """Add the drop-in probe ``name`` (in every worker's ``probe_dir``) running ``script``.

        Like :meth:`verify_script`: an empty executable on the real disk, run as ``script``.
        """
        for node in self.nodes.values():
            path = Path(node.config.probe_dir) / name
            path.parent.mkdir(parents=True, exist_ok=True)
            path.touch(mode=0o755)
            path.chmod(0o755)
            node.host.program(str(path), script)

    def submit(self, command: Sequence[str], **fields: Any) -> str:
        """Queue a job; ``fields`` as ``Store.submit`` takes them."""
        job_id = self.store.submit(list(command), **fields)
        self._note(f"submit {job_id}: {list(command)} {fields or ''}")
        return job_id

    def cancel(self, job_id: str) -> None:
        """Cancel a job, as its user would."""
        self.store.cancel(job_id, "cancelled by the simulation")
        self._note(f"cancel {job_id}")

    def quarantine(self, host: str, device: str, reason: str = "simulated health fault") -> bool:
        """The worker of ``host`` finds ``device`` unhealthy while it may be idle, as a
        health check would: it quarantines it and reports the fault. Returns whether a
        worker was running to do so."""
        node = self.nodes[host]
        worker = node.worker
        if not node.running or not node._started.is_set() or worker is None:
            return False  # not up yet (a register outage, say): nothing to find it
        if device not in worker.devices:
            return False
        fault_id = worker.devices[device].raise_fault("dirty", reason)
        self._note(f"{host}/{device} quarantined by its worker ({fault_id}: {reason})")
        return True

    def set_idle_behavior(self, host: str, device: str, behavior: str) -> None:
        """``run``, ``hold`` or ``drain``, as an operator sets it at the controller."""
        self.store.set_idle_behavior(host, device, behavior)
        self._note(f"idle behaviour of {host}/{device}: {behavior}")

    async def crash(self, name: str, *, reboot: bool = False) -> None:
        """SIGKILL the worker of ``name`` (its processes carry on); ``reboot`` the host too."""
        node = self.nodes[name]
        self._note(f"crash {name}{' and reboot' if reboot else ''}")
        node.crashes.append(trio.current_time())
        # What the dead process was owed dies with it; its successor resends
        # from disk, and those sends are tracked afresh.
        for key in [k for k in self._unacked if k[0] == name]:
            del self._unacked[key]
        if node.running:
            node.running = False
            node.transport.down = True
            node.host.worker_died()
            node._scope.cancel()
            await node._done.wait()
        if reboot:
            node.host.reboot()

    async def stop(self, name: str, *, drain: bool = True) -> None:
        """Stop the worker of ``name`` as its service manager would, and wait until it exits.

        ``drain``: SIGTERM, running jobs finish (within ``shutdown_grace``); else
        as after a second signal, running jobs are stopped now. Either way
        reports are delivered first, so this waits out a controller outage.
        """
        node = self.nodes[name]
        self._note(f"{'drain' if drain else 'stop'} {name}")
        if not node.running:
            return
        await node._started.wait()
        assert node.worker is not None
        if drain:
            node.worker.drain()
        else:
            node.worker.stop()
        await node._done.wait()
        node.running = False

    def restart(self, name: str) -> None:
        """Start a new worker process on ``name``, on the same state directory."""
        node = self.nodes[name]
        if node.running:
            raise RuntimeError(f"the worker of {name} is running; crash it first")
        if node.incarnations:
            node.host.worker_started()
        self._note(f"start worker {node.incarnations + 1} on {name} (pid {node.host.worker_pid})")
        node.transport.down = False
        node.running = True
        node._scope = trio.CancelScope()
        node._started = trio.Event()
        node._done = trio.Event()
        node.incarnations += 1
        # Built here, not in the task, so that node.worker is never the dead one.
        http = httpx.AsyncClient(transport=node.transport, base_url="http://controller")
        # Each process its own generator: a restarted worker is a new process with
        # new ids, and with a seed, the same ones in every replay.
        rng = (
            None if self.seed is None else random.Random(f"{self.seed}/{name}/{node.incarnations}")
        )
        node.worker = Worker(
            node.config, http=http, host=node.host, environ=self.worker_environ, rng=rng
        )
        self._nursery.start_soon(self._serve, node, node.worker, http)

    def inject(self, endpoint: str, *faults: Fault, hosts: Iterable[str] | None = None) -> None:
        """The next requests to ``endpoint`` from ``hosts`` (all by default) meet ``faults``."""
        for node in self._select(hosts):
            node.transport.inject(endpoint, *faults)
        self._note(f"inject {endpoint}: {[f.value for f in faults]}")

    def outage(
        self, endpoint: str, fault: Fault = Fault.UNAVAILABLE, hosts: Iterable[str] | None = None
    ) -> None:
        """Every request to ``endpoint`` from ``hosts`` (all by default) meets ``fault``."""
        for node in self._select(hosts):
            node.transport.outage(endpoint, fault)
        self._note(f"outage {endpoint}: {fault.value}")

    def restore(self, endpoint: str | None = None, hosts: Iterable[str] | None = None) -> None:
        """End outages and drop queued faults: of ``endpoint`` (all by default)."""
        for node in self._select(hosts):
            node.transport.restore(endpoint)
        self._note(f"restore {endpoint or 'every endpoint'}")

    def clear_clean_devices(self) -> list[str]:
        """Clear each quarantined device with nothing of any job alive on it.

        A careful operator: one who looks at the host first. Returns the
        devices (``host/device``) cleared.
        """
        cleared = []
        for info in self.store.devices():
            node = self.nodes.get(info.host)
            if info.state != "quarantined" or node is None or _job_processes(node, info.name):
                continue
            self.store.clear(info.host, info.name)
            cleared.append(info.address)
        if cleared:
            self._note(f"operator clears {cleared}")
        return cleared

    async def wait_until(self, predicate: Callable[[], bool], *, interval: float = 1.0) -> None:
        """Wait for ``predicate()``, re-checked at every controller change and every
        ``interval`` virtual seconds (process tables change without telling anyone)."""
        while not predicate():
            changed = trio.Event()
            unsubscribe = self.store.subscribe(changed.set)
            try:
                with trio.move_on_after(interval):
                    await changed.wait()
            finally:
                unsubscribe()

    async def settle(self, *, operator_every: float | None = 30.0) -> None:
        """Run until every job has ended.

        Every ``operator_every`` virtual seconds an operator clears the
        quarantines that are clean (:meth:`clear_clean_devices`); ``None``
        for no operator. Not at once: the workers' own proofs come first.
        """
        interval = math.inf if operator_every is None else operator_every
        while True:
            with trio.move_on_after(interval):
                await self.wait_until(lambda: all(j.terminal for j in self.store.jobs()))
                return
            self.clear_clean_devices()

    async def drain(self) -> None:
        """Drain every running worker (jobs finish, reports delivered) and wait for it to exit."""
        nodes = [n for n in self.nodes.values() if n.running]
        for node in nodes:
            # A worker that has not started yet would ignore the drain.
            await node._started.wait()
            assert node.worker is not None
            node.worker.drain()
        for node in nodes:
            await node._done.wait()
            node.running = False

    # -- what happened --

    def jobs(self) -> list[JobInfo]:
        """Every job the controller knows, as it sees them now."""
        return self.store.jobs()

    def events(self) -> list[Event]:
        """The controller's event log (``job_finished``, ``device_quarantined``...), in order."""
        return self.store.events()

    def check(self) -> list[str]:
        """Every invariant violation of the run so far, as sentences; ``[]`` is a pass.

        Call it once workers are drained (or stopped with nothing owed): a
        report still on its way is not yet committed.
        """
        problems = list(self.violations)
        events = self.store.events()
        finishes = collections.Counter(
            str(e.data["job_id"]) for e in events if e.type == "job_finished"
        )
        for info in self.store.jobs():
            problems += self._check_job(info, finishes[info.job_id], events)
        for node in self.nodes.values():
            problems += self._check_hooks(node, events)
        manual = {n.name for n in self.nodes.values() if n.config.require_manual_clear}
        for e in events:
            if (
                e.type == "device_cleared"
                and e.data.get("by") == "gone"
                and e.data["host"] in manual
            ):
                problems.append(f"{e.data['host']}/{e.data['device']} freed by a 'gone' claim")
        return problems

    # -- internals --

    def _check_job(self, info: JobInfo, finishes: int, events: list[Event]) -> list[str]:
        job = info.job_id
        out: list[str] = []
        if info.state == "rejected":
            # The harness submits only well-formed jobs: `rejected` is for an
            # assignment's own defects, so a device's state must never end one.
            out.append(f"{job}: ended rejected ({info.reason!r}) though it was well-formed")
        if finishes > 1:
            out.append(f"{job}: {finishes} terminal states recorded")
        if info.started_at is not None and not info.terminal:
            out.append(f"{job}: started but never ended (state {info.state})")
        spawns = [(n, p) for n in self.nodes.values() for p in n.host.spawned(job)]
        spawns = [(n, p) for n, p in spawns if p.argv[0] not in _worker_scripts(n)]
        if len(spawns) > 1:
            out.append(f"{job}: spawned {len(spawns)} times ({[p.pid for _, p in spawns]})")
        if not spawns:
            return out
        node, proc = spawns[0]
        if info.started_at is None or info.started_at > proc.started_at:
            out.append(f"{job}: spawned on {node.name} before the controller saw it start")
        assert proc.stdout is not None
        committed, read = self.store.output(job), bytes(proc.stdout.read)
        disrupted = self._disrupted(node, proc, info, events)
        if committed != read:
            out.append(
                f"{job}: committed output is not what the worker read: {_diff(committed, read)}"
            )
        written = bytes(proc.stdout.written)
        if not disrupted and read != written:
            out.append(f"{job}: the worker read other than the job wrote: {_diff(read, written)}")
        if info.state == "lost" and not disrupted:
            # `lost` is for a crashed worker or a lost host only (docs/protocol.md),
            # whether or not the job's process was signalled afterwards.
            out.append(
                f"{job}: ended lost on {node.name} though its worker never crashed "
                f"and the host was never lost ({info.reason!r})"
            )
        code = proc.returncode
        if code is None or code < 0 or proc.signalled or (info.state == "lost" and disrupted):
            return out
        want = "succeeded" if code == 0 else "failed"
        if (info.state, info.exit_code, info.killed) != (want, code, False):
            out.append(
                f"{job}: exited {code} on its own but was reported {info.state} "
                f"(exit {info.exit_code}, killed {info.killed}, {info.reason!r})"
            )
        return out

    def _check_hooks(self, node: SimNode, events: list[Event]) -> list[str]:
        """A killed or failed hook is a failed hook, whatever its exit code.

        After a failed ``on_acquire`` the job must not run on that device; after a
        failed ``on_release`` the device must be quarantined (``hook_failed``).
        Hooks cut off by a crash of the worker prove nothing either way.
        """
        out: list[str] = []
        history = node.host.spawned()
        for dev in node.config.devices:
            for path, hook in ((dev.on_acquire, "on_acquire"), (dev.on_release, "on_release")):
                if path is None:
                    continue
                for h in history:
                    if h.argv[0] != path or h.environ.get("RC_DEVICE") != dev.name:
                        continue
                    if h.returncode == 0 and not h.signalled:
                        continue
                    if h.ended_at is None or self._crashed_during(node, h.started_at, h.ended_at):
                        continue
                    if hook == "on_acquire":
                        ran = [
                            p
                            for p in history
                            if p.job_id == h.job_id
                            and p.environ.get("RC_DEVICE") == dev.name
                            and p.argv[0] not in _worker_scripts(node)
                            and p.started_at >= h.started_at
                        ]
                        if ran:
                            out.append(
                                f"{node.name}/{dev.name}: job {h.job_id} ran after its "
                                f"on_acquire hook failed (exit {h.returncode}, signals "
                                f"{h.signals})"
                            )
                    elif not any(
                        e.type == "device_quarantined"
                        and e.data.get("host") == node.name
                        and e.data.get("device") == dev.name
                        and e.data.get("kind") == "hook_failed"
                        and e.time >= h.started_at
                        for e in events
                    ):
                        out.append(
                            f"{node.name}/{dev.name}: on_release hook failed (exit "
                            f"{h.returncode}, signals {h.signals}) but the device was not "
                            "quarantined"
                        )
        return out

    def _crashed_during(self, node: SimNode, start: float, end: float) -> bool:
        return any(start <= t <= end for t in node.crashes)

    def _disrupted(
        self, node: SimNode, proc: SimProcess, info: JobInfo, events: list[Event]
    ) -> bool:
        """Whether the job's worker crashed, or its host was declared lost, while it ran."""
        end = info.finished_at if info.finished_at is not None else float("inf")
        if any(proc.started_at <= t <= end for t in node.crashes):
            return True
        return any(
            e.type == "host_lost" and e.data.get("host") == node.name and proc.started_at <= e.time
            for e in events
        )

    def _select(self, hosts: Iterable[str] | None) -> list[SimNode]:
        return list(self.nodes.values()) if hosts is None else [self.nodes[h] for h in hosts]

    def _note(self, text: str) -> None:
        self.log.append((trio.current_time(), text))

    async def _serve(self, node: SimNode, worker: Worker, http: httpx.AsyncClient) -> None:
        started, done = node._started, node._done
        try:
            with node._scope:
                async with http, trio.open_nursery() as nursery:
                    await nursery.start(worker.run)
                    started.set()
        finally:
            if node._done is done:
                node.running = False
            done.set()

    def _on_request(self, node: SimNode, endpoint: str, request: httpx.Request) -> httpx.Request:
        if endpoint == "register":
            body = _json(request)
            if node.config.require_manual_clear:
                claims = [(r.get("job_id"), r.get("claim")) for r in body.get("recovery", [])]
                if ("gone" in (c for _, c in claims)) or not body.get("require_manual_clear"):
                    self._violation(
                        f"{node.name} has require_manual_clear but registered with "
                        f"require_manual_clear={body.get('require_manual_clear')}, claims {claims}"
                    )
            labels = body.get("labels")
            if isinstance(labels, Mapping):
                self._check_labels(node, labels)
            return _with_json(request, body)
        if endpoint == "labels":
            self._check_labels(node, _json(request))
        if endpoint == "poll":
            for device in _json(request).get("ready", []):
                alive = _job_processes(node, str(device))
                if alive:
                    who = [(p.pid, p.job_id, p.state) for p in alive]
                    self._violation(f"{node.name} offered {device} as ready while {who} alive")
                owed = self._unacked.get((node.name, str(device)))
                if owed:
                    self._violation(
                        f"{node.name} offered {device} as ready while its finish "
                        f"{sorted(owed)} is unacknowledged"
                    )
        if endpoint == "finish":
            body = _json(request)
            verify = body.get("verify")
            if (
                isinstance(verify, Mapping)
                and verify.get("ok") is False
                and not body.get("fault_id")
            ):
                # The controller would quarantine on verify.ok = false by itself,
                # which hides a worker that forgot to: the worker must raise it.
                self._violation(
                    f"{node.name} reported a failed verify pass for {request.url.path} "
                    f"without quarantining {body.get('device')} itself"
                )
        return request

    def _check_labels(self, node: SimNode, payload: Mapping[str, Any]) -> None:
        """Invariant 4: facts a pass could not confirm are not sent (they stay as they were).

        The last ``nvidia-smi`` run on the host is the truth of the pass that sent
        them: if it failed (an error exit, killed at its timeout), no GPU device it
        speaks for may appear in the payload, where even an empty map would wipe
        the device's facts at the controller.
        """
        if self._bin is None:
            return
        smi = str(self._bin / "nvidia-smi")
        runs = [p for p in node.host.spawned() if p.argv[:1] == (smi,) and p.ended_at is not None]
        if not runs:
            return
        last = runs[-1]  # in spawn order: probe passes never overlap
        if last.returncode == 0 and not last.signalled:
            return
        devices = payload.get("devices")
        scope = set(gpu_scope(node.config.device_names).values())
        sent = sorted(set(devices) & scope) if isinstance(devices, Mapping) else []
        if sent:
            self._violation(
                f"{node.name} sent facts for {sent} although nvidia-smi failed "
                f"(exit {last.returncode}, signals {last.signals}): unconfirmed facts "
                "must be left out so that they keep their previous values"
            )

    def _on_send(self, node: SimNode, endpoint: str, request: httpx.Request) -> httpx.Request:
        if endpoint == "finish":
            device = _json(request).get("device")
            if isinstance(device, str):
                self._unacked[(node.name, device)].add(request.url.path)
        return request

    def _on_answer(
        self,
        node: SimNode,
        endpoint: str,
        request: httpx.Request,
        status: int,
        body: Mapping[str, Any],
    ) -> None:
        if endpoint != "finish" or not _final(status, body):
            return
        device = _json(request).get("device")
        if isinstance(device, str):
            self._unacked[(node.name, device)].discard(request.url.path)

    def _violation(self, text: str) -> None:
        self._note(f"VIOLATION: {text}")
        self.violations.append(f"t={trio.current_time():.3f}: {text}")


def _final(status: int, body: Mapping[str, Any]) -> bool:
    """Whether an answer ends a report's delivery: success, or a 4xx no retry can change."""
    if 200 <= status < 300:
        return True
    if status == 409 and body.get("error") == "unknown_session":
        return False
    return 400 <= status < 500 and status not in (408, 429)


def _diff(a: bytes, b: bytes) -> str:
    at = next(
        (i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b))
    )
    here, there = a[at : at + 16], b[at : at + 16]
    return f"{len(a)} vs {len(b)} bytes, first difference at {at}: {here!r} vs {there!r}"


def _job_processes(node: SimNode, device: str) -> list[SimProcess]:
    """The live processes of any job started for ``device`` on this node.

    Hooks and verify scripts carry the job's ``RC_JOB_ID`` too, but are the
    worker's own; a process is told by the program it descends from (a fork
    keeps its parent's ``argv``).
    """
    scripts = _worker_scripts(node)
    return [
        p
        for p in node.host.live(device=device)
        if "RC_JOB_ID" in p.environ and p.argv[0] not in scripts
    ]


def _worker_scripts(node: SimNode) -> set[str]:
    """The programs the worker runs of its own: lease hooks and verify scripts."""
    paths = {h for d in node.config.devices for h in (d.on_acquire, d.on_release) if h}
    verify = Path(node.config.verify_dir)
    if verify.is_dir():
        paths.update(str(p) for p in verify.iterdir())
    return paths


@asynccontextmanager
async def open_fleet(
    hosts: int | Sequence[str] = 1,
    *,
    devices: Sequence[str | DeviceConfig] = ("gpu0",),
    root: str | Path | None = None,
    heartbeat_interval: float = 5.0,
    poll_wait: float = 30.0,
    store_config: StoreConfig | None = None,
    cgroups: bool = False,
    nvidia_smi: Script | None = None,
    seed: int | None = None,
    **config_fields: Any,
) -> AsyncIterator[Fleet]:
    """A controller and a worker per host, each on its own SimHost and state directory.

    ``nvidia_smi``: a script that stands for ``nvidia-smi`` on every host from the
    start (its output is what the real one prints for the worker's query); change
    it later with :meth:`Fleet.program_nvidia_smi`. Without it the hosts have no GPU tools.
    ``seed``: the controller's session tokens and every worker's ids and retry
    jitter come from generators seeded with it (see :func:`simulate`).

    ``hosts``: how many (named ``h0``, ``h1``...) or their names. ``devices``: names,
    or :class:`~rc_worker.config.DeviceConfig` with hooks, whose paths are
    programs of the SimHosts (:meth:`Fleet.program`). ``config_fields``
    go to every worker's :class:`~rc_worker.config.Config` (``require_manual_clear``,
    ``shutdown_grace``...). State lives under ``root`` (a temporary directory by
    default, removed afterwards). Workers start at once; leaving the block
    abandons whatever still runs (call :meth:`Fleet.drain` first for a clean end).
    ``cgroups``: the hosts have a cgroup v2 hierarchy the workers may use, so
    (with the default ``cgroup: auto``) every job runs in a cgroup of its own.
    """
    from rc_worker.testing import make_config

    names = [f"h{i}" for i in range(hosts)] if isinstance(hosts, int) else list(hosts)
    store = Store(
        store_config or StoreConfig(heartbeat_interval_s=heartbeat_interval, poll_wait_s=poll_wait),
        instance="sim",
        wall_clock=trio.current_time,
        rng=None if seed is None else random.Random(f"{seed}/controller"),
    )
    tokens = {f"rc-sim-{name}": name for name in names}
    app = create_app(store=store, worker_tokens=tokens, user_tokens=[f"{USER_TOKEN}=sim:admin"])
    with tempfile.TemporaryDirectory(prefix="rc-fleet-") as scratch:
        base = Path(root) if root is not None else Path(scratch)
        async with trio.open_nursery() as nursery:
            # As `rc serve` does: hosts are lost on time even when nobody calls.
            await nursery.start(housekeeping, app)
            fleet = Fleet(store, {}, nursery)
            fleet.seed = seed
            fleet._bin = base / "sim-bin"
            fleet._bin.mkdir(parents=True, exist_ok=True)
            fleet.worker_environ = {**WORKER_ENVIRON, "PATH": str(fleet._bin)}
            for name, token in ((n, t) for t, n in tokens.items()):
                config = make_config(
                    base / name,
                    devices=tuple(devices),
                    host=name,
                    token=token,
                    heartbeat_interval=heartbeat_interval,
                    poll_wait=poll_wait,
                    **config_fields,
                )
                node = SimNode(
                    name,
                    SimHost(name),
                    config,
                    FaultyTransport(httpx.ASGITransport(app=app), name=name),
                )
                node.host.cgroup_v2 = cgroups
                node.transport.on_request = _bind(fleet, node)
                node.transport.on_send = functools.partial(fleet._on_send, node)
                node.transport.on_answer = functools.partial(fleet._on_answer, node)
                fleet.nodes[name] = node
            if nvidia_smi is not None:
                fleet.program_nvidia_smi(nvidia_smi)
            for name in fleet.nodes:
                fleet.restart(name)
            try:
                yield fleet
            finally:
                nursery.cancel_scope.cancel()


def _bind(fleet: Fleet, node: SimNode) -> RequestHook:
    return lambda endpoint, request: fleet._on_request(node, endpoint, request)


class SimulationStalled(Exception):
    """Virtual time stopped while tasks kept running: a livelock, which never ends (invariant 6).

    ``trio.fail_after`` in virtual time cannot see one: the deadline never comes.
    """


WALL_LIMIT = 90.0
"""Real seconds a :func:`simulate` run may take (under the suite's 120 s per-test timeout)."""

STALL_STEPS = 200_000
"""Task steps at one virtual instant past which :func:`simulate` calls the run stalled."""


class SimulationTimedOut(Exception):
    """A simulation ran past its wall-clock limit (``simulate(wall_limit=...)``).

    Raised as an ordinary failure, before a per-test timeout would kill the
    process, so that hypothesis still prints the plan that caused it.
    """


WALL_CHECK_STEPS = 1000
"""Task steps between two looks at the wall clock."""


class _StallGuard(trio.abc.Instrument):
    def __init__(self, limit: int, wall_limit: float | None = None) -> None:
        self.limit = limit
        self.at = -math.inf
        self.steps = 0
        self.scope: trio.CancelScope | None = None
        self.stalled_at: float | None = None
        self.wall_deadline = math.inf if wall_limit is None else time.monotonic() + wall_limit
        self.timed_out = False
        self._since_wall = 0

    def before_task_step(self, task: trio.lowlevel.Task) -> None:
        self._since_wall += 1
        if self._since_wall >= WALL_CHECK_STEPS:
            self._since_wall = 0
            if time.monotonic() > self.wall_deadline and not self.timed_out and self.scope:
                self.timed_out = True
                self.scope.cancel()
        now = trio.current_time()
        if now != self.at:
            self.at, self.steps = now, 0
            return
        self.steps += 1
        if self.steps > self.limit and self.stalled_at is None and self.scope is not None:
            self.stalled_at = now
            self.scope.cancel()


def simulate(
    scenario: Callable[[Fleet], Awaitable[T]],
    *,
    time_limit: float = 3600.0,
    stall_steps: int = STALL_STEPS,
    wall_limit: float | None = WALL_LIMIT,
    seed: int | None = None,
    **fleet_args: Any,
) -> T:
    """Run ``scenario(fleet)`` in a fresh Trio run in virtual time, and return its result.

    ``fleet_args`` go to :func:`open_fleet`. Invariant 6, everything ends, is
    checked twice: a scenario still running after ``time_limit`` virtual
    seconds raises ``trio.TooSlowError``, and one whose virtual time stops
    (more than ``stall_steps`` task steps at one instant: something retries
    without ever sleeping) raises :class:`SimulationStalled`. A run still
    going after ``wall_limit`` real seconds raises :class:`SimulationTimedOut`
    (``None``: no limit), kept under pytest-timeout's so that the failure,
    and the hypothesis plan behind it, are reported rather than the process killed.

    ``seed``: replay exactly. The same seed and scenario give the same run: the
    controller's event log (:meth:`Fleet.events`), every job's output and the
    harness's log are identical between two runs. Without it, ids and jitter
    are random as in production (hypothesis still makes Trio's scheduling
    deterministic for its own examples).
    """
    guard = _StallGuard(stall_steps, wall_limit)
    if seed is not None:
        # Trio breaks ties between tasks ready at once with this generator (the
        # hook its hypothesis plugin seeds); with it and the fleet's generators
        # seeded, one seed and one scenario give one run, byte for byte.
        trio._core._run._r.seed(seed)
        fleet_args["seed"] = seed

    async def main() -> T:
        with trio.CancelScope() as scope:
            guard.scope = scope
            with trio.fail_after(time_limit):
                async with open_fleet(**fleet_args) as fleet:
                    return await scenario(fleet)
        if guard.timed_out:
            raise SimulationTimedOut(
                f"the simulation ran past its wall-clock limit of {wall_limit}s (virtual time "
                f"{trio.current_time():.3f}); a smaller plan, or a livelock that still sleeps"
            )
        raise SimulationStalled(
            f"virtual time stopped at {guard.stalled_at}: more than {stall_steps} task "
            "steps went by without it moving (something retries without sleeping)"
        )

    clock = trio.testing.MockClock(autojump_threshold=0)
    return trio.run(main, clock=clock, instruments=[guard])
