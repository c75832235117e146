"""``rc-worker probe``: one pass, printed as JSON or a table; exit 0 even when a probe failed."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from rc_worker.cli_probe import configure

# Device names that are not gpu<N>, so nvidia-smi is never run, whatever the
# machine running the tests has on its PATH.
CONFIG = """\
host: node-a
state_dir: {root}/state
probe_dir: {root}/probe.d
probe_timeout: 2s
devices:
  - name: dev0
    labels: {{rack: r12}}
  - dev1
"""


def run(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="rc-worker")
    sub = parser.add_subparsers(dest="command")
    configure(sub)
    args = parser.parse_args(argv)
    code: int = args.func(args)
    return code


@pytest.fixture
def config_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    for var in ("RC_WORKER_CONFIG", "RC_HOST", "RC_CONTROLLER_URL", "RC_TOKEN"):
        monkeypatch.delenv(var, raising=False)
    probe_dir = tmp_path / "probe.d"
    probe_dir.mkdir()
    good = probe_dir / "10-good"
    good.write_text("""#!/bin/sh\nprintf '{"dev0.x": 1, "zone": "z1"}'\n""")
    good.chmod(0o755)
    bad = probe_dir / "20-bad"
    bad.write_text("#!/bin/sh\necho 'no such sensor' >&2\nexit 4\n")
    bad.chmod(0o755)
    path = tmp_path / "worker.yaml"
    path.write_text(CONFIG.format(root=tmp_path))
    return path


def test_json_output(config_file: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert run(["probe", "--config", str(config_file), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert set(out) == {"host", "devices", "unconfirmed", "sources", "payload"}
    assert out["host"]["zone"] == "z1"
    assert out["devices"] == {"dev0": {"x": "1", "rack": "r12"}, "dev1": {}}
    assert out["unconfirmed"] == []
    sources = {s["name"]: s for s in out["sources"]}
    assert list(sources) == ["builtin", "probe.d/10-good", "probe.d/20-bad"]
    assert sources["probe.d/10-good"]["ok"] is True
    assert sources["probe.d/20-bad"] == {
        "name": "probe.d/20-bad",
        "ok": False,
        "why": "exit status 4: no such sensor",
        "seconds": sources["probe.d/20-bad"]["seconds"],
    }
    assert out["payload"]["devices"] == out["devices"]
    assert out["payload"]["host"] == out["host"]


def test_table_output_says_what_failed(
    config_file: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert run(["probe", "--config", str(config_file)]) == 0
    out = capsys.readouterr().out
    assert out.startswith("host node-a\n")
    assert "device dev0  (confirmed)" in out
    assert "device dev1  (confirmed, no labels" in out
    assert "FAIL  probe.d/20-bad" in out
    assert "exit status 4: no such sensor" in out
    assert "(nvidia-smi not run: " in out


def test_bad_config_exits_2_without_a_traceback(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "worker.yaml"
    path.write_text("devices: [gpu0]\nprobe_timeout: soon\n")
    assert run(["probe", "--config", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("rc-worker: ")
    assert "probe_timeout" in err
    assert "Traceback" not in err


def test_missing_config_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert run(["probe", "--config", str(tmp_path / "absent.yaml")]) == 2
    assert capsys.readouterr().err.startswith("rc-worker: ")
