"""From YAML text to a resolved ``Config``: the converter, its hooks, and error locations.

Sans-IO: what a check needs of the machine (a token file's bytes, whether a
``job_user`` exists, the HTTP client's opinion of a URL) is asked of a
``ConfigMachine`` that the shell (``rc_worker.config_load``) supplies, and
the file itself is read there. The converter's hooks carry the user-facing
validation; a failure anywhere is walked back to its key path and looked up
in the round-trip YAML tree for its line and column.
"""

from __future__ import annotations

import errno
import math
import re
import typing
import warnings
from collections.abc import Callable, Iterator, Mapping
from pathlib import PurePath, PurePosixPath
from typing import Any, NoReturn

import attrs
import cattrs
from cattrs.errors import (
    AttributeValidationNote,
    ForbiddenExtraKeysError,
    IterableValidationNote,
)
from cattrs.gen import make_dict_structure_fn
from ruamel.yaml import YAML
from ruamel.yaml.comments import CommentedMap
from ruamel.yaml.error import MarkedYAMLError, ReusedAnchorWarning

from rc_worker.core.cgroup_parse import CGROUP_MODES
from rc_worker.core.config import LOG_FORMATS, LOG_LEVELS, Config, DeviceConfig, HooksConfig
from rc_worker.core.config_yaml import (
    Locator,
    PathKey,
    flow_depth,
    plain,
    refuse_tags,
)
from rc_worker.core.durations import DURATION_HELP, SIZE_HELP, parse_duration, parse_size
from rc_worker.core.errors import ConfigError
from rc_worker.core.gpu_query import gpu_index, mig_parent_name
from rc_worker.core.names import (
    DEVICE_NAME_HELP,
    is_device_name,
    label_value_problem,
    split_label_key,
)
from rc_worker.core.tokens import token_problem
from rc_worker.core.urls import port_problem

_DURATION_FIELDS = {
    "heartbeat_interval": True,  # True: must be positive
    "poll_wait": True,
    "probe_interval": True,
    "probe_timeout": True,
    "probe_pass_budget": True,
    "verify_timeout": True,
    "verify_pass_budget": True,
    "shutdown_grace": False,
    "max_grace": False,
    "timeout": True,
    "release_linger": False,
    "max_runtime": True,
}
_GPU_HEALTH_DURATIONS = ("interval", "check_timeout")
_PATH_FIELDS = ("probe_dir", "verify_dir", "sheet_dir", "state_dir", "on_acquire", "on_release")
_HOST_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")
_POSITIVE = "a duration above zero, such as 30s or 5m"
_REQUIRED = {
    "devices": "'devices:' with a list of this host's devices, such as [gpu0, gpu1]",
    "name": "'name:' with the device's name",
}


class _Problem(ValueError):
    """A validation failure at a known key path (relative to where it was raised)."""

    def __init__(self, message: str, path: PathKey = (), *, at_key: bool = False) -> None:
        super().__init__(message)
        self.path = path
        self.at_key = at_key


def _expect_str(value: Any, _: type) -> str:
    if not isinstance(value, str):
        raise _Problem(f"{_describe(value)} is not a string; expected a string")
    return value


def _expect_bool(value: Any, _: type) -> bool:
    if not isinstance(value, bool):
        raise _Problem(f"{_describe(value)} is not a boolean; expected true or false")
    return value


def _expect_int(value: Any, _: type) -> int:
    if value is None:
        raise _Problem(f"an empty value is not a size; expected {SIZE_HELP}")
    try:
        return parse_size(value)
    except ValueError as e:
        raise _Problem(str(e)) from None


def _expect_float(value: Any, _: type) -> float:
    # Every float field of the config is a duration.
    if value is None:
        raise _Problem(f"an empty value is not a duration; expected {DURATION_HELP}")
    try:
        return parse_duration(value)
    except ValueError as e:
        raise _Problem(f"{e}") from None


def _describe(value: Any) -> str:
    if isinstance(value, Mapping):
        return "a mapping"
    if isinstance(value, list):
        return "a list"
    if value is None:
        return "an empty value"
    return repr(value)


