"""``rc-worker run``: the worker as a long-lived daemon, with its signals.

Signals are received in the root task and turned into drain or cancel:

- first SIGTERM or SIGINT: drain (no new work; running jobs finish, held
  devices are released, every report delivered; exit 0), bounded by
  ``shutdown_grace``;
- a second SIGTERM or SIGINT, or SIGQUIT: stop running jobs (grace ceilings
  honoured), report, exit 0;
- SIGHUP: run a probe pass and re-read the sheets now.
"""

from __future__ import annotations

import argparse
import logging
import secrets
import signal
import sys
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack

import attrs
import httpx
import trio

from rc_worker.config import Config, load_config
from rc_worker.errors import ConfigError, RcWorkerError
from rc_worker.worker import Worker

log = logging.getLogger("rc_worker.main")

_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGQUIT, signal.SIGHUP)


def run_from_cli(args: argparse.Namespace) -> int:
    try:
        config = load_config(args.path)
    except ConfigError as e:
        print(f"rc-worker: {e}", file=sys.stderr)
        return 2
    code = 0
    try:
        trio.run(serve, config)
    except* KeyboardInterrupt:
        code = 130
    except* ConfigError as bad_settings:
        # Bad settings found only at start (state_dir, status_listen): exit 2,
        # which a service manager can be told not to restart on.
        for err in bad_settings.exceptions:
            print(f"rc-worker: {err}", file=sys.stderr)
        code = 2
    except* RcWorkerError as failures:
        for failure in failures.exceptions:
            print(f"rc-worker: {failure}", file=sys.stderr)
        code = 1
    return code


async def serve(config: Config) -> None:
    """Run a worker until a signal drains or stops it."""
    async with AsyncExitStack() as stack:
        http: httpx.AsyncClient | None = None
        if config.controller_url is None:
            config, http = embedded_controller(config)
            await stack.enter_async_context(http)
            log.info("no controller_url: serving an embedded reference controller in-process")
        worker = Worker(config, http=http)
        with trio.open_signal_receiver(*_SIGNALS) as signals:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(_handle_signals, signals, worker)
                await worker.run()
                nursery.cancel_scope.cancel()


async def _handle_signals(signals: AsyncIterator[int], worker: Worker) -> None:
    terms = 0
    async for signum in signals:
        name = signal.Signals(signum).name
        if signum == signal.SIGHUP:
            log.info("SIGHUP: probing and re-reading sheets")
            worker.reprobe()
        elif signum == signal.SIGQUIT:
            log.info("SIGQUIT: stopping running jobs now")
            worker.stop()
        else:
            terms += 1
            if terms == 1:
                log.info("%s: draining (send it again to stop running jobs)", name)
                worker.drain()
            else:
                log.info("%s again: stopping running jobs", name)
                worker.stop()


def embedded_controller(config: Config) -> tuple[Config, httpx.AsyncClient]:
    """An in-process reference controller and a client wired to it."""
    from rc_worker.controller import create_app

    token = config.token or secrets.token_urlsafe(24)
    app = create_app(worker_tokens={token: config.host}, user_tokens=[])
    http = httpx.AsyncClient(
        transport=httpx.ASGITransport(app=app), base_url="http://embedded-controller"
    )
    return attrs.evolve(config, token=token), http
