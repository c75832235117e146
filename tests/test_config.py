"""The config loader's contract: what loads, what it resolves to, and the exact error for the rest.

Every error reads ``PATH:LINE:COLUMN: key.path: what is wrong; what is expected``;
the table below pins the prefix of each one exactly.
"""

from __future__ import annotations

import io
import json
import os
import re
import socket
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import attrs
import pytest
from hypothesis import example, given
from hypothesis import strategies as st
from ruamel.yaml import YAML

from rc_worker.config_load import config_path, load_config, load_config_text
from rc_worker.core import config_convert
from rc_worker.core.config import (
    DEFAULT_CONFIG_PATH,
    DEFAULT_HEARTBEAT_INTERVAL,
    DEFAULT_HOOK_TIMEOUT,
    DEFAULT_POLL_WAIT,
    DEFAULT_PROBE_DIR,
    DEFAULT_PROBE_INTERVAL,
    DEFAULT_PROBE_PASS_BUDGET,
    DEFAULT_PROBE_TIMEOUT,
    DEFAULT_RELEASE_LINGER,
    DEFAULT_SHEET_DIR,
    DEFAULT_SHUTDOWN_GRACE,
    DEFAULT_SPOOL_MAX_BYTES,
    DEFAULT_STATE_DIR,
    DEFAULT_VERIFY_DIR,
    DEFAULT_VERIFY_PASS_BUDGET,
    DEFAULT_VERIFY_TIMEOUT,
    WORKER_ENV_VARS,
    Config,
    DeviceConfig,
    GpuHealthConfig,
    HooksConfig,
    child_environ,
)
from rc_worker.core.config_convert import resolved_json
from rc_worker.core.errors import ConfigError
from rc_worker.core.tokens import token_problem


def _write(directory: Path, text: str, name: str = "worker.yaml") -> Path:
    path = directory / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")
    return path


def _load(directory: Path, text: str, environ: Mapping[str, str] | None = None) -> Config:
    return load_config(_write(directory, text), environ={} if environ is None else environ)


# --- the table of bad configs -------------------------------------------------

