"""The Trio shell of the GPU health checks: run the tools, read the kernel log.

Decisions are in ``gpu_health.py``; this module runs nvidia-smi and lspci
exactly as a probe runs (``scripts.run_script`` through the ``Host`` seam: its
own process group, killed at ``gpu_health.check_timeout``), reads the new
lines of the kernel log, and turns each outcome into a ``DeviceVerdict``:
faults to raise, and per check whether it could be read.

Fail closed: a tool that errors, hangs past its timeout or prints what does
not parse is a check that could not run. The verdict then names the check
and why, and the device is held for health (not offered, not quarantined)
until the same check next succeeds. It is never read as healthy.
"""

from __future__ import annotations

import errno
import logging
import os
from collections.abc import Awaitable, Callable, Collection, Iterable, Mapping, Sequence
from pathlib import Path
from typing import TypeVar

import attrs
import trio

from rc_worker.core.config import Config, DeviceConfig, child_environ
from rc_worker.core.gpu_health import (
    CHECK_MEMORY,
    CHECK_MIG,
    CHECK_PCI,
    CHECK_PRESENCE,
    CHECK_RESIDENT,
    CHECK_XID,
    COMPUTE_APPS_ARGS,
    HEALTH_QUERY_ARGS,
    LIST_ARGS,
    LSPCI_ARGS,
    ComputeApp,
    Fault,
    HealthReadError,
    HealthReading,
    ListedGpu,
    MemoryState,
    XidEvent,
    apps_on,
    bus_key,
    count_lspci_gpus,
    decide_memory,
    decide_pci,
    decide_presence,
    decide_xid,
    listed_count,
    mentions_lost_gpu,
    parse_compute_apps,
    parse_gpu_list,
    parse_health_query,
    parse_xid,
    resolve_mig_uuid,
)
from rc_worker.core.gpu_query import NVIDIA_SMI, gpu_scope, mig_parent_name
from rc_worker.core.mig_share import ProcessFacts, Residents, RunningJob, known_jobs, residents
from rc_worker.host import Host
from rc_worker.metrics import WorkerMetrics
from rc_worker.probe import EXIT_LABEL, NVIDIA_SMI_OUTPUT_CAP, PROBE_GRACE
from rc_worker.scripts import Budget, describe, run_script
from rc_worker.sweep import JOB_ID_VAR

DEVICE_VAR = "RC_DEVICE"  # set for every job, hook and verify script (context.child_env)

T = TypeVar("T")

log = logging.getLogger("rc_worker.gpu_health")

LSPCI = "lspci"
SEEN_MARKER = "nvidia-smi-seen"
"""In the state directory: nvidia-smi was found on this host once (``enabled: auto``)."""

KMSG_READ_CAP = 1024 * 1024
"""Kernel log bytes read per pass at most: a flood is read over several passes."""

XID_WAITING_CAP = 256
"""Xids kept at most while a GPU's bus id is not known (each line is read once)."""


@attrs.frozen
class GpuTarget:
    """What a device's checks look at: the physical GPU's index, and which UUIDs are its."""

    device: str
    index: int
    parent: str
    """The physical GPU's device name (itself, for a whole GPU)."""
    mig_uuid: str | None = None


@attrs.define
class DeviceVerdict:
    """One device's checks: faults to raise, and checks that could not run (check -> why).

    ``passed`` lists the checks that ran and read, so their holds lift.
    ``gpu_faults`` are the physical GPU's (its memory, its presence, an Xid on
    its PCI bus), read through this device: they are raised on the GPU's device
    and every slice of it in the same check, not on this device alone
    (``core/mig_share.py``).
    """

    faults: list[Fault] = attrs.Factory(list)
    gpu_faults: list[Fault] = attrs.Factory(list)
    held: dict[str, str] = attrs.Factory(dict)
    passed: set[str] = attrs.Factory(set)


class CheckFailed(Exception):
    """A tool that could not be run or read; the message is the reason shown."""


