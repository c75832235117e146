"""The sans-IO probe core: nvidia-smi parsing, drop-in output, the merger, the payload."""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import attrs
import pytest
from hypothesis import assume, example, given
from hypothesis import strategies as st

from rc_worker.core.dropin_output import DROPIN_STDOUT_CAP, parse_dropin_output
from rc_worker.core.gpu_query import (
    NVIDIA_SMI,
    gpu_scope,
    normalize_bus_id,
    nvidia_smi_facts,
    parse_gpu_query,
)
from rc_worker.core.labels import ProbeResult, SourceFacts, labels_payload, merge_sources

FIXTURES = Path(__file__).parent / "fixtures" / "nvidia-smi"
GPUS8 = tuple(f"gpu{n}" for n in range(8))


def fixture(name: str) -> str:
    return (FIXTURES / name).read_text()


def fixture_rc(stem: str) -> int:
    path = FIXTURES / f"{stem}.rc"
    return int(path.read_text()) if path.exists() else 0


H100_GPU0 = {
    "product": "NVIDIA H100 80GB HBM3",
    "uuid": "GPU-5c1a9e3b-7f2d-4e8a-9b61-0d3f2a7c4e15",
    "memory_total_bytes": str(81559 * 2**20),
    "driver_version": "590.48.01",
    "pci_bus_id": "00000000:00:09.0",
    "compute_cap": "9.0",
    "mig_mode": "Disabled",
}


# --------------------------------------------------------------------------
# nvidia-smi fixtures


@pytest.mark.parametrize(
    "name", ["01_healthy_1gpu.noheader.csv", "01b_healthy_1gpu.header_units.csv"]
)
def test_healthy_one_gpu_with_and_without_header(name: str) -> None:
    reading = nvidia_smi_facts(fixture(name), 0, ["gpu0"])
    assert reading.facts.ok
    assert reading.why == ""
    assert reading.facts.device == {"gpu0": H100_GPU0}
    assert reading.facts.unconfirmed == frozenset()
    assert reading.facts.scope == {"gpu0"}


def test_healthy_eight_gpus() -> None:
    reading = nvidia_smi_facts(fixture("02_healthy_8gpu_h100.noheader.csv"), 0, GPUS8)
    assert reading.facts.ok
    assert not reading.facts.unconfirmed
    assert set(reading.facts.device) == set(GPUS8)
    assert reading.facts.device["gpu3"]["pci_bus_id"] == "00000000:5D:00.0"
    assert reading.bus_ids["0000:5D:00.0"] == 3


def test_rows_for_undeclared_gpus_are_ignored() -> None:
    reading = nvidia_smi_facts(
        fixture("02_healthy_8gpu_h100.noheader.csv"), 0, ["gpu0", "gpu1", "nic0", "gpu01"]
    )
    assert set(reading.facts.device) == {"gpu0", "gpu1"}
    assert reading.facts.scope == {"gpu0", "gpu1"}
    assert not reading.facts.unconfirmed


@pytest.mark.parametrize("stem", ["03_driver_not_loaded", "03b_driver_library_mismatch"])
def test_driver_failures_fail_the_whole_source(stem: str) -> None:
    reading = nvidia_smi_facts(fixture(f"{stem}.txt"), fixture_rc(stem), GPUS8)
    assert not reading.facts.ok
    assert reading.facts.scope == set(GPUS8)
    assert reading.why.startswith(f"exit status {fixture_rc(stem)}: ")


def test_lost_gpu_leaves_only_that_device_unconfirmed() -> None:
    rc = fixture_rc("04_gpu_lost_8gpu")
    assert rc != 0
    reading = nvidia_smi_facts(fixture("04_gpu_lost_8gpu.txt"), rc, GPUS8)
    assert reading.facts.ok
    assert reading.facts.unconfirmed == {"gpu3"}
    assert set(reading.facts.device) == set(GPUS8) - {"gpu3"}
    assert "gpu3 not confirmed" in reading.why
    assert "GPU is lost" in reading.why


