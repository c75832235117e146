"""``http_input``: the URL and token checks ``rc`` and ``rc-worker status`` share."""

from __future__ import annotations

import pytest

from rc_worker.core import tokens
from rc_worker.http_input import token_problem, url_problem


def test_the_token_rule_is_the_cores() -> None:
    # One rule for what rc and rc-worker status are given and what the config loader
    # reads (tests/test_tokens.py checks it).
    assert token_problem is tokens.token_problem


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
        # Were taken: host "ftp" (or "h") on the scheme's port.
        ("http://ftp://x", "'http://ftp://x' has no port number after 'ftp:'; fix"),
        ("http://h:/status", "'http://h:/status' has no port number after 'h:'; fix"),
        ("https://u:pw@[::1]:", "'https://u:pw@[::1]:' has no port number after '[::1]:'; fix"),
        ("http://h:70000", "'http://h:70000' is not a worker status URL; fix (Port out of range"),
    ],
)
def test_what_is_not_an_http_url_is_named(url: str, problem: str) -> None:
    got = url_problem(url, "worker status", "fix")
    assert got is not None
    assert got.startswith(problem)
