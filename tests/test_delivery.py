"""Never lose anything: output, finish and fault reports through faults, outages and restarts.

Every test runs a real worker (real processes, the real clock) against the
reference controller through ``tests.faults.FaultyTransport``, and checks the
same things at the end: every byte the job wrote is committed once and in
order, the job reached exactly one terminal state, and once the worker has
drained, nothing is left in its state directory (the spool is removed once
the finish is acknowledged).
"""

from __future__ import annotations

import logging
import os
import stat
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path

import attrs
import httpx
import pytest
import trio
from faults import (
    TRANSIENT_FAULTS,
    WORKER_ENDPOINTS,
    Fault,
    FaultyTransport,
    fault_plans,
)
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rc_worker import client as client_module
from rc_worker import outbox as outbox_module
from rc_worker.controller import Store, StoreConfig
from rc_worker.controller.messages import Event, JobInfo
from rc_worker.core.config import Config, DeviceConfig
from rc_worker.spool import TRUNCATION_MARKER, JobDir, OutputSpool, ensure_state_dir
from rc_worker.testing import WORKER_TOKEN, LocalSystem, local_system, make_config

JOB = ["sh", "-c", "for i in 1 2 3 4 5; do echo line $i; done"]
JOB_OUTPUT = b"".join(f"line {i}\n".encode() for i in range(1, 6))


@pytest.fixture(autouse=True)
def fast_retries(monkeypatch: pytest.MonkeyPatch) -> None:
    """Retry within milliseconds, so a test can afford dozens of faults."""
    monkeypatch.setattr(client_module, "RETRY_BASE_S", 0.005)
    monkeypatch.setattr(client_module, "RETRY_CAP_S", 0.05)


@pytest.fixture
def small_chunks(monkeypatch: pytest.MonkeyPatch) -> int:
    """Ship output 8 bytes a request: many output requests, so many fault chances."""
    monkeypatch.setattr(outbox_module, "CHUNK", 8)
    return 8


def steady_store(heartbeat_interval_s: float = 0.5) -> Store:
    # A host is lost only after a minute of silence: these tests are about
    # delivery; host loss has tests of its own below.
    return Store(
        StoreConfig(
            heartbeat_interval_s=heartbeat_interval_s,
            missed_heartbeats=int(60 / heartbeat_interval_s),
            poll_wait_s=5.0,
        )
    )


def finished_events(store: Store, job_id: str) -> list[Event]:
    return [e for e in store.events() if e.type == "job_finished" and e.data["job_id"] == job_id]


def left_on_disk(config: Config) -> list[str]:
    root = Path(config.state_dir)
    return sorted(p.name for p in (root / "jobs").iterdir()) + sorted(
        p.name for p in (root / "faults").iterdir()
    )


def spool_file(config: Config, job_id: str, attempt: int = 1) -> Path:
    return JobDir(Path(config.state_dir), f"{job_id}.{attempt}").output


class Wrap:
    """A ``transport_wrapper`` that keeps the FaultyTransport it made."""

    def __init__(
        self,
        plan: Mapping[str, Sequence[Fault]] | None = None,
        *,
        outages: Mapping[str, Fault] | None = None,
    ) -> None:
        self._plan = plan
        self._outages = outages or {}
        self.faults: FaultyTransport | None = None

    def __call__(self, inner: httpx.AsyncBaseTransport) -> FaultyTransport:
        self.faults = FaultyTransport(inner, self._plan)
        for endpoint, fault in self._outages.items():
            self.faults.outage(endpoint, fault)
        return self.faults

    @property
    def t(self) -> FaultyTransport:
        assert self.faults is not None
        return self.faults


async def wait_for(system: LocalSystem, predicate: object) -> None:
    assert callable(predicate)
    await system.wait_until(predicate)


def failing_release_hook(tmp_path: Path) -> Config:
    """One device, gpu0, whose release hook fails after every job: each job ends in a
    fault report (``hook_failed``) to deliver."""
    hook = tmp_path / "release.sh"
    hook.write_text("#!/bin/sh\necho 'the GPU would not reset' >&2\nexit 3\n")
    hook.chmod(0o755)
    device = DeviceConfig(name="gpu0", on_release=str(hook), release_linger=0.0)
    return make_config(tmp_path, devices=(device,))


