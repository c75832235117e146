"""The one JSON decoder for untrusted input: its depth limit, whatever the text looks like."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from rc_worker.core.boundedjson import JsonTooDeep, depth, loads

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
