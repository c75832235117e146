"""SQLite's job output in files beside the database (``persist/output_files.py``).

The rule under test: a byte counts once its length is committed. The decisions are
pure and property-tested; the rest runs on a real state directory, with the crashes
between a file write and its commit played by failing the commit, and by bytes left
on disk as a killed process leaves them.
"""

from __future__ import annotations

import errno
import logging
import os
import shutil
import sqlite3
import tempfile
import threading
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from rc_worker.controller.persist import OutputRecounted, StoreWriteError
from rc_worker.controller.persist.codec import Batch, JobRow
from rc_worker.controller.persist.opening import open_backend
from rc_worker.controller.persist.output_files import OutputFiles, extend, file_name, reconcile
from rc_worker.controller.persist.sqlite import (
    DB_NAME,
    MIGRATION_HEADROOM,
    OUTPUT_DIR,
    SqliteBackend,
    space_for_files,
)

# --- pure -----------------------------------------------------------------------------------


@given(st.text(min_size=1, max_size=40))
def test_a_file_name_is_one_plain_name_whatever_the_id(job_id: str) -> None:
    name = file_name(job_id)
    assert "/" not in name
    assert "\0" not in name
    assert name not in (".", "..")
    assert 0 < len(name.encode()) <= 255


@given(st.text(min_size=1, max_size=40), st.text(min_size=1, max_size=40))
def test_two_ids_never_share_a_file(a: str, b: str) -> None:
    if a != b:
        assert file_name(a) != file_name(b)


def test_a_hostile_id_gets_a_hashed_name() -> None:
    assert file_name("j-7-ab12") == "j-7-ab12"
    for hostile in ("../../etc/passwd", "..", ".hidden", "a/b", "x" * 300):
        assert file_name(hostile).startswith("%")


@st.composite
def contiguous(draw: st.DrawFn) -> tuple[int, list[tuple[int, int]]]:
    """A committed length and pieces as the store hands them out: each continues the
    last, some already committed (a retried batch), in any order."""
    length = draw(st.integers(0, 50))
    pieces, pos = [], draw(st.integers(0, length))
    for size in draw(st.lists(st.integers(0, 20), max_size=8)):
        pieces.append((pos, size))
        pos += size
    return length, draw(st.permutations(pieces))


@given(contiguous())
def test_the_length_covers_every_contiguous_piece(case: tuple[int, list[tuple[int, int]]]) -> None:
    length, pieces = case
    assert extend(length, pieces) == max([length] + [off + n for off, n in pieces])


@given(st.integers(0, 50), st.lists(st.tuples(st.integers(0, 100), st.integers(0, 20))))
def test_the_length_never_counts_a_byte_past_a_hole(
    length: int, pieces: list[tuple[int, int]]
) -> None:
    end = extend(length, pieces)
    assert end >= length
    # Every byte below the new end is the old length's or some piece's.
    covered = set(range(length))
    for off, n in pieces:
        covered |= set(range(off, off + n))
    assert set(range(end)) <= covered


@given(
    st.dictionaries(st.sampled_from(["j-1", "j-2", "j-3", "a/b"]), st.integers(0, 9)),
    st.dictionaries(
        st.sampled_from(["j-1", "j-2", "j-4", file_name("a/b")]),
        st.integers(-1, 9),  # -1: an entry that is not a plain file (a link)
    ),
)
def test_after_a_repair_every_file_matches_its_length(
    lengths: dict[str, int], sizes: dict[str, int]
) -> None:
    repair = reconcile(lengths, sizes)
    files = {name: n for name, n in sizes.items() if name not in repair.remove}
    files.update(repair.truncate)
    final = dict(lengths)
    final.update({job_id: found for job_id, _, found in repair.shortened})
    by_name = {file_name(job_id): n for job_id, n in final.items()}
    # Only files without a length, and what is not a plain file, are removed; every length
    # has exactly its bytes behind it.
    assert set(repair.remove) == (set(sizes) - set(by_name)) | {
        n for n, v in sizes.items() if v < 0
    }
    assert all(files.get(name, 0) == n for name, n in by_name.items())
    # A cut never goes below a committed length, and a length only shrinks to what is there.
    assert all(
        n == by_name[name] == lengths[j]
        for name, n in repair.truncate
        for j in lengths
        if file_name(j) == name
    )
    assert all(found < committed for _, committed, found in repair.shortened)


