"""A cgroup v2 per job: the parsers and the tree plan (sans-IO), the simulated
hierarchy in virtual time, and real cgroups and processes as root.

The real tests need a unified hierarchy this process may create cgroups in
(CI's case: root, v2 mounted beside v1 controllers). Each works under a tree
of its own and removes it, whatever happens.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import signal
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import trio
import trio.testing
from hypothesis import given
from hypothesis import strategies as st

from rc_worker.cgroup import (
    CgroupUnavailable,
    Containment,
    _Terminator,
    clear_strays,
    cpu_max_value,
    kill_all,
    limits_for,
    plan_tree,
    preflight,
    set_up,
    start_containment,
    sweep_cgroup,
    usage,
)
from rc_worker.cgroup import remove as remove_cgroup
from rc_worker.core.cgroup_parse import (
    parse_io_stat,
    parse_keyed,
    parse_mountinfo,
    parse_pids,
    parse_proc_cgroup,
)
from rc_worker.core.errors import ConfigError
from rc_worker.core.model import Assignment, Claim, VerifyResult
from rc_worker.core.reports import finish_report
from rc_worker.host import LinuxHost
from rc_worker.procfs import ProcessInfo
from rc_worker.recovery import recover
from rc_worker.spool import JobDir, write_json_durably
from rc_worker.supervise import JobSpec, run_job
from rc_worker.sweep import unproven
from rc_worker.testing import local_system, make_config
from rc_worker.testing.sim import Fork, Hang, Script, SimHost, Sleep

GUARD = 60
ENV = {"PATH": os.environ.get("PATH", os.defpath), "RC_JOB_ID": "j-1"}

# -- sans-IO ------------------------------------------------------------------------

MOUNTINFO = """\
31 23 0:28 / /sys/fs/cgroup rw,relatime - tmpfs tmpfs rw,mode=755
35 31 0:32 / /sys/fs/cgroup/memory rw,relatime - cgroup cgroup rw,memory
41 31 0:38 / /sys/fs/cgroup/unified rw,relatime - cgroup2 cgroup2 rw
"""


def test_the_v2_mount_is_found_beside_v1() -> None:
    assert parse_mountinfo(MOUNTINFO) == "/sys/fs/cgroup/unified"
    assert parse_mountinfo("\n".join(MOUNTINFO.splitlines()[:2])) is None
    # Optional fields before the separator, and an escaped space in the path.
    line = "29 1 0:26 / /sys/fs/cgroup\\040v2 rw shared:4 master:1 - cgroup2 cgroup2 rw\n"
    assert parse_mountinfo(line) == "/sys/fs/cgroup v2"


def test_the_own_cgroup_is_the_0_line() -> None:
    text = "4:memory:/process_api/x\n1:cpu:/\n0::/system.slice/rc-worker.service\n"
    assert parse_proc_cgroup(text) == "/system.slice/rc-worker.service"
    assert parse_proc_cgroup("0::/\n") == "/"
    assert parse_proc_cgroup("0::/gone (deleted)\n") == "/gone"
    assert parse_proc_cgroup("4:memory:/x\n") is None


def test_io_stat_is_summed_over_devices() -> None:
    text = "8:0 rbytes=10 wbytes=20 rios=1 wios=2 dbytes=0 dios=0\n259:0 rbytes=5 wbytes=0\n"
    assert parse_io_stat(text) == {
        "io_read_bytes": 15,
        "io_write_bytes": 20,
        "io_reads": 1,
        "io_writes": 2,
    }
    assert parse_io_stat("") == dict.fromkeys(parse_io_stat(""), 0)


def test_flat_keyed_files_and_pid_lists() -> None:
    assert parse_keyed("populated 1\nfrozen 0\n") == {"populated": 1, "frozen": 0}
    assert parse_keyed("usage_usec 12\nweird\n") == {"usage_usec": 12}
    assert parse_pids("12\n13\n\n") == (12, 13)


@given(
    own=st.sampled_from(["/", "/system.slice/rc-worker.service", "/a"]),
    available=st.frozensets(st.sampled_from(["memory", "cpu", "io", "pids", "hugetlb"])),
)
def test_the_worker_leaves_its_cgroup_only_to_delegate_controllers(
    own: str, available: frozenset[str]
) -> None:
    plan = plan_tree(own, available, "t", frozenset({"memory", "cpu"}))
    assert plan.enable == available & {"memory", "cpu"}
    assert plan.tree == f"{own.rstrip('/')}/rc-worker-t"
    # The no-internal-processes rule binds every cgroup but the root.
    assert plan.move_self == (bool(plan.enable) and own != "/")
    assert plan.home == (f"{own}/worker" if plan.move_self else own)


def test_limits_need_their_controller() -> None:
    both = frozenset({"memory", "cpu"})
    assert limits_for(2**30, 1.5, both) == {"memory.max": str(2**30), "cpu.max": "150000 100000"}
    assert limits_for(2**30, 1.5, frozenset()) == {}
    assert cpu_max_value(0.001) == "1000 100000"  # the kernel's floor
    with pytest.raises(ValueError, match="number of CPUs"):
        cpu_max_value(math.inf)


# -- the simulated hierarchy -----------------------------------------------------------


def sim_host(*, controllers: frozenset[str] = frozenset()) -> SimHost:
    host = SimHost()
    host.cgroup_v2 = True
    host.cgroup_controllers = controllers
    return host


class Sink:
    def __init__(self) -> None:
        self.data = bytearray()

    async def __call__(self, chunk: bytes) -> None:
        self.data += chunk


async def test_without_a_v2_hierarchy_auto_says_why_and_required_refuses(
    autojump_clock: trio.testing.MockClock,
) -> None:
    host = SimHost()
    assert start_containment(host, "auto", tag="t", needs={}) is None
    assert host.containment is None
    with pytest.raises(ConfigError, match="cgroup: required, but no cgroup v2 hierarchy"):
        start_containment(host, "required", tag="t", needs={})
    with pytest.raises(CgroupUnavailable):
        set_up(host, tag="t")
    assert start_containment(sim_host(), "off", tag="t", needs={}) is None


async def test_a_limit_whose_controller_is_not_delegated_is_refused(
    autojump_clock: trio.testing.MockClock,
) -> None:
    host = sim_host(controllers=frozenset({"cpu"}))
    with pytest.raises(ConfigError, match=r"devices\[0\]\.memory_max: the memory controller"):
        start_containment(host, "auto", tag="t", needs={"devices[0].memory_max": "memory"})
    assert host.containment is None
    assert not any("rc-worker-t" in c for c in host.cgroups())  # nothing left behind


async def test_delegating_controllers_moves_the_worker_into_a_leaf(
    autojump_clock: trio.testing.MockClock,
) -> None:
    host = sim_host(controllers=frozenset({"memory", "cpu"}))
    containment = start_containment(host, "auto", tag="t", needs={"devices[0].cpu_max": "cpu"})
    assert containment is not None
    assert host.worker_cgroup == f"{host.service_cgroup}/worker"
    assert containment.controllers == {"memory", "cpu"}
    limits = limits_for(2**30, 2.0, containment.controllers)
    host.program("job", Script.sleeping(3))
    written: dict[str, str] = {}

    async def look_while_it_runs() -> None:
        await trio.sleep(1)
        [proc] = host.spawned()
        written.update(
            (name, host.cgroup_read(proc.cgroup, name)) for name in ("memory.max", "cpu.max")
        )

    async with trio.open_nursery() as nursery:
        nursery.start_soon(look_while_it_runs)
        result = await run_job(
            JobSpec(["job"], env=ENV, sweep_job_id="j-1", cgroup_limits=limits), Sink(), host=host
        )
    assert written == {"memory.max": str(2**30), "cpu.max": "200000 100000"}
    assert result.sweep.method == "cgroup"
    assert result.usage["cpu_usec"] == 3_000_000  # the simulated host counts wall time
    assert result.usage["memory_peak_bytes"] == 0
    assert host.cgroups() == sorted(
        ["/", "/system.slice", host.service_cgroup, containment.home, containment.tree]
    )


async def test_a_cgroup_sweep_is_exact_where_the_environment_sweep_is_blind(
    autojump_clock: trio.testing.MockClock,
) -> None:
    host = sim_host()
    host.environ_readable = False  # a worker that is not root
    start_containment(host, "auto", tag="t", needs={})
    hidden = Script((Sleep(math.inf),), environ_readable=False)
    host.program("job", Script((Fork(hidden, setsid=True),)))
    result = await run_job(JobSpec(["job"], env=ENV, sweep_job_id="j-1"), Sink(), host=host)
    assert result.sweep.method == "cgroup"
    assert result.sweep.clean
    assert len(result.sweep.found) == 1
    assert host.live(job_id="j-1") == []
    assert host.containment is not None
    assert host.cgroups()[-1] == host.containment.tree  # the job's cgroup is removed


async def test_a_process_stuck_in_the_kernel_remains_and_keeps_its_cgroup(
    autojump_clock: trio.testing.MockClock,
) -> None:
    host = sim_host()
    start_containment(host, "auto", tag="t", needs={})
    host.program("job", Script((Fork(Script((Hang(math.inf),)), setsid=True),)))
    result = await run_job(
        JobSpec(["job"], env=ENV, sweep_job_id="j-1", grace_ceiling=1), Sink(), host=host
    )
    [stuck] = host.live(job_id="j-1")
    assert result.sweep.remaining == (stuck.pid,)
    assert unproven(result.sweep) == f"processes [{stuck.pid}] survived SIGKILL"
    assert stuck.cgroup in host.cgroups()  # left for the next start's recovery


async def test_cgroup_kill_without_cgroup_kill_freezes_and_kills_each(
    autojump_clock: trio.testing.MockClock,
) -> None:
    class OldKernel(SimHost):
        def cgroup_write(self, path: str, name: str, value: str) -> None:
            if name == "cgroup.kill":
                raise FileNotFoundError(2, "no cgroup.kill before Linux 5.14")
            super().cgroup_write(path, name, value)

    host = OldKernel()
    host.cgroup_v2 = True
    host.cgroup_mkdir("/j")
    host.program("job", Script((Fork(Script.sleeping(100)), Sleep(100))))
    proc = await host.spawn(
        ["job"], cwd=None, env=ENV, stdin=False, separate_stderr=False, pty=False, cgroup="/j"
    )
    await trio.sleep(1)
    assert len(host.members("/j")) == 2
    kill_all(host, "/j")
    assert host.members("/j") == []
    assert await proc.wait() == -signal.SIGKILL
    assert host.cgroup_read("/j", "cgroup.freeze") == "0"  # thawed again


async def test_recovery_after_a_crash_proves_gone_from_the_cgroup_for_a_worker_not_root(
    autojump_clock: trio.testing.MockClock, tmp_path: Path
) -> None:
    host = sim_host()
    host.environ_readable = False
    containment = start_containment(host, "auto", tag="t", needs={})
    assert containment is not None
    leftover = containment.leaf("j-1.1")
    host.cgroup_mkdir(leftover)
    host.program("job", Script((Fork(Script.sleeping(30), setsid=True), Sleep(5))))
    await host.spawn(
        ["job"], cwd=None, env=ENV, stdin=False, separate_stderr=False, pty=False, cgroup=leftover
    )
    journal(tmp_path, host.boot_id(), leftover)
    host.worker_died()
    await trio.sleep(60)  # the job and its escapee end on their own
    host.worker_started()
    [entry] = await recover(tmp_path, boot_id=host.boot_id(), require_manual_clear=False, host=host)
    assert entry.claim is Claim.GONE
    assert entry.sweep.method == "cgroup"
    assert entry.sweep.found == ()
    assert leftover not in host.cgroups()


def journal(root: Path, boot_id: str, cgroup: str, *, job_id: str = "j-1") -> None:
    job_dir = JobDir(root, f"{job_id}.1")
    job_dir.create()
    write_json_durably(
        job_dir.journal,
        {
            "job_id": job_id,
            "attempt": 1,
            "device": "gpu0",
            "boot_id": boot_id,
            "spawned": True,
            "cgroup": cgroup,
        },
    )


# -- real cgroups, real processes ---------------------------------------------------------


@pytest.fixture
def real() -> Iterator[LinuxHost]:
    """A LinuxHost with a cgroup tree of this test's own, removed afterwards."""
    host = LinuxHost()
    try:
        containment, _ = set_up(host, tag=f"test-{uuid.uuid4().hex[:8]}")
    except CgroupUnavailable as e:
        pytest.skip(f"no cgroup v2 hierarchy this test may use: {e}")
    host.containment = containment
    try:
        yield host
    finally:
        with contextlib.suppress(OSError):
            for child in host.cgroup_children(containment.tree):
                kill_all(host, f"{containment.tree}/{child}")
        for _ in range(100):
            if remove_cgroup(host, containment.tree):
                break
            time.sleep(0.05)  # a killed process takes a moment to leave


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_bytes().rpartition(b")")[2].split()[0]
    except OSError:
        return False
    return state not in (b"Z", b"X")


