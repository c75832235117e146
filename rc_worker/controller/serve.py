"""Serving the reference controller: hypercorn on Trio, housekeeping, webhook delivery.

:func:`serve` runs three things in one nursery:

- the HTTP server (hypercorn's Trio worker) on the listen address;
- :func:`housekeeping`, which applies the store's timers (lost hosts, unanswered
  assignments) when they fall due, even when no request comes in to apply them
  lazily;
- :func:`deliver_webhooks`, when the app has webhook URLs: every event is POSTed
  to every URL, in order, from a background task, so a slow or dead receiver
  never holds up a request.

Each takes ``task_status`` and reports ready only once it is, so callers start
them with ``await nursery.start(...)``.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.metadata
import inspect
import logging
import random
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from typing import Any, Final, cast

import httpx
import trio
from hypercorn.config import Config as HypercornConfig
from hypercorn.trio import run as hypercorn_trio_run
from hypercorn.trio import tcp_server as hypercorn_tcp_server
from starlette.applications import Starlette

from rc_worker.controller.context import Controller
from rc_worker.controller.errors import StoreUnavailable
from rc_worker.controller.messages import Event
from rc_worker.listen import serve_asgi

__all__ = ["deliver_webhooks", "housekeeping", "serve"]

log = logging.getLogger("rc_worker.controller.serve")

HOUSEKEEPING_MAX_SLEEP_S: Final = 5.0
"""Re-check at least this often, whatever the store's next timer says (belt and braces)."""
RETENTION_INTERVAL_S: Final = 3600.0
RETENTION_BATCH: Final = 500
"""Finished jobs retention deletes per transaction (see ``Backend.delete_finished_before``)."""
WEBHOOK_TRIES: Final = 8
WEBHOOK_BACKOFF_S: Final = (0.5, 60.0)
WEBHOOK_TIMEOUT_S: Final = 10.0


def _controller(app: Starlette) -> Controller:
    ctl: Controller = app.state.controller
    return ctl


async def housekeeping(
    app: Starlette, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
) -> None:
    """Apply the store's timers as they fall due; runs until cancelled."""
    ctl = _controller(app)
    ctl.housekeeping = True
    task_status.started()
    try:
        await _housekeep(ctl)
    finally:
        ctl.housekeeping = False


async def _housekeep(ctl: Controller) -> None:
    while True:
        seen = ctl.changes.version
        now = ctl.tick()
        if ctl.durability is not None:
            # What the timers changed (a host lost) is stored even if no request comes.
            with contextlib.suppress(StoreUnavailable):
                await ctl.durability.flush()
        await ctl.wait_change(seen, now + HOUSEKEEPING_MAX_SLEEP_S)


async def retention(app: Starlette, retention_s: float) -> None:
    """Delete finished jobs (and their output) older than ``retention_s``; runs until cancelled."""
    while True:
        await retention_pass(app, retention_s)
        await trio.sleep(RETENTION_INTERVAL_S)


async def retention_pass(app: Starlette, retention_s: float) -> list[str]:
    """One pass of :func:`retention`; returns the ids of the jobs deleted."""
    ctl = _controller(app)
    cutoff = time.time() - retention_s
    d = ctl.durability
    ids: list[str] = []
    if d is None:
        ids = ctl.store.finished_before(cutoff)
        ctl.store.forget(ids)
    else:
        # The store beneath holds every finished job (most are not in memory): it decides,
        # a batch per transaction, so that commits (every request that changes state) go
        # on in between instead of waiting for the whole deletion.
        while True:
            try:
                # Not a job a request is reading (its output would end short).
                gone = await trio.to_thread.run_sync(
                    functools.partial(
                        d.backend.delete_finished_before, cutoff, RETENTION_BATCH, keep=set(d.busy)
                    )
                )
            except Exception as e:
                log.warning("retention: could not delete old jobs: %s", e)
                break
            ctl.store.forget_stored(gone)
            ids += [job_id for job_id, _ in gone]
            if len(gone) < RETENTION_BATCH:
                break
    if ids:
        log.info("retention: deleted %d finished jobs", len(ids))
    return ids


