"""SimHost under the worker's own supervision code: run_job, the sweep, in virtual time.

Every test takes ``autojump_clock`` itself (pytest-trio only uses a clock the
test asks for by name): virtual seconds are deterministic, so the durations
asserted here are exact, not timings.
"""

from __future__ import annotations

import math
import signal
from collections.abc import Mapping

import pytest
import trio
import trio.testing

from rc_worker.supervise import KILL_WAIT, JobHandle, JobSpec, Result, run_job
from rc_worker.sweep import KILL_WAIT as SWEEP_KILL_WAIT
from rc_worker.sweep import sweep_job_survivors, unproven
from rc_worker.testing.sim import EchoStdin, Fork, Hang, Script, SimHost, SimProcess, Sleep, Write

JOB = "j-1"
ENV = {"RC_JOB_ID": JOB, "PATH": "/usr/bin"}


class Sink:
    def __init__(self) -> None:
        self.data = bytearray()

    async def __call__(self, chunk: bytes) -> None:
        self.data += chunk


async def run(host: SimHost, script: Script, **spec: object) -> tuple[Result, bytes, float]:
    """Run ``script`` as a job; its Result, output, and the virtual seconds it took."""
    host.program("job", script)
    sink = Sink()
    began = trio.current_time()
    result = await run_job(JobSpec(["job"], env=ENV, **spec), sink, host=host)  # type: ignore[arg-type]
    return result, bytes(sink.data), trio.current_time() - began


@pytest.fixture
def host() -> SimHost:
    return SimHost()


# -- exits ----------------------------------------------------------------------


@pytest.mark.parametrize("code", [0, 1, 3, 255])
async def test_exit_code_and_output_come_through(
    autojump_clock: trio.testing.MockClock, host: SimHost, code: int
) -> None:
    script = Script.printing((1, b"one\n"), (2.5, b"two\n"), exit_code=code)
    result, out, took = await run(host, script)
    assert (result.exit_code, result.killed, result.error) == (code, False, None)
    assert out == b"one\ntwo\n"
    assert took == 2.5
    assert host.table() == []  # reaped


async def test_unknown_program_is_an_error_result(
    autojump_clock: trio.testing.MockClock, host: SimHost
) -> None:
    sink = Sink()
    result = await run_job(JobSpec(["no-such-program"], env=ENV), sink, host=host)
    assert result.exit_code is None
    assert result.error is not None
    assert "command not found" in result.error


async def test_output_past_the_pipe_capacity_arrives_whole_and_in_order(
    autojump_clock: trio.testing.MockClock, host: SimHost
) -> None:
    big = bytes(i % 251 for i in range(20 * host.pipe_capacity))
    result, out, _ = await run(host, Script((Write(big), Write(b"end"))))
    assert result.exit_code == 0
    assert out == big + b"end"


async def test_stdin_is_echoed(autojump_clock: trio.testing.MockClock, host: SimHost) -> None:
    result, out, _ = await run(host, Script((EchoStdin(),)), stdin=b"hello " * 2000)
    assert result.exit_code == 0
    assert out == b"hello " * 2000


async def test_separate_stderr_goes_to_its_own_sink(
    autojump_clock: trio.testing.MockClock, host: SimHost
) -> None:
    err = Sink()
    script = Script((Write(b"out"), Write(b"err", stderr=True)))
    result, out, _ = await run(host, script, stderr=err)
    assert result.exit_code == 0
    assert (out, bytes(err.data)) == (b"out", b"err")


# -- limits and signals ----------------------------------------------------------


async def test_sigterm_ignored_means_sigkill_after_the_grace_ceiling(
    autojump_clock: trio.testing.MockClock, host: SimHost
) -> None:
    result, _, took = await run(
        host, Script.sleeping(100).ignoring_sigterm(), max_runtime=5, grace_ceiling=3
    )
    assert (result.killed, result.reason, result.signal) == (True, "max_runtime", signal.SIGKILL)
    assert took == 5 + 3
    [proc] = host.spawned()
    assert set(proc.signals) == {signal.SIGTERM, signal.SIGKILL}


async def test_a_sigterm_handler_runs_its_delay_then_exits(
    autojump_clock: trio.testing.MockClock, host: SimHost
) -> None:
    result, _, took = await run(
        host, Script.sleeping(100).on_term(2, exit_code=0), max_runtime=5, grace_ceiling=10
    )
    assert (result.killed, result.reason, result.exit_code) == (True, "max_runtime", 0)
    assert took == 5 + 2