# (id, file text or None for no file, "LINE:COLUMN: key.path", a fragment of the
# message after it, extra files next to the config).
_BAD: list[tuple[str, str | None, str, str, dict[str, str]]] = [
    # The file itself.
    ("missing-file", None, "1:1: (file)", "no such file; create it", {}),
    ("empty-file", "", "1:1: (file)", "the file is empty; expected a mapping", {}),
    ("only-comments", "# nothing yet\n\n", "1:1: (file)", "the file is empty", {}),
    # YAML syntax.
    ("unclosed-flow", "devices: [gpu0\n", "2:1: (yaml)", "expected ',' or ']'", {}),
    (
        "bad-indent",
        "devices:\n  - gpu0\n bad: 1\n",
        "3:2: (yaml)",
        "expected <block end>",
        {},
    ),
    ("tab-indent", "devices:\n\t- gpu0\n", "2:1: (yaml)", "found character '\\t'", {}),
    (
        "duplicate-yaml-key",
        "devices: [gpu0]\ndevices: [gpu1]\n",
        "2:1: (yaml)",
        'found duplicate key "devices"',
        {},
    ),
    (
        "duplicate-yaml-key-in-device",
        "devices:\n  - name: gpu0\n    name: gpu1\n",
        "3:5: (yaml)",
        'found duplicate key "name"',
        {},
    ),
    # Shape of the top level.
    ("top-level-list", "- gpu0\n", "1:1: (top level)", "the top level is not a mapping", {}),
    ("top-level-scalar", "gpu0\n", "1:1: (top level)", "the top level is not a mapping", {}),
    # Unknown keys: reported at the key itself.
    (
        "unknown-top-level-key",
        "devices: [gpu0]\nbogus: 1\n",
        "2:1: bogus",
        "unknown key 'bogus'; expected one of: devices, controller_url,",
        {},
    ),
    (
        "first-unknown-key-in-file-order",
        "devices: [gpu0]\nzzz: 1\naaa: 2\n",
        "2:1: zzz",
        "unknown key 'zzz'",
        {},
    ),
    ("non-string-key", "devices: [gpu0]\n1: 2\n", "2:1: 1", "unknown key '1'", {}),
    (
        "unknown-device-key",
        "devices:\n  - name: gpu0\n    bogus: 1\n",
        "3:5: devices[0].bogus",
        "unknown key 'bogus'; expected one of: name, max_runtime, on_acquire",
        {},
    ),
    (
        "unknown-hooks-key",
        "devices: [gpu0]\nhooks:\n  bogus: 1\n",
        "3:3: hooks.bogus",
        "unknown key 'bogus'; expected one of: timeout, release_linger",
        {},
    ),
    # Wrong types.
    (
        "quoted-string-for-bool",
        "devices: [gpu0]\nrequire_manual_clear: 'true'\n",
        "2:23: require_manual_clear",
        "'true' is not a boolean; expected true or false",
        {},
    ),
    (
        "yes-is-not-a-bool",
        "devices: [gpu0]\nrequire_manual_clear: yes\n",
        "2:23: require_manual_clear",
        "'yes' is not a boolean",
        {},
    ),
    (
        "list-for-hooks-mapping",
        "devices: [gpu0]\nhooks: [1, 2]\n",
        "2:8: hooks",
        "a list has the wrong type; expected a mapping",
        {},
    ),
    (
        "list-for-labels-mapping",
        "devices:\n  - name: gpu0\n    labels: [rack]\n",
        "3:13: devices[0].labels",
        "a list has the wrong type; expected a mapping",
        {},
    ),
    (
        "empty-hooks",
        "devices: [gpu0]\nhooks:\n",
        "2:1: hooks",
        "an empty value has the wrong type; expected a mapping",
        {},
    ),
    ("number-for-host", "devices: [gpu0]\nhost: 42\n", "2:7: host", "42 is not a string", {}),
    (
        "number-for-path",
        "devices: [gpu0]\nprobe_dir: 5\n",
        "2:12: probe_dir",
        "5 is not a string; expected a string",
        {},
    ),
    (
        "empty-value-for-path",
        "devices: [gpu0]\nstate_dir:\n",
        "2:1: state_dir",
        "an empty value is not a string",
        {},
    ),
    (
        "mapping-for-devices",
        "devices:\n  gpu0: {}\n",
        "2:3: devices",
        "a mapping is not a list; expected a list of devices",
        {},
    ),
    ("scalar-for-devices", "devices: gpu0\n", "1:10: devices", "'gpu0' is not a list", {}),
    (
        "number-for-device",
        "devices:\n  - 5\n",
        "2:5: devices[0]",
        "5 is not a device; expected a bare name or a mapping",
        {},
    ),
    (
        "number-for-device-name",
        "devices:\n  - name: 5\n",
        "2:11: devices[0].name",
        "5 is not a string",
        {},
    ),
    (
        "list-for-label-value",
        "devices:\n  - name: gpu0\n    labels:\n      rack: [1]\n",
        "4:13: devices[0].labels.rack",
        "a list is not a string",
        {},
    ),
    # Durations.
    (
        "malformed-duration",
        "devices: [gpu0]\npoll_wait: 10x\n",
        "2:12: poll_wait",
        "'10x' is not a duration; expected a number of seconds or a Go-style duration",
        {},
    ),
    (
        "duration-with-space",
        "devices: [gpu0]\npoll_wait: 1m 30s\n",
        "2:12: poll_wait",
        "'1m 30s' is not a duration",
        {},
    ),
    (
        "duration-unknown-unit",
        "devices: [gpu0]\nprobe_interval: 1w\n",
        "2:17: probe_interval",
        "'1w' is not a duration",
        {},
    ),
    (
        "negative-number-duration",
        "devices: [gpu0]\npoll_wait: -5\n",
        "2:12: poll_wait",
        "-5 is negative",
        {},
    ),
    (
        "negative-string-duration",
        "devices: [gpu0]\nshutdown_grace: -5s\n",
        "2:17: shutdown_grace",
        "'-5s' is negative",
        {},
    ),
    (
        "infinite-duration",
        "devices: [gpu0]\npoll_wait: .inf\n",
        "2:12: poll_wait",
        "is not a finite duration",
        {},
    ),
    (
        "bool-for-duration",
        "devices: [gpu0]\nheartbeat_interval: true\n",
        "2:21: heartbeat_interval",
        "True is not a duration",
        {},
    ),
    (
        "empty-duration",
        "devices: [gpu0]\nheartbeat_interval:\n",
        "2:1: heartbeat_interval",
        "an empty value is not a duration",
        {},
    ),
    (
        "bad-hooks-duration",
        "devices: [gpu0]\nhooks:\n  release_linger: soon\n",
        "3:19: hooks.release_linger",
        "'soon' is not a duration",
        {},
    ),
    (
        "negative-device-duration",
        "devices:\n  - name: gpu0\n    release_linger: -1s\n",
        "3:21: devices[0].release_linger",
        "'-1s' is negative",
        {},
    ),
    (
        "zero-heartbeat",
        "devices: [gpu0]\nheartbeat_interval: 0\n",
        "2:21: heartbeat_interval",
        "must be more than zero; expected a duration above zero",
        {},
    ),
    (
        "zero-verify-pass-budget",
        "devices: [gpu0]\nverify_pass_budget: 0s\n",
        "2:21: verify_pass_budget",
        "must be more than zero",
        {},
    ),
    (
        "zero-device-timeout",
        "devices:\n  - name: gpu0\n    timeout: 0\n",
        "3:14: devices[0].timeout",
        "timeout must be more than zero",
        {},
    ),
    (
        # Reported where it is written, not on the device that inherits it.
        "zero-hooks-timeout",
        "devices: [gpu0]\nhooks:\n  timeout: 0\n",
        "3:12: hooks.timeout",
        "timeout must be more than zero",
        {},
    ),
    (
        "zero-max-runtime",
        "devices:\n  - name: gpu0\n    max_runtime: 0s\n",
        "3:18: devices[0].max_runtime",
        "or leave it out for no limit",
        {},
    ),
    # Device names.
    (
        "upper-case-bare-name",
        "devices: [GPU0]\n",
        "1:11: devices[0]",
        "device name 'GPU0' is not valid; expected lower-case letters",
        {},
    ),
    (
        "dot-in-mapping-name",
        "devices:\n  - name: gpu.0\n",
        "2:11: devices[0].name",
        "device name 'gpu.0' is not valid",
        {},
    ),
    (
        "leading-dash",
        "devices: ['-gpu']\n",
        "1:11: devices[0]",
        "device name '-gpu' is not valid",
        {},
    ),
    (
        "empty-name",
        "devices:\n  - name: ''\n",
        "2:11: devices[0].name",
        "device name '' is not valid",
        {},
    ),
    (
        "duplicate-bare-names",
        "devices: [gpu0, gpu0]\n",
        "1:17: devices[1]",
        "device 'gpu0' is declared twice; expected unique names",
        {},
    ),
    (
        "duplicate-bare-and-mapping",
        "devices:\n  - gpu0\n  - name: gpu0\n",
        "3:11: devices[1].name",
        "device 'gpu0' is declared twice",
        {},
    ),
    (
        "no-devices-key",
        "host: box1\n",
        "1:1: devices",
        "the key is missing; expected 'devices:'",
        {},
    ),
    (
        "empty-device-list",
        "devices: []\n",
        "1:10: devices",
        "no devices; expected at least one device",
        {},
    ),
    (
        "empty-devices-value",
        "devices:\n",
        "1:1: devices",
        "an empty value is not a list",
        {},
    ),
    (
        "device-without-name",
        "devices:\n  - timeout: 5s\n",
        "2:5: devices[0].name",
        "the key is missing; expected 'name:'",
        {},
    ),
    # Labels.
    (
        "label-names-another-device",
        "devices:\n  - gpu0\n  - name: gpu1\n    labels:\n      gpu0.rack: r1\n",
        "5:7: devices[1].labels.gpu0.rack",
        "label 'gpu0.rack' names device 'gpu0'; expected a bare key or 'gpu1.<label>'",
        {},
    ),
    (
        "invalid-label-key",
        "devices:\n  - name: gpu0\n    labels:\n      'bad key': x\n",
        "4:7: devices[0].labels.bad key",
        "label key 'bad key' is not valid",
        {},
    ),
    (
        "invalid-device-part-of-label-key",
        "devices:\n  - name: gpu0\n    labels:\n      GPU0.rack: x\n",
        "4:7: devices[0].labels.GPU0.rack",
        "label key 'GPU0.rack' is not valid",
        {},
    ),
    (
        "label-given-twice",
        "devices:\n  - name: gpu0\n    labels: {rack: a, gpu0.rack: b}\n",
        "3:23: devices[0].labels.gpu0.rack",
        "label 'gpu0.rack' repeats label 'rack'; expected each label once",
        {},
    ),
    # The token.
    (
        "token-and-token-file",
        "devices: [gpu0]\ntoken: abc\ntoken_file: worker.token\n",
        "3:13: token_file",
        "both token and token_file are set; expected only one",
        {"worker.token": "abc\n"},
    ),
    (
        "token-file-missing",
        "devices: [gpu0]\ntoken_file: nowhere.token\n",
        "2:13: token_file",
        "cannot read the token file (No such file or directory)",
        {},
    ),
    (
        "token-file-unreadable",
        "devices: [gpu0]\ntoken_file: .\n",
        "2:13: token_file",
        "the token file is not a regular file",
        {},
    ),
    (
        "token-file-empty",
        "devices: [gpu0]\ntoken_file: empty.token\n",
        "2:13: token_file",
        "the token file is empty",
        {"empty.token": "  \n\n"},
    ),
    (
        "token-file-empty-path",
        "devices: [gpu0]\ntoken_file: ''\n",
        "2:13: token_file",
        "an empty path",
        {},
    ),
    (
        "token-empty",
        "devices: [gpu0]\ntoken: ''\n",
        "2:8: token",
        "the token is empty; expected the worker token",
        {},
    ),
    # A token no HTTP client can send in a header (was taken, and failed at each request).
    (
        "token-not-visible-ascii",
        "devices: [gpu0]\ntoken: tökén\n",
        "2:8: token",
        "the worker token has character 'ö' in it, which cannot be sent in an HTTP header; "
        "expected the token the controller was given",
        {},
    ),
    (
        "token-file-two-lines",
        "devices: [gpu0]\ntoken_file: worker.token\n",
        "2:13: token_file",
        "the worker token in the token file has '\\r' in it, which cannot be sent in an "
        "HTTP header; expected one line holding the worker token",
        {"worker.token": "abc\r\ndef\r\n"},
    ),
    (
        "status-token-not-visible-ascii",
        "devices: [gpu0]\nstatus_token: tökén\n",
        "2:15: status_token",
        "the status token has character 'ö' in it, which cannot be sent in an HTTP header; "
        "expected visible ASCII",
        {},
    ),
    (
        "status-token-surrounding-space",
        "devices: [gpu0]\nstatus_token: ' st'\n",
        "2:15: status_token",
        "the status token has character ' ' in it",
        {},
    ),
    # Addresses and sizes.
    (
        "controller-url-scheme",
        "devices: [gpu0]\ncontroller_url: ftp://rc.example\n",
        "2:17: controller_url",
        "'ftp://rc.example' is not a URL; expected http://HOST:PORT",
        {},
    ),
    (
        "controller-url-no-scheme",
        "devices: [gpu0]\ncontroller_url: rc.example:8080\n",
        "2:17: controller_url",
        "is not a URL",
        {},
    ),
    # A colon with no port after it: the HTTP client would ask host "ftp" (or "h") on
    # port 80 (was taken; rc and rc-worker status already refused it).
    (
        "controller-url-scheme-twice",
        "devices: [gpu0]\ncontroller_url: http://ftp://x\n",
        "2:17: controller_url",
        "'http://ftp://x' has no port number after 'ftp:'; expected http://HOST:PORT",
        {},
    ),
    (
        "controller-url-empty-port",
        "devices: [gpu0]\ncontroller_url: 'http://h:/'\n",
        "2:17: controller_url",
        "'http://h:/' has no port number after 'h:'; expected http://HOST:PORT",
        {},
    ),
    (
        "controller-url-list-empty-port",
        "devices: [gpu0]\ncontroller_url: [http://a:1, 'http://b:']\n",
        "2:30: controller_url[1]",
        "'http://b:' has no port number after 'b:'",
        {},
    ),
    (
        "controller-url-port-zero",
        "devices: [gpu0]\ncontroller_url: http://h:0\n",
        "2:17: controller_url",
        "'http://h:0' names port 0; expected http://HOST:PORT",
        {},
    ),
    (
        "status-listen-no-port",
        "devices: [gpu0]\nstatus_listen: localhost\n",
        "2:16: status_listen",
        "'localhost' is not a listen address; expected HOST:PORT",
        {},
    ),
    (
        "status-listen-port-range",
        "devices: [gpu0]\nstatus_listen: 127.0.0.1:70000\n",
        "2:16: status_listen",
        "is not a listen address",
        {},
    ),
    (
        "status-listen-number",
        "devices: [gpu0]\nstatus_listen: 9100\n",
        "2:16: status_listen",
        "9100 is not a string",
        {},
    ),
    (
        "spool-size-suffix",
        "devices: [gpu0]\nspool_max_bytes: 50X\n",
        "2:18: spool_max_bytes",
        "'50X' is not a size; expected a number of bytes",
        {},
    ),
    (
        "spool-size-negative",
        "devices: [gpu0]\nspool_max_bytes: -1\n",
        "2:18: spool_max_bytes",
        "-1 is negative",
        {},
    ),
    (
        "spool-size-fraction",
        "devices: [gpu0]\nspool_max_bytes: '1.5'\n",
        "2:18: spool_max_bytes",
        "not a whole number of bytes",
        {},
    ),
    ("host-with-space", "devices: [gpu0]\nhost: my box\n", "2:7: host", "is not valid", {}),
    # A slice of a device the GPU checks cannot find (not gpu<N>): nothing would check it.
    (
        "mig-of-a-plain-device",
        "devices:\n  - a100\n  - name: a100-mig0\n    mig_of: a100\n    mig_index: 0\n",
        "4:13: devices[1].mig_of",
        "'a100' is not a GPU device (gpu<N>), so the GPU health checks could check neither",
        {},
    ),
    (
        "mig-of-a-zero-padded-gpu",
        "devices:\n  - gpu01\n  - name: gpu01-mig0\n    mig_of: gpu01\n    mig_uuid: MIG-x\n",
        "4:13: devices[1].mig_of",
        "expected the physical GPU's device named gpu<N> with its NVML index N",
        {},
    ),
    # With the GPU checks off nothing resolves mig_index: jobs would run with no GPU.
    (
        "mig-index-with-gpu-health-off",
        "devices:\n  - gpu0\n  - name: gpu0-mig0\n    mig_of: gpu0\n    mig_index: 0\n"
        "gpu_health:\n  enabled: false\n",
        "5:16: devices[1].mig_index",
        "mig_index is resolved to the slice's MIG UUID by the GPU health checks",
        {},
    ),
    (
        "empty-dir-path",
        "devices: [gpu0]\nprobe_dir: ''\n",
        "2:12: probe_dir",
        "an empty path; expected a path, or leave it out",
        {},
    ),
    (
        "empty-hook-path",
        "devices:\n  - name: gpu0\n    on_acquire: ''\n",
        "3:17: devices[0].on_acquire",
        "an empty path",
        {},
    ),
]


