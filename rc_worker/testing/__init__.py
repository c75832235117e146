"""The test harness for programs that embed rc_worker.

``local_system`` runs the reference controller in-process and a worker
against it over ``httpx.ASGITransport`` (no sockets), and hands back a
``LocalSystem`` to submit jobs and watch them::

    async with local_system(config) as system:
        job_id = system.submit(["echo", "hello"])
        info = await system.wait_job(job_id)
        assert info.outcome == "succeeded"
        assert system.output(job_id) == b"hello\\n"

The worker runs for real: real processes, the real clock. Leaving the block
drains the worker (jobs finish, reports are delivered) unless ``stop()``,
``crash()`` or a cancellation came first.

``transport_wrapper`` wraps the transport between worker and controller
(fault injection: :class:`FaultyTransport` drops, delays or fails requests);
``crash()`` abandons the worker as a crash would, leaving its state directory
for the next ``local_system`` on the same config (and ``store``) to recover.

For fault simulations of whole fleets in virtual time (docs/simulation.md), this
package also exports what a harness author needs: :class:`SimHost`, :class:`Script`
and its steps, :func:`simulate`, :func:`open_fleet`, :class:`Fault`, and
:func:`fault_plans`, a hypothesis strategy of fault plans that
:meth:`Fleet.run_plan` plays (:func:`replay` replays a printed one exactly).
"""

from __future__ import annotations

import os
from collections.abc import AsyncIterator, Callable, Mapping
from contextlib import asynccontextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

import attrs
import httpx
import trio

from rc_worker.controller import create_app
from rc_worker.controller.messages import DeviceInfo, JobInfo
from rc_worker.controller.store import Store, StoreConfig
from rc_worker.core.config import Config, DeviceConfig, GpuHealthConfig
from rc_worker.host import Host
from rc_worker.worker import Worker

WORKER_TOKEN = "rc-test-worker-token"
USER_TOKEN = "rc-test-user-token"

if TYPE_CHECKING:
    from hypothesis.strategies import SearchStrategy

__all__ = [
    "USER_TOKEN",
    "WORKER_TOKEN",
    "EchoStdin",
    "Fault",
    "FaultyTransport",
    "Fleet",
    "FleetPlan",
    "Fork",
    "Hang",
    "LocalSystem",
    "OnSigterm",
    "Script",
    "SimHost",
    "Sleep",
    "Write",
    "fault_plans",
    "local_system",
    "make_config",
    "open_fleet",
    "replay",
    "simulate",
]


async def wait_until(store: Store, predicate: Callable[[], bool]) -> None:
    """Wait until ``predicate()`` holds, re-checking at every change of the controller's
    ``store``. A worker's own state changes do not notify the controller, so the check
    also runs every 50 ms; bound the wait with ``trio.fail_after``."""
    # Not in __all__ (the harness's exports are the names issue 9 pinned): for tests that
    # open a controller themselves, and for LocalSystem.wait_until.
    while not predicate():
        changed = trio.Event()
        unsubscribe = store.subscribe(changed.set)
        try:
            with trio.move_on_after(0.05):
                await changed.wait()
        finally:
            unsubscribe()


TransportWrapper = Callable[[httpx.AsyncBaseTransport], httpx.AsyncBaseTransport]
"""Given the transport to the controller, returns the one the worker uses."""


@attrs.define(eq=False)
class LocalSystem:
    store: Store
    http: httpx.AsyncClient
    worker: Worker
    config: Config
    _worker_scope: trio.CancelScope = attrs.field(factory=trio.CancelScope, alias="worker_scope")
    _worker_done: trio.Event = attrs.field(factory=trio.Event, alias="worker_done")

    @property
    def crashed(self) -> bool:
        return self._worker_scope.cancel_called

    async def crash(self) -> None:
        """Abandon the worker now, without draining, as if its process had died.

        Its tasks are cancelled: running jobs are killed on the way out (the
        shielded kill path), and whatever was not yet reported stays in the
        state directory, exactly as after a crash. The controller is not told.
        Returns once the worker has stopped; the block carries on.
        """
        self._worker_scope.cancel()
        await self._worker_done.wait()

    def submit(self, command: list[str], **fields: Any) -> str:
        """Queue a job at the controller; ``fields`` as ``Store.submit`` takes them."""
        return self.store.submit(command, **fields)

    def job(self, job_id: str) -> JobInfo:
        return self.store.job(job_id)

    def output(self, job_id: str) -> bytes:
        return self.store.output(job_id)

    def device(self, name: str) -> DeviceInfo:
        return self.store.device(self.config.host, name)

    async def wait_until(self, predicate: Callable[[], bool]) -> None:
        """Wait until ``predicate()`` holds, re-checking at every controller change
        (:func:`wait_until`); bound the wait with ``trio.fail_after``."""
        await wait_until(self.store, predicate)

    async def wait_job(self, job_id: str, states: frozenset[str] | None = None) -> JobInfo:
        """Wait for the job to reach one of ``states`` (default: any terminal state)."""

        def reached() -> bool:
            info = self.store.job(job_id)
            return info.terminal if states is None else info.state in states

        await self.wait_until(reached)
        return self.store.job(job_id)


