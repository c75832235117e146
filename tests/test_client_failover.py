"""ControllerClient with several controller URLs: a dead one or a standby moves it on.

Virtual time (``autojump_clock``) for the retry loop's sleeps; answers are scripted
per controller through one mock transport that looks at the request's host.
"""

from __future__ import annotations

import random
import re

import httpx
import pytest
import trio
import trio.testing

from rc_worker.client import ControllerClient
from rc_worker.config_load import load_config_text
from rc_worker.core.errors import ConfigError

URLS = ("http://active-a:8080", "http://standby-b:8080")


def _client(handler: httpx.MockTransport) -> tuple[ControllerClient, httpx.AsyncClient]:
    http = httpx.AsyncClient(transport=handler, base_url=URLS[0])
    client = ControllerClient(http, host="box1", token="t", rng=random.Random(3), urls=URLS)
    client.session = "s-1"
    return client, http


async def test_a_refused_connection_moves_to_the_next_controller(
    autojump_clock: trio.testing.MockClock,
) -> None:
    hosts: list[str] = []

    def answer(request: httpx.Request) -> httpx.Response:
        hosts.append(request.url.host)
        if request.url.host == "active-a":
            raise httpx.ConnectError("refused", request=request)
        return httpx.Response(200, json={"ok": True})

    client, http = _client(httpx.MockTransport(answer))
    async with http:
        assert await client.heartbeat({}) == {"ok": True}
    assert hosts == ["active-a", "standby-b"]
    assert str(http.base_url).startswith(URLS[1])


async def test_a_standby_503_moves_on_and_a_plain_503_does_not(
    autojump_clock: trio.testing.MockClock,
) -> None:
    hosts: list[str] = []
    answers = {
        # a: busy (a plain 503: the active controller's store is failing), then a standby
        "active-a": [
            httpx.Response(503, json={"error": "unavailable", "message": "store"}),
            httpx.Response(503, json={"error": "standby", "message": "standby"}),
        ],
        "standby-b": [httpx.Response(200, json={"ok": True})],
    }

    def answer(request: httpx.Request) -> httpx.Response:
        hosts.append(request.url.host)
        queue = answers[request.url.host]
        return queue.pop(0) if len(queue) > 1 else queue[0]

    client, http = _client(httpx.MockTransport(answer))
    async with http:
        assert await client.heartbeat({}) == {"ok": True}
    # The plain 503 is retried where it came from; the standby's sends it on.
    assert hosts == ["active-a", "active-a", "standby-b"]


async def test_the_last_controller_wraps_around_to_the_first(
    autojump_clock: trio.testing.MockClock,
) -> None:
    hosts: list[str] = []

    def answer(request: httpx.Request) -> httpx.Response:
        hosts.append(request.url.host)
        if len(hosts) < 3:
            return httpx.Response(503, json={"error": "standby", "message": "standby"})
        return httpx.Response(200, json={"ok": True})

    client, http = _client(httpx.MockTransport(answer))
    async with http:
        await client.heartbeat({})
    assert hosts == ["active-a", "standby-b", "active-a"]


BASE = "devices: [gpu0]\ntoken: t\n"


def test_controller_url_may_be_a_list_and_the_first_is_the_url() -> None:
    config = load_config_text(BASE + "controller_url: [http://a:1, http://b:2]\n")
    assert config.controller_url == ("http://a:1", "http://b:2")
    assert config.controller_urls == ("http://a:1", "http://b:2")
    single = load_config_text(BASE + "controller_url: http://a:1\n")
    assert single.controller_urls == ("http://a:1",)


@pytest.mark.parametrize(
    ("text", "where"),
    [
        ("controller_url: [http://a:1, 'ftp x']\n", "controller_url[1]"),
        ("controller_url: []\n", "controller_url: expected a URL"),
    ],
)
def test_a_bad_url_in_the_list_is_named_by_its_place(text: str, where: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(where)) as caught:
        load_config_text(BASE + text)
    assert "\n" not in str(caught.value)
