"""``rc-worker run``: the worker as a long-lived daemon, with its signals.

Signals are received in the root task and turned into drain or cancel:

- first SIGTERM or SIGINT: drain (no new work; running jobs finish, held
  devices are released, every report delivered; exit 0), bounded by
  ``shutdown_grace``;
- a second SIGTERM or SIGINT, or SIGQUIT: stop running jobs (grace ceilings
  honoured), report, exit 0;
- SIGHUP: run a probe pass and re-read the sheets now.

A failure is one line naming the cause and the fix (``operator_errors``),
exit 2 when restarting cannot help, else 1; with ``--log-level debug`` the
traceback follows it. Under systemd (``$NOTIFY_SOCKET``) it speaks
``Type=notify`` (``sd_notify``).
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import secrets
import signal
import sys
from collections import Counter
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack
from typing import Any

import attrs
import httpx
import trio

from rc_worker.config_load import load_config
from rc_worker.core.config import ENV_TOKEN, FOREIGN_ENV_VARS, Config
from rc_worker.core.errors import ConfigError, RcWorkerError
from rc_worker.logs import setup_logging
from rc_worker.operator_errors import EXIT_FAILED, EXIT_RESTART_WONT_HELP, unexpected
from rc_worker.sd_notify import Notifier, status_line
from rc_worker.worker import Worker

log = logging.getLogger("rc_worker.main")

# How often the STATUS= line for systemd is brought up to date.
STATUS_EVERY_S = 1.0

_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGQUIT, signal.SIGHUP)


TOKEN_FD_VAR = "RC_TOKEN_FD"
"""Set by :func:`exec_without_token`: the descriptor the re-executed worker reads its token from."""
MAX_TOKEN_BYTES = 16 * 1024


def exec_without_token() -> None:
    """Re-execute this process without ``RC_TOKEN`` (nor the rc client's and controller's
    credentials, :data:`~rc_worker.core.config.FOREIGN_ENV_VARS`) in its environment.

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
        return EXIT_RESTART_WONT_HELP
    # The command line wins over the file.
    level = getattr(args, "log_level", None) or config.log_level
    fmt = getattr(args, "log_format", None) or config.log_format
    setup_logging(level, fmt, host=config.host)
    report = _Reporter(json_lines=fmt == "json", debug=level == "debug")
    code = 0
    try:
        trio.run(serve, config)
    except* KeyboardInterrupt:
        code = 130
    except* ConfigError as bad_settings:
        # Bad settings found only at start (state_dir, status_listen, a token
        # the controller refuses): exit 2, which a service manager can be told
        # not to restart on.
        for err in _leaves(bad_settings):
            report(str(err), err)
        code = EXIT_RESTART_WONT_HELP
    except* RcWorkerError as failures:
        for failure in _leaves(failures):
            report(str(failure), failure)
        code = code or EXIT_FAILED
    except* Exception as others:
        for other in _leaves(others):
            report(unexpected(other), other)
        code = code or EXIT_FAILED
    return code


class _Reporter:
    """Prints a failure as one line: ``rc-worker: ...``, or a JSON log line."""

    def __init__(self, *, json_lines: bool, debug: bool) -> None:
        self.json_lines = json_lines
        self.debug = debug

    def __call__(self, message: str, exc: BaseException) -> None:
        if self.json_lines or self.debug:
            log.error("%s", message, exc_info=exc if self.debug else None)
        else:
            print(f"rc-worker: {message}", file=sys.stderr)


def _leaves(group: BaseExceptionGroup[Any]) -> list[BaseException]:
    out: list[BaseException] = []
    for exc in group.exceptions:
        out.extend(_leaves(exc) if isinstance(exc, BaseExceptionGroup) else [exc])
    return out


async def serve(config: Config, *, notifier: Notifier | None = None) -> None:
    """Run a worker until a signal drains or stops it."""
    notifier = notifier if notifier is not None else Notifier()
    async with AsyncExitStack() as stack:
        http: httpx.AsyncClient | None = None
        if config.controller_url is None:
            config, http = embedded_controller(config)
            await stack.enter_async_context(http)
            log.info("no controller_url: serving an embedded reference controller in-process")
        worker = Worker(config, http=http)
        with trio.open_signal_receiver(*_SIGNALS) as signals:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(_handle_signals, signals, worker, notifier)
                if notifier.enabled:
                    nursery.start_soon(_tell_service_manager, worker, notifier)
                await worker.run()
                nursery.cancel_scope.cancel()


async def _handle_signals(signals: AsyncIterator[int], worker: Worker, notifier: Notifier) -> None:
    terms = 0
    async for signum in signals:
        name = signal.Signals(signum).name
        if signum == signal.SIGHUP:
            log.info("SIGHUP: probing and re-reading sheets")
            worker.reprobe()
        elif signum == signal.SIGQUIT:
            log.info("SIGQUIT: stopping running jobs now")
            notifier.notify("STOPPING=1")
            worker.stop()
        else:
            terms += 1
            notifier.notify("STOPPING=1")
            if terms == 1:
                log.info("%s: draining (send it again to stop running jobs)", name)
                worker.drain()
            else:
                log.info("%s again: stopping running jobs", name)
                worker.stop()


async def _tell_service_manager(worker: Worker, notifier: Notifier) -> None:
    """READY=1 after the first register, then STATUS= whenever the device counts change."""
    async with trio.open_nursery() as nursery:
        if notifier.watchdog_interval is not None:
            nursery.start_soon(_watchdog, notifier, notifier.watchdog_interval)
        notifier.notify(
            f"STATUS=registering with the controller at {', '.join(worker.config.controller_urls)}"
        )
        await worker.registered.wait()
        last = _status(worker)
        notifier.notify("READY=1", last)
        while True:
            await trio.sleep(STATUS_EVERY_S)
            line = _status(worker)
            if line != last:
                notifier.notify(line)
                last = line


def _status(worker: Worker) -> str:
    counts = Counter(str(dev.lease.state) for dev in worker.devices.values())
    line = status_line(counts)
    return line + (" (draining)" if worker.draining else "")


async def _watchdog(notifier: Notifier, interval: float) -> None:
    # Sent from the event loop itself: a wedged loop stops the pings, and
    # systemd restarts the worker (WatchdogSec=).
    while True:
        notifier.notify("WATCHDOG=1")
        await trio.sleep(interval)


def embedded_controller(config: Config) -> tuple[Config, httpx.AsyncClient]:
    """An in-process reference controller and a client wired to it."""
    from rc_worker.controller import create_app

    token = config.token or secrets.token_urlsafe(24)
    app = create_app(worker_tokens={token: config.host}, user_tokens=[])
    http = httpx.AsyncClient(
        transport=httpx.ASGITransport(app=app), base_url="http://embedded-controller"
    )
    return attrs.evolve(config, token=token), http
