"""The status and metrics endpoint (``status_listen``), and ``rc-worker status``.

``GET /status`` is the worker's own account of itself as JSON (devices,
their states, jobs and faults, pending reports, the last probe pass);
``GET /metrics`` is Prometheus text. ``GET /healthz`` is liveness: 200
whenever the event loop answers. ``GET /readyz`` is readiness: 200 when the
worker is registered, the controller answered within the last three
heartbeat intervals, and it is not draining; otherwise 503 with the reason.
Served with hypercorn on Trio, on the address the
operator chose; it is read-only and never touches the controller.
"""

from __future__ import annotations

import argparse
import contextlib
import hmac
import json
import os
import stat
import sys
import time
from collections.abc import Awaitable, Callable
from typing import Any, Final, cast

import httpx
import trio
from hypercorn.config import Config as HypercornConfig
from hypercorn.trio import serve as hypercorn_serve
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.routing import Route

from rc_worker import http_input
from rc_worker.config_load import load_config
from rc_worker.core import boundedjson
from rc_worker.core.errors import ConfigError
from rc_worker.listen import bind_problem, serve_asgi
from rc_worker.metrics import WorkerMetrics


def redact_jobs(status: dict[str, Any]) -> dict[str, Any]:
    """``status`` without the ids of jobs: with a job id and the worker's token a job could
    forge another's output, and a job cannot be kept from a TCP port on its own host."""
    out = dict(status)
    out["devices"] = {
        name: {**dev, "job_id": None, "attempt": None} if dev.get("job_id") else dev
        for name, dev in status.get("devices", {}).items()
    }
    out["recovered"] = len(status.get("recovered", []))
    out["jobs_hidden"] = True
    return out


def status_app(
    snapshot: Callable[[], dict[str, Any]],
    metrics: WorkerMetrics,
    *,
    token: str | None = None,
    private: bool = False,
    before_scrape: Callable[[], Awaitable[None]] | None = None,
) -> Starlette:
    """The status app. Job ids are listed only when ``private`` (a Unix socket, whose file
    mode guards it) or when the request presents ``token`` (the ``status_token``) as a bearer
    token. ``before_scrape`` refreshes, off the event loop, what a ``/metrics`` scrape reads
    that costs I/O (the spool's size)."""

    def shows_jobs(request: Request) -> bool:
        if private:
            return True
        if token is None:
            return False
        scheme, _, given = request.headers.get("authorization", "").partition(" ")
        return scheme.lower() == "bearer" and hmac.compare_digest(
            given.strip().encode(), token.encode()
        )

    async def status(request: Request) -> Response:
        data = snapshot()
        return JSONResponse(data if shows_jobs(request) else redact_jobs(data))

    async def healthz(_: Request) -> Response:
        # Liveness only: answering at all proves the event loop runs. A
        # controller outage is not a reason to restart the worker.
        return PlainTextResponse("ok\n")

    async def readyz(_: Request) -> Response:
        snap = snapshot()
        if snap.get("ready"):
            return PlainTextResponse("ready\n")
        reason = snap.get("not_ready_reason") or "not ready"
        return PlainTextResponse(f"not ready: {reason}\n", 503)

    async def prometheus(_: Request) -> Response:
        if before_scrape is not None:
            await before_scrape()
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    return Starlette(
        routes=[
            Route("/status", status),
            Route("/healthz", healthz),
            Route("/readyz", readyz),
            Route("/metrics", prometheus),
        ]
    )


