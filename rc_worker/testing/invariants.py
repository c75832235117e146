"""The fleet's invariant checks (ARCHITECTURE.md), apart from the harness that runs it.

Two kinds. :class:`Watch` sits in every worker's transport and judges what must
be seen at the moment it happens: a device offered ready while a process of its
job lives, or while its own finish is unacknowledged; a ``gone`` claim under
``require_manual_clear``; facts sent for GPUs whose ``nvidia-smi`` failed; a
failed verify pass without the worker's own quarantine; a finish sent again by
a process that already had its final answer. :func:`check` judges the
whole run at the end: exactly one terminal state, output committed once and in
order, a job that exited on its own reported as it exited, hooks that failed
treated as failed.

Both read the truth from the simulated hosts' process tables and the
controller's event log, never from the worker's own account.
"""

from __future__ import annotations

import collections
import math
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx

from rc_worker.controller.messages import Event, JobInfo
from rc_worker.core.gpu_query import gpu_scope
from rc_worker.spool import DISK_ERROR_MARKER
from rc_worker.testing.sim import SimProcess
from rc_worker.testing.transport import json_body

if TYPE_CHECKING:
    from rc_worker.testing.fleet import Fleet, SimNode

__all__ = ["Watch", "check", "job_processes", "worker_scripts"]


def check(fleet: Fleet) -> list[str]:
    """Every invariant violation of ``fleet``'s run so far, as sentences; ``[]`` is a pass."""
    problems = list(fleet.violations)
    events = fleet.store.events()
    finishes = collections.Counter(
        str(e.data["job_id"]) for e in events if e.type == "job_finished"
    )
    for info in fleet.store.jobs():
        problems += _check_job(fleet, info, finishes[info.job_id], events)
    for node in fleet.nodes.values():
        problems += _check_hooks(node, events)
    manual = {n.name for n in fleet.nodes.values() if n.config.require_manual_clear}
    for e in events:
        if e.type == "device_cleared" and e.data.get("by") == "gone" and e.data["host"] in manual:
            problems.append(f"{e.data['host']}/{e.data['device']} freed by a 'gone' claim")
    return problems


def _check_job(fleet: Fleet, info: JobInfo, finishes: int, events: list[Event]) -> list[str]:
    job = info.job_id
    out: list[str] = []
    if info.state == "rejected":
        # The harness submits only well-formed jobs: `rejected` is for an
        # assignment's own defects, so a device's state must never end one.
        out.append(f"{job}: ended rejected ({info.reason!r}) though it was well-formed")
    if finishes > 1:
        out.append(f"{job}: {finishes} terminal states recorded")
    if info.started_at is not None and not info.terminal:
        out.append(f"{job}: started but never ended (state {info.state})")
    spawns = [(n, p) for n in fleet.nodes.values() for p in n.host.spawned(job)]
    scripts = {n.name: worker_scripts(n) for n in fleet.nodes.values()}
    spawns = [(n, p) for n, p in spawns if p.argv[0] not in scripts[n.name]]
    if len(spawns) > 1:
        out.append(f"{job}: spawned {len(spawns)} times ({[p.pid for _, p in spawns]})")
    if not spawns:
        return out
    node, proc = spawns[0]
    if info.started_at is None or info.started_at > proc.started_at:
        out.append(f"{job}: spawned on {node.name} before the controller saw it start")
    assert proc.stdout is not None
    committed, read = fleet.store.output(job), bytes(proc.stdout.read)
    disrupted = _disrupted(node, proc, info, events)
    # `lost` is also the truth for a finish the worker could hold in memory only and
    # lost at a stop (`_held_finish_lost_at_a_stop`): that case alone.
    held_lost = _held_finish_lost_at_a_stop(node, proc, info)
    # A job whose directory vanished lost its spool, and one whose host lost power
    # before its finish was in lost what the spool held past its last fsync (the spool
    # is never fsynced): what was not yet sent is gone, and what was sent must still be
    # what the job wrote, in order.
    end = info.finished_at if info.finished_at is not None else math.inf
    spool_lost = job in node.vanished or any(proc.started_at <= t <= end for t in node.power_losses)
    # The marker of a disk error is held in memory when the disk refuses the output
    # (spool.py): a worker killed after the disk filled, before it was sent, took it
    # with it, and its successor sends what the spool held, a prefix without it.
    spool_lost = spool_lost or any(
        proc.started_at <= full[0] <= end and any(full[0] <= t <= end for t in node.crashes)
        for full in node.full_disk
    )
    # A worker killed in the instant it took a chunk out of the pipe, before its read
    # returned, had that chunk in its memory only (a read(2), then the SIGKILL, before
    # the write(2) to the spool): that chunk, and nothing else, may be missing.
    unspooled = proc.stdout.lost_in_reader
    if (
        committed != read
        and not _cut_by_the_disk(committed, read)
        and not (spool_lost and read.startswith(committed))
        and not (unspooled and committed + unspooled == read)
    ):
        out.append(f"{job}: committed output is not what the worker read: {_diff(committed, read)}")
    written = bytes(proc.stdout.written)
    if not disrupted and read != written:
        out.append(f"{job}: the worker read other than the job wrote: {_diff(read, written)}")
    if info.state == "lost" and not disrupted and not held_lost:
        # `lost` is for a crashed worker or a lost host only (docs/protocol.md),
        # whether or not the job's process was signalled afterwards.
        out.append(
            f"{job}: ended lost on {node.name} though its worker never crashed "
            f"and the host was never lost ({info.reason!r})"
        )
    code = proc.returncode
    if (
        code is None
        or code < 0
        or proc.signalled
        or (info.state == "lost" and (disrupted or held_lost))
    ):
        return out
    want = "succeeded" if code == 0 else "failed"
    if (info.state, info.exit_code, info.killed) != (want, code, False):
        out.append(
            f"{job}: exited {code} on its own but was reported {info.state} "
            f"(exit {info.exit_code}, killed {info.killed}, {info.reason!r})"
        )
    return out


