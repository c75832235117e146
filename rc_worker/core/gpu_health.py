"""GPU health: parsing and decisions (sans-IO: no Trio, no processes).

The worker's built-in GPU checks (the ``gpu_health`` config section). The
shell in ``gpu_health_run.py`` runs nvidia-smi, lspci and reads the kernel
log; this module decides what their output means:

- ``parse_health_query``: ``--query-gpu`` of the ECC, retired-page and
  remapped-row fields, with a header, by column name;
- ``parse_compute_apps``: ``--query-compute-apps``, by column name;
- ``parse_gpu_list``: ``nvidia-smi -L``, GPUs and their MIG slices;
- ``parse_xid``: one kernel log line, ``NVRM: Xid (PCI:<bus>): <code>, ...``;
- ``count_lspci_gpus``: NVIDIA display/3D controllers in ``lspci -n``;
- the ``decide_*`` functions: from a reading to a ``Fault`` (or none).

Every fault says how bad it is (``severity``) and what to do about it
(``action``), so an operator reading ``rc devices`` knows whether to kill a
process and clear, reset the GPU, reboot the host or return the card.

A check that cannot be read is never read as healthy: the parsers raise
``HealthReadError`` and the shell holds the device ("held for health").
"""

from __future__ import annotations

import csv
import re
from collections.abc import Collection, Iterable, Mapping, Sequence

import attrs

from rc_worker.core.config import DEFAULT_IGNORED_XIDS as _DEFAULT_IGNORED_XIDS

# Fault kinds (the ``kind`` of a fault report).
KIND_RESIDENT = "gpu_resident_process"
KIND_MEMORY = "gpu_memory"
KIND_XID = "gpu_xid"
KIND_MISSING = "gpu_missing"

SEVERITIES = ("warning", "error", "fatal")
ACTIONS = ("clear", "reset", "reboot", "replace")

# Check names (the ``check`` label of rc_worker_gpu_health_checks_total).
CHECK_RESIDENT = "resident"
CHECK_MEMORY = "memory"
CHECK_XID = "xid"
CHECK_PRESENCE = "presence"
CHECK_PCI = "pci"
CHECK_MIG = "mig"

# The recommended step for the worker's other fault kinds, so every fault
# carries a severity and an action (the controller applies the same table to
# faults that arrive without them).
KIND_DEFAULTS: dict[str, tuple[str, str]] = {
    "dirty": ("error", "reboot"),  # processes that survived SIGKILL: stuck in the kernel
    "verify_failed": ("error", "clear"),
    "hook_failed": ("error", "clear"),
    "interrupted": ("warning", "clear"),
}


def kind_defaults(kind: str) -> tuple[str, str]:
    """``(severity, action)`` for a fault kind raised without them."""
    return KIND_DEFAULTS.get(kind, ("error", "clear"))


# The Xids NVIDIA's k8s device plugin ignores (config ``gpu_health.ignored_xids``).
DEFAULT_IGNORED_XIDS = _DEFAULT_IGNORED_XIDS
"""NVIDIA's k8s device plugin ignores these: application errors, not the GPU's."""

HEALTH_QUERY_FIELDS = (
    "index",
    "uuid",
    "pci.bus_id",
    "ecc.errors.corrected.volatile.total",
    "ecc.errors.uncorrected.volatile.total",
    "retired_pages.single_bit_ecc.count",
    "retired_pages.double_bit.count",
    "retired_pages.pending",
    "remapped_rows.correctable",
    "remapped_rows.uncorrectable",
    "remapped_rows.pending",
    "remapped_rows.failure",
)
# A header is asked for so columns are read by name: a capture with more
# columns (every fixture from the exporters) parses the same.
HEALTH_QUERY_ARGS = ("--query-gpu=" + ",".join(HEALTH_QUERY_FIELDS), "--format=csv,nounits")
COMPUTE_APPS_FIELDS = ("gpu_uuid", "pid", "process_name", "used_gpu_memory")
COMPUTE_APPS_ARGS = (
    "--query-compute-apps=" + ",".join(COMPUTE_APPS_FIELDS),
    "--format=csv,nounits",
)
LIST_ARGS = ("-L",)
LSPCI_ARGS = ("-n", "-d", "10de:")

