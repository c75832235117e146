"""``rc-worker exec``: run one command locally under exactly the supervision jobs get.

    rc-worker exec [--grace D] [--max-runtime D] [--idle-timeout D] [--job-id ID]
                   [--pty] [--separate-stderr] [--result-json PATH] -- CMD [ARG...]

The job's output goes to stdout (its stderr to stderr with
``--separate-stderr``), its environment is this process's plus
``RC_JOB_ID=<ID>`` when ``--job-id`` is given (which also turns on the
RC_JOB_ID sweep), and its exit status becomes ours: the exit code, 128+N for
a death by signal N, 127 when it could not be started. SIGINT or SIGTERM
stops the job (``killed``, reason ``"cancelled"``) and the result is still
written. Its standard input is /dev/null, as for every unattended job.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
from collections.abc import Sequence
from typing import Any

import attrs
import trio

from rc_worker.core.durations import DURATION_HELP, parse_duration
from rc_worker.supervise import JobHandle, JobSpec, Result, run_job

EXIT_NOT_STARTED = 127
EXIT_USAGE = 2

_PROG = "rc-worker exec"


def configure(subparsers: Any) -> None:
    """Add the ``exec`` subcommand to an argparse subparsers object."""
    parser: argparse.ArgumentParser = subparsers.add_parser(
        "exec",
        help="run one command locally under the worker's job supervision",
        description="Run CMD as the worker runs a job: in its own session, SIGTERM then "
        "SIGKILL after the grace period on a limit or on SIGINT/SIGTERM, background "
        "children torn down, and with --job-id the RC_JOB_ID sweep. Exits with the "
        "job's status (127 when it could not be started).",
    )
    parser.add_argument(
        "--grace",
        type=_duration,
        default=10.0,
        metavar="D",
        help=f"SIGTERM to SIGKILL window (default 10s); D is {DURATION_HELP}",
    )
    parser.add_argument(
        "--max-runtime", type=_limit, default=None, metavar="D", help="kill after D in all"
    )
    parser.add_argument(
        "--idle-timeout",
        type=_limit,
        default=None,
        metavar="D",
        help="kill after D with no output on stdout or stderr",
    )
    parser.add_argument(
        "--job-id",
        default=None,
        metavar="ID",
        help="set RC_JOB_ID=ID in the job's environment and sweep for processes carrying it",
    )
    parser.add_argument("--pty", action="store_true", help="run the job on a new terminal")
    parser.add_argument(
        "--separate-stderr",
        action="store_true",
        help="send the job's stderr to stderr (default: combined into stdout)",
    )
    parser.add_argument(
        "--result-json", default=None, metavar="PATH", help="write the job's Result to PATH"
    )
    parser.add_argument(
        "job_argv", nargs=argparse.REMAINDER, metavar="-- CMD [ARG...]", help="the command to run"
    )
    parser.set_defaults(func=run_exec)


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``exec`` on its own: ``main(["--max-runtime", "5s", "--", "sleep", "9"])``."""
    parser = argparse.ArgumentParser(prog="rc-worker")
    sub = parser.add_subparsers(dest="command")
    configure(sub)
    args = parser.parse_args(["exec", *(sys.argv[1:] if argv is None else argv)])
    code: int = args.func(args)
    return code