# --- on a real state directory -----------------------------------------------------------------


def finished(*jobs: tuple[str, float, bytes]) -> Batch:
    """A commit of finished jobs ``(job_id, finished_at, output)``, each with its output."""
    return Batch(
        generation=1,
        jobs=tuple(
            JobRow(job_id, seq, "succeeded", at, f'{{"job_id": "{job_id}"}}')
            for seq, (job_id, at, _) in enumerate(jobs, 1)
        ),
        output=tuple((job_id, 0, data) for job_id, _, data in jobs),
    )


def opened(state_dir: Path) -> SqliteBackend:
    backend = open_backend(state_dir=state_dir)
    assert isinstance(backend, SqliteBackend)
    return backend


def stored(state_dir: Path, *jobs: tuple[str, float, bytes]) -> None:
    """A state directory holding ``jobs`` finished (see ``finished``), its backend closed."""
    backend = opened(state_dir)
    try:
        backend.write([finished(*jobs)])
    finally:
        backend.close()


def test_output_lives_in_files_and_the_database_keeps_lengths(tmp_path: Path) -> None:
    backend = opened(tmp_path)
    try:
        backend.write([Batch(generation=1, output=(("j-1-t", 0, b"hello "),))])
        backend.write([Batch(generation=2, output=(("j-1-t", 6, b"world\n"),))])
        assert (tmp_path / OUTPUT_DIR / "j-1-t").read_bytes() == b"hello world\n"
        assert backend.read_output("j-1-t", 3, 4) == b"lo w"
        assert backend.read_output("j-1-t", 0, None) == b"hello world\n"
        assert backend.read_output("j-9-t", 0, None) == b""
    finally:
        backend.close()
    with sqlite3.connect(tmp_path / DB_NAME) as conn:
        assert conn.execute("SELECT COUNT(*) FROM output").fetchone() == (0,)
        assert conn.execute("SELECT job_id, length FROM output_files").fetchall() == [("j-1-t", 12)]