async def test_a_child_that_clears_its_environment_and_leaves_its_session_is_killed(
    real: LinuxHost,
) -> None:
    # setsid, and exec with an empty environment: no group, no session, no RC_JOB_ID.
    # The job ends once the escapee leads its own session (so the group teardown misses it).
    script = (
        "env -i setsid sleep 300 >/dev/null 2>&1 & "
        'while [ "$(ps -o sid= -p $! | tr -d " ")" != "$!" ]; do sleep 0.01; done; echo $!'
    )
    sink = Sink()
    with trio.fail_after(GUARD):
        result = await run_job(
            JobSpec(["sh", "-c", script], env=ENV, sweep_job_id="j-1", grace_ceiling=1),
            sink,
            host=real,
        )
    escapee = int(bytes(sink.data).split()[0])
    try:
        assert result.exit_code == 0
        assert not result.killed  # reaping a survivor never relabels the job
        assert result.sweep.method == "cgroup"
        assert escapee in result.sweep.found
        assert result.sweep.clean
        assert not alive(escapee)
        assert "cpu_usec" in result.usage  # accounted from the job's cgroup
        assert real.containment is not None
        assert real.cgroup_children(real.containment.tree) == []  # removed
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(escapee, signal.SIGKILL)


BOMB = """\
d=$1
if [ "$d" -gt 0 ]; then
  setsid sh "$0" $((d - 1)) "$2" &
  setsid sh "$0" $((d - 1)) "$2" &
fi
touch "$2/$$"
exec sleep 300
"""


