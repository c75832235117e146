"""Checks of what people give that goes into an HTTP request: a URL and a bearer token.

Shared by ``rc`` (:mod:`rc_worker.controller.rc_input`, with its own wording) and
``rc-worker status``, so that a mistake is one line naming it and its fix, exit status 2,
before anything is sent, rather than an HTTP library's error reported as a failure to
reach the other end. Sans-IO; not in :mod:`rc_worker.core` because the URL check is
httpx's own parser (what httpx would refuse later is refused now, in the same words).
"""

from __future__ import annotations

from urllib.parse import urlsplit

import httpx

__all__ = ["token_problem", "url_problem"]


def url_problem(url: str, what: str, fix: str) -> str | None:
    """Why ``url`` cannot be a ``what`` URL (``http://`` or ``https://`` with a host, a port
    of 1 to 65535, no white space), or None; ``fix`` says what to give instead."""
    bad = f"{url!r} is not a {what} URL; {fix}"
    if not url.strip():
        return f"the {what} URL is empty; {fix}"
    try:
        parts = urlsplit(url)
        port = parts.port  # raises for a port that is not a number of 0 to 65535
        parsed = httpx.URL(url)
    except (ValueError, httpx.InvalidURL) as e:
        return f"{bad} ({e})"
    if parts.scheme not in ("http", "https") or not parsed.host:
        return bad
    if port == 0:
        return f"{url!r} names port 0; {fix}"
    if any(c.isspace() for c in url):
        return f"{url!r} has white space in it; {fix}"
    return None


def token_problem(token: str, what: str, fix: str) -> str | None:
    """Why ``token`` (the ``what``) cannot be sent as ``Authorization: Bearer TOKEN``, or None.

    An HTTP header carries visible ASCII: a token with a newline (from ``$(cat file)``
    of a file written on another system, say) or a non-ASCII letter cannot be sent at
    all, so nothing at the other end could accept it.
    """
    for c in token:
        if not (" " < c < "\x7f"):
            shown = f"character {c!r}" if c.isprintable() else f"{c!r}"
            return f"the {what} has {shown} in it, which cannot be sent in an HTTP header; {fix}"
    return None
