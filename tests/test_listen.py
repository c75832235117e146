"""``bind_problem``: whether an address can be listened on, asked before a server starts."""

from __future__ import annotations

import socket

from rc_worker.listen import bind_problem


def test_a_free_port_and_port_0_can_be_listened_on() -> None:
    assert bind_problem("127.0.0.1:0") is None


def test_a_port_held_by_a_listener_is_named() -> None:
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        listen = f"127.0.0.1:{held.getsockname()[1]}"
        assert bind_problem(listen) == f"cannot listen on {listen} (Address already in use)"


def test_a_port_over_65535_is_refused_not_wrapped() -> None:
    # getaddrinfo hands back 99999 modulo 65536, so without the check the probe bound
    # 34463 and said yes, and the server then died of an OverflowError.
    assert bind_problem("127.0.0.1:99999") == (
        "cannot listen on 127.0.0.1:99999 (the port must be 0 to 65535)"
    )
