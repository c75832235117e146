"""Fault simulations of whole fleets: one reference controller, N workers, virtual time.

Every worker runs unchanged on its own :class:`~rc_worker.testing.sim.SimHost`
and its own state directory, against one in-process reference controller
(:class:`~rc_worker.testing.simclient.SimClient` over
:class:`~rc_worker.testing.asgi.InProcessTransport`, no sockets), all in one Trio run under
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

The concepts live in their own modules: the transport and its faults
(:mod:`rc_worker.testing.transport`), the invariant checks
(:mod:`rc_worker.testing.invariants`), the stall guard (:mod:`rc_worker.testing.guard`)
and fault plans (:mod:`rc_worker.testing.plans`); this module is the harness,
and keeps every name it always exported.
"""

from __future__ import annotations

import contextlib
import functools
import math
import random
import tempfile
import warnings
from collections.abc import (
    AsyncIterator,
    Awaitable,
    Callable,
    Iterable,
    Iterator,
    Mapping,
    Sequence,
)
from contextlib import asynccontextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import attrs
import httpx
import trio
import trio.testing

from rc_worker.changed import Changed
from rc_worker.controller import create_app
from rc_worker.controller.messages import TERMINAL_STATES, Event, JobInfo
from rc_worker.controller.serve import housekeeping
from rc_worker.controller.store import Store, StoreConfig
from rc_worker.core.config import Config, DeviceConfig
from rc_worker.testing import invariants
from rc_worker.testing.asgi import InProcessTransport
from rc_worker.testing.gcpause import collector_paused, keep_bounded
from rc_worker.testing.guard import (
    STALL_STEPS,
    WALL_LIMIT,
    SimulationStalled,
    SimulationTimedOut,
    StallGuard,
)
from rc_worker.testing.guard import WALL_CHECK_STEPS as WALL_CHECK_STEPS
from rc_worker.testing.sim import Script, SimHost
from rc_worker.testing.simclient import SimClient
from rc_worker.testing.transport import (
    ENDPOINTS,
    Exchange,
    Fault,
    FaultyTransport,
)
from rc_worker.testing.transport import TIMEOUT_S as TIMEOUT_S
from rc_worker.testing.transport import endpoint_of as endpoint_of
from rc_worker.worker import Worker

