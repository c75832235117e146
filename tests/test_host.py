"""LinuxHost: host facts, /proc parsing, signals and spawning, against the real machine."""

from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path

import attrs
import pytest
import trio

from rc_worker.host import LinuxHost, ProcessInfo, parse_environ, parse_proc_stat

ENV = {"PATH": os.environ.get("PATH", os.defpath)}
GUARD = 30


def test_host_facts() -> None:
    host = LinuxHost()
    assert host.hostname()
    assert len(host.boot_id()) == 36
    assert host.kernel()
    assert host.cpu_count() >= 1
    assert host.mem_total_bytes() > 0
    assert host.disk_free_bytes("/definitely/not/there/yet") > 0


def test_parse_proc_stat_with_an_awkward_command_name() -> None:
    raw = b"4242 (a ) b (c) S 1 4200 4100 0 -1 4194560 0 0 0 0 0 0 0 0 20 0 1 0 123 0 0\n"
    assert parse_proc_stat(raw, 7) == ProcessInfo(
        pid=4242, ppid=1, pgid=4200, sid=4100, state="S", start_time=123, uid=7
    )


def test_parse_proc_stat_rejects_garbage() -> None:
    assert parse_proc_stat(b"") is None
    assert parse_proc_stat(b"12 (x)") is None


def test_zombie_is_not_alive() -> None:
    assert not ProcessInfo(1, 0, 1, 1, "Z").alive
    assert ProcessInfo(1, 0, 1, 1, "D").alive


def test_a_process_whose_first_thread_exited_is_alive_while_others_run() -> None:
    # Its row says Z (the first thread's state) but counts the threads still running.
    raw = b"4242 (job) Z 1 4242 4242 0 -1 4227084 0 0 0 0 0 0 0 0 20 0 3 0 123 0 0\n"
    info = parse_proc_stat(raw)
    assert info is not None
    assert info.threads == 3
    assert info.alive
    assert not attrs.evolve(info, threads=1).alive


def test_parse_environ() -> None:
    raw = b"A=1\0B=x=y\0A=2\0NOEQUALS\0=weird\0EMPTY=\0"
    assert parse_environ(raw) == {"A": "1", "B": "x=y", "EMPTY": ""}


def test_process_table_has_us_in_it() -> None:
    host = LinuxHost()
    me = host.own_pid()
    assert me == os.getpid()
    (row,) = [p for p in host.processes() if p.pid == me]
    assert row.pgid == os.getpgid(0)
    assert row.sid == os.getsid(0)
    assert row.ppid == os.getppid()
    assert row.alive


def test_environ_of_a_process() -> None:
    host = LinuxHost()
    with subprocess.Popen(
        ["sh", "-c", "echo ready; sleep 300"],
        env={**ENV, "RC_PROBE": "a=b"},
        stdout=subprocess.PIPE,
        start_new_session=True,
    ) as child:
        try:
            # Right after execve(2) the new image's environment is briefly
            # empty; once it has printed, it is certainly in place.
            assert child.stdout is not None
            assert child.stdout.readline() == b"ready\n"
            assert host.environ(child.pid)["RC_PROBE"] == "a=b"
        finally:
            os.killpg(child.pid, signal.SIGKILL)  # sh and its sleep
    with pytest.raises(ProcessLookupError):
        host.environ(child.pid)  # reaped: gone


def test_signals_to_what_is_gone_say_so() -> None:
    host = LinuxHost()
    with subprocess.Popen(["true"]) as child:
        pass
    assert not host.signal_pid(child.pid, 0)
    assert not host.signal_group(child.pid, 0)
    assert host.signal_pid(os.getpid(), 0)


async def test_spawn_starts_a_new_session() -> None:
    host = LinuxHost()
    with trio.fail_after(GUARD):
        proc = await host.spawn(
            ["sh", "-c", "ps -o pid=,pgid=,sid= -p $$"],
            cwd="/",
            env=ENV,
            stdin=False,
            separate_stderr=False,
            pty=False,
        )
        out = b""
        while chunk := await proc.stdout.receive_some():
            out += chunk
        assert await proc.wait() == 0
        await proc.stdout.aclose()
    pid, pgid, sid = (int(x) for x in out.split())
    assert pid == pgid == sid == proc.pid
    assert sid != os.getsid(0)


