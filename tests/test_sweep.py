"""The RC_JOB_ID sweep: the sans-IO decisions, a scripted host in virtual time,
and real processes on the real clock."""

from __future__ import annotations

import contextlib
import os
import platform
import signal
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import attrs
import pytest
import trio
from hypothesis import given
from hypothesis import strategies as st

from rc_worker.core.pid_window import PidMark
from rc_worker.host import LinuxHost, ProcessInfo
from rc_worker.sweep import (
    NOT_SWEPT,
    SweepReport,
    classify,
    never_survivors,
    sweep_job_survivors,
    unproven,
)

ENV = {"PATH": os.environ.get("PATH", os.defpath)}
GUARD = 30

# -- the report -------------------------------------------------------------


def test_clean_needs_a_scan_full_sight_and_nothing_left() -> None:
    assert SweepReport(scanned=True).clean
    assert SweepReport(scanned=True, found=(5,)).clean
    assert not SweepReport(scanned=True, found=(5,), remaining=(5,)).clean
    assert not SweepReport(scanned=True, blind=True).clean
    assert not SweepReport(scanned=False).clean
    assert not NOT_SWEPT.clean


@given(
    scanned=st.booleans(),
    remaining=st.lists(st.integers(2, 99), max_size=3),
    blind_pids=st.lists(st.integers(2, 99), max_size=3),
    broken=st.booleans(),
)
def test_one_rule_proven_clean_only_when_it_saw_everything_and_nothing_is_left(
    scanned: bool, remaining: list[int], blind_pids: list[int], broken: bool
) -> None:
    report = SweepReport(
        scanned=scanned,
        remaining=tuple(remaining),
        blind=bool(blind_pids) or broken,
        blind_pids=tuple(blind_pids),
    )
    doubt = unproven(report)
    assert (doubt is None) == (scanned and not remaining and not blind_pids and not broken)
    assert report.clean == (doubt is None)
    if doubt is not None and scanned and not remaining:
        # The reason names what could not be seen, for the operator.
        assert all(str(pid) in doubt for pid in blind_pids)


# -- sans-IO ----------------------------------------------------------------


def proc(
    pid: int, *, ppid: int = 1, state: str = "S", sid: int | None = None, start: int = 0
) -> ProcessInfo:
    return ProcessInfo(
        pid=pid, ppid=ppid, pgid=pid, sid=pid if sid is None else sid, state=state, start_time=start
    )


def test_classify_skips_what_started_before_the_job() -> None:
    table = [proc(2, start=99), proc(3, start=100), proc(4, start=150)]
    result = classify(table, {3: "j", 4: "j"}, {2}, "j", since=100)
    assert [p.pid for p in result.matches] == [3, 4]
    assert result.blind_pids == ()  # the unreadable one is older than the job
    assert classify(table, {}, {2, 4}, "j", since=100).blind_pids == (4,)
    assert classify(table, {}, {2, 4}, "j").blind_pids == (2, 4)  # no bound known


def test_never_survivors_are_self_init_and_ancestors() -> None:
    table = [proc(1, ppid=0), proc(10), proc(20, ppid=10), proc(30, ppid=20), proc(40, ppid=30)]
    assert never_survivors(table, own_pid=30) == {1, 10, 20, 30}


def test_classify_matches_the_exact_id_of_live_processes() -> None:
    table = [proc(2), proc(3), proc(4, state="Z"), proc(5), proc(6)]
    job_ids = {2: "j", 3: "jx", 4: "j", 5: None, 6: "J"}
    result = classify(table, job_ids, set(), "j")
    assert [p.pid for p in result.matches] == [2]
    assert not result.blind


def test_classify_is_blind_when_a_live_process_was_unreadable() -> None:
    table = [proc(2), proc(3, state="Z")]
    assert classify(table, {}, {2}, "j").blind
    assert not classify(table, {}, {3}, "j").blind


states = st.sampled_from(["R", "S", "D", "T", "Z", "X", "I"])
values = st.one_of(st.none(), st.sampled_from(["j", "jx", "xj", "J", "j ", ""]))


@given(st.lists(st.tuples(states, values), max_size=30))
def test_classify_properties(rows: list[tuple[str, str | None]]) -> None:
    table = [proc(pid, state=state) for pid, (state, _) in enumerate(rows, start=2)]
    job_ids = {pid: value for pid, (_, value) in enumerate(rows, start=2)}
    result = classify(table, job_ids, set(), "j")
    for p in result.matches:
        assert p.alive
        assert job_ids[p.pid] == "j"
    expected = {p.pid for p in table if p.alive and job_ids[p.pid] == "j"}
    assert {p.pid for p in result.matches} == expected