async def test_a_fork_bomb_bounded_by_depth_is_contained(real: LinuxHost, tmp_path: Path) -> None:
    # Depth 5: 63 processes, all but the first leading a session of its own.
    # The job's main process ends once all have started, so nothing but the
    # cgroup holds them together.
    bomb = tmp_path / "bomb.sh"
    bomb.write_text(BOMB)
    marks = tmp_path / "started"
    marks.mkdir()
    wait = f'sh "$0" 5 {marks} & while [ $(ls {marks} | wc -l) -lt 63 ]; do sleep 0.05; done'
    with trio.fail_after(GUARD):
        result = await run_job(
            JobSpec(["sh", "-c", wait, str(bomb)], env=ENV, sweep_job_id="j-1", grace_ceiling=0.5),
            Sink(),
            host=real,
        )
    assert result.exit_code == 0
    assert result.sweep.method == "cgroup"
    assert result.sweep.clean
    # The first is in the job's process group, ended by the group teardown; the
    # 62 that left it are the sweep's.
    assert len(result.sweep.found) >= 62
    assert not any(alive(int(mark.name)) for mark in marks.iterdir())
    assert real.containment is not None
    assert real.cgroup_children(real.containment.tree) == []


async def test_recovery_of_a_real_cgroup_kills_what_is_left_and_proves_gone(
    real: LinuxHost, tmp_path: Path
) -> None:
    assert real.containment is not None
    leftover = real.containment.leaf("j-1.1")
    real.cgroup_mkdir(leftover)
    with trio.fail_after(GUARD):
        proc = await real.spawn(
            ["sleep", "300"],
            cwd=None,
            env=ENV,
            stdin=False,
            separate_stderr=False,
            pty=False,
            cgroup=leftover,
        )
        journal(tmp_path, real.boot_id(), leftover, job_id=f"j-{uuid.uuid4().hex}")
        [entry] = await recover(
            tmp_path, boot_id=real.boot_id(), require_manual_clear=False, host=real
        )
        assert await proc.wait() == -signal.SIGTERM
    assert entry.claim is Claim.GONE
    assert entry.sweep.method == "cgroup"
    assert entry.sweep.found == (proc.pid,)
    assert real.cgroup_children(real.containment.tree) == []


