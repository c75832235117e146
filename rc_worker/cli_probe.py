"""``rc-worker probe``: run one probe pass and show what it would send.

For an operator writing a drop-in, or wondering why a device's labels did
not change. It exits 0 even when a source failed: the pass itself ran, and
the table (or ``sources`` in ``--json``) says what failed and why. Exit 2 is
for a config that cannot be loaded; 130 for an interrupt.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import trio

from rc_worker.config_load import load_config
from rc_worker.core.errors import ConfigError
from rc_worker.core.gpu_query import NVIDIA_SMI
from rc_worker.core.labels import labels_payload
from rc_worker.probe import ProbePass, Prober

if TYPE_CHECKING:
    Subparsers = argparse._SubParsersAction[argparse.ArgumentParser]


def configure(subparsers: Subparsers) -> None:
    """Add the ``probe`` subcommand to ``rc-worker``'s subparsers."""
    probe = subparsers.add_parser(
        "probe",
        help="run one probe pass and print the labels it would send",
        description="Run one probe pass (built-in facts, nvidia-smi, the drop-ins of "
        "probe_dir) and print what it found. Exits 0 even when a probe failed; "
        "the output says which and why.",
    )
    probe.add_argument(
        "--config",
        dest="path",
        help="config file (default: $RC_WORKER_CONFIG or /etc/rc/worker.yaml)",
    )
    probe.add_argument(
        "--json",
        action="store_true",
        help="print host, devices, unconfirmed, sources and the label payload as JSON",
    )
    probe.set_defaults(func=run_probe)


def run_probe(args: argparse.Namespace) -> int:
    try:
        config = load_config(args.path, need_token=False)
    except ConfigError as e:
        print(f"rc-worker: {e}", file=sys.stderr)
        return 2
    interrupted = False
    probe_pass: ProbePass | None = None
    try:
        probe_pass = trio.run(Prober(config).gather)
    except* KeyboardInterrupt:
        interrupted = True
    if interrupted or probe_pass is None:
        print("rc-worker: probe interrupted", file=sys.stderr)
        return 130
    if args.json:
        text = json.dumps(probe_pass_json(probe_pass), indent=2)
    else:
        text = probe_pass_table(probe_pass, host=config.host)
    # A reader that closes the pipe early (`| head`) is handled in cli.main.
    print(text, flush=True)
    return 0


def probe_pass_json(probe_pass: ProbePass) -> dict[str, Any]:
    result = probe_pass.result
    return {
        "host": dict(result.host),
        "devices": {name: dict(facts) for name, facts in result.device.items()},
        "unconfirmed": [name for name in result.device if name in result.unconfirmed],
        "sources": [
            {"name": s.name, "ok": s.ok, "why": s.why, "seconds": round(s.seconds, 3)}
            for s in probe_pass.sources
        ],
        "payload": labels_payload(result),
    }


def probe_pass_table(probe_pass: ProbePass, *, host: str) -> str:
    result = probe_pass.result
    lines = [f"host {host}"]
    lines += _facts(result.host)
    for name, facts in result.device.items():
        if name in result.unconfirmed:
            state = "UNCONFIRMED: not sent, the controller keeps its previous labels"
        else:
            state = "confirmed" if facts else "confirmed, no labels: sent as {}, which clears them"
        lines.append(f"device {name}  ({state})")
        lines += _facts(facts)
    lines.append("sources")
    width = max((len(s.name) for s in probe_pass.sources), default=0)
    for s in probe_pass.sources:
        mark = "ok  " if s.ok else "FAIL"
        why = f"  {s.why}" if s.why else ""
        lines.append(f"  {mark}  {s.name:<{width}}  {s.seconds:6.2f}s{why}")
    if not any(s.name == NVIDIA_SMI for s in probe_pass.sources):
        why = "not on PATH" if probe_pass.nvidia_smi is None else "no gpu<N> device declared"
        lines.append(f"  (nvidia-smi not run: {why})")
    return "\n".join(lines)


def _facts(facts: Mapping[str, str]) -> list[str]:
    if not facts:
        return []
    width = max(len(k) for k in facts)
    return [f"  {key:<{width}}  {facts[key]}" for key in sorted(facts)]
