"""The fault-injecting transport's endpoint table, and its faults' printed form."""

from __future__ import annotations

import re

from hypothesis import given
from hypothesis import strategies as st

from rc_worker.testing.transport import ENDPOINTS, Fault, endpoint_of

SEGMENTS = st.sampled_from(
    ["", "v1", "v2", "hosts", "jobs", "devices", "h0", "j-1", "gpu0", "x/y", *ENDPOINTS]
)


def by_pattern(path: str) -> str:
    return next((name for name, p in ENDPOINTS.items() if p.match(path)), "other")


@given(st.lists(SEGMENTS, min_size=1, max_size=7))
def test_endpoint_of_agrees_with_the_endpoint_patterns(parts: list[str]) -> None:
    path = "/" + "/".join(parts)
    assert endpoint_of(path) == by_pattern(path)


def test_every_endpoint_is_found() -> None:
    for name, pattern in ENDPOINTS.items():
        path = re.sub(r"\[\^/\]\+", "id-1", pattern.pattern.strip("^$"))
        assert endpoint_of(path) == name, path


def test_a_faults_repr_is_the_python_that_names_it() -> None:
    for fault in Fault:
        assert eval(repr(fault), {"Fault": Fault}) is fault
