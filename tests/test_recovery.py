"""Recovery after a crash: the claim, the journal, and what the controller then decides.

Three layers: ``decide_claim`` (sans-IO, property-tested: invariant 5),
``recover()`` over a scripted process table in virtual time, and whole
in-process workers restarted on the same state directory and controller
(a changed boot id through the Host seam; require_manual_clear). The
real-process SIGKILL tests are in test_crash_recovery.py.
"""

from __future__ import annotations

import json
import signal
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import attrs
import pytest
import trio
import trio.testing
from faults import Fault, FaultyTransport
from hypothesis import given
from hypothesis import strategies as st

from rc_worker import client as client_module
from rc_worker.controller import Store, StoreConfig
from rc_worker.core.model import Claim
from rc_worker.host import LinuxHost, ProcessInfo
from rc_worker.recovery import RECOVERY_FILE, decide_claim, recover
from rc_worker.spool import JobDir, ensure_state_dir, read_json, write_json_durably
from rc_worker.sweep import NOT_SWEPT, SweepReport
from rc_worker.testing import local_system, make_config

BOOT = "boot-now"
JOB_ID = "j-7"


@pytest.fixture(autouse=True)
def fast_retries(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(client_module, "RETRY_BASE_S", 0.005)
    monkeypatch.setattr(client_module, "RETRY_CAP_S", 0.05)


# -- the claim (sans-IO) ------------------------------------------------------------

sweeps = st.builds(
    SweepReport,
    scanned=st.booleans(),
    found=st.lists(st.integers(2, 99), max_size=3).map(tuple),
    remaining=st.lists(st.integers(2, 99), max_size=3).map(tuple),
    blind=st.booleans(),
)


@given(sweep=sweeps, reboot=st.booleans())
def test_require_manual_clear_only_ever_claims_unknown(sweep: SweepReport, reboot: bool) -> None:
    assert decide_claim(sweep, reboot=reboot, require_manual_clear=True) is Claim.UNKNOWN


@given(sweep=sweeps, reboot=st.booleans(), manual=st.booleans())
def test_gone_is_claimed_only_on_proof(sweep: SweepReport, reboot: bool, manual: bool) -> None:
    claim = decide_claim(sweep, reboot=reboot, require_manual_clear=manual)
    if claim is Claim.GONE:
        assert not manual
        assert reboot or (sweep.scanned and not sweep.blind and not sweep.remaining)
    if claim is Claim.ALIVE:
        assert sweep.remaining
        assert not reboot


@pytest.mark.parametrize(
    ("sweep", "reboot", "claim"),
    [
        (NOT_SWEPT, True, Claim.GONE),
        (SweepReport(scanned=True), False, Claim.GONE),
        (SweepReport(scanned=True, found=(5,)), False, Claim.GONE),
        (SweepReport(scanned=True, found=(5,), remaining=(5,)), False, Claim.ALIVE),
        (SweepReport(scanned=True, blind=True), False, Claim.UNKNOWN),
        (SweepReport(scanned=True, found=(5,), blind=True), False, Claim.UNKNOWN),
        (NOT_SWEPT, False, Claim.UNKNOWN),
    ],
    ids=["reboot", "nothing", "removed", "remaining", "blind", "removed-blind", "unlistable"],
)
def test_the_claim_table(sweep: SweepReport, reboot: bool, claim: Claim) -> None:
    assert decide_claim(sweep, reboot=reboot, require_manual_clear=False) is claim


# -- recover() over a scripted process table -------------------------------------------


@attrs.define
class Proc:
    env: dict[str, str]
    dies_of: frozenset[int] = frozenset({signal.SIGTERM, signal.SIGKILL})
    readable: bool = True


@attrs.define
class ScriptedHost:
    """Just the process part of the Host seam, scripted."""

    procs: dict[int, Proc] = attrs.field(factory=dict)
    listable: bool = True
    scans: int = 0
    signals: list[tuple[int, int]] = attrs.field(factory=list)

    def boot_id(self) -> str:
        return BOOT

    def own_pid(self) -> int:
        return 1000

    def processes(self) -> list[ProcessInfo]:
        if not self.listable:
            raise PermissionError("no /proc")
        self.scans += 1
        rows = [ProcessInfo(1, 0, 1, 1, "S"), ProcessInfo(1000, 1, 1000, 1000, "S")]
        return rows + [ProcessInfo(pid, 1, pid, pid, "S") for pid in self.procs]

    def environ(self, pid: int) -> Mapping[str, str]:
        if pid in (1, 1000):
            return {}
        p = self.procs.get(pid)
        if p is None:
            raise ProcessLookupError(pid)
        if not p.readable:
            raise PermissionError(pid)
        return p.env

    def signal_pid(self, pid: int, sig: int) -> bool:
        self.signals.append((pid, sig))
        p = self.procs.get(pid)
        if p is None:
            return False
        if sig in p.dies_of:
            del self.procs[pid]
        return True

    def signal_group(self, pgid: int, sig: int) -> bool:
        return self.signal_pid(pgid, sig)

    def boot_ticks(self) -> int:
        return 0

    def pin(self, pid: int, start_time: int) -> PidPin:
        # No pid is recycled here: a pin is the pid itself.
        return PidPin(self, pid)


def journal(
    root: Path, *, boot_id: str = BOOT, spawned: bool = True, output: bytes = b""
) -> JobDir:
    jd = JobDir(root, f"{JOB_ID}.1")
    jd.create()
    jd.output.write_bytes(output)
    write_json_durably(
        jd.journal,
        {
            "job_id": JOB_ID,
            "attempt": 1,
            "device": "gpu0",
            "boot_id": boot_id,
            "started_at": 0.0,
            "spawned": spawned,
        },
    )
    return jd


async def run_recover(root: Path, host: ScriptedHost, *, manual: bool = False) -> list[Any]:
    return await recover(root, boot_id=BOOT, require_manual_clear=manual, host=host)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("procs", "listable", "claim", "found", "remaining", "blind"),
    [
        ({}, True, Claim.GONE, [], [], False),
        ({50: Proc({"RC_JOB_ID": JOB_ID})}, True, Claim.GONE, [50], [], False),
        ({50: Proc({"RC_JOB_ID": "j-70"})}, True, Claim.GONE, [], [], False),
        (
            {50: Proc({"RC_JOB_ID": JOB_ID}, dies_of=frozenset())},
            True,
            Claim.ALIVE,
            [50],
            [50],
            False,
        ),
        ({50: Proc({}, readable=False)}, True, Claim.UNKNOWN, [], [], True),
        ({}, False, Claim.UNKNOWN, [], [], False),
    ],
    ids=["nothing-left", "leftover-removed", "other-job", "unkillable", "blind", "no-proc"],
)
async def test_recover_sweeps_and_claims(
    tmp_path: Path,
    autojump_clock: trio.testing.MockClock,
    procs: dict[int, Proc],
    listable: bool,
    claim: Claim,
    found: list[int],
    remaining: list[int],
    blind: bool,
) -> None:
    root = ensure_state_dir(str(tmp_path / "state"))
    jd = journal(root, output=b"partial output")
    host = ScriptedHost(procs=dict(procs), listable=listable)
    [entry] = await run_recover(root, host)
    assert entry.claim is claim
    assert (entry.job_id, entry.attempt, entry.device, entry.reboot) == (JOB_ID, 1, "gpu0", False)
    assert list(entry.sweep.found) == found
    assert list(entry.sweep.remaining) == remaining
    assert entry.sweep.blind is blind
    # The finish is written before register: shipped once the worker is up.
    report = read_json(jd.finish)
    assert report is not None
    assert report["outcome"] == "lost"
    assert report["output_bytes"] == len(b"partial output")
    assert report["sweep"]["found"] == found
    register = entry.register_entry()
    assert register["claim"] == str(claim)
    assert register["boot_id"] == BOOT
    # With require_manual_clear, the same facts claim nothing.
    jd.remove()
    journal(root)
    host = ScriptedHost(procs=dict(procs), listable=listable)
    [entry] = await run_recover(root, host, manual=True)
    assert entry.claim is Claim.UNKNOWN
    assert list(entry.sweep.found) == found  # it still swept: cautious, not idle


