"""Validation at the controller's edge: bounded JSON, finite numbers, sane job specs.

Sans-IO. Everything a request carries is checked here once, before the store
sees it, and a bad value is a ``400`` naming the field. Python's ``json``
accepts ``NaN``, ``Infinity`` and ``1e999`` (parsed as ``inf``) and recurses
once per nesting level; a value like that stored in a job would later make
every answer that serialises it fail (``Out of range float values are not
JSON compliant``), and a 100k-deep array raises ``RecursionError``. So
:func:`loads` refuses non-finite numbers, huge integers and deep nesting.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Final

from rc_worker.controller.errors import BadRequest
from rc_worker.core import boundedjson
from rc_worker.core.jsonconv import ProtocolError

__all__ = [
    "MAX_COMMAND_ARGS",
    "MAX_COMMAND_BYTES",
    "MAX_DURATION_S",
    "MAX_ENV_BYTES",
    "MAX_JSON_DEPTH",
    "check_job",
    "finite_number",
    "json_depth",
    "loads",
]

MAX_JSON_DEPTH: Final = boundedjson.MAX_DEPTH
MAX_COMMAND_ARGS: Final = 4096
MAX_COMMAND_BYTES: Final = 256 * 1024
"""Linux's ``MAX_ARG_STRLEN`` is 128 KiB per argument and the whole argv+env is bounded near
2 MiB; a job spec above these would fail at ``execve`` on the worker anyway."""
MAX_ENV_BYTES: Final = 256 * 1024
MAX_ENV_VARS: Final = 4096
MAX_DURATION_S: Final = 366 * 24 * 3600.0
"""A year: any finite limit above this is a typo, and near-infinite floats overflow deadlines."""
MAX_STRING_FIELD: Final = 4096
"""``select``, ``device``, ``cwd`` and similar short strings."""


json_depth = boundedjson.depth


def loads(body: bytes, *, max_depth: int = MAX_JSON_DEPTH) -> object:
    """Parse a JSON body, refusing deep nesting and non-finite or huge numbers (``BadRequest``)."""
    try:
        return boundedjson.loads(body, max_depth=max_depth)
    except UnicodeDecodeError as e:
        raise BadRequest(f"body: not valid UTF-8 ({e})") from None
    except boundedjson.JsonTooDeep as e:
        raise BadRequest(f"body: {e}") from None
    except boundedjson.NotFinite as e:
        # Named by its field (``grace_s: NaN is not a JSON number; ...``), as every
        # other malformed field is.
        raise BadRequest(str(ProtocolError(str(e), e.path))) from None
    except ValueError as e:
        raise BadRequest(f"body: not valid JSON ({e})") from None


def finite_number(value: float, where: str, *, maximum: float = MAX_DURATION_S) -> float:
    """``value`` if finite, not negative and at most ``maximum``; else ``BadRequest``."""
    if not math.isfinite(value):
        raise BadRequest(f"{where}: must be a finite number")
    if value < 0:
        raise BadRequest(f"{where}: must not be negative")
    if value > maximum:
        raise BadRequest(f"{where}: {value:g} is above the limit of {maximum:g}")
    return value


def check_job(
    *,
    command: Sequence[str],
    env: Mapping[str, str],
    select: str,
    device: str | None,
    cwd: str | None,
    max_runtime_s: float | None,
    idle_timeout_s: float | None,
    grace_s: float,
    max_grace_s: float,
) -> None:
    """Refuse a job spec no worker could run as asked, naming the field (``BadRequest``)."""
    if not command:
        raise BadRequest("command: must not be empty")
    if len(command) > MAX_COMMAND_ARGS:
        raise BadRequest(f"command: {len(command)} arguments; at most {MAX_COMMAND_ARGS}")
    if not command[0]:
        raise BadRequest("command[0]: the program must not be an empty string")
    size = 0
    for i, arg in enumerate(command):
        if "\0" in arg:
            raise BadRequest(f"command[{i}]: must not contain NUL characters")
        size += len(arg.encode("utf-8", "surrogatepass")) + 1
    if size > MAX_COMMAND_BYTES:
        raise BadRequest(f"command: {size} bytes; at most {MAX_COMMAND_BYTES}")
    if len(env) > MAX_ENV_VARS:
        raise BadRequest(f"env: {len(env)} variables; at most {MAX_ENV_VARS}")
    size = 0
    for key, value in env.items():
        if not key or "=" in key or "\0" in key:
            raise BadRequest(f"env: {key[:40]!r} is not a valid variable name")
        if "\0" in value:
            raise BadRequest(f"env.{key}: must not contain NUL characters")
        size += len(key.encode("utf-8", "surrogatepass")) + len(
            value.encode("utf-8", "surrogatepass")
        )
        size += 2
    if size > MAX_ENV_BYTES:
        raise BadRequest(f"env: {size} bytes; at most {MAX_ENV_BYTES}")
    for name, text in (("select", select), ("device", device), ("cwd", cwd)):
        if text is not None and len(text) > MAX_STRING_FIELD:
            raise BadRequest(f"{name}: longer than {MAX_STRING_FIELD} characters")
        if text is not None and "\0" in text:
            raise BadRequest(f"{name}: must not contain NUL characters")
    if cwd == "":
        raise BadRequest("cwd: must be null or a non-empty path")
    for name, limit in (("max_runtime_s", max_runtime_s), ("idle_timeout_s", idle_timeout_s)):
        if limit is not None:
            finite_number(limit, name)
            if limit == 0:
                raise BadRequest(f"{name}: must be positive or null")
    finite_number(grace_s, "grace_s", maximum=max_grace_s)
