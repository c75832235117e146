"""The worker's Prometheus metrics.

Borrowed from the cloud dispatcher's worker pool: a gauge of devices per
state (its instances per state), counters of outcomes, and histograms of how
long things take. Each ``Worker`` has its own registry, so several workers
in one process (tests, simulations) never mix their numbers.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Info, ProcessCollector
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from rc_worker._version import __version__
from rc_worker.core.model import DeviceState, IdleBehavior

_JOB_BUCKETS = (1, 10, 60, 300, 900, 3600, 4 * 3600, 12 * 3600, 24 * 3600, 72 * 3600)
_STEP_BUCKETS = (0.01, 0.05, 0.1, 0.5, 1, 5, 10, 30, 60, 300)


class WorkerMetrics:
    """Counters and histograms the worker updates as things happen."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.jobs_finished = Counter(
            "rc_worker_jobs_finished", "Job attempts finished, by outcome.", ["outcome"], registry=r
        )
        self.duplicate_assignments = Counter(
            "rc_worker_duplicate_assignments",
            "Assignments of an attempt this worker already had, ignored (a controller bug).",
            registry=r,
        )
        self.job_seconds = Histogram(
            "rc_worker_job_run_seconds",
            "How long jobs ran, from spawn to exit.",
            buckets=_JOB_BUCKETS,
            registry=r,
        )
        self.quarantines = Counter(
            "rc_worker_quarantines",
            "Devices quarantined by this worker, by kind of fault.",
            ["kind"],
            registry=r,
        )
        self.hook_seconds = Histogram(
            "rc_worker_hook_seconds",
            "Lease hook run time.",
            ["hook"],
            buckets=_STEP_BUCKETS,
            registry=r,
        )
        self.verify_seconds = Histogram(
            "rc_worker_verify_pass_seconds",
            "Verify pass run time.",
            buckets=_STEP_BUCKETS,
            registry=r,
        )
        self.probe_seconds = Histogram(
            "rc_worker_probe_pass_seconds",
            "Probe pass run time.",
            buckets=_STEP_BUCKETS,
            registry=r,
        )
        self.probe_failures = Counter(
            "rc_worker_probe_source_failures",
            "Probe sources that failed a pass, by source.",
            ["source"],
            registry=r,
        )
        self.output_truncated = Counter(
            "rc_worker_output_truncated",
            "Job attempts whose output was cut at spool_max_bytes.",
            registry=r,
        )
        self.controller_requests = Counter(
            "rc_worker_controller_requests",
            "Requests to the controller, by endpoint and answer (a status code, or 'error' "
            "when none came).",
            ["endpoint", "status"],
            registry=r,
        )
        self.controller_last_success = Gauge(
            "rc_worker_controller_last_success_timestamp_seconds",
            "Unix time of the controller's last successful answer.",
            registry=r,
        )
        Info("rc_worker_build", "The worker's version.", registry=r).info({"version": __version__})
        # The standard process_* metrics (CPU, memory, open fds); a no-op off Linux.
        ProcessCollector(registry=r)
        self.swept = Counter(
            "rc_worker_swept_processes",
            "Processes the RC_JOB_ID sweep found after a job's group was torn down.",
            registry=r,
        )

        self.gpu_health_checks = Counter(
            "rc_worker_gpu_health_checks",
            "GPU health checks run, by check and result (ok, or error: could not run).",
            ["check", "result"],
            registry=r,
        )
        self.gpu_xid = Counter(
            "rc_worker_gpu_xid",
            "Xid events read from the kernel log, by code.",
            ["code"],
            registry=r,
        )
        self.gpu_ecc_errors = Gauge(
            "rc_worker_gpu_ecc_errors",
            "Volatile ECC error counts summed over this host's GPUs, by kind.",
            ["kind"],
            registry=r,
        )

    def watch(self, snapshot: Callable[[], StateSnapshot]) -> None:
        """Export gauges computed from the worker's state at each scrape."""
        self.registry.register(_StateCollector(snapshot))


class StateSnapshot:
    """What the gauges read: per-device state and idle behaviour, pending reports."""

    def __init__(
        self,
        devices: Mapping[str, tuple[DeviceState, IdleBehavior]],
        reports_pending: int,
        registered: bool,
        draining: bool = False,
        spool_bytes: int = 0,
    ) -> None:
        self.devices = devices
        self.reports_pending = reports_pending
        self.registered = registered
        self.draining = draining
        self.spool_bytes = spool_bytes


class _StateCollector(Collector):
    def __init__(self, snapshot: Callable[[], StateSnapshot]) -> None:
        self._snapshot = snapshot

    def collect(self) -> Iterable[Metric]:
        snap = self._snapshot()
        by_state = GaugeMetricFamily(
            "rc_worker_devices", "Devices in each worker-side state.", labels=["state"]
        )
        for state in DeviceState:
            count = sum(1 for s, _ in snap.devices.values() if s is state)
            by_state.add_metric([str(state)], count)
        yield by_state
        per_device = GaugeMetricFamily(
            "rc_worker_device_state",
            "1 for each device's current state and idle behaviour.",
            labels=["device", "state", "idle_behavior"],
        )
        for name, (state, idle) in sorted(snap.devices.items()):
            per_device.add_metric([name, str(state), str(idle)], 1)
        yield per_device
        yield GaugeMetricFamily(
            "rc_worker_reports_pending",
            "Finish and fault reports written to disk and not yet acknowledged.",
            value=snap.reports_pending,
        )
        yield GaugeMetricFamily(
            "rc_worker_registered", "1 once the worker has registered.", value=int(snap.registered)
        )
        yield GaugeMetricFamily(
            "rc_worker_draining",
            "1 while the worker drains or stops (takes no new work).",
            value=int(snap.draining),
        )
        yield GaugeMetricFamily(
            "rc_worker_spool_bytes",
            "Bytes of job output and reports held in state_dir's spool.",
            value=snap.spool_bytes,
        )
