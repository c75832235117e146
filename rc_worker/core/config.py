"""The worker's configuration: its attrs classes, defaults and environment names (pure).

The types live here, apart from the converter that builds them
(``config_convert``), which imports them: the types import nothing of the
converter; ``rc_worker.config_load`` (the shell) reads the file and the machine.
After loading, every default is resolved: nothing is unset.
"""

from __future__ import annotations

from collections.abc import Mapping

import attrs

DEFAULT_CONFIG_PATH = "/etc/rc/worker.yaml"

DEFAULT_HOOK_TIMEOUT = 60.0
DEFAULT_RELEASE_LINGER = 10.0
DEFAULT_HEARTBEAT_INTERVAL = 10.0
DEFAULT_POLL_WAIT = 30.0
DEFAULT_PROBE_DIR = "/etc/rc/probe.d"
DEFAULT_PROBE_INTERVAL = 300.0
DEFAULT_PROBE_TIMEOUT = 10.0
DEFAULT_PROBE_PASS_BUDGET = 60.0
DEFAULT_VERIFY_DIR = "/etc/rc/verify.d"
DEFAULT_VERIFY_TIMEOUT = 60.0
DEFAULT_VERIFY_PASS_BUDGET = 300.0
DEFAULT_SHEET_DIR = "/etc/rc/sheets"
DEFAULT_STATE_DIR = "/var/lib/rc-worker"
DEFAULT_SHUTDOWN_GRACE = 300.0
# The longest grace ceiling a job may ask for; longer is cut to it.
DEFAULT_MAX_GRACE = 300.0
DEFAULT_SPOOL_MAX_BYTES = 10 * 2**30
DEFAULT_GPU_HEALTH_INTERVAL = 60.0
DEFAULT_KERNEL_LOG = "/dev/kmsg"
DEFAULT_IGNORED_XIDS = (13, 31, 43, 45, 68, 109)

# Variables of the worker's own configuration. None of them ever reaches a
# job, hook, probe or verify script (see child_environ).
ENV_CONFIG = "RC_WORKER_CONFIG"
ENV_CONTROLLER_URL = "RC_CONTROLLER_URL"
ENV_TOKEN = "RC_TOKEN"
ENV_HOST = "RC_HOST"
ENV_REQUIRE_MANUAL_CLEAR = "RC_REQUIRE_MANUAL_CLEAR"
WORKER_ENV_VARS = frozenset(
    {ENV_CONFIG, ENV_CONTROLLER_URL, ENV_TOKEN, ENV_HOST, ENV_REQUIRE_MANUAL_CLEAR}
)

# Variables of the rc family that are someone's credentials or the rc client's settings: the
# worker drops them from its own environment at start (worker_main.exec_without_token) and
# no child of it ever sees them.
FOREIGN_ENV_VARS = frozenset({"RC_USER_TOKEN", "RC_USER_TOKENS", "RC_WORKER_TOKENS", "RC_URL"})

LOG_FORMATS = ("text", "json")
LOG_LEVELS = ("debug", "info", "warning", "error")


@attrs.frozen
class HooksConfig:
    """Host-level defaults for lease hooks; a device's own value overrides them."""

    timeout: float = DEFAULT_HOOK_TIMEOUT
    release_linger: float = DEFAULT_RELEASE_LINGER


@attrs.frozen
class GpuHealthConfig:
    """The built-in GPU health checks (docs/configuration.md, ``gpu_health``).

    ``enabled`` is ``auto`` (on once nvidia-smi has been seen on this host),
    ``true`` or ``false``. ``check_timeout`` None means the probe timeout; it
    is resolved at load, so after ``load_config`` it is always set.
    """

    enabled: str = "auto"
    interval: float = DEFAULT_GPU_HEALTH_INTERVAL
    kernel_log: str = DEFAULT_KERNEL_LOG
    ignored_xids: tuple[int, ...] = DEFAULT_IGNORED_XIDS
    check_timeout: float | None = None


@attrs.frozen
class DeviceConfig:
    """One device this host offers: a bare name, or a mapping with its lease settings.

    ``timeout`` and ``release_linger`` are resolved at load: the device's own
    value, else the ``hooks:`` default, else the built-in default.
    """

    name: str
    max_runtime: float | None = None
    on_acquire: str | None = None
    on_release: str | None = None
    timeout: float = DEFAULT_HOOK_TIMEOUT
    release_linger: float = DEFAULT_RELEASE_LINGER
    labels: Mapping[str, str] = attrs.field(factory=dict)
    job_user: str | None = None
    """Resolved at load: the device's own ``job_user``, else the host's."""
    # A MIG slice: ``mig_of`` names the physical GPU's device (name or NVML
    # index); ``mig_uuid``, or ``mig_index`` resolved through nvidia-smi -L.
    mig_of: str | None = None
    mig_uuid: str | None = None
    mig_index: int | None = None
    memory_max: int | None = None
    """Bytes: the ``memory.max`` of each job's cgroup on this device (needs ``memory``)."""
    cpu_max: str | None = None
    """CPUs, as written (``1.5``): the ``cpu.max`` of each job's cgroup (needs ``cpu``)."""