async def test_idle_timeout_counts_from_the_last_output(
    autojump_clock: trio.testing.MockClock, host: SimHost
) -> None:
    script = Script.printing((1, b"a"), (4, b"b")).then(Sleep(100))
    result, out, took = await run(host, script, idle_timeout=5)
    assert (result.killed, result.reason) == (True, "idle_timeout")
    assert out == b"ab"
    assert took == 4 + 5


async def test_a_stop_kills_and_keeps_the_reason(
    autojump_clock: trio.testing.MockClock, host: SimHost
) -> None:
    host.program("job", Script.sleeping(100))
    handle = JobHandle()

    async def stop_later() -> None:
        await trio.sleep(7)
        handle.stop("cancelled: by alice")

    async with trio.open_nursery() as nursery:
        nursery.start_soon(stop_later)
        result = await run_job(JobSpec(["job"], env=ENV), Sink(), host=host, handle=handle)
    assert (result.killed, result.reason, result.signal) == (True, "cancelled: by alice", 15)


async def test_a_child_holding_stdout_is_torn_down_with_the_group(
    autojump_clock: trio.testing.MockClock, host: SimHost
) -> None:
    holder = Script.printing((1, b"late\n")).then(Sleep(100)).ignoring_sigterm()
    script = Script((Write(b"main\n"), Fork(holder)))
    result, out, took = await run(host, script, grace_ceiling=2)
    # The main process ended on its own: what teardown does is no relabelling.
    assert (result.exit_code, result.killed) == (0, False)
    assert out == b"main\nlate\n"  # printed during the grace window, still read
    assert took == 2
    assert host.live() == []


async def test_uninterruptible_sleep_holds_sigkill_until_it_ends(
    autojump_clock: trio.testing.MockClock, host: SimHost
) -> None:
    result, _, took = await run(host, Script((Hang(5), Sleep(100))), max_runtime=1, grace_ceiling=1)
    assert (result.killed, result.signal) == (True, signal.SIGKILL)
    assert took == 5  # SIGTERM at 1 and SIGKILL at 2 both waited for the end of the hang


# -- the sweep ----------------------------------------------------------------------


async def test_an_escaped_setsid_child_is_found_and_removed_by_the_sweep(
    autojump_clock: trio.testing.MockClock, host: SimHost
) -> None:
    escapee = Script.sleeping(1000)
    script = Script((Write(b"x"), Fork(escapee, setsid=True, holds_output=False)))
    result, out, _ = await run(host, script, sweep_job_id=JOB, grace_ceiling=2)
    assert (result.exit_code, result.killed, out) == (0, False, b"x")
    child = next(p for p in host.history if not p.spawned_by_worker)
    assert child.sid == child.pgid == child.pid
    assert result.sweep.found == (child.pid,)
    assert result.sweep.remaining == ()
    assert result.sweep.clean
    assert child.returncode == -signal.SIGTERM


async def test_an_unkillable_escapee_is_reported_remaining(
    autojump_clock: trio.testing.MockClock, host: SimHost
) -> None:
    script = Script((Fork(Script((Hang(math.inf),)), setsid=True, holds_output=False),))
    result, _, took = await run(host, script, sweep_job_id=JOB, grace_ceiling=2)
    assert (result.exit_code, result.killed) == (0, False)
    [child] = host.live()
    assert child.state == "D"
    assert result.sweep.found == result.sweep.remaining == (child.pid,)
    assert not result.sweep.clean
    assert took == 2 + SWEEP_KILL_WAIT


async def test_an_unkillable_main_process_is_an_error_with_its_pid_remaining(
    autojump_clock: trio.testing.MockClock, host: SimHost
) -> None:
    result, _, took = await run(
        host, Script((Hang(math.inf),)), max_runtime=1, grace_ceiling=1, sweep_job_id=JOB
    )
    [proc] = host.spawned()
    assert result.killed
    assert result.exit_code is None
    assert result.error is not None
    assert "did not exit after SIGKILL" in result.error
    assert result.sweep.remaining == (proc.pid,)
    assert took >= 1 + 1 + KILL_WAIT