async def test_the_accounting_of_a_real_cgroup(real: LinuxHost) -> None:
    assert real.containment is not None
    path = real.containment.leaf()
    real.cgroup_mkdir(path)
    try:
        with trio.fail_after(GUARD):
            proc = await real.spawn(
                ["sh", "-c", "i=0; while [ $i -lt 20000 ]; do i=$((i+1)); done"],
                cwd=None,
                env=ENV,
                stdin=False,
                separate_stderr=False,
                pty=False,
                cgroup=path,
            )
            assert await proc.wait() == 0
        found = usage(real, path)
        assert found["cpu_usec"] > 0
        assert found["cpu_usec"] >= found["cpu_user_usec"]
    finally:
        remove_cgroup(real, path)
    # The worker came back to where it was.
    assert real.own_cgroup() == real.containment.home


async def test_a_sweep_of_a_cgroup_that_is_gone_is_clean(real: LinuxHost) -> None:
    assert real.containment is not None
    report = await sweep_cgroup(real, real.containment.leaf("never-made"), grace=1)
    assert report.clean
    assert report.method == "cgroup"


def test_containment_leaves_are_unique() -> None:
    c = Containment(tree="/t", home="/")
    assert c.leaf("j.1") == "/t/j.1"
    assert c.leaf() != c.leaf()
    with pytest.raises(ValueError, match="one path component"):
        c.leaf("../x")


