"""nvidia-smi's output as label facts (sans-IO): its CSV, its error cells, and the
"Unable to determine the device handle" lines that stand in a lost GPU's place.

``parse_gpu_query`` reads the listing; ``nvidia_smi_facts`` turns one run
into the merger's ``SourceFacts`` (see ``labels``).
"""

from __future__ import annotations

import re
from collections.abc import Collection, Mapping

import attrs

from rc_worker.core.labels import SourceFacts

NVIDIA_SMI = "nvidia-smi"

# The columns asked for, in order. Parsing is positional unless a header
# says otherwise, and extra trailing columns are ignored, so the fixtures'
# longer query parses the same.
GPU_QUERY_FIELDS = (
    "index",
    "name",
    "uuid",
    "memory.total",
    "driver_version",
    "pci.bus_id",
    "compute_cap",
    "mig.mode.current",
)
NVIDIA_SMI_ARGS = (
    "--query-gpu=" + ",".join(GPU_QUERY_FIELDS),
    "--format=csv,noheader,nounits",
)
# Query column -> label name. ``index`` is not a label: it picks the device.
_GPU_LABELS = {
    "name": "product",
    "uuid": "uuid",
    "memory.total": "memory_total_bytes",
    "driver_version": "driver_version",
    "pci.bus_id": "pci_bus_id",
    "compute_cap": "compute_cap",
    "mig.mode.current": "mig_mode",
}
_MIB = 2**20

_GPU_DEVICE_RE = re.compile(r"gpu(0|[1-9][0-9]*)")
_BUS = r"[0-9A-Fa-f]{4,8}:[0-9A-Fa-f]{2}:[0-9A-Fa-f]{2}\.[0-9A-Fa-f]"
_BUS_RE = re.compile(_BUS)
_LOST_RE = re.compile(r"unable to determine the device handle for gpu", re.IGNORECASE)
# "for GPU0000:CB:00.0" must read as a bus id, not as index 0000 followed by
# junk, so the bus-id form is tried first.
_LOST_BUS_FIRST_RE = re.compile(rf"for gpu\s*(?P<bus>{_BUS})", re.IGNORECASE)
_LOST_INDEX_RE = re.compile(rf"for gpu\s*(?P<index>[0-9]+)\s*:\s*(?P<bus>{_BUS})?", re.IGNORECASE)
_UINT_RE = re.compile(r"[0-9]+")
_HEADER_UNIT_RE = re.compile(r"^(?P<name>[^\[]*?)\s*(?:\[(?P<unit>[^\]]*)\])?$")


def gpu_index(name: str) -> int | None:
    """The NVML index of a device named ``gpu<N>`` (``gpu0``, not ``gpu01``), else None."""
    m = _GPU_DEVICE_RE.fullmatch(name)
    return int(m.group(1)) if m else None


def gpu_scope(device_names: Collection[str]) -> dict[int, str]:
    """The declared devices nvidia-smi can speak for: ``gpu<N>`` by NVML index."""
    scope: dict[int, str] = {}
    for name in device_names:
        index = gpu_index(name)
        if index is not None:
            scope[index] = name
    return scope


def mig_parent_name(mig_of: str, device_names: Collection[str]) -> str:
    """The device a slice's ``mig_of`` names: the device of that name, else, for an
    NVML index ``N``, ``gpu<N>`` (which may not be declared: the config says so)."""
    if mig_of in device_names or not _UINT_RE.fullmatch(mig_of):
        return mig_of
    return f"gpu{int(mig_of)}"


def normalize_bus_id(bus_id: str) -> str | None:
    """``00000000:5d:00.0`` and ``0000:5D:00.0`` alike as ``0000:5D:00.0``."""
    m = _BUS_RE.fullmatch(bus_id.strip())
    if not m:
        return None
    domain, bus, rest = m.group(0).split(":")
    return f"{int(domain, 16):04X}:{bus.upper()}:{rest.upper()}"


@attrs.frozen
class GpuRow:
    index: int
    facts: Mapping[str, str]
    bus_id: str | None = None


@attrs.frozen
class LostGpu:
    """A line in a GPU's place that is not a usable row; ``index`` None if unattributed."""

    line: str
    index: int | None = None
    bus_id: str | None = None


@attrs.frozen
class GpuQuery:
    rows: tuple[GpuRow, ...] = ()
    lost: tuple[LostGpu, ...] = ()
    junk: tuple[str, ...] = ()


