"""``http_input``: the URL and token checks ``rc`` and ``rc-worker status`` share."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from rc_worker.http_input import token_problem, url_problem

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


@pytest.mark.parametrize(
    "url", ["http://127.0.0.1:9100", "https://rc.example/base", "http://[::1]:8080"]
)
def test_an_http_url_is_taken(url: str) -> None:
    assert url_problem(url, "worker status", "fix") is None


@pytest.mark.parametrize(
    ("url", "problem"),
    [
        ("ftp://x", "'ftp://x' is not a worker status URL; fix"),
        (" ", "the worker status URL is empty; fix"),
        ("http://h:0", "'http://h:0' names port 0; fix"),
        ("http://h:70000", "'http://h:70000' is not a worker status URL; fix (Port out of range"),
    ],
)
def test_what_is_not_an_http_url_is_named(url: str, problem: str) -> None:
    got = url_problem(url, "worker status", "fix")
    assert got is not None
    assert got.startswith(problem)
