"""The store's state and the transitions that keep it consistent.

:class:`StoreState` owns the records (hosts, devices, jobs, attempts, faults,
events), the ids, change notification, and the primitive transitions every
rule is built from: requeue, terminate (first terminal state wins), raise and
lift a fault, lose a host, and the timers. ``state_persist.StoredState`` adds
what a persistence layer needs, and :class:`~rc_worker.controller.store.Store` the
public operations on top. Sans-IO: no Trio, no anyio; time comes in as
``now``.
"""

from __future__ import annotations

import bisect
import collections
import random
import secrets
import time
from collections import deque
from collections.abc import Callable, Collection, Iterable

import attrs

from rc_worker.controller.errors import NotFound, StaleAttempt, UnknownSession
from rc_worker.controller.journal import Journal
from rc_worker.controller.matching import Address, LabelIndex
from rc_worker.controller.messages import Event, FaultRequest
from rc_worker.controller.records import Attempt, Device, Fault, Host, Job
from rc_worker.controller.stats import Stats
from rc_worker.controller.timers import Deadlines

__all__ = ["ANY", "OutputElsewhere", "StoreConfig", "StoreState", "host_topic", "job_topic"]

ANY = "any"
"""The wake topic every change includes: for waiters that care about anything (the events
feed, webhooks, housekeeping)."""


FEW_CANDIDATES = 64
"""A queued job with at most this many candidate devices is aimed by looking at them, not at
the parked polls (a job that matches nothing then costs nothing to queue)."""


def host_topic(name: str) -> str:
    """Wakes the long polls of host ``name``: its devices, sessions or cancels changed, or a
    queued job was aimed at one of its parked devices."""
    return f"host/{name}"


def job_topic(job_id: str) -> str:
    """Wakes the followers of job ``job_id``: its output or state changed."""
    return f"job/{job_id}"


class OutputElsewhere(Exception):
    """Output asked for below ``base`` is not in memory: read it from the persistence beneath."""

    def __init__(self, job_id: str, base: int) -> None:
        super().__init__(f"output of {job_id} below {base} is stored, not in memory")
        self.job_id = job_id
        self.base = base


@attrs.frozen
class StoreConfig:
    """Timings and bounds of the reference controller (documented in docs/controller.md)."""

    heartbeat_interval_s: float = 10.0
    missed_heartbeats: int = 3
    poll_wait_s: float = 30.0
    max_poll_wait_s: float = 60.0
    report_timeout_s: float = 60.0
    """An unstarted assignment, or a job carried over a registration in ``recovery``, that the
    host's heartbeats do not mention for this long is resolved (requeued, or finished ``lost``).
    A carried-over job waits at least the host's own loss time, and only while the host has
    a session (see ``StoreState._job_deadline``)."""
    heartbeat_rate: float = 0.0
    """Heartbeats per second the controller aims at across the fleet (0: no target). With
    many hosts each is told a longer interval, ``max(heartbeat_interval_s, hosts / rate)``,
    as Nomad scales its heartbeats, so a large fleet does not cost a core in heartbeats."""
    max_refusals: int = 10
    max_stale_refusals: int = 1000
    max_events: int = 100_000
    max_grace_s: float = 600.0
    """The longest ``grace_s`` a job may ask for (``rc serve --max-grace``): a job that ignores
    SIGTERM holds its device, a cancel and a worker's shutdown this long."""
    max_output_bytes: int = 0
    """Output kept per job (0: no cap); past it chunks are acknowledged and dropped."""
    cleared_omissions: int = 3
    """A lifted fault id leaves heartbeat ``cleared`` once this many heartbeats in a row have
    reported its device without it."""

    @property
    def lost_after_s(self) -> float:
        return self.heartbeat_interval_s * self.missed_heartbeats