def _make_converter() -> cattrs.Converter:
    conv = cattrs.Converter(forbid_extra_keys=True)
    conv.register_structure_hook(str, _expect_str)
    conv.register_structure_hook(bool, _expect_bool)
    conv.register_structure_hook(int, _expect_int)
    conv.register_structure_hook(float, _expect_float)
    device_from_mapping = make_dict_structure_fn(DeviceConfig, conv, _cattrs_forbid_extra_keys=True)

    def structure_device(value: Any, _: type) -> DeviceConfig:
        # The bare-name-or-mapping union of the seed's DeviceConfig.
        if isinstance(value, str):
            return DeviceConfig(name=value)
        if isinstance(value, Mapping):
            return device_from_mapping(value, DeviceConfig)
        raise _Problem(
            f"{_describe(value)} is not a device; expected a bare name or a mapping with 'name'"
        )

    conv.register_structure_hook(DeviceConfig, structure_device)
    devices_type = tuple[DeviceConfig, ...]
    devices_from_list = conv.get_structure_hook(devices_type)

    def structure_devices(value: Any, _: type) -> tuple[DeviceConfig, ...]:
        # cattrs would happily iterate a mapping's keys into a tuple.
        if not isinstance(value, list):
            raise _Problem(f"{_describe(value)} is not a list; expected a list of devices")
        result: tuple[DeviceConfig, ...] = devices_from_list(value, devices_type)
        return result

    conv.register_structure_hook_func(lambda t: t == devices_type, structure_devices)
    urls_type = str | tuple[str, ...] | None

    def structure_urls(value: Any, _: type) -> str | tuple[str, ...] | None:
        # Checked, a list made a tuple, by _prepare_controller_urls.
        if value is None or isinstance(value, str | tuple):
            return value
        return _expect_str(value, str)

    conv.register_structure_hook_func(lambda t: t == urls_type, structure_urls)
    conv.register_unstructure_hook(tuple, lambda t: [conv.unstructure(x) for x in t])
    return conv


_converter: cattrs.Converter | None = None


def _conv() -> cattrs.Converter:
    global _converter
    if _converter is None:
        _converter = _make_converter()
    return _converter


def unstructure(config: Config) -> dict[str, Any]:
    data: dict[str, Any] = _conv().unstructure(config)
    return data


MAX_TOKEN_FILE_BYTES = 64 * 1024
MAX_YAML_DEPTH = 50
"""A worker config nests five levels deep; ruamel recurses per level, so bound it."""


def resolved_json(config: Config) -> dict[str, Any]:
    """The config as JSON-ready data, durations in seconds, the token masked."""
    data = unstructure(config)
    for secret in ("token", "status_token"):
        if data.get(secret) is not None:
            data[secret] = "***"
    return data


_STATUS_TOKEN_FIX = (
    "expected visible ASCII (letters, digits, punctuation), such as from openssl rand -hex 32"
)


def worker_token_problem(token: str) -> str | None:
    """Why ``token`` (stripped) cannot be the worker token the worker sends the controller
    as a bearer token, or None: the file's ``token`` and ``RC_TOKEN`` share the words."""
    return token_problem(
        token,
        "worker token",
        "expected the token the controller was given (rc serve --worker-token), in visible ASCII",
    )


def url_shape_problem(url: str) -> str | None:
    """Why ``url`` is not even shaped like the controller's URL, or None (see
    ``config_load.controller_url_problem`` for the whole check)."""
    if not re.fullmatch(r"https?://[^\s/]+(/\S*)?", url):
        return f"{url!r} is not a URL; expected http://HOST:PORT or https://HOST"
    # http://ftp://x and http://h:/ pass the pattern, and the HTTP client would ask host
    # "ftp" (or "h") on port 80: the rule rc and rc-worker status apply to a URL's port.
    problem = port_problem(url)
    if problem:
        return f"{problem}; expected http://HOST:PORT or https://HOST"
    return None


def _no_file(path: str, limit: int) -> bytes:
    raise OSError(errno.ENOENT, "no machine to read it from", path)


@attrs.frozen
class ConfigMachine:
    """What checking a config asks of the machine it is for.

    ``rc_worker.config_load.THIS_MACHINE`` answers for real; ``NO_MACHINE``
    (the default) reads no file, knows every user and checks only a URL's
    shape, for pure callers and tests.
    """

    read_file: Callable[[str, int], bytes] = _no_file
    """The bytes of a regular file of at most the given size; ``ValueError``
    names the problem, ``OSError`` as from ``open``."""
    user_problem: Callable[[str], str | None] = lambda _name: None
    """Why a name cannot be a ``job_user`` here, or None."""
    url_problem: Callable[[str], str | None] = url_shape_problem
    """Why a URL cannot be the controller's, or None."""


