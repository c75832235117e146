"""A stand-in for nvidia-smi and lspci in the GPU health tests, driven by a JSON table.

Installed on a test PATH as ``nvidia-smi`` (and ``lspci``) by a two-line
shell wrapper. ``FAKE_GPU_TABLE`` names the table, re-read at every call so
a test can change the GPUs between checks::

    {"gpus": [{"index": 0, "uuid": "GPU-...", "name": "NVIDIA H100",
               "pci.bus_id": "00000000:3B:00.0", "lost": false,
               "fields": {"ecc.errors.uncorrected.volatile.total": "0", ...},
               "migs": [{"index": 0, "uuid": "MIG-...", "profile": "1g.10gb"}]}],
     "apps": [{"gpu_uuid": "GPU-...", "pid": 123, "process_name": "python", "used_memory": 100,
               "live": true}],
     "lspci_extra": 0,
     "hang": ["compute-apps"], "fail": ["query-gpu-health"], "garbage": ["-L"]}

``hang``, ``fail`` and ``garbage`` name the call kinds (``query-gpu``: the
probe's query, ``query-gpu-health``: the health query, ``compute-apps``,
``-L``, ``lspci``) that sleep for a minute, exit 3 with an error, or print
text that is not the listing. Every call is appended to ``FAKE_GPU_LOG``.
Fields left out of a GPU's table read ``[N/A]``, as on a GPU without them.
"""

from __future__ import annotations

import json
import os
import sys
import time


def main(argv: list[str]) -> int:
    with open(os.environ["FAKE_GPU_TABLE"]) as f:
        table = json.load(f)
    # The wrapper passes the name it was installed as: nvidia-smi or lspci.
    tool, args = argv[1], argv[2:]
    if os.environ.get("FAKE_GPU_LOG"):
        with open(os.environ["FAKE_GPU_LOG"], "a") as log:
            log.write(f"{os.getpid()} {tool} {' '.join(args)}\n")
    kind, fields, fmt = _kind(tool, args)
    if kind in table.get("hang", []):
        time.sleep(60)
    if kind in table.get("fail", []):
        print("Failed to initialize NVML: Unknown Error")
        return 3
    if kind in table.get("garbage", []):
        print("this is not what you asked for")
        return 0
    gpus = table.get("gpus", [])
    if kind == "lspci":
        n = len(gpus) + int(table.get("lspci_extra", 0))
        for i in range(n):
            print(f"{i + 1:02x}:00.0 0302: 10de:2330 (rev a1)")
        return 0
    if kind == "-L":
        for g in gpus:
            if g.get("lost"):
                print(
                    f"Unable to determine the device handle for gpu {g['pci.bus_id']}: GPU is lost."
                )
                continue
            print(f"GPU {g['index']}: {g.get('name', 'NVIDIA H100')} (UUID: {g['uuid']})")
            for m in g.get("migs", []):
                print(f"  MIG {m['profile']:<11} Device {m['index']:>2}: (UUID: {m['uuid']})")
        return 0
    if kind == "compute-apps":
        rows = [
            [str(a.get(f if f != "used_gpu_memory" else "used_memory", "[N/A]")) for f in fields]
            for a in table.get("apps", [])
            if not a.get("live") or _alive(int(a["pid"]))
        ]
        _csv(fields, rows, fmt)
        return 0
    rows = []
    rc = 0
    for g in gpus:
        if g.get("lost"):
            print(f"Unable to determine the device handle for GPU{g['pci.bus_id']}: Unknown Error")
            rc = 15
            continue
        values = {
            "index": str(g["index"]),
            "uuid": g["uuid"],
            "name": g.get("name", "NVIDIA H100"),
            "pci.bus_id": g["pci.bus_id"],
            "memory.total": "81559",
            "driver_version": "550.90.07",
            "compute_cap": "9.0",
            "mig.mode.current": "Enabled" if g.get("migs") else "Disabled",
            **g.get("fields", {}),
        }
        rows.append([values.get(f, "[N/A]") for f in fields])
    _csv(fields, rows, fmt)
    return rc


def _alive(pid: int) -> bool:
    """An app marked ``live`` is listed only while its process runs, as nvidia-smi does."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"  # a zombie has released its GPU memory


def _kind(tool: str, args: list[str]) -> tuple[str, list[str], str]:
    if tool == "lspci":
        return "lspci", [], ""
    fmt = next((a.split("=", 1)[1] for a in args if a.startswith("--format=")), "csv")
    for a in args:
        if a.startswith("--query-gpu="):
            fields = a.split("=", 1)[1].split(",")
            kind = (
                "query-gpu-health"
                if "ecc.errors.uncorrected.volatile.total" in fields
                else "query-gpu"
            )
            return kind, fields, fmt
        if a.startswith("--query-compute-apps="):
            return "compute-apps", a.split("=", 1)[1].split(","), fmt
        if a == "-L":
            return "-L", [], fmt
    return "other", [], fmt


def _csv(fields: list[str], rows: list[list[str]], fmt: str) -> None:
    if "noheader" not in fmt:
        print(
            ", ".join(
                f + (" [MiB]" if f in ("used_gpu_memory", "memory.total") else "") for f in fields
            )
        )
    for row in rows:
        print(", ".join(row))


if __name__ == "__main__":
    sys.exit(main(sys.argv))
