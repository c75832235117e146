"""Records to rows and back: what a persistence backend writes, and the store rebuilt from it.

Sans-IO. A job is one JSON document (its spec, attempts and outcome); a host is
one JSON document with its devices and their faults; events are rows of their
own; output is a list of ``(offset, bytes)`` chunks. The controller clock
(``now``) does not survive a restart, so the times measured on it (a host's
``last_seen``, an attempt's ``last_heard``) are set to the restart's ``now`` on
load; wall-clock timestamps are kept as they were.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from typing import Any

import attrs

from rc_worker.controller.journal import Marks
from rc_worker.controller.messages import Event, JobSpec, Verify
from rc_worker.controller.records import Attempt, Device, Fault, Host, Job
from rc_worker.controller.state_persist import StoredState
from rc_worker.core import protocol
from rc_worker.core.selectors import parse_selector

__all__ = ["Batch", "JobRow", "Loaded", "restore", "stored_job", "take_batch"]


@attrs.frozen
class JobRow:
    job_id: str
    seq: int
    state: str
    finished_at: float | None
    data: str


@attrs.frozen
class Batch:
    """One commit: rows to upsert (jobs, hosts, meta), rows to add (events, output)."""

    generation: int
    jobs: tuple[JobRow, ...] = ()
    hosts: tuple[tuple[str, str], ...] = ()
    events: tuple[tuple[int, str, float, str], ...] = ()
    output: tuple[tuple[str, int, bytes], ...] = ()
    """``(job_id, offset, data)`` pieces, in the order they were appended."""
    meta: tuple[tuple[str, str], ...] = ()
    deleted_hosts: tuple[str, ...] = ()
    """Hosts marked but no longer in the store (retired)."""


@attrs.frozen
class Loaded:
    """Everything a backend read at start, for :func:`restore`."""

    meta: Mapping[str, str]
    jobs: tuple[str, ...]
    """Documents of the jobs not finished (queued, assigned, running), in submission order:
    finished ones are read from the store when asked for, never all at start."""
    hosts: tuple[str, ...]
    events: tuple[tuple[int, str, float, str], ...]
    """The most recent events, oldest first."""
    output: Mapping[str, int]
    """How many bytes of output each of those jobs has stored (the bytes stay in the store)."""
    finished: Mapping[str, int] = attrs.Factory(dict)
    """How many finished jobs the store holds, per state (their records stay in the store)."""


def _dumps(value: object) -> str:
    return json.dumps(value, separators=(",", ":"), sort_keys=True)


# --- records to documents -------------------------------------------------------------------


def _attempt_doc(a: Attempt) -> dict[str, object]:
    return {
        "number": a.number,
        "host": a.host,
        "device": a.device,
        "status": a.status,
        "start_boot_id": a.start_boot_id,
        "adopted": a.adopted,
        "note": a.note,
    }


def job_doc(job: Job) -> dict[str, object]:
    return {
        "job_id": job.job_id,
        "seq": job.seq,
        "spec": job.spec.to_json(),
        "submitted_at": job.submitted_at,
        "state": job.state,
        "attempts": [_attempt_doc(a) for a in job.attempts],
        "cancel_reason": job.cancel_reason,
        "refusals": job.refusals,
        "stale_refusals": job.stale_refusals,
        "submitted_by": job.submitted_by,
        "started_at": job.started_at,
        "finished_at": job.finished_at,
        "finished_by": job.finished_by,
        "outcome": job.outcome,
        "exit_code": job.exit_code,
        "killed": job.killed,
        "reason": job.reason,
        "error": job.error,
        "output_bytes": job.output_bytes,
        "fault_id": job.fault_id,
        "verify": None if job.verify is None else protocol.unstructure(job.verify),
        "sweep": job.sweep,
        "adopted": job.adopted,
        "output_truncated": job.output_truncated,
        "dropped_bytes": job.dropped_bytes,
    }


def _fault_doc(f: Fault) -> dict[str, object]:
    return {
        "fault_id": f.fault_id,
        "kind": f.kind,
        "reason": f.reason,
        "detail": f.detail,
        "job_id": f.job_id,
        "attempt": f.attempt,
        "raised_by": f.raised_by,
        "boot_id": f.boot_id,
        "severity": f.severity,
        "action": f.action,
        "scope": f.scope,
        "parent_fault": f.parent_fault,
    }


def _device_doc(d: Device) -> dict[str, object]:
    return {
        "present": d.present,
        "declared": d.declared,
        "facts": d.facts,
        "sheet": d.sheet,
        "idle_behavior": d.idle_behavior,
        "faults": [_fault_doc(f) for f in d.faults.values()],
        "seen_faults": sorted(d.seen_faults),
        "cleared_pending": d.cleared_pending,
        "worker_state": d.worker_state,
        "worker_faults": sorted(d.worker_faults),
        "last_job": d.last_job,
        "last_busy": d.last_busy,
    }


def host_doc(h: Host) -> dict[str, object]:
    return {
        "name": h.name,
        "boot_id": h.boot_id,
        "lost": h.lost,
        "left": h.left,
        "pid": h.pid,
        "instance_id": h.instance_id,
        "heartbeat_interval_s": h.heartbeat_interval_s,
        "worker_version": h.worker_version,
        "require_manual_clear": h.require_manual_clear,
        "facts": h.facts,
        "sheet": h.sheet,
        "devices": {name: _device_doc(d) for name, d in h.devices.items()},
    }


def take_batch(store: StoredState) -> Batch:
    """Serialize what the store's journal marked since the last batch (and the counters)."""
    marks, generation = store.journal.take()
    return batch_of(store, marks, generation)


