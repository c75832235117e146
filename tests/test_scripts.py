"""The one script runner: its listing rule, limit, capture and failure text, with real processes."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest
import trio
import trio.testing

from rc_worker.host import LinuxHost
from rc_worker.scripts import (
    REASON_OUTPUT_CAP,
    TAIL_KEEP,
    Budget,
    Limit,
    Listing,
    ScriptRun,
    Skipped,
    describe,
    list_scripts,
    log_skipped,
    run_script,
)

ENV = {"PATH": os.environ.get("PATH", "/usr/bin:/bin")}


def script(path: Path, body: str, mode: int = 0o755) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("#!/bin/sh\n" + body + "\n")
    path.chmod(mode)
    return path


async def sh(body: str, tmp_path: Path, *, seconds: float = 10.0, **kwargs: object) -> ScriptRun:
    path = script(tmp_path / "s", body)
    with trio.fail_after(30):
        return await run_script(
            [str(path)],
            env=ENV,
            limit=Limit(seconds, seconds),
            grace=1.0,
            **kwargs,  # type: ignore[arg-type]
        )


# -- the listing rule ----------------------------------------------------------------


def test_listing_keeps_regular_executables_in_name_order(tmp_path: Path) -> None:
    d = tmp_path / "d"
    script(d / "20-b", "exit 0")
    script(d / "10-a", "exit 0")
    script(d / "30-off", "exit 0", mode=0o644)
    script(d / ".15-hidden", "exit 0")
    (d / "25-dir").mkdir()
    os.mkfifo(d / "27-fifo", 0o755)
    (d / "40-link").symlink_to(d / "10-a")
    listing = list_scripts(d)
    assert [(s.name, s.path, s.problem) for s in listing.scripts] == [
        ("10-a", str(d / "10-a"), ""),
        ("20-b", str(d / "20-b"), ""),
        ("40-link", str(d / "40-link"), ""),
    ]
    # Dot-files are left out silently; the rest is left out with a reason to log.
    assert listing.skipped == (
        Skipped(str(d / "25-dir"), "it is a directory"),
        Skipped(str(d / "27-fifo"), "it is not a regular file"),
        Skipped(str(d / "30-off"), "it is not executable (chmod +x to enable it)"),
    )


def test_an_entry_that_cannot_be_looked_at_is_listed_with_its_problem(tmp_path: Path) -> None:
    d = tmp_path / "d"
    d.mkdir()
    (d / "10-gone").symlink_to(tmp_path / "nowhere")
    [entry] = list_scripts(d).scripts
    assert entry.name == "10-gone"
    assert entry.problem.startswith("could not stat: ")


def test_missing_directory_is_empty_and_an_unlistable_one_raises(tmp_path: Path) -> None:
    assert list_scripts(tmp_path / "absent") == Listing()
    (tmp_path / "file").write_text("")
    with pytest.raises(NotADirectoryError):
        list_scripts(tmp_path / "file")


def test_skips_are_logged_loudly_once_with_a_memory(caplog: pytest.LogCaptureFixture) -> None:
    skipped = [Skipped("/d/README", "it is not executable (chmod +x to enable it)")]
    reported: set[str] = set()
    with caplog.at_level(logging.DEBUG, logger="rc_worker.scripts"):
        log_skipped(skipped, reported)
        log_skipped(skipped, reported)
        log_skipped(skipped)
    levels = [r.levelno for r in caplog.records if "/d/README" in r.getMessage()]
    assert levels == [logging.WARNING, logging.DEBUG, logging.WARNING]
    assert "skipping /d/README: it is not executable" in caplog.text


# -- the limit ------------------------------------------------------------------------


async def test_budget_gives_each_run_its_timeout_or_what_is_left(
    autojump_clock: trio.testing.MockClock,
) -> None:
    budget = Budget(timeout=10, budget=25)
    assert budget.next() == Limit(10, 10, 25)
    await trio.sleep(20)
    limit = budget.next()
    assert limit == Limit(5, 10, 25)
    assert limit.from_budget
    await trio.sleep(5)
    assert budget.next() is None
    # Without a budget of its own (a hook) it is never spent.
    alone = Budget(timeout=3)
    await trio.sleep(100)
    assert alone.next() == Limit(3, 3)
    assert not Limit(3, 3).from_budget
    assert not Limit(1, 3).from_budget  # shorter, but no pass budget set it


async def test_a_script_past_its_timeout_is_killed_with_its_group(tmp_path: Path) -> None:
    pids = tmp_path / "pids"
    run = await sh(f"sleep 30 & echo $$ $! > {pids}; echo waiting >&2; wait", tmp_path, seconds=0.5)
    assert run.result.killed
    assert not run.ok
    assert describe(run, "10-slow") == "10-slow timed out after 0.5s: waiting"
    leader, child = (int(p) for p in pids.read_text().split())
    alive = {p.pid for p in LinuxHost().processes() if p.alive}
    assert leader not in alive
    assert child not in alive


async def test_a_run_cut_off_by_its_pass_budget_says_so(tmp_path: Path) -> None:
    path = script(tmp_path / "s", "exec sleep 30")
    with trio.fail_after(30):
        run = await run_script([str(path)], env=ENV, limit=Limit(0.3, 5, 0.3), grace=1)
    assert describe(run, "10-slow") == "10-slow: stopped when the pass budget of 0.3s ran out"
    assert describe(run) == "stopped when the pass budget of 0.3s ran out"


async def test_the_grace_is_never_longer_than_the_limit(tmp_path: Path) -> None:
    # It ignores SIGTERM: only SIGKILL ends it, after the grace. A grace of
    # 60 s taken as given would run past the guard.
    path = script(tmp_path / "s", "trap '' TERM; sleep 60 & wait; sleep 60")
    with trio.fail_after(20):
        run = await run_script([str(path)], env=ENV, limit=Limit(0.3, 0.3), grace=60)
    assert run.result.killed
    assert describe(run).startswith("timed out after 0.3s")


# -- capture ------------------------------------------------------------------------


async def test_stderr_and_uncapped_stdout_keep_a_bounded_tail(tmp_path: Path) -> None:
    run = await sh(
        "head -c 200000 /dev/zero | tr '\\0' x; echo; echo last out;"
        "head -c 200000 /dev/zero | tr '\\0' y >&2; echo >&2; echo last words >&2; exit 1",
        tmp_path,
    )
    assert len(run.output) == TAIL_KEEP
    assert run.output.endswith(b"x\nlast out\n")
    assert len(run.stderr) == TAIL_KEEP
    assert run.stderr.endswith(b"y\nlast words\n")
    assert run.tail.endswith("y | last words")
    assert len(run.tail) == 200
    assert describe(run, "s").startswith("s exited 1: …yyy")


async def test_capped_output_is_kept_whole_and_a_script_past_it_is_stopped(
    tmp_path: Path,
) -> None:
    run = await sh("printf '{\"a\": 1}'", tmp_path, output_cap=64)
    assert run.ok
    assert run.output == b'{"a": 1}'
    flood = await sh("echo complaint >&2; exec yes", tmp_path, output_cap=1000)
    assert flood.overflowed
    assert len(flood.output) <= 1000
    assert flood.result.killed
    assert flood.result.reason == REASON_OUTPUT_CAP
    # What it said is left out: past the cap the output is not to be trusted.
    assert describe(flood) == "output over the 1000-byte cap"


async def test_merged_streams_arrive_in_order_and_are_the_tail(tmp_path: Path) -> None:
    run = await sh("echo one; echo two >&2; echo three; exit 4", tmp_path, merge_stderr=True)
    assert run.output == b"one\ntwo\nthree\n"
    assert run.stderr == b""
    assert describe(run, "nvidia-smi", exit_label="exit status") == (
        "nvidia-smi exit status 4: one | two | three"
    )
    # Where a non-zero exit is an answer, only the caller can judge it.
    assert describe(run, "nvidia-smi", exit_ok=True) == ""


# -- the failure description -----------------------------------------------------------


@pytest.mark.parametrize(
    ("body", "what", "says"),
    [
        ("exit 0", "20-ok", ""),
        (
            "echo 'xid 79: gpu fell off' >&2; exit 2",
            "20-bad",
            "20-bad exited 2: xid 79: gpu fell off",
        ),
        ("exit 5", "on_release hook /x", "on_release hook /x exited 5"),
        ("echo dying >&2; kill -9 $$", "20-sig", "20-sig killed by signal 9: dying"),
        ("echo multi >&2; echo line >&2; exit 1", "", "exited 1: multi | line"),
    ],
)
async def test_failure_text(tmp_path: Path, body: str, what: str, says: str) -> None:
    run = await sh(body, tmp_path)
    assert describe(run, what) == says
    assert run.ok is (says == "")


async def test_a_script_that_cannot_run(tmp_path: Path) -> None:
    path = tmp_path / "garbage"
    path.write_bytes(b"\x00\x01\x02 not a program")
    path.chmod(0o755)
    with trio.fail_after(30):
        run = await run_script([str(path)], env=ENV, limit=Limit(5, 5), grace=1)
    assert run.result.exit_code is None
    why = describe(run, "10-garbage")
    assert why == f"10-garbage could not run: cannot start {str(path)!r}: Exec format error"
    # Even where a non-zero exit is an answer, not running is a failure.
    assert describe(run, exit_ok=True).startswith("could not run: ")
