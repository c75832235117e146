"""``rc``: serve the reference controller, and talk to one.

``rc serve`` runs the controller (hypercorn on Trio). Every other command is a
client of ``RC_URL`` (default ``http://127.0.0.1:8080``) with the user token
``RC_USER_TOKEN``; ``--url`` and ``--token`` override them. Tables for people
by default, ``--json`` for programs. Exit status: 0 ok, 1 the controller
refused, 2 bad usage, 3 the controller could not be reached or went away;
``rc run`` exits with the job's own status (see docs/controller.md). Errors are
one line on stderr, never a traceback.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import logging
import math
import os
import sys
from collections.abc import AsyncIterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Final, cast

import httpx
import trio

from rc_worker import completion
from rc_worker._version import __version__
from rc_worker.controller import rc_follow
from rc_worker.controller import rc_format as fmt
from rc_worker.controller.rc_follow import (
    ANSWER_TIMEOUT,
    EXIT_CONTROLLER_GONE,
    CliError,
    Reconnect,
    StdoutClosed,
    job_path,
    raise_for,
)
from rc_worker.controller.rc_input import path_segment, token_problem, url_problem
from rc_worker.core.durations import DURATION_HELP, parse_duration, parse_size

log = logging.getLogger("rc_worker.controller")

if TYPE_CHECKING:
    from rc_worker.controller.rc_serve import (
        run_serve,
    )

DEFAULT_URL = "http://127.0.0.1:8080"
EXIT_KILLED = 137
EXIT_NOT_RUN = 125
EXIT_LOST_LEAD = 3
"""``rc serve`` stopped because another controller took the database's lock."""
DEFAULT_RECONNECT_S = 60.0

__all__ = [
    "EXIT_CONTROLLER_GONE",
    "EXIT_KILLED",
    "EXIT_NOT_RUN",
    "CliError",
    "amain",
    "build_parser",
    "main",
    "run_exit_status",
    "run_serve",
]


# --- argument parsing -----------------------------------------------------------------------