@attrs.frozen
class Config:
    """The whole worker configuration, fully resolved.

    ``controller_url`` None means an embedded controller: the worker serves
    the reference controller in-process (demos, single-box use).
    """

    devices: tuple[DeviceConfig, ...]
    controller_url: str | tuple[str, ...] | None = None
    """One URL, or several (a list in the file, commas in ``RC_CONTROLLER_URL``):
    the active controller's and its standbys'. See :attr:`controller_urls`."""
    token: str | None = None
    token_file: str | None = None
    host: str = ""
    heartbeat_interval: float = DEFAULT_HEARTBEAT_INTERVAL
    poll_wait: float = DEFAULT_POLL_WAIT
    hooks: HooksConfig = HooksConfig()
    probe_dir: str = DEFAULT_PROBE_DIR
    probe_interval: float = DEFAULT_PROBE_INTERVAL
    probe_timeout: float = DEFAULT_PROBE_TIMEOUT
    probe_pass_budget: float = DEFAULT_PROBE_PASS_BUDGET
    verify_dir: str = DEFAULT_VERIFY_DIR
    verify_timeout: float = DEFAULT_VERIFY_TIMEOUT
    verify_pass_budget: float = DEFAULT_VERIFY_PASS_BUDGET
    sheet_dir: str = DEFAULT_SHEET_DIR
    require_manual_clear: bool = False
    state_dir: str = DEFAULT_STATE_DIR
    status_listen: str | None = None
    status_token: str | None = None
    job_user: str | None = None
    shutdown_grace: float = DEFAULT_SHUTDOWN_GRACE
    spool_max_bytes: int = DEFAULT_SPOOL_MAX_BYTES
    max_grace: float = DEFAULT_MAX_GRACE
    log_format: str = "text"
    log_level: str = "info"
    gpu_health: GpuHealthConfig = GpuHealthConfig()
    cgroup: str = "auto"
    """``auto``, ``required`` or ``off``: a cgroup v2 per job (see docs/operations.md)."""
    cgroup_io: bool = False
    """Report each job's I/O (``io.stat``) in its finish; needs the ``io`` controller."""

    def device(self, name: str) -> DeviceConfig:
        for dev in self.devices:
            if dev.name == name:
                return dev
        raise KeyError(name)

    @property
    def controller_urls(self) -> tuple[str, ...]:
        """Every controller to try, in order: the worker starts with the first and
        moves to the next on a refused connection or a standby's ``503``."""
        url = self.controller_url
        if url is None:
            return ()
        return (url,) if isinstance(url, str) else url

    @property
    def device_names(self) -> tuple[str, ...]:
        return tuple(dev.name for dev in self.devices)


def config_warnings(config: Config, *, euid: int) -> list[str]:
    """What ``check-config`` warns about: settings that work but are unsafe."""
    warnings = []
    if euid == 0:
        without = [d.name for d in config.devices if d.job_user is None]
        if without:
            warnings.append(
                f"the worker runs as root and devices {', '.join(without)} have no job_user, "
                "so their jobs, hooks and verify scripts run as root and can read the worker's "
                "state and memory; set job_user (e.g. job_user: nobody)"
            )
    return warnings


def cgroup_needs(config: Config) -> dict[str, str]:
    """Each device limit, by its config location, and the controller it needs."""
    needs: dict[str, str] = {}
    for i, dev in enumerate(config.devices):
        if dev.memory_max is not None:
            needs[f"devices[{i}].memory_max"] = "memory"
        if dev.cpu_max is not None:
            needs[f"devices[{i}].cpu_max"] = "cpu"
    if config.cgroup_io:
        needs["cgroup_io"] = "io"
    return needs


def child_environ(environ: Mapping[str, str]) -> dict[str, str]:
    """``environ`` without any ``RC_*`` variable.

    Jobs, hooks, probes and verify scripts start from this: the worker's
    token and settings never reach them, nor anything else of the rc family
    the worker's environment happens to hold (``RC_USER_TOKEN``, ``RC_URL`` of
    the ``rc`` client, an inherited ``RC_JOB_ID``). The ``RC_*`` variables a
    child sees are only the ones the worker sets for it.
    """
    return {k: v for k, v in environ.items() if not k.startswith("RC_")}


def probe_environ(environ: Mapping[str, str]) -> dict[str, str]:
    """``environ`` for the operator's probes, which run as the worker's user and may be
    configured through ``RC_*`` variables of their own (``RC_RACK_FILE``): everything but the
    worker's settings, its token and other people's credentials."""
    drop = WORKER_ENV_VARS | FOREIGN_ENV_VARS
    return {k: v for k, v in environ.items() if k not in drop}
