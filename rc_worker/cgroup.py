"""A cgroup v2 per job: setting up the worker's tree, and the exact sweep.

Where the worker may create cgroups in the unified (v2) hierarchy (a root
worker, a systemd unit with ``Delegate=yes``, a container with a writable
cgroupfs), every process it starts (job, hook, probe, verify script) is born
in a cgroup of its own under the worker's tree::

    <the worker's own cgroup>/            from /proc/self/cgroup (the ``0::`` line)
        worker/                           the worker, when its cgroup must stay
                                          free of processes to delegate controllers
        rc-worker-<tag>/                  the tree (``tag`` names the state directory)
            <job key>/                    one per job attempt: journalled, so a
                                          restarted worker finds it again
            p-<n>-<random>/               one per hook, probe or verify script

Everything a job creates stays in its cgroup whatever it does with its
session, process group or environment, so the end-of-job sweep reads
``cgroup.procs`` (no process table walk, never blind) and ends it with
``cgroup.kill``. How a process gets *born* in its cgroup is the Host's
business (see ``LinuxHost.spawn``).

The parsers and :func:`plan_tree` are sans-IO; the rest reads and writes the
cgroupfs only through the Host seam, so the simulated host runs it unchanged.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import logging
import math
import os
import posixpath
import secrets
import signal
from collections.abc import Mapping
from typing import TYPE_CHECKING

import attrs
import trio

from rc_worker.core.cgroup_parse import parse_io_stat, parse_keyed, parse_pids
from rc_worker.core.errors import ConfigError
from rc_worker.sweep import KILL_WAIT, METHOD_CGROUP, NOT_SWEPT, SweepReport

if TYPE_CHECKING:
    from rc_worker.host import Host, ProcessPin

log = logging.getLogger("rc_worker.cgroup")

# The controllers a device's limits and the finish report's accounting use.
LIMIT_CONTROLLERS = frozenset({"memory", "cpu"})

WORKER_LEAF = "worker"

# cpu.max's period when a device gives its limit as a number of CPUs.
CPU_PERIOD_USEC = 100_000

_POLL_MAX = 0.1


class CgroupUnavailable(Exception):
    """The worker cannot contain its processes in cgroups here; the message says why."""


# -- sans-IO ------------------------------------------------------------------


def cpu_max_value(cpus: float) -> str:
    """``cpu.max`` for a limit of ``cpus`` CPUs: ``<quota> <period>`` in microseconds."""
    if not (math.isfinite(cpus) and cpus > 0):
        raise ValueError(f"cpu_max must be a number of CPUs > 0, got {cpus!r}")
    return f"{max(1000, round(cpus * CPU_PERIOD_USEC))} {CPU_PERIOD_USEC}"


def join(parent: str, name: str) -> str:
    if not name or "/" in name or name in (".", ".."):
        raise ValueError(f"a cgroup name must be one path component, got {name!r}")
    return posixpath.join(parent, name)


@attrs.frozen
class TreePlan:
    """Where things go, decided from what the hierarchy offers (sans-IO)."""

    tree: str  # the parent of every cgroup the worker creates
    home: str  # where the worker itself lives (to return to after a spawn)
    move_self: bool  # the worker must move into ``home`` first
    enable: frozenset[str]  # controllers to switch on down to the tree


def plan_tree(own: str, available: frozenset[str], tag: str, wanted: frozenset[str]) -> TreePlan:
    """Lay out the worker's tree under its own cgroup ``own``.

    A cgroup other than the root may not both hold processes and hand
    controllers to its children (the "no internal processes" rule), so when
    controllers are wanted and available the worker first moves into a leaf
    ``worker/`` of its own cgroup. Without controllers, or at the root, it
    stays where it is.
    """
    enable = wanted & available
    tree = join(own, f"rc-worker-{tag}")
    if enable and own != "/":
        return TreePlan(tree=tree, home=join(own, WORKER_LEAF), move_self=True, enable=enable)
    return TreePlan(tree=tree, home=own, move_self=False, enable=enable)


# -- the tree ---------------------------------------------------------------------


@attrs.frozen
class Containment:
    """The worker's cgroup tree, once set up: where new processes' cgroups go."""

    tree: str
    home: str
    controllers: frozenset[str] = frozenset()

    def leaf(self, name: str | None = None) -> str:
        """A path for a new cgroup: ``name`` (a job key), or a fresh unique one."""
        return join(self.tree, name if name is not None else f"p-{secrets.token_hex(6)}")


def set_up(
    host: Host, *, tag: str, wanted: frozenset[str] = frozenset()
) -> tuple[Containment, str]:
    """Create the worker's tree; the containment and a sentence for the log.

    Raises :class:`CgroupUnavailable` with the reason when it cannot.
    """
    try:
        own = host.own_cgroup()
    except OSError as e:
        raise CgroupUnavailable(f"no cgroup v2 hierarchy to use: {e}") from None
    try:
        available = frozenset(host.cgroup_read(own, "cgroup.controllers").split())
    except OSError as e:
        raise CgroupUnavailable(f"cannot read {own}/cgroup.controllers: {e}") from None
    plan = plan_tree(own, available, tag, wanted)
    enabled: frozenset[str] = frozenset()
    moved = False
    try:
        host.cgroup_mkdir(plan.tree)
    except OSError as e:
        raise CgroupUnavailable(
            f"cannot create {plan.tree} in the unified hierarchy ({e.strerror or e}); "
            "run the worker as root or delegate its cgroup (systemd: Delegate=yes)"
        ) from None
    if plan.enable:
        try:
            if plan.move_self:
                host.cgroup_mkdir(plan.home)
                host.cgroup_write(plan.home, "cgroup.procs", str(host.own_pid()))
                moved = True
            # Down the path: own's children (the tree) get them, then the tree's (jobs).
            controllers = " ".join(f"+{c}" for c in sorted(plan.enable))
            host.cgroup_write(own, "cgroup.subtree_control", controllers)
            host.cgroup_write(plan.tree, "cgroup.subtree_control", controllers)
            enabled = plan.enable
        except OSError as e:
            log.warning(
                "cgroup: could not enable controllers %s for jobs (%s); no limits or "
                "memory accounting",
                sorted(plan.enable),
                e.strerror or e,
            )
    home = plan.home if moved else own
    containment = Containment(tree=plan.tree, home=home, controllers=enabled)
    why = (
        f"in use: every job, hook, probe and verify script runs in its own cgroup under "
        f"{plan.tree} (controllers: {', '.join(sorted(enabled)) or 'none delegated'})"
    )
    return containment, why


def limits_for(
    memory_max: int | None, cpu_max: float | None, controllers: frozenset[str]
) -> dict[str, str]:
    """The cgroup files a device's limits write, for the controllers the tree has."""
    files: dict[str, str] = {}
    if memory_max is not None and "memory" in controllers:
        files["memory.max"] = str(memory_max)
    if cpu_max is not None and "cpu" in controllers:
        files["cpu.max"] = cpu_max_value(cpu_max)
    return files