def _check_hooks(node: SimNode, events: list[Event]) -> list[str]:
    """A killed or failed hook is a failed hook, whatever its exit code.

    After a failed ``on_acquire`` the job must not run on that device; after a
    failed ``on_release`` the device must be quarantined (``hook_failed``).
    Hooks cut off by a crash of the worker prove nothing either way.
    """
    out: list[str] = []
    history = node.host.spawned()
    scripts = worker_scripts(node)
    for dev in node.config.devices:
        for path, hook in ((dev.on_acquire, "on_acquire"), (dev.on_release, "on_release")):
            if path is None:
                continue
            for h in history:
                if h.argv[0] != path or h.environ.get("RC_DEVICE") != dev.name:
                    continue
                if h.returncode == 0 and not h.signalled:
                    continue
                if h.ended_at is None or _crashed_during(node, h.started_at, h.ended_at):
                    continue
                if hook == "on_acquire":
                    # A later attempt of the job (requeued once the hook failed) may run
                    # on this device after an on_acquire of its own that succeeded.
                    acquired_again = [
                        a.started_at
                        for a in history
                        if a.argv[0] == path
                        and a.environ.get("RC_DEVICE") == dev.name
                        and a.job_id == h.job_id
                        and a.started_at > h.started_at
                        and a.returncode == 0
                        and not a.signalled
                    ]
                    ran = [
                        p
                        for p in history
                        if p.job_id == h.job_id
                        and p.environ.get("RC_DEVICE") == dev.name
                        and p.argv[0] not in scripts
                        and p.started_at >= h.started_at
                        and not any(h.started_at < t <= p.started_at for t in acquired_again)
                    ]
                    if ran:
                        out.append(
                            f"{node.name}/{dev.name}: job {h.job_id} ran after its "
                            f"on_acquire hook failed (exit {h.returncode}, signals "
                            f"{h.signals})"
                        )
                elif not any(
                    e.type == "device_quarantined"
                    and e.data.get("host") == node.name
                    and e.data.get("device") == dev.name
                    and e.data.get("kind") == "hook_failed"
                    and e.time >= h.started_at
                    for e in events
                ):
                    out.append(
                        f"{node.name}/{dev.name}: on_release hook failed (exit "
                        f"{h.returncode}, signals {h.signals}) but the device was not "
                        "quarantined"
                    )
    return out


def _crashed_during(node: SimNode, start: float, end: float) -> bool:
    return any(start <= t <= end for t in node.crashes)


def _held_finish_lost_at_a_stop(node: SimNode, proc: SimProcess, info: JobInfo) -> bool:
    """Whether the job's finish could only be held in memory when its worker stopped.

    The disk was full when the worker was stopped after the job ended, before the
    controller took the finish: a finish not on disk by then (the disk refused it
    when the job ended, or its directory vanished, journal and all) could not be
    written back for the next start, and a stop does not wait out the controller
    (issue 13), so the outcome went with that process and the controller ends the
    job ``lost``. A finish written before the disk filled is on disk and survives
    the stop; a vanished directory alone is written again.
    """
    if info.state != "lost" or proc.ended_at is None:
        return False
    end = info.finished_at if info.finished_at is not None else math.inf
    return any(
        proc.ended_at <= t <= end and any(a <= t <= b for a, b in node.full_disk)
        for t in node.stops
    )