@pytest.mark.parametrize(
    ("text", "where", "fragment", "files"),
    [pytest.param(*case[1:], id=case[0]) for case in _BAD],
)
def test_bad_config_is_located(
    tmp_path: Path, text: str | None, where: str, fragment: str, files: dict[str, str]
) -> None:
    path = tmp_path / "worker.yaml"
    if text is not None:
        path.write_text(text, encoding="utf-8")
    for name, content in files.items():
        _write(tmp_path, content, name)
    with pytest.raises(ConfigError) as info:
        load_config(path, environ={})
    message = str(info.value)
    assert message.startswith(f"{path}:{where}: "), message
    assert fragment in message
    # Every message says what is wrong, then what is expected.
    assert "; " in message.removeprefix(f"{path}:{where}: ")


def test_the_table_is_big_enough() -> None:
    assert len(_BAD) >= 25
    assert len({case[0] for case in _BAD}) == len(_BAD)


def test_the_public_names() -> None:
    import rc_worker

    assert rc_worker.load_config is load_config
    assert rc_worker.Config is Config
    assert rc_worker.DeviceConfig is DeviceConfig
    assert rc_worker.HooksConfig is HooksConfig
    assert rc_worker.ConfigError is ConfigError
    for cls in (Config, DeviceConfig, HooksConfig):
        assert attrs.has(cls)
        assert cls.__setattr__ is not object.__setattr__  # frozen