async def test_at_start_strays_of_a_crashed_worker_are_ended_and_kept_ones_left(
    autojump_clock: trio.testing.MockClock,
) -> None:
    host = sim_host()
    containment = start_containment(host, "auto", tag="t", needs={})
    assert containment is not None
    host.program("hook", Script((Fork(Script.sleeping(math.inf), setsid=True), Sleep(1))))
    stray, kept, empty = (containment.leaf(n) for n in ("p-1", "j-1.1", "p-2"))
    for path in (stray, kept, empty):
        host.cgroup_mkdir(path)
    for path in (stray, kept):
        await host.spawn(
            ["hook"], cwd=None, env=ENV, stdin=False, separate_stderr=False, pty=False, cgroup=path
        )
    host.worker_died()
    host.worker_started()
    start_containment(host, "auto", tag="t", needs={})
    assert await clear_strays(host, containment, keep={"j-1.1"}) == ["p-1"]
    assert stray not in host.cgroups()
    assert empty not in host.cgroups()
    assert len(host.members(kept)) == 2  # recovery's to report, not ours to touch


# -- the worker ----------------------------------------------------------------------------


async def test_a_worker_with_cgroup_required_and_none_to_use_refuses_to_start(
    autojump_clock: trio.testing.MockClock, tmp_path: Path
) -> None:
    config = make_config(tmp_path, cgroup="required")
    with pytest.RaisesGroup(
        pytest.RaisesExc(ConfigError, match="cgroup: required, but no cgroup v2 hierarchy"),
        flatten_subgroups=True,
    ):
        async with local_system(config, host=SimHost()):
            pass