def batch_of(store: StoredState, marks: Marks, generation: int) -> Batch:
    jobs = []
    for job_id in sorted(marks.jobs):
        job = store.known_job(job_id)
        if job is not None:
            jobs.append(
                JobRow(job.job_id, job.seq, job.state, job.finished_at, _dumps(job_doc(job)))
            )
    hosts = []
    deleted = []
    for name in sorted(marks.hosts):
        h = store.known_host(name)
        if h is not None:
            hosts.append((name, _dumps(host_doc(h))))
        else:
            deleted.append(name)
    events = tuple((e.seq, e.type, e.time, _dumps(dict(e.data))) for e in marks.events)
    meta = (
        ("instance", store.instance),
        ("counters", _dumps(store.counters())),
        ("event_seq", str(store.last_event_seq)),
        ("retired_hosts", _dumps(sorted(store.retired_hosts))),
    )
    # The pieces as the requests brought them: a backend that stores rows joins them
    # (coalesce_output); one that writes files writes them as they are, without the copy.
    output = tuple(marks.output)
    return Batch(generation, tuple(jobs), tuple(hosts), events, output, meta, tuple(deleted))


OUTPUT_ROW_BYTES = 1 << 20
"""Pieces of one job's output that follow each other are stored as rows of up to this size."""


def coalesce_output(
    pieces: Iterable[tuple[str, int, bytes]], row_bytes: int = OUTPUT_ROW_BYTES
) -> tuple[tuple[str, int, bytes], ...]:
    """Join the pieces that continue each other (same job, next offset) into rows of at
    most ``row_bytes`` (a single larger piece stays whole).

    A streamed output request arrives in pieces of the server's read size (64 KiB),
    each journalled as it is read; stored one row each, 1 GiB of output would be 16,384
    rows, every one with its own index entry and per-row cost on the way in and on every
    read back. The bytes and their offsets are unchanged: only the cuts move.
    """
    rows: list[tuple[str, int, bytes]] = []
    run: list[bytes] = []
    run_job, run_off, run_len = "", 0, 0
    for job_id, off, data in pieces:
        continues = run and job_id == run_job and off == run_off + run_len
        if continues and run_len + len(data) <= row_bytes:
            run.append(data)
            run_len += len(data)
            continue
        if run:
            rows.append((run_job, run_off, run[0] if len(run) == 1 else b"".join(run)))
        run, run_job, run_off, run_len = [data], job_id, off, len(data)
    if run:
        rows.append((run_job, run_off, run[0] if len(run) == 1 else b"".join(run)))
    return tuple(rows)


# --- documents to records -------------------------------------------------------------------


def _spec(doc: Mapping[str, Any]) -> JobSpec:
    # Stored in its wire form (``JobSpec.to_json``), so read back through the protocol's converter.
    return protocol.structure(doc, JobSpec)