async def deliver_webhooks(
    app: Starlette,
    client: httpx.AsyncClient,
    *,
    rng: random.Random | None = None,
    task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
) -> None:
    """POST every event to every webhook URL of the app, in order; runs until cancelled.

    Delivery is at least once and in order per URL. A failed POST (connection
    error, timeout, 408, 429, 5xx) is retried with capped, jittered backoff up
    to :data:`WEBHOOK_TRIES` times, then that event is skipped for that URL and
    logged; any other 4xx skips it at once. Receivers that missed events catch
    up from ``GET /v1/events?after=N``.
    """
    ctl = _controller(app)
    rng = rng or random.Random()
    cursors: dict[str, int] = {}
    if ctl.durability is not None:
        cursors = await trio.to_thread.run_sync(ctl.durability.backend.webhook_cursors)
    async with trio.open_nursery() as nursery:
        for url in ctl.webhooks:
            nursery.start_soon(_deliver_to, ctl, client, url, rng, cursors.get(url, 0))
        task_status.started()


async def _deliver_to(
    ctl: Controller, client: httpx.AsyncClient, url: str, rng: random.Random, after: int
) -> None:
    # `after` is the last event this URL confirmed, kept in the store when there is one:
    # deliveries not yet confirmed when a controller stopped are made again after a restart.
    while True:
        seen = ctl.changes.version
        try:
            events = await ctl.read_events(after, 100)
        except StoreUnavailable:
            await trio.sleep(WEBHOOK_BACKOFF_S[0])  # the store is failing: try again soon
            continue
        if not events:
            await ctl.wait_change(seen, None)
            continue
        for event in events:
            await _post_event(client, url, event, rng, ctl.store.stats.webhook_deliveries)
            after = event.seq
        # One stored cursor per batch, not per event (each is a commit with an fsync): a
        # restart delivers again at most this batch, which at least once allows.
        await _save_cursor(ctl, url, after)


async def _save_cursor(ctl: Controller, url: str, seq: int) -> None:
    d = ctl.durability
    if d is None:
        return
    try:
        await trio.to_thread.run_sync(d.backend.save_webhook_cursor, url, seq)
    except Exception as e:
        # At least once: a cursor not saved means the event is delivered again, no worse.
        log.warning("webhook %s: could not store the delivery of event %d: %s", url, seq, e)


async def _post_event(
    client: httpx.AsyncClient,
    url: str,
    event: Event,
    rng: random.Random,
    results: Counter[str] | None = None,
) -> None:
    """POST one event, retrying; counts each try's result in ``results`` (see
    :data:`~rc_worker.controller.stats.WEBHOOK_RESULTS`)."""
    results = Counter() if results is None else results
    low, high = WEBHOOK_BACKOFF_S
    for attempt in range(1, WEBHOOK_TRIES + 1):
        try:
            r = await client.post(
                url,
                json=event.to_json(),
                headers={"X-RC-Event": event.type, "X-RC-Event-Seq": str(event.seq)},
                timeout=WEBHOOK_TIMEOUT_S,
            )
        except httpx.HTTPError as e:
            problem = f"{type(e).__name__}: {e}"
        else:
            if r.is_success:
                results["delivered"] += 1
                return
            problem = f"status {r.status_code}"
            if r.status_code < 500 and r.status_code not in (408, 429):
                results["refused"] += 1
                log.warning(
                    "webhook %s refused event %d (%s); skipping it", url, event.seq, problem
                )
                return
        if attempt == WEBHOOK_TRIES:
            results["failed"] += 1
            break
        results["retried"] += 1
        delay = rng.uniform(0, min(high, low * 2 ** (attempt - 1)))
        log.info("webhook %s, event %d: %s; retrying in %.1fs", url, event.seq, problem, delay)
        await trio.sleep(delay)
    log.warning("webhook %s: giving up on event %d after %d tries", url, event.seq, WEBHOOK_TRIES)