def test_config_error_is_an_rc_worker_error() -> None:
    from rc_worker.core.errors import RcWorkerError

    assert issubclass(ConfigError, RcWorkerError)


# --- what a good file resolves to ----------------------------------------------


def test_minimal_config_resolves_every_default(tmp_path: Path) -> None:
    config = _load(tmp_path, "devices: [gpu0]\n")
    assert config == Config(
        devices=(DeviceConfig(name="gpu0"),),
        host=socket.gethostname(),
        # check_timeout's default is the probe timeout, resolved at load.
        gpu_health=GpuHealthConfig(check_timeout=DEFAULT_PROBE_TIMEOUT),
    )
    assert config.controller_url is None
    assert config.token is None
    assert config.token_file is None
    assert config.heartbeat_interval == DEFAULT_HEARTBEAT_INTERVAL
    assert config.poll_wait == DEFAULT_POLL_WAIT
    assert config.hooks == HooksConfig(DEFAULT_HOOK_TIMEOUT, DEFAULT_RELEASE_LINGER)
    assert config.probe_dir == DEFAULT_PROBE_DIR
    assert config.probe_interval == DEFAULT_PROBE_INTERVAL
    assert config.probe_timeout == DEFAULT_PROBE_TIMEOUT
    assert config.probe_pass_budget == DEFAULT_PROBE_PASS_BUDGET
    assert config.verify_dir == DEFAULT_VERIFY_DIR
    assert config.verify_timeout == DEFAULT_VERIFY_TIMEOUT
    assert config.verify_pass_budget == DEFAULT_VERIFY_PASS_BUDGET
    assert config.sheet_dir == DEFAULT_SHEET_DIR
    assert config.state_dir == DEFAULT_STATE_DIR == "/var/lib/rc-worker"
    assert config.status_listen is None
    assert config.shutdown_grace == DEFAULT_SHUTDOWN_GRACE
    assert config.spool_max_bytes == DEFAULT_SPOOL_MAX_BYTES
    assert config.require_manual_clear is False
    (device,) = config.devices
    assert device.timeout == DEFAULT_HOOK_TIMEOUT
    assert device.release_linger == DEFAULT_RELEASE_LINGER
    assert device.max_runtime is None
    assert device.on_acquire is None
    assert device.on_release is None
    assert device.labels == {}


def test_empty_host_means_the_hostname(tmp_path: Path) -> None:
    assert _load(tmp_path, "devices: [gpu0]\nhost: ''\n").host == socket.gethostname()


def test_durations_in_every_form(tmp_path: Path) -> None:
    config = _load(
        tmp_path,
        "devices:\n"
        "  - name: gpu0\n"
        "    max_runtime: 2h\n"
        "    timeout: 1m30s\n"
        "    release_linger: 500ms\n"
        "heartbeat_interval: 5\n"
        "poll_wait: '45'\n"
        "probe_interval: 0.5\n"
        "shutdown_grace: 0\n"
        "spool_max_bytes: 50Gi\n",
    )
    device = config.device("gpu0")
    assert (device.max_runtime, device.timeout, device.release_linger) == (7200.0, 90.0, 0.5)
    assert (config.heartbeat_interval, config.poll_wait, config.probe_interval) == (5.0, 45.0, 0.5)
    assert config.shutdown_grace == 0.0
    assert config.spool_max_bytes == 50 * 2**30
    assert all(
        type(getattr(config, f)) is float
        for f in ("heartbeat_interval", "poll_wait", "shutdown_grace")
    )


def test_device_forms_bare_and_mapping_mix(tmp_path: Path) -> None:
    config = _load(tmp_path, "devices:\n  - gpu0\n  - name: gpu1\n    max_runtime: 1h\n  - a_b-9\n")
    assert config.device_names == ("gpu0", "gpu1", "a_b-9")
    assert config.device("gpu1").max_runtime == 3600.0
    with pytest.raises(KeyError):
        config.device("gpu9")


def test_hook_settings_inherit_device_then_hooks_then_builtin(tmp_path: Path) -> None:
    text = (
        "devices:\n"
        "  - name: own\n"
        "    timeout: 5s\n"
        "    release_linger: 1s\n"
        "  - name: inherits\n"
        "  - bare\n"
        "hooks:\n"
        "  timeout: 2m\n"
    )
    config = _load(tmp_path, text)
    assert (config.device("own").timeout, config.device("own").release_linger) == (5.0, 1.0)
    # timeout from hooks:, release_linger from the built-in default.
    for name in ("inherits", "bare"):
        device = config.device(name)
        assert (device.timeout, device.release_linger) == (120.0, DEFAULT_RELEASE_LINGER)
    assert config.hooks == HooksConfig(timeout=120.0, release_linger=DEFAULT_RELEASE_LINGER)

    # Without hooks: everything that is unset is the built-in default.
    config = _load(tmp_path, "devices:\n  - name: gpu0\n    release_linger: 0\n")
    assert config.device("gpu0").timeout == DEFAULT_HOOK_TIMEOUT
    assert config.device("gpu0").release_linger == 0.0