class GpuHealthMonitor:
    """The built-in GPU checks of one worker process.

    ``expected_uuid`` gives a device's UUID as the probe last saw it (the
    ``uuid`` label), so a card swapped under the worker is noticed.
    """

    def __init__(
        self,
        config: Config,
        *,
        host: Host,
        environ: Mapping[str, str],
        metrics: WorkerMetrics,
        state_dir: Path | None = None,
    ) -> None:
        self._config = config
        self._settings = config.gpu_health
        self._host = host
        self._environ = environ
        self.metrics = metrics
        self._state_dir = state_dir
        self._memory: dict[int, MemoryState] = {}
        self._kmsg_fd: int | None = None
        self._kmsg_offset = 0
        self._kmsg_disabled = False
        self._lock = trio.Lock()
        self.targets = _targets(config)
        self.mig_uuids: dict[str, str] = {
            d.name: d.mig_uuid for d in config.devices if d.mig_uuid is not None
        }
        self.ecc_labels: dict[int, dict[str, str]] = {}
        self._listed: dict[int, tuple[str, str | None]] = {}
        """Each GPU's UUID and PCI bus id as the health query last listed them, by index:
        what the resident and Xid checks go by when the probe has not said (no ``uuid``
        or ``pci_bus_id`` label yet). Without them a GPU's processes would be ignored and
        its kernel errors dropped: the checks would pass without having looked."""
        self._seen = False
        """nvidia-smi was seen here and that is recorded: the checks stay on."""
        self._xid_waiting: list[tuple[XidEvent, Fault]] = []
        """Xids read while some GPU's bus id was not known, none of the known ones
        theirs: matched once every bus id is (``_check_xids``)."""

    # -- whether to run at all ---------------------------------------------

    def _smi(self) -> str | None:
        return self._host.store.which(NVIDIA_SMI, self._environ.get("PATH", os.defpath))

    def enabled(self) -> bool:
        """``true``: always; ``false``: never; ``auto``: once nvidia-smi was seen here.

        Seen is remembered in the state directory: a host whose nvidia-smi
        vanishes after that keeps its checks, and they fail closed. Once seen and
        recorded, this process asks no more (it is asked before and after every
        job, and the PATH walk and the marker's stat are I/O on the event loop).
        """
        mode = self._settings.enabled
        if mode != "auto":
            return mode == "true"
        if not self.targets:
            return False
        if self._seen:
            return True
        marker = None if self._state_dir is None else self._state_dir / SEEN_MARKER
        if self._smi() is not None:
            self._seen = True
            if marker is not None and not self._host.store.exists(marker):
                try:
                    self._host.store.touch(marker)
                except OSError as e:
                    self._seen = False  # not recorded: try again next time
                    log.warning("cannot record that nvidia-smi was seen (%s): %s", marker, e)
            return True
        self._seen = marker is not None and self._host.store.exists(marker)
        return self._seen

    # -- running tools -------------------------------------------------------

    async def _run(self, tool: str, args: Sequence[str]) -> str:
        """Run ``tool args`` like a probe; its output, or ``CheckFailed`` with why."""
        path = self._host.store.which(tool, self._environ.get("PATH", os.defpath))
        if path is None:
            raise CheckFailed(f"{tool} not found on PATH")
        limit = Budget(self._settings.check_timeout or self._config.probe_timeout).next()
        assert limit is not None  # a budget of None is never spent
        run = await run_script(
            (path, *args),
            env=child_environ(self._environ),
            limit=limit,
            grace=PROBE_GRACE,
            host=self._host,
            output_cap=NVIDIA_SMI_OUTPUT_CAP,
            merge_stderr=True,
        )
        text = run.output.decode("utf-8", "replace")
        # nvidia-smi exits non-zero when a GPU is lost but still lists the
        # others: that is an answer (``gpu_missing``), not a failure to answer.
        why = describe(run, tool, exit_label=EXIT_LABEL, exit_ok=mentions_lost_gpu(text))
        if why:
            raise CheckFailed(why)
        return text

    def _count(self, check: str, result: str) -> None:
        self.metrics.gpu_health_checks.labels(check, result).inc()

    # -- the checks ------------------------------------------------------------

    async def check(
        self,
        devices: Collection[str],
        *,
        expected_uuid: Mapping[str, str],
        bus_ids: Mapping[str, str],
        memory: bool = True,
        resident: bool = True,
        xids: bool = True,
        pci: bool = False,
        jobs: Callable[[], Mapping[str, RunningJob]] | None = None,
    ) -> dict[str, DeviceVerdict]:
        """Run the checks for ``devices`` (GPU devices only; others are left out).

        One nvidia-smi health query and one compute-apps query serve every
        device asked for. ``bus_ids`` is each device's ``pci_bus_id`` label,
        which maps kernel Xid lines to devices. ``jobs`` gives the jobs running
        now, by device: a sibling slice's job's processes are not resident here.
        """
        async with self._lock:
            targets = [self.targets[d] for d in devices if d in self.targets]
            verdicts = {t.device: DeviceVerdict() for t in targets}
            if not targets:
                return verdicts
            await self._resolve_slices(targets, verdicts)
            if memory:
                await self._check_health(targets, verdicts, expected_uuid)
            if resident:
                await self._check_resident(targets, verdicts, expected_uuid, jobs or dict)
            if xids:
                self._check_xids(targets, verdicts, bus_ids)
            if pci:
                await self._check_pci(targets, verdicts)
            return verdicts

    async def _check_health(
        self,
        targets: Sequence[GpuTarget],
        verdicts: dict[str, DeviceVerdict],
        expected_uuid: Mapping[str, str],
    ) -> None:
        async def read() -> HealthReading:
            return parse_health_query(await self._run(NVIDIA_SMI, HEALTH_QUERY_ARGS))

        reading = await self._query(CHECK_MEMORY, targets, verdicts, read)
        if reading is None:
            return
        totals = {"corrected_volatile": 0, "uncorrected_volatile": 0}
        for row in reading.rows.values():
            self._listed[row.index] = (row.uuid, row.bus_id)
            totals["corrected_volatile"] += row.ecc_corrected or 0
            totals["uncorrected_volatile"] += row.ecc_uncorrected or 0
        for kind, value in totals.items():
            # Summed over the host's GPUs: the metric is labelled by kind only.
            self.metrics.gpu_ecc_errors.labels(kind).set(value)
        for t in targets:
            v = verdicts[t.device]
            missing = decide_presence(t.index, expected_uuid.get(t.parent), reading)
            v.passed.update({CHECK_MEMORY, CHECK_PRESENCE})
            if missing is not None:
                # Gone, lost or swapped is the card, whichever slice's check read it.
                v.gpu_faults.append(missing)
                continue
            row = reading.rows[t.index]
            faults, self._memory[t.index] = decide_memory(self._memory.get(t.index), row)
            # The counters are the card's: growth read through one slice was also
            # consumed for its siblings (the baseline is per GPU), so it must reach them.
            v.gpu_faults.extend(faults)
            self.ecc_labels[t.index] = {
                "ecc_uncorrected_volatile": _label(row.ecc_uncorrected),
                "ecc_corrected_volatile": _label(row.ecc_corrected),
                "remapped_rows_pending": _label(row.remap_pending),
            }

    async def _resolve_slices(
        self, targets: Sequence[GpuTarget], verdicts: dict[str, DeviceVerdict]
    ) -> None:
        """Give each ``mig_index`` slice its MIG UUID from ``nvidia-smi -L``.

        A slice whose UUID is not known is held: without it the job's
        CUDA_VISIBLE_DEVICES could not name the slice, and it would see the GPU.
        """
        slices = [t for t in targets if t.device != t.parent]
        why = ""
        if any(t.mig_uuid is None for t in slices):
            try:
                listing: list[ListedGpu] = parse_gpu_list(await self._run(NVIDIA_SMI, LIST_ARGS))
            except (CheckFailed, HealthReadError) as e:
                why = f"cannot resolve the MIG slice: {e}"
                listing = []
            for dev in self._config.devices:
                if dev.mig_index is not None and dev.name in self.targets:
                    t = self.targets[dev.name]
                    uuid = resolve_mig_uuid(listing, t.index, dev.mig_index)
                    if uuid is not None:
                        self.mig_uuids[dev.name] = uuid
                        self.targets[dev.name] = attrs.evolve(t, mig_uuid=uuid)
        for t in slices:
            if self.targets[t.device].mig_uuid is not None:
                verdicts[t.device].passed.add(CHECK_MIG)
                continue
            index = self._config.device(t.device).mig_index
            verdicts[t.device].held[CHECK_MIG] = why or (
                f"nvidia-smi -L lists no MIG device {index} on GPU {t.index}"
            )

    async def _check_resident(
        self,
        targets: Sequence[GpuTarget],
        verdicts: dict[str, DeviceVerdict],
        expected_uuid: Mapping[str, str],
        jobs: Callable[[], Mapping[str, RunningJob]],
    ) -> None:
        before = list(jobs().values())
        apps = await self._query(CHECK_RESIDENT, targets, verdicts, self.list_apps)
        if apps is None:
            return
        seen = known_jobs(before, jobs().values())
        for t in targets:
            unknown = self.uuid_unknown(t.device, expected_uuid)
            if unknown is not None:
                # Which processes are this GPU's is not known: not "none are".
                verdicts[t.device].held[CHECK_RESIDENT] = unknown
                continue
            mine = self.resident_on(t.device, apps, expected_uuid)
            fault = self.residents(t.device, mine, expected_uuid, seen).fault()
            verdicts[t.device].passed.add(CHECK_RESIDENT)
            if fault is not None:
                verdicts[t.device].faults.append(fault)

    def resident_on(
        self, device: str, apps: Sequence[ComputeApp], expected_uuid: Mapping[str, str]
    ) -> list[ComputeApp]:
        """The apps on ``device``'s GPU: its UUID, or for a slice its MIG UUID.

        nvidia-smi lists a slice's processes under the PARENT's UUID on some
        drivers (fixture 09b), so a slice also counts processes listed under
        its parent: more cautious, never less. Those that a sibling slice's
        running job owns are let go by ``residents``, which tells them.
        """
        t = self.targets[device]
        uuids = {u for u in (self._gpu_uuid(t, expected_uuid), t.mig_uuid) if u}
        return apps_on(apps, uuids)

    def residents(
        self,
        device: str,
        apps: Sequence[ComputeApp],
        expected_uuid: Mapping[str, str],
        jobs: Iterable[RunningJob],
    ) -> Residents:
        """Which of ``device``'s apps (``resident_on``) dirty it: not those of a job
        running on another device of the same physical GPU (``core/mig_share.py``)."""
        t = self.targets[device]
        siblings = [
            job
            for job in jobs
            if job.device != device
            and job.device in self.targets
            and self.targets[job.device].index == t.index
        ]
        return residents(
            apps,
            shared_uuid=self._gpu_uuid(t, expected_uuid),
            jobs=siblings,
            facts=self._process_facts,
        )

    def _process_facts(self, pid: int) -> ProcessFacts:
        """What tells whose ``pid`` is: its process group, session and ``RC_JOB_ID``.
        Unreadable (gone, hidden, another pid namespace, not root) reads as unknown."""
        info = self._host.process(pid)
        try:
            env = self._host.environ(pid)
        except OSError:
            env = {}
        return ProcessFacts(
            pgid=None if info is None else info.pgid,
            sid=None if info is None else info.sid,
            job_id=env.get(JOB_ID_VAR),
            environ_read=bool(env),
            device=env.get(DEVICE_VAR),
        )

    def uuid_unknown(self, device: str, expected_uuid: Mapping[str, str]) -> str | None:
        """Why ``device``'s processes cannot be told yet (its GPU's UUID is not known), or
        None: then "no process listed under it" means none, not "none looked at"."""
        t = self.targets[device]
        if self._gpu_uuid(t, expected_uuid) is not None:
            return None
        return f"the UUID of GPU {t.index} is not known yet (no uuid label, no health query)"

    def _gpu_uuid(self, t: GpuTarget, expected_uuid: Mapping[str, str]) -> str | None:
        """The physical GPU's UUID: the probe's label, else the health query's listing."""
        listed = self._listed.get(t.index)
        return expected_uuid.get(t.parent) or (listed[0] if listed else None)

    async def list_apps(self) -> list[ComputeApp]:
        """The compute apps now (for the after-job sweep); raises ``CheckFailed``."""
        try:
            return parse_compute_apps(await self._run(NVIDIA_SMI, COMPUTE_APPS_ARGS))
        except HealthReadError as e:
            raise CheckFailed(str(e)) from None

    def _check_xids(
        self,
        targets: Sequence[GpuTarget],
        verdicts: dict[str, DeviceVerdict],
        bus_ids: Mapping[str, str],
    ) -> None:
        lines = self._read_kernel_log()
        if lines is None:
            return
        # Every GPU device, not only those asked about: a line is read once,
        # so one for another device must not be dropped by a one-device check.
        by_bus: dict[str, list[GpuTarget]] = {}
        unknown: set[str] = set()
        for t in self.targets.values():
            listed = self._listed.get(t.index)
            key = bus_key(bus_ids.get(t.parent) or (listed[1] if listed else None) or "")
            if key is not None:
                by_bus.setdefault(key, []).append(t)
            else:
                unknown.add(t.device)
        ignored = frozenset(self._settings.ignored_xids)
        waiting, self._xid_waiting = self._xid_waiting, []
        for line in lines:
            event = parse_xid(line)
            if event is None:
                continue
            self.metrics.gpu_xid.labels(str(event.code)).inc()
            fault = decide_xid(event, ignored)
            if fault is not None:
                waiting.append((event, fault))
        for event, fault in waiting:
            hit = by_bus.get(event.bus, [])
            if not hit and unknown:
                # Some GPU's bus id is not known yet (no pci_bus_id label, no health
                # query answered): the line may be its. Kept until it is known.
                self._wait_xid(event, fault)
                continue
            if not hit:
                log.warning("Xid %d on %s: no device has that pci_bus_id", event.code, event.bus)
            for t in hit:
                # The bus is the physical GPU's: every device on it gets the fault,
                # linked to the GPU's device's, however few devices were asked about.
                verdicts.setdefault(t.device, DeviceVerdict()).gpu_faults.append(fault)
        for t in targets:
            if self._xid_waiting and t.device in unknown:
                first = self._xid_waiting[0][0]
                verdicts[t.device].held[CHECK_XID] = (
                    f"an Xid on PCI bus {first.bus} came before the bus id of GPU {t.index} "
                    "was known (no pci_bus_id label, no health query yet); held until it is"
                )
                continue
            verdicts[t.device].passed.add(CHECK_XID)
        self._count(CHECK_XID, "ok")

    def _wait_xid(self, event: XidEvent, fault: Fault) -> None:
        if len(self._xid_waiting) < XID_WAITING_CAP:
            self._xid_waiting.append((event, fault))
            return
        # The devices it may be for stay held all the same, until their bus ids are known.
        log.error(
            "Xid %d on %s: more than %d Xids wait for a GPU's bus id; this one is dropped",
            event.code,
            event.bus,
            XID_WAITING_CAP,
        )

    def _read_kernel_log(self) -> list[str] | None:
        """New lines of the kernel log since the last read; None when disabled.

        /dev/kmsg gives one record per read and EAGAIN at the end (opened
        non-blocking, from its end: old records were there before this
        worker and are not news); a plain file (tests) is read from the
        offset of the last pass. Unreadable: logged once, check disabled.
        """
        if self._kmsg_disabled:
            return None
        path = self._settings.kernel_log
        try:
            if self._kmsg_fd is None:
                self._kmsg_fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
                if _is_char_device(self._kmsg_fd):
                    os.lseek(self._kmsg_fd, 0, os.SEEK_END)
            return _read_records(self._kmsg_fd, self._kmsg_offset, self._advance)
        except OSError as e:
            self._kmsg_disabled = True
            self._count(CHECK_XID, "error")
            log.error(
                "kernel log %s unreadable (%s): the Xid check is off until the worker restarts",
                path,
                e.strerror or e,
            )
            return None

    def _advance(self, n: int) -> None:
        self._kmsg_offset += n

    async def _check_pci(
        self, targets: Sequence[GpuTarget], verdicts: dict[str, DeviceVerdict]
    ) -> None:
        if self._host.store.which(LSPCI, self._environ.get("PATH", os.defpath)) is None:
            return  # no lspci: nothing to compare with, and nothing wrong

        async def read() -> tuple[int, int]:
            on_bus = count_lspci_gpus(await self._run(LSPCI, LSPCI_ARGS))
            return on_bus, listed_count(await self._run(NVIDIA_SMI, LIST_ARGS))

        counts = await self._query(CHECK_PCI, targets, verdicts, read)
        if counts is None:
            return
        fault = decide_pci(*counts)
        for t in targets:
            verdicts[t.device].passed.add(CHECK_PCI)
            if fault is not None:
                verdicts[t.device].faults.append(fault)

    async def _query(
        self,
        check: str,
        targets: Sequence[GpuTarget],
        verdicts: dict[str, DeviceVerdict],
        read: Callable[[], Awaitable[T]],
    ) -> T | None:
        """Run one check's query. If it cannot run (an error, a hang past its
        timeout, output that does not parse), every target is held for health
        with the reason, never read as healthy; the check is counted either way."""
        try:
            result = await read()
        except (CheckFailed, HealthReadError) as e:
            self._count(check, "error")
            for t in targets:
                verdicts[t.device].held[check] = str(e)
            return None
        self._count(check, "ok")
        return result

    def close(self) -> None:
        if self._kmsg_fd is not None:
            os.close(self._kmsg_fd)
            self._kmsg_fd = None


