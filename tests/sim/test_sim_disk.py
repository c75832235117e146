"""The simulated disk (``rc_worker.testing.simdisk``): its crash semantics, its faults,
and that it answers as the real file system does (``LinuxStore``)."""

from __future__ import annotations

import errno
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import pytest
import trio
import trio.testing
from hypothesis import given, settings
from hypothesis import strategies as st

from rc_worker.durable import Committer
from rc_worker.recovery import Damaged, recover
from rc_worker.spool import JobDir, ensure_state_dir, write_json_durably
from rc_worker.statelock import StateDirLocked
from rc_worker.statestore import Entry, LinuxStore, StateStore
from rc_worker.testing.sim import Script, SimHost
from rc_worker.testing.simdisk import SimDisk

ROOT = Path("/state")
T = TypeVar("T")


def _durable_write(disk: StateStore, path: Path, data: bytes) -> None:
    """What ``durable.Committer`` does for one file."""
    tmp = path.with_name(path.name + ".tmp")
    disk.write_synced(tmp, data)
    disk.replace(tmp, path)
    disk.fsync_dir(path.parent)


def _disk() -> SimDisk:
    disk = SimDisk()
    disk.mkdir(ROOT / "jobs", parents=True)
    return disk


# -- crash semantics ---------------------------------------------------------------


def test_a_durable_write_survives_a_power_loss() -> None:
    disk = _disk()
    _durable_write(disk, ROOT / "journal.json", b'{"spawned": true}')
    disk.power_loss()
    assert disk.read(ROOT / "journal.json") == b'{"spawned": true}'
    assert disk.listdir(ROOT) == ["jobs", "journal.json"]


def test_a_rename_whose_directory_was_not_fsynced_may_be_lost() -> None:
    disk = _disk()
    _durable_write(disk, ROOT / "a.json", b"old")
    disk.write_synced(ROOT / "a.json.tmp", b"new")
    disk.replace(ROOT / "a.json.tmp", ROOT / "a.json")
    assert disk.read(ROOT / "a.json") == b"new"  # while the host runs
    disk.power_loss()
    # The directory as at its last fsync: the old file under its name, no temporary.
    assert disk.read(ROOT / "a.json") == b"old"
    assert disk.listdir(ROOT) == ["a.json", "jobs"]


def test_a_removal_not_yet_durable_comes_back_after_a_power_loss() -> None:
    disk = _disk()
    _durable_write(disk, ROOT / "f.json", b"x")
    disk.unlink(ROOT / "f.json")
    assert not disk.exists(ROOT / "f.json")
    disk.power_loss()
    assert disk.read(ROOT / "f.json") == b"x"
    disk.unlink(ROOT / "f.json")
    disk.fsync_dir(ROOT)
    disk.power_loss()
    assert not disk.exists(ROOT / "f.json")


def test_appended_data_never_fsynced_is_lost_or_torn() -> None:
    for torn, expected in ((False, b"synced"), (True, b"synced" + b"abc")):
        disk = _disk()
        disk.torn_writes = torn
        out = ROOT / "out"
        _durable_write(disk, out, b"synced")
        spool = disk.open_append(out)
        assert spool.write(memoryview(b"abcdef")) == 6
        assert disk.read(out) == b"syncedabcdef"
        disk.power_loss()
        assert disk.read(out) == expected, torn


def test_a_torn_rewrite_leaves_half_of_the_new_data() -> None:
    disk = _disk()
    disk.torn_writes = True
    path = ROOT / "journal.json"
    _durable_write(disk, path, b"{}")
    # Written in place, never fsynced (what no durable write does): half survives.
    disk.rmtree(ROOT / "nothing")  # a no-op, as on the real disk
    spool = disk.open_append(path)
    spool.write(memoryview(b"0123"))
    disk.power_loss()
    assert disk.read(path) == b"{}01"


async def test_a_clean_reboot_loses_nothing(autojump_clock: trio.testing.MockClock) -> None:
    host = SimHost()
    host.disk.mkdir(ROOT, parents=True)
    spool = host.disk.open_append(ROOT / "out")
    spool.write(memoryview(b"kept"))
    host.reboot()
    host.disk.power_loss()  # even a later power loss: the reboot synced it
    assert host.disk.read(ROOT / "out") == b"kept"