async def test_a_worker_says_once_whether_cgroups_are_in_use(
    autojump_clock: trio.testing.MockClock, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="rc_worker.cgroup")
    for host, expected in ((SimHost(), "cgroup: not in use: "), (sim_host(), "cgroup: in use: ")):
        caplog.clear()
        host.program("true", Script())
        async with local_system(make_config(tmp_path / expected[8:11]), host=host) as system:
            job = system.submit(["true"])
            await system.wait_job(job)
            assert system.job(job).state == "succeeded"
        said = [r.getMessage() for r in caplog.records if r.name == "rc_worker.cgroup"]
        assert len([m for m in said if m.startswith("cgroup: ")]) == 1
        assert said[0].startswith(expected)
    # In use: the job ran in a cgroup of its own, which is gone with the worker's tree.
    [proc] = host.spawned()
    assert proc.cgroup.startswith(f"{host.service_cgroup}/rc-worker-")
    assert host.cgroups() == ["/", "/system.slice", host.service_cgroup]


async def test_io_accounting_on_request(
    autojump_clock: trio.testing.MockClock, tmp_path: Path
) -> None:
    host = sim_host(controllers=frozenset({"io"}))
    assert start_containment(host, "auto", tag="t", needs={"cgroup_io": "io"}) is not None
    host.program("job", Script.sleeping(1))
    result = await run_job(JobSpec(["job"], env=ENV, sweep_job_id="j-1"), Sink(), host=host)
    assert result.usage["io_read_bytes"] == 4096
    assignment = Assignment(job_id="j-1", attempt=1, device="gpu0", command=("job",))
    report = finish_report(
        assignment, result, verify=VerifyResult(ok=True), fault_id=None, output_bytes=0
    )
    assert report["usage"] == dict(result.usage)
    # Without the io controller delegated, asking for it refuses the start.
    with pytest.RaisesGroup(
        pytest.RaisesExc(ConfigError, match="cgroup_io: the io controller is not delegated"),
        flatten_subgroups=True,
    ):
        async with local_system(make_config(tmp_path, cgroup_io=True), host=sim_host()):
            pass


def test_preflight_says_what_would_stop_the_worker_without_touching_anything() -> None:
    none, some = SimHost(), sim_host(controllers=frozenset({"cpu"}))
    assert preflight(none, "auto", {}) is None
    assert preflight(none, "off", {}) is None
    assert "cgroup: required, but no cgroup v2" in str(preflight(none, "required", {}))
    memory = {"devices[0].memory_max": "memory"}
    assert "devices[0].memory_max: needs a cgroup per job" in str(preflight(none, "auto", memory))
    assert preflight(some, "required", {"devices[0].cpu_max": "cpu"}) is None
    problem = preflight(some, "auto", memory)
    assert problem is not None
    assert problem.startswith("devices[0].memory_max: the memory controller is not delegated")
    assert "lists: cpu" in problem
    assert some.cgroups() == ["/", "/system.slice", some.service_cgroup]  # read-only


async def test_a_damaged_journal_cgroup_falls_back_to_the_environment_sweep(
    tmp_path: Path,
) -> None:
    host = LinuxHost()
    job_id = f"j-{uuid.uuid4().hex}"  # real processes: an id nothing else carries
    for damaged in ("relative/x", "/a/../../etc"):
        journal(tmp_path, host.boot_id(), damaged, job_id=job_id)
        with trio.fail_after(GUARD):
            [entry] = await recover(
                tmp_path, boot_id=host.boot_id(), require_manual_clear=True, host=host
            )
        assert entry.sweep.method == "environ"
        assert entry.sweep.found == ()
        (tmp_path / "jobs" / f"{job_id}.1" / "recovery.json").unlink()


