"""One JSON decoder for untrusted input, shared by the worker and the controller (sans-IO).

Python's ``json`` accepts ``NaN``, ``Infinity`` and ``1e999`` (as ``inf``),
integers of any length, and recurses once per nesting level. A non-finite
number stored and later serialised makes every answer carrying it fail; a
100k-deep array raises ``RecursionError``. :func:`loads` refuses all three
with a ``ValueError`` whose message names the problem.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable
from typing import Any, Final

__all__ = ["MAX_DEPTH", "JsonTooDeep", "depth", "loads"]

MAX_DEPTH: Final = 64
"""The deepest message of the protocol nests about 5 levels; this leaves room and stays far
from Python's recursion limit."""
MAX_INT_DIGITS: Final = 20


class JsonTooDeep(ValueError):
    """The document nests deeper than allowed."""


def depth(value: object) -> int:
    """The nesting depth of a parsed JSON value (a scalar is 0), without recursion."""
    if not isinstance(value, dict | list):
        return 0
    deepest = 0
    # Only containers go on the stack: scalars, most of a document, add no depth.
    stack: list[tuple[dict[Any, object] | list[object], int]] = [(value, 1)]
    while stack:
        item, level = stack.pop()
        deepest = max(deepest, level)
        children: Iterable[object] = item.values() if isinstance(item, dict) else item
        stack.extend((child, level + 1) for child in children if isinstance(child, dict | list))
    return deepest


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number; send a finite number")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"{text[:40]} is out of range for a number")
    return value


def _bounded_int(text: str) -> int:
    if len(text.lstrip("-")) > MAX_INT_DIGITS:
        raise ValueError(f"integer {text[:MAX_INT_DIGITS]}... is too large")
    return int(text)


# One decoder for every call: json.loads with hooks builds a decoder (and its scanner)
# per document, a good part of the cost of a small one.
_DECODER = json.JSONDecoder(
    parse_constant=_refuse_constant, parse_float=_finite_float, parse_int=_bounded_int
)


def loads(data: bytes | str, *, max_depth: int = MAX_DEPTH) -> object:
    """Parse JSON; ``ValueError`` (``JsonTooDeep`` for nesting) on anything unsafe."""
    text = data.decode("utf-8") if isinstance(data, bytes) else data
    if text.startswith("\ufeff"):
        # What json.loads says of a text that starts with a byte order mark.
        raise json.JSONDecodeError("Unexpected UTF-8 BOM (decode using utf-8-sig)", text, 0)
    try:
        # The C decoder guards its own recursion: a 100k-deep array is a RecursionError.
        value = _DECODER.decode(text)
    except RecursionError:
        raise _too_deep(max_depth) from None
    # Each level opens with a bracket, so a text with no more brackets than allowed
    # (strings' own included) cannot nest too deep: no need to walk what was parsed.
    if text.count("[") + text.count("{") > max_depth and depth(value) > max_depth:
        raise _too_deep(max_depth)
    return value


def _too_deep(max_depth: int) -> JsonTooDeep:
    return JsonTooDeep(f"JSON nested too deep; at most {max_depth} levels are accepted")
