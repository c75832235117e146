"""One drop-in probe's stdout as label facts (sans-IO): one JSON object of flat keys."""

from __future__ import annotations

import json
from collections.abc import Collection
from typing import Any

from rc_worker.core.names import label_value_problem, split_label_key

DROPIN_PREFIX = "probe.d/"
DROPIN_STDOUT_CAP = 64 * 1024


class _Duplicate(ValueError):
    pass


def _pairs(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise _Duplicate(f"key {key!r} appears twice")
        out[key] = value
    return out


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


def _kind(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, dict):
        return "an object"
    if isinstance(value, list):
        return "an array"
    if isinstance(value, bool):
        return "a boolean"
    return "a string or number"


def parse_dropin_output(
    data: bytes, declared_devices: Collection[str]
) -> tuple[dict[str, str], dict[str, dict[str, str]]]:
    """One drop-in's stdout as ``(host facts, device facts)``.

    It must be ONE JSON object of flat keys to strings, numbers or booleans:
    ``true`` becomes ``"true"`` and a number keeps its JSON text; a string
    must be a valid label value (``label_value_problem``: no NUL byte). A bare key
    is host-scoped, ``<device>.<label>`` device-scoped, and that device must
    be declared. Raises ``ValueError`` with a short reason otherwise; the
    caller then uses none of the output.
    """
    if len(data) > DROPIN_STDOUT_CAP:
        raise ValueError(f"output over the {DROPIN_STDOUT_CAP}-byte cap")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        raise ValueError("not JSON: the output is not UTF-8") from None
    if not text.strip():
        raise ValueError("not JSON: the output is empty")
    try:
        # Numbers arrive as their own text, so 1.50 stays "1.50" and a large
        # integer is not rounded through a float.
        obj = json.loads(
            text,
            parse_int=str,
            parse_float=str,
            parse_constant=_no_constant,
            object_pairs_hook=_pairs,
        )
    except _Duplicate as e:
        raise ValueError(f"ambiguous output: {e}") from None
    except RecursionError:
        raise ValueError("not JSON we accept: nested too deep") from None
    except ValueError as e:
        raise ValueError(f"not JSON: {e}") from None
    if not isinstance(obj, dict):
        raise ValueError(f"not a JSON object: got {_kind(obj)}")
    host: dict[str, str] = {}
    device: dict[str, dict[str, str]] = {}
    for key, value in obj.items():
        if isinstance(value, bool):
            text_value = "true" if value else "false"
        elif isinstance(value, str):
            text_value = value
        else:
            raise ValueError(
                f"key {key!r} holds {_kind(value)}; values must be strings, numbers or booleans"
            )
        problem = label_value_problem(text_value)
        if problem is not None:
            raise ValueError(f"key {key!r} {problem}")
        try:
            dev, label = split_label_key(key)
        except ValueError as e:
            raise ValueError(f"invalid key: {e}") from None
        if dev is None:
            host[label] = text_value
        elif dev not in declared_devices:
            raise ValueError(f"names undeclared device {dev}")
        else:
            device.setdefault(dev, {})[label] = text_value
    return host, device
