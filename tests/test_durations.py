"""Durations and sizes: the Go-style forms people write, and the errors for everything else."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from rc_worker.core.durations import (
    DURATION_HELP,
    SIZE_HELP,
    coarse_bytes,
    format_duration,
    parse_duration,
    parse_size,
)

# --- parse_duration ---------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "seconds"),
    [
        (0, 0.0),
        (90, 90.0),
        (0.5, 0.5),
        ("90", 90.0),
        ("0.25", 0.25),
        (".5", 0.5),
        ("1e3", 1000.0),
        (" 10s ", 10.0),
        ("+5s", 5.0),
        ("0", 0.0),
        ("0s", 0.0),
        ("500ms", 0.5),
        ("10s", 10.0),
        ("1m30s", 90.0),
        ("2h", 7200.0),
        ("1h2m3s", 3723.0),
        ("1.5h", 5400.0),
        ("1.s", 1.0),
        ("1h0m0.5s", 3600.5),
        ("250us", 250e-6),
        ("250\u00b5s", 250e-6),  # micro sign
        ("250\u03bcs", 250e-6),  # Greek mu: Go accepts both
        ("100ns", 100e-9),
        ("3s500ms", 3.5),
        ("1d", 86400.0),
        ("1d12h", 129600.0),
        ("0.5d", 43200.0),
    ],
)
def test_parse_duration_accepts(text: str | float, seconds: float) -> None:
    assert parse_duration(text) == pytest.approx(seconds)


@pytest.mark.parametrize(
    ("value", "fragment"),
    [
        ("", "an empty string is not a duration"),
        ("   ", "an empty string is not a duration"),
        ("10x", "'10x' is not a duration"),
        ("s", "'s' is not a duration"),
        ("1m 30s", "'1m 30s' is not a duration"),
        ("10S", "'10S' is not a duration"),
        ("ten seconds", "is not a duration"),
        ("1_000", "'1_000' is not a duration"),
        ("nan", "'nan' is not a duration"),
        ("inf", "'inf' is not a duration"),
        ("0x10", "'0x10' is not a duration"),
        ("1w", "'1w' is not a duration"),
        ("1D", "'1D' is not a duration"),
        ("-5", "'-5' is negative"),
        ("-5s", "'-5s' is negative"),
        (-1, "-1 is negative"),
        (-0.5, "-0.5 is negative"),
        (math.inf, "is not a finite duration"),
        (math.nan, "is not a finite duration"),
        (10**400, "is not a finite duration"),
        (True, "True is not a duration"),
        (None, "None is not a duration"),
        ([1], "[1] is not a duration"),
    ],
)
def test_parse_duration_rejects(value: object, fragment: str) -> None:
    with pytest.raises(ValueError, match="expected") as info:
        parse_duration(value)  # type: ignore[arg-type]
    assert fragment in str(info.value)
    assert DURATION_HELP in str(info.value)


# --- format_duration ----------------------------------------------------------


@pytest.mark.parametrize(
    ("seconds", "text"),
    [
        (0, "0s"),
        (0.5, "500ms"),
        (0.00025, "250us"),
        (1e-7, "100ns"),
        (1.5, "1.5s"),
        (59, "59s"),
        (60, "1m"),
        (90, "1m30s"),
        (3600, "1h"),
        (3723, "1h2m3s"),
        (7200.5, "2h0.5s"),
        (-5, "-5s"),
    ],
)
def test_format_duration(seconds: float, text: str) -> None:
    assert format_duration(seconds) == text


@given(st.floats(min_value=0, max_value=1e10, allow_nan=False, allow_infinity=False))
def test_format_then_parse_round_trips(seconds: float) -> None:
    text = format_duration(seconds)
    assert "e" not in text  # never exponent notation: parse_duration rejects "1e-07ms"
    # Six significant digits per part, and nothing below a fraction of a nanosecond.
    assert parse_duration(text) == pytest.approx(seconds, rel=1e-5, abs=1e-9)


_UNITS = {"h": 3600.0, "m": 60.0, "s": 1.0, "ms": 1e-3, "us": 1e-6, "µs": 1e-6, "ns": 1e-9}


@given(
    st.lists(
        st.tuples(
            st.one_of(
                st.integers(min_value=0, max_value=10_000).map(str),
                st.decimals(min_value=0, max_value=10_000, places=3, allow_nan=False).map(
                    lambda d: f"{d:f}"
                ),
            ),
            st.sampled_from(sorted(_UNITS)),
        ),
        min_size=1,
        max_size=6,
    )
)
def test_go_style_parts_parse_to_their_sum(parts: list[tuple[str, str]]) -> None:
    text = "".join(number + unit for number, unit in parts)
    expected = sum(float(number) * _UNITS[unit] for number, unit in parts)
    assert parse_duration(text) == pytest.approx(expected, rel=1e-9, abs=1e-12)


@given(st.floats(min_value=0, max_value=1e12, allow_nan=False, allow_infinity=False))
def test_numbers_are_seconds(seconds: float) -> None:
    assert parse_duration(seconds) == seconds
    assert parse_duration(repr(seconds)) == seconds


# --- parse_size ---------------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "size"),
    [
        (0, 0),
        (1234, 1234),
        (5e9, 5_000_000_000),
        ("1234", 1234),
        ("50G", 50 * 10**9),
        ("50GB", 50 * 10**9),
        ("50g", 50 * 10**9),
        ("50Gi", 50 * 2**30),
        ("50GiB", 50 * 2**30),
        ("1.5K", 1500),
        ("1.5Ki", 1536),
        ("1.3Gi", int(1.3 * 2**30)),  # a fraction of a unit rounds down to whole bytes
        ("2T", 2 * 10**12),
        ("10 Mi", 10 * 2**20),
    ],
)
def test_parse_size_accepts(value: str | int, size: int) -> None:
    result = parse_size(value)
    assert result == size
    assert type(result) is int


@pytest.mark.parametrize(
    ("value", "fragment"),
    [
        ("50X", "'50X' is not a size"),
        ("", "'' is not a size"),
        ("G", "'G' is not a size"),
        ("-1G", "'-1G' is not a size"),
        (-1, "-1 is negative"),
        ("1.5", "'1.5' is not a whole number of bytes"),
        (1.5, "1.5 is not a size"),
        (True, "True is not a size"),
        (None, "None is not a size"),
    ],
)
def test_parse_size_rejects(value: object, fragment: str) -> None:
    with pytest.raises(ValueError, match="expected") as info:
        parse_size(value)  # type: ignore[arg-type]
    assert fragment in str(info.value)
    assert SIZE_HELP in str(info.value)


@given(st.integers(min_value=0, max_value=10**6), st.sampled_from(["K", "M", "G", "T"]))
def test_binary_suffix_is_a_power_of_two(n: int, suffix: str) -> None:
    power = {"K": 10, "M": 20, "G": 30, "T": 40}[suffix]
    assert parse_size(f"{n}{suffix}i") == n * 2**power
    assert parse_size(f"{n}{suffix}") == n * 10 ** (power // 10 * 3)


@given(st.integers(min_value=0, max_value=10**15))
def test_coarse_bytes_never_claims_more_and_stays_within_one_percent(n: int) -> None:
    c = coarse_bytes(n)
    assert 0 <= c <= n
    assert n - c < max(n / 100, 1)
    assert coarse_bytes(c) == c  # already coarse: a steady disk sends no new label


def test_coarse_bytes_keeps_three_significant_digits() -> None:
    assert coarse_bytes(84_563_259_392) == 84_500_000_000
    assert coarse_bytes(84_563_210_240) == 84_500_000_000  # a few MB later: the same label
    assert coarse_bytes(999) == 999
    assert coarse_bytes(72_000_000_000) == 72_000_000_000