def is_error_cell(cell: str) -> bool:
    """nvidia-smi's ways of saying "no value": ``[N/A]``, ``[Unknown Error]``, ``ERR!``..."""
    c = cell.strip()
    return (
        not c
        or (c.startswith("[") and c.endswith("]"))
        or c.upper().startswith("ERR!")
        or c.upper() == "N/A"
    )


def parse_gpu_query(text: str, *, known_bus_ids: Mapping[str, int] | None = None) -> GpuQuery:
    """Parse ``nvidia-smi --query-gpu`` output, with or without header and units.

    Lines that stand in a GPU's place (a lost GPU, a row whose index is an
    error, a row cut short) become ``LostGpu`` entries, attributed to an NVML
    index by, in order: the index the line names; its PCI bus id, looked up
    in ``known_bus_ids`` (bus id -> index from earlier passes); its position
    between rows whose indices leave exactly that gap. Anything else that is
    not blank is junk.
    """
    columns: tuple[str, ...] = GPU_QUERY_FIELDS
    units: dict[str, str] = {}
    entries: list[GpuRow | LostGpu] = []
    junk: list[str] = []
    for raw in text.splitlines():
        line = raw.strip()
        if not line:
            continue
        if _LOST_RE.search(line):
            entries.append(_lost_line(line))
            continue
        cells = [c.strip() for c in line.split(",")]
        header = _header(cells)
        if header is not None:
            columns, units = header
            continue
        entry = _row(line, cells, columns, units)
        if entry is None:
            junk.append(line)
        else:
            entries.append(entry)
    _attribute(entries, known_bus_ids or {})
    return GpuQuery(
        rows=tuple(e for e in entries if isinstance(e, GpuRow)),
        lost=tuple(e for e in entries if isinstance(e, LostGpu)),
        junk=tuple(junk),
    )


def _header(cells: list[str]) -> tuple[tuple[str, ...], dict[str, str]] | None:
    names: list[str] = []
    units: dict[str, str] = {}
    for cell in cells:
        m = _HEADER_UNIT_RE.match(cell)
        name = (m.group("name") if m else cell).strip().lower()
        names.append(name)
        if m and m.group("unit"):
            units[name] = m.group("unit").strip()
    if not names or names[0] != "index" or "uuid" not in names:
        return None
    return tuple(names), units


def _lost_line(line: str) -> LostGpu:
    m = _LOST_BUS_FIRST_RE.search(line)
    if m:
        return LostGpu(line=line, bus_id=normalize_bus_id(m.group("bus")))
    m = _LOST_INDEX_RE.search(line)
    if m:
        bus = m.group("bus")
        return LostGpu(
            line=line, index=int(m.group("index")), bus_id=normalize_bus_id(bus) if bus else None
        )
    return LostGpu(line=line)


def _row(
    line: str, cells: list[str], columns: tuple[str, ...], units: Mapping[str, str]
) -> GpuRow | LostGpu | None:
    by_column = dict(zip(columns, cells, strict=False))
    index_cell = by_column.get("index", "")
    index = int(index_cell) if _UINT_RE.fullmatch(index_cell) else None
    complete = len(cells) >= len(columns) or all(f in by_column for f in GPU_QUERY_FIELDS)
    if (index is None and not complete) or len(cells) < 2:
        return None
    raw_bus = by_column.get("pci.bus_id", "")
    bus = None if is_error_cell(raw_bus) else normalize_bus_id(raw_bus)
    if index is None or not complete:
        # A row whose index is an error cell, or one cut short, is this
        # GPU's place in the listing but not a fact about it.
        return LostGpu(line=line, index=index, bus_id=bus)
    facts: dict[str, str] = {}
    for column, label in _GPU_LABELS.items():
        value = _cell_value(column, by_column.get(column, ""), units.get(column))
        if value is not None:
            facts[label] = value
    return GpuRow(index=index, facts=facts, bus_id=bus)


def _cell_value(column: str, cell: str, unit: str | None) -> str | None:
    if is_error_cell(cell):
        return None
    value = cell.strip()
    if column == "memory.total":
        number = value.removesuffix("MiB").strip()
        return str(int(number) * _MIB) if _UINT_RE.fullmatch(number) else None
    if unit and value.endswith(unit):
        value = value.removesuffix(unit).strip()
    return value or None