# -- a scripted host in virtual time ---------------------------------------


@attrs.define
class Scripted:
    pid: int
    env: dict[str, str] | None  # None: the environment is unreadable (EACCES)
    ppid: int = 1
    state: str = "S"
    sid: int | None = None
    dies_of: frozenset[int] = frozenset({signal.SIGTERM, signal.SIGKILL})
    vanishes_when_read: bool = False
    forks_on_term: Scripted | None = None


class ScriptedHost:
    """Just the part of the Host protocol the sweep uses."""

    def __init__(self, *procs: Scripted, own_pid: int = 100) -> None:
        self.procs = {p.pid: p for p in procs}
        self.own = own_pid
        self.signals: list[tuple[str, int, int]] = []
        self.listing_fails = False

    def processes(self) -> list[ProcessInfo]:
        if self.listing_fails:
            raise PermissionError(13, "cannot list /proc")
        return [
            ProcessInfo(p.pid, p.ppid, p.sid or p.pid, p.sid or p.pid, p.state)
            for p in self.procs.values()
        ]

    def environ(self, pid: int) -> dict[str, str]:
        p = self.procs.get(pid)
        if p is None or p.vanishes_when_read:
            self.procs.pop(pid, None)
            raise ProcessLookupError(3, "gone")
        if p.env is None:
            raise PermissionError(13, "Permission denied")
        return p.env

    def signal_pid(self, pid: int, sig: int) -> bool:
        self.signals.append(("pid", pid, sig))
        p = self.procs.get(pid)
        if p is None:
            return False
        if sig in p.dies_of:
            p.state = "Z"
        if sig == signal.SIGTERM and p.forks_on_term is not None:
            self.procs[p.forks_on_term.pid] = p.forks_on_term
        return True

    def signal_group(self, pgid: int, sig: int) -> bool:
        self.signals.append(("group", pgid, sig))
        return True

    def boot_ticks(self) -> int:
        return 0

    def pin(self, pid: int, start_time: int) -> PidPin:
        # No pid is recycled here: a pin is the pid itself.
        return PidPin(self, pid)

    def own_pid(self) -> int:
        return self.own


JOB = {"RC_JOB_ID": "j1"}


async def sweep(host: ScriptedHost, grace: float = 10.0) -> SweepReport:
    return await sweep_job_survivors("j1", grace=grace, host=host)  # type: ignore[arg-type]


async def test_nothing_found_is_clean(autojump_clock: trio.abc.Clock) -> None:
    host = ScriptedHost(Scripted(2, {"RC_JOB_ID": "other"}))
    assert await sweep(host) == SweepReport(scanned=True)
    assert host.signals == []


async def test_a_survivor_goes_on_sigterm(autojump_clock: trio.abc.Clock) -> None:
    host = ScriptedHost(Scripted(2, JOB, sid=99))
    report = await sweep(host)
    assert report == SweepReport(scanned=True, found=(2,))
    assert report.clean
    assert ("pid", 2, signal.SIGTERM) in host.signals
    assert all(sig != signal.SIGKILL for _, _, sig in host.signals)


async def test_a_survivor_ignoring_sigterm_gets_sigkill(autojump_clock: trio.abc.Clock) -> None:
    host = ScriptedHost(Scripted(2, JOB, dies_of=frozenset({signal.SIGKILL})))
    report = await sweep(host, grace=5)
    assert report == SweepReport(scanned=True, found=(2,))
    assert [s for s in host.signals if s[0] == "pid"] == [
        ("pid", 2, signal.SIGTERM),
        ("pid", 2, signal.SIGKILL),
    ]


async def test_a_session_leader_has_its_group_signalled(autojump_clock: trio.abc.Clock) -> None:
    host = ScriptedHost(Scripted(2, JOB))  # sid == pid: it called setsid
    await sweep(host)
    assert ("group", 2, signal.SIGTERM) in host.signals


async def test_what_survives_sigkill_is_remaining(autojump_clock: trio.abc.Clock) -> None:
    host = ScriptedHost(Scripted(2, JOB, state="D", dies_of=frozenset()))
    report = await sweep(host, grace=1)
    assert report == SweepReport(scanned=True, found=(2,), remaining=(2,))
    assert not report.clean


