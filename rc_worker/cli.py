"""The ``rc-worker`` command.

Every subcommand turns bad input into a message on stderr and exit status 2,
never a traceback.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from collections.abc import Sequence
from typing import Any

from rc_worker._version import __version__
from rc_worker.config import load_config, resolved_json
from rc_worker.errors import ConfigError


def _check_config(args: argparse.Namespace) -> int:
    try:
        config = load_config(args.path)
    except ConfigError as e:
        print(f"rc-worker: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(resolved_json(config), indent=2, sort_keys=True))
    else:
        names = ", ".join(config.device_names)
        print(f"config OK: host {config.host}, devices {names}")
    return 0


def _run(args: argparse.Namespace) -> int:
    from rc_worker.worker_main import run_from_cli

    return run_from_cli(args)


def _demo(args: argparse.Namespace) -> int:
    from rc_worker.demo import demo_main

    return demo_main(args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="rc-worker",
        description="The rc device-host agent: offers this host's devices to a controller "
        "and runs the jobs it assigns.",
    )
    parser.add_argument("--version", action="version", version=f"rc-worker {__version__}")
    parser.add_argument(
        "--log-level",
        default="info",
        choices=["debug", "info", "warning", "error"],
        help="log verbosity (default: info)",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    check = sub.add_parser("check-config", help="validate a config file")
    check.add_argument(
        "path", nargs="?", help="config file (default: $RC_WORKER_CONFIG or /etc/rc/worker.yaml)"
    )
    check.add_argument("--json", action="store_true", help="print the fully resolved config")
    check.set_defaults(func=_check_config)

    run = sub.add_parser("run", help="run the worker until SIGTERM")
    run.add_argument("--config", dest="path", help="config file")
    run.set_defaults(func=_run)

    demo = sub.add_parser(
        "demo",
        help="run a worker against an embedded controller and one sample job, then exit",
    )
    demo.add_argument("--config", dest="path", help="config file (default: the embedded one)")
    demo.set_defaults(func=_demo)

    for module in _optional_subcommands():
        module.configure(sub)
    return parser


def _optional_subcommands() -> list[Any]:
    from rc_worker import cli_exec, cli_probe, completion, status

    return [cli_exec, cli_probe, completion, status]


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help(sys.stderr)
        return 2
    logging.basicConfig(
        level=getattr(logging, args.log_level.upper()),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    if args.log_level != "debug":
        # One line per HTTP request drowns the worker's own account of itself.
        logging.getLogger("httpx").setLevel(logging.WARNING)
    try:
        code: int = args.func(args)
    except BrokenPipeError:
        # `rc-worker ... | head`: the reader has what it wanted. Point stdout
        # at /dev/null so the interpreter's final flush is quiet too.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 0
    return code


if __name__ == "__main__":
    sys.exit(main())