class StoreState:
    """All controller state, in memory. One instance per controller process.

    ``instance`` tags the ids this store hands out (jobs, sessions, faults) so
    that ids from a previous controller process can never name a new object.
    """

    def __init__(
        self,
        config: StoreConfig | None = None,
        *,
        instance: str | None = None,
        wall_clock: Callable[[], float] = time.time,
        rng: random.Random | None = None,
    ) -> None:
        self.config = config or StoreConfig()
        # Session tokens: unguessable by default; a simulation seeds them to replay.
        self._rng = rng
        self.instance = instance or secrets.token_hex(3)
        self._wall = wall_clock
        self._hosts: dict[str, Host] = {}
        self._sessions: dict[str, Host] = {}
        self._jobs: dict[str, Job] = {}
        self._queue: list[tuple[int, str]] = []
        self._live: dict[str, Job] = {}
        # Finished jobs still in memory, oldest finish first. With a persistence layer
        # beneath, the oldest leave memory once stored (evict_finished); without one
        # (--memory, simulations) every job stays here.
        self._finished: dict[str, None] = {}
        # Finished jobs held only by the store beneath, per state (for /metrics).
        self._stored_counts: collections.Counter[str] = collections.Counter()
        self._events: deque[Event] = deque(maxlen=self.config.max_events)
        self._counters: dict[str, int] = {}
        # Faults ever raised, by (kind, action): the controller's /metrics.
        self.faults_raised: dict[tuple[str, str], int] = {}
        self._event_seq = 0
        self.version = 0
        self._subscribers: list[Callable[[], None]] = []
        self._topic_subscribers: list[Callable[[frozenset[str] | None], None]] = []
        # What the change being made touches (wake topics), flushed by _changed.
        self._touched: set[str] = set()
        self._queued_new: list[Job] = []
        self.last_wake: frozenset[str] | None = None
        """The topics the last change woke (None: everything); for tests and metrics."""
        # Indexed matching (rc_worker.controller.matching): label views per device, and
        # each job's candidate devices, cached against the index's epoch.
        self._index = LabelIndex()
        self._job_cands: dict[str, tuple[int, set[Address] | None]] = {}
        # Devices each host's parked polls list (name -> offer generation), and devices a
        # queued job was aimed at whose host has not polled since (one job per wake).
        self._listed: dict[str, dict[str, int]] = {}
        self._claimed: set[Address] = set()
        self._timers = Deadlines()
        self._queued_since: dict[str, float] = {}
        """Wall-clock time each queued job was (re)queued: its queue wait, for /metrics."""
        self.stats = Stats()
        """The controller's counters and histograms (rc_worker.controller.stats)."""
        self.retired_hosts: set[str] = set()
        """Hosts retired (``rc host retire``) and not registered since: the pool's
        ``retired``. Stored with the counters."""
        self._cancelled: dict[str, Job] = {}
        """Live jobs with a cancel to deliver (the heartbeat and the poll look only here)."""
        self.journal = Journal()
        """Dirty marks for a persistence layer beneath the store (off unless one enables it)."""
        self.recovery_grace_s: float | None = None
        # The newest long poll that offered each (host, device): an older poll
        # still parked for it has been superseded and gets nothing.
        self._poll_gen: dict[tuple[str, str], int] = {}
        # Per host, how many idle-behaviour changes and clears it has had here: a host
        # watch answers at once when the worker's count is not this one.
        self._control: dict[str, int] = {}
        # A restart on a stored state keeps ``instance``, so the tokens carry a tag of
        # this process's own: a count that starts again at 0 never repeats an old token
        # (seeded, the instance tag, so that a simulation replays byte for byte).
        self._control_tag = self.instance if rng is not None else secrets.token_hex(4)

    # --- change notification ----------------------------------------------------------------

    def subscribe(self, callback: Callable[[], None]) -> Callable[[], None]:
        """Call ``callback`` after every change; returns the function that unsubscribes."""
        self._subscribers.append(callback)
        return lambda: self._subscribers.remove(callback)

    def subscribe_topics(
        self, callback: Callable[[frozenset[str] | None], None]
    ) -> Callable[[], None]:
        """Call ``callback(topics)`` after every change with the wake topics it touched
        (:func:`host_topic`, :func:`job_topic`, always :data:`ANY`), or None for "wake
        everything"; returns the function that unsubscribes."""
        self._topic_subscribers.append(callback)
        return lambda: self._topic_subscribers.remove(callback)

    def _changed(self) -> None:
        self.version += 1
        if self._queued_new:
            self._wake_for_queue()
        # A change that named nothing it touched wakes everybody: never a missed wake.
        topics = frozenset({*self._touched, ANY}) if self._touched else None
        self._touched = set()
        self.last_wake = topics
        for callback in list(self._subscribers):
            callback()
        for topic_callback in list(self._topic_subscribers):
            topic_callback(topics)

    def _touch_host(self, name: str) -> None:
        self._touched.add(host_topic(name))

    def _control_changed(self, host: str) -> None:
        """An idle behaviour or a fault of ``host``'s changed by the controller's side: the
        worker must hear it now, not at its next heartbeat (its host watch is answered)."""
        self._control[host] = self._control.get(host, 0) + 1
        self._touch_host(host)

    def control_token(self, host: str) -> str:
        """Names the host's idle behaviours and clears as they stand (``control`` of a
        watch answer). The process's tag keeps a restarted controller's count from
        matching its predecessor's."""
        return f"{self._control_tag}.{self._control.get(host, 0)}"

    def _touch_job(self, job: Job) -> None:
        """The job's followers, and the host its current attempt is on."""
        self._touched.add(job_topic(job.job_id))
        cur = job.current
        if cur is not None:
            self._touched.add(host_topic(cur.host))

    # --- targeted wakes and indexed matching --------------------------------------------------

    def _reindex_host(self, h: Host) -> None:
        """Rebuild the label views of a host's devices (after its labels changed)."""
        for d in h.devices.values():
            self._index.update((h.name, d.name), d.labels(h))

    def _unindex_host(self, name: str) -> None:
        for addr in [a for a in self._index.views if a[0] == name]:
            self._index.remove(addr)
        self._claimed = {a for a in self._claimed if a[0] != name}
        self._listed.pop(name, None)

    def label_view(self, h: Host, d: Device) -> dict[str, str]:
        """A device's label view, from the cache (built when its labels last changed)."""
        view = self._index.views.get((h.name, d.name))
        return d.labels(h) if view is None else view

    def _job_candidates(self, job: Job) -> set[Address] | None:
        """The devices ``job`` may run on (None: every device); cached per label epoch."""
        cached = self._job_cands.get(job.job_id)
        if cached is not None and cached[0] == self._index.epoch:
            return cached[1]
        cands: set[Address] | None
        if job.spec.device is not None:
            host, _, name = job.spec.device.partition("/")
            view = self._index.views.get((host, name))
            ok = view is not None and job.selector.matches(view)
            cands = {(host, name)} if ok else set()
        elif not job.selector.terms:
            cands = None
        else:
            cands = self._index.cached(job.selector)
        self._job_cands[job.job_id] = (self._index.epoch, cands)
        return cands

    def _offerable(self, addr: Address) -> bool:
        h = self._hosts.get(addr[0])
        d = None if h is None else h.devices.get(addr[1])
        return (
            h is not None
            and h.session is not None
            and d is not None
            and d.present
            and d.job is None
            and not d.faults
            and not d.worker_faults
            and d.idle_behavior == "run"
        )

    def _wake_for_queue(self) -> None:
        """Aim each newly queued job at one parked, offerable device that can run it, and
        wake that device's host only: one poll per job, not every poll of the fleet. A
        device so aimed at is claimed until its host polls, so that a burst of jobs
        spreads over the fleet. A job with no such device wakes nobody: it is taken by
        the next poll that lists a device it matches (a poll looks at the queue first)."""
        jobs, self._queued_new = self._queued_new, []
        for job in jobs:
            if job.state != "queued" or job.job_id not in self._jobs:
                continue
            cands = self._job_candidates(job)
            found = None
            if cands is not None and len(cands) <= FEW_CANDIDATES:
                # Few devices can run it: look at those (the least address, for replays).
                found = min(
                    (a for a in cands if self._aimable(a)),
                    default=None,
                )
            else:
                for host, names in self._listed.items():
                    for name in names:
                        addr = (host, name)
                        if (cands is None or addr in cands) and self._aimable(addr):
                            found = addr
                            break
                    if found is not None:
                        break
            if found is not None:
                self._claimed.add(found)
                self._touch_host(found[0])

    def _aimable(self, addr: Address) -> bool:
        """Listed by a parked poll, not aimed at already, and able to take work now."""
        listed = self._listed.get(addr[0])
        return (
            listed is not None
            and addr[1] in listed
            and addr not in self._claimed
            and self._offerable(addr)
        )

    def _wake_queue_again(self) -> None:
        """A device aimed at took nothing: aim every queued job again (rare)."""
        self._queued_new.extend(self._jobs[job_id] for _, job_id in self._queue)

    # --- the deadline heap ------------------------------------------------------------------

    def _arm_host(self, h: Host) -> None:
        deadline = self._host_deadline(h)
        if deadline is not None:
            self._timers.arm(("host", h.name), deadline)

    def _arm_job(self, job: Job) -> None:
        deadline = self._job_deadline(job)
        if deadline is not None:
            self._timers.arm(("job", job.job_id), deadline)

    def _host_deadline(self, h: Host) -> float | None:
        deadlines = []
        if h.session is not None:
            deadlines.append(h.last_seen + self._lost_after(h))
        if h.recovering_until is not None:
            deadlines.append(h.recovering_until)
        return min(deadlines, default=None)

    def _job_deadline(self, job: Job) -> float | None:
        cur = job.current
        if job.job_id not in self._live or cur is None:
            return None
        if cur.status == "assigned":
            return cur.last_heard + self.config.report_timeout_s
        if cur.status != "running" or not cur.adopted:
            return None
        h = self._hosts.get(cur.host)
        if h is None or h.session is None:
            # The host is not talking to us (a controller restart's recovery grace, a
            # partition): its heartbeats cannot mention the job, so silence proves nothing
            # of it. The host's own rule decides: lost (and the job with it), or back,
            # when registering arms this again.
            return None
        # A live worker mentions the job in every heartbeat; at a long interval (a large
        # fleet's --heartbeat-rate) a report timeout shorter than the host's own loss
        # rule would end the job of a worker that is still supervising it.
        return cur.last_heard + max(self.config.report_timeout_s, self._lost_after(h))

    def _token(self) -> str:
        """Eight hex digits nobody can guess (or, seeded, the same in every replay)."""
        if self._rng is None:
            return secrets.token_hex(4)
        return f"{self._rng.getrandbits(32):08x}"

    def _next_id(self, prefix: str) -> str:
        n = self._counters[prefix] = self._counters.get(prefix, 0) + 1
        return f"{prefix}-{n}-{self.instance}"

    def _emit(self, type_: str, **data: object) -> None:
        self._event_seq += 1
        event = Event(self._event_seq, type_, self._wall(), data)
        self._events.append(event)
        self.journal.event(event)

    # --- lookups ----------------------------------------------------------------------------

    def _job(self, job_id: str) -> Job:
        job = self._jobs.get(job_id)
        if job is None:
            raise NotFound(f"no job {job_id!r}", code="unknown_job")
        # No dirty mark here: a lookup is not a change (the mutations mark what they change).
        return job

    def _device(self, host: str, name: str) -> tuple[Host, Device]:
        h = self._hosts.get(host)
        d = None if h is None else h.devices.get(name)
        if h is None or d is None:
            raise NotFound(f"no device {host}/{name}", code="unknown_device")
        # No dirty mark here: a lookup is not a change (the mutations mark what they change).
        return h, d

    def _session(self, session: str, host: str | None = None, *, mark: bool = True) -> Host:
        """The host of a live session; :class:`UnknownSession` if none. Marks the host's
        record to be stored unless ``mark`` is false: the callers that run for every
        heartbeat and poll mark only what they change, so that an unchanged heartbeat
        costs the store nothing (at 1,000 hosts, 100 commits a second otherwise)."""
        h = self._sessions.get(session)
        if h is None or (host is not None and h.name != host):
            raise UnknownSession(
                f"session {session!r} is not known for host {host or '?'}; register again"
            )
        if mark:
            self.journal.host(h.name)
        return h

    def session_host(self, session: str) -> str:
        """The host a live session belongs to; :class:`UnknownSession` if none."""
        return self._session(session, mark=False).name

    def attempt_host(self, job_id: str, attempt: int) -> str:
        """The host of a job's current attempt; :class:`StaleAttempt` if ``attempt`` is not it."""
        return self._current(self._job(job_id), attempt).host

    def _current(self, job: Job, attempt: int) -> Attempt:
        cur = job.current
        if cur is None or cur.number != attempt:
            raise self._stale(job, attempt)
        return cur

    @staticmethod
    def _stale(job: Job, attempt: int) -> StaleAttempt:
        cur = job.current
        return StaleAttempt(
            f"attempt {attempt} of job {job.job_id} is not current "
            f"(current: {'none, the job is queued again' if cur is None else cur.number})"
        )

    # --- timers -----------------------------------------------------------------------------

    def tick(self, now: float) -> None:
        """Apply every time-based rule due at ``now``: lost hosts, unanswered assignments."""
        changed = False
        # Only what the deadline heap says is due is looked at (never every host): an
        # entry is a lower bound, so each is checked against its real deadline and re-armed.
        due = self._timers.due(now)
        hosts = [self._hosts[k] for kind, k in due if kind == "host" and k in self._hosts]
        jobs = [self._live[k] for kind, k in due if kind == "job" and k in self._live]
        for h in hosts:
            if h.session is not None and now >= h.last_seen + self._lost_after(h):
                self._lose_host(h, now)
                changed = True
            elif h.recovering_until is not None and now >= h.recovering_until:
                # Still absent after the recovery grace: lost by the ordinary rule.
                self._lose_host(h, now)
                changed = True
            else:
                self._arm_host(h)
        for job in jobs:
            cur = job.current
            if job.job_id not in self._live or cur is None:
                continue
            deadline = self._job_deadline(job)
            if deadline is None:
                continue
            if now < deadline:
                self._arm_job(job)
                continue
            if cur.status == "assigned":
                self._requeue(job, "not started in time; offered again")
                changed = True
            elif cur.status == "running" and cur.adopted:
                self._terminate(
                    job, "lost", reason="the restarted worker never finished it", by="controller"
                )
                changed = True
        if changed:
            self._changed()

    def credit_pause(self, seconds: float) -> None:
        """Time the controller itself was not running (a SIGSTOP, a long GC, a suspended VM)
        does not count against anybody: every host's and assignment's timer moves on by it.

        The heartbeats a host sent meanwhile are waiting in the controller's own socket
        backlog; without the credit the first tick after the pause would declare the host
        lost before reading them.
        """
        if seconds <= 0:
            return
        for h in self._hosts.values():
            if h.session is not None:
                h.last_seen += seconds
        for job in self._live.values():
            cur = job.current
            if cur is not None:
                cur.last_heard += seconds

    def _lost_after(self, h: Host) -> float:
        """Silence after which a host is lost: missed heartbeats of the interval it was told."""
        interval = h.heartbeat_interval_s or self.config.heartbeat_interval_s
        return interval * self.config.missed_heartbeats

    def heartbeat_interval_now(self) -> float:
        """The interval a host registering now is told (see ``StoreConfig.heartbeat_rate``)."""
        base = self.config.heartbeat_interval_s
        rate = self.config.heartbeat_rate
        if rate <= 0:
            return base
        live = sum(1 for h in self._hosts.values() if h.session is not None or not h.lost)
        return max(base, live / rate)

    def next_deadline(self) -> float | None:
        """When :meth:`tick` next has something to do, on the controller clock."""
        # The heap's first entry: at or before the real first deadline (entries are lazy),
        # so a waiter may wake early, tick nothing and wait again, but never late.
        return self._timers.earliest()

    def _lose_host(self, h: Host, now: float) -> None:
        if h.session is not None:
            del self._sessions[h.session]
        h.session = None
        h.recovering_until = None
        h.lost = True
        self.journal.host(h.name)
        self._touch_host(h.name)
        self._claimed = {a for a in self._claimed if a[0] != h.name}
        self._listed.pop(h.name, None)
        lost: list[str] = []
        requeued: list[str] = []
        for d in h.devices.values():
            job = d.job
            cur = None if job is None else job.current
            if job is not None and cur is not None and cur.status == "assigned":
                self._requeue(job, "host lost before it started")
                requeued.append(job.job_id)
                job = cur = None
            if d.present:
                detail = "host lost: no heartbeat"
                if job is not None:
                    detail = f"host lost while job {job.job_id} was running"
                self.controller_fault(
                    d,
                    None if job is None else job.job_id,
                    None if cur is None else cur.number,
                    None if cur is None else cur.start_boot_id,
                    detail,
                )
            if job is not None:
                self._terminate(job, "lost", reason="host lost: no heartbeat", by="controller")
                lost.append(job.job_id)
        self._emit("host_lost", host=h.name, jobs=lost, requeued=requeued)

    # --- job transitions --------------------------------------------------------------------

    def _requeue(self, job: Job, note: str) -> None:
        self.journal.job(job.job_id)
        self._touch_job(job)
        self._queued_new.append(job)
        self._queued_since[job.job_id] = self._wall()
        cur = job.current
        if cur is not None:
            cur.status = "requeued"
            cur.note = note
            self._release(job, cur)
        job.state = "queued"
        self._live.pop(job.job_id, None)
        bisect.insort(self._queue, (job.seq, job.job_id))

    def _release(self, job: Job, att: Attempt) -> None:
        h = self._hosts.get(att.host)
        d = None if h is None else h.devices.get(att.device)
        if d is not None:
            d.vacate(job, self._wall())

    def _terminate(
        self,
        job: Job,
        outcome: str,
        *,
        by: str,
        reason: str = "",
        exit_code: int | None = None,
        killed: bool = False,
    ) -> bool:
        """Record a terminal state; False (and no change) if one is already recorded."""
        if job.terminal:
            return False
        self.journal.job(job.job_id)
        self._touch_job(job)
        self._cancelled.pop(job.job_id, None)
        self._job_cands.pop(job.job_id, None)
        self._queued_since.pop(job.job_id, None)
        if job.state == "queued":
            self._queue.remove((job.seq, job.job_id))
        job.state = outcome
        job.outcome = outcome
        self.stats.jobs_finished[outcome] += 1
        job.reason = reason
        job.exit_code = exit_code
        job.killed = killed
        job.finished_at = self._wall()
        job.finished_by = by
        self._live.pop(job.job_id, None)
        self._finished[job.job_id] = None
        cur = job.current
        if cur is not None:
            cur.status = "finished"
            self._release(job, cur)
        self._emit(
            "job_finished",
            job_id=job.job_id,
            attempt=job.attempt,
            outcome=outcome,
            exit_code=exit_code,
            reason=reason,
            host=None if cur is None else cur.host,
            device=None if cur is None else cur.device,
            by=by,
        )
        return True

    # --- faults -----------------------------------------------------------------------------

    def _raise_fault(self, d: Device, fault: Fault) -> bool:
        if fault.fault_id in d.seen_faults:
            return False
        d.seen_faults.add(fault.fault_id)
        d.faults[fault.fault_id] = fault
        self.journal.host(d.host)
        self._touch_host(d.host)
        key = (fault.kind, fault.action)
        self.faults_raised[key] = self.faults_raised.get(key, 0) + 1
        self._emit(
            "device_quarantined",
            host=d.host,
            device=d.name,
            fault_id=fault.fault_id,
            kind=fault.kind,
            severity=fault.severity,
            action=fault.action,
            scope=fault.scope,
            reason=fault.reason,
            detail=fault.detail,
            job_id=fault.job_id,
        )
        return True

    def _lift(self, d: Device, fault_ids: Iterable[str], *, by: str) -> None:
        lifted = [fault for f in fault_ids if (fault := d.faults.pop(f, None)) is not None]
        ids = [fault.fault_id for fault in lifted]
        if not ids:
            return
        self.stats.faults_cleared.update(fault.kind for fault in lifted)
        self.journal.host(d.host)
        self._control_changed(d.host)
        # Listed in heartbeat `cleared` whoever lifted them: a worker may hold an id it
        # learned at an earlier registration, and frees the device only when told.
        for i in ids:
            d.cleared_pending[i] = 0
        self._emit("device_cleared", host=d.host, device=d.name, fault_ids=ids, by=by)

    def _lift_children(self, host: str, parents: Collection[str], *, by: str) -> bool:
        """Lift the faults of ``host``'s devices whose ``parent_fault`` is among
        ``parents`` (a MIG slice's copies of its physical GPU's faults); whether any was."""
        h = self._hosts.get(host)
        if h is None or not parents:
            return False
        lifted = False
        for other in h.devices.values():
            children = [f for f, x in other.faults.items() if x.parent_fault in parents]
            if children:
                self._lift(other, children, by=by)
                lifted = True
        return lifted

    def _parent_lifted(self, d: Device, parent_fault: str) -> bool:
        """Whether ``parent_fault`` was a fault of a device of ``d``'s host that has been
        lifted since: a child naming it is a copy of a fault already cleared."""
        h = self._hosts.get(d.host)
        if h is None:
            return False
        return any(
            parent_fault in other.seen_faults and parent_fault not in other.faults
            for other in h.devices.values()
        )

    def _worker_fault(
        self,
        d: Device,
        fault_id: str,
        kind: str,
        detail: str,
        job_id: str | None,
        req: FaultRequest | None = None,
    ) -> bool:
        fault = Fault(fault_id, kind, "fault", detail, job_id, None, raised_by="worker")
        if req is not None:
            fault.severity = req.severity or ""
            fault.action = req.action or ""
            fault.scope = "host" if req.scope == "host" else "device"
            fault.parent_fault = req.parent_fault
            fault.__attrs_post_init__()
        raised = self._raise_fault(d, fault)
        if raised and fault.parent_fault is not None and self._parent_lifted(d, fault.parent_fault):
            # A slice's copy of a GPU fault cleared before it arrived (the worker raised
            # it before it heard of the clear): it goes with the GPU's, as it would have
            # had it come first, rather than keep the slice quarantined for a cleared fault.
            self._lift(d, [fault_id], by="parent_cleared")
        return raised

    # --- for registration (rc_worker.controller.registration) -------------------------------

    def running_on(self, host: str) -> list[tuple[Job, Attempt]]:
        out = []
        for job in self._live.values():
            cur = job.current
            if cur is not None and cur.host == host and cur.status == "running":
                self.journal.job(job.job_id)
                out.append((job, cur))
        return out

    def known_job(self, job_id: str) -> Job | None:
        return self._jobs.get(job_id)

    def controller_fault(
        self, d: Device, job_id: str | None, attempt: int | None, boot_id: str | None, detail: str
    ) -> None:
        self._raise_fault(
            d,
            Fault(
                self._next_id("fc"),
                "interrupted",
                "interrupted",
                detail,
                job_id,
                attempt,
                raised_by="controller",
                boot_id=boot_id,
            ),
        )

    def lift(self, d: Device, fault_ids: Iterable[str], *, by: str) -> None:
        self._lift(d, fault_ids, by=by)

    def lose_job(self, job: Job, reason: str) -> None:
        self._terminate(job, "lost", by="controller", reason=reason)

    # --- for adopted claims (rc_worker.controller.claims) ------------------------------------

    def wall(self) -> float:
        return self._wall()

    def next_seq(self) -> int:
        n = self._counters["j"] = self._counters.get("j", 0) + 1
        return n

    def adopt_fault(self, d: Device, fault: Fault) -> None:
        if self._raise_fault(d, fault):
            self._emit("fault_adopted", host=d.host, device=d.name, fault_id=fault.fault_id)
            if fault.parent_fault is not None and self._parent_lifted(d, fault.parent_fault):
                # As for a ``fault`` report naming it: a copy of a GPU fault already cleared.
                self._lift(d, [fault.fault_id], by="parent_cleared")

    def adopt_newer_attempt(
        self, job: Job, d: Device, number: int, now: float, *, via: str
    ) -> None:
        """A worker runs attempt ``number`` of ``job``, above any attempt recorded here:
        the attempts up to it are recorded, then the job is adopted as an unknown one is."""
        cur = job.current
        if cur is not None:
            cur.status = "requeued"
            cur.note = f"superseded: {d.host}/{d.name} runs attempt {number}"
            self._release(job, cur)
        elif job.state == "queued":
            self._queue.remove((job.seq, job.job_id))
            self._queued_since.pop(job.job_id, None)
        for n in range(job.attempt + 1, number):
            job.attempts.append(Attempt(n, d.host, d.name, "requeued", now, note="not recorded"))
        job.attempts.append(Attempt(number, d.host, d.name, "running", now, adopted=True))
        job.state = "running"
        if job.started_at is None:
            job.started_at = self._wall()
        self.adopt_job(job, d, via=via)

    def start_claimed_offer(
        self,
        job: Job,
        d: Device,
        now: float,
        *,
        boot_id: str | None,
        started_at: float | None,
        via: str,
    ) -> None:
        """A worker runs the attempt offered to ``d`` whose ``start`` never arrived (the
        controller restarted before storing it, or it was lost in an outage): started, as
        that start would have, and adopted, so that the worker owes its report."""
        cur = job.current
        assert cur is not None
        assert cur.status == "assigned"
        cur.status = "running"
        cur.adopted = True
        cur.last_heard = now
        # The job runs now, so it started on the boot the worker runs on.
        cur.start_boot_id = boot_id
        said = "the registration" if via == "register" else f"a {via}"
        cur.note = f"started: adopted from {said}; its start never arrived"
        job.state = "running"
        job.started_at = started_at if started_at is not None else self._wall()
        self.adopt_job(job, d, via=via)

    def _displace(self, d: Device, claimed: Job) -> None:
        """The worker says ``d`` runs ``claimed``: a job the controller had there is not.

        Overwritten silently, it would stay ``running`` for ever (not adopted, so no report
        timeout; no heartbeat names it) while the device is offered again once ``claimed``
        ends. An offer not yet started is offered again; a running one ended ``lost``. No
        fault is raised: the worker's own recovery judged the device before it ran
        ``claimed`` there, and any fault it holds it claims with the device.
        """
        held = d.job
        cur = None if held is None else held.current
        if held is None or held is claimed or cur is None:
            return
        why = f"the worker runs {claimed.job_id} on {d.host}/{d.name}"
        if cur.status == "assigned":
            self._requeue(held, f"{why}; offered again")
        else:
            self._terminate(held, "lost", by="controller", reason=f"{why}, not this job")

    def adopt_job(self, job: Job, d: Device, *, via: str) -> None:
        """``job``, its current attempt running on ``d``, is the worker's claim: live, on
        the device (whatever the store had there), stored, and owed a report. ``via``:
        what said so (``register`` or ``heartbeat``), for the event log."""
        self._jobs[job.job_id] = job
        self._live[job.job_id] = job
        self._displace(d, job)
        d.occupy(job, self._wall())
        self.journal.job(job.job_id)
        self._touch_job(job)
        self._arm_job(job)
        cur = job.current
        self._emit(
            "job_adopted",
            job_id=job.job_id,
            attempt=job.attempt,
            host=d.host,
            device=d.name,
            adopted_attempt=None if cur is None else cur.number,
            via=via,
        )
