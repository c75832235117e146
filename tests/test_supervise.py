"""run_job against real processes on the real clock.

No test asserts how long anything took: limits are checked by what the
Result says. Every process a test learns of is tracked and SIGKILLed at the
end (after checking it is still the same process), whatever the outcome.
"""

from __future__ import annotations

import contextlib
import os
import signal
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
import trio

from rc_worker.supervise import (
    JobHandle,
    JobSpec,
    Result,
    describe_spawn_error,
    exit_status,
    run_job,
)

ENV = {"PATH": os.environ.get("PATH", os.defpath), "LC_ALL": "C"}
GUARD = 30  # seconds; a hung test fails instead of hanging


# -- process bookkeeping ----------------------------------------------------


def _stat_fields(pid: int) -> list[str] | None:
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return raw.rpartition(")")[2].split()


def alive(pid: int) -> bool:
    """Exists and is not a zombie (an init that never reaps keeps zombies around)."""
    fields = _stat_fields(pid)
    return fields is not None and fields[0] not in ("Z", "X")


def _start_time(pid: int) -> str | None:
    fields = _stat_fields(pid)
    return None if fields is None else fields[19]


class Pids:
    """The processes a test learned of; killed at teardown if still the same ones."""

    def __init__(self) -> None:
        self._seen: dict[int, str | None] = {}

    def add(self, pid: int) -> int:
        self._seen.setdefault(pid, _start_time(pid))
        return pid

    def add_from(self, pidfile: Path) -> int:
        return self.add(int(pidfile.read_text()))

    def kill_all(self) -> None:
        for pid, started in self._seen.items():
            if started is not None and _start_time(pid) == started:
                with contextlib.suppress(OSError):
                    os.kill(pid, signal.SIGKILL)


@pytest.fixture
def pids() -> Iterator[Pids]:
    tracked = Pids()
    yield tracked
    tracked.kill_all()


class Collect:
    """A sink that keeps what it is given (for small outputs only)."""

    def __init__(self) -> None:
        self.chunks: list[bytes] = []

    async def __call__(self, data: bytes) -> None:
        self.chunks.append(data)
        await trio.lowlevel.checkpoint()

    @property
    def data(self) -> bytes:
        return b"".join(self.chunks)


class WatchFor(Collect):
    """A sink that sets an event once ``marker`` has appeared in the output."""

    def __init__(self, marker: bytes) -> None:
        super().__init__()
        self.marker = marker
        self.seen = trio.Event()

    async def __call__(self, data: bytes) -> None:
        await super().__call__(data)
        if self.marker in self.data:
            self.seen.set()


def sh(script: str, *args: str, **kw: object) -> JobSpec:
    kw.setdefault("env", ENV)
    return JobSpec(["sh", "-c", script, "sh", *args], **kw)  # type: ignore[arg-type]


def ints(data: bytes) -> list[int]:
    return [int(tok) for tok in data.split() if tok.isdigit()]


# -- exit status ------------------------------------------------------------


@pytest.mark.parametrize(("script", "code"), [("exit 0", 0), ("exit 1", 1), ("exit 42", 42)])
async def test_exit_code_is_the_exit_status(script: str, code: int) -> None:
    with trio.fail_after(GUARD):
        result = await run_job(sh(script), Collect())
    assert result == Result(exit_code=code)


async def test_death_by_signal_is_128_plus_n_and_not_killed() -> None:
    with trio.fail_after(GUARD):
        result = await run_job(sh("kill -USR1 $$"), Collect())
    assert result.exit_code == 128 + signal.SIGUSR1
    assert result.signal == signal.SIGUSR1
    assert not result.killed
    assert result.reason == ""


def test_exit_status_mapping() -> None:
    assert exit_status(0) == (0, None)
    assert exit_status(3) == (3, None)
    assert exit_status(-9) == (137, 9)


# -- limits -----------------------------------------------------------------


async def test_max_runtime_kills(pids: Pids) -> None:
    with trio.fail_after(GUARD):
        result = await run_job(sh("exec sleep 300", max_runtime=0.3, grace_ceiling=1), Collect())
    assert result.killed
    assert result.reason == "max_runtime"
    assert result.signal in (signal.SIGTERM, signal.SIGKILL)
    assert result.exit_code == 128 + result.signal


