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
import contextlib
import logging
import os
import secrets
import signal
import sys
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack

import attrs
import httpx
import trio

from rc_worker.config import ENV_TOKEN, FOREIGN_ENV_VARS, Config, load_config
from rc_worker.errors import ConfigError, RcWorkerError
from rc_worker.worker import Worker

log = logging.getLogger("rc_worker.main")

_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGQUIT, signal.SIGHUP)


TOKEN_FD_VAR = "RC_TOKEN_FD"
"""Set by :func:`exec_without_token`: the descriptor the re-executed worker reads its token from."""
MAX_TOKEN_BYTES = 16 * 1024


def exec_without_token() -> None:
    """Re-execute this process without ``RC_TOKEN`` (nor the rc client's and controller's
    credentials, :data:`~rc_worker.config.FOREIGN_ENV_VARS`) in its environment.

    A process's initial environment stays readable in ``/proc/PID/environ`` for
    its whole life (to its user and root), whatever ``os.environ`` later says,
    so a job running as the same user could read the worker's token there. The
    token goes to the new image through a pipe instead (:func:`take_token`).
    Keeps the pid, so service managers see nothing.
    """
    # The rc client's RC_USER_TOKEN and RC_URL of whoever started the worker are none of the
    # worker's business: they go too.
    foreign = [k for k in os.environ if k in FOREIGN_ENV_VARS or k == ENV_TOKEN]
    token = os.environ.get(ENV_TOKEN)
    data = b"" if token is None else token.encode()
    if token is not None and (not data.strip() or len(data) > MAX_TOKEN_BYTES):
        # Nothing secret to move (an empty value), or more than a pipe holds at once:
        # leave it to load_config, which reports what is wrong with it.
        token = None
        foreign.remove(ENV_TOKEN)
    if not foreign:
        return
    env = {k: v for k, v in os.environ.items() if k not in foreign}
    if token is not None:
        read_end, write_end = os.pipe()
        os.write(write_end, data)
        os.close(write_end)
        os.set_inheritable(read_end, True)
        env[TOKEN_FD_VAR] = str(read_end)
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, sys.orig_argv, env)


def take_token() -> dict[str, str]:
    """The environment to load the config with: ``os.environ`` plus the token passed by
    :func:`exec_without_token`, which is read, its descriptor closed, and kept out of
    ``os.environ`` (so no child is given it)."""
    environ = dict(os.environ)
    fd_text = os.environ.pop(TOKEN_FD_VAR, None)
    environ.pop(TOKEN_FD_VAR, None)
    if fd_text is None or not fd_text.isdigit():
        return environ
    fd = int(fd_text)
    try:
        data = os.read(fd, MAX_TOKEN_BYTES + 1)
    except OSError:
        return environ
    finally:
        with contextlib.suppress(OSError):
            os.close(fd)
    environ[ENV_TOKEN] = data.decode("utf-8", "replace")
    return environ


def run_from_cli(args: argparse.Namespace) -> int:
    exec_without_token()
    environ = take_token()
    try:
        config = load_config(args.path, environ=environ)
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