# -- faults --------------------------------------------------------------------------


def test_a_full_disk_refuses_writes_with_enospc_and_takes_what_fits() -> None:
    disk = _disk()
    _durable_write(disk, ROOT / "a", b"12345")
    disk.capacity = disk.used() + 3
    spool = disk.open_append(ROOT / "out")
    assert spool.write(memoryview(b"abcdef")) == 3  # a short write, as the kernel's
    with pytest.raises(OSError, match="No space") as raised:
        spool.write(memoryview(b"g"))
    assert raised.value.errno == errno.ENOSPC
    with pytest.raises(OSError, match="No space") as raised:
        disk.write_synced(ROOT / "b", b"x")
    assert raised.value.errno == errno.ENOSPC
    disk.unlink(ROOT / "a")  # freeing space makes room again
    disk.write_synced(ROOT / "b", b"x")
    disk.capacity = None
    disk.fill()
    with pytest.raises(OSError, match="No space"):
        disk.write_synced(ROOT / "c", b"y")


def test_a_vanished_directory_refuses_what_is_written_into_it() -> None:
    disk = _disk()
    job = ROOT / "jobs" / "j-1.1"
    disk.mkdir(job)
    _durable_write(disk, job / "journal.json", b"{}")
    disk.vanish(job)
    assert not disk.exists(job)
    with pytest.raises(FileNotFoundError):
        _durable_write(disk, job / "finish.json", b"{}")
    disk.power_loss()
    assert not disk.exists(job)  # gone for good, not only until a crash


async def test_the_lock_is_held_until_released_or_its_holder_dies(
    autojump_clock: trio.testing.MockClock,
) -> None:
    host = SimHost()
    host.disk.mkdir(ROOT, parents=True)
    with host.disk.lock(ROOT, pid=host.own_pid()):
        with pytest.raises(StateDirLocked, match=f"pid {host.own_pid()}"):
            host.disk.lock(ROOT, pid=999)
        assert host.disk.read(ROOT / "lock") == f"{host.own_pid()}\n".encode()
    with host.disk.lock(ROOT, pid=host.own_pid()):
        host.worker_started()  # the holder was SIGKILLed: its lock went with it
        with host.disk.lock(ROOT, pid=host.own_pid()):
            pass


def test_a_program_at_a_path_is_a_file_which_finds() -> None:
    host = SimHost()
    host.program("/opt/bin/nvidia-smi", Script.sleeping(0))
    assert host.store.which("nvidia-smi", "/usr/bin:/opt/bin") == "/opt/bin/nvidia-smi"
    assert host.store.which("nvidia-smi", "/usr/bin") is None
    entry = host.store.entry(Path("/opt/bin/nvidia-smi"))
    assert entry == Entry("file", 0, executable=True)


# -- conformance: the same operations on the real disk and the simulated one -----

DIRS = ["a", "a/b"]
FILES = ["x", "a/y", "a/b/z"]
OPS = st.one_of(
    st.tuples(st.just("mkdir"), st.sampled_from(DIRS), st.booleans()),
    st.tuples(st.just("write_synced"), st.sampled_from(FILES), st.binary(max_size=8)),
    st.tuples(st.just("append"), st.sampled_from(FILES), st.binary(max_size=8)),
    st.tuples(st.just("touch"), st.sampled_from(FILES)),
    st.tuples(st.just("read"), st.sampled_from(FILES), st.integers(0, 4), st.integers(-1, 4)),
    st.tuples(st.just("size"), st.sampled_from(FILES)),
    st.tuples(st.just("unlink"), st.sampled_from(FILES)),
    st.tuples(st.just("replace"), st.sampled_from(FILES), st.sampled_from(FILES)),
    st.tuples(st.just("fsync_dir"), st.sampled_from(["", *DIRS])),
    st.tuples(st.just("listdir"), st.sampled_from(["", *DIRS])),
    st.tuples(st.just("entry"), st.sampled_from(["", *DIRS, *FILES])),
    st.tuples(st.just("rmtree"), st.sampled_from(DIRS)),
    st.tuples(st.just("tree_bytes"), st.sampled_from(["", *DIRS, *FILES])),
    st.tuples(st.just("chmod"), st.sampled_from(FILES), st.sampled_from([0o600, 0o700])),
)