async def test_sigterm_ignoring_job_gets_sigkill_after_grace(pids: Pids) -> None:
    # The idle deadline starts counting only after "ready", which the job
    # prints after installing its trap, so SIGTERM is certain to be ignored.
    job = sh(
        "trap '' TERM; echo ready; while :; do sleep 1; done",
        idle_timeout=0.3,
        grace_ceiling=0.3,
    )
    with trio.fail_after(GUARD):
        result = await run_job(job, Collect())
    assert result.killed
    assert result.reason == "idle_timeout"
    assert result.signal == signal.SIGKILL
    assert result.exit_code == 137


async def test_idle_timeout_kills_a_silent_job() -> None:
    with trio.fail_after(GUARD):
        result = await run_job(sh("exec sleep 300", idle_timeout=0.3, grace_ceiling=1), Collect())
    assert result.killed
    assert result.reason == "idle_timeout"


async def test_output_resets_the_idle_timeout() -> None:
    # 2.5 s of output every 0.1 s against a 1 s idle limit: only a reset
    # on each chunk lets this finish on its own.
    script = "i=0; while [ $i -lt 25 ]; do echo tick; sleep 0.1; i=$((i+1)); done"
    out = Collect()
    with trio.fail_after(GUARD):
        result = await run_job(sh(script, idle_timeout=1.0), out)
    assert result == Result(exit_code=0)
    assert out.data.count(b"tick") == 25


async def test_stderr_output_also_resets_the_idle_timeout() -> None:
    script = "i=0; while [ $i -lt 25 ]; do echo tick >&2; sleep 0.1; i=$((i+1)); done"
    err = Collect()
    with trio.fail_after(GUARD):
        result = await run_job(sh(script, idle_timeout=1.0, stderr=err), Collect())
    assert result == Result(exit_code=0)
    assert err.data.count(b"tick") == 25


# -- stdin ------------------------------------------------------------------


async def test_stdin_bytes_are_delivered_then_eof() -> None:
    out = Collect()
    with trio.fail_after(GUARD):
        result = await run_job(JobSpec(["cat"], env=ENV, stdin=b"hello\nworld\n"), out)
    assert result == Result(exit_code=0)
    assert out.data == b"hello\nworld\n"


async def test_stdin_async_iterable() -> None:
    async def pieces() -> AsyncIterator[bytes]:
        for piece in (b"one ", b"two ", b"three"):
            await trio.sleep(0.01)
            yield piece

    out = Collect()
    with trio.fail_after(GUARD):
        result = await run_job(JobSpec(["cat"], env=ENV, stdin=pieces()), out)
    assert result == Result(exit_code=0)
    assert out.data == b"one two three"


async def test_default_stdin_is_dev_null() -> None:
    out = Collect()
    with trio.fail_after(GUARD):
        result = await run_job(JobSpec(["cat"], env=ENV), out)
    assert result == Result(exit_code=0)
    assert out.data == b""


async def test_a_large_stdin_the_job_never_reads() -> None:
    big = b"x" * (16 * 1024 * 1024)  # far more than a pipe holds
    with trio.fail_after(GUARD):
        result = await run_job(sh("sleep 0.2; exit 5", stdin=big), Collect())
    assert result == Result(exit_code=5)


async def test_an_endless_stdin_the_job_ignores() -> None:
    async def forever() -> AsyncIterator[bytes]:
        while True:
            yield b"y" * 4096

    with trio.fail_after(GUARD):
        result = await run_job(JobSpec(["true"], env=ENV, stdin=forever()), Collect())
    assert result == Result(exit_code=0)


async def test_a_job_that_closes_stdin_early() -> None:
    out = Collect()
    with trio.fail_after(GUARD):
        result = await run_job(sh("exec 0<&-; echo closed", stdin=b"z" * 1_000_000), out)
    assert result == Result(exit_code=0)
    assert out.data == b"closed\n"


# -- stderr -----------------------------------------------------------------


async def test_stderr_is_combined_by_default() -> None:
    out = Collect()
    with trio.fail_after(GUARD):
        result = await run_job(sh("echo out; echo err >&2"), out)
    assert result.exit_code == 0
    assert out.data == b"out\nerr\n"