NO_MACHINE = ConfigMachine()


def parse_text(
    text: str,
    *,
    name: str,
    base_dir: str | PurePath,
    read_token: bool = True,
    machine: ConfigMachine = NO_MACHINE,
) -> Config:
    """Validate and resolve config ``text``; relative paths are taken from ``base_dir``,
    which should be absolute (the shell makes it so)."""
    loc = Locator(name)
    try:
        with warnings.catch_warnings():
            # Redefining an anchor is legal YAML (the later one wins).
            warnings.simplefilter("ignore", ReusedAnchorWarning)
            yaml = YAML(typ="rt")
            # The node tree keeps each scalar's source text (label values are
            # taken as written, as Go's yaml.v3 does); the data built from it
            # keeps each value's line and column.
            if flow_depth(text) > MAX_YAML_DEPTH:
                raise ConfigError(
                    f"{name}:1:1: (yaml): nested more than {MAX_YAML_DEPTH} levels deep; "
                    "a worker config needs about five"
                )
            loc.nodes = yaml.compose(text)
            refuse_tags(name, loc.nodes)
            tree = None if loc.nodes is None else yaml.constructor.construct_document(loc.nodes)
    except RecursionError:
        raise ConfigError(
            f"{name}:1:1: (yaml): nested too deep; a worker config needs about five levels"
        ) from None
    except MarkedYAMLError as e:
        mark = e.problem_mark or e.context_mark
        line, col = (mark.line + 1, mark.column + 1) if mark else (1, 1)
        problem = (e.problem or "invalid YAML").strip()
        raise ConfigError(f"{name}:{line}:{col}: (yaml): {problem}; fix the YAML syntax") from None
    if tree is None:
        raise ConfigError(
            f"{name}:1:1: (file): the file is empty; expected a mapping with 'devices'"
        )
    if not isinstance(tree, CommentedMap):
        loc.fail(tree, (), "the top level is not a mapping; expected keys such as 'devices'")
    loc.root = tree
    data = plain(tree)
    hooks = _structure_part(loc, data.get("hooks", {}), "hooks")
    # Before the devices inherit it, or a zero here would be reported there.
    if hooks.timeout <= 0:
        loc.fail_at(("hooks", "timeout"), f"timeout must be more than zero; expected {_POSITIVE}")
    _prepare_devices(loc, data, hooks)
    _prepare_gpu_health(loc, data)
    _prepare_controller_urls(loc, data, machine)
    try:
        config: Config = _conv().structure(data, Config)
    except Exception as e:
        _raise_located(loc, e)
    _check(loc, config, machine)
    return _resolve_paths(
        loc, config, PurePosixPath(base_dir), read_token=read_token, machine=machine
    )


def _structure_part(loc: Locator, value: Any, key: str) -> HooksConfig:
    try:
        result: HooksConfig = _conv().structure(value, HooksConfig)
    except Exception as e:
        _raise_located(loc, e, prefix=(key,))
    return result


def _prepare_devices(loc: Locator, data: dict[str, Any], hooks: HooksConfig) -> None:
    """Give each device the host's hook defaults, and stringify scalar label values.

    Done on the raw data, before structuring, so a device that sets its own
    value keeps it and one that does not inherits ``hooks:``. A label value
    that YAML reads as a number, boolean or date keeps its text as written
    (``cuda: 12.10`` is ``"12.10"``, not ``"12.1"``).
    """
    devices = data.get("devices")
    if not isinstance(devices, list):
        return
    for i, dev in enumerate(devices):
        if isinstance(dev, str):
            dev = devices[i] = {"name": dev}
        if not isinstance(dev, dict):
            continue
        dev.setdefault("timeout", hooks.timeout)
        if data.get("job_user") is not None:
            dev.setdefault("job_user", data["job_user"])
        dev.setdefault("release_linger", hooks.release_linger)
        cpus = dev.get("cpu_max")
        if isinstance(cpus, int | float) and not isinstance(cpus, bool):
            # A number of CPUs, kept as written and checked in _check.
            dev["cpu_max"] = loc.source_text(("devices", i, "cpu_max")) or str(cpus)
        labels = dev.get("labels")
        if isinstance(labels, dict):
            for key, value in labels.items():
                if value is None or isinstance(value, str | Mapping | list):
                    continue
                text = loc.source_text(("devices", i, "labels", key))
                if text is None:
                    text = ("true" if value else "false") if isinstance(value, bool) else str(value)
                labels[key] = text


