"""The store's operator side for devices and hosts: views, clears, idle behaviour, retiring,
the pool, events.

A part of :class:`~rc_worker.controller.store.Store` (see its module); sans-IO.
"""

from __future__ import annotations

import collections

from rc_worker.controller.errors import (
    BadRequest,
    Conflict,
    NotFound,
)
from rc_worker.controller.messages import (
    IDLE_BEHAVIORS,
    DeviceInfo,
    Event,
    JobInfo,
    SheetInfo,
)
from rc_worker.controller.pool import DEFAULT_CLASS_LABEL, DEVICE_STATES, RECENT_S, pool_view
from rc_worker.controller.state_persist import StoredState
from rc_worker.core.selectors import SelectorError, parse_selector

# ``DEVICE_STATES`` (re-exported by ``store``) is the pool's own tuple: one list, so a state
# the pool shows is one ``?state=`` takes.
__all__ = ["DEVICE_STATES", "DevicesSide"]


class DevicesSide(StoredState):
    """Devices, hosts and events as operators see and change them (``/v1/devices``)."""

    def devices(self) -> list[DeviceInfo]:
        return [d.info(h) for h in self._hosts.values() for d in h.devices.values()]

    def devices_page(
        self,
        *,
        state: str | None = None,
        host: str | None = None,
        select: str = "",
        after: str | None = None,
        limit: int | None = None,
    ) -> tuple[list[DeviceInfo], str | None]:
        """Devices filtered server-side, in address order (``host/device``), from after the
        cursor ``after`` (an address); returns the page and the next cursor, None at the end.

        ``select`` is a selector over the devices' labels, answered from the label index;
        ``host`` looks at one host only: neither reads the whole fleet.
        """
        if state is not None and state not in DEVICE_STATES:
            raise BadRequest(f"state: {state!r} is not one of {', '.join(DEVICE_STATES)}")
        try:
            selector = parse_selector(select)
        except SelectorError as e:
            raise BadRequest(f"select: {e}") from None
        start: tuple[str, str] | None = None
        if after is not None:
            h_name, sep, d_name = after.partition("/")
            if not sep or not h_name or not d_name:
                raise BadRequest(f"after: {after!r} is not a cursor (host/device from 'next')")
            start = (h_name, d_name)
        if selector.terms:
            addrs = self._index.candidates(selector)
            if host is not None:
                addrs = {a for a in addrs if a[0] == host}
        elif host is not None:
            h = self._hosts.get(host)
            addrs = set() if h is None else {(host, n) for n in h.devices}
        else:
            addrs = {(h.name, n) for h in self._hosts.values() for n in h.devices}
        out: list[DeviceInfo] = []
        nxt = None
        for addr in sorted(a for a in addrs if start is None or a > start):
            h = self._hosts.get(addr[0])
            d = None if h is None else h.devices.get(addr[1])
            if h is None or d is None or (state is not None and d.view_state(h) != state):
                continue
            if limit is not None and len(out) >= limit:
                nxt = f"{out[-1].host}/{out[-1].name}"
                break
            out.append(d.info(h))
        return out, nxt

    def device(self, host: str, name: str) -> DeviceInfo:
        h, d = self._device(host, name)
        return d.info(h)

    def sheet(self, host: str, name: str) -> SheetInfo:
        h, d = self._device(host, name)
        return SheetInfo(host, name, h.sheet, d.sheet)

    def clear(self, host: str, name: str, *, by: str = "operator") -> list[str]:
        """Lift every current fault of a device (an operator's ``clear``); returns their ids.

        A MIG slice's faults raised for its GPU's go with the GPU's: those naming any
        fault this device ever held (``seen_faults``), not only those it holds now, so
        a slice's copy left by a fault cleared before is cleared too (an outdated
        quarantine must not need each slice cleared by hand), even when the device
        itself holds none now."""
        _, d = self._device(host, name)
        ids = list(d.faults)
        if ids:
            self._lift(d, ids, by=by)
        if self._lift_children(host, d.seen_faults | set(ids), by=by) or ids:
            self._changed()
        return ids

    def clear_host(self, host: str, *, by: str = "operator") -> dict[str, list[str]]:
        """Lift the host-level faults (``scope: host``) of every device of ``host``."""
        h = self._hosts.get(host)
        if h is None:
            raise NotFound(f"no host {host}", code="unknown_host")
        cleared: dict[str, list[str]] = {}
        for d in h.devices.values():
            ids = [f for f, x in d.faults.items() if x.scope == "host"]
            if ids:
                self._lift(d, ids, by=by)
                cleared[d.name] = ids
        # A slice's copy of a host fault (raised after the slice alone was cleared) goes
        # with it: it is not itself ``scope: host``.
        lifted = {f for ids in cleared.values() for f in ids}
        if self._lift_children(host, lifted, by=by) or cleared:
            self._changed()
        return cleared

    def set_idle_behavior(
        self, host: str, name: str, behavior: str, *, by: str | None = None
    ) -> DeviceInfo:
        if behavior not in IDLE_BEHAVIORS:
            raise BadRequest(f"idle_behavior: {behavior!r} is not one of drain, hold, run")
        h, d = self._device(host, name)
        if d.idle_behavior != behavior:
            d.idle_behavior = behavior
            self._control_changed(host)
            self.journal.host(host)
            if by is not None:
                self._emit(
                    "idle_behavior_set", host=host, device=name, idle_behavior=behavior, by=by
                )
            self._changed()
        return d.info(h)

    # --- user side: hosts (the pool's KillInstance for a static fleet) ----------------------

    def pool(
        self, *, class_label: str = DEFAULT_CLASS_LABEL, recent_s: float = RECENT_S
    ) -> dict[str, object]:
        """The worker pool's view: counts per state, free devices per class, running
        attempts (:mod:`rc_worker.controller.pool`)."""
        return pool_view(
            self.devices(),
            self._jobs_for_pool(),
            now=self._wall(),
            class_label=class_label,
            recent_s=recent_s,
            retired=len(self.retired_hosts),
        )

    def _jobs_for_pool(self) -> list[JobInfo]:
        # Only placed and ended jobs count here: no pending reasons to work out.
        return [
            job.info()
            for job in self._jobs.values()
            if job.job_id in self._live or job.finished_at is not None
        ]

    def job_state_counts(self) -> dict[str, int]:
        """How many jobs are in each state (for ``/metrics``): a count, no views built."""
        counts = collections.Counter(job.state for job in self._jobs.values())
        counts.update(self._stored_counts)  # finished jobs only the store beneath holds
        return {state: n for state, n in counts.items() if n > 0}

    def set_host_idle_behavior(
        self, host: str, behavior: str, *, by: str | None = None
    ) -> list[DeviceInfo]:
        """``drain`` (no new work on any device of the host) or ``run`` (resume)."""
        if behavior not in IDLE_BEHAVIORS:
            raise BadRequest(f"idle_behavior: {behavior!r} is not one of drain, hold, run")
        h = self._hosts.get(host)
        if h is None:
            raise NotFound(f"no host {host}", code="unknown_host")
        self.journal.host(host)
        changed = False
        for d in h.devices.values():
            if d.idle_behavior != behavior:
                d.idle_behavior = behavior
                changed = True
        if changed:
            self._control_changed(host)
            who = {} if by is None else {"by": by}
            self._emit("host_idle_behavior", host=host, idle_behavior=behavior, **who)
            self._changed()
        return [d.info(h) for d in h.devices.values()]

    def retire_host(self, host: str, *, force: bool = False, by: str | None = None) -> list[str]:
        """Forget a host gone for good: its devices leave the device list; its jobs'
        records stay. Refused (409) while it runs jobs, unless ``force``, which ends
        them ``lost``. Returns the ids of the jobs so ended. A retired host that
        registers again is a new host."""
        h = self._hosts.get(host)
        if h is None:
            raise NotFound(f"no host {host}", code="unknown_host")
        busy = [job for job in self._live.values() if job.current and job.current.host == host]
        if busy and not force:
            raise Conflict(
                f"host {host} has {len(busy)} job(s) assigned or running "
                f"({', '.join(j.job_id for j in busy)}); wait for them, or retire with --force",
                code="host_busy",
            )
        ended = []
        for job in busy:
            cur = job.current
            if cur is not None and cur.status == "assigned":
                self._requeue(job, f"host {host} retired before it started")
            else:
                self._terminate(job, "lost", by="controller", reason=f"host {host} retired")
                ended.append(job.job_id)
        if h.session is not None:
            self._sessions.pop(h.session, None)
        for key in [k for k in self._poll_gen if k[0] == host]:
            del self._poll_gen[key]
        del self._hosts[host]
        self.retired_hosts.add(host)
        self._unindex_host(host)
        self._touch_host(host)
        self.journal.host(host)  # gone from the store beneath too
        who = {} if by is None else {"by": by}
        self._emit("host_retired", host=host, forced=bool(busy), jobs=ended, **who)
        self._changed()
        return ended

    def events(self, after: int = 0, limit: int | None = None) -> list[Event]:
        """Events with ``seq > after``, oldest first (the oldest may have been dropped)."""
        out: list[Event] = []
        if not self._events:
            return out
        start = max(0, after - self._events[0].seq + 1)
        for i in range(start, len(self._events)):
            if limit is not None and len(out) >= limit:
                break
            out.append(self._events[i])
        return out