async def test_spawn_with_separate_stderr_and_stdin() -> None:
    host = LinuxHost()
    with trio.fail_after(GUARD):
        proc = await host.spawn(
            ["sh", "-c", "cat; echo oops >&2"],
            cwd=None,
            env=ENV,
            stdin=True,
            separate_stderr=True,
            pty=False,
        )
        assert proc.stdin is not None
        assert proc.stderr is not None
        await proc.stdin.send_all(b"in")
        await proc.stdin.aclose()
        assert await proc.stdout.receive_some() == b"in"
        assert await proc.stderr.receive_some() == b"oops\n"
        assert await proc.wait() == 0
        await proc.stdout.aclose()
        await proc.stderr.aclose()


async def test_spawn_on_a_pty_gives_a_controlling_terminal() -> None:
    host = LinuxHost()
    with trio.fail_after(GUARD):
        proc = await host.spawn(
            ["sh", "-c", "exec 3</dev/tty && stty size"],
            cwd=None,
            env=ENV,
            stdin=False,
            separate_stderr=False,
            pty=True,
        )
        out = b""
        while True:
            try:
                chunk = await proc.stdout.receive_some()
            except trio.BrokenResourceError:  # EIO: the terminal hung up
                break
            if not chunk:
                break
            out += chunk
        assert await proc.wait() == 0
        await proc.stdout.aclose()
    assert out.split() == [b"24", b"80"]


async def test_spawn_failure_is_an_oserror() -> None:
    host = LinuxHost()
    with pytest.raises(FileNotFoundError):
        await host.spawn(
            ["no-such-command-rc"], cwd=None, env=ENV, stdin=False, separate_stderr=False, pty=False
        )
    with pytest.raises(OSError, match="missing-dir"):
        await host.spawn(
            ["true"], cwd="/missing-dir", env=ENV, stdin=False, separate_stderr=False, pty=True
        )


def test_signal_group_reaches_the_whole_group() -> None:
    host = LinuxHost()
    with subprocess.Popen(["sleep", "300"], start_new_session=True) as child:
        assert host.signal_group(child.pid, signal.SIGTERM)
        assert child.wait(timeout=10) == -signal.SIGTERM


def test_a_process_row_carries_its_start_time_and_owner() -> None:
    host = LinuxHost()
    before = host.boot_ticks()
    with subprocess.Popen(["sleep", "300"], start_new_session=True) as child:
        try:
            [row] = [p for p in host.processes() if p.pid == child.pid]
            assert before <= row.start_time <= host.boot_ticks()
            assert row.uid == os.geteuid()
        finally:
            child.kill()


def test_a_pin_reaches_its_process_and_nothing_after_it_is_gone() -> None:
    host = LinuxHost()
    with subprocess.Popen(["sleep", "300"], start_new_session=True) as child:
        try:
            [row] = [p for p in host.processes() if p.pid == child.pid]
            # Another start time is another process that had the same pid.
            assert host.pin(child.pid, row.start_time + 1) is None
            pin = host.pin(child.pid, row.start_time)
            assert pin is not None
            assert pin.send_signal(0)
            child.kill()
            child.wait()
            assert not pin.send_signal(signal.SIGTERM)  # reaped: the pin reaches nothing
            pin.close()
            assert not pin.send_signal(0)
        finally:
            child.kill()
    assert host.pin(child.pid, row.start_time) is None


def test_the_real_host_keeps_its_files_on_the_real_disk_and_draws_fresh_ids(
    tmp_path: Path,
) -> None:
    host = LinuxHost()
    host.store.write_synced(tmp_path / "f", b"data")
    assert (tmp_path / "f").read_bytes() == b"data"
    assert host.store.which("sh", os.defpath) is not None
    assert host.new_rng().getrandbits(64) != host.new_rng().getrandbits(64)