def _prepare_gpu_health(loc: Locator, data: dict[str, Any]) -> None:
    """Check the ``gpu_health`` values cattrs' hooks would read too loosely.

    ``enabled`` takes a boolean or ``auto``; ``ignored_xids`` takes plain
    non-negative integers (the int hook reads sizes, so "1k" would pass); a
    missing ``check_timeout`` is the probe timeout.
    """
    section = data.get("gpu_health")
    if section is None:
        return
    if not isinstance(section, dict):
        loc.fail_at(
            ("gpu_health",),
            f"{_describe(section)} is not a mapping; expected keys "
            "such as enabled, interval, kernel_log, ignored_xids, check_timeout",
        )
    enabled = section.get("enabled", "auto")
    if isinstance(enabled, bool):
        section["enabled"] = "true" if enabled else "false"
    elif enabled not in ("auto", "true", "false"):
        loc.fail_at(
            ("gpu_health", "enabled"),
            f"{_describe(enabled)} is not valid; expected true, false or auto",
        )
    xids = section.get("ignored_xids")
    if xids is not None:
        if not isinstance(xids, list):
            loc.fail_at(
                ("gpu_health", "ignored_xids"),
                f"{_describe(xids)} is not a list; expected a list of Xid codes such as [13, 31]",
            )
        for i, code in enumerate(xids):
            if isinstance(code, bool) or not isinstance(code, int) or code < 0:
                loc.fail_at(
                    ("gpu_health", "ignored_xids", i),
                    f"{_describe(code)} is not an Xid code; expected a whole number such as 13",
                )
    if section.get("kernel_log") == "":
        loc.fail_at(
            ("gpu_health", "kernel_log"),
            "an empty path; expected a path such as /dev/kmsg, or leave it out",
        )


