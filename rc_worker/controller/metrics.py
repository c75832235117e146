"""The reference controller's ``GET /metrics``: faults by kind and action.

Prometheus text, unauthenticated like the worker's status listener: counts
only, no job or device data beyond what the labels name.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterable

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector
from starlette.requests import Request
from starlette.responses import Response

from rc_worker.controller.store import Store


class _FaultCollector(Collector):
    def __init__(self, store: Store) -> None:
        self._store = store

    def collect(self) -> Iterable[Metric]:
        raised = CounterMetricFamily(
            "rc_controller_faults",
            "Device faults raised (by workers or the controller), by kind and recommended action.",
            labels=["kind", "action"],
        )
        for (kind, action), count in sorted(self._store.faults_raised.items()):
            raised.add_metric([kind, action], count)
        yield raised
        held = GaugeMetricFamily(
            "rc_controller_device_faults",
            "Faults not yet cleared, by kind and recommended action.",
            labels=["kind", "action"],
        )
        counts: dict[tuple[str, str], int] = {}
        for device in self._store.devices():
            for fault in device.faults:
                key = (fault.kind, fault.action)
                counts[key] = counts.get(key, 0) + 1
        for (kind, action), count in sorted(counts.items()):
            held.add_metric([kind, action], count)
        yield held


def metrics_endpoint(store: Store) -> Callable[[Request], Awaitable[Response]]:
    registry = CollectorRegistry()
    registry.register(_FaultCollector(store))

    async def metrics(_: Request) -> Response:
        return Response(generate_latest(registry), media_type="text/plain; version=0.0.4")

    return metrics