async def test_a_different_boot_id_proves_a_reboot_without_sweeping(tmp_path: Path) -> None:
    root = ensure_state_dir(str(tmp_path / "state"))
    journal(root, boot_id="boot-before")
    host = ScriptedHost(procs={50: Proc({"RC_JOB_ID": JOB_ID})})
    [entry] = await run_recover(root, host)
    assert entry.reboot
    assert entry.claim is Claim.GONE
    assert entry.boot_id == "boot-before"  # the boot the job ran under, for the controller
    assert host.scans == 0
    [entry] = await run_recover(root, host, manual=True)
    assert entry.claim is Claim.UNKNOWN


async def test_a_claim_stands_across_restarts_until_the_finish_is_acknowledged(
    tmp_path: Path,
) -> None:
    root = ensure_state_dir(str(tmp_path / "state"))
    jd = journal(root)
    host = ScriptedHost()
    [first] = await run_recover(root, host)
    scans = host.scans
    [again] = await run_recover(root, host)
    assert again == first
    assert host.scans == scans  # not swept twice: the claim is read back
    # A crash between the two writes of the first recovery, the other way round.
    jd.finish.unlink()
    [again] = await run_recover(root, host)
    assert again == first
    assert read_json(jd.finish) is not None
    # Turning require_manual_clear on since only ever tightens the claim.
    [strict] = await run_recover(root, host, manual=True)
    assert strict.claim is Claim.UNKNOWN


