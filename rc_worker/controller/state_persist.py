"""The store's state as a persistence layer beneath it sees it: what to store, what to
restore at start, paging, retention, and finished jobs that live only beneath.

:class:`StoredState` is :class:`~rc_worker.controller.state.StoreState` with these
operations; the store (``store.py``) is built on it. Sans-IO.
"""

from __future__ import annotations

import bisect
import collections
from collections.abc import Iterable, Mapping

from rc_worker.controller.job_filter import JobFilter
from rc_worker.controller.messages import Event
from rc_worker.controller.records import Host, Job
from rc_worker.controller.state import StoreState


class StoredState(StoreState):
    """The state, with what ``rc_worker.controller.persist`` and retention need of it."""

    # --- for persistence (rc_worker.controller.persist) -------------------------------------

    def known_host(self, name: str) -> Host | None:
        return self._hosts.get(name)

    def counters(self) -> dict[str, int]:
        return dict(self._counters)

    @property
    def last_event_seq(self) -> int:
        return self._event_seq

    def restore_counters(self, counters: dict[str, int], event_seq: int) -> None:
        """Ids and event numbers carry on from a stored state: they never repeat."""
        self._counters = dict(counters)
        self._event_seq = event_seq

    def restore_host(self, h: Host) -> None:
        self._hosts[h.name] = h
        self._reindex_host(h)
        self._arm_host(h)

    def restore_job(self, job: Job) -> None:
        """A stored job, back in the queue or on its device as it was."""
        self._jobs[job.job_id] = job
        if job.state == "queued":
            bisect.insort(self._queue, (job.seq, job.job_id))
            return
        cur = job.current
        if job.terminal:
            self._finished[job.job_id] = None
            return
        if cur is None:
            return
        self._live[job.job_id] = job
        if job.cancel_reason is not None:
            self._cancelled[job.job_id] = job
        self._arm_job(job)
        h = self._hosts.get(cur.host)
        d = None if h is None else h.devices.get(cur.device)
        if d is not None:
            d.job = job

    def first_event_seq(self) -> int | None:
        """The oldest event still in memory (older ones were dropped from the ring)."""
        return self._events[0].seq if self._events else None

    def restore_events(self, events: Iterable[Event]) -> None:
        self._events.extend(events)

    def jobs_page(
        self,
        state: str | None,
        *,
        after: int | None,
        limit: int,
        newest_first: bool,
        where: JobFilter | None = None,
    ) -> tuple[list[Job], int | None]:
        """One page of jobs in submission order (or newest first), after the cursor ``after``
        (a job's ``seq``); returns the jobs and the cursor of the next page, None at the end."""
        jobs = [
            j
            for j in self._jobs.values()
            if (state is None or j.state == state) and (where is None or where(j))
        ]
        # By seq, not by insertion: a finished job read back from the store (readmit)
        # comes in after newer ones. Nearly sorted already, so this costs next to nothing.
        jobs.sort(key=lambda j: j.seq, reverse=newest_first)
        if after is not None:
            jobs = [j for j in jobs if (j.seq < after if newest_first else j.seq > after)]
        page = jobs[:limit]
        return page, (page[-1].seq if len(jobs) > limit else None)

    def trim_output(self, job_id: str, upto: int) -> None:
        """Output below ``upto`` is committed beneath the store: drop it from memory."""
        job = self._jobs.get(job_id)
        if job is None or upto <= job.output_base:
            return
        cut = min(upto, job.stored_bytes) - job.output_base
        del job.output[:cut]
        job.output_base += cut

    def recount_output(self, job_id: str, length: int) -> None:
        """The store beneath holds only ``length`` bytes of the job's output (its file was
        removed or cut under a running controller): count from there. What came past the
        hole, in memory or marked for the next commit, is dropped, and the worker's next
        output is answered with ``length`` (``409 gap`` above it), so it resends the rest
        from its spool. Bytes dropped past ``max_output_bytes`` are counted again as the
        worker resends them."""
        job = self._jobs.get(job_id)
        if job is None or length >= job.stored_bytes:
            return
        stored = job.stored_bytes + job.dropped_bytes
        del job.output[:]
        job.output_base = length
        job.dropped_bytes = 0
        self.journal.drop_output(job_id)
        self.journal.job(job_id)
        self._emit("job_output_recounted", job_id=job_id, stored=stored, counted=length)
        self._touch_job(job)
        self._changed()

    def finished_before(self, wall_time: float) -> list[str]:
        """Ids of jobs that ended before ``wall_time`` (wall clock): retention's candidates."""
        return [
            j.job_id
            for j in self._jobs.values()
            if j.terminal and j.finished_at is not None and j.finished_at < wall_time
        ]

    def forget(self, job_ids: Iterable[str]) -> None:
        """Drop finished jobs (retention); a job still held anywhere is kept."""
        for job_id in job_ids:
            job = self._jobs.get(job_id)
            if job is not None and job.terminal:
                del self._jobs[job_id]
                self._job_cands.pop(job_id, None)
                self._finished.pop(job_id, None)

    # --- finished jobs beneath the store (bounded memory) ------------------------------------

    def evict_finished(self, keep: int, busy: Iterable[str] = ()) -> list[str]:
        """Drop the oldest finished jobs from memory until at most ``keep`` remain.

        Called by a persistence layer once they are stored: a job marked in the journal
        since the last commit, with output not yet committed, or ``busy`` (a request is
        using it) stays. Returns the ids dropped; their records are read from the store
        beneath from then on, and are never loaded all at once again.
        """
        excess = len(self._finished) - keep
        if excess <= 0:
            return []
        skip = set(self.journal.marked_jobs())
        skip.update(busy)
        out: list[str] = []
        for job_id in list(self._finished):
            if excess <= 0:
                break
            job = self._jobs.get(job_id)
            if job is None or not job.terminal:
                del self._finished[job_id]
                continue
            if job_id in skip or job.output:
                continue
            del self._finished[job_id]
            del self._jobs[job_id]
            self._stored_counts[job.state] += 1
            out.append(job_id)
            excess -= 1
        return out

    def readmit(self, job: Job) -> None:
        """A finished job read back from the store beneath, in memory again (as the most
        recently used) so that a decision about it (a late finish, a claim) can be made;
        :meth:`evict_finished` drops it again. Not a change: nothing is marked."""
        if job.job_id in self._jobs or not job.terminal:
            return
        self._jobs[job.job_id] = job
        self._finished[job.job_id] = None
        if self._stored_counts[job.state] > 0:
            self._stored_counts[job.state] -= 1

    def restore_stored_counts(self, counts: Mapping[str, int]) -> None:
        """How many finished jobs the store beneath holds (not loaded at start), per state."""
        self._stored_counts = collections.Counter(dict(counts))

    def forget_stored(self, gone: Iterable[tuple[str, str]]) -> None:
        """Retention deleted these ``(job_id, state)`` from the store beneath: forget them."""
        for job_id, state in gone:
            job = self._jobs.get(job_id)
            if job is not None and job.terminal:
                del self._jobs[job_id]
                self._finished.pop(job_id, None)
            elif job is None and self._stored_counts[state] > 0:
                self._stored_counts[state] -= 1

    def in_memory(self, job_id: str) -> bool:
        return job_id in self._jobs

    def output_in_memory(self, job_id: str) -> int:
        """Bytes of the job's output held in memory (with a store beneath: not yet committed)."""
        job = self._jobs.get(job_id)
        return 0 if job is None else len(job.output)

    def memory_job_ids(self) -> set[str]:
        return set(self._jobs)
