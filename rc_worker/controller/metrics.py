"""``GET /metrics`` on the reference controller: the pool's view for Prometheus.

Gauges read from the store at scrape time (a custom collector on a registry of
the app's own, so two controllers in one process never share series):

- ``rc_controller_hosts{state}``, ``rc_controller_devices{state,idle_behavior}``:
  the pool's counts (:mod:`rc_worker.controller.pool`);
- ``rc_controller_free_devices{class}``: free devices per ``product`` label;
- ``rc_controller_jobs{state}``: jobs per state, queued / assigned / running
  and each terminal outcome;
- ``rc_controller_device_faults{kind}``: faults not yet cleared, by kind;
- ``rc_controller_device_faults_by_action{kind,action}``: the same, with each
  fault's recommended action (clear, reset, reboot, replace);
- ``rc_controller_faults_total{kind,action}``: faults raised since start;
- ``rc_controller_last_event_seq``: the event log's newest sequence number;
- ``rc_controller_registrations_total{outcome}``, ``rc_controller_dispatch_latency_seconds``,
  ``rc_controller_queue_wait_seconds``, ``rc_controller_store_commit_seconds``,
  ``rc_controller_long_polls_parked``, ``rc_controller_webhook_deliveries_total{result}``:
  what the controller counts about itself (:mod:`rc_worker.controller.stats`).

Counts only: no job ids, no host names, so the endpoint needs no token.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Awaitable, Callable, Iterable, Iterator, Mapping

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector
from starlette.requests import Request
from starlette.responses import Response

from rc_worker.controller.messages import JOB_STATES, TERMINAL_STATES
from rc_worker.controller.pool import DEVICE_STATES, HOST_STATES, device_state, host_states
from rc_worker.controller.stats import REGISTRATION_OUTCOMES, WEBHOOK_RESULTS, Stats
from rc_worker.controller.store import Store

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class StoreCollector(Collector):
    def __init__(self, store: Store) -> None:
        self._store = store

    def collect(self) -> Iterator[Metric]:
        devices = self._store.devices()
        hosts = GaugeMetricFamily("rc_controller_hosts", "Hosts per state.", labels=["state"])
        counted = Counter(host_states(devices).values())
        counted["retired"] += len(self._store.retired_hosts)
        for state in sorted({*HOST_STATES, *counted}):
            hosts.add_metric([state], counted.get(state, 0))
        yield hosts
        per_device = GaugeMetricFamily(
            "rc_controller_devices",
            "Devices per state and idle behaviour.",
            labels=["state", "idle_behavior"],
        )
        pairs = Counter((device_state(d), d.idle_behavior) for d in devices)
        for state in DEVICE_STATES:
            for idle in ("run", "hold", "drain"):
                per_device.add_metric([state, idle], pairs.get((state, idle), 0))
        yield per_device
        free = GaugeMetricFamily(
            "rc_controller_free_devices", "Free devices per product label.", labels=["class"]
        )
        for cls, n in sorted(
            Counter(
                d.labels.get("product", "") for d in devices if device_state(d) == "free"
            ).items()
        ):
            free.add_metric([cls], n)
        yield free
        jobs = GaugeMetricFamily("rc_controller_jobs", "Jobs per state.", labels=["state"])
        counts = self._store.job_state_counts()
        for state in sorted({*JOB_STATES, *counts}):  # every state, 0 too: a series to alert on
            jobs.add_metric([state], counts.get(state, 0))
        yield jobs
        faults = GaugeMetricFamily(
            "rc_controller_device_faults", "Faults not yet cleared, by kind.", labels=["kind"]
        )
        for kind, n in sorted(Counter(f.kind for d in devices for f in d.faults).items()):
            faults.add_metric([kind], n)
        yield faults
        by_action = GaugeMetricFamily(
            "rc_controller_device_faults_by_action",
            "Faults not yet cleared, by kind and recommended action.",
            labels=["kind", "action"],
        )
        held = Counter((f.kind, f.action) for d in devices for f in d.faults)
        for (kind, action), n in sorted(held.items()):
            by_action.add_metric([kind, action], n)
        yield by_action
        raised = CounterMetricFamily(
            "rc_controller_faults",
            "Device faults raised since the controller started, by kind and recommended action.",
            labels=["kind", "action"],
        )
        for (kind, action), n in sorted(self._store.faults_raised.items()):
            raised.add_metric([kind, action], n)
        yield raised
        seq = GaugeMetricFamily(
            "rc_controller_last_event_seq", "The newest event's sequence number."
        )
        seq.add_metric([], self._store.last_event_seq)
        yield seq
        yield from _stats_metrics(self._store.stats)


def _counted(
    name: str, doc: str, label: str, counts: Mapping[str, int], always: Iterable[str] = ()
) -> CounterMetricFamily:
    """A counter family with one series per key of ``counts``, and one (0 if need be) for
    each of ``always``: a series that exists from the start is one an alert can read."""
    family = CounterMetricFamily(name, doc, labels=[label])
    for key in sorted({*always, *counts}):
        family.add_metric([key], counts.get(key, 0))
    return family


def _stats_metrics(stats: Stats) -> Iterator[Metric]:
    """What the controller counts about itself (:mod:`rc_worker.controller.stats`)."""
    yield _counted(
        "rc_controller_registrations",
        "Worker registrations by outcome (registered, recovered, refused).",
        "outcome",
        stats.registrations,
        REGISTRATION_OUTCOMES,
    )
    for name, doc, hist in (
        (
            "rc_controller_dispatch_latency_seconds",
            "Seconds from a job's submission to its start.",
            stats.dispatch_latency,
        ),
        (
            "rc_controller_queue_wait_seconds",
            "Seconds a job waited in the queue (each time queued) until it was offered.",
            stats.queue_wait,
        ),
        (
            "rc_controller_store_commit_seconds",
            "Seconds one group commit took to write to the store beneath (persisted only).",
            stats.commit_latency,
        ),
    ):
        family = HistogramMetricFamily(name, doc)
        family.add_metric([], hist.cumulative(), sum_value=hist.sum)
        yield family
    parked = GaugeMetricFamily("rc_controller_long_polls_parked", "Worker long polls waiting.")
    parked.add_metric([], stats.polls_parked)
    yield parked
    yield _counted(
        "rc_controller_jobs_finished",
        "Jobs that ended since the controller started, by outcome (retention never lowers it).",
        "outcome",
        stats.jobs_finished,
        TERMINAL_STATES,
    )
    yield _counted(
        "rc_controller_faults_cleared",
        "Device faults lifted since the controller started (clears, reboots, devices gone),"
        " by kind.",
        "kind",
        stats.faults_cleared,
    )
    yield _counted(
        "rc_controller_webhook_deliveries",
        "Webhook POST attempts by result (delivered, retried, refused, failed).",
        "result",
        stats.webhook_deliveries,
        WEBHOOK_RESULTS,
    )


def metrics_endpoint(store: Store) -> Callable[[Request], Awaitable[Response]]:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(StoreCollector(store))

    async def metrics(request: Request) -> Response:
        return Response(generate_latest(registry), media_type=CONTENT_TYPE)

    return metrics