def create(host: Host, path: str, limits: Mapping[str, str]) -> None:
    """Make the cgroup ``path`` (fresh, or left empty by an earlier attempt) with ``limits``."""
    host.cgroup_mkdir(path)
    for name, value in limits.items():
        host.cgroup_write(path, name, value)


def usage(host: Host, path: str) -> dict[str, int]:
    """The accounting of a cgroup: what of it the hierarchy provides, else nothing."""
    out: dict[str, int] = {}
    try:
        cpu = parse_keyed(host.cgroup_read(path, "cpu.stat"))
    except OSError:
        cpu = {}
    for key, name in (
        ("usage_usec", "cpu_usec"),
        ("user_usec", "cpu_user_usec"),
        ("system_usec", "cpu_system_usec"),
    ):
        if key in cpu:
            out[name] = cpu[key]
    with contextlib.suppress(OSError, ValueError):
        # Only with the memory controller enabled (and Linux 5.19).
        out["memory_peak_bytes"] = int(host.cgroup_read(path, "memory.peak").strip())
    with contextlib.suppress(OSError):
        # Only with the io controller enabled (cgroup_io: true asks for it).
        out.update(parse_io_stat(host.cgroup_read(path, "io.stat")))
    return out


def populated(host: Host, path: str) -> bool:
    """Whether anything is alive in ``path`` (or below); a missing cgroup is empty."""
    try:
        return parse_keyed(host.cgroup_read(path, "cgroup.events")).get("populated", 0) != 0
    except FileNotFoundError:
        return False


def members(host: Host, path: str) -> tuple[int, ...]:
    """The pids in ``path`` and every cgroup below it (a root job may make some)."""
    try:
        pids = list(parse_pids(host.cgroup_read(path, "cgroup.procs")))
        for child in host.cgroup_children(path):
            pids.extend(members(host, join(path, child)))
    except FileNotFoundError:
        pass  # gone while we looked: what was in it has gone too
    return tuple(pids)