def _apply(store: StateStore, base: Path, op: tuple[object, ...]) -> object:
    name, *args = op
    path = base / str(args[0]) if args and isinstance(args[0], str) else base
    try:
        if name == "mkdir":
            store.mkdir(path, parents=bool(args[1]))
        elif name == "write_synced":
            store.write_synced(path, bytes(args[1]))  # type: ignore[call-overload]
        elif name == "append":
            f = store.open_append(path)
            try:
                return f.write(memoryview(bytes(args[1]))), f.size()  # type: ignore[call-overload]
            finally:
                f.close()
        elif name == "touch":
            store.touch(path)
        elif name == "read":
            return store.read(path, int(args[1]), int(args[2]))  # type: ignore[call-overload]
        elif name == "size":
            return store.size(path)
        elif name == "unlink":
            store.unlink(path)
        elif name == "replace":
            store.replace(path, base / str(args[1]))
        elif name == "fsync_dir":
            store.fsync_dir(path)
        elif name == "listdir":
            return store.listdir(path)
        elif name == "entry":
            return store.entry(path)
        elif name == "rmtree":
            store.rmtree(path)
        elif name == "tree_bytes":
            return store.tree_bytes(path)
        elif name == "chmod":
            store.chmod(path, int(args[1]))  # type: ignore[call-overload]
            return store.entry(path)
    except OSError as e:
        return ("error", e.errno)
    return None


def _tree(store: StateStore, path: Path) -> object:
    entry = store.entry(path)
    assert entry is not None
    if entry.kind == "dir":
        return {n: _tree(store, path / n) for n in store.listdir(path)}
    return store.read(path), entry.executable


@settings(max_examples=150, deadline=None)
@given(ops=st.lists(OPS, max_size=25))
def test_the_simulated_disk_answers_as_the_real_one(ops: list[tuple[object, ...]]) -> None:
    with tempfile.TemporaryDirectory(prefix="rc-conformance-") as tmp:
        real_base = Path(tmp)
        sim = SimDisk()
        sim_base = Path("/sim/base")
        sim.mkdir(sim_base, parents=True)
        real = LinuxStore()
        for op in ops:
            assert _apply(real, real_base, op) == _apply(sim, sim_base, op), op
        assert _tree(real, real_base) == _tree(sim, sim_base)


async def _inline(fn: Callable[[], T]) -> T:
    return fn()


async def _recover_on(store: StateStore, root: Path) -> tuple[object, ...]:
    """Leave what a crash leaves, recover from it, and say what came of it."""
    ensure_state_dir(str(root), store)
    spawned = JobDir(root, "j-1.1", store)
    spawned.create()
    write_json_durably(
        spawned.journal,
        {"job_id": "j-1", "attempt": 1, "device": "gpu0", "boot_id": "old", "spawned": True},
        store,
    )
    out = store.open_append(spawned.output)
    out.write(memoryview(b"before the crash\n"))
    out.close()
    garbage = JobDir(root, "j-2.1", store)
    garbage.create()
    store.write_synced(garbage.journal, b"{not json")
    never_ran = JobDir(root, "j-3.1", store)
    never_ran.create()
    write_json_durably(never_ran.finish, {"outcome": "rejected"}, store)
    damaged: list[Damaged] = []
    committer = Committer(_inline, store=store)
    found = await recover(
        root, boot_id="new", require_manual_clear=False, committer=committer, damaged=damaged
    )
    return found, [(d.device, d.why) for d in damaged], _tree(store, root)


async def test_recovery_comes_to_the_same_on_both_disks(tmp_path: Path) -> None:
    real = await _recover_on(LinuxStore(), tmp_path / "state")
    simulated = await _recover_on(SimDisk(), Path("/srv/rc/state"))
    assert real == simulated
    found, damaged, tree = real
    assert [(r.job_id, r.claim.value, r.reboot) for r in found] == [("j-1", "gone", True)]
    assert damaged == [(None, "job directory j-2.1: journal.json is not a JSON object")]
    assert isinstance(tree, dict)
    assert sorted(tree["jobs"]) == ["j-1.1", "j-3.1"]
    assert sorted(tree["damaged"]) == ["j-2.1"]
    assert b'"outcome": "lost"' in tree["jobs"]["j-1.1"]["finish.json"][0]
