"""The one JSON decoder for untrusted input: its depth limit, whatever the text looks like."""

from __future__ import annotations

import json
import math
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from rc_worker.core.boundedjson import JsonTooDeep, NotFinite, depth, loads

# Strings full of brackets: the decoder counts brackets to skip walking a shallow
# document, and those inside strings must not change the answer either way.
TEXT = st.text(alphabet='[]{}ab"\\', max_size=8)
VALUES = st.recursive(
    st.none() | st.integers(-9, 9) | TEXT,
    lambda c: st.lists(c, max_size=3) | st.dictionaries(TEXT, c, max_size=3),
    max_leaves=20,
)


@given(VALUES, st.integers(0, 6))
def test_loads_refuses_exactly_what_nests_deeper_than_allowed(value: Any, limit: int) -> None:
    text = json.dumps(value)
    if depth(value) > limit:
        with pytest.raises(JsonTooDeep):
            loads(text, max_depth=limit)
    else:
        assert loads(text, max_depth=limit) == value


def test_a_scalar_has_no_depth_and_each_container_adds_one() -> None:
    assert depth(3) == 0
    assert depth([]) == depth({}) == 1
    assert depth({"a": [1, {"b": []}]}) == 4
    assert depth([[[[1]]], [2]]) == 4


def _places(value: Any, path: tuple[str | int, ...] = ()) -> list[tuple[str | int, ...]]:
    """Every path to a value inside ``value`` (itself included)."""
    out = [path]
    if isinstance(value, dict):
        for k, v in value.items():
            out += _places(v, (*path, k))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            out += _places(v, (*path, i))
    return out


def _put(value: Any, path: tuple[str | int, ...], new: Any) -> Any:
    if not path:
        return new
    head, rest = path[0], path[1:]
    if isinstance(value, dict):
        return {**value, head: _put(value[head], rest, new)}
    return [_put(v, rest, new) if i == head else v for i, v in enumerate(value)]


@given(VALUES, st.data(), st.sampled_from([math.nan, math.inf, -math.inf, "1e999"]))
def test_a_non_finite_number_is_refused_with_the_path_to_it(
    value: Any, data: st.DataObject, bad: float | str
) -> None:
    path = data.draw(st.sampled_from(_places(value)))
    # Where a value is replaced by one non-finite number, that place is the one named.
    marker = 123456789.5
    text = json.dumps(_put(value, path, marker)).replace("123456789.5", "1e999")
    if bad != "1e999":
        text = json.dumps(_put(value, path, bad))
    with pytest.raises(NotFinite) as refused:
        loads(text)
    assert refused.value.path == path
