"""What changed in the store since the last commit: the seam persistence reads from.

The store marks every record it mutates here (a job by id, a host by name), and
every event and output chunk it adds. A persistence layer takes the marks with
:meth:`Journal.take` at each commit and writes those records; the in-memory
controller never enables the journal, so the sets stay empty.
Sans-IO: no Trio, no database.
"""

from __future__ import annotations

import attrs

from rc_worker.controller.messages import Event


@attrs.define
class Marks:
    """One commit's worth of changes: ids of records to rewrite, events and output to add."""

    jobs: set[str] = attrs.Factory(set)
    hosts: set[str] = attrs.Factory(set)
    events: list[Event] = attrs.Factory(list)
    output: list[tuple[str, int, bytes]] = attrs.Factory(list)
    """``(job_id, offset, data)`` appended since the last commit."""

    def __bool__(self) -> bool:
        return bool(self.jobs or self.hosts or self.events or self.output)


class Journal:
    """Dirty marks, and a generation that moves with each of them."""

    def __init__(self) -> None:
        self.enabled = False
        self.generation = 0
        self._marks = Marks()
        self._in_flight: set[str] = set()
        """Jobs of the commit being written: not stored yet either, until :meth:`stored`
        (a commit that fails puts them back)."""

    def enable(self) -> None:
        """A persistence layer reads the marks from now on (off by default: ``--memory``)."""
        self.enabled = True

    def job(self, job_id: str) -> None:
        if self.enabled:
            self._marks.jobs.add(job_id)
            self.generation += 1

    def host(self, name: str) -> None:
        if self.enabled:
            self._marks.hosts.add(name)
            self.generation += 1

    def event(self, event: Event) -> None:
        if self.enabled:
            self._marks.events.append(event)
            self.generation += 1

    def output(self, job_id: str, offset: int, data: bytes) -> None:
        if self.enabled:
            self._marks.output.append((job_id, offset, data))
            self.generation += 1

    def drop_output(self, job_id: str) -> None:
        """Forget the job's output marked since the last :meth:`take` (its count went back:
        those pieces lie past a hole, and the worker resends them)."""
        self._marks.output = [piece for piece in self._marks.output if piece[0] != job_id]

    def marked_jobs(self) -> set[str]:
        """Ids of the jobs not stored yet: marked since the last :meth:`take`, and those of
        the commit being written. Without the latter, a job could leave memory while its
        commit is in flight; if that commit then failed, the retry could not find it, and
        its end would never be stored."""
        return self._marks.jobs | self._in_flight

    def put_back(self, marks: Marks) -> None:
        """Marks taken for a commit that failed: merged into the current ones, in order, so
        the next commit writes them (re-read from the records) with whatever came since."""
        current, self._marks = self._marks, marks
        self._in_flight = set()
        self._marks.jobs |= current.jobs
        self._marks.hosts |= current.hosts
        self._marks.events += current.events
        self._marks.output += current.output

    def take(self) -> tuple[Marks, int]:
        """The marks so far and the generation they cover; starts a fresh set."""
        marks, self._marks = self._marks, Marks()
        self._in_flight = set(marks.jobs)
        return marks, self.generation

    def stored(self) -> None:
        """The commit of the last :meth:`take` is written: its jobs are stored."""
        self._in_flight = set()
