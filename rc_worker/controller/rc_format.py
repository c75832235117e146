"""How ``rc`` shows things to people: tables and one-line summaries of the JSON API."""

from __future__ import annotations

import shlex
import time
from collections.abc import Mapping, Sequence
from typing import Any

COMMAND_WIDTH = 48
NOTE_WIDTH = 72
REASON_WIDTH = 60

_ESCAPES = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}


def one_line(text: str) -> str:
    """``text`` with every unprintable character escaped (``\\n``, ``\\x1b``, ``\\u2028``, as
    ``repr`` does), so a table row or an error line stays one line and a controller's text
    cannot move the cursor or change the terminal (C0 and C1 controls, escape sequences)."""
    if text.isprintable():
        return text
    return _escaped(text, keep="")


def text_block(text: str) -> str:
    """``text`` of several lines (a usage sheet) with its line breaks and tabs kept but every
    other unprintable character escaped as by :func:`one_line`."""
    return _escaped(text.replace("\r\n", "\n"), keep="\n\t")


def _escaped(text: str, keep: str) -> str:
    out = []
    for ch in text:
        if ch.isprintable() or ch in keep:
            out.append(ch)
        elif ch in _ESCAPES:
            out.append(_ESCAPES[ch])
        else:
            code = ord(ch)
            if code < 0x100:
                out.append(f"\\x{code:02x}")
            elif code < 0x10000:
                out.append(f"\\u{code:04x}")
            else:
                out.append(f"\\U{code:08x}")
    return "".join(out)


def table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """Columns padded to their widest cell; every cell is escaped (:func:`one_line`), so
    whatever the controller sent, each row is one line."""
    rows = [[one_line(cell) for cell in row] for row in rows]
    widths = [len(h) for h in header]
    for row in rows:
        widths = [max(w, len(cell)) for w, cell in zip(widths, row, strict=True)]
    lines = [header, *rows]
    return "\n".join(
        "  ".join(cell.ljust(w) for cell, w in zip(line, widths, strict=True)).rstrip()
        for line in lines
    )


def _short(text: str, width: int) -> str:
    text = one_line(text)
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


def _note(job: Mapping[str, Any]) -> str:
    """Why a queued job waits; why an ended one ended, when that is not its exit code."""
    return str(job.get("pending_reason") or job.get("reason") or job.get("error") or "-")


def jobs_table(jobs: Sequence[Mapping[str, Any]]) -> str:
    rows = [
        [
            _short(str(j["job_id"]), COMMAND_WIDTH),
            _state(j),
            str(j["attempt"]),
            _placement(j),
            _short(shlex.join(j["spec"]["command"]), COMMAND_WIDTH),
            _short(_note(j), NOTE_WIDTH),
        ]
        for j in jobs
    ]
    return table(["JOB", "STATE", "ATTEMPT", "DEVICE", "COMMAND", "NOTE"], rows)


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
    if job.get("pending_reason"):
        lines.insert(2, ("waiting", str(job["pending_reason"])))
    if job.get("cancel_requested"):
        lines.append(("cancel", str(job["cancel_requested"])))
    if job.get("fault_id"):
        lines.append(("fault", str(job["fault_id"])))
    for a in job.get("attempts", []):
        note = f" ({a['note']})" if a.get("note") else ""
        placed = f"{a['host']}/{a['device']} {a['status']}{note}"
        lines.append((f"attempt {a['attempt']}", placed))
    # Every field escaped here, once: a newline in a command, a selector or an id must not
    # start a line of its own.
    lines = [(one_line(k), one_line(v)) for k, v in lines]
    width = max(len(k) for k, _ in lines)
    return "\n".join(f"{k.ljust(width)}  {v}" for k, v in lines)


def cancel_result(job: Mapping[str, Any]) -> str:
    return one_line(_cancel_result(job))


def _cancel_result(job: Mapping[str, Any]) -> str:
    if job["state"] == "running":
        # The worker hears of it through its cancel watch within about a second, not at
        # its next heartbeat (docs/protocol.md, "the poll as a cancel watch").
        return (
            f"{job['job_id']}: cancel requested; its worker is told at once and stops it "
            "(SIGTERM, then SIGKILL after its grace)"
        )
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


def _fault_reason(device: Mapping[str, Any]) -> str:
    """The first fault's kind and detail (``verify_failed: 10-ecc.sh ...``), not just ``fault``."""
    faults = device.get("faults") or []
    if not faults:
        return str(device.get("reason") or "-")
    first = faults[0]
    kind = str(first.get("kind") or first.get("reason") or "fault")
    detail = str(first.get("detail") or "")
    return f"{kind}: {detail}" if detail else kind