def kill_all(host: Host, path: str) -> None:
    """SIGKILL everything in ``path`` at once.

    ``cgroup.kill`` (Linux 5.14) kills atomically, forks included. Before it:
    freeze the cgroup (nothing in it can fork or exit), SIGKILL every pid it
    lists (a frozen process still dies of SIGKILL, and cannot have exited and
    left its pid to another meanwhile), then thaw.
    """
    try:
        host.cgroup_write(path, "cgroup.kill", "1")
        return
    except FileNotFoundError:
        if not populated(host, path):
            return  # no cgroup at all: nothing to kill
    except OSError as e:
        if e.errno not in (errno.EINVAL, errno.ENOTSUP, errno.EOPNOTSUPP):
            raise
    host.cgroup_write(path, "cgroup.freeze", "1")
    try:
        for pid in members(host, path):
            host.signal_pid(pid, signal.SIGKILL)
    finally:
        host.cgroup_write(path, "cgroup.freeze", "0")


def remove(host: Host, path: str) -> bool:
    """Remove the (empty) cgroup ``path`` and any below it; whether it is gone."""
    try:
        for child in host.cgroup_children(path):
            remove(host, join(path, child))
        host.cgroup_rmdir(path)
    except FileNotFoundError:
        return True
    except OSError as e:
        log.warning("cgroup %s: not removed (%s)", path, e.strerror or e)
        return False
    return True


async def _until_empty(
    host: Host, path: str, on_members: dict[int, None], term: _Terminator
) -> None:
    # Nothing notifies us when an unrelated process exits (inotify on
    # cgroup.events would, but needs more than the Host seam offers): a
    # backing-off poll, always under the caller's deadline.
    delay = 0.002
    while True:
        pids = members(host, path)
        for pid in pids:
            on_members.setdefault(pid)
        term.signal(pids)
        if not populated(host, path):
            return
        await trio.sleep(delay)
        delay = min(delay * 2, _POLL_MAX)


class _Terminator:
    """Sends SIGTERM once to each process it is shown, through a pin (see ``Host.pin``).

    A process is known by its pid *and* start time, as the environment sweep knows
    it: a pid freed during the grace and taken by a new process in the cgroup (a
    job's fork loop) names another process, which gets its own polite SIGTERM
    rather than going straight to ``cgroup.kill``.
    """

    def __init__(self, host: Host, active: bool) -> None:
        self.host = host
        self.active = active
        self.pins: dict[tuple[int, int], ProcessPin | None] = {}

    def signal(self, pids: tuple[int, ...]) -> None:
        if not self.active:
            return
        for pid in pids:
            # Read each poll (one procfs stat per member): only the start time
            # tells a pid's new holder from the process already signalled.
            row = self.host.process(pid)
            if row is None:
                continue  # gone already: nothing to signal
            key = (pid, row.start_time)
            if key in self.pins:
                continue
            pin = self.host.pin(pid, row.start_time)
            self.pins[key] = pin
            if pin is not None:
                pin.send_signal(signal.SIGTERM)

    def close(self) -> None:
        for pin in self.pins.values():
            if pin is not None:
                pin.close()


async def sweep_cgroup(host: Host, path: str, *, grace: float) -> SweepReport:
    """End everything left in the cgroup ``path``: the exact sweep.

    Every pid the cgroup holds gets SIGTERM (through a pin), then up to
    ``grace`` seconds to go, then ``cgroup.kill`` and up to
    :data:`~rc_worker.sweep.KILL_WAIT` seconds until ``cgroup.events`` says
    ``populated 0``. What is still there then (a process in uninterruptible
    sleep inside a driver) is ``remaining``. Never blind: membership does not
    depend on anything a process can change about itself. A cgroup that
    cannot be read at all is :data:`~rc_worker.sweep.NOT_SWEPT`.
    """
    if not (grace >= 0 and math.isfinite(grace)):
        raise ValueError(f"grace must be a finite number of seconds >= 0, got {grace!r}")
    await trio.lowlevel.checkpoint()
    found: dict[int, None] = {}
    term = _Terminator(host, active=grace > 0)
    try:
        try:
            if not populated(host, path):
                return SweepReport(scanned=True, method=METHOD_CGROUP)
            with trio.move_on_after(grace):
                await _until_empty(host, path, found, term)
            if populated(host, path):
                kill_all(host, path)
                with trio.move_on_after(KILL_WAIT):
                    await _until_empty(host, path, found, _Terminator(host, active=False))
            remaining = members(host, path) if populated(host, path) else ()
        except OSError as e:
            log.warning("cgroup %s: could not be swept (%s)", path, e.strerror or e)
            return attrs.evolve(NOT_SWEPT, found=tuple(found), method=METHOD_CGROUP)
        return SweepReport(
            scanned=True, found=tuple(found), remaining=remaining, method=METHOD_CGROUP
        )
    finally:
        term.close()


