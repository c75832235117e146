"""``bind_problem``: whether an address can be listened on, asked before a server starts;
``listening_socket``: binding it, for hypercorn."""

from __future__ import annotations

import gc
import re
import socket
import warnings

import pytest

from rc_worker.listen import CannotListen, bind_problem, listening_socket


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


def test_a_port_held_by_a_listener_is_cannot_listen_with_nothing_left_open() -> None:
    # hypercorn's own bind left its socket open for the garbage collector to find.
    with warnings.catch_warnings(record=True) as caught, socket.socket() as held:
        warnings.simplefilter("always", ResourceWarning)
        held.bind(("127.0.0.1", 0))
        held.listen()
        listen = f"127.0.0.1:{held.getsockname()[1]}"
        with pytest.raises(CannotListen) as raised:
            listening_socket(listen, 10)
        assert str(raised.value) == f"cannot listen on {listen} (Address already in use)"
        del raised  # its traceback holds the frames: gone, so collection can find a leak
        gc.collect()
    assert [str(w.message) for w in caught if w.category is ResourceWarning] == []


def test_a_socket_listening_on_port_0_reports_its_port() -> None:
    with listening_socket("127.0.0.1:0", 10) as sock:
        host, port = sock.getsockname()
        assert host == "127.0.0.1"
        assert port != 0
        assert not sock.getblocking()


@pytest.mark.parametrize(
    ("listen", "reason"),
    [
        ("127.0.0.1:99999", "the port must be 0 to 65535"),
        ("127.0.0.1:http", "invalid literal for int() with base 10: 'http'"),
    ],
)
def test_an_address_that_is_not_one_is_cannot_listen(listen: str, reason: str) -> None:
    with pytest.raises(CannotListen, match=re.escape(f"cannot listen on {listen} ({reason})")):
        listening_socket(listen, 10)