_LOST_RE = re.compile(r"unable to determine the device handle|gpu is lost", re.IGNORECASE)


def mentions_lost_gpu(text: str) -> bool:
    """Whether nvidia-smi's output names a GPU it lost ("Unable to determine the
    device handle", "GPU is lost")."""
    return _LOST_RE.search(text) is not None


_UINT_RE = re.compile(r"[0-9]+")
_HEADER_RE = re.compile(r"^(?P<name>[^\[]*?)\s*(?:\[(?P<unit>[^\]]*)\])?$")
_XID_RE = re.compile(
    r"NVRM: Xid \(PCI:(?P<bus>[0-9A-Fa-f]{4,8}:[0-9A-Fa-f]{2}:[0-9A-Fa-f]{2})(?:\.[0-9A-Fa-f])?\)"
    r":\s*(?P<code>[0-9]+)(?:,\s*(?P<rest>.*))?"
)
_BUS_KEY_RE = re.compile(
    r"(?:PCI:)?(?P<domain>[0-9A-Fa-f]{4,8}):(?P<bus>[0-9A-Fa-f]{2}):(?P<dev>[0-9A-Fa-f]{2})"
    r"(?:\.[0-9A-Fa-f])?"
)
_GPU_LINE_RE = re.compile(r"^GPU (?P<index>[0-9]+): (?P<name>.*?) \(UUID: (?P<uuid>[^)]+)\)\s*$")
_MIG_LINE_RE = re.compile(
    r"^\s+MIG (?P<profile>\S+)\s+Device\s+(?P<index>[0-9]+): \(UUID: (?P<uuid>[^)]+)\)\s*$"
)
_LSPCI_RE = re.compile(r"^\S+\s+(?P<cls>[0-9a-fA-F]{4}):\s+10de:[0-9a-fA-F]{4}")


class HealthReadError(ValueError):
    """A check's output that cannot be read: the device is held, never passed."""


@attrs.frozen
class Fault:
    """A health fault: what, why, how bad and what to do."""

    kind: str
    reason: str
    severity: str = "error"
    action: str = "reset"
    host_level: bool = False

    def body(self) -> dict[str, object]:
        """The fault report's fields beyond ``fault_id`` (docs/protocol.md)."""
        out: dict[str, object] = {
            "kind": self.kind,
            "reason": self.reason,
            "severity": self.severity,
            "action": self.action,
        }
        if self.host_level:
            out["scope"] = "host"
        return out


# --------------------------------------------------------------------------
# bus ids


def bus_key(bus_id: str) -> str | None:
    """A bus id as ``DDDD:BB:DD``, whichever spelling: the kernel's ``0000:3b:00``,
    nvidia-smi's ``00000000:3B:00.0``, lspci's ``0000:3b:00.0``. The function
    digit is dropped: the kernel's Xid line does not carry it."""
    m = _BUS_KEY_RE.fullmatch(bus_id.strip())
    if not m:
        return None
    return f"{int(m.group('domain'), 16):04X}:{m.group('bus').upper()}:{m.group('dev').upper()}"


# --------------------------------------------------------------------------
# CSV with a header


def _csv_table(text: str, required: Sequence[str], what: str) -> list[dict[str, str]]:
    """Rows of a ``--format=csv`` listing as {column: cell}, units stripped.

    Raises ``HealthReadError`` on no header, a missing column or a short row.
    """
    lines = [line for line in text.splitlines() if line.strip()]
    if not lines:
        raise HealthReadError(f"{what}: no output (expected a header line)")
    try:
        return _csv_rows(lines, required, what)
    except csv.Error as e:  # a field past csv's size limit, a stray NUL: not a listing
        raise HealthReadError(f"{what}: {e}") from None


