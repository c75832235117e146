"""The ``rc-worker`` command.

Every subcommand turns bad input into a message on stderr and exit status 2,
never a traceback.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence
from typing import Any

from rc_worker._version import __version__
from rc_worker.config_load import load_config
from rc_worker.core.config import LOG_FORMATS, LOG_LEVELS, Config, config_warnings
from rc_worker.core.config_convert import resolved_json
from rc_worker.core.errors import ConfigError
from rc_worker.logs import setup_logging


def _check_config(args: argparse.Namespace) -> int:
    try:
        config = load_config(args.path)
    except ConfigError as e:
        print(f"rc-worker: {e}", file=sys.stderr)
        return 2
    problem = _cgroup_preflight(config)
    if problem is not None:
        print(f"rc-worker: {problem}", file=sys.stderr)
        return 2
    for warning in config_warnings(config, euid=os.geteuid()):
        print(f"rc-worker: warning: {warning}", file=sys.stderr)
    if args.json:
        print(json.dumps(resolved_json(config), indent=2, sort_keys=True))
    else:
        names = ", ".join(config.device_names)
        print(f"config OK: host {config.host}, devices {names}")
    return 0


def _cgroup_preflight(config: Config) -> str | None:
    # What the worker would refuse at start for cgroups, found now (read-only).
    from rc_worker.cgroup import preflight
    from rc_worker.core.config import cgroup_needs
    from rc_worker.host import LinuxHost

    return preflight(LinuxHost(), config.cgroup, cgroup_needs(config))


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
    _log_options(parser, default=None)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    check = sub.add_parser("check-config", help="validate a config file")
    check.add_argument(
        "path", nargs="?", help="config file (default: $RC_WORKER_CONFIG or /etc/rc/worker.yaml)"
    )
    check.add_argument("--json", action="store_true", help="print the fully resolved config")
    check.set_defaults(func=_check_config)

    run = sub.add_parser("run", help="run the worker until SIGTERM")
    run.add_argument("--config", dest="path", help="config file")
    # Also here, after `run`, where operators put them; the command line wins
    # over the config's log_level / log_format.
    _log_options(run, default=argparse.SUPPRESS)
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


def _log_options(parser: argparse.ArgumentParser, *, default: Any) -> None:
    parser.add_argument(
        "--log-level",
        default=default,
        choices=LOG_LEVELS,
        help="log verbosity (default: the config's log_level, else info); debug also "
        "shows tracebacks and the HTTP libraries' own logs",
    )
    parser.add_argument(
        "--log-format",
        default=default,
        choices=LOG_FORMATS,
        help="text lines, or one JSON object per line (default: the config's log_format, "
        "else text)",
    )


def _optional_subcommands() -> list[Any]:
    from rc_worker import cli_exec, cli_probe, completion, status

    return [cli_exec, cli_probe, completion, status]


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help(sys.stderr)
        return 2
    # `run` sets it up again once it has read the config's log_level/log_format.
    setup_logging(args.log_level or "info", args.log_format or "text")
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
