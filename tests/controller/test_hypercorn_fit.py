"""The controller's connection handler replaces private parts of hypercorn's: it is put in
only for the hypercorn it was written for (``serve.hypercorn_mismatch``), and a controller on
another one serves with hypercorn's own handling and says so once, rather than failing every
connection on a renamed private method."""

from __future__ import annotations

import logging
from types import SimpleNamespace
from typing import Any

import httpx
import pytest
import trio
from hypercorn.trio import run as hypercorn_trio_run
from hypercorn.trio import tcp_server as hypercorn_tcp_server

from rc_worker.controller import Store, create_app
from rc_worker.controller import serve as serve_module
from rc_worker.controller.serve import _EofClosingTCPServer, hypercorn_mismatch, serve

from .helpers import USER_TOKENS, WORKER_TOKENS

REAL = hypercorn_tcp_server.TCPServer


def test_the_installed_hypercorn_fits_and_gets_the_handler() -> None:
    assert hypercorn_mismatch() is None
    assert serve_module.CONNECTION_FIXES_OFF is None
    assert hypercorn_trio_run.TCPServer is _EofClosingTCPServer


def test_another_release_series_is_left_alone() -> None:
    problem = hypercorn_mismatch(version="0.19.0")
    assert problem == "hypercorn 0.19.0 is not the 0.18.x it was written for"
    assert hypercorn_mismatch(version="0.18.3") is None


def test_a_run_module_that_builds_connections_otherwise_is_left_alone() -> None:
    elsewhere = SimpleNamespace(TCPServer=object)
    assert hypercorn_mismatch(run_module=elsewhere) == (
        "hypercorn.trio.run no longer builds its connections through TCPServer"
    )
    assert hypercorn_mismatch(run_module=SimpleNamespace()) is not None


class Renamed(REAL):  # type: ignore[misc]
    """A TCPServer whose reading loop was renamed: ours would never be called."""

    _read_data = None  # type: ignore[assignment]

    async def _receive_loop(self) -> None:
        pass


class NewConstructor(REAL):  # type: ignore[misc]
    def __init__(self, app: Any, config: Any, context: Any, stream: Any) -> None:
        pass


def test_a_changed_tcp_server_is_left_alone() -> None:
    run = SimpleNamespace(TCPServer=Renamed)
    assert hypercorn_mismatch(run_module=run, tcp=Renamed) == (
        "hypercorn's TCPServer has no coroutine _read_data"
    )
    run = SimpleNamespace(TCPServer=NewConstructor)
    assert hypercorn_mismatch(run_module=run, tcp=NewConstructor) == (
        "hypercorn's TCPServer takes (app, config, context, stream) now"
    )
    run = SimpleNamespace(TCPServer=REAL)
    assert hypercorn_mismatch(run_module=run, tcp=REAL) is None


async def test_serve_says_once_that_the_fixes_are_off(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(serve_module, "CONNECTION_FIXES_OFF", "hypercorn 9.9 is not it")
    app = create_app(store=Store(), worker_tokens=WORKER_TOKENS, user_tokens=USER_TOKENS)
    caplog.set_level(logging.WARNING, logger="rc_worker.controller.serve")
    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            [url] = await nursery.start(serve, app, "127.0.0.1:0")
            async with httpx.AsyncClient(base_url=url) as http:
                assert (await http.get("/v1/health")).status_code == 200
            nursery.cancel_scope.cancel()
    said = [r.getMessage() for r in caplog.records if "own connection handling" in r.getMessage()]
    assert len(said) == 1
    assert "hypercorn 9.9 is not it" in said[0]