def test_lost_gpu_with_exit_zero_is_still_unconfirmed() -> None:
    reading = nvidia_smi_facts(fixture("04_gpu_lost_8gpu.txt"), 0, GPUS8)
    assert reading.facts.unconfirmed == {"gpu3"}


def test_lost_line_variants() -> None:
    lost = parse_gpu_query(fixture("04b_gpu_lost_line_variants.txt")).lost
    assert [(e.index, e.bus_id) for e in lost] == [
        # Two unnumbered lines before one that names GPU1: no sound position.
        (None, "0000:05:00.0"),
        (None, "0000:CB:00.0"),
        (1, "0000:34:00.0"),
    ]


def _eight_with(replaced: Mapping[int, str]) -> str:
    lines = fixture("02_healthy_8gpu_h100.noheader.csv").splitlines()
    return "\n".join(replaced.get(i, line) for i, line in enumerate(lines)) + "\n"


VARIANTS = fixture("04b_gpu_lost_line_variants.txt").splitlines()


@pytest.mark.parametrize("variant", VARIANTS[:2])
@pytest.mark.parametrize("position", [0, 4, 7])
def test_unnumbered_lost_line_is_attributed_by_position(variant: str, position: int) -> None:
    reading = nvidia_smi_facts(_eight_with({position: variant}), 15, GPUS8)
    assert reading.facts.unconfirmed == {f"gpu{position}"}


def test_two_lost_lines_in_a_row_are_attributed_by_position() -> None:
    text = _eight_with({2: VARIANTS[0], 3: VARIANTS[1]})
    assert nvidia_smi_facts(text, 15, GPUS8).facts.unconfirmed == {"gpu2", "gpu3"}


def test_unattributable_lost_line_leaves_every_gpu_unconfirmed() -> None:
    lines = fixture("02_healthy_8gpu_h100.noheader.csv").splitlines()
    # Rows 3 and 4 are both missing but only one line stands in their place.
    text = "\n".join([*lines[:3], VARIANTS[0], *lines[5:]])
    reading = nvidia_smi_facts(text, 15, GPUS8)
    assert reading.facts.ok
    assert reading.facts.unconfirmed == set(GPUS8)


def test_lost_line_is_attributed_by_remembered_bus_id() -> None:
    lines = fixture("02_healthy_8gpu_h100.noheader.csv").splitlines()
    lost = "Unable to determine the device handle for GPU 0000:5D:00.0: GPU is lost."
    text = "\n".join([*lines[:3], *lines[4:], lost])  # out of place, at the end
    assert nvidia_smi_facts(text, 15, GPUS8).facts.unconfirmed == set(GPUS8)
    remembered = nvidia_smi_facts(text, 15, GPUS8, known_bus_ids={"0000:5D:00.0": 3})
    assert remembered.facts.unconfirmed == {"gpu3"}


def test_declared_gpu_without_a_row_is_unconfirmed() -> None:
    reading = nvidia_smi_facts(fixture("01_healthy_1gpu.noheader.csv"), 0, ["gpu0", "gpu1"])
    assert reading.facts.unconfirmed == {"gpu1"}
    assert reading.why == "gpu1 not confirmed: no row"


def test_error_cells_are_not_facts_but_the_row_is_confirmed() -> None:
    reading = nvidia_smi_facts(fixture("05_err_values_8gpu.noheader.csv"), 0, GPUS8)
    assert reading.facts.ok
    assert not reading.facts.unconfirmed
    assert "mig_mode" not in reading.facts.device["gpu3"]
    assert reading.facts.device["gpu1"]["mig_mode"] == "Disabled"


def test_error_cells_in_every_queried_column() -> None:
    row = "0, ERR!, [GPU requires reset], [Unknown Error], [N/A], [Not Supported], , N/A, 41, 0\n"
    reading = nvidia_smi_facts(row, 0, ["gpu0"])
    assert reading.facts.device == {"gpu0": {}}
    assert not reading.facts.unconfirmed