def state_tag(state_dir: str) -> str:
    """A short stable name for a state directory: two workers on one host never
    share a tree, and a restarted worker finds its own again."""
    return hashlib.sha256(os.path.abspath(state_dir).encode()).hexdigest()[:10]


def start_containment(
    host: Host, mode: str, *, tag: str, needs: Mapping[str, str]
) -> Containment | None:
    """Set up cgroups as ``mode`` says, log once whether they are in use and why
    not, and install the result as ``host.containment``.

    ``needs`` maps a config location (``devices[0].memory_max``) to the
    controller it needs. Raises :class:`~rc_worker.core.errors.ConfigError` for
    ``required`` without cgroups, or a limit whose controller is not delegated.
    """
    host.containment = None
    if mode == "off":
        log.info("cgroup: off (cgroup: off in the config); jobs are swept by RC_JOB_ID")
        return None
    try:
        wanted = LIMIT_CONTROLLERS | frozenset(needs.values())
        containment, why = set_up(host, tag=tag, wanted=wanted)
    except CgroupUnavailable as e:
        if mode == "required":
            raise ConfigError(
                f"cgroup: required, but {e}; fix that, or set cgroup: auto to run without"
            ) from None
        if needs:
            where = next(iter(needs))
            raise ConfigError(
                f"{where}: needs a cgroup per job, and {e}; fix that, or remove {where}"
            ) from None
        log.warning(
            "cgroup: not in use: %s. Jobs are swept by RC_JOB_ID; a job's process that "
            "clears its environment and leaves its session can escape the sweep",
            e,
        )
        return None
    for where, controller in needs.items():
        if controller not in containment.controllers:
            remove(host, containment.tree)
            raise ConfigError(
                f"{where}: the {controller} controller is not delegated to the worker's "
                f"cgroup (its cgroup.controllers does not list it); delegate it (systemd: "
                f"Delegate=yes, and no cgroup v1 {controller} hierarchy) or remove {where}"
            )
    host.containment = containment
    log.info("cgroup: %s", why)
    return containment


async def clear_strays(host: Host, containment: Containment, *, keep: set[str]) -> list[str]:
    """End and remove what an earlier worker process left in the tree, but ``keep``.

    Run after recovery, which dealt with every journalled job's cgroup; what
    is left is a hook, probe or verify script's cgroup from a worker that
    crashed while it ran, or a job cgroup recovery kept (named in ``keep``: a
    survivor stuck in the kernel, which the quarantine reports). Returns the
    names of the cgroups it had to end processes in.
    """
    try:
        names = host.cgroup_children(containment.tree)
    except OSError:
        return []
    ended: list[str] = []
    for name in names:
        if name in keep:
            continue
        path = join(containment.tree, name)
        report = await sweep_cgroup(host, path, grace=1.0)
        if report.found:
            ended.append(name)
            log.warning(
                "cgroup %s: ended %s left by an earlier worker process", path, list(report.found)
            )
        if report.clean:
            remove(host, path)
    return ended


def preflight(host: Host, mode: str, needs: Mapping[str, str]) -> str | None:
    """What would stop a worker with these settings from starting here, read-only.

    For ``rc-worker check-config`` (a systemd ``ExecStartPre``): ``required``
    with no v2 hierarchy, or a limit whose controller the worker's cgroup is
    not given. Whether the worker may *create* cgroups is only found out at
    start. ``None``: nothing known to stop it.
    """
    if mode == "off" or (mode == "auto" and not needs):
        return None
    try:
        own = host.own_cgroup()
        available = frozenset(host.cgroup_read(own, "cgroup.controllers").split())
    except OSError as e:
        if mode == "required":
            return f"cgroup: required, but no cgroup v2 hierarchy to use: {e}"
        where = next(iter(needs))
        return f"{where}: needs a cgroup per job, and there is no cgroup v2 hierarchy to use: {e}"
    for where, controller in needs.items():
        if controller not in available:
            return (
                f"{where}: the {controller} controller is not delegated to the worker's cgroup "
                f"{own} (its cgroup.controllers lists: {' '.join(sorted(available)) or 'none'}); "
                f"delegate it (systemd: Delegate=yes) or remove {where}"
            )
    return None