def ticking_probe(config: Config) -> None:
    """Labels are sent only when they change: a drop-in whose answer changes at
    every pass gives each probe pass (a reprobe) a ``PUT labels`` to fault."""
    probe = Path(config.probe_dir) / "10-tick"
    probe.parent.mkdir(parents=True, exist_ok=True)
    probe.write_text('#!/bin/sh\necho "{\\"tick\\": \\"$(date +%s%N)\\"}"\n')
    probe.chmod(0o755)


async def run_one_job(
    directory: Path,
    plan: Mapping[str, Sequence[Fault]],
    *,
    wait_for_faults: Sequence[str],
    command: list[str] = JOB,
) -> tuple[JobInfo, Store, FaultyTransport, Config]:
    """One job through a worker whose requests meet ``plan``; returns after the drain.

    Waits until the plan's faults for ``wait_for_faults`` have all met a
    request, or the test would prove less than it says (heartbeats, say,
    come only every interval, and the job is done long before).
    """
    store = steady_store()
    job_id = store.submit(command)
    config = make_config(directory)
    if "labels" in plan:
        ticking_probe(config)
    wrap = Wrap(plan)
    async with local_system(config, store=store, transport_wrapper=wrap) as system:
        await system.wait_job(job_id)
        for endpoint in wait_for_faults:
            while wrap.t.pending(endpoint):
                if endpoint == "labels":
                    system.worker.reprobe()
                with trio.move_on_after(0.2):
                    await wrap.t.wait_until(lambda e=endpoint: wrap.t.pending(e) == 0)
    return store.job(job_id), store, wrap.t, config


def assert_delivered_once(
    info: JobInfo, store: Store, config: Config, output: bytes = JOB_OUTPUT
) -> None:
    assert info.state == "succeeded", info
    assert info.exit_code == 0
    assert store.output(info.job_id) == output
    assert info.output_bytes == len(output)
    assert len(finished_events(store, info.job_id)) == 1
    assert left_on_disk(config) == []


# -- fault injection at every endpoint ------------------------------------------


@pytest.mark.parametrize("endpoint", WORKER_ENDPOINTS)
async def test_every_fault_at_one_endpoint_loses_and_doubles_nothing(
    tmp_path: Path, endpoint: str, small_chunks: int
) -> None:
    """503, 503 with Retry-After, refused, timed out, and applied-but-answer-lost,
    one after the other on the same endpoint."""
    with trio.fail_after(30):
        info, store, faults, config = await run_one_job(
            tmp_path, {endpoint: TRANSIENT_FAULTS}, wait_for_faults=[endpoint]
        )
    assert_delivered_once(info, store, config)
    met = [e.fault for e in faults.log if e.endpoint == endpoint and e.fault is not Fault.OK]
    assert met == list(TRANSIENT_FAULTS)
    if endpoint == "poll":
        # The assignment answered to the lost poll never reached the worker:
        # the controller offered the job again as a new attempt, which ran.
        assert [a.status for a in info.attempts][-1] == "finished"