def test_row_whose_index_is_an_error_stands_in_its_place() -> None:
    lines = fixture("02_healthy_8gpu_h100.noheader.csv").splitlines()
    lines[5] = "[Unknown Error]" + lines[5][1:]
    assert nvidia_smi_facts("\n".join(lines), 0, GPUS8).facts.unconfirmed == {"gpu5"}


def test_cut_short_last_row_is_unconfirmed() -> None:
    text = fixture("02_healthy_8gpu_h100.noheader.csv")[:-60]
    reading = nvidia_smi_facts(text, 0, GPUS8)
    assert reading.facts.unconfirmed == {"gpu7"}


def test_human_table_is_unparseable() -> None:
    reading = nvidia_smi_facts(fixture("05b_err_table_excerpt.txt"), 0, ["gpu0"])
    assert not reading.facts.ok
    assert reading.why.startswith("unparseable output: ")


def test_only_a_lost_line_fails_the_whole_source() -> None:
    line = "Unable to determine the device handle for GPU0: 0000:05:00.0: GPU is lost.\n"
    reading = nvidia_smi_facts(line, 0, ["gpu0", "gpu1"])
    assert not reading.facts.ok
    assert reading.why.startswith("no GPU answered: Unable to determine")


def test_mig_mode() -> None:
    reading = nvidia_smi_facts(fixture("06_mig_enabled_1gpu.noheader.csv"), 0, ["gpu0"])
    assert reading.facts.device["gpu0"]["mig_mode"] == "Enabled"


def test_empty_output_confirms_nothing() -> None:
    reading = nvidia_smi_facts("", 0, ["gpu0"])
    assert reading.facts.unconfirmed == {"gpu0"}


def test_gpu_scope_and_bus_ids() -> None:
    assert gpu_scope(["gpu0", "gpu12", "gpu01", "gpu", "mig0", "gpu-1"]) == {0: "gpu0", 12: "gpu12"}
    assert normalize_bus_id("00000000:5d:00.0") == "0000:5D:00.0"
    assert normalize_bus_id("[N/A]") is None


@given(st.text())
@example("²")
@example("١, NVIDIA H100, GPU-1, ١٢, 1, 00000000:18:00.0, 9.0, Disabled")
def test_parsing_never_raises(text: str) -> None:
    reading = nvidia_smi_facts(text, 0, GPUS8)
    assert reading.facts.unconfirmed <= set(GPUS8)
    assert set(reading.facts.device) <= set(GPUS8)


_CELL = st.sampled_from(
    ["NVIDIA H100 80GB HBM3", "GPU-0f3c", "81559", "550.90.07", "00000000:18:00.0", "9.0", "x"]
)
_ERROR_CELL = st.sampled_from(["[N/A]", "[Unknown Error]", "[GPU requires reset]", "ERR!"])


@given(
    n=st.integers(1, 8),
    cells=st.lists(st.lists(_CELL | _ERROR_CELL, min_size=7, max_size=7), min_size=8, max_size=8),
    replaced=st.sets(st.integers(0, 7)),
    variant=st.sampled_from(VARIANTS[:2]),
    declared=st.sets(st.integers(0, 9)),
)
def test_listing_in_index_order_confirms_exactly_the_rows_that_answered(
    n: int, cells: list[list[str]], replaced: set[int], variant: str, declared: set[int]
) -> None:
    replaced = {i for i in replaced if i < n}
    assume(len(replaced) < n)
    lines = [variant if i in replaced else ", ".join([str(i), *cells[i]]) for i in range(n)]
    names = [f"gpu{i}" for i in declared]
    reading = nvidia_smi_facts("\n".join(lines), 15 if replaced else 0, names)
    answered = {f"gpu{i}" for i in range(n) if i not in replaced}
    assert reading.facts.ok
    assert reading.facts.unconfirmed == set(names) - answered
    assert set(reading.facts.device) == set(names) & answered
    for facts in reading.facts.device.values():
        # No error cell ever becomes a fact.
        assert not any(v.startswith("[") or v.startswith("ERR!") for v in facts.values())


# --------------------------------------------------------------------------
# drop-in output


DECLARED = ("gpu0", "gpu1")


