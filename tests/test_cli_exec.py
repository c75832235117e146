"""``rc-worker exec``, run as a real subprocess."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import trio

from rc_worker.cli_exec import configure

GUARD = 30
ENTRY = "import sys; from rc_worker.cli_exec import main; sys.exit(main())"


async def rc_exec(*args: str) -> subprocess.CompletedProcess[bytes]:
    with trio.fail_after(GUARD):
        return await trio.run_process(
            [sys.executable, "-c", ENTRY, *args],
            capture_stdout=True,
            capture_stderr=True,
            check=False,
        )


def read_result(path: Path) -> dict[str, Any]:
    data: dict[str, Any] = json.loads(path.read_text())
    return data


def test_configure_adds_the_exec_subcommand() -> None:
    parser = argparse.ArgumentParser()
    configure(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["exec", "--grace", "500ms", "--max-runtime", "1m30s", "--", "ls"])
    assert args.command == "exec"
    assert args.grace == 0.5
    assert args.max_runtime == 90.0
    assert args.idle_timeout is None
    assert args.job_argv == ["--", "ls"]
    assert callable(args.func)


async def test_exit_status_output_and_result(tmp_path: Path) -> None:
    result_path = tmp_path / "result.json"
    done = await rc_exec(
        "--result-json", str(result_path), "--", "sh", "-c", "echo out; echo err >&2; exit 3"
    )
    assert done.returncode == 3
    assert done.stdout == b"out\nerr\n"
    assert read_result(result_path) == {
        "exit_code": 3,
        "signal": None,
        "killed": False,
        "reason": "",
        "error": None,
        "sweep": {
            "scanned": False,
            "found": [],
            "remaining": [],
            "blind": False,
            "blind_pids": [],
            "method": "environ",
            "clean": False,
        },
    }


async def test_separate_stderr() -> None:
    done = await rc_exec("--separate-stderr", "--", "sh", "-c", "echo out; echo err >&2")
    assert done.returncode == 0
    assert done.stdout == b"out\n"
    assert done.stderr == b"err\n"


async def test_job_id_is_in_the_environment_and_turns_on_the_sweep(tmp_path: Path) -> None:
    result_path = tmp_path / "result.json"
    done = await rc_exec(
        "--job-id",
        "exec-test-7",
        "--result-json",
        str(result_path),
        "--",
        "sh",
        "-c",
        "echo $RC_JOB_ID",
    )
    assert done.returncode == 0
    assert done.stdout == b"exec-test-7\n"
    sweep = read_result(result_path)["sweep"]
    assert sweep["scanned"]
    assert sweep["clean"]


async def test_death_by_signal_is_128_plus_n() -> None:
    done = await rc_exec("--", "sh", "-c", "kill -KILL $$")
    assert done.returncode == 137


async def test_max_runtime(tmp_path: Path) -> None:
    result_path = tmp_path / "result.json"
    done = await rc_exec(
        "--max-runtime",
        "300ms",
        "--grace",
        "1s",
        "--result-json",
        str(result_path),
        "--",
        "sleep",
        "300",
    )
    result = read_result(result_path)
    assert result["killed"]
    assert result["reason"] == "max_runtime"
    assert done.returncode == result["exit_code"] == 128 + result["signal"]


async def test_pty() -> None:
    done = await rc_exec("--pty", "--", "sh", "-c", "test -t 0 && test -t 1")
    assert done.returncode == 0


async def test_command_not_found_is_127_with_a_message(tmp_path: Path) -> None:
    result_path = tmp_path / "result.json"
    done = await rc_exec("--result-json", str(result_path), "--", "no-such-command-rc")
    assert done.returncode == 127
    assert b"no-such-command-rc" in done.stderr
    assert b"Traceback" not in done.stderr
    assert read_result(result_path)["error"]


@pytest.mark.parametrize("flag", ["--grace", "--max-runtime", "--idle-timeout"])
async def test_bad_duration_is_exit_2(flag: str) -> None:
    done = await rc_exec(flag, "ten seconds", "--", "true")
    assert done.returncode == 2
    assert b"not a duration" in done.stderr
    assert b"Traceback" not in done.stderr


async def test_missing_command_is_exit_2() -> None:
    done = await rc_exec("--pty")
    assert done.returncode == 2
    assert b"give the command" in done.stderr


async def test_pty_with_separate_stderr_is_exit_2() -> None:
    done = await rc_exec("--pty", "--separate-stderr", "--", "true")
    assert done.returncode == 2
    assert b"--pty" in done.stderr


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
async def test_a_signal_stops_the_job_and_the_result_is_written(
    tmp_path: Path, sig: signal.Signals
) -> None:
    result_path = tmp_path / "result.json"
    pidfile = tmp_path / "job.pid"
    argv = [sys.executable, "-c", ENTRY, "--grace", "1s", "--result-json", str(result_path)]
    argv += ["--", "sh", "-c", 'echo $$ > "$1"; echo ready; exec sleep 300', "sh", str(pidfile)]
    proc = await trio.lowlevel.open_process(argv, stdout=subprocess.PIPE, start_new_session=True)
    try:
        assert proc.stdout is not None
        with trio.fail_after(GUARD):
            seen = b""
            while b"ready" not in seen:
                chunk = await proc.stdout.receive_some()
                assert chunk, "rc-worker exec ended before the job was ready"
                seen += chunk
            proc.send_signal(sig)
            code = await proc.wait()
        result = read_result(result_path)
        assert result["killed"]
        assert result["reason"] == "cancelled"
        assert code == result["exit_code"] == 128 + signal.SIGTERM
        job_pid = int(pidfile.read_text())
        assert _gone(job_pid)
    finally:
        # Should the test fail early: exec itself, then the job (its own session).
        with contextlib.suppress(OSError):
            os.killpg(proc.pid, signal.SIGKILL)
        with contextlib.suppress(OSError, ValueError):
            _kill_if_alive(int(pidfile.read_text()))
        with trio.move_on_after(5, shield=True):
            await proc.wait()
        if proc.stdout is not None:
            await proc.stdout.aclose()


def _kill_if_alive(pid: int) -> None:
    if not _gone(pid) and b"sleep" in Path(f"/proc/{pid}/cmdline").read_bytes():
        os.kill(pid, signal.SIGKILL)


def _gone(pid: int) -> bool:
    """Reaped, or a zombie (an init that never reaps keeps those around)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0] == "Z"
    except OSError:
        return True