def _attribute(entries: list[GpuRow | LostGpu], known_bus_ids: Mapping[str, int]) -> None:
    """Give each unattributed ``LostGpu`` an index, in place, where that is sound."""
    row_indices = {e.index for e in entries if isinstance(e, GpuRow)}
    for i, e in enumerate(entries):
        if isinstance(e, LostGpu) and e.index is None and e.bus_id is not None:
            known = known_bus_ids.get(e.bus_id)
            # A remembered index that answered with a row this pass belongs
            # to another card now; the memory is stale.
            if known is not None and known not in row_indices:
                entries[i] = attrs.evolve(e, index=known)
    # Rows come in NVML index order and a lost GPU's line sits in its place,
    # so a run of k unattributed lines between indices a and b with
    # b - a - 1 == k is exactly a+1..a+k. A run at the end is trusted only
    # when every entry before it sits at its own index.
    i = 0
    while i < len(entries):
        if _index_of(entries[i]) is not None:
            i += 1
            continue
        j = i
        while j < len(entries) and _index_of(entries[j]) is None:
            j += 1
        before = _index_of(entries[i - 1]) if i > 0 else -1
        after = _index_of(entries[j]) if j < len(entries) else None
        k = j - i
        fits = (before is not None and after is not None and after - before - 1 == k) or (
            after is None and all(_index_of(entries[p]) == p for p in range(i))
        )
        if fits and before is not None:
            for offset in range(k):
                entries[i + offset] = attrs.evolve(entries[i + offset], index=before + 1 + offset)
        i = j


def _index_of(entry: GpuRow | LostGpu) -> int | None:
    return entry.index


@attrs.frozen
class NvidiaSmiReading:
    """nvidia-smi's outcome: the merger's input, a short reason, and bus ids to remember."""

    facts: SourceFacts
    why: str = ""
    bus_ids: Mapping[str, int] = attrs.field(factory=dict)


def nvidia_smi_facts(
    output: str,
    exit_code: int,
    device_names: Collection[str],
    *,
    known_bus_ids: Mapping[str, int] | None = None,
) -> NvidiaSmiReading:
    """Read one completed nvidia-smi run (both streams, in order) for the declared devices.

    Row N speaks for declared ``gpu<N>`` only. A parsed row confirms its
    device; a declared ``gpu<N>`` with no row, or whose place holds an error
    line, is unconfirmed; an error line that cannot be attributed leaves
    every ``gpu<N>`` unconfirmed. Non-zero exit or unparseable output with
    no rows at all is a failure of the whole source.
    """
    scope = gpu_scope(device_names)
    scope_set = frozenset(scope.values())
    query = parse_gpu_query(output, known_bus_ids=known_bus_ids)
    if not query.rows:
        if exit_code != 0:
            return NvidiaSmiReading(
                SourceFacts.failed(NVIDIA_SMI, scope_set),
                f"exit status {exit_code}: {text_tail(output)}",
            )
        if query.junk or query.lost:
            what = "unparseable output" if query.junk else "no GPU answered"
            return NvidiaSmiReading(
                SourceFacts.failed(NVIDIA_SMI, scope_set), f"{what}: {text_tail(output)}"
            )
    seen: dict[int, GpuRow] = {}
    doubtful: set[int] = set()
    for row in query.rows:
        if row.index in seen:
            doubtful.add(row.index)
        seen[row.index] = row
    doubtful.update(e.index for e in query.lost if e.index is not None)
    unattributed = [e for e in query.lost if e.index is None]
    if unattributed:
        unconfirmed = set(scope_set)
    else:
        unconfirmed = {name for n, name in scope.items() if n in doubtful or n not in seen}
    device = {scope[n]: row.facts for n, row in seen.items() if n in scope}
    reasons: list[str] = []
    if exit_code != 0:
        reasons.append(f"exit status {exit_code}")
    if unconfirmed:
        names = ", ".join(sorted(unconfirmed, key=_natural))
        detail = query.lost[0].line if query.lost else "no row"
        reasons.append(f"{names} not confirmed: {detail}")
    bus_ids = {row.bus_id: row.index for row in query.rows if row.bus_id is not None}
    return NvidiaSmiReading(
        facts=SourceFacts(
            name=NVIDIA_SMI,
            ok=True,
            device=device,
            unconfirmed=frozenset(unconfirmed),
            scope=scope_set,
        ),
        why="; ".join(reasons),
        bus_ids=bus_ids,
    )


def _natural(name: str) -> tuple[str, int]:
    m = re.fullmatch(r"(.*?)([0-9]*)", name)
    assert m is not None
    return m.group(1), int(m.group(2) or -1)


def text_tail(text: str, limit: int = 200) -> str:
    """The last non-blank lines of ``text``, on one line, at most ``limit`` characters."""
    flat = " | ".join(line.strip() for line in text.splitlines() if line.strip())
    return flat if len(flat) <= limit else "…" + flat[-(limit - 1) :]
