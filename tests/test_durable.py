"""Durable writes: off the event loop, in groups, with the ordering durable.py promises."""

from __future__ import annotations

import errno
import functools
import json
import os
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio
import trio.testing

from rc_worker.durable import Committer
from rc_worker.spool import JobDir, ensure_state_dir, make_dirs_durably, read_json
from rc_worker.testing import make_config
from rc_worker.testing.simdisk import SimDisk
from rc_worker.worker import Worker


async def test_writes_issued_together_share_a_flush_and_a_directory_fsync(
    tmp_path: Path,
) -> None:
    committer = Committer()
    async with trio.open_nursery() as nursery:
        for i in range(20):
            nursery.start_soon(committer.write, tmp_path / f"f{i}.json", {"i": i})
    for i in range(20):
        assert read_json(tmp_path / f"f{i}.json") == {"i": i}
    assert sorted(os.listdir(tmp_path)) == sorted(f"f{i}.json" for i in range(20))
    assert committer.files == 20
    # One flush, one directory fsync for all twenty (one write per flush,
    # the old way, would be twenty of each).
    assert committer.flushes == 1
    assert committer.dir_syncs == 1


async def test_writes_issued_during_a_flush_wait_and_go_together(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    gate = threading.Event()
    real_fsync = os.fsync

    def slow_first_fsync(fd: int) -> None:
        gate.wait(10)
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", slow_first_fsync)
    committer = Committer()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(committer.write, tmp_path / "first.json", {"n": 0})
        # Let the first flush begin and block in its thread.
        await trio.testing.wait_all_tasks_blocked()
        assert committer.flushes == 1
        for i in range(1, 11):
            nursery.start_soon(committer.write, tmp_path / f"w{i}.json", {"n": i})
        # Every writer has run up to its wait on the flush in progress.
        await trio.testing.wait_all_tasks_blocked()
        # The event loop kept running while a flush sat in fsync.
        assert committer.flushes == 1
        gate.set()
    assert committer.flushes == 2
    assert committer.files == 11
    for i in range(1, 11):
        assert read_json(tmp_path / f"w{i}.json") == {"n": i}


async def test_files_are_renamed_into_place_in_the_order_issued(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    renamed: list[str] = []
    real_replace = os.replace

    def recording_replace(src: Any, dst: Any) -> None:
        renamed.append(Path(dst).name)
        real_replace(src, dst)

    monkeypatch.setattr(os, "replace", recording_replace)
    committer = Committer()
    names = [f"{c}.json" for c in "qwertyuiop"]
    async with trio.open_nursery() as nursery:
        nursery.start_soon(
            committer.write_all, [(tmp_path / "finish.json", {}), (tmp_path / "journal.json", {})]
        )
        # start_soon runs tasks in an unspecified order; letting each one run
        # until it blocks fixes the order in which the writes are issued.
        await trio.testing.wait_all_tasks_blocked()
        for name in names:
            nursery.start_soon(committer.write, tmp_path / name, {})
            await trio.testing.wait_all_tasks_blocked()
    # In order across flushes too (the checkpoints let a flush begin midway).
    assert renamed == ["finish.json", "journal.json", *names]


async def test_the_later_of_two_writes_of_a_path_wins(tmp_path: Path) -> None:
    committer = Committer()
    path = tmp_path / "finish.json"
    async with trio.open_nursery() as nursery:
        nursery.start_soon(committer.write, path, {"v": 1})
        await trio.testing.wait_all_tasks_blocked()
        nursery.start_soon(committer.write, path, {"v": 2})
    assert read_json(path) == {"v": 2}
    # And within one flush: one file, the later content.
    await committer.write_all([(path, {"v": 3}), (path, {"v": 4})])
    assert read_json(path) == {"v": 4}
    assert os.listdir(tmp_path) == ["finish.json"]


async def test_a_failed_write_fails_alone_and_names_its_path(tmp_path: Path) -> None:
    committer = Committer()
    missing = tmp_path / "no-such-dir" / "finish.json"
    errors: list[OSError] = []

    async def failing() -> None:
        try:
            await committer.write(missing, {"x": 1})
        except OSError as e:
            errors.append(e)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(failing)
        nursery.start_soon(committer.write, tmp_path / "ok.json", {"x": 2})
    assert len(errors) == 1
    assert str(missing) in str(errors[0])
    assert read_json(tmp_path / "ok.json") == {"x": 2}
    assert committer.flushes == 1


async def test_a_value_json_cannot_encode_raises_in_the_caller(tmp_path: Path) -> None:
    committer = Committer()
    with pytest.raises(TypeError):
        await committer.write(tmp_path / "x.json", {"x": object()})
    assert os.listdir(tmp_path) == []
    assert committer.flushes == 0


async def test_a_cancelled_writer_still_gets_its_file_written(tmp_path: Path) -> None:
    committer = Committer()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(committer.write, tmp_path / "a.json", {"a": 1})
        with trio.CancelScope() as scope:
            scope.cancel()
            await committer.write(tmp_path / "b.json", {"b": 1})
    assert read_json(tmp_path / "a.json") == {"a": 1}
    assert read_json(tmp_path / "b.json") == {"b": 1}


# -- the worker: a poll answer with 1,000 assignments -------------------------------


class BusyController:
    """Answers the first poll with ``count`` assignments for a device the host lacks."""

    def __init__(self, count: int, on_heartbeat: Callable[[], None]) -> None:
        self.assignments: list[Any] = [
            {"job_id": f"j-{i}", "attempt": 1, "device": "gpu9", "command": ["true"]}
            for i in range(count)
        ]
        self.count = count
        self.heartbeats = 0
        self.finishes: dict[str, dict[str, Any]] = {}
        self.all_finished = trio.Event()
        self._on_heartbeat = on_heartbeat

    async def __call__(self, request: httpx.Request) -> httpx.Response:
        path = request.url.path
        if path.endswith("/register"):
            return httpx.Response(200, json={"session": "s-1", "heartbeat_interval_s": 0.02})
        if path.endswith("/heartbeat"):
            self.heartbeats += 1
            self._on_heartbeat()
            return httpx.Response(200, json={})
        if path.endswith("/poll"):
            batch, self.assignments = self.assignments, []
            if not batch:
                await trio.sleep(0.2)
            return httpx.Response(200, json={"assignments": batch})
        if path.endswith("/output"):
            return httpx.Response(200, json={"committed": 0})
        if path.endswith("/finish"):
            self.finishes[path.split("/")[3]] = json.loads(request.content)
            if len(self.finishes) == self.count:
                self.all_finished.set()
            return httpx.Response(200, json={})
        return httpx.Response(200, json={})


async def test_heartbeats_keep_flowing_while_a_thousand_rejections_are_written(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Every fsync is held until the worker has sent heartbeats with a flush
    # stuck in it. A worker that fsynced on its event loop would be frozen
    # right there: no heartbeat could go out until the disk answered.
    in_fsync = threading.Event()
    release = threading.Event()
    real_fsync = os.fsync

    def held_fsync(fd: int) -> None:
        in_fsync.set()
        release.wait(20)
        real_fsync(fd)

    beats_while_held: list[int] = []

    def on_heartbeat() -> None:
        if in_fsync.is_set() and not release.is_set():
            beats_while_held.append(1)
            if len(beats_while_held) >= 3:
                release.set()

    controller = BusyController(1000, on_heartbeat)
    monkeypatch.setattr(os, "fsync", held_fsync)
    config = make_config(tmp_path, devices=("gpu0",), token="t")
    transport = httpx.MockTransport(controller)
    try:
        with trio.fail_after(120):
            async with httpx.AsyncClient(transport=transport, base_url="http://c") as http:
                worker = Worker(config, http=http)
                async with trio.open_nursery() as nursery:
                    await nursery.start(worker.run)
                    await controller.all_finished.wait()
                    worker.drain()
    finally:
        release.set()
    # Three heartbeats went out while the rejections' first flush was stuck
    # in fsync, and before any of their finishes could be sent.
    assert len(beats_while_held) >= 3
    assert len(controller.finishes) == 1000
    assert all(f["outcome"] == "rejected" for f in controller.finishes.values())
    assert all("unknown device 'gpu9'" in f["reason"] for f in controller.finishes.values())
    # Group commit: 2,000 files (a finish and a journal each) in a handful of
    # flushes, not one flush per file.
    assert worker._ctx is not None
    committer = worker._ctx.outbox.committer
    assert committer.files >= 2000
    assert committer.flushes <= 20
    # Everything delivered: nothing owed is left on disk.
    assert os.listdir(Path(config.state_dir) / "jobs") == []


async def test_before_creates_the_directory_a_group_writes_into(tmp_path: Path) -> None:
    committer = Committer()
    dirs = [tmp_path / f"job{i}" for i in range(12)]
    async with trio.open_nursery() as nursery:
        for d in dirs:
            nursery.start_soon(
                functools.partial(
                    committer.write_all,
                    [(d / "finish.json", {"d": d.name}), (d / "journal.json", {"d": d.name})],
                    before=d.mkdir,
                )
            )
    for d in dirs:
        assert read_json(d / "finish.json") == {"d": d.name}
        assert read_json(d / "journal.json") == {"d": d.name}
    assert committer.flushes == 1


async def test_an_unexpected_failure_in_a_flush_leaves_no_writer_believing_its_file_durable(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def broken_fsync(fd: int) -> None:
        raise RuntimeError("a bug in the flush")

    monkeypatch.setattr(os, "fsync", broken_fsync)
    committer = Committer()
    outcomes: list[str] = []

    async def writer(name: str) -> None:
        try:
            await committer.write(tmp_path / name, {})
        except OSError as e:
            outcomes.append(f"OSError: {e.strerror}")
        else:
            outcomes.append("durable")

    async with trio.open_nursery() as nursery:
        for i in range(5):
            nursery.start_soon(writer, f"f{i}.json")
    assert "durable" not in outcomes
    assert len(outcomes) == 5
    # Every writer, the flush's leader too, gets an I/O error naming the bug.
    assert all(o.startswith("OSError: durable write failed") for o in outcomes), outcomes
    assert all("a bug in the flush" in o for o in outcomes), outcomes


# -- a new directory's own entry ------------------------------------------------------


class RecordingDisk(SimDisk):
    """A strict simulated disk (a new directory is a name like any other: kept by a power
    loss only once its parent is fsynced) that records each directory fsync; one directory
    (``fail``) refuses its fsync."""

    def __init__(self, fail: Path | None = None) -> None:
        super().__init__()
        self.strict_dirs = True
        self.dir_fsyncs: list[Path] = []
        self.fail = fail

    def fsync_dir(self, path: Path) -> None:
        if path == self.fail:
            raise OSError(errno.EIO, "Input/output error", str(path))
        super().fsync_dir(path)
        self.dir_fsyncs.append(path)


async def inline(fn: Callable[[], Any]) -> Any:
    """Run blocking work inline, as the simulated host does."""
    await trio.lowlevel.checkpoint()
    return fn()


def state_on(disk: SimDisk) -> Path:
    root = Path("/state")
    ensure_state_dir(str(root), disk)
    disk.sync()  # the state directory itself was made long ago
    if isinstance(disk, RecordingDisk):
        disk.dir_fsyncs.clear()  # counted from here: the writes under test
    return root


async def test_a_journal_in_a_new_job_directory_survives_a_power_loss() -> None:
    disk = RecordingDisk()
    root = state_on(disk)
    committer = Committer(inline, store=disk)
    dirs = [JobDir(root, f"j-{i}.1", disk) for i in range(5)]
    async with trio.open_nursery() as nursery:
        for jd in dirs:
            nursery.start_soon(
                functools.partial(committer.write, jd.journal, {"job_id": jd.key}, before=jd.create)
            )
    disk.power_loss()
    # Every awaited journal is there: the job directories' own entries in jobs/ were
    # fsynced too, not only the journals in them.
    for jd in dirs:
        assert read_json(jd.journal, disk) == {"job_id": jd.key}
    # Shared: one fsync of jobs/ for the five directories the flush made there.
    assert disk.dir_fsyncs.count(root / "jobs") == 1
    assert sorted(disk.dir_fsyncs) == sorted([root / "jobs", *(jd.path for jd in dirs)])
    assert committer.flushes == 1
    assert committer.dir_syncs == 6


async def test_a_write_whose_new_directory_cannot_be_made_durable_fails() -> None:
    disk = RecordingDisk(fail=Path("/state/jobs"))
    root = state_on(disk)
    committer = Committer(inline, store=disk)
    jd = JobDir(root, "j-1.1", disk)
    with pytest.raises(OSError, match="Input/output error"):
        await committer.write(jd.journal, {"job_id": jd.key}, before=jd.create)
    # A file into a directory that exists already needs no fsync of its parent.
    await committer.write(jd.finish, {"outcome": "succeeded"})
    assert read_json(jd.finish, disk) == {"outcome": "succeeded"}


def test_a_new_state_directory_survives_a_power_loss() -> None:
    # jobs/ and faults/, and the state directory itself, are names in their parents: a
    # journal later written under jobs/ counts on them outliving a power loss.
    disk = RecordingDisk()
    root = Path("/var/lib/rc/state")
    ensure_state_dir(str(root), disk)
    disk.power_loss()
    assert disk.is_dir(root / "jobs")
    assert disk.is_dir(root / "faults")
    # Once each, from the state directory up to the first that was there already (/).
    assert disk.dir_fsyncs == [*root.parents, root]


def test_directories_made_for_the_lock_are_fsynced_up_to_one_that_existed() -> None:
    # The worker makes the state directory for its lock, before ensure_state_dir sees it.
    disk = RecordingDisk()
    disk.mkdir(Path("/var"))
    disk.sync()
    make_dirs_durably(Path("/var/lib/rc"), disk)
    disk.power_loss()
    assert disk.is_dir(Path("/var/lib/rc"))
    assert disk.dir_fsyncs == [Path("/var/lib"), Path("/var")]
    # Already there: nothing to fsync.
    make_dirs_durably(Path("/var/lib/rc"), disk)
    assert disk.dir_fsyncs == [Path("/var/lib"), Path("/var")]
