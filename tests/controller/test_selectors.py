from __future__ import annotations

from fractions import Fraction

import pytest
from hypothesis import given
from hypothesis import strategies as st

from rc_worker.core.selectors import (
    SelectorError,
    parse_number,
    parse_selector,
    parse_size,
)

DECIMAL = {"K": 10**3, "M": 10**6, "G": 10**9, "T": 10**12, "P": 10**15}
BINARY = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50}


@given(n=st.integers(0, 10**6), suffix=st.sampled_from(sorted({**DECIMAL, **BINARY})))
def test_size_suffixes(n: int, suffix: str) -> None:
    factor = {**DECIMAL, **BINARY}[suffix]
    assert parse_size(f"{n}{suffix}") == n * factor
    assert parse_size(f"{n}{suffix}B") == n * factor


@given(n=st.integers(0, 10**18))
def test_plain_numbers_are_bytes(n: int) -> None:
    assert parse_size(str(n)) == n


@given(n=st.integers(0, 10**6), suffix=st.sampled_from(sorted(DECIMAL)))
def test_ordering_agrees_with_integer_comparison(n: int, suffix: str) -> None:
    threshold = n * DECIMAL[suffix]
    sel = parse_selector(f"disk_free_bytes>={n}{suffix}")
    assert sel.matches({"disk_free_bytes": str(threshold)})
    assert not sel.matches({"disk_free_bytes": str(threshold - 1)})
    assert parse_selector(f"x<{n}{suffix}").matches({"x": str(threshold - 1)})
    assert not parse_selector(f"x>{n}{suffix}").matches({"x": str(threshold)})
    assert parse_selector(f"x<={n}{suffix}").matches({"x": str(threshold)})


def test_decimal_and_binary_differ() -> None:
    fifty_g = {"m": str(50 * 10**9)}
    assert parse_selector("m>=50G").matches(fifty_g)
    assert not parse_selector("m>=50Gi").matches(fifty_g)


def test_fractions_and_float_labels() -> None:
    assert parse_number("1.5Ki") == 1536
    assert parse_number("0.5") == Fraction(1, 2)
    assert parse_selector("compute_capability>=8.0").matches({"compute_capability": "9.0"})
    assert not parse_selector("compute_capability>=8.0").matches({"compute_capability": "7.5"})


def test_equality_strings_and_numbers() -> None:
    assert parse_selector("product=H100").matches({"product": "H100"})
    assert not parse_selector("product=H100").matches({"product": "A100"})
    assert not parse_selector("product=H100").matches({})
    assert parse_selector("mem=80G").matches({"mem": "80000000000"})
    assert parse_selector("product==H100").matches({"product": "H100"})
    assert parse_selector("name=NVIDIA H100 80GB").matches({"name": "NVIDIA H100 80GB"})


def test_not_equal_matches_absent() -> None:
    sel = parse_selector("product!=A100")
    assert sel.matches({})
    assert sel.matches({"product": "H100"})
    assert not sel.matches({"product": "A100"})


def test_comma_is_and() -> None:
    sel = parse_selector("disk_free_bytes>=50G, product=H100")
    assert sel.matches({"disk_free_bytes": "60000000000", "product": "H100"})
    assert not sel.matches({"disk_free_bytes": "60000000000", "product": "A100"})
    assert not sel.matches({"disk_free_bytes": "6", "product": "H100"})


def test_ordering_on_non_numbers_never_matches() -> None:
    assert not parse_selector("x>=5").matches({"x": "lots"})
    assert not parse_selector("x>=5").matches({})


def test_empty_selector_matches_everything() -> None:
    assert parse_selector("").matches({})
    assert parse_selector(None).matches({"a": "b"})
    assert str(parse_selector("")) == ""


def test_device_scoped_keys() -> None:
    assert parse_selector("gpu0.memory_total_bytes>80Gi").matches(
        {"gpu0.memory_total_bytes": str(81 * 2**30)}
    )


def test_round_trip() -> None:
    text = "a>=50G,b!=x,c=d,e<1Ki,f<=2,g>3"
    assert str(parse_selector(text)) == text
    assert parse_selector(str(parse_selector(text))) == parse_selector(text)


@pytest.mark.parametrize(
    ("text", "fragment"),
    [
        ("x>=5Q", "unknown size suffix 'Q'"),
        ("x>=lots", "is not a number"),
        ("product", "has no operator"),
        ("a=1,,b=2", "empty term"),
        ("a=1,", "empty term"),
        ("=5", "is not a label key"),
        ("a b=5", "is not a label key"),
        ("x>=", "has no value"),
    ],
)
def test_errors_say_what_to_write(text: str, fragment: str) -> None:
    with pytest.raises(SelectorError, match=fragment):
        parse_selector(text)


def test_size_errors() -> None:
    with pytest.raises(SelectorError, match="whole number of bytes"):
        parse_size("1.5")
    with pytest.raises(SelectorError, match="Ki, Mi, Gi"):
        parse_size("3Q")
