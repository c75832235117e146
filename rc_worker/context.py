"""What every DeviceSupervisor shares with the worker: config, seams, delivery, environment."""

from __future__ import annotations

import logging
import os
import random
import time
from collections.abc import Awaitable, Callable, Mapping
from pathlib import Path
from typing import Any

import attrs
import trio

from rc_worker.cgroup import limits_for
from rc_worker.client import ControllerClient
from rc_worker.core.config import Config, DeviceConfig, child_environ
from rc_worker.core.config_convert import cpu_count
from rc_worker.core.errors import JobUserError
from rc_worker.core.model import Assignment, job_key
from rc_worker.host import Host, RunAs, resolve_user
from rc_worker.metrics import WorkerMetrics
from rc_worker.outbox import Outbox
from rc_worker.spool import JobDir

log = logging.getLogger("rc_worker.context")


@attrs.define(eq=False)
class WorkerContext:
    config: Config
    host: Host
    client: ControllerClient
    outbox: Outbox
    root: Path
    boot_id: str
    environ: Mapping[str, str]
    poke_poller: Callable[[], None]
    metrics: WorkerMetrics = attrs.field(factory=WorkerMetrics)
    draining: bool = False
    stopping: bool = False
    device_labels: dict[str, Mapping[str, str]] = attrs.field(factory=dict)
    # The GPU health gate (gpu_health_coord.py): (device, job_id or None,
    # grace) -> why the device cannot take work, or None. None: no checks.
    health_gate: Callable[[str, str | None, float], Awaitable[str | None]] | None = None
    rng: random.Random = attrs.field(factory=random.Random)
    """Ids (faults) and jitter come from here: a simulation seeds it to replay exactly."""

    async def run_as(self, device: DeviceConfig) -> RunAs | None:
        """Who the device's jobs, hooks and verify scripts run as: its ``job_user`` when the
        worker is root (only root can switch), else the worker's own user.

        Looked up afresh (group changes take effect at the next job, as at a login) in a
        thread: the name service may be LDAP or sssd, and a slow one must not stall the
        event loop, so every device's heartbeats, kills and output. A user it cannot find
        (deleted since the config was read, the directory unreachable) is
        :class:`JobUserError`, with the reason in one line.
        """
        name = device.job_user
        if name is None or os.geteuid() != 0:
            return None
        try:
            return await trio.to_thread.run_sync(resolve_user, name)
        except (KeyError, OSError) as e:
            why = e.args[0] if isinstance(e, KeyError) and e.args else e
            raise JobUserError(
                f"job_user {name!r} cannot be resolved ({why}); check `getent passwd {name}`"
                " on this host, then clear the fault"
            ) from None

    def job_key(self, a: Assignment) -> str:
        return job_key(a.job_id, a.attempt)

    async def journal(self, job_dir: JobDir, a: Assignment) -> str | None:
        """Record, durably, that this job is about to be spawned here; its cgroup.

        Written and fsynced before the process exists, so a worker that dies
        at any later moment finds the entry at its next start and can prove,
        or refuse to claim, that the job left nothing behind. Returns the
        cgroup the job is to run in (journalled: recovery reads it), or
        ``None`` without cgroups.
        """
        containment = self.host.containment
        cgroup = None if containment is None else containment.leaf(job_key(a.job_id, a.attempt))
        mark = self.host.pid_mark() if cgroup is None else None
        record: dict[str, Any] = {
            "job_id": a.job_id,
            "attempt": a.attempt,
            "device": a.device,
            "boot_id": self.boot_id,
            # A reported timestamp, never used for a timeout.
            "started_at": time.time(),
            # A lower bound of the job's start time in the process
            # table's clock: recovery's sweep skips older processes.
            "since_ticks": self.host.boot_ticks(),
            # Where pid allocation stood: it reads only newer pids' rows.
            "pid_mark": None if mark is None else mark.to_json(),
            "spawned": True,
            "cgroup": cgroup,
        }
        await self.outbox.committer.write(job_dir.journal, record, before=job_dir.create)
        job_dir.written_journal = record
        return cgroup

    def cgroup_limits(self, device: DeviceConfig) -> dict[str, str]:
        """The files a job's cgroup on ``device`` gets written: its limits."""
        containment = self.host.containment
        if containment is None:
            return {}
        cpus = None if device.cpu_max is None else cpu_count(device.cpu_max)
        return limits_for(device.memory_max, cpus, containment.controllers)

    async def report(
        self, ident: Assignment | tuple[str, int, str], report: Mapping[str, Any]
    ) -> None:
        """Durably record and deliver the finish of an attempt that never ran."""
        job_id, attempt, device = (
            (ident.job_id, ident.attempt, ident.device) if isinstance(ident, Assignment) else ident
        )
        job_dir = JobDir(self.root, job_key(job_id, attempt), self.host.store)
        try:
            await self.outbox.report(
                job_dir,
                job_id,
                attempt,
                report,
                {"job_id": job_id, "attempt": attempt, "device": device, "spawned": False},
            )
        except OSError as e:
            # A full or failing disk costs this report its file, never its delivery.
            log.error("job %s: cannot write its report (%s); sending it from memory", job_id, e)
            # Never ran, so the controller holds none of its output: no need to ask.
            self.outbox.hold_report(job_dir, job_id, attempt, report, device, fresh=True)
        self.metrics.jobs_finished.labels(str(report["outcome"])).inc()

    def child_env(self, device: str, job_id: str | None) -> dict[str, str]:
        """The environment of a hook or verify script for ``device``."""
        env = child_environ(self.environ)
        env.update(RC_HOST=self.config.host, RC_DEVICE=device)
        if job_id is not None:
            env["RC_JOB_ID"] = job_id
        cuda = self.cuda_visible_devices(device)
        if cuda is not None:
            env["CUDA_VISIBLE_DEVICES"] = cuda
        return env

    def job_env(self, device: str, a: Assignment) -> dict[str, str]:
        """The environment of a job: the worker's (less its own settings), the
        assignment's, then the RC_* variables, which the assignment cannot
        override."""
        env = child_environ(self.environ)
        env.update(a.env)
        env.update(RC_JOB_ID=a.job_id, RC_DEVICE=device, RC_HOST=self.config.host)
        cuda = self.cuda_visible_devices(device)
        if cuda is not None:
            env["CUDA_VISIBLE_DEVICES"] = cuda
        return env

    def cuda_visible_devices(self, device: str) -> str | None:
        """The MIG UUID of a slice, else the GPU UUID from the device's probe
        labels, else N for ``gpu<N>``."""
        mig = self.device_labels.get(device, {}).get("mig_uuid")
        if mig:
            return mig
        slice_config = next((d for d in self.config.devices if d.name == device), None)
        if slice_config is not None and slice_config.mig_of is not None:
            # A MIG slice whose UUID is not known yet: no GPU at all rather
            # than every GPU (an unset variable would show them all).
            return slice_config.mig_uuid or ""
        uuid = self.device_labels.get(device, {}).get("uuid")
        if uuid:
            return uuid
        if device.startswith("gpu") and device[3:].isdigit():
            return str(int(device[3:]))
        return None


def warn_token_file_mode(path: str | None) -> str | None:
    """A warning when the token file is readable by group or others."""
    if path is None:
        return None
    try:
        mode = os.stat(path).st_mode
    except OSError:
        return None
    if mode & 0o077:
        return (
            f"token file {path} is readable by group or others (mode {mode & 0o777:o}); "
            f"run: chmod 600 {path}"
        )
    return None
