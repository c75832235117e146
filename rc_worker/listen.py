"""Whether an address can be listened on, asked before a server starts.

hypercorn's bind error arrives as a bare ``OSError`` from inside its nursery, wrapped in
exception groups, with its half-made socket unclosed: an operator would read a
traceback for "the port is taken". Both servers (``rc serve``, the worker's
``status_listen``) try the address first and turn a failure into one line.
"""

from __future__ import annotations

import socket


def bind_problem(listen: str) -> str | None:
    """Why ``HOST:PORT`` cannot be bound now (``cannot listen on …``), or None.

    Bound with ``SO_REUSEADDR`` as the server will be, then closed at once: a port
    held by another listener fails here, one in TIME_WAIT does not. Port 0 always works.
    """
    host, _, port = listen.rpartition(":")
    host = host.strip("[]")
    try:
        if not 0 <= int(port) <= 65535:
            # getaddrinfo takes 99999 and hands back its value modulo 65536.
            raise ValueError("the port must be 0 to 65535")
        infos = socket.getaddrinfo(host, int(port), type=socket.SOCK_STREAM)
        family, kind, proto, _, address = infos[0]
        with socket.socket(family, kind, proto) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            probe.bind(address)
    except (OSError, ValueError) as e:
        reason = e.strerror if isinstance(e, OSError) and e.strerror else str(e)
        return f"cannot listen on {listen} ({reason})"
    return None