async def serve_status(
    app: Starlette,
    listen: str,
    *,
    task_status: trio.TaskStatus[list[str]] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve ``app`` on ``listen`` (``HOST:PORT`` or ``unix:/path``) until cancelled; reports
    the bound URLs."""
    config = HypercornConfig()
    config.bind = [listen]
    config.accesslog = None
    config.errorlog = None
    if listen.startswith("unix:"):
        path = listen[len("unix:") :]
        # Only the worker's user may connect: the socket lists job ids.
        config.umask = 0o177
        with contextlib.suppress(FileNotFoundError):
            if stat.S_ISSOCK(os.lstat(path).st_mode):
                os.unlink(path)  # a stale socket from an earlier run
        await hypercorn_serve(cast(Any, app), config, task_status=task_status)
        return
    _check_listen(listen)
    # Bound (and closed) here: no unclosed socket for an address taken since the check.
    await serve_asgi(app, config, task_status=task_status)


def _check_listen(listen: str) -> None:
    """Fail with a clear message if ``listen`` cannot be bound (:mod:`rc_worker.listen`)."""
    problem = bind_problem(listen)
    if problem is not None:
        raise ConfigError(
            f"status_listen: {problem}; choose a free address and port, or leave status_listen out"
        )


# -- rc-worker status ---------------------------------------------------------


def configure(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "status", help="show a running worker's devices and jobs (from its status_listen)"
    )
    parser.add_argument("--config", dest="path", help="config file (to find status_listen)")
    parser.add_argument("--url", help="the status endpoint, e.g. http://127.0.0.1:9100")
    parser.add_argument("--json", action="store_true", help="print the raw status JSON")
    parser.add_argument(
        "--token",
        help="the worker's status_token, to see job ids over TCP (default: the config's "
        "status_token when --url is not given; --token wins over it)",
    )
    parser.set_defaults(func=status_main)


ANSWER_MAX_BYTES: Final = 16 << 20
"""A worker's ``/status`` is a few KiB per device; an answer this large is something else,
and reading on would hold all of it in memory."""
ANSWER_TIMEOUT_S: Final = 10.0
"""How long the whole answer may take: httpx's read timeout is per read, so a peer that
sends a byte now and then would otherwise keep ``rc-worker status`` waiting for ever."""


class NotAWorker(ValueError):
    """What answered is not an rc-worker's status endpoint; the message says how it showed."""


class _TooSlow(Exception):
    """The answer did not arrive, whole, within :data:`ANSWER_TIMEOUT_S`."""


def status_main(args: argparse.Namespace) -> int:
    url = args.url
    if url is None:
        try:
            config = load_config(args.path, need_token=False)
        except ConfigError as e:
            print(f"rc-worker: {e}", file=sys.stderr)
            return 2
        if config.status_listen is None:
            print(
                "rc-worker: the config sets no status_listen; set it (e.g. "
                "status_listen: 127.0.0.1:9100) and restart the worker, or pass --url",
                file=sys.stderr,
            )
            return 2
        url = config.status_listen
        # A token typed now is meant now: it wins over the config's (which may be
        # unset, or readable only to the worker's own user) rather than being dropped.
        token = config.status_token if args.token is None else args.token
        check = (
            "check that status_listen in the config is the address this host's rc-worker "
            "serves (restart the worker after changing it) and that no other service uses it"
        )
    else:
        token = args.token
        check = (
            "check that --url is the address in the worker's status_listen "
            "(e.g. 127.0.0.1:9100 or unix:/run/rc-worker/status.sock)"
        )
    problem = _input_problem(url, args.token, url_from_config=args.url is None)
    if problem is not None:
        print(f"rc-worker: {problem}", file=sys.stderr)
        return 2
    if not url.startswith("unix:") and "://" not in url:
        url = "http://" + url
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    try:
        code, body = _fetch(url, headers)
        data = read_answer(code, body)
    except httpx.InvalidURL as e:  # what _input_problem's check let through, if anything
        print(
            f"rc-worker: {url!r} is not a usable address ({_one_line(e)}); {URL_HELP}",
            file=sys.stderr,
        )
        return 2
    except (httpx.TimeoutException, _TooSlow):
        print(
            f"rc-worker: what listens at {url} did not answer within {ANSWER_TIMEOUT_S:g}s; "
            f"{check}, and that the worker is not stopped (SIGSTOP) or overloaded",
            file=sys.stderr,
        )
        return 1
    except NotAWorker as e:
        print(
            f"rc-worker: what answered at {url} is not an rc-worker ({e}); {check}", file=sys.stderr
        )
        return 1
    except (httpx.HTTPError, ValueError) as e:
        print(
            f"rc-worker: cannot read the worker's status at {url}: {_one_line(e)}",
            file=sys.stderr,
        )
        return 1
    if args.json:
        print(json.dumps(data, indent=2, sort_keys=True))
    else:
        print(format_status(data))
    return 0


URL_HELP = "give HOST:PORT, http://HOST:PORT or unix:/path/to/socket, as in status_listen"


def _input_problem(url: str, token: str | None, *, url_from_config: bool) -> str | None:
    """What keeps ``url`` and the ``--token`` from being asked at all, as one line, or None.

    A ``HOST:PORT`` is an ``http://`` URL; any other scheme (``ftp://x``) is refused, not
    made into ``http://ftp://x`` and reported as a host that cannot be found. A token that
    cannot go in a header was a "cannot read the worker's status" (exit 1), as if the
    worker were at fault. The config's ``status_token`` is not checked here: loading the
    config refused it already, at its line.
    """
    if not url.startswith("unix:"):
        given = url if "://" in url or not url.strip() else "http://" + url
        problem = http_input.url_problem(given, "worker status", URL_HELP)
        if problem is not None:
            return f"{'status_listen' if url_from_config else '--url'}: {problem}"
    if token is not None:
        fix = "give the worker's status_token exactly as its config has it"
        if not token:  # "$(cat missing)": sending none would quietly hide job ids
            return f"--token: the status token is empty; {fix}, or leave --token out"
        problem = http_input.token_problem(token, "status token", fix)
        if problem is not None:
            return f"--token: {problem}"
    return None


def _fetch(url: str, headers: dict[str, str]) -> tuple[int, bytes]:
    """``GET /status`` at ``url`` (``http(s)://…`` or ``unix:/path``): the
    status code and at most :data:`ANSWER_MAX_BYTES` of the body, within
    :data:`ANSWER_TIMEOUT_S` in all."""
    if url.startswith("unix:"):
        transport: httpx.HTTPTransport | None = httpx.HTTPTransport(uds=url[len("unix:") :])
        base = "http://worker"
    else:
        transport = None
        base = url
    deadline = time.monotonic() + ANSWER_TIMEOUT_S
    data = bytearray()
    with (
        httpx.Client(transport=transport, base_url=base, timeout=ANSWER_TIMEOUT_S) as client,
        client.stream("GET", "/status", headers=headers) as response,
    ):
        for chunk in response.iter_bytes():
            data += chunk
            if len(data) > ANSWER_MAX_BYTES:
                raise NotAWorker(
                    f"its /status answer is larger than {ANSWER_MAX_BYTES >> 20} MiB, "
                    "which no worker sends"
                )
            if time.monotonic() > deadline:
                raise _TooSlow
        return response.status_code, bytes(data)


def read_answer(code: int, body: bytes) -> dict[str, Any]:
    """The status in an answer to ``GET /status``, or :class:`NotAWorker` saying why it
    is not a worker's: :func:`format_status` can show whatever this returns."""
    if not 200 <= code < 300:
        raise NotAWorker(f"it answered GET /status with HTTP {code}")
    try:
        data = boundedjson.loads(body)
    except ValueError as e:
        raise NotAWorker(f"its /status answer is not JSON: {_one_line(e)}") from None
    problem = status_problem(data)
    if problem is not None:
        raise NotAWorker(f"its /status answer {problem}")
    return cast(dict[str, Any], data)


def status_problem(data: object) -> str | None:
    """What keeps ``data`` from being what a worker's ``GET /status`` says
    (:meth:`rc_worker.worker.Worker.status`), or None. Only what ``rc-worker status`` reads
    is checked, so that a newer worker's additions still show."""
    if not isinstance(data, dict):
        return f"is a JSON {boundedjson.kind(data)}, not an object"
    for key in ("version", "host"):
        if not isinstance(data.get(key), str):
            return f'has no "{key}" string'
    problem = _kinds(data, {"session": str, "not_ready_reason": str}, nullable=True)
    if problem is None:
        problem = _kinds(data, {"reports_pending": int})
    if problem is not None:
        return f"has {problem}"
    devices = data.get("devices")
    if not isinstance(devices, dict):
        return 'has no "devices" object'
    for name, dev in devices.items():
        where = f"device {_quote(name)}"
        if not isinstance(dev, dict):
            return f"has {where} as a JSON {boundedjson.kind(dev)}, not an object"
        for key in ("state", "idle_behavior"):
            if not isinstance(dev.get(key), str):
                return f'has no "{key}" string for {where}'
        problem = _kinds(
            dev, {"job_id": str, "attempt": int, "held_for_health": str}, nullable=True
        )
        faults = dev.get("faults", [])
        if problem is None and not (
            isinstance(faults, list) and all(isinstance(f, str) for f in faults)
        ):
            problem = '"faults" that is not a list of strings'
        if problem is not None:
            return f"has {problem} for {where}"
    return None


def _kinds(data: dict[str, Any], kinds: dict[str, type], *, nullable: bool = False) -> str | None:
    """Which of ``kinds`` (key: type) ``data`` holds with another type; absent is fine."""
    for key, kind in kinds.items():
        if key not in data or (nullable and data[key] is None):
            continue
        value = data[key]
        # bool is an int to Python, never to a worker.
        if isinstance(value, bool) or not isinstance(value, kind):
            return f'"{key}" as a JSON {boundedjson.kind(value)}'
    return None


def _quote(name: str) -> str:
    # JSON escapes newlines and control characters: the message stays one line.
    text = json.dumps(name)
    return text if len(text) <= 40 else text[:36] + '..."'


def _one_line(e: BaseException) -> str:
    text = " ".join(str(e).split())
    return text or type(e).__name__


def format_status(data: dict[str, Any]) -> str:
    flags = [k for k in ("draining", "stopping") if data.get(k)]
    lines = [
        f"host {data.get('host')}  session {data.get('session') or '-'}"
        + (f"  ({', '.join(flags)})" if flags else ""),
        f"reports pending: {data.get('reports_pending', 0)}",
        "ready" if data.get("ready") else f"not ready: {data.get('not_ready_reason') or '-'}",
        f"{'DEVICE':<12} {'STATE':<12} {'IDLE':<6} {'JOB':<24} FAULTS",
    ]
    for name, dev in sorted(data.get("devices", {}).items()):
        job = f"{dev['job_id']}#{dev['attempt']}" if dev.get("job_id") else "-"
        faults = ",".join(dev.get("faults", [])) or "-"
        lines.append(f"{name:<12} {dev['state']:<12} {dev['idle_behavior']:<6} {job:<24} {faults}")
        if dev.get("held_for_health"):
            lines.append(f"{'':<12} held for health: {dev['held_for_health']}")
    return "\n".join(lines)
