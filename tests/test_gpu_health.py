"""GPU health parsing and decisions (sans-IO), against real captures in tests/fixtures."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from rc_worker.core.gpu_health import (
    DEFAULT_IGNORED_XIDS,
    KIND_MEMORY,
    KIND_MISSING,
    KIND_RESIDENT,
    KIND_XID,
    ComputeApp,
    GpuHealthRow,
    HealthReadError,
    MemoryState,
    _count,
    _csv_table,
    _flag,
    apps_on,
    bus_key,
    count_lspci_gpus,
    decide_memory,
    decide_pci,
    decide_presence,
    decide_resident,
    decide_xid,
    health_label,
    parse_compute_apps,
    parse_gpu_list,
    parse_health_query,
    parse_xid,
    resolve_mig_uuid,
)

FIXTURES = Path(__file__).parent / "fixtures"
SMI = FIXTURES / "nvidia-smi"
KMSG = FIXTURES / "kmsg"
MASKED = "GPU-00000000-0000-0000-0000-000000000000"


def smi(name: str) -> str:
    return (SMI / name).read_text()


# -- the health query -----------------------------------------------------------


def test_h100_capture_reads_zero_ecc_and_no_pending_remap() -> None:
    reading = parse_health_query(smi("10_query_gpu_full_h100.csv"))
    row = reading.rows[0]
    assert row.uuid == MASKED
    assert row.bus_id == "0000:00:09"
    assert (row.ecc_corrected, row.ecc_uncorrected) == (0, 0)
    # Hopper: page retirement is not supported, row remapping is.
    assert (row.retired_sbe, row.retired_dbe, row.retired_pending) == (None, None, None)
    assert (row.remap_pending, row.remap_failure) == (False, False)
    faults, _ = decide_memory(None, row)
    assert faults == []


def test_mig_and_geforce_captures_read_not_supported_not_zero() -> None:
    mig = parse_health_query(smi("10b_query_gpu_full_h200_mig.csv")).rows[0]
    assert mig.remap_pending is None
    assert mig.ecc_uncorrected == 0
    geforce = parse_health_query(smi("10c_query_gpu_full_rtx4080.csv")).rows[0]
    assert geforce.ecc_uncorrected is None
    assert geforce.remap_failure is None
    assert decide_memory(None, geforce)[0] == []


def _with_cell(name: str, column: str, value: str) -> str:
    """The real capture with one cell changed (no public CSV with it set was found)."""
    header, row = smi(name).splitlines()
    names = [c.strip() for c in header.split(",")]
    cells = [c.strip() for c in row.split(",")]
    cells[names.index(column)] = value
    return header + "\n" + ", ".join(cells) + "\n"


def test_pending_remap_needs_a_reset_and_a_failed_one_a_new_card() -> None:
    pending = parse_health_query(
        _with_cell("10_query_gpu_full_h100.csv", "remapped_rows.pending", "Yes")
    )
    (fault,), _ = decide_memory(None, pending.rows[0])
    assert (fault.kind, fault.severity, fault.action) == (KIND_MEMORY, "error", "reset")
    failed = parse_health_query(
        _with_cell("10_query_gpu_full_h100.csv", "remapped_rows.failure", "Yes")
    )
    (fault,), _ = decide_memory(None, failed.rows[0])
    assert (fault.severity, fault.action) == ("fatal", "replace")
    assert "row remapping failed" in fault.reason


def test_uncorrectable_growth_faults_and_repeated_growth_means_replace() -> None:
    row = parse_health_query(smi("10_query_gpu_full_h100.csv")).rows[0]
    faults, state = decide_memory(None, row)
    assert faults == []  # the first check is a baseline
    grown = GpuHealthRow(index=0, uuid="u", bus_id=None, ecc_uncorrected=2)
    faults, state = decide_memory(state, grown)
    assert [(f.kind, f.action) for f in faults] == [(KIND_MEMORY, "reset")]
    assert "grew by 2 to 2" in faults[0].reason
    same, state = decide_memory(state, grown)
    assert same == []  # no growth, no new fault
    again = GpuHealthRow(index=0, uuid="u", bus_id=None, ecc_uncorrected=3)
    faults, _ = decide_memory(state, again)
    assert [(f.severity, f.action) for f in faults] == [("fatal", "replace")]


def test_retired_pages_pending_and_growth() -> None:
    row = GpuHealthRow(index=0, uuid="u", bus_id=None, retired_dbe=1, retired_pending=True)
    faults, _state = decide_memory(MemoryState(retired_dbe=0), row)
    assert {f.kind for f in faults} == {KIND_MEMORY}
    assert len(faults) == 2
    assert any("pending" in f.reason for f in faults)


@given(
    prev=st.none() | st.integers(0, 1000),
    now=st.none() | st.integers(0, 1000),
)
def test_ecc_faults_only_on_growth(prev: int | None, now: int | None) -> None:
    state = MemoryState(ecc_uncorrected=prev)
    row = GpuHealthRow(index=0, uuid="u", bus_id=None, ecc_uncorrected=now)
    faults, after = decide_memory(state, row)
    grew = prev is not None and now is not None and now > prev
    assert bool(faults) == grew
    assert after.ecc_uncorrected == now


@pytest.mark.parametrize(
    "text",
    [
        "",
        "this is not what you asked for\n",
        "index, uuid\n0\n",  # a short row
        "index, uuid, ecc.errors.uncorrected.volatile.total\n0, GPU-x, lots\n",
        "index, uuid, remapped_rows.pending\n0, GPU-x, Maybe\n",
        "index, name\n0, H100\n",  # no uuid column
    ],
)
def test_unreadable_health_output_never_passes(text: str) -> None:
    with pytest.raises(HealthReadError):
        parse_health_query(text)


# -- presence, PCI --------------------------------------------------------------


def test_a_lost_gpu_is_missing_and_a_swapped_one_is_too() -> None:
    text = (
        "index, uuid, pci.bus_id\n0, GPU-a, 00000000:18:00.0\n"
        "Unable to determine the device handle for GPU0000:2A:00.0: Unknown Error\n"
    )
    reading = parse_health_query(text)
    assert decide_presence(0, "GPU-a", reading) is None
    gone = decide_presence(1, "GPU-b", reading)
    assert gone is not None
    assert gone.kind == KIND_MISSING
    assert (gone.severity, gone.action) == ("fatal", "reboot")
    assert "Unable to determine" in gone.reason
    swapped = decide_presence(0, "GPU-old", reading)
    assert swapped is not None
    assert "was GPU-old" in swapped.reason
    lost_lines = [ln for ln in smi("04_gpu_lost_8gpu.txt").splitlines() if "Unable" in ln]
    only_lost = parse_health_query("\n".join(lost_lines))
    assert only_lost.lost
    assert not only_lost.rows
    assert decide_presence(0, None, only_lost) is not None


def test_lspci_counts_gpus_not_switches_or_audio() -> None:
    text = (
        "18:00.0 0302: 10de:2330 (rev a1)\n"
        "2a:00.0 0302: 10de:2330 (rev a1)\n"
        "05:00.0 0680: 10de:22a3 (rev a1)\n"
        "01:00.1 0403: 10de:22bb (rev a1)\n"
        "01:00.0 0300: 10de:2704 (rev a1)\n"
    )
    assert count_lspci_gpus(text) == 3
    fault = decide_pci(3, 2)
    assert fault is not None
    assert fault.host_level
    assert fault.kind == KIND_MISSING
    assert fault.body()["scope"] == "host"
    assert decide_pci(2, 2) is None


# -- compute apps -----------------------------------------------------------------


def test_compute_apps_capture_names_pid_process_and_memory() -> None:
    apps = parse_compute_apps(smi("09_compute_apps_load_h100.csv"))
    assert [(a.pid, a.name, a.used_mib) for a in apps] == [
        (11327, "/root/tools/memhog", 2566),
        (11328, "/root/tools/memhog", 1542),
        (11345, "./gpu_burn", 15690),
    ]
    fault = decide_resident(apps_on(apps, {MASKED}))
    assert fault is not None
    assert fault.kind == KIND_RESIDENT
    assert "pid 11345 (./gpu_burn, 15690 MiB)" in fault.reason
    assert (fault.severity, fault.action) == ("warning", "clear")
    assert apps_on(apps, {"GPU-other"}) == []


def test_idle_compute_apps_is_the_header_alone() -> None:
    assert parse_compute_apps(smi("09c_compute_apps_idle_h200_mig.csv")) == []
    assert decide_resident([]) is None


def test_mig_capture_lists_slice_processes_under_the_parent_uuid() -> None:
    apps = parse_compute_apps(smi("09b_compute_apps_load_h200_mig.csv"))
    assert {a.gpu_uuid for a in apps} == {MASKED}


@pytest.mark.parametrize(
    "text", ["", "Failed to initialize NVML: Unknown Error\n", "gpu_uuid, pid\nGPU-x, many\n"]
)
def test_unreadable_compute_apps_never_read_as_idle(text: str) -> None:
    with pytest.raises(HealthReadError):
        parse_compute_apps(text)


def test_compute_apps_without_units_parse_alike() -> None:
    text = "gpu_uuid, pid, process_name, used_gpu_memory [MiB]\nGPU-x, 7, python, 12\n"
    assert parse_compute_apps(text) == [ComputeApp("GPU-x", 7, "python", 12)]


# -- nvidia-smi -L ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "gpus", "slices"),
    [
        ("11_list_mig_h200_masked.txt", 1, 5),
        ("11b_list_mig_a100.txt", 1, 7),
        ("11c_list_mig_mixed_a100.txt", 4, 4),
    ],
)
def test_gpu_list_with_mig(name: str, gpus: int, slices: int) -> None:
    listing = parse_gpu_list(smi(name))
    assert len(listing) == gpus
    assert sum(len(g.slices) for g in listing) == slices


def test_mig_index_resolves_to_its_uuid() -> None:
    listing = parse_gpu_list(smi("11b_list_mig_a100.txt"))
    assert resolve_mig_uuid(listing, 0, 6) == "MIG-1aae4990-b962-574e-8375-119d6d9b9687"
    assert resolve_mig_uuid(listing, 0, 7) is None
    assert resolve_mig_uuid(listing, 1, 0) is None
    with pytest.raises(HealthReadError):
        parse_gpu_list("No devices were found\n")


# -- Xid ----------------------------------------------------------------------------


def test_every_xid_fixture_line_parses_whatever_its_prefix() -> None:
    events = [
        e
        for f in sorted(KMSG.iterdir())
        for line in f.read_text().splitlines()
        if (e := parse_xid(line)) is not None
    ]
    codes = sorted({e.code for e in events})
    assert codes == [13, 31, 32, 45, 48, 62, 63, 79, 94, 109, 145, 149, 154, 171]
    kmsg_record = "4,1234,5678901,-;NVRM: Xid (PCI:0000:3b:00): 79, GPU has fallen off the bus."
    event = parse_xid(kmsg_record)
    assert event is not None
    assert event.bus == "0000:3B:00"
    assert event.code == 79
    assert event.text.startswith("NVRM: Xid")


def test_a_double_bit_error_chain_needs_a_reset_on_the_gpu_nvidia_smi_names() -> None:
    # A real DBE incident: Xid 48 and 171 (the error), 63 (a row marked for
    # remapping) and 154 (recovery action "Drain and Reset").
    lines = (KMSG / "12h_xid_48_171_63_154_dbe.txt").read_text().splitlines()
    events = [e for line in lines if (e := parse_xid(line)) is not None]
    assert [e.code for e in events] == [48, 171, 48, 63, 154]
    # The kernel's PCI:0000:55:00 is nvidia-smi's 00000000:55:00.0.
    assert {e.bus for e in events} == {bus_key("00000000:55:00.0")}
    ignored = frozenset(DEFAULT_IGNORED_XIDS)
    faults = [decide_xid(e, ignored) for e in events]
    assert all(f is not None and f.kind == KIND_XID for f in faults)
    # "Drain and Reset" is still a reset, not something to clear by hand.
    assert [(f.severity, f.action) for f in faults if f is not None] == [("error", "reset")] * 5


def test_only_the_new_recovery_action_counts() -> None:
    ignored = frozenset(DEFAULT_IGNORED_XIDS)
    prefix = "NVRM: Xid (PCI:0000:55:00): 154, GPU recovery action changed from "
    cases = {
        "0x2 (Node Reboot Required) to 0x0 (None)": ("warning", "clear"),
        "0x0 (None) to 0x2 (Node Reboot Required)": ("fatal", "reboot"),
        "0x0 (None) to 0x1 (GPU Reset Required)": ("error", "reset"),
        "0x0 (None) to 0x3 (Drain P2P)": ("warning", "clear"),
    }
    for change, expected in cases.items():
        event = parse_xid(prefix + change)
        assert event is not None
        fault = decide_xid(event, ignored)
        assert fault is not None
        assert (fault.severity, fault.action) == expected, change


def test_query_remapped_rows_capture_reads_as_counts_and_flags() -> None:
    # Real `--query-remapped-rows` output after a reset: the remap is no longer
    # pending, and its uncorrectable count stays. Its cells are the same
    # Yes/No and counts as the `remapped_rows.*` fields of --query-gpu.
    table = _csv_table(
        smi("13_query_remapped_rows_after_reset.csv"),
        ["gpu_uuid", "remapped_rows.uncorrectable", "remapped_rows.pending"],
        "remapped rows",
    )
    assert [_count(r["remapped_rows.uncorrectable"]) for r in table] == [0, 1, 0, 0]
    assert {_flag(r["remapped_rows.pending"]) for r in table} == {False}
    assert {_flag(r["remapped_rows.failure"]) for r in table} == {False}
    row = GpuHealthRow(
        index=1,
        uuid=MASKED,
        bus_id="00000000:55:00.0",
        remap_uncorrectable=_count(table[1]["remapped_rows.uncorrectable"]),
        remap_pending=_flag(table[1]["remapped_rows.pending"]),
        remap_failure=_flag(table[1]["remapped_rows.failure"]),
    )
    faults, _ = decide_memory(None, row)
    assert faults == []


def test_fallen_off_the_bus_without_xid_is_not_an_xid() -> None:
    lines = (KMSG / "12e_fallen_off_bus_no_xid.txt").read_text().splitlines()
    assert [parse_xid(line) for line in lines] == [None] * len(lines)


def test_ignored_xids_do_not_fault_and_79_needs_a_reboot() -> None:
    ignored = frozenset(DEFAULT_IGNORED_XIDS)
    for line in (KMSG / "12_xid_dmesg_ctime.txt").read_text().splitlines():
        event = parse_xid(line)
        if event is not None:
            assert decide_xid(event, ignored) is None  # 13 and 109
    event = parse_xid((KMSG / "12g_xid_79_fragment.txt").read_text())
    assert event is not None
    fault = decide_xid(event, ignored)
    assert fault is not None
    assert fault.kind == KIND_XID
    assert (fault.severity, fault.action) == ("fatal", "reboot")
    assert "fallen off the bus" in fault.reason
    reset = parse_xid((KMSG / "12f_xid_62_154_gsp.txt").read_text().splitlines()[2])
    assert reset is not None
    assert reset.code == 154
    fault = decide_xid(reset, ignored)
    assert fault is not None
    assert fault.action == "reset"
    assert decide_xid(reset, {154}) is None


# -- bus ids --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("spelling", "key"),
    [
        ("0000:3b:00", "0000:3B:00"),  # the kernel's Xid line
        ("00000000:3B:00.0", "0000:3B:00"),  # nvidia-smi
        ("0000:3b:00.0", "0000:3B:00"),  # lspci -D
        ("PCI:0000:3b:00", "0000:3B:00"),
        ("0019:01:00", "0019:01:00"),  # a non-zero domain (Grace Hopper)
        ("3b:00.0", None),
        ("", None),
    ],
)
def test_bus_id_spellings_meet(spelling: str, key: str | None) -> None:
    assert bus_key(spelling) == key


@given(
    domain=st.integers(0, 0xFFFF),
    bus=st.integers(0, 0xFF),
    dev=st.integers(0, 0x1F),
    fn=st.integers(0, 7),
)
def test_kernel_and_nvidia_smi_spellings_always_agree(
    domain: int, bus: int, dev: int, fn: int
) -> None:
    kernel = f"{domain:04x}:{bus:02x}:{dev:02x}"
    smi_style = f"{domain:08X}:{bus:02X}:{dev:02X}.{fn}"
    assert bus_key(kernel) == bus_key(smi_style) is not None
    line = f"[  1.0] NVRM: Xid (PCI:{kernel}): 48, An uncorrectable double bit error"
    event = parse_xid(line)
    assert event is not None
    assert event.bus == bus_key(smi_style)


def test_health_label_ranks_faulted_over_held_over_ok() -> None:
    assert health_label(False, False) == "ok"
    assert health_label(True, False) == "held"
    assert health_label(True, True) == "faulted"


# -- error cells are not "not supported" (from a review) -----------------------------------

HEADER = (
    "index, uuid, pci.bus_id, ecc.errors.corrected.volatile.total, "
    "ecc.errors.uncorrected.volatile.total"
)


@pytest.mark.parametrize("cell", ["[GPU requires reset]", "[Unknown Error]", "ERR!"])
def test_an_error_cell_is_an_unreadable_reading_never_a_healthy_one(cell: str) -> None:
    text = f"{HEADER}\n0, GPU-a, 00000000:18:00.0, 0, {cell}\n"
    with pytest.raises(HealthReadError):
        parse_health_query(text)


def test_a_not_supported_cell_is_none() -> None:
    for cell in ("[N/A]", "N/A", "[Not Supported]"):
        row = parse_health_query(f"{HEADER}\n0, GPU-a, 00000000:18:00.0, 0, {cell}\n").rows[0]
        assert row.ecc_uncorrected is None
        assert row.ecc_corrected == 0


def test_a_field_past_the_csv_limit_is_an_unreadable_reading_not_an_exception() -> None:
    with pytest.raises(HealthReadError):
        parse_health_query(f'{HEADER}\n0, GPU-a, "{"x" * 200_000}", 0, 0\n')
