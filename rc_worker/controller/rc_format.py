"""How ``rc`` shows things to people: tables and one-line summaries of the JSON API."""

from __future__ import annotations

import shlex
import time
from collections.abc import Mapping, Sequence
from typing import Any

COMMAND_WIDTH = 48


def table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    widths = [len(h) for h in header]
    for row in rows:
        widths = [max(w, len(cell)) for w, cell in zip(widths, row, strict=True)]
    lines = [header, *rows]
    return "\n".join(
        "  ".join(cell.ljust(w) for cell, w in zip(line, widths, strict=True)).rstrip()
        for line in lines
    )


def _short(text: str, width: int) -> str:
    return text if len(text) <= width else text[: width - 1] + "…"


def _placement(job: Mapping[str, Any]) -> str:
    if job.get("host") and job.get("device"):
        return f"{job['host']}/{job['device']}"
    return "-"


def _state(job: Mapping[str, Any]) -> str:
    state = str(job["state"])
    if state == "failed" and job.get("exit_code") is not None:
        return f"failed ({job['exit_code']})"
    if state == "running" and job.get("cancel_requested"):
        return "running (cancelling)"
    return state


def jobs_table(jobs: Sequence[Mapping[str, Any]]) -> str:
    rows = [
        [
            str(j["job_id"]),
            _state(j),
            str(j["attempt"]),
            _placement(j),
            _short(shlex.join(j["spec"]["command"]), COMMAND_WIDTH),
        ]
        for j in jobs
    ]
    return table(["JOB", "STATE", "ATTEMPT", "DEVICE", "COMMAND"], rows)


def _when(ts: object) -> str:
    if not isinstance(ts, int | float):
        return "-"
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(ts))


def job_details(job: Mapping[str, Any]) -> str:
    spec = job["spec"]
    lines = [
        ("job", job["job_id"]),
        ("state", _state(job)),
        ("command", shlex.join(spec["command"])),
        ("select", spec.get("select") or "-"),
        ("pinned to", spec.get("device") or "-"),
        ("attempt", str(job["attempt"])),
        ("device", _placement(job)),
        ("submitted", _when(job.get("submitted_at"))),
        ("started", _when(job.get("started_at"))),
        ("finished", _when(job.get("finished_at"))),
        ("exit code", "-" if job.get("exit_code") is None else str(job["exit_code"])),
        ("reason", job.get("reason") or "-"),
        ("error", job.get("error") or "-"),
        ("output", f"{job.get('committed_bytes', 0)} bytes"),
    ]
    if job.get("cancel_requested"):
        lines.append(("cancel", str(job["cancel_requested"])))
    if job.get("fault_id"):
        lines.append(("fault", str(job["fault_id"])))
    for a in job.get("attempts", []):
        note = f" ({a['note']})" if a.get("note") else ""
        lines.append((f"attempt {a['attempt']}", f"{a['host']}/{a['device']} {a['status']}{note}"))
    width = max(len(k) for k, _ in lines)
    return "\n".join(f"{k.ljust(width)}  {v}" for k, v in lines)


def cancel_result(job: Mapping[str, Any]) -> str:
    if job["state"] == "running":
        return f"{job['job_id']}: cancel requested; the worker stops it at its next heartbeat"
    return f"{job['job_id']}: {_state(job)}" + (f" ({job['reason']})" if job.get("reason") else "")


_SEVERITY_RANK = {"warning": 0, "error": 1, "fatal": 2}
_ACTION_RANK = {"clear": 0, "reset": 1, "reboot": 2, "replace": 3}


def fault_action(faults: Sequence[Mapping[str, Any]]) -> str:
    """The step to take for a device's faults: the most drastic action, with
    the worst severity and the kind it is for (``reboot (fatal gpu_xid)``)."""
    if not faults:
        return "-"
    worst = max(faults, key=lambda f: _ACTION_RANK.get(str(f.get("action")), 0))
    severity = max((str(f.get("severity")) for f in faults), key=lambda s: _SEVERITY_RANK.get(s, 0))
    return f"{worst.get('action') or 'clear'} ({severity} {worst.get('kind') or 'fault'})"


def devices_table(devices: Sequence[Mapping[str, Any]]) -> str:
    rows = []
    for d in devices:
        faults = ",".join(f["fault_id"] for f in d.get("faults", []))
        rows.append(
            [
                str(d["address"]),
                str(d["state"]),
                d.get("reason")
                or (f"held: {d['held_for_health']}" if d.get("held_for_health") else "-"),
                faults or "-",
                fault_action(d.get("faults", [])),
                str(d["idle_behavior"]),
                d.get("job_id") or "-",
                str(d["host_state"]),
            ]
        )
    return table(["DEVICE", "STATE", "REASON", "FAULTS", "ACTION", "IDLE", "JOB", "HOST"], rows)


def sheet(body: Mapping[str, Any]) -> str:
    parts = []
    if body.get("host_sheet"):
        parts.append(f"# host {body['host']}\n\n{body['host_sheet'].rstrip()}")
    if body.get("device_sheet"):
        parts.append(f"# device {body['host']}/{body['device']}\n\n{body['device_sheet'].rstrip()}")
    return "\n\n".join(parts) or f"{body['host']}/{body['device']}: no usage sheet"


def clear_result(body: Mapping[str, Any]) -> str:
    address = body["device"]["address"]
    if not body["cleared"]:
        return f"{address}: nothing to clear (state {body['device']['state']})"
    return f"{address}: cleared {', '.join(body['cleared'])}; now {body['device']['state']}"


def clear_host_result(body: Mapping[str, Any]) -> str:
    cleared = body["cleared"]
    if not cleared:
        return f"{body['host']}: no host-level fault to clear"
    ids = sorted({i for v in cleared.values() for i in v})
    return f"{body['host']}: cleared {', '.join(ids)} on {', '.join(sorted(cleared))}"


def event_line(event: Mapping[str, Any]) -> str:
    skip = {"seq", "type", "time"}
    details = " ".join(
        f"{k}={v}" for k, v in event.items() if k not in skip and v not in (None, "")
    )
    return f"{event['seq']:>6}  {_when(event.get('time'))}  {event['type']:<18}  {details}"