def _disrupted(node: SimNode, proc: SimProcess, info: JobInfo, events: list[Event]) -> bool:
    """Whether the job's worker crashed, or its host was declared lost, while it ran."""
    end = info.finished_at if info.finished_at is not None else float("inf")
    if any(proc.started_at <= t <= end for t in node.crashes):
        return True
    return any(
        e.type == "host_lost" and e.data.get("host") == node.name and proc.started_at <= e.time
        for e in events
    )


class Watch:
    """The checks made as the run goes, in every worker's transport.

    ``violation(text)`` records what it finds (the fleet's log and list);
    ``smi_path()`` is where the hosts' ``nvidia-smi`` stands, or ``None``.
    """

    def __init__(
        self, violation: Callable[[str], None], smi_path: Callable[[], Path | None]
    ) -> None:
        self._violation = violation
        self._smi_path = smi_path
        # Finishes a worker process has sent and not yet had a final answer to,
        # by (host, device): such a device must not be listed ready.
        self._unacked: dict[tuple[str, str], set[str]] = collections.defaultdict(set)
        # Finishes the current worker process of a host has had a final answer
        # to, by (host, path, attempt): that process must not report them again.
        self._answered: dict[tuple[str, str, object], int] = {}
        # The facts each host last sent for each device (register or PUT labels).
        self._facts: dict[tuple[str, str], object] = {}

    def forget(self, host: str) -> None:
        """The worker of ``host`` died: what it was owed dies with it. Its successor
        resends from disk, and those sends are tracked afresh."""
        for key in [k for k in self._unacked if k[0] == host]:
            del self._unacked[key]
        self.new_process(host)

    def new_process(self, host: str) -> None:
        """A new worker process on ``host``: a finish whose answer its predecessor
        got, but which it did not live to forget, may be resent once (idempotent)."""
        for key in [k for k in self._answered if k[0] == host]:
            del self._answered[key]

    def on_request(self, node: SimNode, endpoint: str, request: httpx.Request) -> httpx.Request:
        if endpoint == "register":
            body = _json(request)
            if node.config.require_manual_clear:
                claims = [(r.get("job_id"), r.get("claim")) for r in body.get("recovery", [])]
                if ("gone" in (c for _, c in claims)) or not body.get("require_manual_clear"):
                    self._violation(
                        f"{node.name} has require_manual_clear but registered with "
                        f"require_manual_clear={body.get('require_manual_clear')}, claims {claims}"
                    )
            labels = body.get("labels")
            if isinstance(labels, Mapping):
                self._check_labels(node, labels)
            return _with_json(request, body)
        if endpoint == "labels":
            self._check_labels(node, _json(request))
        if endpoint == "poll":
            for device in _json(request).get("ready", []):
                alive = job_processes(node, str(device))
                if alive:
                    who = [(p.pid, p.job_id, p.state) for p in alive]
                    self._violation(f"{node.name} offered {device} as ready while {who} alive")
                owed = self._unacked.get((node.name, str(device)))
                if owed:
                    self._violation(
                        f"{node.name} offered {device} as ready while its finish "
                        f"{sorted(owed)} is unacknowledged"
                    )
        if endpoint == "finish":
            body = _json(request)
            verify = body.get("verify")
            if (
                isinstance(verify, Mapping)
                and verify.get("ok") is False
                and not body.get("fault_id")
            ):
                # The controller would quarantine on verify.ok = false by itself,
                # which hides a worker that forgot to: the worker must raise it.
                self._violation(
                    f"{node.name} reported a failed verify pass for {request.url.path} "
                    f"without quarantining {body.get('device')} itself"
                )
        return request

    def _check_labels(self, node: SimNode, payload: Mapping[str, Any]) -> None:
        """Invariant 4: facts a pass could not confirm are not sent (they stay as they were).

        The last ``nvidia-smi`` run on the host is the truth of the pass: if it
        failed (an error exit, killed at its timeout), no GPU device it speaks for
        may appear in the payload with facts other than those the host last sent
        for it, where even an empty map would wipe the device's facts at the
        controller. The same facts again change nothing: a register retried with
        the body built before the failed pass resends them.
        """
        devices = payload.get("devices")
        if not isinstance(devices, Mapping):
            return
        before = {d: self._facts.get((node.name, d)) for d in devices}
        for device, facts in devices.items():
            self._facts[(node.name, device)] = facts
        where = self._smi_path()
        if where is None:
            return
        smi = str(where)
        runs = [p for p in node.host.spawned() if p.argv[:1] == (smi,) and p.ended_at is not None]
        if not runs:
            return
        last = runs[-1]  # in spawn order: probe passes never overlap
        if last.returncode == 0 and not last.signalled:
            return
        scope = set(gpu_scope(node.config.device_names).values())
        sent = sorted(d for d in set(devices) & scope if devices[d] != before[d])
        if sent:
            self._violation(
                f"{node.name} sent facts for {sent} although nvidia-smi failed "
                f"(exit {last.returncode}, signals {last.signals}): unconfirmed facts "
                "must be left out so that they keep their previous values"
            )

    def on_send(self, node: SimNode, endpoint: str, request: httpx.Request) -> httpx.Request:
        if endpoint == "finish":
            body = _json(request)
            device = body.get("device")
            if isinstance(device, str):
                self._unacked[(node.name, device)].add(request.url.path)
            status = self._answered.get((node.name, request.url.path, body.get("attempt")))
            if status is not None:
                # The process had the controller's final answer: reporting the
                # job's end again is a second finish (exactly one terminal state).
                self._violation(
                    f"{node.name} reported the finish {request.url.path} (attempt "
                    f"{body.get('attempt')}) twice: it already had the final answer {status}"
                )
        return request

    def on_answer(
        self,
        node: SimNode,
        endpoint: str,
        request: httpx.Request,
        status: int,
        body: Mapping[str, Any],
    ) -> None:
        if endpoint != "finish" or not _final(status, body):
            return
        sent = _json(request)
        self._answered[(node.name, request.url.path, sent.get("attempt"))] = status
        device = sent.get("device")
        if isinstance(device, str):
            self._unacked[(node.name, device)].discard(request.url.path)


