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
from rc_worker.durable import Committer
from rc_worker.host import Host
from rc_worker.model import Claim
from rc_worker.reports import lost_report, sweep_json
from rc_worker.spool import JobDir, job_dirs, read_json
from rc_worker.sweep import NOT_SWEPT, SweepReport, sweep_job_survivors, unproven

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

    def register_entry(self) -> dict[str, Any]:
        return {
            "device": self.device,
            "job_id": self.job_id,
            "attempt": self.attempt,
            "boot_id": self.boot_id,
            "claim": str(self.claim),
            "sweep": sweep_json(self.sweep),
        }


def decide_claim(sweep: SweepReport, *, reboot: bool, require_manual_clear: bool) -> Claim:
    """The claim for one interrupted job (sans-IO)."""
    if require_manual_clear:
        return Claim.UNKNOWN
    # The rule a job's end decides by too (sweep.unproven): gone only when proven.
    if reboot or unproven(sweep) is None:
        return Claim.GONE
    if sweep.remaining:
        return Claim.ALIVE
    return Claim.UNKNOWN


async def recover(
    root: Path,
    *,
    boot_id: str,
    require_manual_clear: bool,
    host: Host | None = None,
    committer: Committer | None = None,
) -> list[Recovered]:
    """Claim, for every journal entry of a spawned job, what is left of it.

    Covers jobs whose ``finish`` is already on disk but was never
    acknowledged, too: the controller still believes them running, and a
    register that left them out would have it finish them ``lost`` and
    quarantine their device, although their real finish is about to arrive.
    """
    durable = committer if committer is not None else Committer()
    found: list[Recovered] = []
    for job_dir in job_dirs(root):
        claimed = read_json(job_dir.path / RECOVERY_FILE)
        if claimed is not None:
            # Recovered by an earlier start that stopped before its finish
            # was acknowledged: the claim stands, and is sent again.
            entry = _from_json(claimed)
            if require_manual_clear and entry.claim is not Claim.UNKNOWN:
                # Switched on since that start: it still only tightens.
                entry = attrs.evolve(entry, claim=Claim.UNKNOWN)
            if not job_dir.finish.exists():
                await _write_lost(durable, job_dir, entry)
            found.append(entry)
            continue
        journal = read_json(job_dir.journal)
        finished = job_dir.finish.exists()
        if journal is None or not journal.get("spawned"):
            if not finished:
                # Nothing was spawned (the crash came between creating the
                # directory and the journal): there is nothing to recover.
                job_dir.remove()
            # Else the report of an attempt that never ran: the outbox sends it.
            continue
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
        await durable.write(
            job_dir.path / RECOVERY_FILE, {**entry.register_entry(), "reboot": reboot}
        )
        found.append(entry)
    return found


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
    )


async def _write_lost(durable: Committer, job_dir: JobDir, entry: Recovered) -> None:
    await durable.write(
        job_dir.finish,
        lost_report(
            entry.job_id,
            entry.attempt,
            entry.device,
            sweep=entry.sweep,
            output_bytes=job_dir.output_size(),
        ),
    )


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
