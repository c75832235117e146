"""The client speaks the typed protocol: messages out with the live session, replies in as
messages, and a reply that does not fit is one error naming the field (issue 9)."""

from __future__ import annotations

import json
import random
from typing import Any

import httpx
import pytest
import trio

from rc_worker.client import ControllerClient
from rc_worker.core import protocol
from rc_worker.core.errors import ControllerError


def _client(
    answer: dict[str, Any], seen: list[httpx.Request]
) -> tuple[ControllerClient, httpx.AsyncClient]:
    async def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        return httpx.Response(200, json=answer)

    http = httpx.AsyncClient(transport=httpx.MockTransport(handler), base_url="http://ctl")
    client = ControllerClient(http, host="box1", token="t", rng=random.Random(1))
    client.session = "s-7"
    return client, http


async def test_a_message_goes_out_with_the_live_session_and_its_wire_keys() -> None:
    seen: list[httpx.Request] = []
    client, http = _client({"ok": True}, seen)
    report = protocol.FinishRequest(protocol.NO_SESSION, 2, "gpu0", "failed", exit_code=3)
    with trio.fail_after(10):
        async with http:
            await client.finish("j-1", report)
    body = json.loads(seen[0].content)
    assert body["session"] == "s-7"
    assert (body["attempt"], body["device"], body["outcome"], body["exit_code"]) == (
        2,
        "gpu0",
        "failed",
        3,
    )
    assert "stale_offer" not in body
    assert protocol.structure(body, protocol.FinishRequest) == protocol.FinishRequest(
        "s-7", 2, "gpu0", "failed", exit_code=3
    )


async def test_a_heartbeat_reply_comes_back_as_its_message() -> None:
    answer = {
        "cancel": [{"job_id": "j-1", "attempt": 1, "reason": "cancelled by alice"}],
        "idle_behavior": {"gpu0": "drain"},
        "cleared": {"gpu0": ["f-1"]},
        "later_addition": {"ignored": True},
    }
    client, http = _client(answer, [])
    with trio.fail_after(10):
        async with http:
            reply = await client.heartbeat_reply({"gpu0": protocol.DeviceReport("free")})
    assert reply == protocol.HeartbeatReply(
        (protocol.CancelOrder("j-1", 1, "cancelled by alice"),),
        {"gpu0": "drain"},
        {"gpu0": ("f-1",)},
    )


async def test_a_malformed_reply_is_one_error_naming_the_field() -> None:
    client, http = _client({"cancel": [{"job_id": "j-1", "attempt": "one"}]}, [])
    with trio.fail_after(10):
        async with http:
            with pytest.raises(ControllerError, match=r"cancel\[0\]\.attempt: expected an integer"):
                await client.heartbeat_reply({})