def _whole_number(text: str, least: int, below: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < least:
        raise argparse.ArgumentTypeError(f"{value} {below}")
    return value


def _at_least_one(text: str) -> int:
    return _whole_number(text, 1, "is less than 1; give N >= 1")


def _byte_offset(text: str) -> int:
    return _whole_number(text, 0, "is negative; give a byte of the output, 0 (the start) or more")


def _duration(text: str) -> float:
    try:
        return parse_duration(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _positive_duration(text: str) -> float:
    value = _duration(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not more than 0; give e.g. 10s")
    return value


def _rate(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or value < 0:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a number of 0 or more (per second; 0: no target)"
        )
    return value


def _size(text: str) -> int:
    try:
        return parse_size(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _env_pair(text: str) -> tuple[str, str]:
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"{text!r} is not KEY=VALUE")
    return key, value


def _address(text: str) -> tuple[str, str]:
    host, sep, device = text.partition("/")
    if not sep or not host or not device or "/" in device:
        raise argparse.ArgumentTypeError(f"{text!r} is not HOST/DEVICE (e.g. box1/gpu0)")
    return host, device


def _address_or_host(text: str) -> tuple[str, str | None]:
    if "/" not in text:
        if not text:
            raise argparse.ArgumentTypeError("expected HOST/DEVICE or HOST (e.g. box1/gpu0)")
        return text, None
    return _address(text)


def _named(what: str) -> Any:
    """An argparse type for a job id or host name: one that can be a request path's segment."""

    def check(text: str) -> str:
        try:
            path_segment(what, text)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None
        return text

    return check


def _seg(text: str) -> str:
    """``text`` (checked by the parser) as one segment of a request path."""
    return path_segment("name", text)


def parse_worker_token(text: str) -> tuple[str, str]:
    """``TOKEN=HOST`` (split at the last ``=``) or a bare ``TOKEN`` valid for any host."""
    token, sep, host = text.rpartition("=")
    if not sep or not token or not host:
        return text, "*"
    return token, host


def _split_list(text: str) -> list[str]:
    return [part for part in text.replace(",", " ").split() if part]


def build_parser() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--url", help=f"controller URL (default: $RC_URL or {DEFAULT_URL})")
    common.add_argument("--token", help="user token (default: $RC_USER_TOKEN)")
    common.add_argument("--json", action="store_true", help="print JSON instead of a table")
    d = f"D is {DURATION_HELP}"

    parser = argparse.ArgumentParser(
        prog="rc", description=__doc__.split("\n\n")[0], epilog="Durations: " + d + "."
    )
    parser.add_argument("--version", action="version", version=f"rc {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("serve", help="run the reference controller")
    p.add_argument("--listen", default="127.0.0.1:8080", help="HOST:PORT (default %(default)s)")
    p.add_argument(
        "--worker-token",
        action="append",
        default=[],
        metavar="TOKEN[=HOST]",
        help="a worker token, for one host or (bare) for any; repeatable; also $RC_WORKER_TOKENS",
    )
    p.add_argument(
        "--user-token",
        action="append",
        default=[],
        metavar="TOKEN[=NAME[:admin]]",
        help="a user token, its user's name and role (bare: a plain user with a name derived "
        "from the token); repeatable; also $RC_USER_TOKENS",
    )
    p.add_argument(
        "--max-grace",
        type=_duration,
        default=600.0,
        metavar="D",
        help="the longest grace a job may ask for (default %(default)ss)",
    )
    p.add_argument(
        "--webhook",
        action="append",
        default=[],
        metavar="URL",
        help="POST every event to URL; repeatable",
    )
    p.add_argument(
        "--heartbeat-interval",
        type=_positive_duration,
        default=10.0,
        metavar="D",
        help="the heartbeat interval workers are told to keep (default 10s)",
    )
    p.add_argument(
        "--heartbeat-rate",
        type=_rate,
        default=0.0,
        metavar="N",
        help="aim at N heartbeats per second across the fleet: with many hosts each is "
        "told a longer interval, hosts/N at least (default 0: no target)",
    )
    p.add_argument(
        "--poll-wait",
        type=_positive_duration,
        default=30.0,
        metavar="D",
        help="the long-poll wait workers are told to use (default 30s)",
    )
    where = p.add_mutually_exclusive_group()
    where.add_argument(
        "--state-dir",
        metavar="DIR",
        help="keep state in an SQLite database here (default: $RC_STATE_DIR, else "
        "$XDG_STATE_HOME/rc, else ~/.local/state/rc)",
    )
    where.add_argument(
        "--db", metavar="URL", help="keep state in PostgreSQL (a libpq URI; also $RC_DB)"
    )
    where.add_argument(
        "--memory", action="store_true", help="keep state in memory only (tests, demos)"
    )
    p.add_argument(
        "--recovery-grace",
        type=_duration,
        default=300.0,
        metavar="D",
        help="after a restart, how long a host may take to register again (default 5m)",
    )
    p.add_argument(
        "--max-output-bytes",
        type=_size,
        default=1 << 30,
        metavar="N",
        help="output kept per job, past it dropped (default 1GiB; 0: no cap)",
    )
    p.add_argument(
        "--retention",
        type=_duration,
        default=30 * 86400.0,
        metavar="D",
        help="delete finished jobs older than this (default 30d; 0: keep forever)",
    )

    for name, help_ in (("submit", "queue a job; prints its id"), ("run", "submit, follow, exit")):
        p = sub.add_parser(name, parents=[common], help=help_)
        p.add_argument("--select", default="", help="label selector, e.g. 'product=H100'")
        p.add_argument("--device", type=_address, help="HOST/DEVICE to run on")
        p.add_argument(
            "--env",
            type=_env_pair,
            action="append",
            default=[],
            metavar="K=V",
            help="set an environment variable for the job; repeatable",
        )
        p.add_argument("--cwd", metavar="DIR", help="the job's working directory")
        p.add_argument(
            "--max-runtime", type=_duration, metavar="D", help="kill the job after this long"
        )
        p.add_argument(
            "--idle-timeout",
            type=_duration,
            metavar="D",
            help="kill the job after this long without output",
        )
        p.add_argument(
            "--grace",
            type=_duration,
            default=10.0,
            metavar="D",
            help="SIGTERM to SIGKILL when the job is stopped (default 10s)",
        )
        p.add_argument("--pty", action="store_true", help="run the job on a terminal")
        p.add_argument("--stdin", action="store_true", help="stream this command's stdin to it")
        p.add_argument(
            "--strict",
            action="store_true",
            help="refuse (exit 1, nothing queued) if no registered device could ever run it",
        )
        if name == "run":
            p.add_argument(
                "--quiet",
                "-q",
                action="store_true",
                help="do not print the job's output (with --json it goes to stderr otherwise)",
            )
            p.add_argument(
                "--reconnect",
                type=_duration,
                default=DEFAULT_RECONNECT_S,
                metavar="D",
                help="keep reconnecting to a controller that went away this long (default 1m)",
            )
        p.add_argument(
            "cmd", nargs=argparse.REMAINDER, metavar="-- CMD ...", help="the command to run"
        )

    p = sub.add_parser("ps", parents=[common], help="list jobs (the most recent 50 by default)")
    p.add_argument("--limit", type=int, default=50, metavar="N", help="the N most recent")
    p.add_argument("--all", action="store_true", help="every job the controller keeps")
    p.add_argument("--state", help="only jobs in this state (queued, running, failed, ...)")
    p.add_argument("--host", help="only jobs placed on this host")
    p.add_argument(
        "--select", metavar="SELECTOR", help="only jobs placed on a device this selector matches"
    )
    p = sub.add_parser("show", parents=[common], help="show one job")
    p.add_argument("job", type=_named("job id"), help="job id")
    p = sub.add_parser("logs", parents=[common], help="print a job's output")
    p.add_argument("job", type=_named("job id"), help="job id")
    p.add_argument("--follow", "-f", action="store_true", help="keep printing until it ends")
    p.add_argument(
        "--offset", type=_byte_offset, default=0, metavar="N", help="start at byte N (default 0)"
    )
    p.add_argument(
        "--reconnect",
        type=_duration,
        default=DEFAULT_RECONNECT_S,
        metavar="D",
        help="with --follow: keep reconnecting to a controller that went away this long "
        "(default 1m)",
    )
    p = sub.add_parser("cancel", parents=[common], help="cancel a job")
    p.add_argument("job", type=_named("job id"), help="job id")
    p.add_argument("--reason", default="", help="why (shown in the job's record)")
    p = sub.add_parser("devices", parents=[common], help="list devices (every one by default)")
    p.add_argument(
        "--state",
        help="only devices in this state (free, busy, held, quarantined, absent; held: free"
        " but kept from work by its idle behaviour; absent: no worker polls for it)",
    )
    p.add_argument("--host", help="only the devices of this host")
    p.add_argument("--select", metavar="SELECTOR", help="only devices this label selector matches")
    p.add_argument(
        "--limit", type=_at_least_one, metavar="N", help="the first N (in host/device order)"
    )
    p = sub.add_parser("sheet", parents=[common], help="print a device's usage sheet")
    p.add_argument("device", type=_address, metavar="HOST/DEVICE", help="the device")
    p = sub.add_parser(
        "clear",
        parents=[common],
        help="lift a quarantine (HOST alone: the host-level faults of all its devices)",
    )
    p.add_argument(
        "device", type=_address_or_host, metavar="HOST/DEVICE | HOST", help="the device, or a host"
    )
    p = sub.add_parser("idle", parents=[common], help="set a device's idle behaviour")
    p.add_argument("device", type=_address, metavar="HOST/DEVICE", help="the device")
    p.add_argument(
        "behavior",
        choices=["run", "hold", "drain"],
        help="run: take jobs; hold: take none, keep it; drain: take none, release it",
    )
    p = sub.add_parser(
        "pool", parents=[common], help="hosts and devices per state, free devices per class"
    )
    p.add_argument(
        "--class",
        dest="class_label",
        default="product",
        metavar="LABEL",
        help="count free devices per value of this label (default product)",
    )
    p = sub.add_parser("host", parents=[common], help="drain, resume or retire a host")
    p.add_argument(
        "action",
        choices=["drain", "resume", "retire"],
        help="drain: no new work on its devices; resume: take work again; "
        "retire: forget a host gone for good (its jobs' records stay)",
    )
    p.add_argument("host", type=_named("host"), help="the host's name")
    p.add_argument(
        "--force",
        action="store_true",
        help="retire even with jobs running there (they end lost)",
    )
    p = sub.add_parser("events", parents=[common], help="print events")
    p.add_argument("--after", type=int, default=0, metavar="N", help="only events after number N")
    p.add_argument("--follow", "-f", action="store_true", help="keep printing new events")
    p = sub.add_parser("completion", help="print a shell completion script")
    p.add_argument("shell", choices=completion.SHELLS, help="the shell to complete for")
    return parser


# --- client plumbing ------------------------------------------------------------------------


UNREADABLE: Final = (KeyError, IndexError, TypeError, AttributeError, ValueError)
"""What reading an answer of the wrong shape raises (a field missing, a list where an
object belongs): such an answer is one line (:func:`_unreadable`), never a traceback."""


def _unreadable(error: BaseException, url: str) -> CliError:
    """An answer ``rc`` could not read (``error`` is one of :data:`UNREADABLE`)."""
    what = f"{type(error).__name__}: {error}" if str(error) else type(error).__name__
    return CliError(
        f"the controller at {url} answered something rc cannot read ({what}); check that "
        f"--url / RC_URL is an rc controller (rc serve) of a version that speaks to rc "
        f"{__version__}"
    )


def _out(text: str) -> None:
    """Print ``text`` (a line is added) on stdout: every command's output but the bytes of a
    job's own (:mod:`rc_follow`'s sinks). A reader that closed stdout (``rc ps | head -1``)
    is :class:`StdoutClosed`, which ``amain`` turns into a quiet exit 0."""
    line = text if text.endswith("\n") else text + "\n"
    if sys.stdout is None:  # started with stdout closed (`rc ps >&-`): no reader at all
        raise StdoutClosed(len(line.encode()), rc_follow.NOT_OPEN)
    try:
        sys.stdout.write(line)
        sys.stdout.flush()
    except BrokenPipeError:
        raise StdoutClosed(len(line.encode())) from None


def _say(text: str) -> None:
    """Print ``text`` (a line) on stderr: rc's own notes and errors. Best effort: a stderr
    whose reader has gone, or that rc was started without (``2>&-``: ``print`` would then
    write to stdout, into a ``--json`` answer), must not change what rc does or its status.

    Escaped (:func:`rc_format.one_line`): the controller's text in it (an error's message,
    a job's id or reason) is not to start a line of its own or send the terminal an escape
    sequence; ``rc``'s own text has no control character, so it is shown unchanged."""
    if sys.stderr is None:
        return
    with contextlib.suppress(OSError):
        print(fmt.one_line(text), file=sys.stderr, flush=True)


async def _feed_stdin(client: httpx.AsyncClient, job_id: str) -> None:
    source = cast(io.BufferedReader, sys.stdin.buffer)

    async def chunks() -> AsyncIterator[bytes]:
        # A blocking read in a thread; abandoned (not waited for) if rc is stopped.
        while data := await trio.to_thread.run_sync(
            source.read1, 64 * 1024, abandon_on_cancel=True
        ):
            yield data

    try:
        await rc_follow.call(
            client, "PUT", job_path(job_id, "stdin"), content=chunks(), timeout=None
        )
    except httpx.TransportError:
        # Not resumable (a second upload is refused): the job has seen end of file.
        _say(f"rc: the controller went away during the stdin upload; job {job_id} got end of file")


def _submit_body(args: argparse.Namespace) -> dict[str, Any]:
    cmd = list(args.cmd)
    if cmd and cmd[0] == "--":
        cmd = cmd[1:]
    if not cmd:
        raise CliError(
            f"rc {args.command}: give the command after --, e.g. rc {args.command} -- nvidia-smi", 2
        )
    return {
        "command": cmd,
        "select": args.select,
        "device": None if args.device is None else "/".join(args.device),
        "env": dict(args.env),
        "cwd": args.cwd,
        "max_runtime_s": args.max_runtime,
        "idle_timeout_s": args.idle_timeout,
        "grace_s": args.grace,
        "pty": args.pty,
        "stdin": args.stdin,
        "strict": args.strict,
    }


def run_exit_status(job: Mapping[str, Any]) -> int:
    """``rc run``'s exit status for a finished job (docs/controller.md)."""
    state = job.get("state")
    code = job.get("exit_code")
    if state == "succeeded":
        return 0
    if state == "failed":
        return code if isinstance(code, int) and 0 < code < 256 else 1
    if state == "killed":
        return EXIT_KILLED
    return EXIT_NOT_RUN


# --- commands -------------------------------------------------------------------------------


DEVICES_PAGE = 1000
"""Devices asked for per request by ``rc devices``: a large fleet comes in pages."""


async def _devices(client: httpx.AsyncClient, args: argparse.Namespace) -> list[Any]:
    """Every device the filters match (or the first ``--limit``), page after page."""
    params: dict[str, Any] = {
        k: v for k in ("state", "host", "select") if (v := getattr(args, k)) is not None
    }
    out: list[Any] = []
    after = None
    while True:
        want = DEVICES_PAGE if args.limit is None else min(DEVICES_PAGE, args.limit - len(out))
        page = {**params, "limit": want, **({} if after is None else {"after": after})}
        body = await rc_follow.call(client, "GET", "/v1/devices", params=page)
        out += body["devices"]
        after = body.get("next")
        if after is None or (args.limit is not None and len(out) >= args.limit):
            return out


JOBS_PAGE: Final = 1000
"""Jobs ``rc ps --all`` asks for per request: one answer stays small however many there are."""


async def _jobs(client: httpx.AsyncClient, args: argparse.Namespace) -> list[Any]:
    """``rc ps``: the most recent ``--limit`` (shown oldest first), or with ``--all`` every
    job, a page at a time; filtered by the controller."""
    params: dict[str, Any] = {
        k: v for k in ("state", "host", "select") if (v := getattr(args, k)) is not None
    }
    if not args.all:
        body = await rc_follow.call(
            client, "GET", "/v1/jobs", params={**params, "limit": args.limit, "order": "desc"}
        )
        return list(reversed(body["jobs"]))  # the most recent, shown oldest first
    out: list[Any] = []
    after = None
    while True:
        page = {**params, "limit": JOBS_PAGE, **({} if after is None else {"after": after})}
        body = await rc_follow.call(client, "GET", "/v1/jobs", params=page)
        out += body["jobs"]
        after = body.get("next")
        if after is None:
            return out


def _check_stdin(args: argparse.Namespace) -> None:
    """Refuse ``--stdin`` (status 2) when ``rc`` has no standard input at all (``<&-``:
    Python then has ``sys.stdin`` None): checked before the job is submitted, which would
    otherwise be queued waiting for an input ``rc`` cannot read."""
    if args.stdin and sys.stdin is None:
        raise CliError(
            f"rc {args.command} --stdin: standard input is not open (rc was started with <&-); "
            "give the job's input on it (< FILE, or a pipe), or leave out --stdin",
            2,
        )


async def _cmd_submit(client: httpx.AsyncClient, args: argparse.Namespace) -> int:
    _check_stdin(args)
    submitted = await rc_follow.call(client, "POST", "/v1/jobs", json=_submit_body(args))
    job_id: str = submitted["job_id"]
    if submitted.get("pending_code") == "no_match":
        _say(
            f"rc: warning: no registered device could ever run job {job_id}: "
            f"{submitted.get('pending_reason')}; it waits in the queue "
            "(--strict refuses such jobs)"
        )
    if args.command == "submit":
        try:
            _out(json.dumps({"job_id": job_id}) if args.json else job_id)
        except (StdoutClosed, OSError):
            # Only the id is lost: the job is queued and waits for its stdin, which is
            # uploaded all the same before rc stops (quietly for a closed stdout, as every
            # command; a failing one is reported).
            if args.stdin:
                await _feed_stdin(client, job_id)
            raise
        if args.stdin:
            await _feed_stdin(client, job_id)
        return 0
    _say(f"rc: job {job_id}")
    if args.quiet:
        sink: rc_follow.Sink = rc_follow.discard
    else:
        sink = (
            rc_follow.to_stream(sys.stderr, "stderr")
            if args.json
            else rc_follow.to_stream(sys.stdout)
        )
    reconnect = Reconnect(args.reconnect, str(client.base_url), job_id)
    try:
        async with trio.open_nursery() as nursery:
            if args.stdin:
                nursery.start_soon(_feed_stdin, client, job_id)
            job = await rc_follow.follow_output(client, job_id, 0, sink, reconnect)
            nursery.cancel_scope.cancel()
    except* (CliError, httpx.HTTPError, *UNREADABLE) as group:
        raise _translate(group, str(client.base_url)) from group
    except* KeyboardInterrupt:
        _say("")  # after the ^C the terminal printed
        _say(f"rc: job {job_id} keeps running; stop it with: rc cancel {job_id}")
        raise
    status = run_exit_status(job)
    if args.json:
        try:
            _out(json.dumps(job, indent=2))  # output_truncated is in it
        except StdoutClosed as e:
            # As without --json (the job's output there), a closed stdout is reported, not
            # a quiet 0: rc run's status is the job's, and nothing on stdout says rc failed.
            raise CliError(
                f"cannot write the record of job {job_id} to stdout ({e.why}); it ended "
                f"{job['state']}: rc show --json {job_id}"
            ) from None
    elif job.get("output_truncated") and not args.quiet:
        # On stderr: stdout is the job's own output, as it was kept.
        _say(f"rc: {_truncated_message(job)}")
    if not args.json and job["state"] not in ("succeeded", "failed"):
        why = job.get("reason") or job.get("error") or ""
        _say(f"rc: job {job_id} ended {job['state']}{': ' + why if why else ''}")
    return status


def _translate(group: BaseExceptionGroup[Exception], url: str = "") -> CliError:
    """One CliError (the first one's message and status) for a group of them; ``url`` is the
    controller's, for an answer rc could not read."""
    first: BaseException = group
    while isinstance(first, BaseExceptionGroup):
        first = first.exceptions[0]
    if isinstance(first, CliError):
        return CliError(str(first), first.status)
    if isinstance(first, UNREADABLE):
        return _unreadable(first, url)
    what = f"{type(first).__name__}: {first}" if str(first) else type(first).__name__
    if isinstance(first, httpx.TransportError):
        return CliError(f"cannot reach the controller: {what}", EXIT_CONTROLLER_GONE)
    return CliError(what)


async def _cmd_logs(client: httpx.AsyncClient, args: argparse.Namespace) -> int:
    sink = rc_follow.json_lines if args.json else rc_follow.to_stream(sys.stdout)
    if args.follow:
        reconnect = Reconnect(args.reconnect, str(client.base_url), args.job)
        job = await rc_follow.follow_output(client, args.job, args.offset, sink, reconnect)
        _truncation_marker(job, json_mode=args.json)
        return 0
    # Streamed in chunks: a job's output may be larger than this machine's memory.
    offset = args.offset
    path = job_path(args.job, "output")
    params = {"offset": args.offset}
    async with client.stream("GET", path, params=params, timeout=ANSWER_TIMEOUT) as r:
        if not r.is_success:
            raise_for(await rc_follow.read_answer(client, r, "GET", path))
        async for chunk in r.aiter_raw():
            sink(offset, chunk)
            offset += len(chunk)
    job = await rc_follow.call(client, "GET", job_path(args.job))
    _truncation_marker(job, json_mode=args.json)
    return 0


def _truncation_marker(job: Any, *, json_mode: bool) -> None:
    """The last line of ``rc logs`` for a job whose output the controller capped: text, or
    with ``--json`` one object ``{"output_truncated": true, "committed_bytes": N, ...}``."""
    if not isinstance(job, dict) or not job.get("output_truncated"):
        return
    kept = job.get("committed_bytes")
    message = _truncated_message(job)
    if json_mode:
        line = {"output_truncated": True, "committed_bytes": kept, "message": message}
        _out(json.dumps(line))
    else:
        _out(f"\n[rc: {message}]")


def _truncated_message(job: Mapping[str, Any]) -> str:
    return (
        f"output truncated: the controller kept only the first {job.get('committed_bytes')}"
        " bytes (rc serve --max-output-bytes)"
    )


async def _cmd_client(client: httpx.AsyncClient, args: argparse.Namespace) -> int:
    c = args.command
    if c in ("submit", "run"):
        return await _cmd_submit(client, args)
    if c == "logs":
        return await _cmd_logs(client, args)
    body: Any
    if c == "ps":
        body = {"jobs": await _jobs(client, args)}
        text = fmt.jobs_table(body["jobs"])
    elif c == "show":
        body = await rc_follow.call(client, "GET", job_path(args.job))
        text = fmt.job_details(body)
    elif c == "cancel":
        payload = {"reason": args.reason} if args.reason else {}
        body = await rc_follow.call(client, "POST", job_path(args.job, "cancel"), json=payload)
        text = fmt.cancel_result(body)
    elif c == "devices":
        body = {"devices": await _devices(client, args)}
        text = fmt.devices_table(body["devices"])
    elif c == "sheet":
        body = await rc_follow.call(
            client, "GET", "/v1/devices/{}/{}/sheet".format(*map(_seg, args.device))
        )
        text = fmt.sheet(body)
    elif c == "clear" and args.device[1] is None:
        body = await rc_follow.call(client, "POST", f"/v1/hosts/{_seg(args.device[0])}/clear")
        text = fmt.clear_host_result(body)
    elif c == "clear":
        body = await rc_follow.call(
            client, "POST", "/v1/devices/{}/{}/clear".format(*map(_seg, args.device))
        )
        text = fmt.clear_result(body)
    elif c == "idle":
        path = "/v1/devices/{}/{}/idle-behavior".format(*map(_seg, args.device))
        body = await rc_follow.call(client, "POST", path, json={"idle_behavior": args.behavior})
        text = fmt.one_line(f"{body['address']}: idle behavior {body['idle_behavior']}")
    elif c == "pool":
        body = await rc_follow.call(client, "GET", "/v1/pool", params={"class": args.class_label})
        text = fmt.pool_summary(body)
    elif c == "host":
        payload = {"force": True} if args.force else {}
        path = f"/v1/hosts/{_seg(args.host)}/{args.action}"
        body = await rc_follow.call(client, "POST", path, json=payload)
        text = fmt.host_result(args.action, args.host, body)
    elif c == "events":
        return await _cmd_events(client, args)
    else:  # pragma: no cover - argparse only lets known commands through
        raise CliError(f"unknown command {c!r}", 2)
    _out(json.dumps(body, indent=2) if args.json else text)
    return 0


async def _cmd_events(client: httpx.AsyncClient, args: argparse.Namespace) -> int:
    after = args.after
    while True:
        params = {"after": after, "wait_s": 30 if args.follow else 0}
        body = await rc_follow.call(client, "GET", "/v1/events", params=params)
        for event in body["events"]:
            _out(json.dumps(event) if args.json else fmt.event_line(event))
            after = event["seq"]
        if not args.follow:
            return 0


# --- entry points ---------------------------------------------------------------------------


async def amain(
    argv: Sequence[str],
    *,
    env: Mapping[str, str] | None = None,
    transport: httpx.AsyncBaseTransport | None = None,
) -> int:
    """Run one ``rc`` command; returns its exit status. ``transport`` is for tests."""
    env = os.environ if env is None else env
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as e:
        return e.code if isinstance(e.code, int) else 2
    try:
        if args.command == "completion":
            _out(completion.render(build_parser(), args.shell))
            return 0
        if args.command == "serve":
            # The server stack (Starlette, hypercorn, the stores) loads only for `rc serve`:
            # every other command is a short-lived client, and starts in a fraction of the time.
            from rc_worker.controller.rc_serve import (
                _serve_until_signalled,
                check_listen,
                open_serve_backend,
                serve_settings,
            )

            serve_settings(args, env)
            check_listen(args)
            # Opened here, before any nursery, so a store that cannot be used is one line.
            backend = await open_serve_backend(args, env)
            return await _serve_until_signalled(argv[1:], env, backend)
        url, token = _where_and_who(args, env)
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        # Connecting is bounded well inside the default reconnect window; reading is not
        # (a followed job can be silent for hours).
        timeout = httpx.Timeout(30.0, connect=10.0, read=None)
        rc_follow.read_up_to_a_mebibyte()
        async with httpx.AsyncClient(
            base_url=url, headers=headers, transport=transport, timeout=timeout
        ) as client:
            try:
                return await _cmd_client(client, args)
            except UNREADABLE as e:
                raise _unreadable(e, url) from e
    except StdoutClosed:
        # `rc logs J | head -c 10`, `rc ps | head -1`: the reader has what it wanted; nothing
        # to report. (`rc run` turned it into a CliError: its status is the job's.)
        rc_follow.quiet_stdout()
        return 0
    except CliError as e:
        _say(f"rc: {e}")
        return e.status
    except httpx.TimeoutException as e:
        where = args.url or env.get("RC_URL") or DEFAULT_URL
        _say(
            f"rc: the controller at {where} did not answer in time ({type(e).__name__}); "
            "check that --url / RC_URL is an rc controller (rc serve) and that it is not "
            "stopped (SIGSTOP) or overloaded"
        )
        return EXIT_CONTROLLER_GONE
    except httpx.TransportError as e:
        where = args.url or env.get("RC_URL") or DEFAULT_URL
        what = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
        _say(
            f"rc: cannot reach the controller at {where}: {what}; check that rc serve runs "
            "there, or set --url / RC_URL"
        )
        return EXIT_CONTROLLER_GONE
    except httpx.HTTPError as e:
        _say(f"rc: {type(e).__name__}: {e}")
        return 1
    except OSError as e:
        _say(f"rc: {e}")
        return 1


def _where_and_who(args: argparse.Namespace, env: Mapping[str, str]) -> tuple[str, str]:
    """The controller's URL and the user token, checked (CliError, status 2). An empty
    ``$RC_URL`` or ``$RC_USER_TOKEN`` counts as unset; an empty ``--url`` or ``--token`` was
    meant to say something, so it is refused rather than quietly replaced by the default."""
    if args.url is not None:
        url, url_from = args.url, "--url"
    elif env.get("RC_URL"):
        url, url_from = env["RC_URL"], "RC_URL"
    else:
        url, url_from = DEFAULT_URL, "--url"
    problem = url_problem(url)
    if problem:
        raise CliError(f"{url_from}: {problem}", 2)
    if args.token is not None:
        token, token_from = args.token, "--token"
        if not token:
            raise CliError(
                "--token is empty; give the user token, or leave --token out to use $RC_USER_TOKEN",
                2,
            )
    else:
        token, token_from = env.get("RC_USER_TOKEN", ""), "RC_USER_TOKEN"
    problem = token_problem(token)
    if problem:
        raise CliError(f"{token_from}: {problem}", 2)
    return url, token


def main(argv: Sequence[str] | None = None) -> int:
    """The ``rc`` console script."""
    status = 130
    try:
        status = trio.run(amain, list(sys.argv[1:] if argv is None else argv))
    except* KeyboardInterrupt:
        pass
    return status


def __getattr__(name: str) -> Any:
    # ``rc serve``'s entry points moved to rc_serve.py (loaded only when serving); they are
    # still importable from here.
    if name in _SERVE_NAMES:
        from rc_worker.controller import rc_serve

        return getattr(rc_serve, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


_SERVE_NAMES: Final = frozenset(
    {
        "PERSISTED_MAX_EVENTS",
        "open_serve_backend",
        "run_serve",
        "serve_backend_choice",
        "serve_settings",
    }
)


if __name__ == "__main__":
    sys.exit(main())