def load_job(doc: Mapping[str, Any], now: float) -> Job:
    spec = _spec(doc["spec"])
    verify = doc.get("verify")
    job = Job(
        job_id=doc["job_id"],
        seq=doc["seq"],
        spec=spec,
        selector=parse_selector(spec.select),
        submitted_at=doc["submitted_at"],
        state=doc["state"],
        attempts=[
            Attempt(
                number=a["number"],
                host=a["host"],
                device=a["device"],
                status=a["status"],
                last_heard=now,
                start_boot_id=a.get("start_boot_id"),
                adopted=bool(a.get("adopted", False)),
                note=a.get("note", ""),
            )
            for a in doc.get("attempts", ())
        ],
        cancel_reason=doc.get("cancel_reason"),
        refusals=doc.get("refusals", 0),
        stale_refusals=doc.get("stale_refusals", 0),
        submitted_by=doc.get("submitted_by"),
        started_at=doc.get("started_at"),
        finished_at=doc.get("finished_at"),
        finished_by=doc.get("finished_by"),
        outcome=doc.get("outcome"),
        exit_code=doc.get("exit_code"),
        killed=bool(doc.get("killed", False)),
        reason=doc.get("reason", ""),
        error=doc.get("error"),
        output_bytes=doc.get("output_bytes"),
        fault_id=doc.get("fault_id"),
        verify=None if verify is None else protocol.structure(verify, Verify),
        sweep=doc.get("sweep"),
    )
    job.adopted = bool(doc.get("adopted", False))
    job.output_truncated = bool(doc.get("output_truncated", False))
    job.dropped_bytes = int(doc.get("dropped_bytes", 0))
    return job


def load_host(doc: Mapping[str, Any], now: float) -> Host:
    h = Host(
        name=doc["name"],
        boot_id=doc["boot_id"],
        last_seen=now,
        lost=bool(doc.get("lost", False)),
        left=bool(doc.get("left", False)),
        pid=doc.get("pid"),
        instance_id=doc.get("instance_id"),
        heartbeat_interval_s=doc.get("heartbeat_interval_s"),
        worker_version=doc.get("worker_version", ""),
        require_manual_clear=bool(doc.get("require_manual_clear", False)),
        facts=dict(doc.get("facts") or {}),
        sheet=doc.get("sheet"),
    )
    for name, dd in (doc.get("devices") or {}).items():
        d = Device(
            h.name,
            name,
            present=bool(dd.get("present", True)),
            declared=dict(dd.get("declared") or {}),
            facts=dict(dd.get("facts") or {}),
            sheet=dd.get("sheet"),
            idle_behavior=dd.get("idle_behavior", "run"),
            seen_faults=set(dd.get("seen_faults") or ()),
            cleared_pending=dict(dd.get("cleared_pending") or {}),
            worker_state=dd.get("worker_state"),
            last_job=dd.get("last_job"),
            last_busy=dd.get("last_busy"),
        )
        d.worker_faults = set(dd.get("worker_faults") or ())
        for f in dd.get("faults") or ():
            d.faults[f["fault_id"]] = Fault(
                f["fault_id"],
                f["kind"],
                f["reason"],
                f.get("detail", ""),
                f.get("job_id"),
                f.get("attempt"),
                f.get("raised_by", "worker"),
                f.get("boot_id"),
                severity=f.get("severity", ""),
                action=f.get("action", ""),
                scope=f.get("scope", "device"),
                parent_fault=f.get("parent_fault"),
            )
        h.devices[name] = d
    return h


def restore(
    store: StoredState, loaded: Loaded, *, now: float, recovery_grace_s: float | None
) -> None:
    """Fill an empty store from what a backend loaded, and start the recovery phase.

    Every known host becomes ``unknown`` until its worker registers again, for at
    most ``recovery_grace_s`` (``None``: until it registers, however long).
    """
    meta = loaded.meta
    if "instance" in meta:
        store.instance = meta["instance"]
    store.restore_counters(json.loads(meta.get("counters", "{}")), int(meta.get("event_seq", "0")))
    store.retired_hosts = set(json.loads(meta.get("retired_hosts", "[]")))
    for text in loaded.hosts:
        h = load_host(json.loads(text), now)
        if h.lost or h.left:
            h.recovering_until = None  # gone already: nothing to wait for
        elif recovery_grace_s is not None:
            h.recovering_until = now + recovery_grace_s
        else:
            h.recovering_until = float("inf")
        store.restore_host(h)
    for text in loaded.jobs:
        job = load_job(json.loads(text), now)
        # The bytes stay beneath the store; reads below this go there (OutputElsewhere).
        job.output_base = loaded.output.get(job.job_id, 0)
        store.restore_job(job)
    store.restore_events(
        Event(seq, type_, time, json.loads(data)) for seq, type_, time, data in loaded.events
    )
    store.restore_stored_counts(loaded.finished)


def stored_job(doc: str, stored_bytes: int, now: float) -> Job:
    """A job as a backend returned it (``read_job``, ``read_finished``), with its output
    length: the bytes stay in the store."""
    job = load_job(json.loads(doc), now)
    job.output_base = stored_bytes
    return job