def _csv_rows(lines: list[str], required: Sequence[str], what: str) -> list[dict[str, str]]:
    header = next(csv.reader([lines[0]], skipinitialspace=True))
    names: list[str] = []
    units: dict[str, str] = {}
    for cell in header:
        m = _HEADER_RE.match(cell.strip())
        name = (m.group("name") if m else cell).strip().lower()
        names.append(name)
        if m and m.group("unit"):
            units[name] = m.group("unit").strip()
    missing = [c for c in required if c not in names]
    if missing:
        raise HealthReadError(f"{what}: no column {', '.join(missing)} in {lines[0][:120]!r}")
    rows: list[dict[str, str]] = []
    for line in lines[1:]:
        cells = next(csv.reader([line], skipinitialspace=True))
        if len(cells) < len(names):
            # A lost GPU's line stands in its row; the caller decides.
            rows.append({"_line": line})
            continue
        row = {}
        for name, cell in zip(names, cells, strict=False):
            value = cell.strip()
            unit = units.get(name)
            if unit and value.endswith(unit):
                value = value.removesuffix(unit).strip()
            row[name] = value
        rows.append(row)
    return rows


# What nvidia-smi prints for a field this GPU does not have (no remapper before Ampere, no
# ECC on GeForce). Every other bracketed cell is an error (``[GPU requires reset]``,
# ``[Unknown Error]``, ``[Insufficient Permissions]``) and so is ``ERR!``: read as "not
# supported", a GPU that needs a reset would pass its memory checks.
_ABSENT = frozenset({"", "N/A", "[N/A]", "NOT SUPPORTED", "[NOT SUPPORTED]"})


def _na(cell: str) -> bool:
    """The field is not supported on this GPU (an error cell is not this: see _ABSENT)."""
    return cell.strip().upper() in _ABSENT


def _not_an_id(cell: str) -> bool:
    """An error or absent cell where a GPU's index or UUID should be: the GPU is lost."""
    c = cell.strip()
    return _na(c) or (c.startswith("[") and c.endswith("]")) or c.upper() == "ERR!"


def _count(cell: str) -> int | None:
    """A counter cell: an int, or None for "not supported here" (``[N/A]``); an error cell
    (``[GPU requires reset]``) raises, so the GPU is held, never passed."""
    if _na(cell):
        return None
    if _UINT_RE.fullmatch(cell.strip()):
        return int(cell)
    raise HealthReadError(f"{cell!r} is not a count")


def _flag(cell: str) -> bool | None:
    if _na(cell):
        return None
    c = cell.strip().lower()
    if c in ("yes", "1", "true"):
        return True
    if c in ("no", "0", "false"):
        return False
    raise HealthReadError(f"{cell!r} is not Yes or No")


# --------------------------------------------------------------------------
# ECC, retired pages, remapped rows, presence


@attrs.frozen
class GpuHealthRow:
    index: int
    uuid: str
    bus_id: str | None
    ecc_corrected: int | None = None
    ecc_uncorrected: int | None = None
    retired_sbe: int | None = None
    retired_dbe: int | None = None
    retired_pending: bool | None = None
    remap_correctable: int | None = None
    remap_uncorrectable: int | None = None
    remap_pending: bool | None = None
    remap_failure: bool | None = None


@attrs.frozen
class HealthReading:
    """One ``--query-gpu`` health listing: rows by index, and the lost lines."""

    rows: Mapping[int, GpuHealthRow] = attrs.field(factory=dict)
    lost: tuple[str, ...] = ()