if TYPE_CHECKING:
    from rc_worker.testing.plans import FleetPlan

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
    vanished: set[str] = attrs.Factory(set)
    """Jobs whose directory the harness made vanish (``disk_fault``): their spool with it."""
    power_losses: list[float] = attrs.Factory(list)
    """Virtual times the harness cut the host's power (``disk_fault``, ``torn``)."""
    stops: list[float] = attrs.Factory(list)
    """Virtual times the worker was stopped (two signals, :meth:`Fleet.stop` without
    ``drain``): it waits for the controller a bounded time only."""
    full_disk: list[list[float]] = attrs.Factory(list)
    """``[from, until]`` of each time the harness filled the host's disk (``disk_fault``,
    ``full``); ``until`` is infinite until it is repaired."""
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
        self.worker_environ: Mapping[str, str] = WORKER_ENVIRON
        """The environment every worker process starts with (``PATH`` is the fleet's bin)."""
        self._bin: Path | None = None
        self._watch = invariants.Watch(self._violation, self._smi_path)

    # -- driving --

    def program(self, name: str, script: Script) -> None:
        """Register ``name`` on every host (see :meth:`SimHost.program`)."""
        for node in self.nodes.values():
            node.host.program(name, script)

    def verify_script(self, name: str, script: Script) -> None:
        """Add ``name`` to every worker's verify pass, running ``script`` (installed on
        each SimHost's disk, where the pass lists ``verify_dir``)."""
        for node in self.nodes.values():
            node.host.program(str(Path(node.config.verify_dir) / name), script)

    def program_nvidia_smi(self, script: Script) -> None:
        """``nvidia-smi`` on every host runs ``script`` from now on.

        It stands in the fleet's ``PATH`` on each SimHost's disk, where the worker
        looks for it. Give it to :func:`open_fleet` to have it there from the
        start, as on a GPU host.
        """
        assert self._bin is not None
        for node in self.nodes.values():
            node.host.program(str(self._bin / "nvidia-smi"), script)
        self._note("nvidia-smi reprogrammed")

    def probe_script(self, name: str, script: Script) -> None:
        """Add the drop-in probe ``name`` (in every worker's ``probe_dir``) running ``script``."""
        for node in self.nodes.values():
            node.host.program(str(Path(node.config.probe_dir) / name), script)

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
        self._watch.forget(name)
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
            node.stops.append(trio.current_time())
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
        self._watch.new_process(name)
        node.transport.down = False
        node.running = True
        node._scope = trio.CancelScope()
        node._started = trio.Event()
        node._done = trio.Event()
        node.incarnations += 1
        # Built here, not in the task, so that node.worker is never the dead one.
        http = SimClient(transport=node.transport, base_url="http://controller")
        # No rng given: the worker takes its host's (SimHost.new_rng), one stream per
        # worker process, the same in every replay of a seeded fleet.
        node.worker = Worker(node.config, http=http, host=node.host, environ=self.worker_environ)
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
            if (
                info.state != "quarantined"
                or node is None
                or invariants.job_processes(node, info.name)
            ):
                continue
            self.store.clear(info.host, info.name)
            cleared.append(info.address)
        if cleared:
            self._note(f"operator clears {cleared}")
        return cleared

    async def wait_until(self, predicate: Callable[[], bool], *, interval: float = 1.0) -> None:
        """Wait for ``predicate()``, re-checked at every controller change and every
        ``interval`` virtual seconds (process tables change without telling anyone)."""
        if predicate():
            return
        changed = Changed()
        unsubscribe = self.store.subscribe(changed.notify)  # once, not at every change
        try:
            while not predicate():
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
                await self.wait_until(self._all_ended)
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
        report still on its way is not yet committed. The checks are
        :mod:`rc_worker.testing.invariants`.
        """
        return invariants.check(self)

    async def run_plan(self, plan: FleetPlan) -> list[str]:
        """Play a fault plan (:func:`rc_worker.testing.fault_plans` draws them), then lift
        every fault, bring every worker back, settle and drain; the invariant violations.

        Open the fleet with ``plan.fleet_args()`` (its hosts, devices and settings).
        """
        from rc_worker.testing.plans import play

        return await play(self, plan)

    # -- internals --

    def _all_ended(self) -> bool:
        # Counted, not viewed: a queued job's view explains why it waits, for every
        # candidate device, and this runs at every change of the controller.
        return set(self.store.job_state_counts()) <= TERMINAL_STATES

    def _select(self, hosts: Iterable[str] | None) -> list[SimNode]:
        return list(self.nodes.values()) if hosts is None else [self.nodes[h] for h in hosts]

    def _note(self, text: str) -> None:
        self.log.append((trio.current_time(), text))

    def _violation(self, text: str) -> None:
        self._note(f"VIOLATION: {text}")
        self.violations.append(f"t={trio.current_time():.3f}: {text}")

    def _smi_path(self) -> Path | None:
        return None if self._bin is None else self._bin / "nvidia-smi"

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
    or :class:`~rc_worker.core.config.DeviceConfig` with hooks, whose paths are
    programs of the SimHosts (:meth:`Fleet.program`). ``config_fields``
    go to every worker's :class:`~rc_worker.core.config.Config` (``require_manual_clear``,
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
            fleet._bin = base / "sim-bin"
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
                    SimHost(name, seed=seed),
                    config,
                    FaultyTransport(InProcessTransport(app), name=name),
                )
                node.host.cgroup_v2 = cgroups
                node.transport.on_request = functools.partial(fleet._watch.on_request, node)
                node.transport.on_send = functools.partial(fleet._watch.on_send, node)
                node.transport.on_answer = functools.partial(fleet._watch.on_answer, node)
                fleet.nodes[name] = node
            if nvidia_smi is not None:
                fleet.program_nvidia_smi(nvidia_smi)
            for name in fleet.nodes:
                fleet.restart(name)
            try:
                yield fleet
            finally:
                nursery.cancel_scope.cancel()


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
    clock = trio.testing.MockClock(autojump_threshold=0)
    guard = StallGuard(stall_steps, wall_limit, clock, every=keep_bounded)
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

    with collector_paused():  # a tenth of a run's time otherwise (gcpause)
        if seed is None:
            return trio.run(main, clock=clock, instruments=[guard])
        with _deterministic_scheduling():
            return trio.run(main, clock=clock, instruments=[guard])


@contextlib.contextmanager
def _deterministic_scheduling() -> Iterator[None]:
    """Trio's scheduler as hypothesis's Trio plugin sets it, for one seeded run.

    By default Trio runs the tasks ready at one instant in the order they became
    ready (reversed half the time), and ties between deadlines are broken by
    memory address: a run then depends on what the process did before. Under
    pytest the hypothesis plugin sorts each batch by task creation before the
    seeded shuffle; a replay line pasted into a plain ``python`` must run the
    same way, or it is not the run that failed
    (``tests/sim/test_replay_in_a_fresh_process.py``).
    """
    module = trio._core._run
    if not hasattr(module, "_ALLOW_DETERMINISTIC_SCHEDULING"):
        # A Trio that changed this private switch: the run still works, and replays
        # exactly where hypothesis's plugin (which Trio keeps working) is loaded.
        warnings.warn(
            "this Trio has no _ALLOW_DETERMINISTIC_SCHEDULING: a seeded simulation replays "
            "exactly only with hypothesis imported",
            RuntimeWarning,
            stacklevel=3,
        )
        yield
        return
    before = module._ALLOW_DETERMINISTIC_SCHEDULING
    setattr(module, "_ALLOW_DETERMINISTIC_SCHEDULING", True)  # noqa: B010 (a Final)
    try:
        yield
    finally:
        setattr(module, "_ALLOW_DETERMINISTIC_SCHEDULING", before)  # noqa: B010
