"""Probe output and the ProbeResult merger (sans-IO: no Trio, no processes).

A probe pass has several sources: the built-in host facts, ``nvidia-smi``,
and the drop-in executables of ``probe_dir``. The shell in ``probe.py`` runs
them; this module decides what their output means:

- ``parse_gpu_query`` / ``nvidia_smi_facts``: nvidia-smi's CSV, its error
  cells, and the "Unable to determine the device handle" lines that stand in
  a lost GPU's place;
- ``parse_dropin_output``: one drop-in's JSON object of flat label keys;
- ``merge_sources``: every source's outcome this pass, plus which devices
  each drop-in spoke for the last time it worked, into a ``ProbeResult``;
- ``labels_payload``: the ``PUT /v1/hosts/{host}/labels`` body.

The rule the merger exists for (ARCHITECTURE invariant 4): a device whose
facts a pass could not confirm is left out of the payload so it keeps its
previous facts, while host facts from every source that worked are always
sent. Freezing them on one source's failure once advertised a full disk as
free and routed a job onto it.
"""

from __future__ import annotations

import json
import re
from collections.abc import Collection, Mapping, Sequence
from typing import Any

import attrs

from rc_worker.names import split_label_key

NVIDIA_SMI = "nvidia-smi"
BUILTIN = "builtin"
DROPIN_PREFIX = "probe.d/"

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

DROPIN_STDOUT_CAP = 64 * 1024

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


# --------------------------------------------------------------------------
# Results


@attrs.frozen
class ProbeResult:
    """What one probe pass produced.

    ``host`` holds host-wide facts; ``device`` has an entry for every declared
    device (possibly empty); ``unconfirmed`` names the declared devices whose
    own facts this pass could not confirm, because a source understood to
    speak for them failed. Those are left out of the label payload, so the
    controller keeps their previous facts instead of clearing them on a
    guess. None of the three is ever None.
    """

    host: Mapping[str, str] = attrs.field(factory=dict)
    device: Mapping[str, Mapping[str, str]] = attrs.field(factory=dict)
    unconfirmed: frozenset[str] = frozenset()

    @property
    def confirmed(self) -> tuple[str, ...]:
        """The devices whose facts this pass confirmed, in declared order."""
        return tuple(d for d in self.device if d not in self.unconfirmed)


@attrs.frozen
class SourceFacts:
    """One source's outcome this pass, as the merger sees it.

    ``ok`` False means the source failed and none of its output is used.
    ``unconfirmed`` lets a source that worked in part (nvidia-smi with one
    GPU lost) name the devices it could not confirm. ``scope`` is the set of
    devices a source speaks for whatever its history (nvidia-smi's declared
    ``gpu<N>`` devices; empty for the built-ins); None means it is learned:
    the devices it named on its last success in this process.
    """

    name: str
    ok: bool
    host: Mapping[str, str] = attrs.field(factory=dict)
    device: Mapping[str, Mapping[str, str]] = attrs.field(factory=dict)
    unconfirmed: frozenset[str] = frozenset()
    scope: frozenset[str] | None = None

    @classmethod
    def failed(cls, name: str, scope: frozenset[str] | None = None) -> SourceFacts:
        return cls(name=name, ok=False, scope=scope)


History = Mapping[str, frozenset[str]]


@attrs.frozen
class MergedPass:
    result: ProbeResult
    history: History


# --------------------------------------------------------------------------
# The merger


def merge_sources(
    declared: Mapping[str, Mapping[str, str]],
    sources: Sequence[SourceFacts],
    history: History,
) -> MergedPass:
    """Merge one pass's sources, in order, into a ``ProbeResult`` and the next history.

    ``declared`` maps every declared device, in config order, to its declared
    labels, which override every probe. A later source overrides an earlier
    one on the same key. ``history`` maps a learned-scope source's name to
    the devices it named on its last success; sources that did not run this
    pass keep theirs, so one that comes back broken still unconfirms what it
    last spoke for.
    """
    host: dict[str, str] = {}
    device: dict[str, dict[str, str]] = {name: {} for name in declared}
    unconfirmed: set[str] = set()
    next_history = dict(history)
    for source in sources:
        if not source.ok:
            # A source never seen to work speaks for nothing: its failure
            # must not freeze devices it may never have described, or their
            # labels could never be cleared.
            reach = source.scope if source.scope is not None else history.get(source.name)
            unconfirmed.update(reach or ())
            continue
        host.update(source.host)
        for name, facts in source.device.items():
            if name in device:
                device[name].update(facts)
        unconfirmed.update(source.unconfirmed)
        if source.scope is None:
            spoke = set(source.device) | source.unconfirmed
            next_history[source.name] = frozenset(spoke & declared.keys())
    for name, labels in declared.items():
        device[name].update(labels)
    result = ProbeResult(
        host=host, device=device, unconfirmed=frozenset(unconfirmed & declared.keys())
    )
    return MergedPass(result=result, history=next_history)


