"""Output across a controller restart that loses its store (the in-memory controller).

The new controller adopts the attempt the worker claims running at its registration, with
none of its output (docs/protocol.md, register); the worker must resend what it still
spools, whether or not the job writes anything more.
"""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
import trio
from test_delivery import steady_store

from rc_worker import client as client_module
from rc_worker.controller import Store, create_app
from rc_worker.controller.errors import NotFound
from rc_worker.testing import USER_TOKEN, WORKER_TOKEN, local_system, make_config, wait_until


@pytest.fixture(autouse=True)
def fast_retries(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(client_module, "RETRY_BASE_S", 0.005)
    monkeypatch.setattr(client_module, "RETRY_CAP_S", 0.05)


class Restartable(httpx.AsyncBaseTransport):
    """The worker's way to the controller; :meth:`restart` puts a new controller process
    behind it, and requests in flight to the old one break, as their connections would."""

    def __init__(self, inner: httpx.AsyncBaseTransport) -> None:
        self.inner = inner
        self.output_answered = trio.Event()
        self._in_flight: set[trio.CancelScope] = set()

    def restart(self, store: Store, host: str) -> None:
        app = create_app(
            store=store,
            worker_tokens={WORKER_TOKEN: host},
            user_tokens=[f"{USER_TOKEN}=tester:admin"],
        )
        self.inner = httpx.ASGITransport(app=app)
        for scope in self._in_flight:
            scope.cancel()

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        with trio.CancelScope() as scope:
            self._in_flight.add(scope)
            try:
                response = await self.inner.handle_async_request(request)
                await response.aread()
            finally:
                self._in_flight.discard(scope)
        if scope.cancelled_caught:
            raise httpx.RemoteProtocolError("the controller restarted", request=request)
        if request.url.path.endswith("/output"):
            self.output_answered.set()
        return response


def known(store: Store, job_id: str) -> bool:
    try:
        store.job(job_id)
    except NotFound:
        return False
    return True


@pytest.mark.parametrize("after", [b"", b"more\n"], ids=["nothing more", "more"])
async def test_output_committed_before_a_restart_reaches_the_new_controller(
    tmp_path: Path, after: bytes
) -> None:
    """The job writes ``first``, which the old controller commits; the controller restarts
    (nothing of the job left), adopts the job from the worker's registration, and the job
    ends after writing ``after``. Before, with nothing written after the restart, the
    worker believed ``first`` committed and sent the finish at once: the new controller
    had the job succeed with none of its output, which the worker then deleted."""
    go, rest = tmp_path / "go", tmp_path / "rest"
    rest.write_bytes(after)
    command = ["sh", "-c", f"echo first; while [ ! -e {go} ]; do sleep 0.01; done; cat {rest}"]
    old = steady_store()
    job_id = old.submit(command)
    config = make_config(tmp_path)
    made: list[Restartable] = []

    def wrap(inner: httpx.AsyncBaseTransport) -> Restartable:
        made.append(Restartable(inner))
        return made[0]

    with trio.fail_after(40):
        async with local_system(config, store=old, transport_wrapper=wrap) as system:
            await system.wait_until(lambda: old.committed(job_id) == len(b"first\n"))
            await made[0].output_answered.wait()  # the worker heard it committed
            new = steady_store()
            made[0].restart(new, config.host)
            await wait_until(new, lambda: known(new, job_id))  # adopted at registration
            go.touch()
            await wait_until(new, lambda: known(new, job_id) and new.job(job_id).terminal)
    info = new.job(job_id)
    assert info.adopted
    assert info.state == "succeeded", info
    assert new.output(job_id) == b"first\n" + after
    assert info.output_bytes == info.committed_bytes == len(b"first\n" + after)