def test_a_failed_commit_leaves_its_bytes_unread_and_cut_at_the_next_open(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    backend = opened(tmp_path)
    backend.write([Batch(generation=1, output=(("j-1-t", 0, b"kept"),))])

    def refuse() -> None:
        raise sqlite3.OperationalError("disk I/O error")

    monkeypatch.setattr(backend, "_commit", refuse)
    with pytest.raises(StoreWriteError):
        backend.write([Batch(generation=2, output=(("j-1-t", 4, b" never acknowledged"),))])
    monkeypatch.undo()
    # The bytes reached the file before the commit failed; they do not count.
    assert (tmp_path / OUTPUT_DIR / "j-1-t").stat().st_size > 4
    assert backend.read_output("j-1-t", 0, None) == b"kept"
    backend.close()
    backend = opened(tmp_path)
    try:
        assert (tmp_path / OUTPUT_DIR / "j-1-t").read_bytes() == b"kept"
        # And the batch, retried, stores them once.
        backend.write([Batch(generation=2, output=(("j-1-t", 4, b" then stored"),))])
        assert backend.read_output("j-1-t", 0, None) == b"kept then stored"
    finally:
        backend.close()


def test_an_open_removes_files_never_committed(tmp_path: Path) -> None:
    opened(tmp_path).close()
    stray = tmp_path / OUTPUT_DIR / "j-5-t"
    stray.write_bytes(b"written by a controller killed before its commit")
    backend = opened(tmp_path)
    try:
        assert not stray.exists()
        assert backend.read_output("j-5-t", 0, None) == b""
    finally:
        backend.close()


def test_a_short_file_is_served_as_it_is_and_said_once(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    stored(tmp_path, ("j-1-t", 1.0, b"0123456789"))
    (tmp_path / OUTPUT_DIR / "j-1-t").write_bytes(b"0123")  # a backup copied too early
    with caplog.at_level(logging.WARNING, logger="rc_worker.controller"):
        backend = opened(tmp_path)
    try:
        [message] = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
        assert "j-1-t" in message
        assert "4 of the 10 bytes" in message
        assert backend.read_output("j-1-t", 0, None) == b"0123"
        row = backend.read_job("j-1-t")
        assert row is not None
        assert row[1] == 4
    finally:
        backend.close()
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="rc_worker.controller"):
        opened(tmp_path).close()
    assert not [r for r in caplog.records if r.levelno == logging.WARNING]


def test_a_hostile_job_id_stays_inside_the_output_directory(tmp_path: Path) -> None:
    state = tmp_path / "state"
    backend = opened(state)
    try:
        backend.write([Batch(generation=1, output=(("../../escaped", 0, b"x"),))])
        assert not (tmp_path / "escaped").exists()
        assert [p.name for p in (state / OUTPUT_DIR).iterdir()] == [file_name("../../escaped")]
        assert backend.read_output("../../escaped", 0, None) == b"x"
    finally:
        backend.close()


def test_retention_removes_the_files_of_the_jobs_it_deletes(tmp_path: Path) -> None:
    backend = opened(tmp_path)
    try:
        backend.write([finished(("j-1-t", 10.0, b"old"), ("j-2-t", 99.0, b"new"))])
        assert backend.delete_finished_before(50.0, 10) == [("j-1-t", "succeeded")]
        assert sorted(p.name for p in (tmp_path / OUTPUT_DIR).iterdir()) == ["j-2-t"]
        assert backend.read_output("j-1-t", 0, None) == b""
        assert backend.read_output("j-2-t", 0, None) == b"new"
    finally:
        backend.close()


def test_an_unreadable_output_directory_is_one_line_at_open(tmp_path: Path) -> None:
    from rc_worker.controller.persist import StoreOpenError

    opened(tmp_path).close()
    (tmp_path / OUTPUT_DIR).rmdir()
    (tmp_path / OUTPUT_DIR).write_text("not a directory")
    with pytest.raises(StoreOpenError) as caught:
        opened(tmp_path)
    message = str(caught.value)
    assert "\n" not in message
    assert str(tmp_path) in message


def test_a_file_cut_under_a_running_controller_is_recounted_not_read_short(
    tmp_path: Path,
) -> None:
    """Never a short read that looks whole: the read that finds the file cut counts the
    job's output at what the file holds (stored, so a restart counts the same) and says
    so (``OutputRecounted``, a ``StoreWriteError`` to a caller that knows nothing of it);
    the caller reads again."""
    backend = opened(tmp_path)
    try:
        backend.write([Batch(generation=1, output=(("j-1-t", 0, b"0123456789"),))])
        (tmp_path / OUTPUT_DIR / "j-1-t").write_bytes(b"0123")
        assert backend.read_output("j-1-t", 0, 4) == b"0123"
        with pytest.raises(OutputRecounted) as caught:
            backend.read_output("j-1-t", 0, None)
        assert isinstance(caught.value, StoreWriteError)
        assert (caught.value.job_id, caught.value.stored, caught.value.counted) == (
            "j-1-t",
            10,
            4,
        )
        assert "\n" not in str(caught.value)
        assert backend.read_output("j-1-t", 0, None) == b"0123"
        (tmp_path / OUTPUT_DIR / "j-1-t").unlink()
        with pytest.raises(OutputRecounted) as caught:
            backend.read_output("j-1-t", 2, None)
        assert (caught.value.stored, caught.value.counted) == (4, 0)
        assert backend.read_output("j-1-t", 0, None) == b""
        assert backend.read_job("j-1-t") is None  # no job row; its length, as stored:
        assert backend._length("j-1-t") == 0
    finally:
        backend.close()


def test_a_link_in_the_output_directory_is_never_followed(tmp_path: Path) -> None:
    opened(tmp_path).close()
    target = tmp_path / "elsewhere"
    target.write_bytes(b"not the controller's")
    (tmp_path / OUTPUT_DIR / "j-1-t").symlink_to(target)
    backend = opened(tmp_path)  # a link is no output file: removed at open
    try:
        assert not (tmp_path / OUTPUT_DIR / "j-1-t").is_symlink()
        backend.write([Batch(generation=1, output=(("j-1-t", 0, b"mine"),))])
        assert backend.read_output("j-1-t", 0, None) == b"mine"
        assert target.read_bytes() == b"not the controller's"
    finally:
        backend.close()


def test_a_read_racing_retention_gets_nothing_not_an_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    backend = opened(tmp_path)
    try:
        backend.write([finished(("j-1-t", 10.0, b"0123456789"))])
        read = backend.files.read

        def retention_first(job_id: str, offset: int, size: int) -> bytes:
            # Retention commits and removes the file between the length's read and this one.
            assert backend.delete_finished_before(50.0, 10) == [("j-1-t", "succeeded")]
            return read(job_id, offset, size)

        monkeypatch.setattr(backend.files, "read", retention_first)
        assert backend.read_output("j-1-t", 0, None) == b""
    finally:
        backend.close()


def test_a_name_created_by_a_failed_write_is_made_durable_by_its_retry(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from rc_worker.controller.persist import output_files

    backend = opened(tmp_path)
    synced: list[Path] = []
    real_fsync_dir = output_files._fsync_dir
    monkeypatch.setattr(output_files, "_fsync_dir", lambda p: (synced.append(p), real_fsync_dir(p)))
    real_pwrite = output_files._pwrite_all

    def full_for_b(fd: int, data: bytes, offset: int) -> None:
        if data == b"b":
            raise OSError(28, "No space left on device")
        real_pwrite(fd, data, offset)

    monkeypatch.setattr(output_files, "_pwrite_all", full_for_b)
    try:
        with pytest.raises(StoreWriteError):
            backend.write([Batch(generation=1, output=(("j-a", 0, b"a"), ("j-b", 0, b"b")))])
        assert (tmp_path / OUTPUT_DIR / "j-a").exists()  # created, its name not yet synced
        monkeypatch.setattr(output_files, "_pwrite_all", real_pwrite)
        synced.clear()
        # The retry finds j-a there; its name must still be synced before its length counts.
        backend.write([Batch(generation=1, output=(("j-a", 0, b"a"),))])
        assert synced == [tmp_path / OUTPUT_DIR]
        assert backend.read_output("j-a", 0, None) == b"a"
    finally:
        backend.close()


def test_a_directory_among_the_output_files_is_refused_in_one_line(tmp_path: Path) -> None:
    from rc_worker.controller.persist import StoreOpenError

    opened(tmp_path).close()
    (tmp_path / OUTPUT_DIR / "j-1-t").mkdir()
    with pytest.raises(StoreOpenError) as caught:
        opened(tmp_path)
    message = str(caught.value)
    assert "\n" not in message
    assert str(tmp_path / OUTPUT_DIR / "j-1-t") in message
    assert "move it out" in message


def _store_of_schema_1(state_dir: Path) -> None:
    fixture = Path(__file__).parent.parent / "fixtures" / "controller-schema-v1.sql"
    text = "\n".join(line for line in fixture.read_text().splitlines() if not line.startswith("--"))
    state_dir.mkdir(mode=0o700)
    conn = sqlite3.connect(state_dir / DB_NAME)
    try:
        for sql in (s.strip() for s in text.split(";\n")):
            if sql:
                conn.execute(sql)
        conn.commit()
    finally:
        conn.close()


def test_an_upgrade_without_room_for_the_output_says_so_and_keeps_the_rows(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    from rc_worker.controller.persist import sqlite as sqlite_backend

    state = tmp_path / "state"
    _store_of_schema_1(state)
    monkeypatch.setattr(sqlite_backend.os, "statvfs", lambda path: _fs(1, files=1000))
    message = _upgrade_failing(state, monkeypatch, caplog)
    assert "14 bytes of job output" in message
    assert "and 4096 bytes and 1000 files are" in message
    # The upgrade done once there is room: said once, with what to run to compact.
    assert any("VACUUM" in r.getMessage() for r in caplog.records)


# --- a review's findings: space, a failed upgrade, files gone under a running controller -----


def _fs(free_blocks: int, *, files: int = 10_000, block: int = 4096) -> Any:
    return SimpleNamespace(
        f_bavail=free_blocks, f_frsize=block, f_bsize=block, f_files=files, f_favail=files
    )


def test_the_space_an_upgrade_needs_counts_whole_blocks_and_files() -> None:
    # 20,000 outputs of 100 bytes: 2 MB of output, 82 MB of files on 4 KiB blocks.
    need, free, files_free = space_for_files([100] * 20_000, _fs(1000))
    assert need == 20_000 * 4096
    assert free == 1000 * 4096
    assert files_free == 10_000
    assert space_for_files([0, 4096, 4097], _fs(1))[0] == 0 + 4096 + 8192
    # No inode count (btrfs): no fixed limit of files.
    assert space_for_files([1, 2], _fs(1, files=0))[2] == 2


def test_an_upgrade_refuses_when_the_files_would_not_fit_though_the_bytes_would(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from rc_worker.controller.persist import StoreOpenError
    from rc_worker.controller.persist import sqlite as sqlite_backend

    state = tmp_path / "state"
    _store_of_schema_1(state)
    with sqlite3.connect(state / DB_NAME) as conn:  # three more jobs' output: 4 files
        conn.executemany(
            "INSERT INTO output (job_id, off, data) VALUES (?, 0, ?)",
            [(f"j-{i}-more", b"x" * 100) for i in range(3)],
        )
    headroom = MIGRATION_HEADROOM // 4096
    # Room for the 314 bytes (and the headroom), not for the four whole blocks they take.
    monkeypatch.setattr(sqlite_backend.os, "statvfs", lambda path: _fs(headroom + 1))
    with pytest.raises(StoreOpenError) as caught:
        opened(state)
    assert f"needs {MIGRATION_HEADROOM + 4 * 4096} bytes and 4 files free" in str(caught.value)
    # Blocks enough, files not:
    monkeypatch.setattr(sqlite_backend.os, "statvfs", lambda path: _fs(headroom + 4, files=3))
    with pytest.raises(StoreOpenError):
        opened(state)
    monkeypatch.setattr(sqlite_backend.os, "statvfs", lambda path: _fs(headroom + 4, files=4))
    opened(state).close()


def _upgrade_failing(
    state: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> str:
    """Opening ``state`` (a store of schema 1) fails as ``monkeypatch`` arranged: the
    store is left as it was, no copy behind, nothing said moved; then, undone, the
    upgrade goes through. Returns the refusal."""
    from rc_worker.controller.persist import StoreOpenError

    with (
        caplog.at_level(logging.INFO, logger="rc_worker.controller"),
        pytest.raises(StoreOpenError) as caught,
    ):
        opened(state)
    assert "\n" not in str(caught.value)
    assert not any("VACUUM" in r.getMessage() for r in caplog.records)  # nothing moved
    assert list((state / OUTPUT_DIR).iterdir()) == []  # no copy left behind
    with sqlite3.connect(state / DB_NAME) as conn:  # untouched: still version 1, rows and all
        assert conn.execute("SELECT COUNT(*) FROM output").fetchone() == (2,)
    monkeypatch.undo()
    with caplog.at_level(logging.WARNING, logger="rc_worker.controller"):
        backend = opened(state)
    try:
        assert backend.read_output("j-1-v1", 0, None) == b"from schema 1\n"
    finally:
        backend.close()
    return str(caught.value)


def test_an_upgrade_that_fails_midway_through_a_write_leaves_no_copies(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    from rc_worker.controller.persist import output_files

    state = tmp_path / "state"
    _store_of_schema_1(state)
    real = output_files.OutputFiles.write

    def full_after_writing(self: Any, pieces: Any, committed: Any) -> set[str]:
        real(self, pieces, committed)  # the copies are there, then the disk is full
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(output_files.OutputFiles, "write", full_after_writing)
    _upgrade_failing(state, monkeypatch, caplog)


def test_an_upgrade_whose_commit_fails_leaves_no_copies_and_says_nothing_moved(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    state = tmp_path / "state"
    _store_of_schema_1(state)
    real = SqliteBackend._put_meta

    def full_at_the_end(self: Any, cur: Any, rows: Any) -> None:
        if ("schema_version", "3") in list(rows):
            raise sqlite3.OperationalError("database or disk is full")
        real(self, cur, rows)

    monkeypatch.setattr(SqliteBackend, "_put_meta", full_at_the_end)
    _upgrade_failing(state, monkeypatch, caplog)


def test_an_output_directory_holding_none_of_the_output_is_refused_not_emptied(
    tmp_path: Path,
) -> None:
    from rc_worker.controller.persist import StoreOpenError

    stored(tmp_path, ("j-1-t", 1.0, b"0123456789"), ("j-2-t", 2.0, b"ab"))
    output = tmp_path / OUTPUT_DIR
    shutil.move(output, tmp_path / "elsewhere")  # a file system not mounted, say
    output.mkdir()
    with pytest.raises(StoreOpenError) as caught:
        opened(tmp_path)
    message = str(caught.value)
    assert "\n" not in message
    assert "12 bytes of output of 2 jobs" in message
    assert "DELETE FROM output_files" in message
    with sqlite3.connect(tmp_path / DB_NAME) as conn:  # the lengths are kept
        assert conn.execute("SELECT SUM(length) FROM output_files").fetchone() == (12,)
    output.rmdir()
    shutil.move(tmp_path / "elsewhere", output)  # mounted again: all of it is served
    backend = opened(tmp_path)
    try:
        assert backend.read_output("j-1-t", 0, None) == b"0123456789"
    finally:
        backend.close()


@pytest.mark.parametrize("how", ["removed", "cut"])
def test_a_job_whose_file_went_under_a_running_controller_is_recounted_alone(
    tmp_path: Path, how: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Never written past a hole (which reads back as zeros, served as output), and never
    the whole store failing for one file: that job's output counts what its file holds,
    said in one line naming the file; the rest of the commit lands; the worker's resend
    from there fills it in. (The store failed every commit until the file was restored,
    answering 503 to every change on the controller.)"""
    backend = opened(tmp_path)
    path = tmp_path / OUTPUT_DIR / "j-1-t"
    kept = 0 if how == "removed" else 4
    try:
        first = (("j-1-t", 0, b"0123456789"), ("j-2-t", 0, b"a"))
        backend.write([Batch(generation=1, output=first)])
        if how == "removed":
            path.unlink()
        else:
            path.write_bytes(b"0123")
        more = Batch(generation=2, output=(("j-1-t", 10, b"abc"), ("j-2-t", 1, b"b")))
        with caplog.at_level(logging.WARNING, logger="rc_worker.controller"):
            assert backend.write([more]) == {"j-1-t": kept}
        [line] = [r.getMessage() for r in caplog.records if "j-1-t" in r.getMessage()]
        assert str(path) in line
        assert f"now counts {kept} bytes" in line
        assert path.read_bytes() == b"0123"[:kept]  # nothing written past the hole
        assert backend.read_output("j-1-t", 0, None) == b"0123"[:kept]
        assert backend.read_output("j-2-t", 0, None) == b"ab"  # the rest of it counts
        # The worker resends from what it is told is stored, and more after it.
        resent = Batch(generation=3, output=(("j-1-t", kept, b"0123456789abc"[kept:]),))
        assert backend.write([resent]) == {}
        assert backend.read_output("j-1-t", 0, None) == b"0123456789abc"
    finally:
        backend.close()
    reopened = opened(tmp_path)  # and a restart finds nothing to repair
    try:
        assert reopened.read_output("j-1-t", 0, None) == b"0123456789abc"
    finally:
        reopened.close()


@given(
    data=st.binary(min_size=1, max_size=40),
    split=st.integers(0, 40),
    kept=st.integers(0, 40),
    pieces=st.lists(st.tuples(st.integers(0, 40), st.integers(0, 20)), max_size=6),
)
def test_a_recounted_file_holds_exactly_the_bytes_it_counts(
    data: bytes, split: int, kept: int, pieces: list[tuple[int, int]]
) -> None:
    """Whatever was cut and whatever the next commit brings (retries below the cut,
    pieces that continue it, pieces past the hole): the length counted is
    :func:`extend` of what the file kept, and every byte below it is the job's own."""
    held = min(split, len(data))
    kept = min(kept, held)
    with tempfile.TemporaryDirectory() as d:
        files = OutputFiles(Path(d) / "output")
        files.write([("j", 0, data[:held])], {})
        os.truncate(files.path("j"), kept)
        writes = [(off, data[off : off + size]) for off, size in pieces if off < len(data)]
        recounted = files.write([("j", off, b) for off, b in writes], {"j": held})
        if kept == held or not writes:  # only a job being written is looked at
            assert recounted == {}
        else:
            length = extend(kept, [(off, len(b)) for off, b in writes])
            assert recounted == {"j": length}
            assert files.read("j", 0, length) == data[:length]


def test_one_job_whose_file_is_gone_is_counted_as_empty_at_the_next_start(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A restart counts what the file holds, as a running controller does (above)."""
    stored(tmp_path, ("j-1-t", 1.0, b"0123456789"))
    (tmp_path / OUTPUT_DIR / "j-1-t").unlink()
    with caplog.at_level(logging.WARNING, logger="rc_worker.controller"):
        backend = opened(tmp_path)
    try:
        assert any("0 of the 10 bytes" in r.getMessage() for r in caplog.records)
        assert backend.read_output("j-1-t", 0, None) == b""
        backend.write([Batch(generation=2, output=(("j-1-t", 0, b"resent"),))])
        assert backend.read_output("j-1-t", 0, None) == b"resent"
    finally:
        backend.close()


def test_retention_removes_its_files_before_another_commit_can_write(tmp_path: Path) -> None:
    backend = opened(tmp_path)
    held_elsewhere: list[bool] = []
    real_remove = backend.files.remove

    def remove(job_ids: Any) -> None:
        # Would another thread's commit get in now?
        got: list[bool] = []
        t = threading.Thread(target=lambda: got.append(backend.lock.acquire(blocking=False)))
        t.start()
        t.join()
        held_elsewhere.append(not got[0])
        if got[0]:
            backend.lock.release()
        real_remove(job_ids)

    backend.files.remove = remove  # type: ignore[method-assign]
    try:
        backend.write([finished(("j-1-t", 10.0, b"old"))])
        assert backend.delete_finished_before(50.0, 10) == [("j-1-t", "succeeded")]
        assert held_elsewhere == [True]
    finally:
        backend.close()


@pytest.mark.parametrize("code", [errno.EINVAL, errno.EIO])
def test_a_directory_that_cannot_be_fsynced_is_carried_on_past_only_when_unsupported(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, code: int
) -> None:
    import stat

    from rc_worker.controller.persist import StoreOpenError, output_files

    real_fsync = os.fsync

    def fsync(fd: int) -> None:
        if stat.S_ISDIR(os.fstat(fd).st_mode):
            raise OSError(code, os.strerror(code))
        real_fsync(fd)

    monkeypatch.setattr(output_files.os, "fsync", fsync)
    if code == errno.EIO:  # a real error stays one, in one line
        with pytest.raises(StoreOpenError) as caught:
            opened(tmp_path)
        assert "\n" not in str(caught.value)
        return
    backend = opened(tmp_path)  # EINVAL: the file system cannot sync a directory
    try:
        backend.write([finished(("j-1-t", 1.0, b"kept"))])
        assert backend.read_output("j-1-t", 0, None) == b"kept"
    finally:
        backend.close()


def test_a_transaction_inside_another_is_refused_not_nested(tmp_path: Path) -> None:
    """The lock is re-entrant (retention holds it past its commit): a nested transaction
    would BEGIN inside the open one, and its rollback would undo both."""
    backend = opened(tmp_path)
    try:
        with backend._transaction(backend._write_failed) as cur:
            cur.execute("SELECT 1")
            with pytest.raises(RuntimeError, match="inside another"):
                backend.read_output("j-1-t", 0, None)  # opens a transaction of its own
        with pytest.raises(RuntimeError), backend._transaction(backend._write_failed):
            backend.read_output("j-1-t", 0, None)
        # Neither left a transaction open: the store still works.
        backend.write([finished(("j-1-t", 1.0, b"after"))])
        assert backend.read_output("j-1-t", 0, None) == b"after"
    finally:
        backend.close()
