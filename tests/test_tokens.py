"""``core.tokens``: what bearer token can be sent at all."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from rc_worker.core.tokens import token_problem

VISIBLE = "".join(chr(c) for c in range(0x21, 0x7F))


@given(st.text())
def test_a_token_can_be_sent_exactly_when_it_is_visible_ascii(token: str) -> None:
    problem = token_problem(token, "status token", "give it as the config has it")
    assert (problem is None) == all(c in VISIBLE for c in token)
    if problem is not None:
        assert problem.startswith("the status token has ")
        assert problem.endswith("; give it as the config has it")
        assert "\n" not in problem  # one line, whatever the token holds


@given(st.text(alphabet=VISIBLE))
def test_a_visible_ascii_token_is_taken(token: str) -> None:
    assert token_problem(token, "user token", "fix") is None
