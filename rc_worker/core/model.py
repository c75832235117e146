"""Messages between the worker and the controller (sans-IO).

``parse_assignment`` is where a controller's assignment is checked before
anything acts on it: a malformed one becomes an ``AssignmentError`` that
names the problem, and the worker answers it with a ``rejected`` finish.
"""

from __future__ import annotations

import enum
import math
import re
from collections.abc import Mapping
from typing import Any, Final
from urllib.parse import urlsplit

import attrs

from rc_worker.core.errors import AssignmentError

# Job ids name files in the state directory, so their alphabet is closed.
JOB_ID_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")

VERIFY_REASON_PREFIX = "verify failed: "

# Bounds on an assignment: Linux refuses an argv+envp much above 2 MiB at execve anyway, and a
# duration above a year is a controller bug, not a limit (it would also overflow deadlines).
MAX_ARGS = 4096
MAX_ARGV_CHARS = 1024 * 1024
MAX_SECONDS = 366 * 24 * 3600.0


class Outcome(enum.StrEnum):
    """A job attempt's terminal outcome as ``finish`` reports it (PROTOCOL.md)."""

    SUCCEEDED = "succeeded"
    FAILED = "failed"
    KILLED = "killed"
    ERROR = "error"
    REFUSED = "refused"
    REJECTED = "rejected"
    LOST = "lost"


class DeviceState(enum.StrEnum):
    """A device's worker-side state, as heartbeats report it."""

    FREE = "free"
    ACQUIRING = "acquiring"
    RUNNING = "running"
    VERIFYING = "verifying"
    LINGERING = "lingering"
    RELEASING = "releasing"
    QUARANTINED = "quarantined"


class IdleBehavior(enum.StrEnum):
    """What an idle device does: ``run`` takes work; ``hold`` takes none and
    stays held; ``drain`` takes none and is released once idle."""

    RUN = "run"
    HOLD = "hold"
    DRAIN = "drain"


class Claim(enum.StrEnum):
    """What a restarted worker claims about an interrupted job's processes."""

    GONE = "gone"
    ALIVE = "alive"
    UNKNOWN = "unknown"


@attrs.frozen
class Assignment:
    """One offer of a job to one of this host's devices."""

    job_id: str
    attempt: int
    device: str
    command: tuple[str, ...]
    cwd: str | None = None
    env: Mapping[str, str] = attrs.field(factory=dict)
    max_runtime_s: float | None = None
    idle_timeout_s: float | None = None
    grace_s: float = 10.0
    stdin_url: str | None = None
    pty: bool = False


@attrs.frozen
class VerifyResult:
    """The outcome of one verify pass.

    ``reason`` is empty when ``ok``; otherwise it starts with
    ``VERIFY_REASON_PREFIX``, then the first failing script's name and the
    tail of its stderr: short enough for a log line and an event payload.
    """

    ok: bool
    reason: str = ""


PROTOCOL_VERSION: Final = 2
"""The worker ⇄ controller protocol of docs/protocol.md. 2: ``register`` carries, per device,
the faults the worker holds and the attempt it runs."""


def job_key(job_id: str, attempt: int) -> str:
    """The name of a job attempt's directory under the state dir."""
    return f"{job_id}.{attempt}"


def assignment_identity(raw: Any) -> tuple[str, int, str] | None:
    """The (job_id, attempt, device) of a raw assignment, if it has a usable one.

    A rejection needs these to address its ``finish``; an assignment without
    them cannot be answered at all, only logged.
    """
    if not isinstance(raw, Mapping):
        return None
    job_id, attempt, device = raw.get("job_id"), raw.get("attempt"), raw.get("device")
    if not isinstance(job_id, str) or not JOB_ID_RE.fullmatch(job_id):
        return None
    if not isinstance(attempt, int) or isinstance(attempt, bool) or attempt < 0:
        return None
    return job_id, attempt, device if isinstance(device, str) else ""


