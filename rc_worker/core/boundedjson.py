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

__all__ = ["MAX_DEPTH", "JsonTooDeep", "NotFinite", "depth", "kind", "loads"]

MAX_DEPTH: Final = 64
"""The deepest message of the protocol nests about 5 levels; this leaves room and stays far
from Python's recursion limit."""
MAX_INT_DIGITS: Final = 20


class JsonTooDeep(ValueError):
    """The document nests deeper than allowed."""


class NotFinite(ValueError):
    """A number that is not finite (``NaN``, ``Infinity``, ``1e999``); ``path`` says where
    (keys and indexes from the top, empty for the document itself), so that a message
    can name the field rather than call the whole body invalid."""

    def __init__(self, problem: str, path: tuple[str | int, ...]) -> None:
        super().__init__(problem)
        self.path = path


class _Bad:
    """A non-finite number's place in a second, locating pass (see :func:`_locate`)."""

    def __init__(self, problem: str) -> None:
        self.problem = problem


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


def _constant_problem(name: str) -> str:
    return f"{name} is not a JSON number; send a finite number"


def _float_problem(text: str) -> str:
    return f"{text[:40]} is out of range for a number"


def _refuse_constant(name: str) -> Any:
    raise _NonFinite(_constant_problem(name))


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise _NonFinite(_float_problem(text))
    return value


class _NonFinite(ValueError):
    """Raised inside the decoder; :func:`loads` turns it into :class:`NotFinite`."""


def _locate(text: str, problem: str) -> NotFinite:
    """Where the first non-finite number is: parsed again with markers in their place.

    The decoder cannot say which key it was under when it met the number, and
    this only runs for a body that is refused anyway.
    """
    marked = json.loads(
        text,
        parse_constant=lambda name: _Bad(_constant_problem(name)),
        parse_float=lambda t: _Bad(_float_problem(t)) if not math.isfinite(float(t)) else 0.0,
        parse_int=_bounded_int,
    )
    stack: list[tuple[object, tuple[str | int, ...]]] = [(marked, ())]
    while stack:
        value, path = stack.pop()
        if isinstance(value, _Bad):
            return NotFinite(value.problem, path)
        if isinstance(value, dict):
            stack.extend((v, (*path, k)) for k, v in reversed(list(value.items())))
        elif isinstance(value, list):
            stack.extend((v, (*path, i)) for i, v in reversed(list(enumerate(value))))
    return NotFinite(problem, ())


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
    except _NonFinite as e:
        raise _locate(text, str(e)) from None
    # Each level opens with a bracket, so a text with no more brackets than allowed
    # (strings' own included) cannot nest too deep: no need to walk what was parsed.
    if text.count("[") + text.count("{") > max_depth and depth(value) > max_depth:
        raise _too_deep(max_depth)
    return value


def _too_deep(max_depth: int) -> JsonTooDeep:
    return JsonTooDeep(f"JSON nested too deep; at most {max_depth} levels are accepted")


def kind(value: object) -> str:
    """The JSON name of a decoded value's type (``object``, ``array``, ``null``...), for
    messages that say what came instead of what was expected."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int | float):
        return "number"
    if isinstance(value, dict):
        return "object"
    return "array" if isinstance(value, list) else "string"
