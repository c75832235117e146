"""Run every ``bench/bench_*.py`` in name order, each in its own interpreter.

A benchmark is a script that measures itself against a raw baseline in the
same run and prints its figures; this only runs them one after another (never
in parallel: they would measure each other) and fails if any of them failed.
Extra arguments are passed to every benchmark.

    python bench/run_all.py [ARGS...]
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

BENCH_DIR = Path(__file__).resolve().parent


def main(argv: list[str]) -> int:
    scripts = sorted(BENCH_DIR.glob("bench_*.py"))
    if not scripts:
        print(f"no bench_*.py in {BENCH_DIR}", file=sys.stderr)
        return 1
    failed: list[str] = []
    for script in scripts:
        print(f"== {script.name}", flush=True)
        done = subprocess.run([sys.executable, str(script), *argv], check=False)
        if done.returncode != 0:
            failed.append(f"{script.name} (exit {done.returncode})")
        print(flush=True)
    if failed:
        print("failed: " + ", ".join(failed), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
