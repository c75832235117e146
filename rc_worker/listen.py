"""Listening on an address: asked before a server starts, and bound for hypercorn.

hypercorn's bind error arrives as a bare ``OSError`` from inside its nursery, wrapped in
exception groups, with its half-made socket unclosed: an operator would read a
traceback for "the port is taken", and a ``ResourceWarning: unclosed socket`` came later.
Both servers (``rc serve``, the worker's ``status_listen``) try the address first and turn
a failure into one line (:func:`bind_problem`); and they bind the socket themselves
(:func:`serve_asgi`), so that an address taken between that check and the bind is a
:class:`CannotListen` with the same line, and no socket is left open whatever happens.
"""

from __future__ import annotations

import copy
import os
import socket
from collections.abc import Awaitable, Callable
from typing import Any

import trio
from hypercorn.config import Config as HypercornConfig
from hypercorn.trio import serve as hypercorn_serve


class CannotListen(OSError):
    """A server could not bind its address; the message is :func:`bind_problem`'s line
    (``cannot listen on ADDRESS (REASON)``), the bind's own error is the cause."""


def _reason(e: OSError | ValueError) -> str:
    return e.strerror if isinstance(e, OSError) and e.strerror else str(e)


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
        return f"cannot listen on {listen} ({_reason(e)})"
    return None


def listening_socket(listen: str, backlog: int) -> socket.socket:
    """A TCP socket bound to ``HOST:PORT`` and listening, non-blocking, set up as
    hypercorn 0.18 sets up its own (``Config._create_sockets``: the family from the host,
    ``TCP_NODELAY``, ``SO_REUSEADDR``); :class:`CannotListen` if it cannot be, with the
    socket closed (hypercorn's stays open until collected)."""
    host, _, port = listen.rpartition(":")
    host = host.replace("[", "").replace("]", "")
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if not 0 <= int(port) <= 65535:
            raise ValueError("the port must be 0 to 65535")
        sock.bind((host, int(port)))
        sock.listen(backlog)
        sock.setblocking(False)
    except (OSError, ValueError) as e:
        sock.close()
        raise CannotListen(f"cannot listen on {listen} ({_reason(e)})") from e
    return sock


async def serve_asgi(
    app: Any,
    config: HypercornConfig,
    *,
    shutdown_trigger: Callable[[], Awaitable[None]] | None = None,
    task_status: trio.TaskStatus[list[str]] = trio.TASK_STATUS_IGNORED,
) -> None:
    """``hypercorn.trio.serve(app, config)`` for a ``config.bind`` of one ``HOST:PORT``, on a
    socket bound here (:func:`listening_socket`) and closed here, whatever happens.

    hypercorn serves a socket it did not bind through its documented ``fd://N`` bind
    (public configuration, unlike its internal ``worker_serve(sockets=...)``): it gets a
    duplicate of this socket's descriptor, so each side closes only its own, hypercorn
    when it stops and this function on the way out.
    """
    (listen,) = config.bind
    with listening_socket(listen, config.backlog) as sock:
        served = copy.copy(config)  # the caller's config keeps its HOST:PORT
        served.bind = [f"fd://{os.dup(sock.fileno())}"]
        await hypercorn_serve(
            app, served, shutdown_trigger=shutdown_trigger, task_status=task_status
        )