async def test_at_the_root_the_worker_stays_and_still_delegates(
    autojump_clock: trio.testing.MockClock,
) -> None:
    host = sim_host(controllers=frozenset({"memory"}))
    host.service_cgroup = host.worker_cgroup = "/"  # a root worker outside any service
    containment = start_containment(host, "auto", tag="t", needs={"m": "memory"})
    assert containment is not None
    assert containment.home == "/"
    assert host.worker_cgroup == "/"
    assert containment.controllers == {"memory"}
    leaf = containment.leaf("j.1")
    host.cgroup_mkdir(leaf)
    assert host.cgroup_read(leaf, "cgroup.controllers") == "memory\n"


async def test_moving_the_worker_for_a_spawn_happens_off_the_event_loop(
    real: LinuxHost, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each move of the worker into a job's cgroup and back waits out an RCU grace period
    in the kernel (about 4-5 ms when spawns are spaced out): on the event loop's thread
    it stalled every device twice a spawn. The child is still born in its cgroup."""
    threads: list[bool] = []
    write = LinuxHost.cgroup_write

    def recorded(self: LinuxHost, path: str, name: str, value: str) -> None:
        if name == "cgroup.procs":
            threads.append(threading.current_thread() is threading.main_thread())
        write(self, path, name, value)

    monkeypatch.setattr(LinuxHost, "cgroup_write", recorded)
    sink = Sink()
    with trio.fail_after(GUARD):
        result = await run_job(
            JobSpec(["sh", "-c", "cat /proc/self/cgroup"], env=ENV, grace_ceiling=1),
            sink,
            host=real,
        )
    assert result.exit_code == 0
    assert real.containment is not None
    assert f"0::{real.containment.tree}/" in bytes(sink.data).decode()  # born in the job's
    assert len(threads) >= 2  # in and back out
    assert not any(threads)


class ReusedPids:
    """The two calls the sweep's terminator makes of a host: ``process`` (a row of the
    process table) and ``pin``. ``started[pid]`` is the start time of the process that
    holds ``pid`` now; each signal sent through a pin is recorded with whom it reached."""

    def __init__(self) -> None:
        self.started: dict[int, int] = {}
        self.sent: list[tuple[int, int, int]] = []

    def process(self, pid: int) -> ProcessInfo | None:
        if pid not in self.started:
            return None
        return ProcessInfo(pid, 1, pid, pid, "S", start_time=self.started[pid])

    def pin(self, pid: int, start_time: int) -> _RecordingPin | None:
        if self.started.get(pid) != start_time:
            return None
        return _RecordingPin(self, pid, start_time)


class _RecordingPin:
    def __init__(self, host: ReusedPids, pid: int, start_time: int) -> None:
        self.host, self.pid, self.start_time = host, pid, start_time

    def send_signal(self, sig: int) -> bool:
        self.host.sent.append((self.pid, self.start_time, sig))
        return True

    def close(self) -> None:
        pass


def test_a_pid_taken_by_a_new_process_in_the_cgroup_gets_its_own_sigterm() -> None:
    host = ReusedPids()
    term = _Terminator(host, active=True)  # type: ignore[arg-type]
    host.started = {100: 5, 101: 5}
    term.signal((100, 101))
    term.signal((100, 101))  # the same processes, polled again: nothing more
    assert host.sent == [(100, 5, signal.SIGTERM), (101, 5, signal.SIGTERM)]
    # 100 exits during the grace and a new process in the cgroup gets its pid.
    host.started[100] = 9
    term.signal((100, 101))
    assert host.sent[2:] == [(100, 9, signal.SIGTERM)]
    # Gone between the listing and the look: nothing sent, nothing remembered.
    del host.started[101]
    term.signal((100, 101))
    assert len(host.sent) == 3
    term.close()
