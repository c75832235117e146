"""``rc-worker check-config``: a bad config is exit 2 and a message, never a traceback."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from rc_worker.cli import main
from rc_worker.core.config import WORKER_ENV_VARS
from rc_worker.host import LinuxHost

GOOD = """\
devices:
  - gpu0
  - name: gpu1
    max_runtime: 2h
    timeout: 90s
    labels:
      gpu1.rack: r7
      slots: 4
hooks:
  release_linger: 1m30s
controller_url: http://rc.example:8080
token: do-not-print-me
host: box1
poll_wait: 500ms
spool_max_bytes: 50Gi
"""

BAD = "devices: [gpu0]\npoll_wait: soon\n"


@pytest.fixture(autouse=True)
def _no_worker_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in WORKER_ENV_VARS:
        monkeypatch.delenv(name, raising=False)


def _write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "worker.yaml"
    path.write_text(text, encoding="utf-8")
    return path


def test_good_config_is_ok(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["check-config", str(_write(tmp_path, GOOD))]) == 0
    out, err = capsys.readouterr()
    assert "gpu0" in out
    assert "gpu1" in out
    assert "do-not-print-me" not in out + err


def test_json_is_the_fully_resolved_config(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["check-config", str(_write(tmp_path, GOOD)), "--json"]) == 0
    out, err = capsys.readouterr()
    data = json.loads(out)  # one JSON object, nothing else on stdout
    assert isinstance(data, dict)
    assert "do-not-print-me" not in out + err
    assert data["token"] == "***"
    assert data["host"] == "box1"
    assert data["controller_url"] == "http://rc.example:8080"
    # Durations are numbers of seconds; sizes are bytes.
    assert data["poll_wait"] == 0.5
    assert data["hooks"] == {"timeout": 60.0, "release_linger": 90.0}
    assert data["spool_max_bytes"] == 50 * 2**30
    gpu0, gpu1 = data["devices"]
    assert gpu0 == {
        "name": "gpu0",
        "max_runtime": None,
        "on_acquire": None,
        "on_release": None,
        "timeout": 60.0,
        "release_linger": 90.0,
        "labels": {},
        "job_user": None,
        "mig_of": None,
        "mig_uuid": None,
        "mig_index": None,
        "memory_max": None,
        "cpu_max": None,
    }
    assert (gpu1["max_runtime"], gpu1["timeout"], gpu1["release_linger"]) == (7200.0, 90.0, 90.0)
    assert gpu1["labels"] == {"rack": "r7", "slots": "4"}
    # Every default is resolved: nothing is left out.
    for key in ("probe_dir", "verify_dir", "sheet_dir", "state_dir", "shutdown_grace"):
        assert data[key] is not None
    for key, value in data.items():
        if key.endswith(("_interval", "_timeout", "_budget", "_wait", "_grace")):
            assert isinstance(value, int | float), key
            assert not isinstance(value, bool), key


def test_json_without_a_token_shows_null(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["check-config", str(_write(tmp_path, "devices: [gpu0]\n")), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["token"] is None


def test_bad_config_is_exit_2_with_the_message_on_stderr(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = _write(tmp_path, BAD)
    assert main(["check-config", str(path), "--json"]) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert f"{path}:2:12: poll_wait: 'soon' is not a duration; expected" in err
    assert "Traceback" not in err


@pytest.mark.parametrize(
    ("line", "fragment"),
    [
        ("status_token: tökén", "2:15: status_token: the status token has character 'ö'"),
        ('token: "a\\tb"', "2:8: token: the worker token has '\\t'"),
    ],
)
def test_a_token_no_header_can_carry_is_exit_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], line: str, fragment: str
) -> None:
    """Was "OK": the worker then failed at every request that sent it."""
    path = _write(tmp_path, f"devices: [gpu0]\n{line}\n")
    assert main(["check-config", str(path)]) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert f"{path}:{fragment} in it, which cannot be sent in an HTTP header; expected" in err
    assert "Traceback" not in err


@pytest.mark.parametrize(
    ("url", "fragment"),
    [
        ("http://ftp://x", "has no port number after 'ftp:'"),
        ("'http://h:/'", "has no port number after 'h:'"),
    ],
)
def test_a_controller_url_with_no_port_after_its_colon_is_exit_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], url: str, fragment: str
) -> None:
    """Was "OK": the worker then asked host "ftp" (or "h") on port 80, as rc would not."""
    path = _write(tmp_path, f"devices: [gpu0]\ncontroller_url: {url}\ntoken: t\n")
    assert main(["check-config", str(path)]) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert f"{path}:2:17: controller_url: {url.strip(chr(39))!r} {fragment}; expected" in err
    assert "Traceback" not in err


def test_a_controller_url_from_the_environment_with_no_port_is_exit_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("RC_CONTROLLER_URL", "http://ftp://x")
    assert main(["check-config", str(_write(tmp_path, GOOD))]) == 2
    err = capsys.readouterr().err
    assert "RC_CONTROLLER_URL: 'http://ftp://x' has no port number after 'ftp:'; expected" in err
    assert "Traceback" not in err


@pytest.mark.parametrize(
    ("setup", "fragment"),
    [
        ("missing", ":1:1: (file): no such file"),
        ("directory", ":1:1: (file): the config is not a regular file"),
        ("syntax", ":1:10: (yaml):"),
        ("unknown-key", ":2:1: colour: unknown key 'colour'"),
    ],
)
def test_every_kind_of_bad_file_is_exit_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], setup: str, fragment: str
) -> None:
    path = tmp_path / "worker.yaml"
    if setup == "directory":
        path.mkdir()
    elif setup == "syntax":
        path.write_text("devices: ]\n", encoding="utf-8")
    elif setup == "unknown-key":
        path.write_text("devices: [gpu0]\ncolour: blue\n", encoding="utf-8")
    assert main(["check-config", str(path)]) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert f"{path}{fragment}" in err
    assert "Traceback" not in err


def test_path_comes_from_rc_worker_config(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("RC_WORKER_CONFIG", str(_write(tmp_path, "devices: [from-env]\n")))
    assert main(["check-config", "--json"]) == 0
    assert [d["name"] for d in json.loads(capsys.readouterr().out)["devices"]] == ["from-env"]


def test_environment_overrides_show_in_the_json(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("RC_HOST", "env-host")
    monkeypatch.setenv("RC_TOKEN", "env-secret")
    monkeypatch.setenv("RC_REQUIRE_MANUAL_CLEAR", "yes")
    assert main(["check-config", str(_write(tmp_path, GOOD)), "--json"]) == 0
    out = capsys.readouterr().out
    data = json.loads(out)
    assert (data["host"], data["token"], data["require_manual_clear"]) == ("env-host", "***", True)
    assert "env-secret" not in out


def test_bad_environment_is_exit_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("RC_REQUIRE_MANUAL_CLEAR", "maybe")
    assert main(["check-config", str(_write(tmp_path, GOOD))]) == 2
    err = capsys.readouterr().err
    assert "RC_REQUIRE_MANUAL_CLEAR: 'maybe' is not a boolean" in err
    assert "Traceback" not in err


# --- the real console script, in a real process ----------------------------------


def _script_environ() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k not in WORKER_ENV_VARS}


def _rc_worker() -> str:
    script = Path(sys.executable).parent / "rc-worker"
    if not script.exists():
        pytest.fail(f"{script} is missing; install the package (pip install -e .)")
    return str(script)


def test_console_script_bad_config_exit_2_no_traceback(tmp_path: Path) -> None:
    path = _write(tmp_path, BAD)
    result = subprocess.run(
        [_rc_worker(), "check-config", str(path)],
        capture_output=True,
        text=True,
        env=_script_environ(),
        check=False,
        timeout=60,
    )
    assert result.returncode == 2, result
    assert result.stdout == ""
    assert f"{path}:2:12: poll_wait: 'soon' is not a duration" in result.stderr
    assert "Traceback" not in result.stderr


def test_console_script_json(tmp_path: Path) -> None:
    result = subprocess.run(
        [_rc_worker(), "check-config", str(_write(tmp_path, GOOD)), "--json"],
        capture_output=True,
        text=True,
        env=_script_environ(),
        check=False,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    data = json.loads(result.stdout)
    assert data["token"] == "***"
    assert data["poll_wait"] == 0.5
    assert "do-not-print-me" not in result.stdout + result.stderr


def test_check_config_refuses_a_limit_this_host_does_not_delegate(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # What the real host offers decides; either way check-config says what start would.
    host = LinuxHost()
    try:
        available = host.cgroup_read(host.own_cgroup(), "cgroup.controllers").split()
    except OSError:
        available = []
    path = tmp_path / "worker.yaml"
    path.write_text("devices:\n  - name: gpu0\n    memory_max: 1Gi\n")
    code = main(["check-config", str(path)])
    _, err = capsys.readouterr()
    if "memory" in available:
        assert code == 0
    else:
        assert code == 2
        assert err.startswith("rc-worker: devices[0].memory_max: ")
        assert err.count("\n") == 1  # one line, no traceback