def test_dropin_output_is_split_by_scope_and_stringified() -> None:
    out = b'{"rack": "r12", "gpu0.ecc": true, "gpu1.ecc": false, "cores": 64, "ratio": 1.50}\n'
    host, device = parse_dropin_output(out, DECLARED)
    assert host == {"rack": "r12", "cores": "64", "ratio": "1.50"}
    assert device == {"gpu0": {"ecc": "true"}, "gpu1": {"ecc": "false"}}


def test_dropin_empty_object_is_fine() -> None:
    assert parse_dropin_output(b"{}", DECLARED) == ({}, {})


@pytest.mark.parametrize(
    ("out", "why"),
    [
        (b"", "not JSON: the output is empty"),
        (b"rack=r12", "not JSON: "),
        (b'{"a": 1} {"b": 2}', "not JSON: "),
        (b'{"a": NaN}', "not JSON: NaN"),
        (b"\xff\xfe", "not JSON: the output is not UTF-8"),
        (b'["a"]', "not a JSON object: got an array"),
        (b'"a"', "not a JSON object"),
        (b'{"a": {"b": 1}}', "key 'a' holds an object"),
        (b'{"a": [1]}', "key 'a' holds an array"),
        (b'{"a": null}', "key 'a' holds null"),
        (b'{"a b": "1"}', "invalid key: "),
        (b'{"gpu0.a.b": "1"}', "invalid key: "),
        (b'{"GPU0.a": "1"}', "invalid key: "),
        (b'{"gpu9.a": "1"}', "names undeclared device gpu9"),
        (b'{"gpu0.uuid": "GPU-\\u0000bad"}', "key 'gpu0.uuid' holds a NUL byte"),
        (b'{"rack": "\\u0000"}', "key 'rack' holds a NUL byte"),
        (b'{"a": "1", "a": "2"}', "ambiguous output: key 'a' appears twice"),
        (b"{" + b" " * DROPIN_STDOUT_CAP + b"}", "output over the 65536-byte cap"),
    ],
)
def test_dropin_output_failures(out: bytes, why: str) -> None:
    with pytest.raises(ValueError, match="^" + __import__("re").escape(why)):
        parse_dropin_output(out, DECLARED)


_LABEL = st.from_regex(r"[a-z_][a-z0-9_-]{0,8}", fullmatch=True)
_VALUE = (
    st.text(max_size=10)
    | st.booleans()
    | st.integers()
    | st.floats(allow_nan=False, allow_infinity=False)
)


@given(
    st.dictionaries(
        st.tuples(st.sampled_from([None, *DECLARED]), _LABEL).map(
            lambda t: t[1] if t[0] is None else f"{t[0]}.{t[1]}"
        ),
        _VALUE,
    )
)
@example({"gpu0.uuid": "GPU-\0bad"})
def test_dropin_round_trip(obj: dict[str, Any]) -> None:
    """Every value comes back as its text, unless a string holds a NUL byte (no label
    value can: a uuid becomes CUDA_VISIBLE_DEVICES): then the whole output is refused."""
    nul = [k for k, v in obj.items() if isinstance(v, str) and "\0" in v]
    if nul:
        with pytest.raises(ValueError, match=r"^key .* holds a NUL byte") as caught:
            parse_dropin_output(json.dumps(obj).encode(), DECLARED)
        assert repr(nul[0]) in str(caught.value)  # the first offending key, named
        return
    host, device = parse_dropin_output(json.dumps(obj).encode(), DECLARED)
    flat = dict(host)
    for dev, facts in device.items():
        flat.update({f"{dev}.{k}": v for k, v in facts.items()})
    expected = {
        k: v
        if isinstance(v, str)
        else ("true" if v is True else "false" if v is False else json.dumps(v))
        for k, v in obj.items()
    }
    assert flat == expected


# --------------------------------------------------------------------------
# the merger

DEVICES = ("gpu0", "gpu1", "gpu2", "nic0")
_NAMES = st.sampled_from([f"probe.d/{i}" for i in range(6)])
_FACTS = st.dictionaries(
    st.sampled_from(["a", "b", "c"]), st.sampled_from(["1", "2", "3"]), max_size=2
)
_DEVSET = st.frozensets(st.sampled_from(DEVICES))