def devices_table(devices: Sequence[Mapping[str, Any]]) -> str:
    rows = []
    for d in devices:
        faults = ",".join(f["fault_id"] for f in d.get("faults", []))
        rows.append(
            [
                _short(str(d["address"]), COMMAND_WIDTH),
                str(d["state"]),
                _short(
                    f"held: {d['held_for_health']}"
                    if d.get("held_for_health") and not d.get("faults")
                    else _fault_reason(d),
                    REASON_WIDTH,
                ),
                _short(faults, COMMAND_WIDTH) or "-",
                fault_action(d.get("faults", [])),
                str(d["idle_behavior"]),
                d.get("job_id") or "-",
                str(d["host_state"]),
            ]
        )
    return table(["DEVICE", "STATE", "REASON", "FAULTS", "ACTION", "IDLE", "JOB", "HOST"], rows)


def sheet(body: Mapping[str, Any]) -> str:
    """The usage sheets as written, their lines kept, but no control character that could
    move the cursor or change the terminal (:func:`text_block`)."""
    host, device = one_line(str(body["host"])), one_line(str(body["device"]))
    parts = []
    if body.get("host_sheet"):
        parts.append(f"# host {host}\n\n{text_block(body['host_sheet'].rstrip())}")
    if body.get("device_sheet"):
        parts.append(f"# device {host}/{device}\n\n{text_block(body['device_sheet'].rstrip())}")
    return "\n\n".join(parts) or f"{host}/{device}: no usage sheet"


def clear_result(body: Mapping[str, Any]) -> str:
    return one_line(_clear_result(body))


def _clear_result(body: Mapping[str, Any]) -> str:
    address = body["device"]["address"]
    if not body["cleared"]:
        return f"{address}: nothing to clear (state {body['device']['state']})"
    return f"{address}: cleared {', '.join(body['cleared'])}; now {body['device']['state']}"


def clear_host_result(body: Mapping[str, Any]) -> str:
    return one_line(_clear_host_result(body))


def _clear_host_result(body: Mapping[str, Any]) -> str:
    cleared = body["cleared"]
    if not cleared:
        return f"{body['host']}: no host-level fault to clear"
    ids = sorted({i for v in cleared.values() for i in v})
    return f"{body['host']}: cleared {', '.join(ids)} on {', '.join(sorted(cleared))}"


def event_line(event: Mapping[str, Any]) -> str:
    skip = {"seq", "type", "time"}
    details = " ".join(
        f"{k}={one_line(str(v))}" for k, v in event.items() if k not in skip and v not in (None, "")
    )
    return one_line(
        f"{event['seq']:>6}  {_when(event.get('time'))}  {event['type']:<18}  {details}"
    )


def pool_summary(body: Mapping[str, Any]) -> str:
    """``rc pool``: counts per state, free devices per class, running attempts."""

    def counts(title: str, values: Mapping[str, int]) -> str:
        return one_line(f"{title:<14}" + "  ".join(f"{k} {v}" for k, v in values.items()))

    lines = [
        counts("hosts", body.get("hosts", {})),
        counts("devices", body.get("devices", {})),
        counts("idle behavior", body.get("idle_behavior", {})),
    ]
    free = body.get("free_by_class", {})
    label = body.get("class_label", "product")
    if free:
        lines.append(one_line(f"free by {label}:"))
        lines += [one_line(f"  {v:>5}  {k or '(no ' + label + ')'}") for k, v in free.items()]
    running = body.get("running", [])
    rows = [
        [
            str(r["job_id"]),
            f"{r.get('host')}/{r.get('device')}",
            str(r.get("state")),
            "-" if r.get("ended_at") is None else _when(r.get("ended_at")),
        ]
        for r in running
    ]
    if rows:
        lines.append(table(["JOB", "DEVICE", "STATE", "ENDED"], rows))
    return "\n".join(lines)


def host_result(action: str, host: str, body: Mapping[str, Any]) -> str:
    return one_line(_host_result(action, host, body))


def _host_result(action: str, host: str, body: Mapping[str, Any]) -> str:
    if action == "retire":
        lost = body.get("jobs_lost") or []
        return f"{host}: retired" + (f"; jobs ended lost: {', '.join(lost)}" if lost else "")
    devices = body.get("devices") or []
    state = "draining: no new work" if action == "drain" else "resumed: taking work"
    return f"{host}: {state} ({len(devices)} device(s))"