def parse_health_query(text: str) -> HealthReading:
    """Parse the health query's output (header, with or without units).

    Lines that say a GPU is lost are kept apart; any other line that is not a
    row raises ``HealthReadError``: output that does not parse never passes.
    A cell that is ``[N/A]`` is "not supported on this GPU" (no remapper on
    pre-Ampere cards, no ECC on GeForce); an error cell where a GPU's index
    or UUID should be makes it lost.
    """
    lost = [line.strip() for line in text.splitlines() if _LOST_RE.search(line)]
    rest = "\n".join(line for line in text.splitlines() if not _LOST_RE.search(line))
    if not rest.strip() and lost:
        return HealthReading(rows={}, lost=tuple(lost))
    table = _csv_table(rest, ("index", "uuid"), "health query")
    rows: dict[int, GpuHealthRow] = {}
    for row in table:
        if "_line" in row:
            raise HealthReadError(f"health query: a short row {row['_line'][:120]!r}")
        if not _UINT_RE.fullmatch(row["index"]) or _not_an_id(row["uuid"]):
            lost.append(", ".join(row.values()))
            continue
        try:
            rows[int(row["index"])] = GpuHealthRow(
                index=int(row["index"]),
                uuid=row["uuid"],
                bus_id=bus_key(row.get("pci.bus_id", "")),
                ecc_corrected=_count(row.get("ecc.errors.corrected.volatile.total", "")),
                ecc_uncorrected=_count(row.get("ecc.errors.uncorrected.volatile.total", "")),
                retired_sbe=_count(row.get("retired_pages.single_bit_ecc.count", "")),
                retired_dbe=_count(row.get("retired_pages.double_bit.count", "")),
                retired_pending=_flag(row.get("retired_pages.pending", "")),
                remap_correctable=_count(row.get("remapped_rows.correctable", "")),
                remap_uncorrectable=_count(row.get("remapped_rows.uncorrectable", "")),
                remap_pending=_flag(row.get("remapped_rows.pending", "")),
                remap_failure=_flag(row.get("remapped_rows.failure", "")),
            )
        except HealthReadError as e:
            raise HealthReadError(f"health query, GPU {row['index']}: {e}") from None
    return HealthReading(rows=rows, lost=tuple(lost))


@attrs.frozen
class MemoryState:
    """What the memory check remembers of one GPU between checks."""

    ecc_uncorrected: int | None = None
    retired_dbe: int | None = None
    growths: int = 0


def decide_memory(prev: MemoryState | None, row: GpuHealthRow) -> tuple[list[Fault], MemoryState]:
    """ECC and memory faults of one GPU, and what to remember for the next check.

    Volatile uncorrectable errors count since the driver loaded, so the first
    check of a worker process is a baseline: only growth since then faults
    (a restart must not re-raise what an operator has cleared). Retired-page
    and row-remap states are read as they stand.
    """
    faults: list[Fault] = []
    growths = prev.growths if prev is not None else 0
    if (
        prev is not None
        and prev.ecc_uncorrected is not None
        and row.ecc_uncorrected is not None
        and row.ecc_uncorrected > prev.ecc_uncorrected
    ):
        growths += 1
        grew = row.ecc_uncorrected - prev.ecc_uncorrected
        repeated = growths > 1
        faults.append(
            Fault(
                KIND_MEMORY,
                f"volatile uncorrectable ECC errors grew by {grew} to {row.ecc_uncorrected}"
                + (" (again: repeated uncorrectable errors)" if repeated else ""),
                severity="fatal" if repeated else "error",
                action="replace" if repeated else "reset",
            )
        )
    if (
        prev is not None
        and prev.retired_dbe is not None
        and row.retired_dbe is not None
        and row.retired_dbe > prev.retired_dbe
    ):
        faults.append(
            Fault(
                KIND_MEMORY,
                f"pages retired for double-bit errors grew to {row.retired_dbe}",
                severity="error",
                action="reset",
            )
        )
    if row.retired_pending:
        faults.append(
            Fault(
                KIND_MEMORY,
                "retired pages pending: a GPU reset applies the retirement",
                severity="error",
                action="reset",
            )
        )
    if row.remap_failure:
        faults.append(
            Fault(
                KIND_MEMORY,
                "row remapping failed: the GPU can no longer mask bad memory",
                severity="fatal",
                action="replace",
            )
        )
    elif row.remap_pending:
        faults.append(
            Fault(
                KIND_MEMORY,
                f"row remap pending ({row.remap_uncorrectable or 0} uncorrectable rows): "
                "a GPU reset applies it",
                severity="error",
                action="reset",
            )
        )
    state = MemoryState(
        ecc_uncorrected=row.ecc_uncorrected, retired_dbe=row.retired_dbe, growths=growths
    )
    return faults, state