@asynccontextmanager
async def local_system(
    config: Config,
    *,
    store: Store | None = None,
    host: Host | None = None,
    environ: Mapping[str, str] | None = None,
    transport_wrapper: TransportWrapper | None = None,
) -> AsyncIterator[LocalSystem]:
    """A reference controller and one worker, in this Trio run.

    ``transport_wrapper``, when given, receives the ASGI transport to the
    controller and returns the one the worker uses (tests wrap it to inject
    faults).
    """
    if store is None:
        store = Store(
            StoreConfig(
                heartbeat_interval_s=config.heartbeat_interval, poll_wait_s=config.poll_wait
            )
        )
    app = create_app(
        store=store,
        worker_tokens={WORKER_TOKEN: config.host},
        user_tokens=[f"{USER_TOKEN}=tester:admin"],
    )
    config = attrs.evolve(config, token=WORKER_TOKEN)
    transport: httpx.AsyncBaseTransport = httpx.ASGITransport(app=app)
    if transport_wrapper is not None:
        transport = transport_wrapper(transport)
    async with httpx.AsyncClient(transport=transport, base_url="http://controller") as http:
        worker = Worker(config, http=http, host=host, environ=environ)
        system = LocalSystem(store=store, http=http, worker=worker, config=config)
        async with trio.open_nursery() as nursery:
            await nursery.start(_run_worker, system)
            try:
                yield system
            except BaseException:
                nursery.cancel_scope.cancel()
                raise
            if not system.crashed:
                worker.drain()


async def _run_worker(
    system: LocalSystem, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
) -> None:
    # The worker runs in a scope of its own so that crash() can end it
    # without cancelling the test's block, which runs in the outer nursery.
    try:
        with system._worker_scope:
            await system.worker.run(task_status=task_status)
    finally:
        system._worker_done.set()


def make_config(
    state_dir: str | os.PathLike[str],
    *,
    devices: tuple[str | DeviceConfig, ...] = ("gpu0",),
    **overrides: Any,
) -> Config:
    """A config for tests: everything under ``state_dir``, short intervals.

    Probe, verify and sheet directories point inside ``state_dir`` (absent
    unless the test creates them), so nothing from the machine leaks in.
    """
    root = Path(state_dir)
    fields: dict[str, Any] = {
        "devices": tuple(DeviceConfig(name=d) if isinstance(d, str) else d for d in devices),
        "host": "test-host",
        "state_dir": str(root / "state"),
        "probe_dir": str(root / "probe.d"),
        "verify_dir": str(root / "verify.d"),
        "sheet_dir": str(root / "sheets"),
        "heartbeat_interval": 0.5,
        "poll_wait": 5.0,
        "probe_timeout": 5.0,
        "verify_timeout": 10.0,
        "verify_pass_budget": 20.0,
        "shutdown_grace": 30.0,
        # Off unless a test turns it on: the machine's own nvidia-smi must not
        # leak into a test (docs/configuration.md, gpu_health).
        "gpu_health": GpuHealthConfig(enabled="false", kernel_log=str(root / "kmsg")),
    }
    fields.update(overrides)
    return Config(**fields)


def fault_plans(
    *, hosts: int | None = None, devices: int | None = None, max_jobs: int = 5
) -> SearchStrategy[FleetPlan]:
    """A hypothesis strategy of fault plans for :meth:`Fleet.run_plan`.

    Outages and injected faults per endpoint, crashes with and without a reboot,
    restarts, stops and drains, full disks, failing verify scripts and hooks,
    cancels, idle-behaviour changes, health faults, a failing ``nvidia-smi``;
    ``hosts`` hosts of ``devices`` devices each (one or two, drawn, when ``None``),
    up to ``max_jobs`` jobs. Needs hypothesis (the ``test`` extra), imported only here.
    """
    from rc_worker.testing.strategies import fault_plans as strategy

    return strategy(hosts=hosts, devices=devices, max_jobs=max_jobs)


# The simulation harness, after what it builds on above (the fleet uses make_config).
from rc_worker.testing.fleet import Fleet, open_fleet, simulate  # noqa: E402
from rc_worker.testing.plans import FleetPlan, replay  # noqa: E402
from rc_worker.testing.sim import (  # noqa: E402
    EchoStdin,
    Fork,
    Hang,
    OnSigterm,
    Script,
    SimHost,
    Sleep,
    Write,
)
from rc_worker.testing.transport import Fault, FaultyTransport  # noqa: E402
