"""Whether the port a URL's colon promises is one that can be asked (sans-IO).

``urllib`` and httpx both take an empty port as no port, so ``http://ftp://x`` is
host ``ftp`` on port 80 and ``http://h:/`` is ``h`` on port 80: a scheme or a port
went missing, and asking that host would only say it cannot be found, or reach the
wrong service. Port 0 cannot be connected to at all. The rule is here, in the core,
so that the config loader refuses such a ``controller_url`` at load, naming the key
and its line, with the same rule as ``rc`` and ``rc-worker status`` apply to what
is typed (:mod:`rc_worker.http_input`).
"""

from __future__ import annotations

from urllib.parse import urlsplit

__all__ = ["port_problem"]


def port_problem(url: str) -> str | None:
    """Why the port ``url`` names cannot be asked (a ``:`` after the host with no number
    after it, or port 0), or None; the caller adds what to give instead.

    A URL that does not parse, or whose port is not a number of 0 to 65535, is None
    here: that is the URL parser's to name, in its own words.
    """
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError:
        return None
    hostport = parts.netloc.rpartition("@")[2]
    if hostport.endswith(":"):
        return f"{url!r} has no port number after {hostport!r}"
    if port == 0:
        return f"{url!r} names port 0"
    return None
