"""Label selectors: which devices a job may run on.

A selector is a comma-separated list of terms, all of which must hold (AND)::

    disk_free_bytes>=50G,product=H100,gpu0.memory_total_bytes>80Gi

Operators: ``=``, ``!=``, ``>=``, ``<=``, ``>``, ``<``. The ordering operators
compare numbers; a number may carry a size suffix: ``K M G T P`` are powers of
1000 and ``Ki Mi Gi Ti Pi`` powers of 1024 (an optional trailing ``B`` is
accepted, so ``50GB`` and ``50GiB`` read the same as ``50G`` and ``50Gi``).

Matching rules (also in docs/protocol.md):

- ``k=v`` holds when label ``k`` is present and equal to ``v``; when both sides
  read as numbers they are compared as numbers (``80G`` equals
  ``80000000000``), otherwise as strings.
- ``k!=v`` holds when ``k`` is absent or not equal to ``v``.
- ``k>=v`` (and the other ordering operators) hold only when ``k`` is present
  and reads as a number; a label that is not a number never matches.

Sans-IO: no I/O and no Trio, so it is property-tested directly.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from fractions import Fraction
from typing import Final

import attrs

__all__ = [
    "Selector",
    "SelectorError",
    "Term",
    "parse_number",
    "parse_selector",
    "parse_size",
]

_DECIMAL_SUFFIXES: Final = {"K": 3, "k": 3, "M": 6, "G": 9, "T": 12, "P": 15}
_BINARY_SUFFIXES: Final = {"Ki": 10, "Mi": 20, "Gi": 30, "Ti": 40, "Pi": 50}
_SUFFIX_HELP: Final = "use K, M, G, T, P (powers of 1000) or Ki, Mi, Gi, Ti, Pi (powers of 1024)"

_NUMBER = re.compile(r"\s*([+-]?(?:\d+(?:\.\d*)?|\.\d+))\s*([A-Za-z]*)\s*")
_KEY = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.\-/]*")
# Longest operators first, so ">=" is not read as ">" followed by "=50G".
_OPERATORS: Final = ("!=", ">=", "<=", "==", "=", ">", "<")
_ORDERING: Final = frozenset({">=", "<=", ">", "<"})


class SelectorError(ValueError):
    """A selector or size could not be parsed; the message says what to write instead."""


def parse_number(text: str) -> Fraction:
    """Read ``text`` as an exact number, honouring size suffixes.

    ``"50G"`` is 50·10⁹, ``"1.5Ki"`` is 1536, ``"8"`` is 8. Raises
    :class:`SelectorError` for anything else.
    """
    m = _NUMBER.fullmatch(text)
    if m is None:
        raise SelectorError(f"{text!r} is not a number; write e.g. 8, 1.5, 50G or 50Gi")
    value = Fraction(m.group(1))
    suffix = m.group(2)
    if suffix.endswith("B") and suffix != "B":
        suffix = suffix[:-1]
    elif suffix == "B":
        suffix = ""
    if not suffix:
        return value
    if suffix in _DECIMAL_SUFFIXES:
        return value * Fraction(10) ** _DECIMAL_SUFFIXES[suffix]
    if suffix in _BINARY_SUFFIXES:
        return value * Fraction(2) ** _BINARY_SUFFIXES[suffix]
    raise SelectorError(f"{text!r}: unknown size suffix {m.group(2)!r}; {_SUFFIX_HELP}")


def parse_size(text: str) -> int:
    """Read a size in bytes (``"50G"``, ``"50Gi"``, ``"1048576"``) as an integer."""
    value = parse_number(text)
    if value.denominator != 1:
        raise SelectorError(f"{text!r} is not a whole number of bytes")
    return int(value)


def _try_number(text: str) -> Fraction | None:
    try:
        return parse_number(text)
    except SelectorError:
        return None


@attrs.frozen
class Term:
    """One ``key OP value`` condition."""

    key: str
    op: str
    value: str
    number: Fraction | None

    def matches(self, labels: Mapping[str, str]) -> bool:
        actual = labels.get(self.key)
        if self.op == "!=":
            return actual is None or not self._equal(actual)
        if actual is None:
            return False
        if self.op == "=":
            return self._equal(actual)
        have = _try_number(actual)
        if have is None or self.number is None:
            return False
        if self.op == ">=":
            return have >= self.number
        if self.op == "<=":
            return have <= self.number
        if self.op == ">":
            return have > self.number
        return have < self.number

    def _equal(self, actual: str) -> bool:
        if actual == self.value:
            return True
        have = _try_number(actual)
        return have is not None and self.number is not None and have == self.number

    def __str__(self) -> str:
        return f"{self.key}{self.op}{self.value}"


@attrs.frozen
class Selector:
    """A parsed selector: every term must hold. The empty selector matches everything."""

    terms: tuple[Term, ...] = ()

    def matches(self, labels: Mapping[str, str]) -> bool:
        return all(term.matches(labels) for term in self.terms)

    def __str__(self) -> str:
        return ",".join(str(t) for t in self.terms)


def _parse_term(raw: str) -> Term:
    text = raw.strip()
    if not text:
        raise SelectorError("empty term in selector (two commas in a row, or a trailing comma?)")
    found: tuple[int, str] | None = None
    for op in _OPERATORS:
        i = text.find(op)
        if i != -1 and (
            found is None or i < found[0] or (i == found[0] and len(op) > len(found[1]))
        ):
            found = (i, op)
    if found is None:
        raise SelectorError(
            f"selector term {text!r} has no operator; write key=value, key!=value, "
            "key>=50G, key<=..., key>... or key<..."
        )
    i, op = found
    key, value = text[:i].strip(), text[i + len(op) :].strip()
    if not _KEY.fullmatch(key):
        raise SelectorError(
            f"selector term {text!r}: {key!r} is not a label key "
            "(letters, digits, '_', '-', '.', '/'; e.g. disk_free_bytes or gpu0.product)"
        )
    if not value:
        raise SelectorError(f"selector term {text!r} has no value after {op!r}")
    if op == "==":
        op = "="
    number = _try_number(value)
    if op in _ORDERING and number is None:
        # Re-raise with the parser's own message: it names the bad suffix.
        try:
            parse_number(value)
        except SelectorError as e:
            raise SelectorError(f"selector term {text!r}: {e}") from None
    return Term(key=key, op=op, value=value, number=number)


def parse_selector(text: str | None) -> Selector:
    """Parse a selector; ``None`` and ``""`` give the selector that matches everything."""
    if text is None or not text.strip():
        return Selector()
    return Selector(tuple(_parse_term(part) for part in text.split(",")))