def _label(value: object) -> str:
    if value is None:
        return "n/a"
    if isinstance(value, bool):
        return "yes" if value else "no"
    return str(value)


def _is_char_device(fd: int) -> bool:
    import stat

    return stat.S_ISCHR(os.fstat(fd).st_mode)


def _read_records(fd: int, offset: int, advance: Callable[[int], None]) -> list[str]:
    lines: list[str] = []
    if _is_char_device(fd):
        total = 0
        while total < KMSG_READ_CAP:
            try:
                record = os.read(fd, 8192)
            except BlockingIOError:
                break
            except OSError as e:
                if e.errno == errno.EPIPE:
                    continue  # records overwritten before we read them
                raise
            if not record:
                break
            total += len(record)
            lines.append(record.decode("utf-8", "replace").split(";", 1)[-1].rstrip("\n"))
        return lines
    data = os.pread(fd, KMSG_READ_CAP, offset)
    # Only whole lines: a line being written is read at the next pass.
    end = data.rfind(b"\n") + 1
    advance(end)
    return data[:end].decode("utf-8", "replace").splitlines()


def _targets(config: Config) -> dict[str, GpuTarget]:
    """Every GPU device (``gpu<N>``) and every MIG slice, with its physical GPU's index."""
    scope = {name: n for n, name in gpu_scope(config.device_names).items()}
    targets = {name: GpuTarget(name, n, name) for name, n in scope.items()}
    for dev in config.devices:
        parent = mig_parent(config, dev)
        if parent is not None and parent in scope:
            targets[dev.name] = GpuTarget(dev.name, scope[parent], parent, dev.mig_uuid)
    return targets


def mig_parent(config: Config, dev: DeviceConfig) -> str | None:
    """The device name of ``dev``'s physical GPU, for a MIG slice; else None."""
    if dev.mig_of is None:
        return None
    parent = mig_parent_name(dev.mig_of, config.device_names)
    return parent if parent in config.device_names or parent != dev.mig_of else None
