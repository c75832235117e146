"""Messages between the worker and the controller (sans-IO).

``parse_assignment`` is where a controller's assignment is checked before
anything acts on it: the protocol's converter checks its shape, this module the
worker's rules about its values; a malformed one becomes an ``AssignmentError``
that names the problem, and the worker answers it with a ``rejected`` finish.
The message types themselves are the protocol's (:mod:`rc_worker.core.protocol`).
"""

from __future__ import annotations

import enum
import math
import re
from collections.abc import Mapping
from typing import Final
from urllib.parse import urlsplit

import attrs

from rc_worker.core import protocol
from rc_worker.core.errors import AssignmentError
from rc_worker.core.protocol import Assignment, ProtocolError

__all__ = [
    "JOB_ID_RE",
    "PROTOCOL_VERSION",
    "Assignment",
    "Claim",
    "DeviceState",
    "IdleBehavior",
    "Outcome",
    "VerifyResult",
    "assignment_identity",
    "check_controller_url",
    "effective_limit",
    "job_key",
    "parse_assignment",
    "url_origin",
]

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


def assignment_identity(raw: object) -> tuple[str, int, str] | None:
    """The (job_id, attempt, device) of a raw assignment, if it has a usable one.

    A rejection needs these to address its ``finish``; an assignment without
    them cannot be answered at all, only logged.
    """
    try:
        ident = protocol.structure(raw, protocol.AssignmentIdentity)
    except ProtocolError:
        return None
    if not JOB_ID_RE.fullmatch(ident.job_id) or ident.attempt < 0:
        return None
    return ident.job_id, ident.attempt, ident.device if isinstance(ident.device, str) else ""


def parse_assignment(raw: object, *, origin: str | None = None) -> Assignment:
    """Check and convert one assignment from a poll response, completely: nothing acts on an
    assignment before this has accepted every field of it.

    The protocol's converter checks its shape; the worker's own rules about its values
    follow. ``origin`` is the controller's ``scheme://host[:port]``: a ``stdin.url`` must be
    a path on it (or an absolute URL with that very origin), so the worker's token never
    goes elsewhere.
    """
    if not isinstance(raw, Mapping):
        raise AssignmentError("the assignment is not a JSON object")
    if assignment_identity(raw) is None:
        raise AssignmentError(
            "job_id must be a string of letters, digits, '.', '_' or '-' and attempt an integer"
        )
    if not raw.get("device") or not isinstance(raw.get("device"), str):
        raise AssignmentError("device must be a non-empty string")
    try:
        a = protocol.structure(raw, Assignment)
    except ProtocolError as e:
        raise AssignmentError(e.sentence) from None
    command = a.command
    if not command:
        raise AssignmentError("command must be a non-empty list of strings")
    if not command[0]:
        raise AssignmentError("command[0], the program, must not be an empty string")
    if any("\0" in c for c in command):
        raise AssignmentError("command must not contain NUL characters")
    if len(command) > MAX_ARGS or sum(len(c) + 1 for c in command) > MAX_ARGV_CHARS:
        raise AssignmentError(f"command is larger than {MAX_ARGV_CHARS} characters")
    if a.cwd is not None and not a.cwd:
        raise AssignmentError("cwd must be null or a non-empty string")
    env = a.env
    if not all(k and "=" not in k and "\0" not in k + v for k, v in env.items()):
        raise AssignmentError("env must be an object mapping variable names to strings")
    if len(env) > MAX_ARGS or sum(len(k) + len(v) + 2 for k, v in env.items()) > MAX_ARGV_CHARS:
        raise AssignmentError(f"env is larger than {MAX_ARGV_CHARS} characters")
    if a.stdin is not None:
        check_controller_url(a.stdin.url, origin, "stdin.url")
    _seconds(a.grace_s, "grace_s")
    _positive_or_none(a.max_runtime_s, "max_runtime_s")
    _positive_or_none(a.idle_timeout_s, "idle_timeout_s")
    return a


def _seconds(value: float | None, key: str) -> None:
    if value is None:
        return
    if not math.isfinite(value) or value < 0:
        raise AssignmentError(f"{key} must be a finite, non-negative number of seconds")
    if value > MAX_SECONDS:
        raise AssignmentError(f"{key} must be at most {MAX_SECONDS:g} seconds")


def _positive_or_none(value: float | None, key: str) -> None:
    _seconds(value, key)
    if value == 0:
        raise AssignmentError(f"{key} must be more than zero, or null for no limit")


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
