"""Checks of what people give that goes into an HTTP request: a URL and a bearer token.

Shared by ``rc`` (:mod:`rc_worker.controller.rc_input`, with its own wording) and
``rc-worker status``, so that a mistake is one line naming it and its fix, exit status 2,
before anything is sent, rather than an HTTP library's error reported as a failure to
reach the other end. Sans-IO; not in :mod:`rc_worker.core` because the URL check is
httpx's own parser (what httpx would refuse later is refused now, in the same words).
The token rule is the core's (:mod:`rc_worker.core.tokens`, which the config loader
applies to the tokens in a worker's config), re-exported here; so is the rule for a
URL's port (:mod:`rc_worker.core.urls`, which it applies to ``controller_url``).
"""

from __future__ import annotations

from urllib.parse import urlsplit

import httpx

from rc_worker.core.tokens import token_problem
from rc_worker.core.urls import port_problem

__all__ = ["token_problem", "url_problem"]


def url_problem(url: str, what: str, fix: str) -> str | None:
    """Why ``url`` cannot be a ``what`` URL (``http://`` or ``https://`` with a host, a port
    of 1 to 65535 if a ``:`` says there is one, no white space), or None; ``fix`` says what
    to give instead."""
    bad = f"{url!r} is not a {what} URL; {fix}"
    if not url.strip():
        return f"the {what} URL is empty; {fix}"
    try:
        parts = urlsplit(url)
        _ = parts.port  # raises for a port that is not a number of 0 to 65535
        parsed = httpx.URL(url)
    except (ValueError, httpx.InvalidURL) as e:
        return f"{bad} ({e})"
    if parts.scheme not in ("http", "https") or not parsed.host:
        return bad
    # An empty port (http://ftp://x is host "ftp" on port 80 to both parsers) or port 0:
    # the core's rule, which the config loader applies to controller_url too.
    problem = port_problem(url)
    if problem:
        return f"{problem}; {fix}"
    if any(c.isspace() for c in url):
        return f"{url!r} has white space in it; {fix}"
    return None