def _check(loc: Locator, config: Config, machine: ConfigMachine) -> None:
    if not config.devices:
        loc.fail_at(("devices",), "no devices; expected at least one device name")
    seen: set[str] = set()
    for i, dev in enumerate(config.devices):
        where: PathKey = ("devices", i) if loc.is_scalar(("devices", i)) else ("devices", i, "name")
        if not is_device_name(dev.name):
            loc.fail_at(
                where, f"device name {dev.name!r} is not valid; expected {DEVICE_NAME_HELP}"
            )
        if dev.name in seen:
            loc.fail_at(where, f"device {dev.name!r} is declared twice; expected unique names")
        seen.add(dev.name)
        labels: dict[str, str] = {}
        for key in dev.labels:
            label_at: PathKey = ("devices", i, "labels", key)
            label = _check_label(loc, label_at, dev.name, key)
            # The probes' rule too: a declared uuid overrides theirs and becomes a job's
            # CUDA_VISIBLE_DEVICES, which no environment can carry with a NUL in it.
            problem = label_value_problem(dev.labels[key])
            if problem is not None:
                loc.fail_at(label_at, f"label {key!r} {problem}")
            if label in labels:
                loc.fail_at(
                    label_at,
                    f"label {key!r} repeats label {labels[label]!r}; expected each label once",
                    at_key=True,
                )
            labels[label] = key
    for key, positive in _DURATION_FIELDS.items():
        seconds = getattr(config, key, None)
        if positive and isinstance(seconds, float) and seconds <= 0:
            loc.fail_at((key,), f"{key} must be more than zero; expected {_POSITIVE}")
    for key in _GPU_HEALTH_DURATIONS:
        seconds = getattr(config.gpu_health, key)
        if seconds is not None and seconds <= 0:
            loc.fail_at(("gpu_health", key), f"{key} must be more than zero; expected {_POSITIVE}")
    _check_mig(loc, config)
    for i, dev in enumerate(config.devices):
        if dev.timeout <= 0:
            loc.fail_at(
                ("devices", i, "timeout"), f"timeout must be more than zero; expected {_POSITIVE}"
            )
        if dev.max_runtime is not None and dev.max_runtime <= 0:
            loc.fail_at(
                ("devices", i, "max_runtime"),
                f"max_runtime must be more than zero; expected {_POSITIVE}, "
                "or leave it out for no limit",
            )
        if dev.memory_max is not None and dev.memory_max <= 0:
            loc.fail_at(
                ("devices", i, "memory_max"),
                "memory_max must be more than zero; expected a size such as 16Gi",
            )
        if dev.cpu_max is not None and cpu_count(dev.cpu_max) is None:
            loc.fail_at(
                ("devices", i, "cpu_max"),
                f"{dev.cpu_max!r} is not a number of CPUs; expected a number above zero "
                "such as 2 or 1.5",
            )
        for key in ("memory_max", "cpu_max"):
            if getattr(dev, key) is not None and config.cgroup == "off":
                loc.fail_at(
                    ("devices", i, key),
                    f"{key} is applied through the job's cgroup, and cgroup is off; "
                    "expected cgroup: auto or required, or leave it out",
                )
        for key in ("on_acquire", "on_release"):
            if getattr(dev, key) == "":
                loc.fail_at(
                    ("devices", i, key), "an empty path; expected a script's path, or leave it out"
                )
    for key in _PATH_FIELDS:
        if getattr(config, key, None) == "":
            loc.fail_at((key,), "an empty path; expected a path, or leave it out for the default")
    if config.token_file == "":
        loc.fail_at(("token_file",), "an empty path; expected the path of the token file")
    if config.token is not None and not config.token.strip():
        loc.fail_at(
            ("token",),
            "the token is empty; expected the worker token, or leave it out "
            "for an embedded controller",
        )
    if config.token is not None:
        problem = worker_token_problem(config.token.strip())
        if problem:
            loc.fail_at(("token",), problem)
    if config.token is not None and config.token_file is not None:
        loc.fail_at(("token_file",), "both token and token_file are set; expected only one")
    if isinstance(config.controller_url, str):  # a list's were checked one by one
        problem = machine.url_problem(config.controller_url)
        if problem:
            loc.fail_at(("controller_url",), problem)
    if config.host:
        problem = host_problem(config.host)
        if problem:
            loc.fail_at(("host",), problem)
    for key, choices in (("log_format", LOG_FORMATS), ("log_level", LOG_LEVELS)):
        if getattr(config, key) not in choices:
            loc.fail_at(
                (key,), f"{getattr(config, key)!r} is not one of {', '.join(choices)}; pick one"
            )
    if config.cgroup_io and config.cgroup == "off":
        loc.fail_at(
            ("cgroup_io",),
            "I/O is accounted through the job's cgroup, and cgroup is off; "
            "expected cgroup: auto or required, or cgroup_io: false",
        )
    if config.cgroup not in CGROUP_MODES:
        loc.fail_at(
            ("cgroup",),
            f"{config.cgroup!r} is not a cgroup mode; expected one of {', '.join(CGROUP_MODES)}",
        )
    if config.status_listen is not None:
        problem = listen_problem(config.status_listen)
        if problem:
            loc.fail_at(("status_listen",), problem)
    if config.status_token is not None and not config.status_token.strip():
        loc.fail_at(("status_token",), "the token is empty; expected a token, or leave it out")
    if config.status_token is not None:
        # Not stripped, unlike the worker token: the status endpoint compares it as
        # written, so surrounding white space is refused here rather than never matching.
        problem = token_problem(config.status_token, "status token", _STATUS_TOKEN_FIX)
        if problem:
            loc.fail_at(("status_token",), problem)
    if config.job_user is not None:
        problem = machine.user_problem(config.job_user)
        if problem:
            loc.fail_at(("job_user",), problem)
    for i, dev in enumerate(config.devices):
        if dev.job_user is not None and dev.job_user != config.job_user:
            problem = machine.user_problem(dev.job_user)
            if problem:
                loc.fail_at(("devices", i, "job_user"), problem)


