"""The worker pool's view of the fleet (after the second seed's dispatcher pool).

Sans-IO: built from the store's snapshots (devices and jobs), so it can be
tested without a controller and never changes what it reads.

- ``hosts``: hosts per state (``up``, ``draining``, ``lost``; the controller's
  own ``unknown`` and ``retired`` where it keeps them);
- ``devices``: devices per state: ``free``, ``busy``, ``held`` (free, but its
  idle behaviour keeps work off it: ``hold`` or ``drain``), ``quarantined``,
  ``absent`` (free, but no worker polls for it: its host deregistered, is lost,
  or has not registered again after a controller restart); and per idle
  behaviour (the seed's ``CountWorkers``);
- ``free_by_class``: free devices per value of a label (``product`` by default:
  "how many free H100s"), for capacity planning;
- ``running``: the seed's ``Running()``: every attempt assigned or running,
  with ``ended_at`` null, and those that ended within ``recent_s`` with the
  time they ended (the "exited at T" placeholder, which tells a job that
  ended without its state reaching a cache yet from one still running).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping
from typing import Any

from rc_worker.controller.messages import DeviceInfo, JobInfo

DEVICE_STATES = ("free", "busy", "held", "quarantined", "absent")
"""A device's states as the pool counts them, ``GET /v1/devices`` shows them and ``?state=``
takes them (the vocabulary issue 14 pinned; ``host_state`` beside it says why a device is
``absent``)."""
SESSIONLESS_HOST_STATES = ("left", "lost", "unknown")
"""Host states with no worker session: nothing is offered to their devices until the worker
registers (again)."""
HOST_STATES = ("unknown", "up", "draining", "lost", "retired", "left")
"""Every host state, each counted (0 included) by ``rc pool --json`` and the
``rc_controller_hosts`` metric: a series that appeared only while a host was in that
state would read as "no data", not 0, to an alert on it. ``left``: the worker drained and
deregistered."""
IDLE_BEHAVIORS = ("run", "hold", "drain")
DEFAULT_CLASS_LABEL = "product"
RECENT_S = 300.0


def view_state(state: str, idle_behavior: str, host_state: str) -> str:
    """A device's state as the pool sees it (and ``GET /v1/devices`` shows it), from its
    record's: ``held`` is free but kept from work by its idle behaviour; a free device of a
    host with no worker session (deregistered, lost, or not yet registered again after a
    controller restart) is ``absent``: nothing runs there until it registers."""
    # The record says free (a lost host's ``interrupted`` fault cleared by an operator, a
    # restarted controller's recovery grace), but only a registered worker polls for work:
    # counting these free would offer capacity that is not there. Ahead of ``held``: the
    # host's absence is why no work goes there, whatever the idle behaviour.
    if state == "free" and host_state in SESSIONLESS_HOST_STATES:
        return "absent"
    if state == "free" and idle_behavior != "run":
        return "held"
    return state


def view_host_state(state: str, present_idle_behaviors: Iterable[str]) -> str:
    """A host's state as the pool sees it: ``draining`` when it is up and every present
    device has idle behaviour ``drain`` (``rc host drain``)."""
    behaviors = list(present_idle_behaviors)
    if state == "up" and behaviors and all(b == "drain" for b in behaviors):
        return "draining"
    return state


def device_state(d: DeviceInfo) -> str:
    """The pool's state of one device (what its view already says)."""
    return view_state(d.state, d.idle_behavior, d.host_state)


def host_states(devices: Iterable[DeviceInfo]) -> dict[str, str]:
    """Each host's state, from its devices' views."""
    by_host: dict[str, list[DeviceInfo]] = {}
    for d in devices:
        by_host.setdefault(d.host, []).append(d)
    return {
        host: view_host_state(ds[0].host_state, (d.idle_behavior for d in ds if d.present))
        for host, ds in by_host.items()
    }


def pool_view(
    devices: Iterable[DeviceInfo],
    jobs: Iterable[JobInfo],
    *,
    now: float,
    class_label: str = DEFAULT_CLASS_LABEL,
    recent_s: float = RECENT_S,
    retired: int = 0,
) -> dict[str, Any]:
    """The pool's counts and running attempts (see the module docstring); ``retired`` hosts
    have no devices left, so they are counted apart."""
    devices = list(devices)
    hosts = host_states(devices)
    host_counts = Counter(hosts.values())
    host_counts["retired"] += retired
    states = Counter(device_state(d) for d in devices)
    idle = Counter(d.idle_behavior for d in devices if d.present)
    free_by_class: Counter[str] = Counter(
        d.labels.get(class_label, "") for d in devices if device_state(d) == "free"
    )
    running: list[dict[str, Any]] = []
    for j in jobs:
        if j.state in ("assigned", "running"):
            running.append(_attempt(j, None))
        elif j.terminal and j.finished_at is not None and now - j.finished_at <= recent_s:
            running.append(_attempt(j, j.finished_at))
    return {
        "hosts": _counts(host_counts, HOST_STATES),
        "devices": _counts(states, DEVICE_STATES),
        "idle_behavior": _counts(idle, IDLE_BEHAVIORS),
        "class_label": class_label,
        "free_by_class": dict(sorted(free_by_class.items())),
        "running": running,
    }


def _counts(counter: Mapping[str, int], keys: Iterable[str]) -> dict[str, int]:
    out = {k: int(counter.get(k, 0)) for k in keys}
    out.update({k: int(v) for k, v in counter.items() if k not in out})
    return out


def _attempt(j: JobInfo, ended_at: float | None) -> dict[str, Any]:
    return {
        "job_id": j.job_id,
        "attempt": j.attempt,
        "host": j.host,
        "device": j.device,
        "state": j.state,
        "started_at": j.started_at,
        "ended_at": ended_at,
    }
