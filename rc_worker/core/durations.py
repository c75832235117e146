"""Durations and sizes as people write them in config files and on the command line.

Sans-IO and dependency-free: used by the config loader, the CLI and the
controller's selectors alike.
"""

from __future__ import annotations

import math
import re
from decimal import Decimal

_UNIT_SECONDS = {
    "ns": 1e-9,
    "us": 1e-6,
    "\u00b5s": 1e-6,  # micro sign, as Go accepts
    "\u03bcs": 1e-6,  # Greek small letter mu, as Go accepts
    "ms": 1e-3,
    "s": 1.0,
    "m": 60.0,
    "h": 3600.0,
    "d": 86400.0,  # not in Go; a day is always 24h here (no calendar, no DST)
}
_PART = re.compile(r"(\d+(?:\.\d*)?|\.\d+)(ns|us|\u00b5s|\u03bcs|ms|s|m|h|d)")
# A bare number of seconds: plain decimal notation, optionally with an
# exponent. Stricter than float(), which would also take "1_000", "nan", "inf".
_SECONDS = re.compile(r"(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][+-]?\d+)?")

DURATION_HELP = "a number of seconds or a Go-style duration such as 500ms, 10s, 1m30s, 2h or 1d"


def parse_duration(value: str | int | float) -> float:
    """Return ``value`` in seconds.

    Accepts a number of seconds (``90``, ``0.5``, ``"90"``) or a Go-style
    string (``"500ms"``, ``"1m30s"``, ``"2h"``), plus ``d`` for days of 24
    hours (``"1d12h"``). Negative, non-finite and malformed values raise
    ``ValueError`` with a message naming the fix.
    """
    if isinstance(value, bool):
        raise ValueError(f"{value!r} is not a duration; expected {DURATION_HELP}")
    if isinstance(value, int | float):
        try:
            seconds = float(value)
        except OverflowError:  # an int too large for a float
            seconds = math.inf
    elif isinstance(value, str):
        seconds = _parse_duration_text(value.strip())
    else:
        raise ValueError(f"{value!r} is not a duration; expected {DURATION_HELP}")
    if not math.isfinite(seconds):
        raise ValueError(f"{value!r} is not a finite duration; expected {DURATION_HELP}")
    if seconds < 0:
        raise ValueError(f"{value!r} is negative; expected {DURATION_HELP}, zero or more")
    return seconds


def _parse_duration_text(text: str) -> float:
    if not text:
        raise ValueError(f"an empty string is not a duration; expected {DURATION_HELP}")
    if text.startswith("-"):
        raise ValueError(f"{text!r} is negative; expected {DURATION_HELP}, zero or more")
    if text.startswith("+"):  # Go accepts a leading plus sign
        text = text[1:]
    if _SECONDS.fullmatch(text):
        return float(text)
    pos = 0
    total = 0.0
    for match in _PART.finditer(text):
        if match.start() != pos:
            break
        total += float(match.group(1)) * _UNIT_SECONDS[match.group(2)]
        pos = match.end()
    if pos != len(text) or pos == 0:
        raise ValueError(f"{text!r} is not a duration; expected {DURATION_HELP}")
    return total


def format_duration(seconds: float) -> str:
    """A compact human form of ``seconds`` (``1m30s``, ``500ms``), for logs and tables.

    Six significant digits at most per part; whatever it returns for a finite
    ``seconds`` >= 0, ``parse_duration`` reads back (to within that rounding).
    """
    if not math.isfinite(seconds):
        return str(seconds)
    if seconds < 0:
        return "-" + format_duration(-seconds)
    if seconds == 0:
        return "0s"
    if seconds < 1:
        for unit, factor in (("ms", 1e3), ("us", 1e6)):
            if seconds * factor >= 1:
                return _number(seconds * factor) + unit
        return _number(seconds * 1e9) + "ns"
    whole = int(seconds)
    frac = seconds - whole
    hours, rest = divmod(whole, 3600)
    minutes, secs = divmod(rest, 60)
    out = ""
    if hours:
        out += f"{hours}h"
    if minutes:
        out += f"{minutes}m"
    tail = _number(secs + frac)
    if tail != "0" or not out:
        out += f"{tail}s"
    return out


def _number(value: float) -> str:
    """``value`` to six significant digits, never in exponent notation."""
    text = f"{value:.6g}"
    if "e" in text:
        text = f"{value:.12f}".rstrip("0").rstrip(".") or "0"
    return text


_SIZE = re.compile(r"(\d+(?:\.\d*)?)\s*([KMGTPE]i?)?B?", re.IGNORECASE)
_SIZE_FACTORS = {
    "": 1,
    "k": 10**3,
    "m": 10**6,
    "g": 10**9,
    "t": 10**12,
    "p": 10**15,
    "e": 10**18,
    "ki": 2**10,
    "mi": 2**20,
    "gi": 2**30,
    "ti": 2**40,
    "pi": 2**50,
    "ei": 2**60,
}

SIZE_HELP = "a number of bytes, optionally with a suffix: 50G = 50·10⁹, 50Gi = 50·2³⁰"


def parse_size(value: str | int | float) -> int:
    """Return ``value`` in bytes: ``1234``, ``"50G"`` (10⁹) or ``"50Gi"`` (2³⁰)."""
    if isinstance(value, bool):
        raise ValueError(f"{value!r} is not a size; expected {SIZE_HELP}")
    if isinstance(value, float) and value.is_integer():
        value = int(value)  # 5e9 written as a YAML float
    if isinstance(value, int):
        if value < 0:
            raise ValueError(f"{value!r} is negative; expected {SIZE_HELP}")
        return int(value)
    if not isinstance(value, str):
        raise ValueError(f"{value!r} is not a size; expected {SIZE_HELP}")
    match = _SIZE.fullmatch(value.strip())
    if match is None:
        raise ValueError(f"{value!r} is not a size; expected {SIZE_HELP}")
    suffix = (match.group(2) or "").lower()
    size = Decimal(match.group(1)) * _SIZE_FACTORS[suffix]
    if not suffix and size != size.to_integral_value():
        raise ValueError(f"{value!r} is not a whole number of bytes; expected {SIZE_HELP}")
    # A fraction of a suffixed unit ("1.5Gi") rounds down to whole bytes.
    return int(size)


def coarse_bytes(n: int, digits: int = 3) -> int:
    """``n`` rounded down to its first ``digits`` significant digits (72,345,678,901 →
    72,300,000,000): never more than there is, and within 1 % of it.

    For a fact that moves all the time: the worker sends labels only when they change,
    and free disk space exact to the byte changed at every probe pass, so every pass of
    every host cost the controller a labels write.
    """
    if n <= 0:
        return 0
    step: int = 10 ** max(len(str(n)) - digits, 0)
    return n - n % step
