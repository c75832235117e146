"""After a crash: prove, or refuse to claim, that an interrupted job left nothing behind.

At start, before registering, every job directory whose journal says the
job was spawned is a job the controller may still believe running: either
the previous worker process never saw it end, or it ended and its finish was
not yet acknowledged. For each one:

- a different boot id proves a reboot: nothing of it can be running;
- otherwise the RC_JOB_ID sweep looks for it, and removes what it finds.
  The claim is ``gone`` only when the scan was complete (not blind) and
  nothing remains, ``alive`` when something remains, ``unknown`` when it
  could not look;
- with ``require_manual_clear`` the claim is always ``unknown``: the setting
  only ever makes the worker more cautious.

Its spooled output is then shipped and the job finished as ``lost`` (or
with the finish already on disk, its real outcome); the claims go to the
controller at register, which decides the device's state.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import attrs

from rc_worker.cgroup import remove as remove_cgroup
from rc_worker.cgroup import sweep_cgroup
from rc_worker.core import protocol

# The decision is pure (claim_decision.py), shared with the lease; re-exported here.
from rc_worker.core.claim_decision import decide_claim as decide_claim
from rc_worker.core.model import Claim
from rc_worker.core.pid_window import PidMark
from rc_worker.core.reports import lost_report, sweep_json
from rc_worker.durable import Committer
from rc_worker.host import Host
from rc_worker.spool import JobDir, job_dirs, move_aside, read_json
from rc_worker.sweep import NOT_SWEPT, SweepReport, sweep_job_survivors

log = logging.getLogger("rc_worker.recovery")

RECOVERY_GRACE = 5.0
RECOVERY_FILE = "recovery.json"


@attrs.frozen
class Recovered:
    device: str
    job_id: str
    attempt: int
    boot_id: str
    claim: Claim
    sweep: SweepReport
    reboot: bool

    def register_message(self) -> protocol.Recovery:
        """This claim as a ``recovery`` entry of ``register``."""
        return protocol.Recovery(
            self.device,
            self.job_id,
            self.attempt,
            self.boot_id,
            str(self.claim),
            sweep_json(self.sweep),
        )

    def register_entry(self) -> dict[str, Any]:
        return protocol.unstructure(self.register_message())


@attrs.frozen
class Damaged:
    """A state file recovery could not use or write: its device (None: unknown, so every
    device) is quarantined with a ``damaged_state`` fault, and any finish it could not write
    is held in memory (``report``) for the outbox to deliver."""

    device: str | None
    why: str
    job_dir: JobDir | None = None
    job_id: str | None = None
    attempt: int | None = None
    report: dict[str, Any] | None = None


async def recover(
    root: Path,
    *,
    boot_id: str,
    require_manual_clear: bool,
    host: Host | None = None,
    damaged: list[Damaged] | None = None,
    committer: Committer | None = None,
) -> list[Recovered]:
    """Claim, for every journal entry of a spawned job, what is left of it.

    Covers jobs whose ``finish`` is already on disk but was never
    acknowledged, too: the controller still believes them running, and a
    register that left them out would have it finish them ``lost`` and
    quarantine their device, although their real finish is about to arrive.

    Never crashes on what it finds: a damaged job directory (an unreadable or
    incomplete journal, a bad claim, a garbage finish) is moved aside to
    ``state_dir/damaged/`` and listed in ``damaged``, as is a finish the disk
    would not take (full, failing); the caller quarantines their devices.
    """
    durable = committer if committer is not None else Committer()
    found: list[Recovered] = []
    problems: list[Damaged] = [] if damaged is None else damaged
    store = durable.store
    for job_dir in job_dirs(root, store):
        problem = _damage(job_dir)
        if problem is not None:
            why, device = problem
            move_aside(root, job_dir.path, why, store)
            problems.append(Damaged(device, f"job directory {job_dir.key}: {why}"))
            continue
        try:
            entry = await _recover_one(
                durable,
                job_dir,
                boot_id=boot_id,
                require_manual_clear=require_manual_clear,
                host=host,
            )
        except _Unwritten as u:
            log.error("job directory %s: cannot write recovery state: %s", job_dir.key, u.error)
            found.append(u.entry)
            problems.append(
                Damaged(
                    u.entry.device,
                    f"job directory {job_dir.key}: cannot write recovery state ({u.error})",
                    job_dir=job_dir if u.report is not None else None,
                    job_id=u.entry.job_id,
                    attempt=u.entry.attempt,
                    report=u.report,
                )
            )
            continue
        if entry is not None:
            found.append(entry)
    return found


class _Unwritten(Exception):
    """The disk would not take a recovery write; what it would have held is here."""

    def __init__(self, entry: Recovered, report: dict[str, Any] | None, error: OSError) -> None:
        super().__init__(str(error))
        self.entry, self.report, self.error = entry, report, error


def _damage(job_dir: JobDir) -> tuple[str, str | None] | None:
    """Why a job directory cannot be recovered as it is (and its device, if known)."""
    store = job_dir.store
    journal_text_ok = True
    journal: object = None
    if store.exists(job_dir.journal):
        journal = read_json(job_dir.journal, store)
        journal_text_ok = journal is not None
    device = journal.get("device") if isinstance(journal, dict) else None
    device = device if isinstance(device, str) and device else None
    if not journal_text_ok:
        return "journal.json is not a JSON object", None
    if isinstance(journal, dict) and journal.get("spawned"):
        job_id, attempt = journal.get("job_id"), journal.get("attempt")
        if not isinstance(job_id, str) or not job_id:
            return "journal.json has no job_id", device
        if not isinstance(attempt, int) or isinstance(attempt, bool):
            return "journal.json has no integer attempt", device
        if device is None:
            return "journal.json has no device", None
    if job_dir.has_finish() and read_json(job_dir.finish, store) is None:
        return "finish.json is not a JSON object", device
    claim_path = job_dir.path / RECOVERY_FILE
    if store.exists(claim_path):
        claimed = read_json(claim_path, store)
        try:
            if claimed is None:
                raise ValueError("not a JSON object")
            _from_json(claimed)
        except (KeyError, ValueError, TypeError, AttributeError) as e:
            return f"{RECOVERY_FILE} is unusable ({type(e).__name__}: {e})", device
    return None


async def _recover_one(
    durable: Committer,
    job_dir: JobDir,
    *,
    boot_id: str,
    require_manual_clear: bool,
    host: Host | None,
) -> Recovered | None:
    claimed = read_json(job_dir.path / RECOVERY_FILE, job_dir.store)
    if claimed is not None:
        # Recovered by an earlier start that stopped before its finish
        # was acknowledged: the claim stands, and is sent again.
        entry = _from_json(claimed)
        if require_manual_clear and entry.claim is not Claim.UNKNOWN:
            # Switched on since that start: it still only tightens.
            entry = attrs.evolve(entry, claim=Claim.UNKNOWN)
        if not job_dir.has_finish():
            await _write_lost(durable, job_dir, entry)
        return entry
    journal = read_json(job_dir.journal, job_dir.store)
    finished = job_dir.has_finish()
    if journal is None or not journal.get("spawned"):
        if not finished and not job_dir.store.exists(job_dir.journal):
            # Nothing was spawned (the crash came between creating the
            # directory and the journal): there is nothing to recover.
            job_dir.remove()
        # Else the report of an attempt that never ran: the outbox sends it.
        return None
    job_id, attempt = str(journal["job_id"]), int(journal["attempt"])
    device, then = str(journal["device"]), str(journal.get("boot_id", ""))
    reboot = then != boot_id
    if reboot:
        sweep = NOT_SWEPT
    else:
        sweep = await _sweep(journal, job_id, host)
    claim = decide_claim(sweep, reboot=reboot, require_manual_clear=require_manual_clear)
    log.warning(
        "job %s attempt %d on %s %s: %s, claim %s%s",
        job_id,
        attempt,
        device,
        "ended, but its finish was not yet acknowledged when the worker stopped"
        if finished
        else "was interrupted by the worker's stop",
        "reboot proven"
        if reboot
        else f"swept (found {list(sweep.found)}, "
        f"remaining {list(sweep.remaining)}, blind {sweep.blind})",
        claim,
        " (require_manual_clear)" if require_manual_clear else "",
    )
    entry = Recovered(device, job_id, attempt, then, claim, sweep, reboot)
    # The finish first: a crash between the two writes then leaves a job
    # that is simply recovered again, never a claim without a report.
    if not finished:
        await _write_lost(durable, job_dir, entry)
    try:
        await durable.write(
            job_dir.path / RECOVERY_FILE, {**entry.register_entry(), "reboot": reboot}
        )
    except OSError as e:
        # The finish is on disk: only the claim is not, and it is sent from memory now.
        raise _Unwritten(entry, None, e) from None
    return entry


async def _sweep(journal: dict[str, Any], job_id: str, host: Host | None) -> SweepReport:
    """End what is left of an interrupted job: through its cgroup when it had one.

    The cgroup is proof either way, for a worker that is not root too: still
    populated after the kill is alive (``remaining``); empty, or removed
    (the worker removes only empty ones), is gone. Where the hierarchy cannot
    be read at all, the RC_JOB_ID sweep decides instead.
    """
    cgroup = journal.get("cgroup")
    if isinstance(cgroup, str) and cgroup.startswith("/") and host is not None:
        try:
            report = await sweep_cgroup(host, cgroup, grace=RECOVERY_GRACE)
        except ValueError:  # not a cgroup path (a damaged journal): no proof from it
            report = NOT_SWEPT
        if report.scanned:
            if report.clean:
                remove_cgroup(host, cgroup)
            return report
    since = journal.get("since_ticks")
    return await sweep_job_survivors(
        job_id,
        grace=RECOVERY_GRACE,
        host=host,
        since=since if isinstance(since, int) and not isinstance(since, bool) else None,
        mark=PidMark.from_json(journal.get("pid_mark")),
    )


async def _write_lost(durable: Committer, job_dir: JobDir, entry: Recovered) -> None:
    report = lost_report(
        entry.job_id,
        entry.attempt,
        entry.device,
        sweep=entry.sweep,
        output_bytes=job_dir.output_size(),
    )
    try:
        await durable.write(job_dir.finish, report)
    except OSError as e:
        # The caller holds it in memory and quarantines the device.
        raise _Unwritten(entry, report, e) from None


def _from_json(data: dict[str, Any]) -> Recovered:
    sweep = data.get("sweep") or {}
    return Recovered(
        device=str(data["device"]),
        job_id=str(data["job_id"]),
        attempt=int(data["attempt"]),
        boot_id=str(data["boot_id"]),
        claim=Claim(data["claim"]),
        sweep=SweepReport(
            scanned=bool(sweep.get("scanned")),
            found=tuple(sweep.get("found", ())),
            remaining=tuple(sweep.get("remaining", ())),
            blind=bool(sweep.get("blind")),
            blind_pids=tuple(sweep.get("blind_pids", ())),
            method=str(sweep.get("method", "environ")),
        ),
        reboot=bool(data.get("reboot")),
    )