def test_relative_paths_resolve_against_the_files_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    conf_dir = tmp_path.resolve() / "etc" / "rc"
    text = (
        "devices:\n"
        "  - name: gpu0\n"
        "    on_acquire: hooks/acquire.sh\n"
        "    on_release: /opt/rc/release.sh\n"
        "probe_dir: probe.d\n"
        "verify_dir: ./verify.d\n"
        "sheet_dir: ../sheets\n"
        "state_dir: /var/lib/elsewhere\n"
    )
    _write(conf_dir, text)
    # Loaded through a relative path from somewhere else entirely.
    elsewhere = tmp_path / "cwd"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    config = load_config(os.path.relpath(conf_dir / "worker.yaml"), environ={})
    assert config.probe_dir == str(conf_dir / "probe.d")
    assert config.verify_dir == str(conf_dir / "verify.d")
    assert config.sheet_dir == str(conf_dir / ".." / "sheets")
    assert config.state_dir == "/var/lib/elsewhere"
    assert config.device("gpu0").on_acquire == str(conf_dir / "hooks" / "acquire.sh")
    assert config.device("gpu0").on_release == "/opt/rc/release.sh"
    assert all(Path(p).is_absolute() for p in (config.probe_dir, config.verify_dir))


def test_token_file_is_read_stripped_and_resolved(tmp_path: Path) -> None:
    _write(tmp_path / "secrets", "  s3cret-token \n\n", "worker.token")
    config = _load(tmp_path, "devices: [gpu0]\ntoken_file: secrets/worker.token\n")
    assert config.token == "s3cret-token"
    assert config.token_file == str(tmp_path / "secrets" / "worker.token")


def test_inline_token_is_stripped(tmp_path: Path) -> None:
    config = _load(tmp_path, "devices: [gpu0]\ntoken: |\n  abc123\n")
    assert config.token == "abc123"


def test_no_token_is_fine_for_an_embedded_controller(tmp_path: Path) -> None:
    config = _load(tmp_path, "devices: [gpu0]\ntoken:\n")
    assert config.token is None
    assert config.controller_url is None


def test_labels_are_normalised_and_stringified_as_written(tmp_path: Path) -> None:
    text = (
        "devices:\n"
        "  - name: gpu0\n"
        "    labels:\n"
        "      gpu0.rack: r12\n"
        "      nvlink: true\n"
        "      slots: 4\n"
        "      cuda: 12.10\n"
        "      ratio: 1e3\n"
        "      mask: 0x10\n"
        "      since: 2024-01-01\n"
        "      _private-ok: 'quoted'\n"
        "  - gpu1\n"
    )
    config = _load(tmp_path, text)
    assert config.device("gpu0").labels == {
        "rack": "r12",
        "nvlink": "true",
        "slots": "4",
        "cuda": "12.10",  # not "12.1": a label is taken as written
        "ratio": "1e3",
        "mask": "0x10",
        "since": "2024-01-01",
        "_private-ok": "quoted",
    }
    assert config.device("gpu1").labels == {}
    assert all(type(v) is str for v in config.device("gpu0").labels.values())


def test_yaml_anchors_and_merge_keys_work(tmp_path: Path) -> None:
    text = (
        "devices:\n"
        "  - &base {name: gpu0, timeout: 5s, labels: {rack: r1}}\n"
        "  - <<: *base\n"
        "    name: gpu1\n"
        "require_manual_clear: &yes true\n"
    )
    config = _load(tmp_path, text)
    assert config.device("gpu1").timeout == 5.0
    assert config.device("gpu1").labels == {"rack": "r1"}
    # An anchored boolean is a ruamel ScalarBoolean (an int): still a bool here.
    assert config.require_manual_clear is True


def test_a_redefined_anchor_is_legal_yaml(tmp_path: Path) -> None:
    # ruamel warns (ReusedAnchorWarning); the loader neither warns nor fails.
    config = _load(tmp_path, "devices:\n  - &d gpu0\n  - &d gpu1\nhost: *d\n")
    assert config.device_names == ("gpu0", "gpu1")
    assert config.host == "gpu1"


def test_values_are_plain_python_types(tmp_path: Path) -> None:
    config = _load(tmp_path, "devices: [gpu0]\nspool_max_bytes: 0x100\nhost: 'box'\n")
    assert type(config.spool_max_bytes) is int
    assert config.spool_max_bytes == 256
    assert type(config.host) is str


def test_config_is_frozen_and_evolves(tmp_path: Path) -> None:
    config = _load(tmp_path, "devices: [gpu0]\n")
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        config.host = "other"  # type: ignore[misc]
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        config.devices[0].timeout = 1.0  # type: ignore[misc]
    assert attrs.evolve(config, host="other").host == "other"


def test_load_config_text_matches_load_config(tmp_path: Path) -> None:
    text = "devices: [gpu0]\nprobe_dir: probe.d\nhost: box\n"
    from_file = _load(tmp_path, text)
    from_text = load_config_text(text, base_dir=str(tmp_path))
    assert from_file == from_text


def test_text_errors_name_the_given_source() -> None:
    with pytest.raises(ConfigError, match=r"^inline\.yaml:1:10: devices: no devices"):
        load_config_text("devices: []\n", name="inline.yaml")


# --- the environment ------------------------------------------------------------


def test_default_path_and_rc_worker_config() -> None:
    assert config_path(None, {}) == Path(DEFAULT_CONFIG_PATH) == Path("/etc/rc/worker.yaml")
    assert config_path(None, {"RC_WORKER_CONFIG": ""}) == Path(DEFAULT_CONFIG_PATH)
    assert config_path(None, {"RC_WORKER_CONFIG": "/x/w.yaml"}) == Path("/x/w.yaml")
    # An explicit path wins over the environment.
    assert config_path("/y/w.yaml", {"RC_WORKER_CONFIG": "/x/w.yaml"}) == Path("/y/w.yaml")


def test_rc_worker_config_picks_the_file(tmp_path: Path) -> None:
    path = _write(tmp_path, "devices: [picked]\n", "elsewhere.yaml")
    config = load_config(environ={"RC_WORKER_CONFIG": str(path)})
    assert config.device_names == ("picked",)
    with pytest.raises(ConfigError, match=r"nope\.yaml:1:1: \(file\): no such file"):
        load_config(environ={"RC_WORKER_CONFIG": str(tmp_path / "nope.yaml")})