async def test_unreadable_environment_makes_it_blind(autojump_clock: trio.abc.Clock) -> None:
    host = ScriptedHost(Scripted(2, None), Scripted(3, JOB))
    report = await sweep(host)
    assert report.blind
    assert report.found == (3,)
    assert not report.clean


async def test_vanishing_mid_scan_is_not_blindness(autojump_clock: trio.abc.Clock) -> None:
    host = ScriptedHost(Scripted(2, JOB, vanishes_when_read=True))
    assert await sweep(host) == SweepReport(scanned=True)


async def test_an_unlistable_table_is_not_scanned(autojump_clock: trio.abc.Clock) -> None:
    host = ScriptedHost(Scripted(2, JOB))
    host.listing_fails = True
    report = await sweep(host)
    assert not report.scanned
    assert not report.clean


async def test_self_and_ancestors_are_never_touched(autojump_clock: trio.abc.Clock) -> None:
    # The worker (100) runs inside job j1 under a shell (50) that carries it.
    host = ScriptedHost(
        Scripted(50, JOB, ppid=1),
        Scripted(100, JOB, ppid=50),
        Scripted(1, None, ppid=0),
    )
    assert await sweep(host) == SweepReport(scanned=True)
    assert host.signals == []


async def test_zombies_are_not_survivors(autojump_clock: trio.abc.Clock) -> None:
    host = ScriptedHost(Scripted(2, JOB, state="Z"))
    assert await sweep(host) == SweepReport(scanned=True)


async def test_a_child_forked_during_grace_is_found_too(autojump_clock: trio.abc.Clock) -> None:
    late = Scripted(3, JOB, dies_of=frozenset({signal.SIGKILL}))
    host = ScriptedHost(Scripted(2, JOB, forks_on_term=late))
    report = await sweep(host, grace=2)
    assert report == SweepReport(scanned=True, found=(2, 3))


async def test_rejects_an_empty_job_id() -> None:
    with pytest.raises(ValueError, match="non-empty"):
        await sweep_job_survivors("", grace=1)


# -- real processes ---------------------------------------------------------


def _state(pid: int) -> str | None:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]
    except OSError:
        return None


def alive(pid: int) -> bool:
    return _state(pid) not in (None, "Z", "X")


@pytest.fixture
def children() -> Iterator[list[subprocess.Popen[bytes]]]:
    """Processes a test starts itself; killed and reaped at the end, whatever happened."""
    started: list[subprocess.Popen[bytes]] = []
    yield started
    for p in started:
        if p.poll() is None:
            with contextlib.suppress(OSError):
                p.kill()
        p.wait(timeout=10)


def start(
    children: list[subprocess.Popen[bytes]], argv: list[str], job_id: str, **kw: object
) -> subprocess.Popen[bytes]:
    p = subprocess.Popen(argv, env={**ENV, "RC_JOB_ID": job_id}, **kw)  # type: ignore[call-overload]
    children.append(p)
    return p  # type: ignore[no-any-return]


def new_id() -> str:
    return f"sweep-{uuid.uuid4()}"


async def test_real_processes_older_than_the_job_are_never_inspected(
    children: list[subprocess.Popen[bytes]],
) -> None:
    # The same id on a process started before the job (a reused id, another
    # worker's job): it cannot descend from the job, so the sweep leaves it.
    job_id = new_id()
    older = start(children, ["sleep", "300"], job_id, start_new_session=True)
    host = LinuxHost()
    await trio.sleep(0.05)  # a few clock ticks
    since = host.boot_ticks()
    newer = start(children, ["sleep", "300"], job_id, start_new_session=True)
    with trio.fail_after(GUARD):
        report = await sweep_job_survivors(job_id, grace=1, host=host, since=since)
    assert report.found == (newer.pid,)
    assert report.clean
    assert older.poll() is None
    assert newer.wait(timeout=10) == -signal.SIGTERM


async def test_real_sweep_with_a_pid_mark_reads_only_newer_rows_and_finds_the_escaped(
    children: list[subprocess.Popen[bytes]],
) -> None:
    # The worker's sweep without a cgroup: a pid mark before the job, then
    # only rows of pids handed out since are read (core/pid_window.py). The
    # older carrier of the id is not even looked at; the escaped one is found.
    job_id = new_id()
    older = start(children, ["sleep", "300"], job_id, start_new_session=True)
    seen: list[list[int]] = []

    class Watched(LinuxHost):
        def processes_since(self, mark: PidMark) -> list[ProcessInfo] | None:
            rows = super().processes_since(mark)
            seen.append([r.pid for r in rows or []])
            return rows

    host = Watched()
    mark = host.pid_mark()
    if mark is None:
        pytest.skip("this host's /proc is another pid namespace's, or unreadable")
    escaped = start(children, ["sleep", "300"], job_id, start_new_session=True)
    with trio.fail_after(GUARD):
        report = await sweep_job_survivors(job_id, grace=1, host=host, mark=mark)
    assert report.found == (escaped.pid,)
    assert report.clean
    assert seen
    assert all(older.pid not in pids for pids in seen)
    assert escaped.pid in seen[0]
    assert older.poll() is None
    assert escaped.wait(timeout=10) == -signal.SIGTERM