async def test_an_unreadable_environment_makes_the_sweep_blind(
    autojump_clock: trio.testing.MockClock, host: SimHost
) -> None:
    # Started while the job runs, so it may be the job's, and it cannot be read.
    async def meanwhile() -> None:
        await trio.sleep(0.5)
        host.start(Script((Sleep(math.inf),), environ_readable=False), signalable=False)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(meanwhile)
        result, _, _ = await run(host, Script((Sleep(1),)), sweep_job_id=JOB)
    assert result.sweep.scanned
    assert result.sweep.blind
    assert not result.sweep.clean


async def test_an_unreadable_process_with_an_older_pid_is_not_looked_at(
    autojump_clock: trio.testing.MockClock, host: SimHost
) -> None:
    # Same clock tick as the job's start, so its start time cannot rule it
    # out; its pid was handed out before the job's mark, which does.
    older = host.start(Script((Sleep(math.inf),), environ_readable=False), signalable=False)
    result, _, _ = await run(host, Script(), sweep_job_id=JOB)
    assert older.started_ticks == 0
    assert result.sweep.scanned
    assert not result.sweep.blind
    assert result.sweep.clean


async def test_a_worker_that_is_not_root_sees_no_environment(
    autojump_clock: trio.testing.MockClock, host: SimHost
) -> None:
    host.program("job", Script((Fork(Script.sleeping(50), setsid=True),)))
    host.environ_readable = False
    result = await run_job(JobSpec(["job"], env=ENV, sweep_job_id=JOB), Sink(), host=host)
    assert result.sweep.blind
    assert result.sweep.found == ()
    assert len(host.live(job_id=JOB)) == 1  # the escapee it could not see


async def test_the_sweep_catches_a_session_leaders_env_less_group(
    autojump_clock: trio.testing.MockClock, host: SimHost
) -> None:
    # The escapee leads its session, so its whole group goes with it.
    grandchild = Fork(Script.sleeping(500))
    escapee = Script((grandchild, Sleep(500)))
    host.program("job", Script((Fork(escapee, setsid=True),)))
    await run_job(JobSpec(["job"], env=ENV), Sink(), host=host)
    report = await sweep_job_survivors(JOB, grace=1, host=host)
    assert len(report.found) == 2
    assert host.live() == []


# -- the table, crashes and reboots ------------------------------------------------------


async def test_the_table_shows_sessions_groups_and_zombies(
    autojump_clock: trio.testing.MockClock, host: SimHost
) -> None:
    script = Script((Fork(Script.sleeping(10)), Fork(Script.sleeping(10), setsid=True), Sleep(1)))
    host.program("job", script)
    proc = await host.spawn(
        ["job"], cwd=None, env=ENV, stdin=False, separate_stderr=False, pty=False
    )
    await trio.sleep(0.5)
    rows = {p.pid: p for p in host.processes()}
    main = rows[proc.pid]
    assert (main.ppid, main.pgid, main.sid) == (host.own_pid(), proc.pid, proc.pid)
    kids = [p for p in rows.values() if p.ppid == proc.pid]
    assert sorted(k.pgid == proc.pid for k in kids) == [False, True]
    await trio.sleep(1)
    zombie = next(p for p in host.processes() if p.pid == proc.pid)
    assert zombie.state == "Z"
    assert not zombie.alive
    assert host.environ(proc.pid) == {}
    assert await proc.wait() == 0
    with pytest.raises(ProcessLookupError):
        host.environ(proc.pid)
    assert not host.signal_pid(proc.pid, 0)
    assert host.signal_group(proc.pid, 0)  # the forked child still holds the group


async def test_a_dead_worker_leaves_its_jobs_running_but_deaf(
    autojump_clock: trio.testing.MockClock, host: SimHost
) -> None:
    host.program("job", Script((Sleep(5), Write(b"into the void"), Sleep(5))))
    host.program("quiet", Script.sleeping(20))
    loud = await host.spawn(
        ["job"], cwd=None, env=ENV, stdin=False, separate_stderr=False, pty=False
    )
    quiet = await host.spawn(
        ["quiet"], cwd=None, env=ENV, stdin=False, separate_stderr=False, pty=False
    )
    host.worker_died()
    # The dying worker's own cleanup changes nothing.
    assert not host.signal_group(loud.pid, signal.SIGKILL)
    with pytest.raises(OSError, match="gone"):
        host.processes()
    assert await loud.stdout.receive_some() == b""
    await trio.sleep(6)
    [left] = host.live()
    assert left.pid == quiet.pid
    assert left.ppid == 1
    assert host.history[0].returncode == -signal.SIGPIPE  # wrote to a pipe nobody reads
    new_pid = host.worker_started()
    assert host.own_pid() == new_pid != left.pid
    assert any(p.pid == quiet.pid for p in host.processes())


