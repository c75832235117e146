"""Whether a bearer token can be sent at all (sans-IO).

Every token this project sends goes in ``Authorization: Bearer TOKEN``: the worker's
to the controller, ``status_token`` to a worker's status endpoint, a user's from ``rc``.
The rule is here, in the core, so that the config loader can refuse a token at load,
where it names the key and its line, with the same rule as ``rc`` and
``rc-worker status`` apply to what is typed (:mod:`rc_worker.http_input`).
"""

from __future__ import annotations

__all__ = ["token_problem"]


def token_problem(token: str, what: str, fix: str) -> str | None:
    """Why ``token`` (the ``what``) cannot be sent as ``Authorization: Bearer TOKEN``, or None.

    An HTTP header carries visible ASCII: a token with a newline (from ``$(cat file)``
    of a file written on another system, say) or a non-ASCII letter cannot be sent at
    all, so nothing at the other end could accept it. A space is refused too: a bearer
    token has none (RFC 6750), and one in the middle is a paste of two things.
    """
    for c in token:
        if not (" " < c < "\x7f"):
            shown = f"character {c!r}" if c.isprintable() else f"{c!r}"
            return f"the {what} has {shown} in it, which cannot be sent in an HTTP header; {fix}"
    return None