@st.composite
def _source(draw: st.DrawFn, name: str) -> SourceFacts:
    ok = draw(st.booleans())
    scope = draw(st.none() | _DEVSET)
    return SourceFacts(
        name=name,
        ok=ok,
        host=draw(_FACTS),
        device=draw(st.dictionaries(st.sampled_from(DEVICES), _FACTS, max_size=3)),
        unconfirmed=draw(_DEVSET) if ok and draw(st.booleans()) else frozenset(),
        scope=scope,
    )


@st.composite
def _pass(
    draw: st.DrawFn,
) -> tuple[dict[str, dict[str, str]], list[SourceFacts], dict[str, frozenset[str]]]:
    devices = draw(st.lists(st.sampled_from(DEVICES), unique=True))
    declared = {
        d: draw(st.dictionaries(st.sampled_from(["a", "x"]), st.just("decl"))) for d in devices
    }
    names = draw(st.lists(_NAMES, unique=True, max_size=4))
    sources = [draw(_source(n)) for n in names]
    history = draw(st.dictionaries(_NAMES, _DEVSET))
    return declared, sources, history


def _reach(s: SourceFacts, history: Mapping[str, frozenset[str]]) -> frozenset[str]:
    return s.scope if s.scope is not None else history.get(s.name, frozenset())


Pass = tuple[dict[str, dict[str, str]], list[SourceFacts], dict[str, frozenset[str]]]


@given(_pass())
def test_every_declared_device_is_exactly_one_of_confirmed_or_unconfirmed(p: Pass) -> None:
    declared, sources, history = p
    result = merge_sources(declared, sources, history).result
    assert list(result.device) == list(declared)
    assert result.unconfirmed <= set(declared)
    assert set(result.confirmed) | result.unconfirmed == set(declared)
    assert not set(result.confirmed) & result.unconfirmed


@given(_pass())
def test_host_facts_from_a_successful_source_are_always_used(p: Pass) -> None:
    declared, sources, history = p
    result = merge_sources(declared, sources, history).result
    for i, s in enumerate(sources):
        if not s.ok:
            continue
        for key, value in s.host.items():
            later = [t for t in sources[i + 1 :] if t.ok and key in t.host]
            assert result.host[key] == (later[-1].host[key] if later else value)
    assert set(result.host) == {k for s in sources if s.ok for k in s.host}
    # Whatever every other source did, this one's host facts are there.
    for s in sources:
        if s.ok:
            others_failed = [t if t is s else attrs.evolve(t, ok=False) for t in sources]
            merged = merge_sources(declared, others_failed, history).result
            assert merged.host == s.host


@given(_pass())
def test_a_failed_source_unconfirms_only_the_devices_it_last_spoke_for(p: Pass) -> None:
    declared, sources, history = p
    result = merge_sources(declared, sources, history).result
    blamed = set()
    for s in sources:
        blamed |= s.unconfirmed if s.ok else _reach(s, history)
    assert result.unconfirmed == blamed & set(declared)


@given(_pass(), st.sampled_from(["probe.d/new", "probe.d/other"]))
def test_a_source_that_never_succeeded_unconfirms_nothing(p: Pass, name: str) -> None:
    declared, sources, history = p
    history.pop(name, None)
    before = merge_sources(declared, sources, history)
    after = merge_sources(declared, [*sources, SourceFacts.failed(name)], history)
    assert after.result == before.result
    assert name not in after.history


@given(_pass())
def test_a_device_whose_every_speaking_source_succeeded_is_confirmed(p: Pass) -> None:
    declared, sources, history = p
    result = merge_sources(declared, sources, history).result
    for d in declared:
        failed_for_d = any(
            (not s.ok and d in _reach(s, history)) or (s.ok and d in s.unconfirmed) for s in sources
        )
        if not failed_for_d:
            assert d in result.confirmed
            assert d in labels_payload(result)["devices"]


