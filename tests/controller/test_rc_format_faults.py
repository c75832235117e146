"""How `rc devices` and `rc clear HOST` show faults' severity and action."""

from __future__ import annotations

from rc_worker.controller.rc_format import clear_host_result, devices_table, fault_action


def _fault(kind: str, severity: str, action: str) -> dict[str, str]:
    return {"fault_id": f"f-{kind}", "kind": kind, "severity": severity, "action": action}


def test_the_most_drastic_action_is_shown_with_the_worst_severity() -> None:
    faults = [
        _fault("gpu_resident_process", "warning", "clear"),
        _fault("gpu_xid", "fatal", "reboot"),
        _fault("gpu_memory", "error", "reset"),
    ]
    assert fault_action(faults) == "reboot (fatal gpu_xid)"
    assert fault_action([]) == "-"


def test_devices_table_has_an_action_column() -> None:
    device = {
        "address": "box1/gpu0",
        "state": "quarantined",
        "reason": "fault",
        "faults": [_fault("gpu_memory", "fatal", "replace")],
        "idle_behavior": "run",
        "job_id": None,
        "host_state": "up",
    }
    header, row = devices_table([device]).splitlines()
    assert "ACTION" in header.split()
    assert "replace (fatal gpu_memory)" in row


def test_clear_host_result_names_what_it_lifted() -> None:
    body = {"host": "box1", "cleared": {"gpu0": ["f-9"], "gpu1": ["f-9"]}}
    assert clear_host_result(body) == "box1: cleared f-9 on gpu0, gpu1"
    assert clear_host_result({"host": "box1", "cleared": {}}) == (
        "box1: no host-level fault to clear"
    )
