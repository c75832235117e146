"""``rc-worker demo``: the whole system on one box, one sample job, then exit.

Runs the reference controller in-process, a worker on the embedded default
config (``rc_worker/data/embedded.yaml``) with its state in a temporary
directory, submits a sample job, streams its output as the controller
commits it, prints the outcome, and drains the worker.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from importlib import resources
from pathlib import Path

import attrs
import trio

from rc_worker.config_load import load_config, load_config_text
from rc_worker.core.config import Config
from rc_worker.core.errors import ConfigError
from rc_worker.testing import local_system

SAMPLE_JOB = [
    "sh",
    "-c",
    'echo "hello from job $RC_JOB_ID on $RC_DEVICE"; '
    'for i in 1 2 3; do echo "step $i"; sleep 0.2; done; echo done',
]


def embedded_config() -> Config:
    text = resources.files("rc_worker").joinpath("data/embedded.yaml").read_text()
    return load_config_text(text, name="<embedded>")


def demo_main(args: argparse.Namespace) -> int:
    try:
        config = load_config(args.path) if args.path else embedded_config()
    except ConfigError as e:
        print(f"rc-worker: {e}", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="rc-worker-demo-") as tmp:
        config = attrs.evolve(
            config,
            state_dir=str(Path(tmp) / "state"),
            controller_url=None,
            probe_dir=config.probe_dir if args.path else str(Path(tmp) / "probe.d"),
            verify_dir=config.verify_dir if args.path else str(Path(tmp) / "verify.d"),
            sheet_dir=config.sheet_dir if args.path else str(Path(tmp) / "sheets"),
        )
        return trio.run(_demo, config)


async def _demo(config: Config) -> int:
    with trio.fail_after(120):
        async with local_system(config) as system:
            job_id = system.submit(SAMPLE_JOB)
            print(f"submitted {job_id}: {' '.join(SAMPLE_JOB[:2])} '...'", flush=True)
            shown = 0

            def progressed() -> bool:
                return system.store.committed(job_id) > shown or system.job(job_id).terminal

            while True:
                await system.wait_until(progressed)
                data = system.store.output(job_id, shown)
                if data:
                    sys.stdout.write(data.decode("utf-8", "replace"))
                    sys.stdout.flush()
                    shown += len(data)
                info = system.job(job_id)
                if info.terminal and shown >= system.store.committed(job_id):
                    break
            print(
                f"job {job_id} on {info.host}/{info.device}: {info.state}, "
                f"exit code {info.exit_code}",
                flush=True,
            )
    return 0 if info.state == "succeeded" else 1