@settings(
    max_examples=12,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(plan=fault_plans())
async def test_any_mix_of_faults_loses_and_doubles_nothing(
    tmp_path: Path, small_chunks: int, plan: dict[str, list[Fault]]
) -> None:
    directory = Path(tempfile.mkdtemp(dir=tmp_path))
    with trio.fail_after(30):
        # A request that got through (OK) is not retried, so the faults
        # planned after it for a once-only call (register, start, finish) are
        # never met; heartbeats keep coming, so theirs all are.
        info, store, _, config = await run_one_job(
            directory, plan, wait_for_faults=[e for e in plan if e == "heartbeat"]
        )
    assert_delivered_once(info, store, config)


async def test_fault_reports_survive_faults_and_quarantine_once(tmp_path: Path) -> None:
    """The fault endpoint: a failed release hook's report, through every fault."""
    config = failing_release_hook(tmp_path)
    store = steady_store()
    job_id = store.submit(JOB)
    wrap = Wrap({"fault": TRANSIENT_FAULTS})
    with trio.fail_after(30):
        async with local_system(config, store=store, transport_wrapper=wrap) as system:
            await system.wait_job(job_id)
            await wait_for(system, lambda: system.device("gpu0").state == "quarantined")
            await wrap.t.wait_until(lambda: any(e.status == 200 for e in wrap.t.exchanges("fault")))
    quarantines = [e for e in store.events() if e.type == "device_quarantined"]
    assert len(quarantines) == 1
    assert quarantines[0].data["kind"] == "hook_failed"
    assert store.device("test-host", "gpu0").state == "quarantined"
    assert store.job(job_id).state == "succeeded"
    assert left_on_disk(config) == []


# -- outages ----------------------------------------------------------------------


async def test_output_waits_on_disk_through_an_outage_and_ships_in_bounded_chunks(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Memory stays bounded: while the controller is away the job's output
    piles up in the spool file, not in the worker; afterwards it is streamed
    from disk no more than REQUEST_MAX bytes a request (CHUNK at a time)."""
    chunk = 64 * 1024
    monkeypatch.setattr(outbox_module, "CHUNK", 16 * 1024)
    monkeypatch.setattr(outbox_module, "REQUEST_MAX", chunk)
    size = 600_000
    go = tmp_path / "go"
    command = [
        "sh",
        "-c",
        f"echo first; while [ ! -e {go} ]; do sleep 0.01; done; "
        f"head -c {size} /dev/zero | tr '\\0' x; echo last",
    ]
    expected = b"first\n" + b"x" * size + b"last\n"
    store = steady_store()
    job_id = store.submit(command)
    config = make_config(tmp_path)
    wrap = Wrap()
    with trio.fail_after(40):
        async with local_system(config, store=store, transport_wrapper=wrap) as system:
            await wait_for(system, lambda: store.committed(job_id) == len(b"first\n"))
            wrap.t.outage("output", Fault.REFUSED)
            wrap.t.outage("finish", Fault.REFUSED)
            go.touch()
            spool = spool_file(config, job_id)
            await wait_for(system, lambda: spool.stat().st_size == len(expected))
            # Several refusals in a row: the outage outlasts many retries.
            await wrap.t.wait_until(lambda: len(wrap.t.exchanges("output")) >= 10)
            assert store.committed(job_id) == len(b"first\n")
            assert system.job(job_id).state == "running"
            wrap.t.restore("output")
            wrap.t.restore("finish")
            info = await system.wait_job(job_id)
    assert_delivered_once(store.job(job_id), store, config, expected)
    assert info.state == "succeeded"
    sizes = [e.body_bytes for e in wrap.t.exchanges("output")]
    # Streamed: with the spool ahead, a request carries REQUEST_MAX bytes
    # (four CHUNK reads), never more.
    assert max(sizes) == chunk
    assert sum(1 for e in wrap.t.exchanges("output") if e.status == 200) >= size // chunk


async def test_the_spool_cap_truncates_behind_a_marker_that_reaches_the_controller(
    tmp_path: Path,
) -> None:
    cap = 100
    config = attrs.evolve(make_config(tmp_path), spool_max_bytes=cap)
    store = steady_store()
    # 300 bytes, and the first write already crosses the cap.
    job_id = store.submit(["sh", "-c", "head -c 300 /dev/zero | tr '\\0' y"])
    with trio.fail_after(30):
        async with local_system(config, store=store) as system:
            info = await system.wait_job(job_id)
    marker = TRUNCATION_MARKER.format(cap=cap).encode()
    assert store.output(job_id) == b"y" * cap + marker
    assert info.state == "succeeded"
    assert info.output_bytes == cap + len(marker)
    assert left_on_disk(config) == []


@settings(max_examples=60, deadline=None)
@given(
    writes=st.lists(st.binary(min_size=0, max_size=64), max_size=12),
    cap=st.integers(min_value=0, max_value=300),
)
async def test_the_spool_keeps_a_prefix_up_to_the_cap_then_one_marker(
    writes: list[bytes], cap: int
) -> None:
    with tempfile.TemporaryDirectory() as d:
        job_dir = JobDir(ensure_state_dir(d), "j-1.1")
        job_dir.create()
        spool = OutputSpool(job_dir, cap=cap)
        for data in writes:
            await spool(data)
        spool.close()
        written = b"".join(writes)
        marker = TRUNCATION_MARKER.format(cap=cap).encode()
        expected = written[:cap] + (marker if len(written) > cap else b"")
        assert job_dir.output.read_bytes() == expected
        assert spool.size == len(expected)
        assert spool.truncated == max(0, len(written) - cap)


# -- durable reports across restarts ------------------------------------------------


async def leave_finish_on_disk(config: Config, store: Store, job_id: str) -> Path:
    """Run the job with its finish refused, then kill the worker: its finish is left on
    disk (returned), and the controller still has the job running."""
    first = Wrap()
    async with local_system(config, store=store, transport_wrapper=first) as system:
        first.t.outage("finish", Fault.REFUSED)
        await first.t.wait_until(lambda: len(first.t.exchanges("finish")) >= 3)
        finish = JobDir(Path(config.state_dir), f"{job_id}.1").finish
        assert finish.exists()
        await system.crash()
    assert store.job(job_id).state == "running"
    return finish


async def test_a_finish_on_disk_survives_a_restart_and_keeps_its_outcome(tmp_path: Path) -> None:
    """The finish is written before its first try; a worker that dies while it
    cannot be delivered leaves it on disk, and the next worker delivers it: the
    job keeps its real outcome (not ``lost``) and its device stays free."""
    store = steady_store()
    config = make_config(tmp_path)
    job_id = store.submit(["sh", "-c", "echo done; exit 4"])
    with trio.fail_after(40):
        await leave_finish_on_disk(config, store, job_id)
        async with local_system(config, store=store) as system:
            info = await system.wait_job(job_id)
            assert system.device("gpu0").state == "free"
    assert info.state == "failed"
    assert info.exit_code == 4
    assert store.output(job_id) == b"done\n"
    assert len(finished_events(store, job_id)) == 1
    assert not [e for e in store.events() if e.type == "device_quarantined"]
    assert left_on_disk(config) == []


async def test_a_fault_report_on_disk_survives_a_restart(tmp_path: Path) -> None:
    config = failing_release_hook(tmp_path)
    store = steady_store()
    job_id = store.submit(JOB)
    first = Wrap()
    with trio.fail_after(40):
        async with local_system(config, store=store, transport_wrapper=first) as system:
            first.t.outage("fault", Fault.UNAVAILABLE)
            await system.wait_job(job_id)
            await first.t.wait_until(lambda: len(first.t.exchanges("fault")) >= 2)
            pending = list((Path(config.state_dir) / "faults").iterdir())
            assert len(pending) == 1
            await system.crash()
        fault_id = pending[0].name.removeprefix("gpu0.").removesuffix(".json")
        assert store.device("test-host", "gpu0").state == "free"
        async with local_system(config, store=store) as system:
            await wait_for(system, lambda: system.device("gpu0").state == "quarantined")
            assert system.device("gpu0").fault_id == fault_id
    assert left_on_disk(config) == []


# -- unknown_session ------------------------------------------------------------------


async def test_unknown_session_re_registers_and_carries_on(tmp_path: Path) -> None:
    store = steady_store()
    config = make_config(tmp_path)
    wrap = Wrap({"labels": [Fault.UNKNOWN_SESSION]})
    ticking_probe(config)
    with trio.fail_after(30):
        async with local_system(config, store=store, transport_wrapper=wrap) as system:
            while wrap.t.pending("labels"):
                system.worker.reprobe()
                with trio.move_on_after(0.2):
                    await wrap.t.wait_until(lambda: wrap.t.pending("labels") == 0)
            await wrap.t.wait_until(lambda: len(wrap.t.exchanges("register")) == 2)
            job_id = system.submit(JOB)
            info = await system.wait_job(job_id)
    assert_delivered_once(info, store, config)
    labels = [e.status for e in wrap.t.exchanges("labels")]
    assert labels[:2] == [409, 200]


async def test_a_host_lost_to_silence_loses_its_job_but_not_its_output_or_finish(
    tmp_path: Path,
) -> None:
    """The controller marks a host lost after 3 missed heartbeats and finishes
    its running job ``lost``; the worker, which never stopped, is told
    ``unknown_session``, registers again, and still delivers every byte and
    its finish (acknowledged, changing nothing). The device stays quarantined
    until an operator clears it."""
    store = Store(StoreConfig(heartbeat_interval_s=0.3, missed_heartbeats=3, poll_wait_s=5.0))
    config = make_config(tmp_path)
    go = tmp_path / "go"
    job_id = store.submit(["sh", "-c", f"echo a; while [ ! -e {go} ]; do sleep 0.01; done; echo b"])
    wrap = Wrap()
    with trio.fail_after(40):
        async with local_system(config, store=store, transport_wrapper=wrap) as system:
            await wait_for(system, lambda: store.committed(job_id) == 2)
            wrap.t.outage("heartbeat", Fault.REFUSED)

            def host_lost() -> bool:
                store.tick(trio.current_time())
                return system.device("gpu0").host_state == "lost"

            await wait_for(system, host_lost)
            assert store.job(job_id).state == "lost"
            wrap.t.restore("heartbeat")
            go.touch()
            await wrap.t.wait_until(
                lambda: any(e.status == 200 for e in wrap.t.exchanges("finish", job_id))
            )
            assert len(wrap.t.exchanges("register")) >= 2
            assert store.output(job_id) == b"a\nb\n"
            assert system.device("gpu0").state == "quarantined"
            assert system.device("gpu0").reason == "interrupted"
            # Clear once a heartbeat has told the controller the worker holds
            # the quarantine (see the stale-heartbeat test below for why).
            await wait_for(system, lambda: system.device("gpu0").worker_state == "quarantined")
            store.clear("test-host", "gpu0")
            second = system.submit(["echo", "again"])
            assert (await system.wait_job(second)).state == "succeeded"
    assert store.job(job_id).state == "lost"
    assert len(finished_events(store, job_id)) == 1
    assert left_on_disk(config) == []


async def test_unknown_session_at_finish_re_registers_and_keeps_the_real_outcome(
    tmp_path: Path,
) -> None:
    """The same live process registering again interrupted nothing: its
    finish, resent with the new session, still records the real outcome."""
    store = steady_store()
    config = make_config(tmp_path)
    wrap = Wrap({"finish": [Fault.UNKNOWN_SESSION]})
    job_id = store.submit(JOB)
    with trio.fail_after(30):
        async with local_system(config, store=store, transport_wrapper=wrap) as system:
            await system.wait_job(job_id)
            await wrap.t.wait_until(
                lambda: any(e.status == 200 for e in wrap.t.exchanges("finish"))
            )
    assert len(wrap.t.exchanges("register")) == 2
    assert [e.status for e in wrap.t.exchanges("finish")] == [409, 200]
    assert_delivered_once(store.job(job_id), store, config)


# -- the state directory and the token ----------------------------------------------


async def test_the_state_dir_is_private_and_the_token_never_logged(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    token_file = tmp_path / "token"
    token_file.write_text(WORKER_TOKEN + "\n")
    token_file.chmod(0o644)
    state = tmp_path / "state"
    state.mkdir(mode=0o755)
    os.chmod(state, 0o755)
    config = attrs.evolve(make_config(tmp_path), token_file=str(token_file))
    store = steady_store()
    # A retry or two, so the retry path's log lines are in the capture too.
    wrap = Wrap({"output": [Fault.UNAVAILABLE], "finish": [Fault.REFUSED]})
    with trio.fail_after(30):
        async with local_system(config, store=store, transport_wrapper=wrap) as system:
            job_id = system.submit(JOB)
            assert (await system.wait_job(job_id)).state == "succeeded"
            assert stat.S_IMODE(state.stat().st_mode) == 0o700
            for sub in ("jobs", "faults"):
                assert stat.S_IMODE((state / sub).stat().st_mode) & 0o077 == 0
    warnings = [
        r.getMessage()
        for r in caplog.records
        if r.levelno == logging.WARNING and "token file" in r.getMessage()
    ]
    assert warnings == [
        f"token file {token_file} is readable by group or others (mode 644); "
        f"run: chmod 600 {token_file}"
    ]
    loggers = {r.name for r in caplog.records}
    assert {"rc_worker.client", "rc_worker.worker"} <= loggers
    for record in caplog.records:
        assert WORKER_TOKEN not in record.getMessage(), record
        assert WORKER_TOKEN not in repr(record.args), record


async def test_a_private_token_file_draws_no_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    token_file = tmp_path / "token"
    token_file.write_text(WORKER_TOKEN + "\n")
    token_file.chmod(0o600)
    config = attrs.evolve(make_config(tmp_path), token_file=str(token_file))
    with trio.fail_after(30):
        async with local_system(config, store=steady_store()):
            pass
    assert not [r for r in caplog.records if "token file" in r.getMessage()]


async def test_a_heartbeat_stale_from_before_a_re_register_does_not_lose_a_clear(
    tmp_path: Path,
) -> None:
    """A heartbeat body built before the worker learned of a quarantine (it
    was retried through the outage) arrives after the operator's clear; the
    clear must still reach the worker."""
    store = Store(StoreConfig(heartbeat_interval_s=0.3, missed_heartbeats=3, poll_wait_s=5.0))
    config = make_config(tmp_path)
    go = tmp_path / "go"
    job_id = store.submit(["sh", "-c", f"echo a; while [ ! -e {go} ]; do sleep 0.01; done; echo b"])
    wrap = Wrap()
    with trio.fail_after(30):
        async with local_system(config, store=store, transport_wrapper=wrap) as system:
            await wait_for(system, lambda: store.committed(job_id) == 2)
            # The heartbeat loop is now stuck retrying one body built while the
            # device was running and held no fault.
            wrap.t.outage("heartbeat", Fault.REFUSED)

            def host_lost() -> bool:
                store.tick(trio.current_time())
                return system.device("gpu0").host_state == "lost"

            await wait_for(system, host_lost)
            go.touch()  # "b" is shipped: unknown_session, register, fault learned
            await wrap.t.wait_until(
                lambda: any(e.status == 200 for e in wrap.t.exchanges("finish", job_id))
            )
            assert system.worker.devices["gpu0"].lease.faults
            store.clear("test-host", "gpu0")

            def answered() -> int:
                return sum(e.status == 200 for e in wrap.t.exchanges("heartbeat"))

            # Counted from here: heartbeats answered before the outage say nothing.
            before = answered()
            wrap.t.restore("heartbeat")
            await wrap.t.wait_until(lambda: answered() >= before + 3)
            assert not system.worker.devices["gpu0"].lease.faults


async def test_a_fault_still_on_disk_at_start_keeps_its_device_quarantined(
    tmp_path: Path,
) -> None:
    config = failing_release_hook(tmp_path)
    store = steady_store()
    first = Wrap()
    with trio.fail_after(40):
        async with local_system(config, store=store, transport_wrapper=first) as system:
            first.t.outage("fault", Fault.REFUSED)
            await system.wait_job(system.submit(JOB))
            await first.t.wait_until(lambda: len(first.t.exchanges("fault")) >= 2)
            await system.crash()
        # The controller is still unreachable for faults when the worker comes back.
        second = Wrap(outages={"fault": Fault.REFUSED})
        second_job = store.submit(["echo", "on a dirty device"])
        async with local_system(config, store=store, transport_wrapper=second) as system:
            await second.t.wait_until(lambda: len(second.t.exchanges("heartbeat")) >= 2)
            assert store.job(second_job).state == "queued"
            assert system.worker.devices["gpu0"].lease.faults
            second.t.restore("fault")
            await wait_for(system, lambda: system.device("gpu0").state == "quarantined")
            store.clear("test-host", "gpu0")
            assert (await system.wait_job(second_job)).state == "succeeded"
