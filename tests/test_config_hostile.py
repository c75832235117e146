"""Config for a hostile world: job_user, status_token, unix status sockets (issue 12)."""

from __future__ import annotations

from pathlib import Path

import pytest

from rc_worker.cli import main
from rc_worker.config_load import load_config
from rc_worker.core.config import config_warnings
from rc_worker.core.errors import ConfigError


def _write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "worker.yaml"
    path.write_text(text)
    return path


def test_job_user_is_per_host_and_overridable_per_device(tmp_path: Path) -> None:
    path = _write(
        tmp_path,
        "job_user: nobody\ndevices:\n  - gpu0\n  - name: gpu1\n    job_user: root\n",
    )
    config = load_config(path, environ={})
    assert config.job_user == "nobody"
    assert [d.job_user for d in config.devices] == ["nobody", "root"]


def test_an_unknown_job_user_is_a_located_error(tmp_path: Path) -> None:
    path = _write(tmp_path, "devices:\n  - name: gpu0\n    job_user: no-such-user-xyz\n")
    with pytest.raises(ConfigError) as info:
        load_config(path, environ={})
    message = str(info.value)
    assert message.startswith(f"{path}:3:")
    assert "no user 'no-such-user-xyz'" in message
    assert "\n" not in message


def test_check_config_warns_a_root_worker_without_job_user(tmp_path: Path) -> None:
    config = load_config(_write(tmp_path, "devices: [gpu0, gpu1]\n"), environ={})
    [warning] = config_warnings(config, euid=0)
    assert "gpu0, gpu1" in warning
    assert "job_user" in warning
    assert config_warnings(config, euid=1000) == []
    safe = load_config(_write(tmp_path, "job_user: nobody\ndevices: [gpu0]\n"), environ={})
    assert config_warnings(safe, euid=0) == []


@pytest.mark.skipif(not hasattr(__import__("os"), "geteuid"), reason="POSIX only")
def test_check_config_prints_the_warning(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("os.geteuid", lambda: 0)
    path = _write(tmp_path, "devices: [gpu0]\n")
    assert main(["check-config", str(path)]) == 0
    assert "warning: the worker runs as root" in capsys.readouterr().err


def test_status_listen_may_be_a_unix_socket(tmp_path: Path) -> None:
    ok = load_config(_write(tmp_path, "devices: [gpu0]\nstatus_listen: unix:/run/rc.sock\n"))
    assert ok.status_listen == "unix:/run/rc.sock"
    with pytest.raises(ConfigError, match="unix:/absolute/path"):
        load_config(_write(tmp_path, "devices: [gpu0]\nstatus_listen: unix:rc.sock\n"))


# --- hostile config files: one-line errors, never a hang or a traceback ---------------------


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        ('devices: !!python/object/apply:os.system ["echo pwned"]\n', "is not allowed"),
        ("devices: [gpu0]\nx: !!python/name:os.system ''\n", "is not allowed"),
        ("devices: " + "[" * 5000 + "]" * 5000 + "\n", "nested"),
        (
            "devices: [gpu0]\nhooks:\n"
            + "".join(" " * (i + 1) + f"a{i}:\n" for i in range(900))
            + " " * 902
            + "x\n",
            "nested too deep",
        ),
        ("devices: [gpu0]\ncontroller_url: 'http://[::1'\ntoken: t\n", "is not a URL"),
    ],
)
def test_hostile_yaml_is_a_one_line_error(tmp_path: Path, text: str, needle: str) -> None:
    path = _write(tmp_path, text)
    with pytest.raises(ConfigError) as info:
        load_config(path, environ={})
    message = str(info.value)
    assert needle in message
    assert "\n" not in message
    assert message.startswith(f"{path}:")


def test_check_config_refuses_what_run_would_refuse(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = _write(tmp_path, "devices: [gpu0]\ncontroller_url: 'http://[::1'\ntoken: t\n")
    assert main(["check-config", str(path)]) == 2
    err = capsys.readouterr().err
    assert "controller_url" in err
    assert "Traceback" not in err


def test_a_fifo_as_config_is_refused_at_once(tmp_path: Path) -> None:
    import os

    fifo = tmp_path / "worker.yaml"
    os.mkfifo(fifo)
    # Nobody writes to it: reading it would block for ever.
    with pytest.raises(ConfigError, match="not a regular file"):
        load_config(fifo, environ={})


def test_a_config_that_is_not_utf8_names_the_byte_and_the_fix(tmp_path: Path) -> None:
    path = tmp_path / "worker.yaml"
    path.write_bytes(b"devices: [gpu0]\nlabels: {room: caf\xe9}\n")  # Latin-1, not UTF-8
    with pytest.raises(ConfigError) as e:
        load_config(path, environ={})
    assert str(e.value) == (
        f"{path}:2:19: (file): byte 0xe9 is not UTF-8 text; save the config as UTF-8"
    )


@pytest.mark.parametrize("source", ["/dev/zero", "fifo", "big"])
def test_token_file_is_bounded(tmp_path: Path, source: str) -> None:
    import os

    if source == "fifo":
        token_path = tmp_path / "token"
        os.mkfifo(token_path)
    elif source == "big":
        token_path = tmp_path / "token"
        token_path.write_bytes(b"t" * 200_000)
    else:
        token_path = Path(source)
    path = _write(
        tmp_path, f"devices: [gpu0]\ncontroller_url: http://c:1\ntoken_file: {token_path}\n"
    )
    with pytest.raises(ConfigError, match="token_file: the token file is"):
        load_config(path, environ={})
