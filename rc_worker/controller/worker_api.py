"""The endpoints a worker calls (docs/protocol.md, "Endpoints used by the worker")."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator

import anyio
import attrs
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from rc_worker.controller import wire
from rc_worker.controller.context import (
    Controller,
    Principal,
    controller_of,
    heartbeat_job_ids,
    json_body,
    query_int,
    register_job_ids,
)
from rc_worker.controller.errors import ApiError, Conflict, StaleAttempt, TooLarge
from rc_worker.controller.messages import Assignment
from rc_worker.controller.state import host_topic
from rc_worker.core.model import PROTOCOL_VERSION
from rc_worker.core.protocol import (
    DeregisterRequest,
    OkReply,
    OutputReply,
    PollReply,
    StateReply,
    unstructure,
)

MAX_OUTPUT_CHUNK = 16 * 1024 * 1024
COMMIT_OUTPUT_BYTES = 4 * 1024 * 1024
"""A durable store commits a streamed body every this many bytes, not only at its end: what
waits for a commit sits in memory twice (the job's buffer and the journal's pieces), so a
16 MiB body would otherwise cost its size several times over per job."""

log = logging.getLogger("rc_worker.controller")


def _ok() -> JSONResponse:
    return JSONResponse(unstructure(OkReply()))


async def register(request: Request) -> Response:
    ctl = controller_of(request)
    host = request.path_params["host"]
    try:
        ctl.require_worker(request, host)
        req = wire.register(await json_body(request))
    except ApiError:
        ctl.store.stats.registrations["refused"] += 1  # the store counts its own refusals
        raise
    if req.protocol != PROTOCOL_VERSION:
        log.warning(
            "host %s registered with protocol %d, this controller speaks %d; upgrade the older one",
            host,
            req.protocol,
            PROTOCOL_VERSION,
        )
    await ctl.ensure_jobs(register_job_ids(req))  # finished ones may live only in the store
    now = ctl.tick()
    return JSONResponse(unstructure(ctl.store.register(host, req, now=now)))


async def heartbeat(request: Request) -> Response:
    ctl = controller_of(request)
    host = request.path_params["host"]
    ctl.require_worker(request, host)
    req = wire.heartbeat(await json_body(request))
    await ctl.ensure_jobs(heartbeat_job_ids(req))  # finished ones may live only in the store
    now = ctl.tick()
    return JSONResponse(unstructure(ctl.store.heartbeat(host, req, now=now)))


async def poll(request: Request) -> Response:
    ctl = controller_of(request)
    host = request.path_params["host"]
    ctl.require_worker(request, host)
    req = wire.poll(await json_body(request))
    session, ready, wait_s, withdrawn = (
        req.session,
        list(req.ready),
        req.wait_s,
        list(req.withdrawn),
    )
    known = {(c.job_id, c.attempt) for c in req.known_cancels}
    # A host watch: cancels, and (when the worker sent the token it knows) idle
    # behaviour changes and clears, all answered at once.
    watch = _Watch(known, req.known_control) if req.watch_cancels else None
    cfg = ctl.store.config
    wait = min(cfg.poll_wait_s if wait_s is None else wait_s, cfg.max_poll_wait_s)
    offers = ctl.store.open_poll(host, ready, withdrawn)
    ctl.store.stats.polls_parked += 1
    try:
        return await _long_poll(ctl, request, host, session, ready, offers, watch, wait)
    finally:
        ctl.store.stats.polls_parked -= 1
        ctl.store.close_poll(host, offers)


async def _long_poll(
    ctl: Controller,
    request: Request,
    host: str,
    session: str,
    ready: list[str],
    offers: dict[str, int],
    watch: _Watch | None,
    wait: float,
) -> Response:
    deadline = ctl.now() + wait
    assignments: list[Assignment] = []
    answer = PollReply()
    error: ApiError | None = None
    async with anyio.create_task_group() as tg:
        # A worker that hung up must not be handed work nobody will read.
        tg.start_soon(_cancel_on_disconnect, request, tg.cancel_scope)
        try:
            while True:
                seen = ctl.changes.version
                now = ctl.tick()
                assignments = ctl.store.poll(host, session, ready, now=now, offers=offers)
                fresh = False
                if watch is not None:
                    answer = ctl.store.watch_answer(
                        host, session, orders=watch.known_control is not None
                    )
                    fresh = watch.news(answer)
                if assignments or fresh or now >= deadline or ctl.store.superseded(host, offers):
                    # Superseded: the worker polled again with an updated ready set
                    # (a device it listed here stopped being offerable): answer now.
                    break
                # Woken only by a change to this host (or a job aimed at its devices).
                await ctl.wait_change(seen, deadline, host_topic(host))
        except ApiError as e:
            # Caught here, not outside: out of the task group it would arrive wrapped.
            error = e
        tg.cancel_scope.cancel()
    if error is not None:
        raise error
    return JSONResponse(unstructure(attrs.evolve(answer, assignments=tuple(assignments))))


@attrs.frozen
class _Watch:
    """What a host watch's worker already has: the cancels and the control token it
    sent. Anything else is news, answered at once."""

    known: set[tuple[str, int]] = attrs.field(hash=False)
    known_control: str | None

    def news(self, answer: PollReply) -> bool:
        if any((c.job_id, c.attempt) not in self.known for c in answer.cancel):
            return True
        # A worker that sent no token (an older one) hears idle changes and clears at
        # its heartbeat, as before; answering it at once would answer it again and again.
        return self.known_control is not None and self.known_control != answer.control


async def deregister(request: Request) -> Response:
    ctl = controller_of(request)
    host = request.path_params["host"]
    ctl.require_worker(request, host)
    session = wire.parse(await json_body(request), DeregisterRequest).session
    now = ctl.tick()
    ctl.store.deregister(host, session, now=now)
    return _ok()


async def _cancel_on_disconnect(request: Request, scope: anyio.CancelScope) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            scope.cancel()
            return


def _check_session_host(ctl: Controller, p: Principal, session: str) -> None:
    ctl.check_host(p, ctl.store.session_host(session))


def _check_attempt_sender(
    ctl: Controller, p: Principal, request: Request, job_id: str, attempt: int
) -> None:
    """Output and stdin are addressed by attempt. The token must act for the attempt's
    host, and a session, when sent, must be live and of that same host: with a
    fleet-wide token, a worker still running an attempt the controller has offered
    elsewhere under the same number would otherwise write into (or drain the stdin of)
    the new attempt."""
    session = request.query_params.get("session")
    session_host = None
    if session is not None:
        session_host = ctl.store.session_host(session)
        ctl.check_host(p, session_host)
    host = ctl.store.attempt_host(job_id, attempt)
    ctl.check_host(p, host)
    if session_host is not None and session_host != host:
        raise StaleAttempt(
            f"attempt {attempt} of job {job_id} runs on host {host}, not on {session_host}"
        )


async def start(request: Request) -> Response:
    ctl = controller_of(request)
    p = ctl.require_worker(request)
    req = wire.start(await json_body(request))
    _check_session_host(ctl, p, req.session)
    now = ctl.tick()
    ctl.store.start(request.path_params["job_id"], req, now=now)
    return _ok()


async def output(request: Request) -> Response:
    ctl = controller_of(request)
    p = ctl.require_worker(request)
    job_id = request.path_params["job_id"]
    attempt = query_int(request, "attempt")
    offset = query_int(request, "offset")
    ctl.tick()
    _check_attempt_sender(ctl, p, request, job_id, attempt)
    committed = await _append_as_read(ctl, request, job_id, attempt, offset)
    if ctl.durability is not None:
        # The answer is what is stored: a commit that found the job's output file removed
        # or cut counted it lower (``recount_output``), and the worker resends from there.
        await ctl.durability.flush()
        if ctl.store.in_memory(job_id):
            committed = ctl.store.committed(job_id)
    return JSONResponse(unstructure(OutputReply(committed)))


async def _append_as_read(
    ctl: Controller, request: Request, job_id: str, attempt: int, offset: int
) -> int:
    """Append the body to the job's output piece by piece, as it arrives.

    The worker streams its output (a chunked body of up to MAX_OUTPUT_CHUNK
    bytes); holding a whole body before storing it would cost a copy and the
    body's size in memory, and keep followers waiting for the end. Each piece
    goes through the store's idempotent append at its own offset, so a body
    that breaks off midway leaves a correct prefix committed, and the
    worker's retry resends from its start (bytes already held are ignored).
    """
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > MAX_OUTPUT_CHUNK:
        raise _too_large()
    received = 0
    committed: int | None = None
    async with contextlib.aclosing(request.stream()) as stream:
        try:
            async for piece in stream:
                if not piece:
                    continue
                received += len(piece)
                if received > MAX_OUTPUT_CHUNK:
                    raise _too_large()
                committed = ctl.store.append_output(job_id, attempt, offset, piece)
                offset += len(piece)
                if (
                    ctl.durability is not None
                    and ctl.store.output_in_memory(job_id) >= COMMIT_OUTPUT_BYTES
                ):
                    await ctl.durability.flush()  # StoreUnavailable: 503, body drained
        except ApiError:
            # Read the rest before answering (a gap, a stale attempt): a client
            # still sending its body would otherwise meet a closed connection,
            # take it for a transient failure, and resend the same body forever.
            try:
                await _drain(stream, received)
            except ClientDisconnect:
                # Gone meanwhile: it needs no answer, nor a traceback.
                log.info(
                    "job %s attempt %d: the worker hung up while its refused output was read",
                    job_id,
                    attempt,
                )
            raise
        except ClientDisconnect:
            # The worker broke its body off (a spool that read back short, a worker
            # stopped mid-request): what came is appended, and its next request asks
            # from there. Nobody is left to read the answer; not an error of the
            # controller's, so no traceback.
            log.info(
                "job %s attempt %d: the worker broke off its output after %d bytes",
                job_id,
                attempt,
                received,
            )
    if committed is None:
        # An empty body asks where the controller is.
        committed = ctl.store.append_output(job_id, attempt, offset, b"")
    return committed


async def _drain(stream: AsyncIterator[bytes], received: int) -> None:
    async for piece in stream:
        received += len(piece)
        if received > MAX_OUTPUT_CHUNK:
            break


def _too_large() -> TooLarge:
    return TooLarge(f"body larger than {MAX_OUTPUT_CHUNK} bytes; send less per request")


async def finish(request: Request) -> Response:
    ctl = controller_of(request)
    p = ctl.require_worker(request)
    req = wire.finish(await json_body(request))
    _check_session_host(ctl, p, req.session)
    now = ctl.tick()
    job = ctl.store.finish(request.path_params["job_id"], req, now=now)
    return JSONResponse(unstructure(StateReply(job.state)))


async def labels(request: Request) -> Response:
    ctl = controller_of(request)
    host = request.path_params["host"]
    ctl.require_worker(request, host)
    req = wire.labels(await json_body(request))
    session, update = req.session, req.update
    now = ctl.tick()
    ctl.store.put_labels(host, session, update, now=now)
    return _ok()


async def sheets(request: Request) -> Response:
    ctl = controller_of(request)
    host = request.path_params["host"]
    ctl.require_worker(request, host)
    req = wire.sheets(await json_body(request))
    session, update = req.session, req.sheets
    now = ctl.tick()
    ctl.store.put_sheets(host, session, update, now=now)
    return _ok()


async def fault(request: Request) -> Response:
    ctl = controller_of(request)
    host = request.path_params["host"]
    ctl.require_worker(request, host)
    req = wire.fault(await json_body(request))
    now = ctl.tick()
    device = ctl.store.raise_fault(host, request.path_params["device"], req, now=now)
    return JSONResponse(unstructure(StateReply(device.state)))


async def stdin(request: Request) -> Response:
    ctl = controller_of(request)
    p = ctl.require_worker(request)
    job_id = request.path_params["job_id"]
    attempt = query_int(request, "attempt")
    ctl.tick()
    _check_attempt_sender(ctl, p, request, job_id, attempt)
    if not ctl.store.job(job_id).spec.stdin:
        raise Conflict(f"job {job_id} was not submitted with stdin", code="no_stdin")
    return StreamingResponse(
        ctl.stdin.drain(ctl, job_id, attempt), media_type="application/octet-stream"
    )


def routes() -> list[Route]:
    return [
        Route("/v1/hosts/{host}/register", register, methods=["POST"]),
        Route("/v1/hosts/{host}/heartbeat", heartbeat, methods=["POST"]),
        Route("/v1/hosts/{host}/poll", poll, methods=["POST"]),
        Route("/v1/hosts/{host}/deregister", deregister, methods=["POST"]),
        Route("/v1/hosts/{host}/labels", labels, methods=["PUT"]),
        Route("/v1/hosts/{host}/sheets", sheets, methods=["PUT"]),
        Route("/v1/hosts/{host}/devices/{device}/fault", fault, methods=["POST"]),
        Route("/v1/jobs/{job_id}/start", start, methods=["POST"]),
        Route("/v1/jobs/{job_id}/output", output, methods=["POST"]),
        Route("/v1/jobs/{job_id}/finish", finish, methods=["POST"]),
        Route("/v1/jobs/{job_id}/stdin", stdin, methods=["GET"]),
    ]