def _duration(text: str) -> float:
    try:
        return parse_duration(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _limit(text: str) -> float:
    seconds = _duration(text)
    if seconds == 0:
        raise argparse.ArgumentTypeError(f"{text!r}: a limit must be more than zero; omit it")
    return seconds


def _fail(message: str, code: int = EXIT_USAGE) -> int:
    print(f"{_PROG}: {message}", file=sys.stderr)
    return code


def run_exec(args: argparse.Namespace) -> int:
    argv = list(args.job_argv)
    if argv[:1] == ["--"]:
        argv = argv[1:]
    if not argv:
        return _fail("give the command to run after --, e.g. rc-worker exec -- sh -c 'echo hi'")
    if args.pty and args.separate_stderr:
        return _fail("--separate-stderr cannot be used with --pty: a terminal is one stream")
    env = dict(os.environ)
    if args.job_id is not None:
        env["RC_JOB_ID"] = args.job_id
    try:
        spec = JobSpec(
            command=argv,
            env=env,
            grace_ceiling=args.grace,
            max_runtime=args.max_runtime,
            idle_timeout=args.idle_timeout,
            sweep_job_id=args.job_id,
            pty=args.pty,
        )
    except ValueError as e:
        return _fail(str(e))
    if args.result_json is not None:
        # Find out now, not after a long job, that the result has nowhere to go.
        try:
            with open(args.result_json, "a"):
                pass
        except OSError as e:
            return _fail(f"cannot write --result-json {args.result_json}: {e.strerror or e}")
    result, stop_signal = trio.run(_supervise, spec, args.separate_stderr)
    if args.result_json is not None:
        try:
            with open(args.result_json, "w") as f:
                json.dump(result_json(result), f, indent=2)
                f.write("\n")
        except OSError as e:
            return _fail(f"cannot write --result-json {args.result_json}: {e.strerror or e}")
    if result.exit_code is not None:
        return result.exit_code
    if stop_signal is not None and result.error == "stopped before it was started":
        return 128 + stop_signal
    return _fail(result.error or "the job did not run", EXIT_NOT_STARTED)


def result_json(result: Result) -> dict[str, Any]:
    """The ``--result-json`` document."""
    sweep = result.sweep
    return {
        "exit_code": result.exit_code,
        "signal": result.signal,
        "killed": result.killed,
        "reason": result.reason,
        "error": result.error,
        "sweep": {
            "scanned": sweep.scanned,
            "found": list(sweep.found),
            "remaining": list(sweep.remaining),
            "blind": sweep.blind,
            "blind_pids": list(sweep.blind_pids),
            "method": sweep.method,
            "clean": sweep.clean,
        },
    }


class _FdSink:
    """Writes to one of our own standard fds without blocking the event loop.

    A consumer that stops reading (a paused pager) must not freeze the
    timers that enforce the job's limits, so the fd is driven non-blocking
    through Trio. A consumer that went away (EPIPE) just stops receiving:
    the job is still supervised to the end and its result still reported.
    """

    def __init__(self, fd: int) -> None:
        self._stream: trio.lowlevel.FdStream | None
        try:
            self._stream = trio.lowlevel.FdStream(os.dup(fd))
        except OSError:
            self._stream = None

    async def __call__(self, data: bytes) -> None:
        if self._stream is None:
            await trio.lowlevel.checkpoint()
            return
        try:
            await self._stream.send_all(data)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            self._stream = None

    async def aclose(self) -> None:
        # Closing restores blocking mode on the shared open file, which a
        # terminal's other users (the shell) rely on.
        if self._stream is not None:
            await self._stream.aclose()


async def _supervise(spec: JobSpec, separate_stderr: bool) -> tuple[Result, int | None]:
    handle = JobHandle()
    stop_signal: list[int] = []
    stdout = _FdSink(1)
    stderr = _FdSink(2) if separate_stderr else None
    if stderr is not None:
        # The fd stream can only exist inside trio.run, hence the late evolve.
        spec = attrs.evolve(spec, stderr=stderr)
    try:
        with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
            async with trio.open_nursery() as nursery:

                async def stop_on_signal() -> None:
                    async for signum in signals:
                        stop_signal.append(signum)
                        handle.stop("cancelled")

                nursery.start_soon(stop_on_signal)
                result = await run_job(spec, stdout, handle=handle)
                nursery.cancel_scope.cancel()
    finally:
        with trio.move_on_after(1.0, shield=True):
            await stdout.aclose()
            if stderr is not None:
                await stderr.aclose()
    return result, (stop_signal[0] if stop_signal else None)