def decide_presence(index: int, expected_uuid: str | None, reading: HealthReading) -> Fault | None:
    """``gpu_missing`` when GPU ``index`` is gone, lost, or another card."""
    row = reading.rows.get(index)
    if row is None:
        detail = f": {reading.lost[0]}" if reading.lost else ""
        return Fault(
            KIND_MISSING,
            f"nvidia-smi no longer lists GPU {index}{detail}",
            severity="fatal",
            action="reboot",
        )
    if expected_uuid and row.uuid != expected_uuid:
        return Fault(
            KIND_MISSING,
            f"GPU {index} is now {row.uuid}, was {expected_uuid}",
            severity="error",
            action="clear",
        )
    return None


def count_lspci_gpus(text: str) -> int:
    """NVIDIA VGA (0300) and 3D (0302) controllers in ``lspci -n -d 10de:``.

    NVSwitches (0680) and audio functions (0403) are not GPUs.
    """
    count = 0
    for line in text.splitlines():
        m = _LSPCI_RE.match(line.strip())
        if m and m.group("cls").lower() in ("0300", "0302"):
            count += 1
    return count


def decide_pci(lspci_count: int, smi_count: int) -> Fault | None:
    """A host-level ``gpu_missing`` when the bus has more GPUs than nvidia-smi lists."""
    if lspci_count > smi_count:
        return Fault(
            KIND_MISSING,
            f"{lspci_count} NVIDIA GPUs on the PCI bus but nvidia-smi lists {smi_count}: "
            "a GPU has fallen off the driver",
            severity="fatal",
            action="reboot",
            host_level=True,
        )
    return None


# --------------------------------------------------------------------------
# compute apps


@attrs.frozen
class ComputeApp:
    gpu_uuid: str
    pid: int
    name: str
    used_mib: int | None


def parse_compute_apps(text: str) -> list[ComputeApp]:
    """Parse ``--query-compute-apps`` output (header required, units optional)."""
    if any(_LOST_RE.search(line) for line in text.splitlines()):
        raise HealthReadError("compute apps: nvidia-smi reports a lost GPU")
    table = _csv_table(text, ("gpu_uuid", "pid"), "compute apps")
    apps: list[ComputeApp] = []
    for row in table:
        if "_line" in row:
            raise HealthReadError(f"compute apps: a short row {row['_line'][:120]!r}")
        if not _UINT_RE.fullmatch(row["pid"]):
            raise HealthReadError(f"compute apps: pid {row['pid']!r} is not a number")
        memory = row.get("used_gpu_memory", row.get("used_memory", ""))
        apps.append(
            ComputeApp(
                gpu_uuid=row["gpu_uuid"],
                pid=int(row["pid"]),
                name=row.get("process_name", "") or "?",
                used_mib=int(memory) if _UINT_RE.fullmatch(memory) else None,
            )
        )
    return apps


def apps_on(apps: Iterable[ComputeApp], uuids: Collection[str]) -> list[ComputeApp]:
    """The apps on any of ``uuids`` (a GPU's UUID, or a MIG slice's and its parent's)."""
    return [a for a in apps if a.gpu_uuid in uuids]


def decide_resident(apps: Sequence[ComputeApp]) -> Fault | None:
    """``gpu_resident_process`` naming each pid, its name and the memory it holds."""
    if not apps:
        return None
    parts = [
        f"pid {a.pid} ({a.name}, {'?' if a.used_mib is None else a.used_mib} MiB)" for a in apps
    ]
    return Fault(
        KIND_RESIDENT,
        "processes resident on the GPU: " + ", ".join(parts),
        severity="warning",
        action="clear",
    )


# --------------------------------------------------------------------------
# nvidia-smi -L (MIG)


@attrs.frozen
class MigSlice:
    index: int
    uuid: str
    profile: str


@attrs.frozen
class ListedGpu:
    index: int
    name: str
    uuid: str
    slices: tuple[MigSlice, ...] = ()