async def test_stderr_can_be_separate() -> None:
    out, err = Collect(), Collect()
    with trio.fail_after(GUARD):
        result = await run_job(sh("echo out; echo err >&2", stderr=err), out)
    assert result.exit_code == 0
    assert out.data == b"out\n"
    assert err.data == b"err\n"


# -- what a job leaves behind ----------------------------------------------


async def test_background_child_holding_stdout_is_torn_down(pids: Pids) -> None:
    out = Collect()
    with trio.fail_after(GUARD):
        result = await run_job(sh("sleep 300 & echo $!; exit 0", grace_ceiling=1), out)
    (child,) = ints(out.data)
    pids.add(child)
    assert result == Result(exit_code=0)  # a success, not killed, whatever teardown did
    assert not alive(child)


async def test_background_child_ignoring_sigterm_is_killed_yet_job_succeeds(
    pids: Pids,
) -> None:
    out = Collect()
    script = "(trap '' TERM; echo $(sh -c 'echo $PPID'); exec sleep 300) & sleep 0.2; exit 0"
    with trio.fail_after(GUARD):
        result = await run_job(sh(script, grace_ceiling=0.2), out)
    for pid in ints(out.data):
        pids.add(pid)
        assert not alive(pid)
    assert result == Result(exit_code=0)


async def test_escaped_child_with_job_id_is_swept(pids: Pids, tmp_path: Path) -> None:
    job_id = f"job-{uuid.uuid4()}"
    pidfile = tmp_path / "escaped.pid"
    script = (
        'setsid sh -c \'echo $$ > "$1"; exec sleep 300\' sh "$1" & '
        'while [ ! -s "$1" ]; do sleep 0.01; done; exit 0'
    )
    job = sh(
        script,
        str(pidfile),
        env={**ENV, "RC_JOB_ID": job_id},
        sweep_job_id=job_id,
        grace_ceiling=0.5,
    )
    try:
        with trio.fail_after(GUARD):
            result = await run_job(job, Collect())
    finally:
        with contextlib.suppress(OSError):
            pids.add_from(pidfile)
    escaped = int(pidfile.read_text())
    assert escaped in result.sweep.found
    assert escaped not in result.sweep.remaining
    assert result.sweep.scanned
    assert result.sweep.clean
    assert not alive(escaped)
    # The incident of 2026-08-17: a sweep never relabels a successful job.
    assert (result.exit_code, result.killed, result.reason) == (0, False, "")


async def test_escaped_child_without_sweep_cannot_hang_the_report(
    pids: Pids, tmp_path: Path
) -> None:
    # It holds stdout open forever and nothing may remove it: the report
    # still comes back, after the bounded drain.
    pidfile = tmp_path / "escaped.pid"
    script = (
        'setsid sh -c \'echo $$ > "$1"; exec sleep 300\' sh "$1" & '
        'while [ ! -s "$1" ]; do sleep 0.01; done; echo done'
    )
    out = Collect()
    try:
        with trio.fail_after(GUARD):
            result = await run_job(sh(script, str(pidfile)), out)
    finally:
        with contextlib.suppress(OSError):
            pids.add_from(pidfile)
    escaped = int(pidfile.read_text())
    assert result == Result(exit_code=0)
    assert out.data == b"done\n"
    assert alive(escaped)  # nobody asked for a sweep


async def test_sweep_matches_the_exact_job_id_only(pids: Pids) -> None:
    job_id = f"job-{uuid.uuid4()}"
    decoy = await trio.lowlevel.open_process(
        ["sleep", "300"],
        env={**ENV, "RC_JOB_ID": job_id + "x"},
        start_new_session=True,
    )
    pids.add(decoy.pid)
    try:
        job = sh("exit 0", env={**ENV, "RC_JOB_ID": job_id}, sweep_job_id=job_id, grace_ceiling=0.2)
        with trio.fail_after(GUARD):
            result = await run_job(job, Collect())
        assert decoy.pid not in result.sweep.found
        assert alive(decoy.pid)
        assert result.sweep.clean
        assert result == Result(exit_code=0, sweep=result.sweep)
    finally:
        decoy.kill()
        with trio.move_on_after(5, shield=True):
            await decoy.wait()


# -- could not start --------------------------------------------------------