def _check_mig(loc: Locator, config: Config) -> None:
    names = config.device_names
    for i, dev in enumerate(config.devices):
        if dev.mig_of is None:
            for key in ("mig_uuid", "mig_index"):
                if getattr(dev, key) is not None:
                    loc.fail_at(
                        ("devices", i, key),
                        f"{key} without mig_of; expected mig_of: the physical GPU's device",
                    )
            continue
        parent = mig_parent_name(dev.mig_of, names)
        if parent not in names or parent == dev.name:
            loc.fail_at(
                ("devices", i, "mig_of"),
                f"{dev.mig_of!r} is not another device of this host; expected the name "
                "(or NVML index) of the physical GPU's device, such as gpu0",
            )
        if config.device(parent).mig_of is not None:
            loc.fail_at(
                ("devices", i, "mig_of"),
                f"{parent!r} is itself a MIG slice; expected the physical GPU's device",
            )
        if gpu_index(parent) is None and config.gpu_health.enabled != "false":
            # The GPU checks find a GPU by its NVML index, read from the name: a
            # slice of any other device would be checked by nothing, nor would its GPU.
            loc.fail_at(
                ("devices", i, "mig_of"),
                f"{parent!r} is not a GPU device (gpu<N>), so the GPU health checks "
                "could check neither this slice nor its GPU; expected the physical GPU's "
                "device named gpu<N> with its NVML index N (mig_of: gpuN, or mig_of: N), "
                "or gpu_health.enabled: false",
            )
        if dev.mig_index is not None and config.gpu_health.enabled == "false":
            # The UUID is looked up by the GPU checks (nvidia-smi -L): with them off it
            # never would be, and every job on the slice would run with no GPU at all.
            loc.fail_at(
                ("devices", i, "mig_index"),
                "mig_index is resolved to the slice's MIG UUID by the GPU health checks, "
                "which gpu_health.enabled: false turns off; expected mig_uuid: MIG-... "
                "(from nvidia-smi -L), or the GPU health checks on",
            )
        if (dev.mig_uuid is None) == (dev.mig_index is None):
            loc.fail_at(
                ("devices", i, "mig_of"),
                "a MIG slice needs exactly one of mig_uuid or mig_index; "
                "expected mig_uuid: MIG-... or mig_index: N (from nvidia-smi -L)",
            )


def cpu_count(text: str) -> float | None:
    """A device's ``cpu_max`` as a number of CPUs, or ``None`` when it is not one."""
    try:
        cpus = float(text)
    except ValueError:
        return None
    return cpus if math.isfinite(cpus) and cpus >= 0.01 else None


def _check_label(loc: Locator, where: PathKey, device: str, key: str) -> str:
    """The label name of ``key``, once it is a valid key for ``device``."""
    try:
        owner, label = split_label_key(key)
    except ValueError as e:
        loc.fail_at(where, str(e), at_key=True)
    if owner is not None and owner != device:
        loc.fail_at(
            where,
            f"label {key!r} names device {owner!r}; expected a bare key or '{device}.<label>'",
            at_key=True,
        )
    return label


def _resolve_paths(
    loc: Locator,
    config: Config,
    base_dir: PurePosixPath,
    *,
    read_token: bool,
    machine: ConfigMachine,
) -> Config:
    def resolve(p: str | None) -> str | None:
        if p is None or p == "":
            return p
        return str(base_dir / p)

    changes: dict[str, Any] = {
        k: resolve(getattr(config, k)) for k in _PATH_FIELDS if hasattr(config, k)
    }
    token_file = resolve(config.token_file)
    if token_file is not None and not read_token:
        changes["token_file"] = token_file
    elif token_file is not None:
        try:
            token = machine.read_file(token_file, MAX_TOKEN_FILE_BYTES).decode("utf-8").strip()
        except ValueError as e:
            loc.fail_at(
                ("token_file",), f"the token file {e}; expected a small file holding the token"
            )
        except OSError as e:
            loc.fail_at(
                ("token_file",),
                f"cannot read the token file ({e.strerror}); "
                "expected a readable file holding the token",
            )
        if not token:
            loc.fail_at(("token_file",), "the token file is empty; expected the worker token in it")
        problem = token_problem(
            token,
            "worker token in the token file",
            "expected one line holding the worker token, in visible ASCII",
        )
        if problem:
            loc.fail_at(("token_file",), problem)
        changes.update(token_file=token_file, token=token)
    elif config.token is not None:
        changes["token"] = config.token.strip()
    devices = tuple(
        attrs.evolve(
            dev,
            on_acquire=resolve(dev.on_acquire),
            on_release=resolve(dev.on_release),
            labels={split_label_key(k)[1]: v for k, v in dev.labels.items()},
        )
        for dev in config.devices
    )
    health = config.gpu_health
    if health.check_timeout is None:
        health = attrs.evolve(health, check_timeout=config.probe_timeout)
    health = attrs.evolve(health, kernel_log=resolve(health.kernel_log) or health.kernel_log)
    return attrs.evolve(config, devices=devices, gpu_health=health, **changes)


