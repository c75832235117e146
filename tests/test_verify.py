"""run_verify on its own: order, skips, failure reasons, the pass budget."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import trio

from rc_worker.core.model import VERIFY_REASON_PREFIX
from rc_worker.verify import run_verify


def script(path: Path, body: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("#!/bin/sh\n" + body + "\n")
    path.chmod(0o755)


ENV = {"PATH": os.environ.get("PATH", "/usr/bin:/bin")}


async def test_first_failure_ends_the_pass_with_its_stderr_tail(tmp_path: Path) -> None:
    log = tmp_path / "ran"
    script(tmp_path / "d" / "10-ok", f"echo 10 >> {log}")
    script(tmp_path / "d" / "20-bad", f"echo 20 >> {log}; echo 'xid 79: gpu fell off' >&2; exit 2")
    script(tmp_path / "d" / "30-never", f"echo 30 >> {log}")
    with trio.fail_after(30):
        result = await run_verify(str(tmp_path / "d"), script_timeout=5, pass_budget=10, env=ENV)
    assert not result.ok
    assert result.reason == VERIFY_REASON_PREFIX + "20-bad exited 2: xid 79: gpu fell off"
    assert log.read_text().split() == ["10", "20"]


async def test_a_script_not_started_for_lack_of_budget_is_a_failure(tmp_path: Path) -> None:
    script(tmp_path / "d" / "10-ok", "exit 0")
    with trio.fail_after(30):
        result = await run_verify(str(tmp_path / "d"), script_timeout=5, pass_budget=0, env=ENV)
    assert not result.ok
    assert "10-ok: not started, the pass budget of 0s is spent" in result.reason


async def test_missing_directory_and_skipped_entries_pass(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with trio.fail_after(30):
        assert (
            await run_verify(str(tmp_path / "absent"), script_timeout=1, pass_budget=1, env=ENV)
        ).ok
        d = tmp_path / "d"
        d.mkdir()
        (d / "10-not-executable").write_text("#!/bin/sh\nexit 1\n")
        (d / ".20-hidden").write_text("#!/bin/sh\nexit 1\n")
        (d / "30-dir").mkdir()
        assert (await run_verify(str(d), script_timeout=1, pass_budget=1, env=ENV)).ok
    assert "10-not-executable: it is not executable" in caplog.text.replace(str(d) + "/", "")


async def test_verify_fails_closed_on_what_it_cannot_look_at(tmp_path: Path) -> None:
    d = tmp_path / "d"
    script(d / "10-ok", "exit 0")
    (d / "20-gone").symlink_to(tmp_path / "nowhere")
    with trio.fail_after(30):
        dangling = await run_verify(str(d), script_timeout=5, pass_budget=10, env=ENV)
        (tmp_path / "file").write_text("")
        unlistable = await run_verify(
            str(tmp_path / "file"), script_timeout=5, pass_budget=10, env=ENV
        )
    assert dangling.reason.startswith(VERIFY_REASON_PREFIX + "20-gone: could not stat: ")
    assert unlistable.reason == (
        VERIFY_REASON_PREFIX + f"could not list {tmp_path / 'file'}: Not a directory"
    )


async def test_a_fifo_in_the_verify_dir_is_skipped_not_run(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    d = tmp_path / "d"
    d.mkdir()
    os.mkfifo(d / "10-fifo", 0o755)
    with trio.fail_after(30):
        assert (await run_verify(str(d), script_timeout=1, pass_budget=1, env=ENV)).ok
    assert f"skipping {d / '10-fifo'}: it is not a regular file" in caplog.text