async def test_command_not_found_is_an_error_not_an_exception() -> None:
    with trio.fail_after(GUARD):
        result = await run_job(JobSpec(["no-such-command-rc"], env=ENV), Collect())
    assert result.exit_code is None
    assert not result.killed
    assert result.error is not None
    assert "no-such-command-rc" in result.error
    assert "not found" in result.error


async def test_bad_cwd_is_an_error(tmp_path: Path) -> None:
    missing = str(tmp_path / "missing")
    with trio.fail_after(GUARD):
        result = await run_job(JobSpec(["true"], env=ENV, cwd=missing), Collect())
    assert result.exit_code is None
    assert result.error is not None
    assert missing in result.error


async def test_not_executable_is_an_error(tmp_path: Path) -> None:
    script = tmp_path / "script"
    script.write_text("#!/bin/sh\nexit 0\n")
    with trio.fail_after(GUARD):
        result = await run_job(JobSpec([str(script)], env=ENV), Collect())
    assert result.exit_code is None
    assert result.error is not None
    assert "ermission" in result.error


def test_spawn_error_without_path_explains_the_environment() -> None:
    err = FileNotFoundError(2, "No such file or directory", "tool")
    message = describe_spawn_error(err, ["tool"], None, None)
    assert "no PATH" in message


# -- memory -----------------------------------------------------------------


def _peak_rss_kib() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1])
    raise AssertionError("no VmHWM in /proc/self/status")


def _current_rss_kib() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError("no VmRSS in /proc/self/status")


def _reset_peak_rss() -> None:
    # Linux clear_refs "5" resets VmHWM, so the peak measures this job alone;
    # where that is not allowed, the lifetime peak still bounds the growth.
    with contextlib.suppress(OSError):
        Path("/proc/self/clear_refs").write_text("5")


async def test_a_gibibyte_of_output_keeps_memory_flat() -> None:
    total = 0

    async def count(data: bytes) -> None:
        nonlocal total
        total += len(data)

    _reset_peak_rss()
    before = max(_current_rss_kib(), _peak_rss_kib())
    with trio.fail_after(GUARD):
        result = await run_job(JobSpec(["head", "-c", "1G", "/dev/zero"], env=ENV), count)
    growth_mib = (_peak_rss_kib() - before) / 1024
    assert result == Result(exit_code=0)
    assert total == 1 << 30
    assert growth_mib < 64


# -- terminals --------------------------------------------------------------


async def test_pty_job_sees_a_terminal() -> None:
    out = Collect()
    with trio.fail_after(GUARD):
        result = await run_job(
            sh("test -t 0 && test -t 1 && test -t 2 && echo terminal", pty=True), out
        )
    assert result == Result(exit_code=0)
    assert b"terminal" in out.data


async def test_pty_job_has_a_controlling_terminal() -> None:
    out = Collect()
    with trio.fail_after(GUARD):
        result = await run_job(sh("exec 3</dev/tty && echo controlling", pty=True), out)
    assert result == Result(exit_code=0)
    assert b"controlling" in out.data


async def test_pty_without_stdin_reads_end_of_file() -> None:
    with trio.fail_after(GUARD):
        result = await run_job(JobSpec(["cat"], env=ENV, pty=True), Collect())
    assert result == Result(exit_code=0)


async def test_pty_stdin_is_typed() -> None:
    out = Collect()
    job = sh('read line; echo "got:$line"; cat', pty=True, stdin=b"hello\npartial")
    with trio.fail_after(GUARD):
        result = await run_job(job, out)
    assert result == Result(exit_code=0)
    assert b"got:hello" in out.data


def test_pty_cannot_have_a_separate_stderr() -> None:
    with pytest.raises(ValueError, match="terminal"):
        JobSpec(["true"], pty=True, stderr=Collect())


# -- stopping ---------------------------------------------------------------


async def test_stop_handle_gives_killed_and_the_reason() -> None:
    handle = JobHandle()
    out = WatchFor(b"ready")

    async def stop_when_ready() -> None:
        await out.seen.wait()
        handle.stop("cancelled")
        handle.stop("second reason is ignored")

    with trio.fail_after(GUARD):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(stop_when_ready)
            result = await run_job(
                sh("echo ready; exec sleep 300", grace_ceiling=1), out, handle=handle
            )
    assert result.killed
    assert result.reason == "cancelled"
    assert result.signal == signal.SIGTERM
    assert handle.pid is not None
    assert not alive(handle.pid)