async def test_a_finished_job_whose_finish_was_never_acknowledged_is_claimed_too(
    tmp_path: Path,
) -> None:
    """The controller still believes it running: left out of register, it
    would be finished ``lost`` and its device quarantined."""
    root = ensure_state_dir(str(tmp_path / "state"))
    jd = journal(root)
    real = {"attempt": 1, "device": "gpu0", "outcome": "succeeded", "exit_code": 0}
    write_json_durably(jd.finish, real)
    [entry] = await run_recover(root, ScriptedHost())
    assert entry.claim is Claim.GONE
    assert read_json(jd.finish) == real  # the real outcome is kept, not overwritten
    assert (jd.path / RECOVERY_FILE).exists()


async def test_what_never_ran_is_not_claimed(tmp_path: Path) -> None:
    root = ensure_state_dir(str(tmp_path / "state"))
    # A directory whose journal never made it to disk: nothing was spawned.
    half = JobDir(root, "j-1.1")
    half.create()
    # A report of an attempt that never ran (rejected): the outbox sends it.
    rejected = journal(root, spawned=False)
    write_json_durably(rejected.finish, {"attempt": 1, "outcome": "rejected"})
    assert await run_recover(root, ScriptedHost()) == []
    assert not half.path.exists()
    assert rejected.finish.exists()


# -- whole workers restarted on one state dir and one controller ----------------------


class BootHost(LinuxHost):
    """The real host, but with a boot id the test chooses (a reboot in between)."""

    def __init__(self, boot: str) -> None:
        self.boot = boot

    def boot_id(self) -> str:
        return self.boot


def steady_store() -> Store:
    return Store(StoreConfig(heartbeat_interval_s=0.5, missed_heartbeats=120, poll_wait_s=5.0))


SLEEPER = ["sh", "-c", "echo before; sleep 300"]


async def start_and_abandon(config: Any, store: Store, host: LinuxHost | None = None) -> str:
    """A worker runs a job, and dies with it running (its journal stays on disk)."""
    job_id = store.submit(SLEEPER)
    async with local_system(config, store=store, host=host) as system:
        await system.wait_until(lambda: store.committed(job_id) == len(b"before\n"))
        await system.crash()
    assert store.job(job_id).state == "running"
    return job_id


def quarantines(store: Store) -> list[Any]:
    return [e for e in store.events() if e.type == "device_quarantined"]