def parse_gpu_list(text: str) -> list[ListedGpu]:
    """Parse ``nvidia-smi -L``: each GPU, with its MIG slices under it."""
    gpus: list[ListedGpu] = []
    for raw in text.splitlines():
        if not raw.strip() or _LOST_RE.search(raw):
            continue  # a lost GPU's line: counted by ``listed_count``
        g = _GPU_LINE_RE.match(raw.strip())
        if g:
            gpus.append(ListedGpu(int(g.group("index")), g.group("name"), g.group("uuid")))
            continue
        m = _MIG_LINE_RE.match(raw)
        if m and gpus:
            last = gpus[-1]
            mig = MigSlice(int(m.group("index")), m.group("uuid"), m.group("profile"))
            gpus[-1] = attrs.evolve(last, slices=(*last.slices, mig))
            continue
        raise HealthReadError(f"nvidia-smi -L: cannot read {raw.strip()[:120]!r}")
    return gpus


def listed_count(text: str) -> int:
    """GPUs nvidia-smi -L accounts for: listed ones and lost ones (whose loss the
    presence check already attributes to a device)."""
    lost = sum(1 for line in text.splitlines() if _LOST_RE.search(line))
    return len(parse_gpu_list(text)) + lost


def resolve_mig_uuid(gpus: Sequence[ListedGpu], parent_index: int, mig_index: int) -> str | None:
    for gpu in gpus:
        if gpu.index == parent_index:
            for mig in gpu.slices:
                if mig.index == mig_index:
                    return mig.uuid
    return None


# --------------------------------------------------------------------------
# Xid


@attrs.frozen
class XidEvent:
    bus: str
    """``DDDD:BB:DD``, see ``bus_key``."""
    code: int
    text: str


def parse_xid(line: str) -> XidEvent | None:
    """The Xid in one kernel log line, whatever its prefix (kmsg, dmesg, journal)."""
    m = _XID_RE.search(line)
    if not m:
        return None
    bus = bus_key(m.group("bus"))
    if bus is None:
        return None
    text = line[m.start() :].strip()
    return XidEvent(bus=bus, code=int(m.group("code")), text=text)


# Codes with a known recommended action (NVIDIA's Xid catalogue); any other
# code not ignored is an error whose step is a GPU reset.
_XID_ACTIONS: dict[int, tuple[str, str]] = {
    79: ("fatal", "reboot"),  # fallen off the bus
    74: ("error", "reset"),  # NVLink
    48: ("error", "reset"),  # double-bit ECC
    63: ("error", "reset"),  # row remap / page retirement recorded
    64: ("fatal", "replace"),  # row remap / page retirement failed
    92: ("warning", "clear"),  # high single-bit ECC rate
    94: ("error", "reset"),  # contained ECC error
    95: ("error", "reset"),  # uncontained ECC error
    119: ("error", "reset"),  # GSP RPC timeout
    120: ("error", "reset"),  # GSP error
}


def decide_xid(event: XidEvent, ignored: Collection[int]) -> Fault | None:
    """``gpu_xid`` for any code not ignored, with the line's text."""
    if event.code in ignored:
        return None
    severity, action = _XID_ACTIONS.get(event.code, ("error", "reset"))
    if event.code == 154:
        # "GPU recovery action changed from 0x0 (None) to 0x4 (Drain and Reset)":
        # only the new action counts (the old one may well say "Reboot"), and
        # "Drain and Reset" still needs the reset (NVIDIA's GPU memory error
        # management guide, "Error Recovery and Response Flags").
        target = event.text.lower().rsplit(" to ", 1)[-1]
        if "reboot" in target:
            severity, action = "fatal", "reboot"
        elif "reset" in target:
            severity, action = "error", "reset"
        elif "drain" in target or "none" in target:
            severity, action = "warning", "clear"
    return Fault(KIND_XID, event.text, severity=severity, action=action)


def health_label(held: bool, faulted: bool) -> str:
    """The ``gpu_health`` label: ``faulted`` outranks ``held``, which outranks ``ok``."""
    if faulted:
        return "faulted"
    if held:
        return "held"
    return "ok"