async def test_stop_before_start_never_starts_the_job() -> None:
    handle = JobHandle()
    handle.stop("controller said no")
    with trio.fail_after(GUARD):
        result = await run_job(JobSpec(["true"], env=ENV), Collect(), handle=handle)
    assert result.exit_code is None
    assert result.reason == "controller said no"
    assert handle.pid is None


async def test_stop_after_the_job_ended_changes_nothing() -> None:
    handle = JobHandle()
    with trio.fail_after(GUARD):
        result = await run_job(JobSpec(["true"], env=ENV), Collect(), handle=handle)
    handle.stop("too late")
    assert result == Result(exit_code=0)
    assert handle.stop_reason is None


async def test_a_handle_serves_one_job() -> None:
    handle = JobHandle()
    with trio.fail_after(GUARD):
        await run_job(JobSpec(["true"], env=ENV), Collect(), handle=handle)
        with pytest.raises(RuntimeError, match="new one"):
            await run_job(JobSpec(["true"], env=ENV), Collect(), handle=handle)


async def test_outer_cancellation_kills_the_process_group(pids: Pids) -> None:
    out = WatchFor(b"ready")
    handle = JobHandle()
    script = "sleep 300 & echo $!; echo ready; wait"
    with trio.fail_after(GUARD):
        with trio.CancelScope() as scope:
            async with trio.open_nursery() as nursery:

                async def cancel_when_ready() -> None:
                    await out.seen.wait()
                    scope.cancel()

                nursery.start_soon(cancel_when_ready)
                await run_job(sh(script, grace_ceiling=1), out, handle=handle)
                pytest.fail("run_job returned although its scope was cancelled")
    assert scope.cancelled_caught
    assert handle.pid is not None
    child = pids.add(ints(out.data)[0])
    assert not alive(handle.pid)
    assert not alive(child)


async def test_outer_cancellation_sigkills_a_job_ignoring_sigterm(pids: Pids) -> None:
    out = WatchFor(b"ready")
    handle = JobHandle()
    with trio.fail_after(GUARD), trio.CancelScope() as scope:
        async with trio.open_nursery() as nursery:

            async def cancel_when_ready() -> None:
                await out.seen.wait()
                scope.cancel()

            nursery.start_soon(cancel_when_ready)
            await run_job(
                sh("trap '' TERM; echo ready; while :; do sleep 1; done", grace_ceiling=0.2),
                out,
                handle=handle,
            )
    assert handle.pid is not None
    assert not alive(handle.pid)


async def test_a_failing_sink_kills_the_job_and_propagates() -> None:
    handle = JobHandle()

    async def broken(data: bytes) -> None:
        await trio.lowlevel.checkpoint()
        raise OSError("spool disk full")

    with trio.fail_after(GUARD), pytest.RaisesGroup(pytest.RaisesExc(OSError, match="disk full")):
        await run_job(sh("echo hi; exec sleep 300", grace_ceiling=1), broken, handle=handle)
    assert handle.pid is not None
    assert not alive(handle.pid)


# -- the spec ---------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"command": []}, "must not be empty"),
        ({"command": "ls -l"}, "not a single string"),
        ({"command": [""]}, "name the program"),
        ({"command": ["true"], "grace_ceiling": -1}, "grace_ceiling"),
        ({"command": ["true"], "max_runtime": 0}, "None for no limit"),
        ({"command": ["true"], "idle_timeout": float("inf")}, "idle_timeout"),
        ({"command": ["true"], "stdin": "text"}, "encode"),
        ({"command": ["true"], "sweep_job_id": ""}, "sweep_job_id"),
        ({"command": ["true"], "env": {"A=B": "c"}}, "not a valid variable"),
    ],
)
def test_jobspec_validates(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        JobSpec(**kwargs)  # type: ignore[arg-type]


def test_jobspec_env_is_a_private_copy() -> None:
    env = {"A": "1"}
    spec = JobSpec(["true"], env=env)
    env["A"] = "2"
    assert spec.env["A"] == "1"
    assert spec.command == ("true",)
    assert spec.grace_ceiling == 10.0
    assert spec.max_runtime is None
    assert spec.idle_timeout is None