def _final(status: int, body: Mapping[str, Any]) -> bool:
    """Whether an answer ends a report's delivery: success, or a 4xx no retry can change."""
    if 200 <= status < 300:
        return True
    if status == 409 and body.get("error") == "unknown_session":
        return False
    return 400 <= status < 500 and status not in (408, 429)


_DISK_MARKER = DISK_ERROR_MARKER.split("{why}")[0].encode()


def _cut_by_the_disk(committed: bytes, read: bytes) -> bool:
    """Whether ``committed`` is what the worker read up to a disk error, then its marker.

    A full disk costs the job's output (issue 12): the spool keeps what it could
    write and ends it with the marker, which reaches the controller instead of the rest.
    """
    at = committed.find(_DISK_MARKER)
    return at >= 0 and read.startswith(committed[:at]) and committed.endswith(b")]\n")


def _diff(a: bytes, b: bytes) -> str:
    at = next(
        (i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b))
    )
    here, there = a[at : at + 16], b[at : at + 16]
    return f"{len(a)} vs {len(b)} bytes, first difference at {at}: {here!r} vs {there!r}"


def job_processes(node: SimNode, device: str) -> list[SimProcess]:
    """The live processes of any job started for ``device`` on this node.

    Hooks and verify scripts carry the job's ``RC_JOB_ID`` too, but are the
    worker's own; a process is told by the program it descends from (a fork
    keeps its parent's ``argv``).
    """
    live = [p for p in node.host.live(device=device) if "RC_JOB_ID" in p.environ]
    if not live:
        return live  # most of the time: no need to list the worker's own programs
    scripts = worker_scripts(node)
    return [p for p in live if p.argv[0] not in scripts]


def worker_scripts(node: SimNode) -> set[str]:
    """The programs the worker runs of its own: lease hooks and verify scripts."""
    paths = {h for d in node.config.devices for h in (d.on_acquire, d.on_release) if h}
    verify = Path(node.config.verify_dir)
    disk = node.host.disk  # where the worker lists them (fleet.verify_script installs there)
    if disk.is_dir(verify):
        paths.update(str(verify / name) for name in disk.listdir(verify))
    return paths


def _json(request: httpx.Request) -> dict[str, Any]:
    return dict(json_body(request.content))


def _with_json(request: httpx.Request, body: Mapping[str, Any]) -> httpx.Request:
    headers = [(k, v) for k, v in request.headers.raw if k.lower() != b"content-length"]
    return httpx.Request(
        request.method, request.url, headers=headers, json=body, extensions=request.extensions
    )