async def test_a_changed_boot_id_frees_the_device_even_with_manual_clear(tmp_path: Path) -> None:
    store = steady_store()
    config = make_config(tmp_path)
    with trio.fail_after(40):
        job_id = await start_and_abandon(config, store, BootHost("boot-before"))
        strict = attrs.evolve(config, require_manual_clear=True)
        async with local_system(strict, store=store, host=BootHost("boot-after")) as system:
            info = await system.wait_job(job_id)
            assert info.state == "lost"
            assert system.device("gpu0").state == "free"
            after = system.submit(["echo", "after"])
            assert (await system.wait_job(after)).state == "succeeded"
            [recovered] = system.worker.recovered
            assert recovered.reboot
            assert recovered.claim is Claim.UNKNOWN
    assert store.output(job_id) == b"before\n"
    assert quarantines(store) == []


async def test_manual_clear_keeps_the_device_quarantined_until_cleared(tmp_path: Path) -> None:
    store = steady_store()
    config = make_config(tmp_path)
    with trio.fail_after(40):
        job_id = await start_and_abandon(config, store)
        strict = attrs.evolve(config, require_manual_clear=True)
        watch: list[FaultyTransport] = []

        def wrap(inner: Any) -> FaultyTransport:
            watch.append(FaultyTransport(inner))
            return watch[-1]

        async with local_system(strict, store=store, transport_wrapper=wrap) as system:
            info = await system.wait_job(job_id)
            assert info.state == "lost"
            assert store.output(job_id) == b"before\n"
            assert system.device("gpu0").state == "quarantined"
            assert system.device("gpu0").reason == "interrupted"
            waiting = system.submit(["echo", "waiting"])
            # Heartbeats go by and the job stays queued: nothing is offered.
            beats = len(watch[0].exchanges("heartbeat"))
            await watch[0].wait_until(lambda: len(watch[0].exchanges("heartbeat")) >= beats + 2)
            assert store.job(waiting).state == "queued"
            store.clear("test-host", "gpu0")
            assert (await system.wait_job(waiting)).state == "succeeded"
    [event] = quarantines(store)
    assert event.data["kind"] == "interrupted"


async def test_a_gone_claim_frees_the_device(tmp_path: Path) -> None:
    store = steady_store()
    config = make_config(tmp_path)
    with trio.fail_after(40):
        job_id = await start_and_abandon(config, store)
        async with local_system(config, store=store) as system:
            assert (await system.wait_job(job_id)).state == "lost"
            assert system.device("gpu0").state == "free"
            [recovered] = system.worker.recovered
            assert recovered.claim is Claim.GONE
            after = system.submit(["echo", "after"])
            assert (await system.wait_job(after)).state == "succeeded"
    assert quarantines(store) == []
    assert not list((Path(config.state_dir) / "jobs").iterdir())


async def test_re_registering_later_does_not_resend_settled_recovery_claims(
    tmp_path: Path,
) -> None:
    """After its recovered job's finish is acknowledged, a worker that must
    register again (unknown_session) claims nothing more: it is the same live
    process, and the job it is running keeps its real outcome."""
    store = steady_store()
    config = make_config(tmp_path)
    go = tmp_path / "go"
    faults: list[FaultyTransport] = []

    def wrap(inner: Any) -> FaultyTransport:
        faults.append(FaultyTransport(inner))
        return faults[-1]

    with trio.fail_after(40):
        old = await start_and_abandon(config, store)
        async with local_system(config, store=store, transport_wrapper=wrap) as system:
            assert (await system.wait_job(old)).state == "lost"
            job_id = system.submit(
                ["sh", "-c", f"echo b; while [ ! -e {go} ]; do sleep 0.01; done; echo c"]
            )
            await system.wait_until(lambda: store.committed(job_id) == 2)
            faults[0].inject("heartbeat", Fault.UNKNOWN_SESSION)
            await faults[0].wait_until(lambda: len(faults[0].exchanges("register")) == 2)
            registers = [json.loads(e) for e in _register_bodies(faults[0])]
            go.touch()
            info = await system.wait_job(job_id)
    assert registers[-1]["recovery"] == []
    assert info.state == "succeeded"


def _register_bodies(t: FaultyTransport) -> list[str]:
    return [e.body for e in t.exchanges("register")]


@attrs.define
class PidPin:
    host: ScriptedHost
    pid: int

    def send_signal(self, sig: int) -> bool:
        return self.host.signal_pid(self.pid, sig)

    def close(self) -> None:
        pass
