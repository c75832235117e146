"""The endpoints people call through the ``rc`` client (docs/protocol.md)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import aclosing

from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from rc_worker.controller import wire
from rc_worker.controller.context import Controller, User, controller_of, json_body, query_int
from rc_worker.controller.errors import ApiError, BadRequest, Conflict, Forbidden
from rc_worker.controller.messages import JOB_STATES
from rc_worker.controller.pool import DEFAULT_CLASS_LABEL
from rc_worker.controller.state import job_topic
from rc_worker.core.protocol import (
    ClearReply,
    DevicesReply,
    EventsPage,
    HostClearReply,
    JobsPage,
    RetireReply,
    StdinReply,
    SubmitReply,
    unstructure,
)

MAX_EVENTS_PER_PAGE = 1000
MAX_JOBS_PER_PAGE = 10_000
MAX_DEVICES_PER_PAGE = 10_000
MAX_EVENTS_WAIT_S = 60.0
STREAM_CHUNK = 1 << 20
"""Output is read (from memory or the store beneath) and sent this much at a time: one
thread hop and one query per MiB for a stored output, and at most this much held per reader."""


def _user(request: Request) -> Controller:
    ctl = controller_of(request)
    ctl.require_user(request)
    ctl.tick()
    return ctl


def _admin(request: Request, what: str) -> tuple[Controller, User]:
    ctl = controller_of(request)
    user = ctl.require_admin(request, what)
    ctl.tick()
    return ctl, user


async def submit(request: Request) -> Response:
    ctl = controller_of(request)
    user = ctl.require_user(request)
    ctl.tick()
    req = wire.submit(await json_body(request))
    kwargs = wire.submit_kwargs(req.spec)
    if req.strict:
        # Checked and submitted with no await in between: the devices cannot change meanwhile.
        why = ctl.store.pending(kwargs["select"], kwargs["device"])
        if why.code == "no_match":
            raise Conflict(
                f"no registered device could ever run this job: {why.reason}", code="no_match"
            )
    job_id = ctl.store.submit(**kwargs, submitted_by=user.name)
    job = ctl.store.job(job_id)
    return JSONResponse(unstructure(SubmitReply(job_id, job.pending_reason, job.pending_code)))


async def list_jobs(request: Request) -> Response:
    ctl = _user(request)
    state = request.query_params.get("state")
    q = request.query_params
    if state is not None and state not in JOB_STATES:
        raise BadRequest(f"state: {state!r} is not one of {', '.join(sorted(JOB_STATES))}")
    where = ctl.store.placed_on(q.get("host"), q.get("select", ""))
    if not any(k in q for k in ("limit", "after", "order")):
        if ctl.durability is not None:
            # Finished jobs live in the store beneath, not in memory: read in a thread.
            jobs, _ = await ctl.durability.jobs_page(
                state, after=None, limit=None, newest_first=False, where=where
            )
        else:
            jobs = ctl.store.jobs(state, where)
        return JSONResponse(unstructure(JobsPage(tuple(jobs))))
    limit = query_int(request, "limit", MAX_JOBS_PER_PAGE)
    if not 1 <= limit <= MAX_JOBS_PER_PAGE:
        raise BadRequest(f"limit: must be between 1 and {MAX_JOBS_PER_PAGE}")
    order = q.get("order", "asc")
    if order not in ("asc", "desc"):
        raise BadRequest(f"order: {order!r} is not asc or desc")
    after = query_int(request, "after") if "after" in q else None
    if ctl.durability is not None:
        page, nxt = await ctl.durability.jobs_page(
            state, after=after, limit=limit, newest_first=order == "desc", where=where
        )
    else:
        page, nxt = ctl.store.jobs_page_info(
            state, after=after, limit=limit, newest_first=order == "desc", where=where
        )
    return JSONResponse(unstructure(JobsPage(tuple(page), nxt)))


async def get_job(request: Request) -> Response:
    ctl = _user(request)
    return JSONResponse(ctl.store.job(request.path_params["job_id"]).to_json())


async def get_output(request: Request) -> Response:
    ctl = _user(request)
    job_id = request.path_params["job_id"]
    offset = query_int(request, "offset", 0)
    if offset < 0:
        raise BadRequest("offset: must not be negative")
    job = ctl.store.job(job_id)
    if request.query_params.get("follow", "").lower() not in ("1", "true", "yes"):
        # Streamed in chunks up to what is committed now: never a copy of the whole output.
        # The first chunk is read before the length is sent: a read that finds the output's
        # file cut counts it lower first (``OutputRecounted``), and the length sent is then
        # the one counted after it, not one the body could never reach.
        end = job.committed_bytes
        first = b""
        if end > offset:
            first = await ctl.read_output(job_id, offset, min(STREAM_CHUNK, end - offset))
        job = ctl.store.job(job_id)
        end = min(end, job.committed_bytes)
        return StreamingResponse(
            _snapshot(ctl, job_id, offset, end, first[: max(end - offset, 0)]),
            media_type="application/octet-stream",
            headers={
                "X-RC-Job-State": job.state,
                "X-RC-Committed": str(job.committed_bytes),
                "Content-Length": str(max(end - offset, 0)),
            },
        )
    return StreamingResponse(
        _follow(ctl, job_id, offset),
        media_type="application/octet-stream",
        headers={"X-RC-Job-State": job.state},
    )


async def _snapshot(
    ctl: Controller, job_id: str, offset: int, end: int, first: bytes
) -> AsyncIterator[bytes]:
    if first:
        yield first
    pos = offset + len(first)
    while pos < end:
        # From memory, or from the store beneath for what was committed there.
        data = await ctl.read_output(job_id, pos, min(STREAM_CHUNK, end - pos))
        if not data:
            return
        pos += len(data)
        yield data


async def _follow(ctl: Controller, job_id: str, offset: int) -> AsyncIterator[bytes]:
    pos = offset
    while True:
        seen = ctl.changes.version
        ctl.tick()
        # The job's state is read before the output: bytes committed just before the finish
        # are then always sent before the stream ends, even across the await of a read from
        # the store beneath (the output only grows).
        ended = ctl.store.job(job_id).terminal
        data = await ctl.read_output(job_id, pos, STREAM_CHUNK)
        if data:
            pos += len(data)
            yield data
            continue
        if ended:
            return
        await ctl.wait_change(seen, None, job_topic(job_id))  # its output or state only


def _owner_or_admin(ctl: Controller, user: User, job_id: str, what: str) -> None:
    """A job is its submitter's (or an admin's) to cancel or to feed."""
    owner = ctl.store.job(job_id).submitted_by
    if owner != user.name and not user.admin:
        raise Forbidden(
            f"job {job_id} was submitted by {owner or 'nobody known'}; "
            f"only they or an admin may {what}"
        )


async def put_stdin(request: Request) -> Response:
    ctl = controller_of(request)
    user = ctl.require_user(request)
    ctl.tick()
    job_id = request.path_params["job_id"]
    _owner_or_admin(ctl, user, job_id, "write its standard input")
    try:
        # Closed here, not left to the garbage collector, when the job ends mid-upload.
        async with aclosing(request.stream()) as body:
            try:
                accepted = await ctl.stdin.feed(ctl, job_id, body)
            except ApiError:
                # Read and drop the rest: an HTTP/1.1 client sends its whole body before it
                # reads the answer, and would otherwise see a broken connection, not this error.
                async for _ in body:
                    pass
                raise
    except ClientDisconnect:
        return JSONResponse({"error": "disconnected", "message": "upload dropped"}, 400)
    return JSONResponse(unstructure(StdinReply(accepted)))


async def cancel(request: Request) -> Response:
    ctl = controller_of(request)
    user = ctl.require_user(request)
    ctl.tick()
    job_id = request.path_params["job_id"]
    _owner_or_admin(ctl, user, job_id, "cancel it")
    reason = wire.cancel(await json_body(request, empty_ok=True)).reason
    return JSONResponse(ctl.store.cancel(job_id, reason, by=user.name).to_json())


async def list_devices(request: Request) -> Response:
    ctl = _user(request)
    q = request.query_params
    limit = None
    if "limit" in q:
        limit = query_int(request, "limit")
        if not 1 <= limit <= MAX_DEVICES_PER_PAGE:
            raise BadRequest(f"limit: must be between 1 and {MAX_DEVICES_PER_PAGE}")
    page, nxt = ctl.store.devices_page(
        state=q.get("state"),
        host=q.get("host"),
        select=q.get("select", ""),
        after=q.get("after"),
        limit=limit,
    )
    return JSONResponse(unstructure(DevicesReply(tuple(page), next=nxt)))


def _address(request: Request) -> tuple[str, str]:
    return request.path_params["host"], request.path_params["device"]


async def get_sheet(request: Request) -> Response:
    ctl = _user(request)
    return JSONResponse(ctl.store.sheet(*_address(request)).to_json())


async def clear(request: Request) -> Response:
    ctl, user = _admin(request, "clearing a device")
    host, device = _address(request)
    cleared = ctl.store.clear(host, device, by=user.name)
    return JSONResponse(unstructure(ClearReply(tuple(cleared), ctl.store.device(host, device))))


async def clear_host(request: Request) -> Response:
    ctl, user = _admin(request, "clearing a host")
    host = request.path_params["host"]
    cleared = ctl.store.clear_host(host, by=user.name)
    devices = tuple(d for d in ctl.store.devices() if d.host == host)
    cleared_ids = {name: tuple(ids) for name, ids in cleared.items()}
    return JSONResponse(unstructure(HostClearReply(host, cleared_ids, devices)))


async def idle_behavior(request: Request) -> Response:
    ctl, user = _admin(request, "setting a device's idle behaviour")
    behavior = wire.idle_behavior(await json_body(request)).idle_behavior
    info = ctl.store.set_idle_behavior(*_address(request), behavior, by=user.name)
    return JSONResponse(info.to_json())


async def pool(request: Request) -> Response:
    ctl = _user(request)
    label = request.query_params.get("class") or DEFAULT_CLASS_LABEL
    return JSONResponse(ctl.store.pool(class_label=label))


async def host_drain(request: Request) -> Response:
    ctl, user = _admin(request, "draining a host")
    devices = ctl.store.set_host_idle_behavior(request.path_params["host"], "drain", by=user.name)
    return JSONResponse(unstructure(DevicesReply(tuple(devices))))


async def host_resume(request: Request) -> Response:
    ctl, user = _admin(request, "resuming a host")
    devices = ctl.store.set_host_idle_behavior(request.path_params["host"], "run", by=user.name)
    return JSONResponse(unstructure(DevicesReply(tuple(devices))))


async def host_retire(request: Request) -> Response:
    ctl, user = _admin(request, "retiring a host")
    force = wire.retire(await json_body(request)).force
    host = request.path_params["host"]
    ended = ctl.store.retire_host(host, force=force, by=user.name)
    return JSONResponse(unstructure(RetireReply(host, tuple(ended))))


async def events(request: Request) -> Response:
    ctl = _user(request)
    after = query_int(request, "after", 0)
    limit = min(query_int(request, "limit", MAX_EVENTS_PER_PAGE), MAX_EVENTS_PER_PAGE)
    wait_s = float(min(max(query_int(request, "wait_s", 0), 0), MAX_EVENTS_WAIT_S))
    deadline = ctl.now() + wait_s
    while True:
        seen = ctl.changes.version
        now = ctl.tick()
        found = await ctl.read_events(after, limit)
        if found or now >= deadline:
            break
        await ctl.wait_change(seen, deadline)
    return JSONResponse(unstructure(EventsPage(tuple(found), ctl.store.last_event_seq)))


def routes() -> list[Route]:
    return [
        Route("/v1/jobs", submit, methods=["POST"]),
        Route("/v1/jobs", list_jobs, methods=["GET"]),
        Route("/v1/jobs/{job_id}", get_job, methods=["GET"]),
        Route("/v1/jobs/{job_id}/output", get_output, methods=["GET"]),
        Route("/v1/jobs/{job_id}/stdin", put_stdin, methods=["PUT"]),
        Route("/v1/jobs/{job_id}/cancel", cancel, methods=["POST"]),
        Route("/v1/devices", list_devices, methods=["GET"]),
        Route("/v1/devices/{host}/{device}/sheet", get_sheet, methods=["GET"]),
        Route("/v1/devices/{host}/{device}/clear", clear, methods=["POST"]),
        Route("/v1/hosts/{host}/clear", clear_host, methods=["POST"]),
        Route("/v1/devices/{host}/{device}/idle-behavior", idle_behavior, methods=["POST"]),
        Route("/v1/events", events, methods=["GET"]),
        Route("/v1/pool", pool, methods=["GET"]),
        Route("/v1/hosts/{host}/drain", host_drain, methods=["POST"]),
        Route("/v1/hosts/{host}/resume", host_resume, methods=["POST"]),
        Route("/v1/hosts/{host}/retire", host_retire, methods=["POST"]),
    ]
