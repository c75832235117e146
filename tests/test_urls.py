"""``core.urls``: whether the port a URL's colon promises can be asked."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from rc_worker.config_load import controller_url_problem
from rc_worker.core.urls import port_problem
from rc_worker.http_input import url_problem

_HOSTS = st.sampled_from(["h", "ftp", "rc.example", "10.0.0.1", "[::1]", "u:pw@h"])
_PORTS = st.none() | st.just("") | st.integers(0, 65535).map(str)
_PATHS = st.sampled_from(["", "/", "/base", "//x", "/a:b"])


def _url(scheme: str, host: str, port: str | None, path: str) -> str:
    return f"{scheme}://{host}{'' if port is None else ':' + port}{path}"


@given(st.sampled_from(["http", "https"]), _HOSTS, _PORTS, _PATHS)
def test_a_port_can_be_asked_unless_it_is_empty_or_zero(
    scheme: str, host: str, port: str | None, path: str
) -> None:
    url = _url(scheme, host, port, path)
    problem = port_problem(url)
    assert (problem is None) == (port not in ("", "0")), url
    if port == "":
        assert problem == f"{url!r} has no port number after {host.rpartition('@')[2] + ':'!r}"


@given(st.sampled_from(["http", "https"]), _HOSTS, _PORTS, _PATHS)
def test_the_worker_config_and_rc_refuse_the_same_urls(
    scheme: str, host: str, port: str | None, path: str
) -> None:
    # One rule: a controller_url check-config passes is one rc would take, and back.
    url = _url(scheme, host, port, path)
    assert (controller_url_problem(url) is None) == (url_problem(url, "controller", "fix") is None)


def test_a_url_the_parser_refuses_is_left_to_it() -> None:
    assert port_problem("http://h:99999") is None
    assert port_problem("http://[::1") is None