def test_environ_defaults_to_os_environ(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for name in WORKER_ENV_VARS:
        monkeypatch.delenv(name, raising=False)
    path = _write(tmp_path, "devices: [gpu0]\nhost: from-file\n")
    monkeypatch.setenv("RC_WORKER_CONFIG", str(path))
    monkeypatch.setenv("RC_HOST", "from-env")
    config = load_config()
    assert config.host == "from-env"


def test_environment_overrides_the_file(tmp_path: Path) -> None:
    text = (
        "devices: [gpu0]\n"
        "controller_url: http://file.example:8080\n"
        "token: file-token\n"
        "host: file-host\n"
    )
    path = _write(tmp_path, text)
    config = load_config(path, environ={})
    assert (config.controller_url, config.token, config.host) == (
        "http://file.example:8080",
        "file-token",
        "file-host",
    )
    env = {
        "RC_CONTROLLER_URL": "https://env.example/rc",
        "RC_TOKEN": " env-token\n",
        "RC_HOST": "env-host",
    }
    config = load_config(path, environ=env)
    assert (config.controller_url, config.token, config.host) == (
        "https://env.example/rc",
        "env-token",
        "env-host",
    )
    # Empty variables change nothing.
    empty = {"RC_CONTROLLER_URL": "", "RC_TOKEN": "", "RC_HOST": ""}
    assert load_config(path, environ=empty) == load_config(path, environ={})


def test_a_real_controller_needs_a_token_from_the_file_or_rc_token(tmp_path: Path) -> None:
    path = tmp_path / "w.yaml"
    path.write_text("devices: [gpu0]\ncontroller_url: http://ctl:8080\n")
    with pytest.raises(ConfigError, match=r"w\.yaml:1:1: token: controller_url is set but no"):
        load_config(path, environ={})
    assert load_config(path, environ={"RC_TOKEN": "t"}).token == "t"
    path.write_text("devices: [gpu0]\n")
    with pytest.raises(ConfigError, match="no worker token"):
        load_config(path, environ={"RC_CONTROLLER_URL": "http://ctl:8080"})


def test_tools_that_never_talk_to_the_controller_need_no_token(tmp_path: Path) -> None:
    path = tmp_path / "w.yaml"
    path.write_text("devices: [gpu0]\ncontroller_url: http://ctl:8080\ntoken_file: secret\n")
    config = load_config(path, environ={}, need_token=False)
    assert config.token is None
    assert config.token_file == str(tmp_path / "secret")
    with pytest.raises(ConfigError, match="cannot read the token file"):
        load_config(path, environ={})


@given(st.text(alphabet=st.characters(codec="utf-8", exclude_categories=["Cs"]), min_size=1))
@example(" tok\x7fen\t")
@example("é")
@example("abc-DEF_123.~+/=")
def test_a_token_loads_exactly_when_it_can_be_sent(token: str) -> None:
    """Whatever the token: it loads as written when a header can carry it, and is refused
    at its own line otherwise, with the rule rc-worker status applies to --token."""
    # A JSON string is a YAML double-quoted scalar (DEL spelt out: YAML wants it escaped).
    quoted = json.dumps(token).replace("\x7f", "\\u007f")
    if not token.strip():
        return  # empty, or white space only: its own error (the table above)
    for key, sent, rule in [
        ("status_token", token, token_problem(token, "status token", "fix")),
        ("token", token.strip(), token_problem(token.strip(), "worker token", "fix")),
    ]:
        text = f"devices: [gpu0]\n{key}: {quoted}\n"
        if rule is None:
            assert getattr(load_config_text(text), key) == sent
        else:
            with pytest.raises(ConfigError) as info:
                load_config_text(text)
            assert str(info.value).startswith(f"<string>:2:{len(key) + 3}: {key}: the "), info
            assert "cannot be sent in an HTTP header; expected" in str(info.value)
            assert "\n" not in str(info.value)


def test_rc_token_overrides_a_token_file(tmp_path: Path) -> None:
    _write(tmp_path, "file-token\n", "worker.token")
    path = _write(tmp_path, "devices: [gpu0]\ntoken_file: worker.token\n")
    assert load_config(path, environ={"RC_TOKEN": "env-token"}).token == "env-token"


def test_environment_supplies_what_the_file_lacks(tmp_path: Path) -> None:
    path = _write(tmp_path, "devices: [gpu0]\n")
    config = load_config(
        path, environ={"RC_CONTROLLER_URL": "http://10.0.0.1:7070", "RC_TOKEN": "t"}
    )
    assert (config.controller_url, config.token) == ("http://10.0.0.1:7070", "t")


@pytest.mark.parametrize(
    ("name", "value", "fragment"),
    [
        ("RC_CONTROLLER_URL", "not a url", "RC_CONTROLLER_URL: 'not a url' is not a URL"),
        ("RC_CONTROLLER_URL", "ftp://x", "RC_CONTROLLER_URL: 'ftp://x' is not a URL"),
        (
            "RC_CONTROLLER_URL",
            "http://ftp://x",
            "RC_CONTROLLER_URL: 'http://ftp://x' has no port number after 'ftp:'",
        ),
        (
            "RC_CONTROLLER_URL",
            "http://a:1,http://h:/",
            "RC_CONTROLLER_URL: 'http://h:/' has no port number after 'h:'",
        ),
        ("RC_HOST", "bad host", "RC_HOST: host 'bad host' is not valid"),
        ("RC_TOKEN", "tok\nen\n", "RC_TOKEN: the worker token has '\\n' in it"),
    ],
)
def test_bad_environment_values_are_errors(
    tmp_path: Path, name: str, value: str, fragment: str
) -> None:
    path = _write(tmp_path, "devices: [gpu0]\n")
    with pytest.raises(ConfigError) as info:
        load_config(path, environ={name: value})
    assert str(info.value).startswith(fragment)
    assert "; expected" in str(info.value)


@pytest.mark.parametrize(
    ("in_file", "value", "expected"),
    [
        # Truthy switches it on...
        (False, "1", True),
        (False, "true", True),
        (False, "TRUE", True),
        (False, "Yes", True),
        (False, "on", True),
        (False, " On ", True),
        (True, "1", True),
        # ...falsy changes nothing: it never switches the file's true off.
        (False, "0", False),
        (False, "false", False),
        (False, "no", False),
        (False, "OFF", False),
        (False, "", False),
        (True, "0", True),
        (True, "false", True),
        (True, "No", True),
        (True, "off", True),
        (True, "", True),
        # Unset: the file decides.
        (False, None, False),
        (True, None, True),
    ],
)
def test_require_manual_clear_is_ored_in(
    tmp_path: Path, in_file: bool, value: str | None, expected: bool
) -> None:
    path = _write(tmp_path, f"devices: [gpu0]\nrequire_manual_clear: {str(in_file).lower()}\n")
    env = {} if value is None else {"RC_REQUIRE_MANUAL_CLEAR": value}
    assert load_config(path, environ=env).require_manual_clear is expected


@pytest.mark.parametrize("value", ["2", "maybe", "y", "n", "truee", "enable", "-1"])
@pytest.mark.parametrize("in_file", [False, True])
def test_require_manual_clear_rejects_anything_else(
    tmp_path: Path, in_file: bool, value: str
) -> None:
    path = _write(tmp_path, f"devices: [gpu0]\nrequire_manual_clear: {str(in_file).lower()}\n")
    with pytest.raises(ConfigError) as info:
        load_config(path, environ={"RC_REQUIRE_MANUAL_CLEAR": value})
    message = str(info.value)
    assert message.startswith(f"RC_REQUIRE_MANUAL_CLEAR: {value!r} is not a boolean; expected")


def test_child_environ_drops_every_rc_variable() -> None:
    env = {name: "x" for name in WORKER_ENV_VARS} | {
        "PATH": "/bin",
        "RC_JOB_ID": "j1",
        "RC_USER_TOKEN": "u",
        "RC_URL": "http://c",
        "RCX": "kept",
    }
    assert child_environ(env) == {"PATH": "/bin", "RCX": "kept"}


# --- the resolved JSON form -------------------------------------------------------


def test_resolved_json_masks_the_token_and_uses_seconds(tmp_path: Path) -> None:
    config = _load(
        tmp_path,
        "devices:\n  - name: gpu0\n    max_runtime: 1h\n    labels: {gpu0.rack: r1}\n"
        "token: secret\npoll_wait: 1m\n",
    )
    data = resolved_json(config)
    assert json.loads(json.dumps(data)) == data
    assert data["token"] == "***"
    assert "secret" not in json.dumps(data)
    assert data["poll_wait"] == 60.0
    assert data["devices"] == [
        {
            "name": "gpu0",
            "max_runtime": 3600.0,
            "on_acquire": None,
            "on_release": None,
            "timeout": DEFAULT_HOOK_TIMEOUT,
            "release_linger": DEFAULT_RELEASE_LINGER,
            "labels": {"rack": "r1"},
            "job_user": None,
            "mig_of": None,
            "mig_uuid": None,
            "mig_index": None,
            "memory_max": None,
            "cpu_max": None,
        }
    ]
    assert data["gpu_health"]["check_timeout"] == DEFAULT_PROBE_TIMEOUT
    assert set(data) == {f.name for f in attrs.fields(Config)}
    # The config itself still holds the real token.
    assert config.token == "secret"


def test_resolved_json_without_a_token(tmp_path: Path) -> None:
    assert resolved_json(_load(tmp_path, "devices: [gpu0]\n"))["token"] is None


# --- the shipped example ---------------------------------------------------------

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def test_the_example_config_loads_and_uses_every_key() -> None:
    path = EXAMPLES / "worker.yaml"
    config = load_config(path, environ={})
    # Its relative directories and hooks are the ones shipped next to it.
    assert config.probe_dir == str(EXAMPLES / "probe.d")
    assert config.verify_dir == str(EXAMPLES / "verify.d")
    assert config.sheet_dir == str(EXAMPLES / "sheets")
    assert (EXAMPLES / "sheets" / "host.md").is_file()
    assert (EXAMPLES / "sheets" / "host.d" / "gpu0.md").is_file()
    assert "gpu0" in config.device_names
    for device in config.devices:
        for hook in (device.on_acquire, device.on_release):
            if hook is not None:
                assert Path(hook).parent == EXAMPLES / "hooks"
                assert os.access(hook, os.X_OK), hook
    verify_scripts = sorted((EXAMPLES / "verify.d").iterdir())
    assert len(verify_scripts) >= 2
    assert all(os.access(script, os.X_OK) for script in verify_scripts)
    # Every key appears, set or (token_file, host) commented out.
    text = path.read_text(encoding="utf-8")
    written = set(re.findall(r"^[ \t]*(?:#[ \t]*)?(?:- )?([a-z_]+):", text, re.MULTILINE))
    for cls in (Config, DeviceConfig, HooksConfig):
        missing = {f.name for f in attrs.fields(cls)} - written
        assert not missing, f"examples/worker.yaml does not show {sorted(missing)}"


# --- property: any valid Config survives YAML and the loader ----------------------

_positive = st.floats(min_value=1e-6, max_value=1e8, allow_nan=False, allow_infinity=False)
_non_negative = st.floats(min_value=0, max_value=1e8, allow_nan=False, allow_infinity=False)
_device_names = st.from_regex(r"[a-z0-9][a-z0-9_-]{0,11}", fullmatch=True)
_label_names = st.from_regex(r"[A-Za-z0-9_][A-Za-z0-9_-]{0,11}", fullmatch=True)
_hostnames = st.from_regex(r"[A-Za-z0-9][A-Za-z0-9._-]{0,15}", fullmatch=True)
_ports = st.integers(min_value=1, max_value=65535)
_path_parts = st.from_regex(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,7}", fullmatch=True)
_abs_paths = st.lists(_path_parts, min_size=1, max_size=4).map(lambda p: "/" + "/".join(p))
_tokens = st.text(st.characters(min_codepoint=33, max_codepoint=126), min_size=1, max_size=40)
# Label values are facts people and probes write: any printable text. (Control,
# format and line-separator characters are YAML's own business, and JSON is
# only YAML for printable text.)
_label_values = st.text(
    st.characters(exclude_categories=("Cs", "Cc", "Cf", "Co", "Cn", "Zl", "Zp")), max_size=20
)


@st.composite
def _devices(draw: st.DrawFn) -> tuple[DeviceConfig, ...]:
    names = draw(st.lists(_device_names, min_size=1, max_size=5, unique=True))
    return tuple(
        DeviceConfig(
            name=name,
            max_runtime=draw(st.none() | _positive),
            on_acquire=draw(st.none() | _abs_paths),
            on_release=draw(st.none() | _abs_paths),
            timeout=draw(_positive),
            release_linger=draw(_non_negative),
            labels=draw(st.dictionaries(_label_names, _label_values, max_size=4)),
        )
        for name in names
    )


_configs = st.builds(
    Config,
    devices=_devices(),
    controller_url=st.none()
    | st.builds(
        lambda scheme, host, port, path: f"{scheme}://{host}:{port}{path}",
        st.sampled_from(["http", "https"]),
        _hostnames,
        _ports,
        st.sampled_from(["", "/", "/rc/api"]),
    ),
    token=st.none() | _tokens,
    token_file=st.none(),
    host=_hostnames,
    heartbeat_interval=_positive,
    poll_wait=_positive,
    hooks=st.builds(HooksConfig, timeout=_positive, release_linger=_non_negative),
    probe_dir=_abs_paths,
    probe_interval=_positive,
    probe_timeout=_positive,
    probe_pass_budget=_positive,
    verify_dir=_abs_paths,
    verify_timeout=_positive,
    verify_pass_budget=_positive,
    sheet_dir=_abs_paths,
    require_manual_clear=st.booleans(),
    state_dir=_abs_paths,
    status_listen=st.none()
    | st.builds(
        lambda h, p: f"{h}:{p}", st.sampled_from(["127.0.0.1", "0.0.0.0", "[::1]"]), _ports
    ),
    shutdown_grace=_non_negative,
    spool_max_bytes=st.integers(min_value=0, max_value=2**62),
    gpu_health=st.builds(
        GpuHealthConfig,
        enabled=st.sampled_from(["auto", "true", "false"]),
        interval=_positive,
        kernel_log=_abs_paths,
        ignored_xids=st.lists(st.integers(0, 200), max_size=6).map(tuple),
        check_timeout=_positive,
    ),
)


def _to_yaml(data: Any, how: str) -> str:
    if how == "json":  # JSON is YAML 1.2 (written raw: YAML has no surrogate-pair escapes)
        return json.dumps(data, indent=2, ensure_ascii=False)
    out = io.StringIO()
    yaml = YAML(typ="safe", pure=True)
    yaml.default_flow_style = False
    yaml.dump(data, out)
    return out.getvalue()


# A worker that talks to a real controller needs a token (checked after the
# environment overrides); keep the generated configs valid.
_configs = _configs.map(
    lambda c: c if c.controller_url is None or c.token else attrs.evolve(c, token="t0k3n")
)


@given(config=_configs, how=st.sampled_from(["json", "yaml"]), via_token_file=st.booleans())
def test_any_valid_config_round_trips(config: Config, how: str, via_token_file: bool) -> None:
    data = config_convert.unstructure(config)
    assert data["token"] == config.token  # the real token, not resolved_json's mask
    with tempfile.TemporaryDirectory() as tmp:
        if via_token_file and config.token is not None:
            token_file = Path(tmp) / "worker.token"
            token_file.write_text(config.token + "\n", encoding="utf-8")
            data["token"] = None
            data["token_file"] = "worker.token"  # relative: resolved next to the config
            config = attrs.evolve(config, token_file=str(token_file))
        path = Path(tmp) / "worker.yaml"
        path.write_text(_to_yaml(data, how), encoding="utf-8")
        loaded = load_config(path, environ={})
    assert loaded == config


@given(
    names=st.lists(_device_names, min_size=1, max_size=4, unique=True),
    hooks_timeout=st.none() | _positive,
    hooks_linger=st.none() | _non_negative,
)
def test_bare_names_equal_mappings_with_inherited_values(
    names: list[str], hooks_timeout: float | None, hooks_linger: float | None
) -> None:
    hooks: dict[str, float] = {}
    if hooks_timeout is not None:
        hooks["timeout"] = hooks_timeout
    if hooks_linger is not None:
        hooks["release_linger"] = hooks_linger
    bare = load_config_text(json.dumps({"devices": names, "hooks": hooks, "host": "h"}))
    spelled = load_config_text(
        json.dumps(
            {
                "devices": [
                    {
                        "name": n,
                        "timeout": hooks.get("timeout", DEFAULT_HOOK_TIMEOUT),
                        "release_linger": hooks.get("release_linger", DEFAULT_RELEASE_LINGER),
                    }
                    for n in names
                ],
                "hooks": hooks,
                "host": "h",
            }
        )
    )
    assert bare == spelled


@given(
    name=_device_names,
    labels=st.dictionaries(_label_names, _label_values, max_size=5),
    prefixed=st.data(),
)
def test_device_prefixed_label_keys_normalise(
    name: str, labels: dict[str, str], prefixed: st.DataObject
) -> None:
    written = {
        (f"{name}.{key}" if prefixed.draw(st.booleans()) else key): value
        for key, value in labels.items()
    }
    text = json.dumps(
        {"devices": [{"name": name, "labels": written}], "host": "h"}, ensure_ascii=False
    )
    assert load_config_text(text).device(name).labels == labels


# --- cgroup -------------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["auto", "required", "off"])
def test_cgroup_modes(tmp_path: Path, mode: str) -> None:
    assert _load(tmp_path, f"devices: [gpu0]\ncgroup: {mode}\n").cgroup == mode


def test_cgroup_defaults_to_auto(tmp_path: Path) -> None:
    assert _load(tmp_path, "devices: [gpu0]\n").cgroup == "auto"


def test_an_unknown_cgroup_mode_is_refused(tmp_path: Path) -> None:
    path = _write(tmp_path, "devices: [gpu0]\ncgroup: yes-please\n")
    with pytest.raises(ConfigError, match=r":2:9: cgroup: 'yes-please' is not a cgroup mode"):
        load_config(path, environ={})


def test_device_limits(tmp_path: Path) -> None:
    config = _load(tmp_path, "devices:\n  - name: gpu0\n    memory_max: 2Gi\n    cpu_max: 1.50\n")
    assert config.devices[0].memory_max == 2 * 2**30
    assert config.devices[0].cpu_max == "1.50"


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("    cpu_max: lots\n", "'lots' is not a number of CPUs"),
        ("    cpu_max: 0\n", "'0' is not a number of CPUs"),
        ("    memory_max: 0\n", "memory_max must be more than zero"),
    ],
)
def test_bad_device_limits_are_refused(tmp_path: Path, text: str, message: str) -> None:
    path = _write(tmp_path, "devices:\n  - name: gpu0\n" + text)
    with pytest.raises(ConfigError, match=message):
        load_config(path, environ={})