async def test_real_escaped_process_is_found_and_removed(
    children: list[subprocess.Popen[bytes]],
) -> None:
    job_id = new_id()
    escaped = start(children, ["sleep", "300"], job_id, start_new_session=True)
    with trio.fail_after(GUARD):
        report = await sweep_job_survivors(job_id, grace=1)
    assert report.found == (escaped.pid,)
    assert report.remaining == ()
    assert report.clean
    assert escaped.wait(timeout=10) == -signal.SIGTERM


async def test_real_sigterm_ignoring_process_is_killed(
    children: list[subprocess.Popen[bytes]],
) -> None:
    job_id = new_id()
    stubborn = start(
        children,
        ["sh", "-c", "trap '' TERM; echo ready; exec sleep 300"],
        job_id,
        stdout=subprocess.PIPE,
    )
    assert stubborn.stdout is not None
    assert stubborn.stdout.readline() == b"ready\n"  # the trap is in place
    with trio.fail_after(GUARD):
        report = await sweep_job_survivors(job_id, grace=0.2)
    assert report.found == (stubborn.pid,)
    assert report.clean
    assert stubborn.wait(timeout=10) == -signal.SIGKILL
    stubborn.stdout.close()


async def test_real_prefix_and_suffix_matches_are_left_alone(
    children: list[subprocess.Popen[bytes]],
) -> None:
    job_id = new_id()
    longer = start(children, ["sleep", "300"], job_id + "x")
    shorter = start(children, ["sleep", "300"], job_id[:-1])
    with trio.fail_after(GUARD):
        report = await sweep_job_survivors(job_id, grace=0.2)
    assert report.found == ()
    assert report.clean
    assert alive(longer.pid)
    assert alive(shorter.pid)


async def test_real_zombie_is_never_reported(children: list[subprocess.Popen[bytes]]) -> None:
    job_id = new_id()
    zombie = start(children, ["true"], job_id)
    with trio.fail_after(GUARD):
        # Wait for it to exit without reaping it (WNOWAIT): a zombie.
        await trio.to_thread.run_sync(os.waitid, os.P_PID, zombie.pid, os.WEXITED | os.WNOWAIT)
        assert _state(zombie.pid) == "Z"
        report = await sweep_job_survivors(job_id, grace=0.2)
    assert report.found == ()
    assert report.clean
    assert zombie.wait(timeout=10) == 0


# exit(2) of one thread (glibc's exit() ends them all): its number where the
# test knows it.
THREAD_EXIT = {"x86_64": 60, "aarch64": 93}.get(platform.machine())


async def test_real_process_whose_first_thread_exited_is_found_and_removed(
    children: list[subprocess.Popen[bytes]],
) -> None:
    """A process whose first thread exited while another runs on shows ``Z`` in its
    /proc row and has no environment under its own pid; it had been taken for a zombie
    and left running, and the device offered as clean."""
    if THREAD_EXIT is None:
        pytest.skip(f"no exit(2) number known for {platform.machine()}")
    job_id = new_id()
    script = (
        "import ctypes, threading, time\n"
        "threading.Thread(target=time.sleep, args=(300,)).start()\n"
        f"ctypes.CDLL(None).syscall({THREAD_EXIT}, 0)\n"
    )
    escaped = start(children, [sys.executable, "-c", script], job_id, start_new_session=True)
    with trio.fail_after(GUARD):
        for _ in range(3000):  # until its first thread has exited
            if _state(escaped.pid) == "Z":
                break
            await trio.sleep(0.01)
        report = await sweep_job_survivors(job_id, grace=1)
    assert report.found == (escaped.pid,)
    assert report.clean
    assert escaped.wait(timeout=10) == -signal.SIGTERM


@attrs.define
class PidPin:
    host: ScriptedHost
    pid: int

    def send_signal(self, sig: int) -> bool:
        return self.host.signal_pid(self.pid, sig)

    def close(self) -> None:
        pass