def labels_payload(result: ProbeResult) -> dict[str, Any]:
    """The body of ``PUT /v1/hosts/{host}/labels`` (less the session).

    Host facts always; every confirmed device, an empty map included (that
    clears its facts); unconfirmed devices left out, so they keep theirs.
    """
    return {
        "host": dict(result.host),
        "devices": {name: dict(result.device[name]) for name in result.confirmed},
    }


# --------------------------------------------------------------------------
# nvidia-smi


def gpu_scope(device_names: Collection[str]) -> dict[int, str]:
    """The declared devices nvidia-smi can speak for: ``gpu<N>`` by NVML index."""
    scope: dict[int, str] = {}
    for name in device_names:
        m = _GPU_DEVICE_RE.fullmatch(name)
        if m:
            scope[int(m.group(1))] = name
    return scope


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


# --------------------------------------------------------------------------
# Drop-in probes


class _Duplicate(ValueError):
    pass


def _pairs(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise _Duplicate(f"key {key!r} appears twice")
        out[key] = value
    return out


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


def _kind(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, dict):
        return "an object"
    if isinstance(value, list):
        return "an array"
    if isinstance(value, bool):
        return "a boolean"
    return "a string or number"


def parse_dropin_output(
    data: bytes, declared_devices: Collection[str]
) -> tuple[dict[str, str], dict[str, dict[str, str]]]:
    """One drop-in's stdout as ``(host facts, device facts)``.

    It must be ONE JSON object of flat keys to strings, numbers or booleans:
    ``true`` becomes ``"true"`` and a number keeps its JSON text. A bare key
    is host-scoped, ``<device>.<label>`` device-scoped, and that device must
    be declared. Raises ``ValueError`` with a short reason otherwise; the
    caller then uses none of the output.
    """
    if len(data) > DROPIN_STDOUT_CAP:
        raise ValueError(f"output over the {DROPIN_STDOUT_CAP}-byte cap")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        raise ValueError("not JSON: the output is not UTF-8") from None
    if not text.strip():
        raise ValueError("not JSON: the output is empty")
    try:
        # Numbers arrive as their own text, so 1.50 stays "1.50" and a large
        # integer is not rounded through a float.
        obj = json.loads(
            text,
            parse_int=str,
            parse_float=str,
            parse_constant=_no_constant,
            object_pairs_hook=_pairs,
        )
    except _Duplicate as e:
        raise ValueError(f"ambiguous output: {e}") from None
    except RecursionError:
        raise ValueError("not JSON we accept: nested too deep") from None
    except ValueError as e:
        raise ValueError(f"not JSON: {e}") from None
    if not isinstance(obj, dict):
        raise ValueError(f"not a JSON object: got {_kind(obj)}")
    host: dict[str, str] = {}
    device: dict[str, dict[str, str]] = {}
    for key, value in obj.items():
        if isinstance(value, bool):
            text_value = "true" if value else "false"
        elif isinstance(value, str):
            text_value = value
        else:
            raise ValueError(
                f"key {key!r} holds {_kind(value)}; values must be strings, numbers or booleans"
            )
        try:
            dev, label = split_label_key(key)
        except ValueError as e:
            raise ValueError(f"invalid key: {e}") from None
        if dev is None:
            host[label] = text_value
        elif dev not in declared_devices:
            raise ValueError(f"names undeclared device {dev}")
        else:
            device.setdefault(dev, {})[label] = text_value
    return host, device