def parse_assignment(raw: Any, *, origin: str | None = None) -> Assignment:
    """Check and convert one assignment from a poll response, completely: nothing acts on an
    assignment before this has accepted every field of it.

    ``origin`` is the controller's ``scheme://host[:port]``: a ``stdin.url`` must be a path on
    it (or an absolute URL with that very origin), so the worker's token never goes elsewhere.
    """
    if not isinstance(raw, Mapping):
        raise AssignmentError("the assignment is not a JSON object")
    ident = assignment_identity(raw)
    if ident is None:
        raise AssignmentError(
            "job_id must be a string of letters, digits, '.', '_' or '-' and attempt an integer"
        )
    job_id, attempt, device = ident
    if not device:
        raise AssignmentError("device must be a non-empty string")
    command = raw.get("command")
    if not isinstance(command, list) or not command or not all(isinstance(c, str) for c in command):
        raise AssignmentError("command must be a non-empty list of strings")
    if not command[0]:
        raise AssignmentError("command[0], the program, must not be an empty string")
    if any("\0" in c for c in command):
        raise AssignmentError("command must not contain NUL characters")
    if len(command) > MAX_ARGS or sum(len(c) + 1 for c in command) > MAX_ARGV_CHARS:
        raise AssignmentError(f"command is larger than {MAX_ARGV_CHARS} characters")
    cwd = raw.get("cwd")
    if cwd is not None and (not isinstance(cwd, str) or not cwd):
        raise AssignmentError("cwd must be null or a non-empty string")
    env = raw.get("env") or {}
    if not isinstance(env, Mapping) or not all(
        isinstance(k, str) and isinstance(v, str) and k and "=" not in k and "\0" not in k + v
        for k, v in env.items()
    ):
        raise AssignmentError("env must be an object mapping variable names to strings")
    if len(env) > MAX_ARGS or sum(len(k) + len(v) + 2 for k, v in env.items()) > MAX_ARGV_CHARS:
        raise AssignmentError(f"env is larger than {MAX_ARGV_CHARS} characters")
    stdin = raw.get("stdin")
    stdin_url: str | None = None
    if stdin is not None:
        if not isinstance(stdin, Mapping) or not isinstance(stdin.get("url"), str):
            raise AssignmentError('stdin must be null or {"url": "..."}')
        stdin_url = check_controller_url(stdin["url"], origin, "stdin.url")
    pty = raw.get("pty", False)
    if not isinstance(pty, bool):
        raise AssignmentError("pty must be true or false")
    grace = _seconds(raw, "grace_s", default=10.0)
    return Assignment(
        job_id=job_id,
        attempt=attempt,
        device=device,
        command=tuple(command),
        cwd=cwd,
        env=dict(env),
        max_runtime_s=_positive_or_none(raw, "max_runtime_s"),
        idle_timeout_s=_positive_or_none(raw, "idle_timeout_s"),
        grace_s=10.0 if grace is None else grace,
        stdin_url=stdin_url,
        pty=pty,
    )


def _seconds(raw: Mapping[str, Any], key: str, *, default: float | None) -> float | None:
    value = raw.get(key, default)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise AssignmentError(f"{key} must be a number of seconds or null")
    if not math.isfinite(value) or value < 0:
        raise AssignmentError(f"{key} must be a finite, non-negative number of seconds")
    if value > MAX_SECONDS:
        raise AssignmentError(f"{key} must be at most {MAX_SECONDS:g} seconds")
    return float(value)


def _positive_or_none(raw: Mapping[str, Any], key: str) -> float | None:
    value = _seconds(raw, key, default=None)
    if value == 0:
        raise AssignmentError(f"{key} must be more than zero, or null for no limit")
    return value


def url_origin(url: str) -> str:
    """``scheme://host[:port]`` of an absolute URL, lower-cased, default ports dropped."""
    parts = urlsplit(url)
    scheme = parts.scheme.lower()
    try:
        port = parts.port
    except ValueError:
        port = None
    host = (parts.hostname or "").lower()
    if ":" in host:
        host = f"[{host}]"
    default = {"http": 80, "https": 443}.get(scheme)
    return f"{scheme}://{host}" + ("" if port in (None, default) else f":{port}")


def check_controller_url(url: str, origin: str | None, where: str) -> str:
    """``url`` if it addresses the controller (a path, or an absolute URL on ``origin``)."""
    if url.startswith("/") and not url.startswith("//") and "\\" not in url:
        return url
    parts = urlsplit(url)
    if (
        parts.scheme
        and parts.netloc
        and origin is not None
        and url_origin(url) == url_origin(origin)
    ):
        return url
    raise AssignmentError(
        f"{where} {url[:200]!r} is not on the controller's origin {origin or '(unknown)'}; "
        "the worker sends its token only to the controller"
    )


def effective_limit(device_limit: float | None, job_limit: float | None) -> float | None:
    """The smaller of two optional limits (None = no limit)."""
    limits = [x for x in (device_limit, job_limit) if x is not None]
    return min(limits) if limits else None