class _KeepAliveTimer:
    """hypercorn's keep-alive timer for one connection, as one task whose deadline moves.

    hypercorn stops its timer when a request begins (a task cancelled) and restarts it
    when the response ends (a new task, through ``nursery.start``): two task switches and
    a task spawned per request, about 8 % of the controller's CPU at 100 jobs/s over
    1,000 connections. Here the first arming spawns the one task; stopping and restarting
    only move its cancel scope's deadline. The task ends when the timer fires (it closes
    the connection, as hypercorn's does), when the server terminates, or when the
    connection is done (:meth:`finish`).
    """

    def __init__(self, server: _EofClosingTCPServer) -> None:
        self.server = server
        self.scope: trio.CancelScope | None = None
        self.done = False

    async def restart(self, task_group: Any, action: Any) -> None:
        deadline = trio.current_time() + self.server.config.keep_alive_timeout
        if self.scope is not None:
            self.scope.deadline = deadline
            return
        if self.done:
            return
        self.scope = trio.CancelScope(deadline=deadline)
        task_group.spawn(self._run)  # hypercorn TaskGroup.spawn: start_soon in its nursery

    async def stop(self) -> None:
        if self.scope is not None:
            self.scope.deadline = float("inf")

    def finish(self) -> None:
        """The peer is gone: the task ends without closing anything more, and none starts
        again; the connection's task group (and so the socket) closes as soon as the
        response in flight, if any, is out, instead of a keep-alive timeout later."""
        self.done = True
        if self.scope is not None:
            self.scope.cancel()

    async def _run(self) -> None:
        scope = self.scope
        assert scope is not None
        with scope:
            await self.server.context.terminated.wait()
        if self.done:
            return
        # Timed out (or the server terminates): close, as hypercorn's timer does.
        with trio.CancelScope(shield=True):
            await self.server._initiate_server_close()


class _GrowingReads:
    """A connection's stream whose reads grow while the peer keeps them full.

    hypercorn reads 64 KiB at a time: a worker streaming output at pipe speed
    then costs a round of h11 events, ASGI messages and store appends per
    64 KiB (a third of the controller's CPU per GiB). A read that came back
    full says more is waiting, so the next asks for up to 256 KiB; one that
    did not goes back to 64 KiB, so the many small requests (heartbeats,
    polls) never have a large buffer allocated for them. Not more: hypercorn
    queues up to ``max_app_queue_size`` (10) body pieces per connection while
    the handler waits for a commit, so each uploading worker can hold ten
    reads in the controller's memory. hypercorn always asks for 64 KiB; the
    size asked for here is this class's own (``max_bytes`` is ignored).
    """

    SMALL = 1 << 16
    LARGE = 1 << 18

    def __init__(self, stream: trio.abc.Stream) -> None:
        self._stream = stream
        self._size = self.SMALL

    async def receive_some(self, max_bytes: int | None = None) -> bytes | bytearray:
        data = await self._stream.receive_some(self._size)
        self._size = self.LARGE if len(data) >= self._size else self.SMALL
        return data

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)  # sending, EOF, closing: the stream's own


