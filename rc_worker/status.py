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
from collections.abc import Awaitable, Callable
from typing import Any, cast

import httpx
import trio
from hypercorn.config import Config as HypercornConfig
from hypercorn.trio import serve as hypercorn_serve
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.routing import Route

from rc_worker.config_load import load_config
from rc_worker.core import boundedjson
from rc_worker.core.errors import ConfigError
from rc_worker.listen import bind_problem
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
    await hypercorn_serve(cast(Any, app), config, task_status=task_status)


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
    parser.add_argument("--token", help="the worker's status_token, to see job ids (with --url)")
    parser.set_defaults(func=status_main)


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
        token = config.status_token
    else:
        token = args.token
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    try:
        if url.startswith("unix:"):
            transport = httpx.HTTPTransport(uds=url[len("unix:") :])
            with httpx.Client(transport=transport, base_url="http://worker") as client:
                response = client.get("/status", headers=headers, timeout=10.0)
        else:
            if not url.startswith(("http://", "https://")):
                url = "http://" + url
            response = httpx.get(url.rstrip("/") + "/status", headers=headers, timeout=10.0)
        response.raise_for_status()
        data: Any = boundedjson.loads(response.content)
    except (httpx.HTTPError, ValueError) as e:
        print(f"rc-worker: cannot read the worker's status at {url}: {e}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(data, indent=2, sort_keys=True))
    else:
        print(format_status(data))
    return 0


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
