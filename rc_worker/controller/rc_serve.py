"""``rc serve``: the reference controller as a service (its store, its standby, its signals).

Kept apart from ``rc_cli.py`` so that the client commands (``rc ps``, ``rc logs``, ...)
do not load the server stack: Starlette, hypercorn, the stores and the standby logic.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
from collections.abc import Awaitable, Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, Final, cast

import attrs
import trio

from rc_worker.controller.app import create_app
from rc_worker.controller.context import User, parse_user_token
from rc_worker.controller.durable import Durability
from rc_worker.controller.gcpause import keep_gc_pauses_short
from rc_worker.controller.persist import Backend, MemoryBackend, StoreOpenError
from rc_worker.controller.persist.opening import open_backend, open_store
from rc_worker.controller.persist.sqlite import default_state_dir
from rc_worker.controller.rc_cli import (
    EXIT_LOST_LEAD,
    CliError,
    _split_list,
    build_parser,
    parse_worker_token,
)
from rc_worker.controller.rc_input import url_problem
from rc_worker.controller.serve import serve
from rc_worker.controller.standby import Leader, guard_lead, wait_to_lead
from rc_worker.controller.state import StoreConfig
from rc_worker.controller.store import Store
from rc_worker.core.tokens import token_problem
from rc_worker.listen import CannotListen, bind_problem

log = logging.getLogger("rc_worker.controller")


def _check_token(token: str, kind: str) -> None:
    """A token no client can send (the rule ``rc`` and ``rc-worker`` apply to theirs) would
    let nothing in: refused here, naming the character and never the token."""
    problem = token_problem(token, f"{kind} token", "write a token of visible ASCII without spaces")
    if problem:
        raise CliError(f"rc serve: --{kind}-token: {problem}", 2)


def serve_settings(
    args: argparse.Namespace, env: Mapping[str, str]
) -> tuple[dict[str, str], dict[str, User]]:
    worker: dict[str, str] = {}
    for text in [*_split_list(env.get("RC_WORKER_TOKENS", "")), *args.worker_token]:
        if not text.strip() or (text.startswith("=") and text.count("=") == 1 and text != "="):
            # '' would let any request without a token in; '=HOST' is a TOKEN=HOST whose
            # TOKEN went missing (an empty $(cat file)), not a token that starts with '='.
            raise CliError(
                f"rc serve: --worker-token {text!r}: the token is empty; write TOKEN or TOKEN=HOST",
                2,
            )
        token, host = parse_worker_token(text)
        _check_token(token, "worker")
        worker[token] = host
    users: dict[str, User] = {}
    for text in [*_split_list(env.get("RC_USER_TOKENS", "")), *args.user_token]:
        try:
            token, user = parse_user_token(text)
        except ValueError as e:
            raise CliError(f"rc serve: --user-token: {e}", 2) from None
        _check_token(token, "user")
        users[token] = user
    if not worker or not users:
        raise CliError(
            "rc serve: give at least one --worker-token TOKEN[=HOST] and one --user-token TOKEN "
            "(or set RC_WORKER_TOKENS and RC_USER_TOKENS)",
            2,
        )
    for url in args.webhook:
        problem = url_problem(url, "webhook", "give an http:// or https:// URL to POST events to")
        if problem:
            raise CliError(f"rc serve: --webhook: {problem}", 2)
    host, sep, port = args.listen.rpartition(":")
    if not sep or not host or not port.isdigit() or int(port) > 65535:
        raise CliError(
            f"rc serve: --listen {args.listen!r} is not HOST:PORT (a port of 0 to 65535)", 2
        )
    return worker, users


def check_listen(args: argparse.Namespace) -> None:
    """One line, not hypercorn's bind error from inside its nursery, for an address that
    cannot be listened on (asked before the store is opened). Status 1: the address may be
    free again by the next start, so a service manager's retry can help."""
    problem = bind_problem(args.listen)
    if problem is not None:
        raise _cannot_listen(problem)


def _cannot_listen(problem: str) -> CliError:
    return CliError(f"rc serve: {problem}; stop what holds it, or choose another --listen", 1)


def _listen_failed(group: BaseExceptionGroup[CannotListen]) -> CliError:
    """The address was free when :func:`check_listen` asked, but not by the bind (taken
    meanwhile: while the store opened, while this controller waited as a standby, or
    between the standby's listener closing and the active server's bind once it took
    over): the same line and status as :func:`check_listen`'s, not hypercorn's nested
    groups."""
    first: BaseException = group
    while isinstance(first, BaseExceptionGroup):
        first = first.exceptions[0]
    return _cannot_listen(str(first))


PERSISTED_MAX_EVENTS: Final = 10_000
"""Events ``rc serve`` keeps in memory over a database (all of them stay in the database)."""