class _EofClosingTCPServer(hypercorn_tcp_server.TCPServer):
    """hypercorn's connection handler, closing a connection as soon as its peer has, with a
    cheaper keep-alive timer (:class:`_KeepAliveTimer`).

    hypercorn 0.18 notices the client's EOF but keeps the connection's task group,
    and so the socket, open until its keep-alive timer fires: every keep-alive
    client that hangs up leaves a socket in CLOSE-WAIT for ``keep_alive_timeout``
    (75 s here), and a steady stream of clients piles them up. Once the peer is gone
    the keep-alive timer has nothing to wait for: it ends.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.idle_task = cast(Any, _KeepAliveTimer(self))
        self.stream = cast(Any, _GrowingReads(self.stream))

    async def _read_data(self) -> None:
        await super()._read_data()
        cast(_KeepAliveTimer, self.idle_task).finish()


HYPERCORN_SERIES = "0.18."
"""The hypercorn releases the connection handler above was written and tested against: it
overrides private methods (``_read_data``, ``_initiate_server_close``) and replaces the
``idle_task`` and ``stream`` its constructor sets, none of which hypercorn promises to keep."""


def hypercorn_mismatch(
    version: str | None = None, run_module: Any = hypercorn_trio_run, tcp: Any = None
) -> str | None:
    """Why hypercorn is not the one :class:`_EofClosingTCPServer` fits, or None when it is.

    A mismatch leaves hypercorn's own connection handling in place (with its CLOSE-WAIT
    sockets, per-request timer tasks and 64 KiB reads): slower, but never a controller
    whose every connection fails on a renamed private method after an upgrade.
    """
    tcp = hypercorn_tcp_server.TCPServer if tcp is None else tcp
    if version is None:
        try:
            version = importlib.metadata.version("hypercorn")
        except importlib.metadata.PackageNotFoundError:
            version = "(unknown version)"
    if not version.startswith(HYPERCORN_SERIES):
        return f"hypercorn {version} is not the {HYPERCORN_SERIES}x it was written for"
    if getattr(run_module, "TCPServer", None) not in (tcp, _EofClosingTCPServer):
        return "hypercorn.trio.run no longer builds its connections through TCPServer"
    for name in ("_read_data", "_initiate_server_close"):
        if not inspect.iscoroutinefunction(getattr(tcp, name, None)):
            return f"hypercorn's TCPServer has no coroutine {name}"
    params = list(inspect.signature(tcp.__init__).parameters)
    if params != ["self", "app", "config", "context", "state", "stream"]:
        return f"hypercorn's TCPServer takes ({', '.join(params[1:])}) now"
    return None


def _install_connection_fixes() -> str | None:
    # hypercorn.trio.run builds connections through its module-level name; replacing it
    # there is the one seam it offers. Checked first, so a hypercorn that changed shape
    # is left alone rather than broken (``serve`` says so once).
    problem = hypercorn_mismatch()
    if problem is None:
        setattr(hypercorn_trio_run, "TCPServer", _EofClosingTCPServer)  # noqa: B010
    return problem


CONNECTION_FIXES_OFF: Final = _install_connection_fixes()
"""Why the connection handler above is not in use (None: it is)."""


def hypercorn_config(listen: str) -> HypercornConfig:
    config = HypercornConfig()
    config.bind = [listen]
    config.accesslog = None
    config.errorlog = logging.getLogger("rc_worker.controller.http")
    # Long polls and followed output stay open well past hypercorn's defaults.
    config.keep_alive_timeout = 75.0
    config.graceful_timeout = 5.0
    return config


async def serve(
    app: Starlette,
    listen: str = "127.0.0.1:8080",
    *,
    webhook_client: httpx.AsyncClient | None = None,
    shutdown_trigger: Callable[[], Awaitable[None]] | None = None,
    retention_s: float | None = None,
    task_status: trio.TaskStatus[list[str]] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve ``app`` on ``listen`` (``HOST:PORT``; port 0 picks a free one).

    Reports the bound URLs (``["http://127.0.0.1:41234"]``) through
    ``task_status`` once the socket listens. Runs until cancelled, or until
    ``shutdown_trigger`` returns (then in-flight requests get a short grace).
    """
    ctl = _controller(app)
    if CONNECTION_FIXES_OFF is not None:
        log.warning(
            "serving with hypercorn's own connection handling: %s; closed client "
            "connections then linger until their keep-alive timeout (install hypercorn %sx "
            "to get the fixes back)",
            CONNECTION_FIXES_OFF,
            HYPERCORN_SERIES,
        )
    async with trio.open_nursery() as nursery:
        # Before housekeeping's first tick: a pause is measured from the first moment.
        nursery.start_soon(ctl.watch_loop)
        if ctl.durability is not None:
            await nursery.start(ctl.durability.run)
        await nursery.start(housekeeping, app)
        if retention_s:
            nursery.start_soon(retention, app, retention_s)
        if ctl.webhooks:
            if webhook_client is None:
                webhook_client = await _own_client(nursery)
            await nursery.start(deliver_webhooks, app, webhook_client)

        async def http(task_status: trio.TaskStatus[list[str]]) -> None:
            # On a socket bound (and closed) here: CannotListen, and no unclosed socket,
            # for an address taken since rc serve's check (rc_worker.listen).
            await serve_asgi(
                app,
                hypercorn_config(listen),
                shutdown_trigger=shutdown_trigger,
                task_status=task_status,
            )
            # hypercorn returns only after shutdown_trigger: take the background tasks down too.
            nursery.cancel_scope.cancel()

        binds: list[str] = await nursery.start(http)
        log.info("controller listening on %s", ", ".join(binds))
        task_status.started(binds)


async def _own_client(nursery: trio.Nursery) -> httpx.AsyncClient:
    """An httpx client that lives as long as ``nursery`` (closed when it is cancelled)."""

    async def hold(task_status: trio.TaskStatus[httpx.AsyncClient]) -> None:
        async with httpx.AsyncClient() as client:
            task_status.started(client)
            await trio.sleep_forever()

    client: httpx.AsyncClient = await nursery.start(hold)
    return client