async def test_a_reboot_ends_everything_and_changes_the_boot_id(
    autojump_clock: trio.testing.MockClock, host: SimHost
) -> None:
    host.program("job", Script((Hang(math.inf),)))
    await host.spawn(["job"], cwd=None, env=ENV, stdin=False, separate_stderr=False, pty=False)
    before = host.boot_id()
    host.reboot()
    assert host.boot_id() != before
    assert host.table() == []
    assert not host.worker_alive
    host.worker_started()
    assert [p.pid for p in host.processes()] == [1, host.own_pid()]


# -- the start-time filter, blindness, recycled pids -------------------------------


async def test_an_unreadable_process_older_than_the_job_does_not_blind_the_sweep(
    autojump_clock: trio.testing.MockClock, host: SimHost
) -> None:
    daemon = host.start(Script((Sleep(math.inf),), environ_readable=False, uid=1000))
    await trio.sleep(1)
    result, _, _ = await run(host, Script(), sweep_job_id=JOB)
    assert result.sweep.clean
    assert result.sweep.blind_pids == ()
    assert daemon.alive
    assert [p.uid for p in host.processes() if p.pid == daemon.pid] == [1000]


async def test_blind_pids_name_the_processes_the_sweep_could_not_inspect(
    autojump_clock: trio.testing.MockClock, host: SimHost
) -> None:
    await trio.sleep(1)
    hidden = Script((Sleep(math.inf),), environ_readable=False)
    result, _, _ = await run(host, Script((Fork(hidden, setsid=True),)), sweep_job_id=JOB)
    [escapee] = host.live(job_id=JOB)
    assert result.sweep.blind
    assert result.sweep.blind_pids == (escapee.pid,)
    doubt = unproven(result.sweep)
    assert doubt is not None
    assert str(escapee.pid) in doubt


class RecyclingHost(SimHost):
    """Between the sweep's scan and its signal, the victim exits and its pid goes
    to an unrelated newcomer."""

    victim: int | None = None
    newcomer: SimProcess | None = None

    def environ(self, pid: int) -> Mapping[str, str]:
        env = super().environ(pid)
        if pid == self.victim and self.newcomer is None:
            self.signal_pid(pid, signal.SIGKILL)
            self.newcomer = self.start(Script((Sleep(math.inf),)), pid=pid)
        return env


async def test_a_pid_recycled_between_scan_and_signal_is_never_signalled(
    autojump_clock: trio.testing.MockClock,
) -> None:
    host = RecyclingHost()
    host.program("job", Script((Fork(Script.sleeping(100), setsid=True), Sleep(2))))
    handle = JobHandle()

    async def victim_is_the_escapee() -> None:
        await trio.sleep(1)
        [escapee] = [p for p in host.live(job_id=JOB) if p.pid != handle.pid]
        host.victim = escapee.pid

    async with trio.open_nursery() as nursery:
        nursery.start_soon(victim_is_the_escapee)
        result = await run_job(
            JobSpec(["job"], env=ENV, sweep_job_id=JOB), Sink(), host=host, handle=handle
        )
    assert host.newcomer is not None
    assert host.newcomer.pid == host.victim
    assert host.newcomer.signals == []  # the old code sent it SIGTERM
    assert host.newcomer.alive
    assert result.sweep.found == (host.victim,)
    assert result.sweep.clean


async def test_a_seeded_host_gives_each_worker_process_its_own_repeatable_ids(
    autojump_clock: trio.testing.MockClock,
) -> None:
    first, again, unseeded = SimHost(seed=7), SimHost(seed=7), SimHost()
    draws = [h.new_rng().getrandbits(64) for h in (first, again)]
    assert draws[0] == draws[1]  # the same seed: the same ids, run after run
    first.worker_started()  # a new worker process: a stream of its own
    assert first.new_rng().getrandbits(64) != draws[0]
    assert unseeded.new_rng().getrandbits(64) != unseeded.new_rng().getrandbits(64)