async def run_serve(
    argv: Sequence[str],
    *,
    env: Mapping[str, str] | None = None,
    shutdown_trigger: Callable[[], Awaitable[None]] | None = None,
    backend: Backend | None = None,
    task_status: trio.TaskStatus[list[str]] = trio.TASK_STATUS_IGNORED,
) -> None:
    """``rc serve ARGS``: serve until cancelled (or ``shutdown_trigger``); reports bound URLs."""
    args = build_parser().parse_args(["serve", *argv])
    env = os.environ if env is None else env
    worker, users = serve_settings(args, env)
    if args.heartbeat_rate < 0 or args.heartbeat_rate != args.heartbeat_rate:
        raise CliError("--heartbeat-rate: must be a number >= 0 (0: no target)", 2)
    config = StoreConfig(
        heartbeat_interval_s=args.heartbeat_interval,
        poll_wait_s=args.poll_wait,
        heartbeat_rate=args.heartbeat_rate,
        max_grace_s=args.max_grace,
        max_output_bytes=args.max_output_bytes,
    )
    if backend is None:
        # A caller that passes the store opened it, and checked the address before that.
        check_listen(args)
        backend = await open_serve_backend(args, env)
    listen = args.listen
    try:
        leader = cast("Leader | None", backend if hasattr(backend, "try_lead") else None)
        if leader is not None:
            # Several controllers may share this database: lead, or wait as a standby
            # (listening as one: a bind).
            chosen = await wait_to_lead(
                leader, listen, shutdown_trigger=shutdown_trigger, task_status=task_status
            )
            if chosen is None:
                return
            listen, reported = chosen
            if reported:  # a standby listened there and said so already
                task_status = trio.TASK_STATUS_IGNORED
        durability = None
        if not isinstance(backend, MemoryBackend):
            # Older events are read from the store when asked for (GET /v1/events, webhooks):
            # memory holds only the most recent, and a restart loads only those.
            config = attrs.evolve(config, max_events=PERSISTED_MAX_EVENTS)
            grace, now = args.recovery_grace, trio.current_time()
            try:
                store, _ = await trio.to_thread.run_sync(
                    lambda: open_store(backend, config, now=now, recovery_grace_s=grace)
                )
            except StoreOpenError as e:
                # As open_serve_backend's: the store opened, but its state cannot be read.
                raise CliError(f"rc serve: {e}", 2) from None
            durability = Durability(store, backend)
            log.info("controller state in %s", backend.description)
        else:
            store = Store(config)
        app = create_app(
            store=store,
            worker_tokens=worker,
            user_tokens=users,
            webhooks=args.webhook,
            durability=durability,
        )
        async with trio.open_nursery() as nursery:
            # With a large fleet, a full GC pause was the tail of dispatch latency.
            await nursery.start(keep_gc_pauses_short)

            async def serving(task_status: trio.TaskStatus[list[str]]) -> None:
                await serve(
                    app,
                    listen,
                    shutdown_trigger=shutdown_trigger,
                    retention_s=args.retention or None,
                    task_status=task_status,
                )
                nursery.cancel_scope.cancel()  # shut down: the lock's guard has nothing to do

            binds: list[str] = await nursery.start(serving)
            task_status.started(binds)
            if leader is not None:
                nursery.start_soon(guard_lead, leader, nursery.cancel_scope)
        if leader is not None and leader.lost is not None:
            raise CliError(
                f"rc serve: lost the controllers' lock in the database ({leader.lost}); "
                "stopped so that only one controller is active",
                EXIT_LOST_LEAD,
            )
    except* CannotListen as group:
        # Raised only by the servers' own bind (rc_worker.listen), the standby's or the
        # active one's, each before that server listens: the standby's "listening" line
        # does not make the active server's bind failure after a takeover any less an
        # address problem. An OSError from anything else (a state file it may not read,
        # say) is not one, and passes on as it is.
        raise _listen_failed(group) from None
    finally:
        backend.close()


def serve_backend_choice(args: argparse.Namespace, env: Mapping[str, str]) -> dict[str, Any]:
    """Where ``rc serve`` keeps state: ``--memory``, ``--db``/``$RC_DB``, else a state dir."""
    if args.memory:
        return {}
    if args.db or (not args.state_dir and env.get("RC_DB")):
        return {"db": args.db or env["RC_DB"]}
    if args.state_dir:
        return {"state_dir": Path(args.state_dir)}
    return {"state_dir": default_state_dir(env)}


async def open_serve_backend(args: argparse.Namespace, env: Mapping[str, str]) -> Backend:
    """Open (create, migrate) the store ``rc serve`` was told to use; CliError, status 2."""
    choice = serve_backend_choice(args, env)
    try:
        backend: Backend = await trio.to_thread.run_sync(lambda: open_backend(**choice))
    except StoreOpenError as e:
        raise CliError(f"rc serve: {e}", 2) from None
    return backend


async def _serve_until_signalled(
    argv: Sequence[str], env: Mapping[str, str], backend: Backend
) -> int:
    stop = trio.Event()
    failed: list[CliError] = []
    with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async with trio.open_nursery() as nursery:

            async def on_signals() -> None:
                async for signum in signals:
                    name = signal.Signals(signum).name
                    if stop.is_set():
                        say(f"rc: {name} again: stopping now")
                        nursery.cancel_scope.cancel()  # a second signal: stop now
                    else:
                        # An operator (or systemd's journal) sees why it went, and that
                        # requests in flight are being finished, not hung.
                        say(f"rc: {name}: finishing the requests in flight, then stopping")
                    stop.set()

            async def serve_then_stop() -> None:
                try:
                    await run_serve(
                        argv,
                        env=env,
                        shutdown_trigger=stop.wait,
                        backend=backend,
                        task_status=_SayListening(),
                    )
                except CliError as e:
                    failed.append(e)  # raised below, outside the nursery: one line, no group
                # Served its last request: the signal watcher has nothing left to do.
                nursery.cancel_scope.cancel()

            nursery.start_soon(on_signals)
            # Not nursery.start: run_serve may end before it listens (a failure, now a
            # CliError; a standby stopped), and start() would make that "child exited
            # without calling task_status.started()" in an exception group.
            nursery.start_soon(serve_then_stop)
    if failed:
        raise failed[0]
    say("rc: controller stopped")
    return 0


class _SayListening(trio.TaskStatus[list[str]]):
    """``run_serve``'s report that it listens, said on stderr (service managers and tests
    wait for this line)."""

    def started(self, value: list[str] | None = None) -> None:
        say(f"rc: controller listening on {', '.join(value or [])}")


def say(line: str) -> None:
    print(line, file=sys.stderr, flush=True)
