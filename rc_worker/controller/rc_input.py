"""What ``rc`` checks of its own input before it sends anything (sans-IO).

A controller URL, a user token and the ids that go into a request's path come from
people (a flag, an environment variable, a pasted id). Each is checked here so that a
mistake is one line naming it and its fix, exit status 2 (bad usage), rather than an
HTTP library's traceback, a "cannot reach the controller" (exit 3) that sends people
looking at the network, or a request to some other path than the one meant.
"""

from __future__ import annotations

from urllib.parse import quote

from rc_worker import http_input

__all__ = ["path_segment", "token_problem", "url_problem"]

URL_HELP = "give the controller's URL, e.g. http://127.0.0.1:8080"


def url_problem(url: str, what: str = "controller", fix: str = URL_HELP) -> str | None:
    """Why ``url`` cannot be a controller's URL (or a ``what`` URL, with ``fix``), or None:
    the checks httpx would fail later (and how), made now (:mod:`rc_worker.http_input`)."""
    return http_input.url_problem(url, what, fix)


def token_problem(token: str) -> str | None:
    """Why the user ``token`` cannot be sent as ``Authorization: Bearer TOKEN``, or None
    (:mod:`rc_worker.http_input`)."""
    return http_input.token_problem(
        token,
        "user token",
        "give the token exactly as rc serve was given it (--token or RC_USER_TOKEN)",
    )


_LISTED_BY = {"job id": " (rc ps lists them)", "host": " (rc devices lists them)"}


def path_segment(what: str, text: str) -> str:
    """``text`` (a job id, a host or a device name) as one segment of a request path.

    Percent-encoded, so that ``?``, ``#`` or ``%`` in it name that very thing rather
    than start a query or a fragment, and ``.``/``..`` are not folded into the path
    above it. Raises ``ValueError`` (naming ``what``) for an empty one, or one with
    ``/`` in it, which no job, host or device has.
    """
    listed = _LISTED_BY.get(what, "")
    if not text:
        raise ValueError(f"the {what} is empty; give one{listed}")
    if "/" in text:
        raise ValueError(f"{what} {text!r} has '/' in it, which no {what} has{listed}")
    if text.strip(".") == "":
        return text.replace(".", "%2E")
    return quote(text, safe="")