@given(_pass())
def test_declared_labels_override_and_later_sources_override_earlier(p: Pass) -> None:
    declared, sources, history = p
    result = merge_sources(declared, sources, history).result
    for d, labels in declared.items():
        expected: dict[str, str] = {}
        for s in sources:
            if s.ok:
                expected.update(s.device.get(d, {}))
        expected.update(labels)
        assert result.device[d] == expected


@given(_pass())
def test_history_is_what_each_source_named_on_its_last_success(p: Pass) -> None:
    declared, sources, history = p
    nxt = merge_sources(declared, sources, history).history
    ran = {s.name: s for s in sources}
    for name in set(history) | set(nxt):
        s = ran.get(name)
        if s is not None and s.ok and s.scope is None:
            assert nxt[name] == (set(s.device) | s.unconfirmed) & set(declared)
        else:
            assert nxt.get(name) == history.get(name)


@given(_pass())
def test_payload_has_host_facts_and_exactly_the_confirmed_devices(p: Pass) -> None:
    declared, sources, history = p
    result = merge_sources(declared, sources, history).result
    payload = labels_payload(result)
    assert payload["host"] == result.host
    assert set(payload["devices"]) == set(declared) - result.unconfirmed
    for d, facts in payload["devices"].items():
        assert facts == result.device[d]
    json.dumps(payload)


@given(st.lists(st.tuples(st.booleans(), _DEVSET), min_size=1, max_size=8))
def test_a_drop_in_across_passes_unconfirms_what_it_named_when_it_last_worked(
    runs: list[tuple[bool, frozenset[str]]],
) -> None:
    declared: dict[str, dict[str, str]] = {d: {} for d in DEVICES}
    history: Mapping[str, frozenset[str]] = {}
    last_named: frozenset[str] = frozenset()
    for ok, named in runs:
        source = (
            SourceFacts(name="probe.d/x", ok=True, device={d: {"k": "v"} for d in named})
            if ok
            else SourceFacts.failed("probe.d/x")
        )
        merged = merge_sources(declared, [source], history)
        assert merged.result.unconfirmed == (frozenset() if ok else last_named)
        if ok:
            last_named = named
        history = merged.history


def test_named_gpu0_then_broke_leaves_only_gpu0_unconfirmed() -> None:
    declared: dict[str, dict[str, str]] = {"gpu0": {}, "gpu1": {"rack": "r1"}}
    first = merge_sources(
        declared,
        [
            SourceFacts(name="builtin", ok=True, host={"disk_free_bytes": "72"}, scope=frozenset()),
            SourceFacts(name="probe.d/10-ecc", ok=True, device={"gpu0": {"ecc": "on"}}),
        ],
        {},
    )
    assert labels_payload(first.result) == {
        "host": {"disk_free_bytes": "72"},
        "devices": {"gpu0": {"ecc": "on"}, "gpu1": {"rack": "r1"}},
    }
    second = merge_sources(
        declared,
        [
            SourceFacts(name="builtin", ok=True, host={"disk_free_bytes": "3"}, scope=frozenset()),
            SourceFacts.failed("probe.d/10-ecc"),
        ],
        first.history,
    )
    assert second.result.unconfirmed == {"gpu0"}
    assert labels_payload(second.result) == {
        "host": {"disk_free_bytes": "3"},
        "devices": {"gpu1": {"rack": "r1"}},
    }


def test_nvidia_smi_failure_unconfirms_its_static_scope_without_history() -> None:
    declared: dict[str, dict[str, str]] = {"gpu0": {}, "gpu1": {}, "nic0": {}}
    smi = SourceFacts.failed(NVIDIA_SMI, frozenset({"gpu0", "gpu1"}))
    result = merge_sources(declared, [smi], {}).result
    assert result.unconfirmed == {"gpu0", "gpu1"}
    assert labels_payload(result)["devices"] == {"nic0": {}}


def test_probe_result_defaults_are_never_none() -> None:
    result = ProbeResult()
    assert result.host == {}
    assert result.device == {}
    assert result.unconfirmed == frozenset()
    assert labels_payload(result) == {"host": {}, "devices": {}}