def test_a_limit_with_cgroups_off_is_refused(tmp_path: Path) -> None:
    path = _write(tmp_path, "cgroup: off\ndevices:\n  - name: gpu0\n    memory_max: 1Gi\n")
    with pytest.raises(ConfigError, match="memory_max is applied through the job's cgroup"):
        load_config(path, environ={})


def test_io_accounting_with_cgroups_off_is_refused(tmp_path: Path) -> None:
    path = _write(tmp_path, "cgroup: off\ncgroup_io: true\ndevices: [gpu0]\n")
    with pytest.raises(ConfigError, match="cgroup_io: I/O is accounted through the job's cgroup"):
        load_config(path, environ={})


def test_a_slice_of_a_plain_device_loads_with_gpu_health_off(tmp_path: Path) -> None:
    """Nothing is checked with the GPU checks off, so nothing is left out by the name."""
    config = _load(
        tmp_path,
        "devices:\n  - a100\n  - name: a100-mig0\n    mig_of: a100\n    mig_uuid: MIG-x\n"
        "gpu_health:\n  enabled: false\n",
    )
    assert config.device("a100-mig0").mig_of == "a100"


def test_a_declared_label_value_with_a_nul_byte_is_refused_where_it_is_written(
    tmp_path: Path,
) -> None:
    # A declared uuid overrides the probes' and becomes the job's CUDA_VISIBLE_DEVICES:
    # accepted, it failed every job on the device at spawn and got it quarantined.
    path = _write(tmp_path, 'devices:\n  - name: gpu0\n    labels: {uuid: "GPU-\\0bad"}\n')
    with pytest.raises(
        ConfigError,
        match=r":3:20: devices\[0\]\.labels\.uuid: label 'uuid' holds a NUL byte; "
        r"a label value must be text without NUL bytes$",
    ):
        load_config(path, environ={})