def _prepare_controller_urls(loc: Locator, data: dict[str, Any], machine: ConfigMachine) -> None:
    """``controller_url`` may be a list (the active controller's, then standbys'):
    each is checked where it stands, and a list becomes a tuple."""
    urls = data.get("controller_url")
    if urls is None or isinstance(urls, str):
        return
    if not isinstance(urls, list) or not urls:
        loc.fail_at(
            ("controller_url",), "expected a URL (http://HOST:PORT) or a non-empty list of them"
        )
    for i, url in enumerate(urls):
        if not isinstance(url, str):
            loc.fail_at(("controller_url", i), f"{url!r} is not a URL; expected http://HOST:PORT")
        problem = machine.url_problem(url)
        if problem:
            loc.fail_at(("controller_url", i), problem)
    data["controller_url"] = tuple(urls)


def host_problem(host: str) -> str | None:
    if not _HOST_RE.fullmatch(host):
        return f"host {host!r} is not valid; expected letters, digits, '.', '_' and '-'"
    return None


def listen_problem(listen: str) -> str | None:
    if listen.startswith("unix:"):
        if not listen[len("unix:") :].startswith("/"):
            return f"{listen!r}: expected unix:/absolute/path for a Unix socket"
        return None
    host, sep, port = listen.rpartition(":")
    if not sep or not host or not port.isdigit() or int(port) > 65535:
        return f"{listen!r} is not a listen address; expected HOST:PORT such as 127.0.0.1:9100"
    return None


def _raise_located(loc: Locator, error: BaseException, prefix: PathKey = ()) -> NoReturn:
    for path, leaf in _leaves(error, prefix):
        if isinstance(leaf, ForbiddenExtraKeysError):
            # The first unknown key in the file, not in alphabetical order.
            key = min(
                sorted(leaf.extra_fields),
                key=lambda k: loc.position((*path, k), at_key=True),
            )
            loc.fail_at(
                (*path, key),
                f"unknown key {key!r}; expected one of: {_known_keys(leaf.cl)}",
                at_key=True,
            )
        if isinstance(leaf, KeyError):
            what = _REQUIRED.get(str(path[-1]) if path else "", "a value")
            loc.fail_at(path, f"the key is missing; expected {what}")
        if isinstance(leaf, _Problem):
            loc.fail_at((*path, *leaf.path), str(leaf), at_key=leaf.at_key)
        # Anything else is cattrs meeting a value of the wrong shape (a list
        # where a mapping belongs, say): describe it from the field's type.
        loc.fail_at(
            path, f"{_describe(loc.value(path))} has the wrong type; expected {_expected(path)}"
        )
    raise ConfigError(f"{loc.name}:1:1: (config): {error}") from None


def _expected(path: PathKey) -> str:
    hint: Any = Config
    for part in path:
        if attrs.has(hint) and isinstance(part, str):
            hint = typing.get_type_hints(hint)[part]
        else:
            args = [a for a in typing.get_args(hint) if a is not type(None) and a is not Ellipsis]
            hint = args[-1] if args else Any
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    origin = typing.get_origin(hint)
    if origin in (tuple, list):
        return "a list"
    if attrs.has(hint) or (origin is not None and issubclass(origin, Mapping)):
        return "a mapping"
    if hint is str or str in args:
        return "a string"
    return "a value of another type"


def _known_keys(cl: type) -> str:
    return ", ".join(f.name for f in attrs.fields(cl))


def _leaves(error: BaseException, path: PathKey) -> Iterator[tuple[PathKey, BaseException]]:
    here = path
    for note in getattr(error, "__notes__", ()):
        if isinstance(note, AttributeValidationNote):
            here = (*path, note.name)
        elif isinstance(note, IterableValidationNote):
            here = (*path, note.index)
    children = getattr(error, "exceptions", None)
    if children:
        for child in children:
            yield from _leaves(child, here)
    else:
        yield here, error
