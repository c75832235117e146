"""Start-up failures of a real ``rc-worker run``: one line naming cause and fix, the right exit.

Exit 2 for what a restart cannot fix (config, 401/403 at register, an unusable
state directory, a status address in use); 1 for the rest; never a traceback
or an exception group unless ``--log-level debug``.
"""

from __future__ import annotations

import argparse
import json
import signal
import socket
from pathlib import Path

import pytest
import trio
from workerproc import (
    TOKEN,
    no_traceback,
    serve_controller,
    worker_process,
    write_config,
)

from rc_worker import worker_main
from rc_worker.controller.store import Store, StoreConfig


def _store() -> Store:
    return Store(StoreConfig(heartbeat_interval_s=0.5, poll_wait_s=2.0))


async def _exit_of(tmp_path: Path, tokens: dict[str, str], extra: str = "") -> tuple[int, str]:
    async with trio.open_nursery() as nursery:
        url = await serve_controller(nursery, _store(), tokens)
        config = write_config(tmp_path, url, extra=extra)
        async with worker_process(config) as w:
            code = await w.wait()
            text = w.stderr.decode()
        nursery.cancel_scope.cancel()
    return code, text


async def test_an_unknown_token_is_one_line_and_exit_2(tmp_path: Path) -> None:
    with trio.fail_after(60):
        code, text = await _exit_of(tmp_path, {"some-other-token": "op-host"})
    assert code == 2
    no_traceback(text)
    [line] = [ln for ln in text.splitlines() if ln.startswith("rc-worker:")]
    assert "401" in line
    assert "token" in line
    assert "RC_TOKEN" in line  # the fix
    assert TOKEN not in text


async def test_a_token_for_another_host_is_one_line_and_exit_2(tmp_path: Path) -> None:
    with trio.fail_after(60):
        code, text = await _exit_of(tmp_path, {TOKEN: "someone-else"})
    assert code == 2
    no_traceback(text)
    [line] = [ln for ln in text.splitlines() if ln.startswith("rc-worker:")]
    assert "403" in line
    assert "'op-host'" in line
    assert "set host" in line


async def test_a_status_address_in_use_is_one_line_and_exit_2(tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with trio.fail_after(60):
            code, text = await _exit_of(
                tmp_path, {TOKEN: "op-host"}, extra=f"status_listen: 127.0.0.1:{port}\n"
            )
    assert code == 2
    no_traceback(text)
    [line] = [ln for ln in text.splitlines() if ln.startswith("rc-worker:")]
    assert f"status_listen: cannot listen on 127.0.0.1:{port}" in line
    assert "choose a free address" in line


async def test_an_unusable_state_dir_is_one_line_and_exit_2(tmp_path: Path) -> None:
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("a file where the state directory's parent should be\n")
    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            url = await serve_controller(nursery, _store(), {TOKEN: "op-host"})
            config = write_config(tmp_path, url)
            config.write_text(
                config.read_text().replace(str(tmp_path / "state"), str(blocker / "state"))
            )
            async with worker_process(config) as w:
                code = await w.wait()
                text = w.stderr.decode()
            nursery.cancel_scope.cancel()
    assert code == 2
    no_traceback(text)
    [line] = [ln for ln in text.splitlines() if ln.startswith("rc-worker:")]
    assert "state_dir: cannot create or use" in line
    assert "writable" in line


async def test_a_config_error_is_one_line_and_exit_2(tmp_path: Path) -> None:
    config = write_config(tmp_path, "http://127.0.0.1:1", extra="log_format: xml\n")
    with trio.fail_after(60):
        async with worker_process(config) as w:
            code = await w.wait()
            text = w.stderr.decode()
    assert code == 2
    no_traceback(text)
    assert text.strip().count("\n") == 0
    assert "log_format: 'xml' is not one of text, json" in text


async def test_an_unreachable_controller_is_one_warning_and_sigterm_still_stops(
    tmp_path: Path,
) -> None:
    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        port = closed.getsockname()[1]
    # Nothing listens on that port now.
    config = write_config(tmp_path, f"http://127.0.0.1:{port}")
    with trio.fail_after(60):
        async with worker_process(config) as w:
            line = await w.wait_for_line(lambda ln: "controller unreachable" in ln)
            # Several tries fail meanwhile; the log says so once, not per try.
            await trio.sleep(2)
            w.proc.send_signal(signal.SIGTERM)
            code = await w.wait()
            lines = w.lines
    assert f"http://127.0.0.1:{port}" in line
    assert "check that it is running and that controller_url is right" in line
    assert " WARNING " in line
    assert sum("controller unreachable" in ln for ln in lines) == 1, lines
    assert code == 0
    no_traceback(w.stderr.decode())


def _args(tmp_path: Path, level: str | None) -> argparse.Namespace:
    config = write_config(tmp_path, "http://127.0.0.1:1", extra="token: t\n")
    return argparse.Namespace(path=str(config), log_level=level, log_format=None)


async def _crash(config: object, **_: object) -> None:
    raise RuntimeError("the disk caught fire")


@pytest.mark.parametrize("level", [None, "debug"])
def test_an_unexpected_failure_is_one_line_exit_1_and_a_traceback_only_in_debug(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    level: str | None,
    restore_logging: None,
) -> None:
    monkeypatch.setattr(worker_main, "serve", _crash)
    code = worker_main.run_from_cli(_args(tmp_path, level))
    err = capsys.readouterr().err
    assert code == 1
    assert "internal error: RuntimeError: the disk caught fire" in err
    assert "sub-exception" not in err
    if level == "debug":
        assert "Traceback" in err
    else:
        assert "Traceback" not in err
        assert err.count("\n") == 1
        assert "--log-level debug" in err


async def test_with_json_logs_the_failure_is_one_json_line(tmp_path: Path) -> None:
    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            url = await serve_controller(nursery, _store(), {"some-other-token": "op-host"})
            config = write_config(tmp_path, url)
            async with worker_process(config, args=("--log-format", "json")) as w:
                code = await w.wait()
                lines = w.lines
            nursery.cancel_scope.cancel()
    assert code == 2
    last = json.loads(lines[-1])
    assert last["level"] == "error"
    assert "401 unauthorized" in last["message"]
    assert "traceback" not in last
    for line in lines:
        json.loads(line)  # every line is JSON, the failure included
