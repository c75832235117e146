"""The store's user side for jobs: submitting, viewing, explaining why one waits, cancelling.

A part of :class:`~rc_worker.controller.store.Store` (see its module); sans-IO.
"""

from __future__ import annotations

import bisect
from collections.abc import Mapping, Sequence

import attrs

from rc_worker.controller.errors import (
    BadRequest,
)
from rc_worker.controller.job_filter import JobFilter, placement_filter
from rc_worker.controller.messages import (
    JOB_STATES,
    JobInfo,
    JobSpec,
)
from rc_worker.controller.pending import (
    MAX_COUNTED,
    Candidate,
    Pending,
    explain,
    waiting_reason,
)
from rc_worker.controller.records import Device, Host, Job
from rc_worker.controller.state import OutputElsewhere
from rc_worker.controller.state_persist import StoredState
from rc_worker.controller.validate import check_job
from rc_worker.core.selectors import Selector, SelectorError, parse_selector


class JobsSide(StoredState):
    """Jobs as their submitters and operators see them (``/v1/jobs``)."""

    # --- user side: jobs --------------------------------------------------------------------

    def submit(
        self,
        command: Sequence[str],
        *,
        select: str = "",
        device: str | None = None,
        env: Mapping[str, str] | None = None,
        cwd: str | None = None,
        max_runtime_s: float | None = None,
        idle_timeout_s: float | None = None,
        grace_s: float = 10.0,
        pty: bool = False,
        stdin: bool = False,
        submitted_by: str | None = None,
    ) -> str:
        """Queue a job; returns its id. Raises BadRequest / NotFound (unknown ``device``).

        ``submitted_by`` names the user (recorded in the job and the event log); only
        that user, or an admin, may cancel the job through the API."""
        if isinstance(command, str) or not all(isinstance(a, str) for a in command):
            raise BadRequest("command: must be a non-empty list of strings")
        check_job(
            command=command,
            env=env or {},
            select=select,
            device=device,
            cwd=cwd,
            max_runtime_s=max_runtime_s,
            idle_timeout_s=idle_timeout_s,
            grace_s=grace_s,
            max_grace_s=self.config.max_grace_s,
        )
        try:
            selector = parse_selector(select)
        except SelectorError as e:
            raise BadRequest(f"select: {e}") from None
        if device is not None:
            host, sep, name = device.partition("/")
            if not sep or not host or not name or "/" in name:
                raise BadRequest(f"device: {device!r} is not of the form host/device")
            self._device(host, name)
        spec = JobSpec(
            command=tuple(command),
            select=str(selector),
            device=device,
            env=dict(env or {}),
            cwd=cwd,
            max_runtime_s=max_runtime_s,
            idle_timeout_s=idle_timeout_s,
            grace_s=grace_s,
            pty=pty,
            stdin=stdin,
        )
        job_id = self._next_id("j")
        job = Job(
            job_id,
            self._counters["j"],
            spec,
            selector,
            submitted_at=self._wall(),
            submitted_by=submitted_by,
        )
        self._jobs[job_id] = job
        self.journal.job(job_id)
        bisect.insort(self._queue, (job.seq, job_id))
        self._touch_job(job)
        self._queued_new.append(job)
        self._queued_since[job_id] = job.submitted_at
        if submitted_by is not None:
            self._emit("job_submitted", job_id=job_id, by=submitted_by)
        self._changed()
        return job_id

    def job(self, job_id: str) -> JobInfo:
        return self._view(self._job(job_id))

    def jobs(self, state: str | None = None, where: JobFilter | None = None) -> list[JobInfo]:
        if state is not None and state not in JOB_STATES:
            raise BadRequest(f"state: {state!r} is not one of {', '.join(sorted(JOB_STATES))}")
        candidates: list[Candidate] | None = None  # computed once, and only if a job is queued
        out = []
        for j in self._jobs.values():
            if (state is None or j.state == state) and (where is None or where(j)):
                if j.state == "queued" and candidates is None:
                    candidates = self._candidates()
                out.append(self._view(j, candidates))
        return out

    def jobs_page_info(
        self,
        state: str | None,
        *,
        after: int | None,
        limit: int,
        newest_first: bool,
        where: JobFilter | None = None,
    ) -> tuple[list[JobInfo], int | None]:
        """One page of :meth:`jobs` (see :meth:`StoredState.jobs_page`), as views."""
        if state is not None and state not in JOB_STATES:
            self.jobs(state)  # the 400 naming the valid states
        page, nxt = self.jobs_page(
            state, after=after, limit=limit, newest_first=newest_first, where=where
        )
        return self.views(page), nxt

    def placed_on(self, host: str | None, select: str = "") -> JobFilter | None:
        """The filter of ``GET /v1/jobs?host=&select=`` (:mod:`job_filter`): the devices a
        selector names come from the label index, as for ``GET /v1/devices``."""
        try:
            selector = parse_selector(select)
        except SelectorError as e:
            raise BadRequest(f"select: {e}") from None
        devices = self._index.candidates(selector) if selector.terms else None
        return placement_filter(host, devices)

    def views(self, jobs: Sequence[Job]) -> list[JobInfo]:
        """The views of ``jobs`` (the devices' candidates worked out once for them all)."""
        candidates = self._candidates() if any(j.state == "queued" for j in jobs) else None
        return [self._view(j, candidates) for j in jobs]

    def pending(self, select: str = "", device: str | None = None) -> Pending:
        """Why a job with this selector and pin would wait now (``no_match``: it never runs)."""
        try:
            selector = parse_selector(select)
        except SelectorError as e:
            raise BadRequest(f"select: {e}") from None
        return self._explain(selector, device)

    def _view(self, job: Job, candidates: list[Candidate] | None = None) -> JobInfo:
        # Computed on every read, so a queued job's reason is always the current one.
        info = job.info()
        if job.state != "queued":
            return info
        if candidates is None:
            why = self._explain(job.selector, job.spec.device)
        else:
            why = explain(job.selector, job.spec.device, candidates)
        return attrs.evolve(info, pending_reason=why.reason, pending_code=why.code)

    def _candidates(self) -> list[Candidate]:
        return [self._candidate(h, d) for h in self._hosts.values() for d in h.devices.values()]

    def _candidate(self, h: Host, d: Device) -> Candidate:
        return Candidate(
            address=f"{h.name}/{d.name}",
            labels=self.label_view(h, d),
            present=d.present,
            host_lost=h.lost,
            fault=None if (f := d.first_fault()) is None else f.describe(),
            idle_behavior=d.idle_behavior,
            job_id=None if d.job is None else d.job.job_id,
            worker_state=d.worker_state,
        )

    @staticmethod
    def _is_free(h: Host, d: Device) -> bool:
        """Present and able to take a job now, as :func:`pending.explain` judges it."""
        return not h.lost and not d.faults and d.idle_behavior == "run" and d.job is None

    def _present(self, addr: tuple[str, str]) -> bool:
        h = self._hosts.get(addr[0])
        d = None if h is None else h.devices.get(addr[1])
        return d is not None and d.present

    def _explain(self, selector: Selector, pinned: str | None) -> Pending:
        """:func:`explain` over the devices that matter only, found through the label index:
        the same answer as over the whole fleet (a property test checks it), at the cost
        of the matching devices, not of every device (a submit's answer carries it)."""
        if pinned is not None:
            host, _, name = pinned.partition("/")
            h = self._hosts.get(host)
            d = None if h is None else h.devices.get(name)
            return explain(
                selector, pinned, [] if h is None or d is None else [self._candidate(h, d)]
            )
        addrs = self._index.cached(selector)
        if len(addrs) > MAX_COUNTED:
            # Many devices match: walk the fleet in order and stop at the count a reason shows.
            nfree = 0
            first: tuple[Host, Device] | None = None
            for h in self._hosts.values():
                for d in h.devices.values():
                    if (h.name, d.name) in addrs and d.present and self._is_free(h, d):
                        nfree += 1
                        first = first or (h, d)
                if nfree > MAX_COUNTED + 1:
                    break
            if first is not None:
                return Pending("waiting_for_worker", waiting_reason(self._candidate(*first), nfree))
        by_host: dict[str, set[str]] = {}
        for host, name in addrs:
            by_host.setdefault(host, set()).add(name)
        # In fleet order (hosts, then devices, as registered), as explain() would see them.
        matching = [
            (h, d)
            for h in self._hosts.values()
            if h.name in by_host
            for d in h.devices.values()
            if d.name in by_host[h.name] and d.present
        ]
        if not matching:
            return Pending("no_match", self._no_match(selector))
        # The common answer (a matching device is free) needs only the first free one and a
        # count; Candidates for every matching device are built only when none is free.
        free = [(h, d) for h, d in matching if self._is_free(h, d)]
        if free:
            return Pending(
                "waiting_for_worker", waiting_reason(self._candidate(*free[0]), len(free))
            )
        return explain(selector, None, [self._candidate(h, d) for h, d in matching])

    def _no_match(self, selector: Selector) -> str:
        """Which term the present devices run out at (as :func:`pending._no_match` says it),
        from the index: the candidates of each prefix of the selector."""
        if not any(d.present for h in self._hosts.values() for d in h.devices.values()):
            return "no device is registered"
        for i, term in enumerate(selector.terms):
            if any(map(self._present, self._index.candidates(Selector(selector.terms[: i + 1])))):
                continue
            alone = self._index.candidates(Selector((term,)))
            if i == 0 or not any(map(self._present, alone)):
                return f"no registered device satisfies {str(term)!r}"
            before = ",".join(str(t) for t in selector.terms[:i])
            return f"no registered device that satisfies {before!r} also satisfies {str(term)!r}"
        raise AssertionError("some device satisfies every term")  # pragma: no cover

    def output(self, job_id: str, offset: int = 0, limit: int | None = None) -> bytes:
        """The job's committed output from ``offset`` (at most ``limit`` bytes).

        :class:`OutputElsewhere` if part of it is no longer in memory (a persisted store
        keeps only what is not yet committed to its database); the caller reads it there.
        """
        job = self._job(job_id)
        if offset < job.output_base:
            raise OutputElsewhere(job_id, job.output_base)
        start = offset - job.output_base
        end = None if limit is None else start + limit
        return bytes(job.output[start:end])

    def committed(self, job_id: str) -> int:
        job = self._job(job_id)
        return job.stored_bytes + job.dropped_bytes

    def cancel(self, job_id: str, reason: str = "cancelled", *, by: str | None = None) -> JobInfo:
        """Cancel a job: at once if it has not started, else via the heartbeat's ``cancel``.

        A finished job is left as it is (cancelling is idempotent). ``by`` names who asked
        (recorded in the event log).
        """
        job = self._job(job_id)
        if job.cancel_reason is not None:
            return job.info()
        self.journal.job(job_id)
        if by is not None and not job.terminal:
            self._emit("job_cancel_requested", job_id=job_id, by=by, reason=reason)
        if job.terminal:
            # Declared lost by the controller, it may still run on a worker that was only
            # cut off: the cancel is kept for that worker's heartbeats; the state stays.
            if job.state == "lost" and job.finished_by == "controller":
                job.cancel_reason = reason or "cancelled"
                self._touch_job(job)
                self._changed()
            return job.info()
        job.cancel_reason = reason or "cancelled"
        self._touch_job(job)
        if job.job_id in self._live:
            self._cancelled[job.job_id] = job
        if job.state != "running":
            self._terminate(job, "killed", reason=job.cancel_reason, killed=True, by="controller")
        self._changed()
        return job.info()

    # --- user side: devices and events ------------------------------------------------------
