"""Worker: the root of the nursery tree.

::

    Worker.run()                       root nursery
    ├── heartbeat loop                 device states up; cancels, idle behaviour, clears down
    ├── poll manager                   one long poll per batch of newly ready devices
    ├── cancel watch                   a long poll the controller answers with a cancel
    ├── probe loop                     a probe pass every probe_interval; labels after each
    ├── outbox                         output, finish and fault reports, from disk
    └── one DeviceSupervisor per device

``drain()`` stops taking work, lets running jobs finish, releases held
devices, delivers every report, deregisters, then returns from ``run``.
``stop()`` does the same but stops running jobs first (grace ceilings
honoured) and does not wait for a controller that does not take the reports:
they stay on disk for the next start. Cancelling
the scope around ``run`` abandons everything at once: jobs are killed
(shielded, bounded) and whatever was not reported stays on disk for the
next start to recover.
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Mapping
from contextlib import AbstractContextManager, AsyncExitStack
from functools import partial
from pathlib import Path
from typing import Any

import httpx
import trio
from prometheus_client import Counter

from rc_worker._version import __version__
from rc_worker.cancel_watch import Orders, watch_cancels
from rc_worker.cgroup import clear_strays, start_containment, state_tag
from rc_worker.cgroup import remove as remove_cgroup
from rc_worker.changed import Changed
from rc_worker.client import ControllerClient
from rc_worker.context import WorkerContext, warn_token_file_mode
from rc_worker.core.config import Config, cgroup_needs
from rc_worker.core.errors import ConfigError, ControllerError
from rc_worker.core.labels import ProbeResult, labels_payload
from rc_worker.core.model import (
    PROTOCOL_VERSION,
    IdleBehavior,
    job_key,
)
from rc_worker.core.protocol import (
    NO_SESSION,
    CancelOrder,
    DeviceReport,
    HeartbeatReply,
    LabelsRequest,
    LabelsUpdate,
    PollReply,
    RegisterRequest,
    SheetsRequest,
    SheetsUpdate,
)
from rc_worker.device import DeviceSupervisor
from rc_worker.durable import Committer
from rc_worker.gpu_health_coord import GpuHealthCoordinator
from rc_worker.gpu_health_run import GpuHealthMonitor
from rc_worker.health import not_ready_reason
from rc_worker.host import Host, LinuxHost
from rc_worker.metrics import StateSnapshot, WorkerMetrics
from rc_worker.operator_errors import register_refused
from rc_worker.outbox import Outbox
from rc_worker.probe import Prober
from rc_worker.recovery import Damaged, Recovered, recover
from rc_worker.sheets import SheetReader
from rc_worker.spool import ensure_state_dir, make_dirs_durably
from rc_worker.status import serve_status, status_app
from rc_worker.worker_poll import Polling

log = logging.getLogger("rc_worker.worker")

# Stopping (a second signal) waits this long at most for reports the
# controller has not taken, and a drained worker as long for its deregister.
STOP_REPORT_WINDOW_S = 3.0


class Worker(Polling):
    """One worker process's service. ``await nursery.start(worker.run)``.

    ``http`` is the one ``httpx.AsyncClient`` to the controller; tests and
    simulations hand in one over ``httpx.ASGITransport``. Without it the
    worker opens its own to ``config.controller_url``.
    """

    def __init__(
        self,
        config: Config,
        *,
        http: httpx.AsyncClient | None = None,
        host: Host | None = None,
        environ: Mapping[str, str] | None = None,
        rng: random.Random | None = None,
    ) -> None:
        import os

        self.config = config
        self.host: Host = host if host is not None else LinuxHost()
        self._http = http
        self._environ = dict(os.environ if environ is None else environ)
        self.devices: dict[str, DeviceSupervisor] = {}
        self.recovered: list[Recovered] = []
        self._ctx: WorkerContext | None = None
        self._poll_wake = Changed()
        # Rejections of a poll's assignments still being written to disk.
        self._rejecting = 0
        # Every (job_id, attempt) this process was assigned: one set entry per job, a few
        # dozen bytes each, so a process that runs a million jobs holds a few tens of MB.
        self._seen_attempts: set[tuple[str, int]] = set()
        self._drained = trio.Event()
        self._heartbeat_interval = config.heartbeat_interval
        # Set to send the next heartbeat now: a clear was applied, and the controller
        # assigns nothing to a device while a heartbeat last reported it holding a fault.
        self._heartbeat_now = trio.Event()
        # The token of the idle behaviours and clears last applied (the watch's and the
        # heartbeat's, see cancel_watch.Orders).
        self._orders = Orders()
        self._poll_wait = config.poll_wait
        self._reprobe = trio.Event()
        self._prober = Prober(config, host=self.host, environ=self._environ)
        self._sheets = SheetReader(config.sheet_dir, config.device_names, self.host.store)
        self.registered = trio.Event()
        self._nursery: trio.Nursery | None = None
        self._labels: dict[str, Any] = {"host": {}, "devices": {}}
        self._probe_result: ProbeResult | None = None
        self.health: GpuHealthCoordinator | None = None
        # What the controller has of them (sent at register or by PUT): an
        # unchanged probe pass sends nothing, which at fleet scale is most of them.
        self._labels_sent: dict[str, Any] | None = None
        self._last_probe: list[dict[str, Any]] = []
        self.metrics = WorkerMetrics()
        self.metrics.watch(self._state_snapshot)
        self._answer_counters: dict[tuple[str, str], Counter] = {}
        self._spool_bytes = 0
        """The job spool's size, as of the last ``/metrics`` scrape (walked in a thread)."""
        self.status_urls: list[str] = []
        self._last_answer: float | None = None
        self._register_scope: trio.CancelScope | None = None
        # Who this process is, for the controller's "same process or new" at
        # register; in memory only, so no later process can repeat it.
        # ``rng``: every id and jitter of this worker; a simulation seeds it so that
        # a run replays exactly. By default, the host's (fresh entropy on a real one).
        self._rng = rng if rng is not None else self.host.new_rng()
        self.instance_id = f"{self._rng.getrandbits(64):016x}"
        self._poll_seq = 0

    # -- control ------------------------------------------------------------

    @property
    def draining(self) -> bool:
        return self._ctx is not None and self._ctx.draining

    def drain(self) -> None:
        """Take no new work; finish, release and report; then ``run`` returns."""
        if self._ctx is None or self._ctx.draining:
            return
        log.info("draining: no new work; running jobs finish, then the worker exits")
        self._ctx.draining = True
        if self._register_scope is not None:
            self._register_scope.cancel()
        if self._nursery is not None:
            self._nursery.start_soon(self._drain_deadline)
        self._poke_all()

    def stop(self) -> None:
        """Drain, but stop running jobs first (each with its grace ceiling)."""
        self.drain()
        if self._ctx is None or self._ctx.stopping:
            return
        log.info("stopping: running jobs are cancelled")
        self._ctx.stopping = True
        for dev in self.devices.values():
            dev.stop_for_shutdown()

    def reprobe(self) -> None:
        """Run a probe pass and re-read the sheets now (SIGHUP)."""
        self._reprobe.set()

    def _poke_all(self) -> None:
        self._poke_poller()
        for dev in self.devices.values():
            dev.poke()

    # -- the service ----------------------------------------------------------

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        # The lock comes before anything reads or writes the state directory:
        # a second worker on it must be refused touching nothing.
        with self._lock_state_dir():
            await self._run_locked(task_status)

    def _lock_state_dir(self) -> AbstractContextManager[object]:
        root = Path(self.config.state_dir)
        try:
            make_dirs_durably(root, self.host.store)
        except OSError as e:
            raise _state_dir_error(self.config.state_dir, e) from None
        return self.host.store.lock(root, pid=self.host.own_pid())

    async def _run_locked(self, task_status: trio.TaskStatus[None]) -> None:
        try:
            root = ensure_state_dir(self.config.state_dir, self.host.store)
        except OSError as e:
            raise _state_dir_error(self.config.state_dir, e) from None
        warning = warn_token_file_mode(self.config.token_file)
        if warning:
            log.warning("%s", warning)
        boot_id = self.host.boot_id()
        # Before anything is spawned (probes included): a cgroup per process.
        containment = start_containment(
            self.host,
            self.config.cgroup,
            tag=state_tag(self.config.state_dir),
            needs=cgroup_needs(self.config),
        )
        try:
            await self._serve(root, boot_id, task_status)
        finally:
            if containment is not None:
                # Empty cgroups only: one a survivor still holds stays, for
                # the next start's recovery to find.
                remove_cgroup(self.host, containment.tree)

    async def _serve(self, root: Path, boot_id: str, task_status: trio.TaskStatus[None]) -> None:
        async with AsyncExitStack() as stack:
            http = self._http
            if http is None:
                http = await stack.enter_async_context(self._open_http())
            client = ControllerClient(
                http,
                host=self.config.host,
                token=self.config.token,
                on_unknown_session=self._register,
                on_answer=self._on_answer,
                rng=self._rng,
                urls=self.config.controller_urls,
            )
            committer = Committer(self.host.run_blocking, store=self.host.store)
            outbox = Outbox(
                root, client, on_change=self._poke_poller, committer=committer, rng=self._rng
            )
            ctx = WorkerContext(
                config=self.config,
                host=self.host,
                client=client,
                outbox=outbox,
                root=root,
                boot_id=boot_id,
                environ=self._environ,
                poke_poller=self._poke_poller,
                metrics=self.metrics,
                rng=self._rng,
            )
            self._ctx = ctx
            self.devices = {d.name: DeviceSupervisor(ctx, d) for d in self.config.devices}
            self._setup_health(ctx, root)
            for device, fault_id, reason, kind, parent in outbox.faults_on_disk():
                if device in self.devices:
                    self.devices[device].add_fault(
                        fault_id, f"undelivered fault: {reason}", kind=kind, parent_fault=parent
                    )
            for device_name, why in outbox.damaged:
                self._quarantine_damaged(device_name, why)
            async with trio.open_nursery() as nursery:
                self._nursery = nursery
                if self.config.status_listen is not None:
                    # Up before register, so /readyz can say "not registered"
                    # through a controller outage.
                    listen = self.config.status_listen
                    app = status_app(
                        self.status,
                        self.metrics,
                        token=self.config.status_token,
                        private=listen.startswith("unix:"),
                        before_scrape=self._measure_spool,
                    )
                    self.status_urls = await nursery.start(
                        serve_status, app, self.config.status_listen
                    )
                    log.info("status and metrics at %s", ", ".join(self.status_urls))
                self._apply_probe(await self._gather())
                damaged: list[Damaged] = []
                self.recovered = await recover(
                    root,
                    boot_id=boot_id,
                    require_manual_clear=self.config.require_manual_clear,
                    host=self.host,
                    committer=committer,
                    damaged=damaged,
                )
                for d in damaged:
                    if (
                        d.report is not None
                        and d.job_dir is not None
                        and d.job_id is not None
                        and d.attempt is not None
                    ):
                        # A previous process's attempt: the controller may hold some
                        # of its output already, so the delivery asks (not fresh).
                        outbox.hold_report(d.job_dir, d.job_id, d.attempt, d.report, fresh=False)
                    self._quarantine_damaged(d.device, d.why)
                if self.host.containment is not None:
                    kept = {job_key(r.job_id, r.attempt) for r in self.recovered}
                    await clear_strays(self.host, self.host.containment, keep=kept)
                with trio.CancelScope() as self._register_scope:
                    await self._first_register(client, http)
                self._register_scope = None
                if not self.registered.is_set():
                    # Told to stop while the controller was not answering:
                    # nothing ran, and what the journal holds stays for later.
                    log.info("stopped before the controller answered a register")
                    nursery.cancel_scope.cancel()
                    return
                await nursery.start(outbox.run)
                for dev in self.devices.values():
                    await nursery.start(dev.run)
                nursery.start_soon(self._heartbeat_loop, client)
                nursery.start_soon(self._poll_manager, client, nursery)
                nursery.start_soon(self._probe_loop, client)
                nursery.start_soon(
                    partial(
                        watch_cancels,
                        client,
                        held=self._held_jobs,
                        apply=self._apply_cancel,
                        changed=self._poll_wake.watch,
                        wait_s=lambda: self._poll_wait,
                        pause_s=lambda: self._heartbeat_interval,
                        waiting=self._awaits_controller,
                        apply_control=self._apply_control,
                        orders=self._orders,
                    )
                )
                if self.health is not None:
                    nursery.start_soon(self._health_loop, client, self.health)
                task_status.started()
                await self._until_drained(outbox)
                await self._deregister(client, outbox)
                nursery.cancel_scope.cancel()
        log.info("worker stopped")

    def _setup_health(self, ctx: WorkerContext, root: Path) -> None:
        """The GPU health checks (issue 15), when this host declares a GPU device."""
        monitor = GpuHealthMonitor(
            self.config, host=self.host, environ=self._environ, metrics=self.metrics, state_dir=root
        )
        if not monitor.targets or self.config.gpu_health.enabled == "false":
            return
        self.health = GpuHealthCoordinator(self.config, monitor, ctx, self.devices)
        ctx.health_gate = self.health.gate

    async def _health_loop(self, client: ControllerClient, health: GpuHealthCoordinator) -> None:
        """Idle devices every ``gpu_health.interval``; labels follow what it found."""
        while True:
            if health.monitor.enabled():
                try:
                    await health.check_idle()
                except Exception as e:
                    # Output no check foresaw must not take the worker, and every device's
                    # jobs, down with it: the check before each job still stands (and fails
                    # closed), and this one runs again at the next interval.
                    log.error(
                        "the idle GPU health check failed (%s: %s); trying again in %.0fs",
                        type(e).__name__,
                        e,
                        self.config.gpu_health.interval,
                        exc_info=log.isEnabledFor(logging.DEBUG),
                    )
                self._rebuild_labels()
                await self._send_labels(client)  # only when they changed
            await trio.sleep(self.config.gpu_health.interval)

    def _open_http(self) -> httpx.AsyncClient:
        urls = self.config.controller_urls
        if not urls:
            raise ControllerError(0, "no_controller", "config has no controller_url")
        return httpx.AsyncClient(base_url=urls[0], timeout=httpx.Timeout(30.0))

    async def _until_drained(self, outbox: Outbox) -> None:
        """Return once draining, every device is idle and every report delivered.

        Stopping (a second signal) does not wait on the controller: once every
        device is idle, reports it has not taken within ``STOP_REPORT_WINDOW_S``
        stay on disk and go out after the next start. One held in memory only (the
        disk refused it, or its directory vanished) is written to disk first, within
        the window; one the disk still refuses is lost, and the log line says so.
        """
        assert self._ctx is not None
        while True:
            wake = self._poll_wake.watch()
            if self._ctx.draining and all(dev.idle() for dev in self.devices.values()):
                # Rejections still being written are owed too.
                if outbox.pending() == 0 and self._rejecting == 0:
                    return
                if self._ctx.stopping:
                    break
            await wake.wait()
        with trio.move_on_after(STOP_REPORT_WINDOW_S):
            # A report held in memory only (the disk refused it) is written first,
            # within the same window, so that it too stays for the next start.
            await outbox.write_held_reports()
            while outbox.pending() or self._rejecting:
                await self._poll_wake.wait()
            return
        lost = outbox.held_in_memory()
        if lost:
            log.error(
                "stopping with %d report(s) the controller has not taken; %d of them "
                "the disk would not take and are lost (%s); the rest stay in %s and are "
                "delivered after the next start",
                outbox.pending(),
                len(lost),
                ", ".join(lost),
                self.config.state_dir,
            )
        else:
            log.warning(
                "stopping with %d report(s) the controller has not taken; they stay in %s "
                "and are delivered after the next start",
                outbox.pending(),
                self.config.state_dir,
            )

    async def _deregister(self, client: ControllerClient, outbox: Outbox) -> None:
        # Only after a complete drain: a worker that still owes reports must
        # look lost to the controller until it comes back with them.
        if outbox.pending() or client.session is None:
            return
        with trio.move_on_after(STOP_REPORT_WINDOW_S):
            try:
                await client.deregister()
                log.info("told the controller this worker is leaving (deregister)")
            except ControllerError as e:
                log.warning("deregister refused: %s", e)

    async def _first_register(self, client: ControllerClient, http: httpx.AsyncClient) -> None:
        try:
            await self._register(client)
        except ControllerError as e:
            refused = register_refused(e, url=str(http.base_url), host=self.config.host)
            if refused is None:
                raise
            raise refused from None

    def _on_answer(self, endpoint: str, status: str) -> None:
        # The labelled child, kept: labels() takes a lock and builds a key every time,
        # and this runs for every answer.
        counter = self._answer_counters.get((endpoint, status))
        if counter is None:
            counter = self.metrics.controller_requests.labels(endpoint, status)
            self._answer_counters[(endpoint, status)] = counter
        counter.inc()
        if status.isdigit() and int(status) < 500:
            self._last_answer = trio.current_time()
            if status.startswith("2"):
                self.metrics.controller_last_success.set(time.time())

    def readiness(self) -> str | None:
        """None when ready for work (``/readyz`` 200), else why not."""
        try:
            now = trio.current_time()
        except RuntimeError:
            now = self._last_answer or 0.0  # outside Trio: silence cannot be judged
        return not_ready_reason(
            registered=self.registered.is_set(),
            draining=self.draining,
            last_answer=self._last_answer,
            now=now,
            heartbeat_interval=self._heartbeat_interval,
        )

    async def _drain_deadline(self) -> None:
        # shutdown_grace bounds the drain: past it, running jobs are stopped.
        await trio.sleep(self.config.shutdown_grace)
        if self._ctx is not None and not self._ctx.stopping:
            log.warning(
                "drain still running after shutdown_grace (%gs); stopping jobs",
                self.config.shutdown_grace,
            )
            self.stop()

    # -- what it says about itself ---------------------------------------------

    def status(self) -> dict[str, Any]:
        """The worker's own account of itself (``GET /status``)."""
        ctx = self._ctx
        not_ready = self.readiness()
        return {
            "version": __version__,
            "host": self.config.host,
            "session": ctx.client.session if ctx is not None else None,
            "registered": self.registered.is_set(),
            "ready": not_ready is None,
            "not_ready_reason": not_ready,
            "draining": self.draining,
            "stopping": ctx is not None and ctx.stopping,
            "devices": {name: dev.status() for name, dev in self.devices.items()},
            "reports_pending": ctx.outbox.pending() if ctx is not None else 0,
            "recovered": [r.register_entry() for r in self.recovered],
            "labels": self._labels,
            "last_probe": self._last_probe,
        }

    async def _measure_spool(self) -> None:
        # A walk of every spooled file: never on the event loop (a long outage spools many).
        walk = partial(self.host.store.tree_bytes, Path(self.config.state_dir) / "jobs")
        self._spool_bytes = await self.host.run_blocking(walk)

    def _state_snapshot(self) -> StateSnapshot:
        return StateSnapshot(
            devices={
                name: (dev.lease.state, dev.lease.idle_behavior)
                for name, dev in self.devices.items()
            },
            reports_pending=self._ctx.outbox.pending() if self._ctx is not None else 0,
            registered=self.registered.is_set(),
            draining=self.draining,
            spool_bytes=self._spool_bytes,
        )

    # -- register -------------------------------------------------------------

    async def _register(self, client: ControllerClient) -> None:
        assert self._ctx is not None
        labels = self._labels
        payload = RegisterRequest(
            boot_id=self._ctx.boot_id,
            devices=tuple(
                self.devices[d.name].register_decl(d.labels) for d in self.config.devices
            ),
            worker_version=__version__,
            pid=self.host.own_pid(),
            instance_id=self.instance_id,
            labels=_labels_update(labels),
            sheets=_sheets_update(self._sheets.read()),
            # Only claims whose lost finish is still undelivered: a
            # re-registration must not repeat what the controller settled.
            recovery=tuple(
                r.register_message()
                for r in self.recovered
                if self.host.store.exists(self._ctx.root / "jobs" / job_key(r.job_id, r.attempt))
            ),
            require_manual_clear=self.config.require_manual_clear,
            protocol=PROTOCOL_VERSION,
        )
        answer = await client.register(payload)
        self._labels_sent = labels
        log.info("registered with the controller as session %s", client.session)
        theirs = answer.protocol
        if theirs != PROTOCOL_VERSION:
            log.warning(
                "the controller speaks protocol %s, this worker %d; upgrade the older one",
                theirs if theirs is not None else "1 (or older)",
                PROTOCOL_VERSION,
            )
        self._heartbeat_interval = _positive(answer.heartbeat_interval_s, self._heartbeat_interval)
        self._poll_wait = _positive(answer.poll_wait_s, self._poll_wait)
        for name, info in answer.devices.items():
            dev = self.devices.get(name)
            if dev is None:
                continue
            if info.state == "quarantined":
                for fault_id in info.faults or (info.fault_id,):
                    if fault_id:
                        dev.add_fault(fault_id, info.reason or "controller")
            self._set_idle(dev, info.idle_behavior)
        # The reply may be older than what a watch brought: the next watch asks afresh,
        # and is answered at once with what stands. The one in flight is left alone:
        # this registration may be running inside it (cancel_watch.Orders.forget).
        self._orders.forget(ask_again=False)
        self.registered.set()

    # -- loops ----------------------------------------------------------------

    async def _heartbeat_loop(self, client: ControllerClient) -> None:
        while True:
            with trio.move_on_after(self._heartbeat_interval):
                await self._heartbeat_now.wait()
            self._heartbeat_now = trio.Event()
            try:
                # Read afresh at each try: a retried heartbeat must not carry
                # the states of before the outage.
                answer = await client.heartbeat_reply(self._heartbeat_states)
            except ControllerError as e:
                log.error("heartbeat refused: %s", e)
                continue
            self._apply_heartbeat(answer)

    def _heartbeat_states(self) -> dict[str, DeviceReport]:
        return {name: dev.heartbeat_report() for name, dev in self.devices.items()}

    def _apply_heartbeat(self, answer: HeartbeatReply) -> None:
        for cancel in answer.cancel:
            self._apply_cancel(cancel)
        if self._apply_control(answer):
            # Possibly older than what the watch brought (computed before a change, delivered
            # after): the watch asks again at once, and hears what stands now.
            self._orders.forget()

    def _apply_control(self, answer: HeartbeatReply | PollReply) -> bool:
        """The idle behaviours and clears of a heartbeat's answer or a host watch's;
        whether they changed anything here."""
        changed = False
        for name, value in answer.idle_behavior.items():
            if name in self.devices:
                changed = self._set_idle(self.devices[name], value) or changed
        for name, ids in answer.cleared.items():
            if name in self.devices and self.devices[name].clear_faults(set(ids)):
                changed = True
                # Reported at once: until a heartbeat says the fault is gone, the
                # controller offers the device nothing (a worker's word is fact).
                self._heartbeat_now.set()
        self._poke_poller()
        return changed

    def _awaits_controller(self) -> bool:
        """Whether a device waits for what only the controller can change: a fault to
        clear, an idle behaviour other than ``run``, or a linger that ``drain`` ends.
        The host watch stays open then, so that change arrives at once, not at the
        next heartbeat."""
        return any(dev.awaits_controller() for dev in self.devices.values())

    def _apply_cancel(self, cancel: CancelOrder) -> None:
        for dev in self.devices.values():
            # A job that already ended here is not this device's lease job any
            # more: the cancel is ignored and the job keeps its own outcome.
            dev.cancel(cancel.job_id, cancel.attempt, cancel.reason)

    def _held_jobs(self) -> set[tuple[str, int]]:
        return {dev.lease.job for dev in self.devices.values() if dev.lease.job is not None}

    def _set_idle(self, dev: DeviceSupervisor, value: Any) -> bool:
        """Whether the device's idle behaviour changed."""
        try:
            behaviour = IdleBehavior(value)
        except ValueError:
            return False
        return dev.set_idle_behavior(behaviour)

    def _quarantine_damaged(self, device: str | None, why: str) -> None:
        """Quarantine the device of damaged state (every device when it is unknown): what ran
        there is not known, so an operator decides (``kind: damaged_state``)."""
        assert self._ctx is not None
        names = [device] if device in self.devices else list(self.devices)
        for name in names:
            self.devices[name].raise_fault("damaged_state", why)

    async def _probe_loop(self, client: ControllerClient) -> None:
        await self._send_labels(client)
        while True:
            with trio.move_on_after(self.config.probe_interval):
                await self._reprobe.wait()
            self._reprobe = trio.Event()
            self._apply_probe(await self._gather())
            await self._send_labels(client)
            if self._sheets.changed():
                try:
                    sheets = _sheets_update(self._sheets.read())
                    await client.put_sheets(SheetsRequest(NO_SESSION, sheets))
                except ControllerError as e:
                    log.error("sheets refused: %s", e)

    async def _send_labels(self, client: ControllerClient) -> None:
        labels = self._labels
        if labels == self._labels_sent:
            return
        try:
            update = _labels_update(labels)
            await client.put_labels(LabelsRequest(NO_SESSION, update.host, update.devices))
        except ControllerError as e:
            log.error("labels refused: %s", e)
            return
        self._labels_sent = labels

    async def _gather(self) -> ProbeResult:
        with self.metrics.probe_seconds.time():
            probe_pass = await self._prober.gather()
        for source in probe_pass.sources:
            if not source.ok:
                self.metrics.probe_failures.labels(source.name).inc()
        self._last_probe = [
            {"name": s.name, "ok": s.ok, "why": s.why, "seconds": round(s.seconds, 3)}
            for s in probe_pass.sources
        ]
        return probe_pass.result

    def _apply_probe(self, result: ProbeResult) -> None:
        assert self._ctx is not None
        self._probe_result = result
        for name, facts in result.device.items():
            if name not in result.unconfirmed:
                self._ctx.device_labels[name] = dict(facts)
        self._rebuild_labels()

    def _rebuild_labels(self) -> None:
        """The labels payload: the last probe pass, plus the GPU health labels and,
        for MIG slices, their parent's facts. A device the probe left out (its
        facts unconfirmed) stays out, so it keeps its previous labels."""
        if self._probe_result is None:
            return
        payload = labels_payload(self._probe_result)
        health = self.health
        if health is not None:
            health.sync_slice_labels()
            devices = payload["devices"]
            for parent, names in health.slices.items():
                for name in names:
                    if name in devices and parent in devices:
                        devices[name] = {**self._ctx_labels(name), **devices[name]}
            for name in list(devices):
                devices[name] = {**devices[name], **health.health_labels(name)}
        self._labels = payload

    def _ctx_labels(self, name: str) -> dict[str, str]:
        return dict(self._ctx.device_labels.get(name, {})) if self._ctx is not None else {}


def _state_dir_error(state_dir: str, e: OSError) -> ConfigError:
    return ConfigError(
        f"state_dir: cannot create or use {state_dir} ({e.strerror}); "
        "make it writable by the worker's user, or point state_dir elsewhere"
    )


def _labels_update(labels: Mapping[str, Any]) -> LabelsUpdate:
    """The labels payload (labels.labels_payload) as the protocol's message."""
    return LabelsUpdate(host=labels.get("host"), devices=labels.get("devices") or {})


def _sheets_update(sheets: Mapping[str, Any]) -> SheetsUpdate:
    """The sheets a ``SheetReader`` read, as the protocol's message: the host's sheet
    always given (``null`` removes it), each device's when its file exists."""
    return SheetsUpdate(host=sheets.get("host"), host_given=True, devices=sheets["devices"])


def _positive(value: Any, default: float) -> float:
    if isinstance(value, int | float) and not isinstance(value, bool) and value > 0:
        return float(value)
    return default


def state_root(config: Config) -> Path:
    return Path(config.state_dir)
