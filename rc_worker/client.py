"""The worker's side of PROTOCOL.md, over one ``httpx.AsyncClient``.

Every call retries transient failures (connection errors, timeouts, 408,
429, 5xx) forever with capped, fully jittered backoff, honouring
``Retry-After``; the caller bounds it with a cancel scope when it must. A
final 4xx raises ``ControllerError``. ``409 unknown_session`` re-registers
(once per lost session, however many requests noticed) and resends the
request with the new session.
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import (
    AsyncIterable,
    AsyncIterator,
    Awaitable,
    Callable,
    Mapping,
    Sequence,
)
from typing import Any, TypeVar

import httpx
import trio

from rc_worker.core import boundedjson, protocol
from rc_worker.core.errors import ControllerError, UnknownSession
from rc_worker.core.protocol import (
    DeviceReport,
    ErrorReply,
    HeartbeatReply,
    KnownCancel,
    OutputReply,
    PollReply,
    PollRequest,
    ProtocolError,
    RegisterReply,
    StartRequest,
)
from rc_worker.core.retry import Backoff, RetryLog, is_transient_status, retry_after_seconds
from rc_worker.http_body import read_bounded

log = logging.getLogger("rc_worker.client")

RegisterFn = Callable[["ControllerClient"], Awaitable[None]]
# Told of every answer: the endpoint's name and the status ("error" when none came).
AnswerFn = Callable[[str, str], None]
# A request body (a protocol message, or the wire form of one kept on disk), or a
# function giving it afresh at every try. The client adds the live session.
Body = Mapping[str, Any] | protocol.Message
Payload = Body | Callable[[], Body]
T = TypeVar("T")
# A heartbeat's device states, or a function giving them afresh at every try.
DeviceStates = (
    Mapping[str, DeviceReport | Mapping[str, Any]]
    | Callable[[], Mapping[str, DeviceReport | Mapping[str, Any]]]
)
# Raw bytes, or a function giving a fresh stream of them at every try: a
# streamed body cannot be replayed, so a retry starts a new one.
Content = bytes | Callable[[], AsyncIterable[bytes]]

# How long past the long-poll's own wait a poll may take before it counts as
# a timeout: the controller answers at wait_s; this is slack for the network.
POLL_SLACK_S = 15.0

# The retry schedule (retry.Backoff): the first ceiling and the cap, in
# seconds. Read at every request rather than fixed at construction, and
# module-level, because the worker builds its own client: a test harness
# shrinks them for a whole worker (monkeypatch); production never changes them.
MAX_RESPONSE_BYTES = 32 * 2**20
"""The largest answer the worker reads: a poll's batch of assignments is far below this."""

RETRY_BASE_S = 0.2
RETRY_CAP_S = 30.0


class ControllerClient:
    """Typed calls to one controller for one host.

    ``on_unknown_session`` is the worker's register routine; it must call
    ``register`` (which stores the new session) and may do more.
    """

    def __init__(
        self,
        http: httpx.AsyncClient,
        *,
        host: str,
        token: str | None,
        on_unknown_session: RegisterFn | None = None,
        rng: random.Random | None = None,
        on_answer: AnswerFn | None = None,
        urls: Sequence[str] = (),
    ) -> None:
        self._http = http
        # Every controller to try, in order (config ``controller_url`` as a list): a
        # refused connection or a standby's 503 moves the client to the next one.
        self._urls = tuple(urls)
        self._on_answer = on_answer or (lambda endpoint, status: None)
        self._retry_logs: dict[str, RetryLog] = {}
        self.host = host
        self._headers = {"Authorization": f"Bearer {token}"} if token else {}
        self._on_unknown_session = on_unknown_session
        self._rng = rng or random.Random()
        self.session: str | None = None
        self._generation = 0
        self._register_lock = trio.Lock()

    @property
    def generation(self) -> int:
        """How many times this client has registered. A change means the controller may
        be another process now (a restart that lost its store): what it said before, a
        job's committed output offset say, may no longer hold."""
        return self._generation

    @property
    def origin(self) -> str | None:
        """The controller's ``scheme://host[:port]``: the only place the token is sent."""
        base = self._http.base_url
        return f"{base.scheme}://{base.netloc.decode('ascii')}" if base.host else None

    # -- worker endpoints -------------------------------------------------

    async def register(self, payload: Body) -> RegisterReply:
        body = await self._call("POST", f"/v1/hosts/{self.host}/register", payload, session=False)
        session = body.get("session")
        if not isinstance(session, str) or not session:
            raise ControllerError(200, "bad_response", "register answered without a session")
        reply = _reply("register", body, RegisterReply)
        self.session = session
        self._generation += 1
        return reply

    async def heartbeat(self, devices: DeviceStates) -> dict[str, Any]:
        """Report device states; the answer as it came (:meth:`heartbeat_reply` gives
        it as its message). Pass a callable to have them read afresh at every try.

        A heartbeat retried through an outage, or resent after registering
        again, must not carry the states of before: the controller drops a
        pending ``cleared`` for a fault a heartbeat does not report, so a
        stale one (sent before the worker learned of the fault at register)
        would lose the operator's clear for good.
        """

        def body() -> Mapping[str, Any]:
            return {"devices": devices() if callable(devices) else devices}

        return await self._call("POST", f"/v1/hosts/{self.host}/heartbeat", body)

    async def heartbeat_reply(self, devices: DeviceStates) -> HeartbeatReply:
        """:meth:`heartbeat`, its answer as the protocol's message (a malformed one is a
        ``ControllerError`` naming the field)."""
        return _reply("heartbeat", await self.heartbeat(devices), HeartbeatReply)

    async def poll(
        self, ready: list[str], wait_s: float, withdrawn: list[str] | None = None
    ) -> list[object]:
        """Long-poll for assignments to ``ready``; ``withdrawn`` names devices an
        earlier poll still parked listed that are no longer offerable. Each
        assignment comes back raw: the worker checks each on its own."""
        payload = PollRequest(
            protocol.NO_SESSION, ready=tuple(ready), wait_s=wait_s, withdrawn=tuple(withdrawn or ())
        )
        body = await self._call(
            "POST",
            f"/v1/hosts/{self.host}/poll",
            payload,
            read_timeout=wait_s + POLL_SLACK_S,
        )
        return list(_reply("poll", body, PollReply).assignments)

    async def watch(
        self, known: list[tuple[str, int]], known_control: str | None, wait_s: float
    ) -> PollReply:
        """The host watch: a long poll for no device (``watch_cancels``, docs/protocol.md)
        answered as soon as a cancel not in ``known`` exists for this host's jobs, or the
        host's ``control`` (its idle behaviours and clears) is not ``known_control``
        (``""``: none known yet; ``None``: not asked), whose answer then carries them."""
        body = await self._call(
            "POST",
            f"/v1/hosts/{self.host}/poll",
            PollRequest(
                protocol.NO_SESSION,
                wait_s=wait_s,
                watch_cancels=True,
                known_cancels=tuple(KnownCancel(j, n) for j, n in known),
                known_control=known_control,
            ),
            read_timeout=wait_s + POLL_SLACK_S,
        )
        return _reply("poll", body, PollReply)

    async def deregister(self) -> None:
        """Tell the controller this worker is leaving on purpose (after a drain)."""
        await self._call(
            "POST",
            f"/v1/hosts/{self.host}/deregister",
            protocol.DeregisterRequest(protocol.NO_SESSION),
        )

    async def start(self, job_id: str, attempt: int, device: str, boot_id: str) -> None:
        await self._call(
            "POST",
            f"/v1/jobs/{job_id}/start",
            StartRequest(protocol.NO_SESSION, attempt, device, boot_id),
        )

    async def output(
        self, job_id: str, attempt: int, offset: int, data: Content, length: int | None = None
    ) -> int:
        """Append ``data`` at ``offset``; returns the controller's committed offset.

        ``data`` is bytes, or a function returning a stream of them, sent as
        one streamed request body: the bytes go out as they are read, and the
        controller appends them as they arrive. With ``length`` the stream
        must yield exactly that many bytes, declared as the body's
        Content-Length; without it the body is chunked. Each try calls
        it afresh from the same ``offset`` (a retry resends what the
        controller may already hold; it ignores bytes below its committed
        offset). A ``409 gap`` is not an error here: its ``committed`` says
        where to resend from, and the caller carries on from there.
        """
        try:
            body = await self._call(
                "POST",
                f"/v1/jobs/{job_id}/output",
                content=data,
                params={"attempt": attempt, "offset": offset},
                content_length=length,
            )
        except ControllerError as e:
            if e.status == 409 and e.code == "gap":
                try:
                    return protocol.structure(e.body, OutputReply).committed
                except ProtocolError:
                    pass
            raise
        try:
            return protocol.structure(body, OutputReply).committed
        except ProtocolError:
            raise ControllerError(
                200, "bad_response", "output answered without 'committed'"
            ) from None

    async def finish(self, job_id: str, report: Body) -> None:
        """Send a ``finish`` (the wire form the outbox keeps on disk, or the message)."""
        await self._call("POST", f"/v1/jobs/{job_id}/finish", report)

    async def fault(self, device: str, report: Body) -> None:
        await self._call("POST", f"/v1/hosts/{self.host}/devices/{device}/fault", report)

    async def put_labels(self, payload: Body) -> None:
        await self._call("PUT", f"/v1/hosts/{self.host}/labels", payload)

    async def put_sheets(self, sheets: Body) -> None:
        await self._call("PUT", f"/v1/hosts/{self.host}/sheets", sheets)

    async def stdin(self, url: str) -> AsyncIterator[bytes]:
        """Stream a job's standard input from the controller.

        Not retried once bytes have flowed: resuming a stream mid-way could
        repeat or skip input, so a broken stream ends the job's input (EOF)
        and is logged.
        """
        try:
            async with self._http.stream(
                "GET", url, headers=self._headers, timeout=httpx.Timeout(None, connect=30.0)
            ) as response:
                if response.status_code != 200:
                    log.warning(
                        "stdin stream %s answered %s; the job gets EOF", url, response.status_code
                    )
                    return
                async for chunk in response.aiter_bytes():
                    if chunk:
                        yield chunk
        except httpx.HTTPError as e:
            log.warning("stdin stream %s broke (%s); the job gets EOF", url, type(e).__name__)

    # -- the one request loop ---------------------------------------------

    async def _call(
        self,
        method: str,
        path: str,
        payload: Payload | None = None,
        *,
        content: Content | None = None,
        content_length: int | None = None,
        params: Mapping[str, Any] | None = None,
        session: bool = True,
        read_timeout: float | None = None,
    ) -> dict[str, Any]:
        backoff = Backoff(base=RETRY_BASE_S, cap=RETRY_CAP_S, rng=self._rng)
        reregistered = False
        endpoint = endpoint_of(path)
        retry_log = self._retry_logs.setdefault(endpoint, RetryLog())
        while True:
            generation = self._generation
            try:
                try:
                    answer = await self._once(
                        method,
                        path,
                        payload,
                        content,
                        content_length,
                        params,
                        session,
                        read_timeout,
                    )
                except (ControllerError, _Transient) as e:
                    self._note_answer(endpoint, retry_log, e.status)
                    raise
                self._note_answer(endpoint, retry_log, 200)
                return answer
            except UnknownSession:
                if not session or self._on_unknown_session is None:
                    raise
                try:
                    if reregistered:
                        # Forgotten again right after registering (a controller
                        # behind a balancer without shared sessions, a bug):
                        # back off like any other failure, never a hot loop.
                        await trio.sleep(backoff.next_delay())
                    await self._reregister(generation)
                    reregistered = True
                    again = self._retry_logs.get("register again")
                    if again is not None and again.succeeded(trio.current_time()):
                        log.info("registered again after the controller refused it for a while")
                    continue
                except ControllerError as e:
                    # The register was refused, not this request: raising
                    # here would read as "this finish was refused for good"
                    # and the caller would drop a report the controller never
                    # saw. Keep it, and try registering again later.
                    delay = backoff.next_delay()
                    again = self._retry_logs.setdefault("register again", RetryLog())
                    log.log(
                        logging.ERROR if again.failed(trio.current_time()) else logging.DEBUG,
                        "%s %s: registering again was refused (%s); retrying in %.1fs",
                        method,
                        path,
                        e,
                        delay,
                    )
            except _Transient as e:
                if e.failover and self._fail_over():
                    # Another controller may be the active one: ask it soon, not after
                    # a backoff grown on this one's failures.
                    backoff = Backoff(base=RETRY_BASE_S, cap=RETRY_CAP_S, rng=self._rng)
                delay = backoff.next_delay(e.retry_after)
                if retry_log.failed(trio.current_time()):
                    log.warning(
                        "%s: %s; retrying (next in %.1fs, %d failed so far)",
                        endpoint,
                        self._explain(e),
                        delay,
                        retry_log.failures,
                    )
                else:
                    log.debug("%s %s: %s; retrying in %.1fs", method, path, e, delay)
            await trio.sleep(delay)

    def _fail_over(self) -> bool:
        """Move to the next of :attr:`_urls`; False when there is no other."""
        if len(self._urls) < 2:
            return False
        here = str(self._http.base_url).rstrip("/")
        at = next((i for i, u in enumerate(self._urls) if u.rstrip("/") == here), -1)
        target = self._urls[(at + 1) % len(self._urls)]
        log.warning("the controller at %s is not the active one; trying %s", here, target)
        self._http.base_url = httpx.URL(target)
        return True

    def _explain(self, e: _Transient) -> str:
        if e.status is None:
            return (
                f"controller unreachable at {self._http.base_url} ({e}); check that it is "
                "running and that controller_url is right"
            )
        return f"the controller at {self._http.base_url} answered {e}"

    def _note_answer(self, endpoint: str, retry_log: RetryLog, status: int | None) -> None:
        # Any final answer, refusals included, ends an outage.
        self._on_answer(endpoint, "error" if status is None else str(status))
        if status is None or is_transient_status(status):
            return
        outage = retry_log.succeeded(trio.current_time())
        if outage is not None:
            log.info(
                "%s: the controller answers again (after %d failed tries over %.0fs)",
                endpoint,
                outage[0],
                outage[1],
            )

    async def _once(
        self,
        method: str,
        path: str,
        payload: Payload | None,
        content: Content | None,
        content_length: int | None,
        params: Mapping[str, Any] | None,
        session: bool,
        read_timeout: float | None,
    ) -> dict[str, Any]:
        json_body: dict[str, Any] | None = None
        if payload is not None:
            wire = protocol.to_wire(payload() if callable(payload) else payload)
            assert isinstance(wire, dict)
            json_body = wire
            if session:
                json_body["session"] = self.session
        query = dict(params or {})
        if content is not None and session:
            query["session"] = self.session
        headers = self._headers
        if content is not None:
            headers = {**headers, "Content-Type": "application/octet-stream"}
            if content_length is not None:
                # Declared, the body goes out as it is, not chunked (httpx then
                # drops its Transfer-Encoding: chunked).
                headers["Content-Length"] = str(content_length)
        try:
            async with self._http.stream(
                method,
                path,
                json=json_body,
                content=content() if callable(content) else content,
                params=query or None,
                headers=headers,
                timeout=(httpx.USE_CLIENT_DEFAULT if read_timeout is None else read_timeout),
            ) as response:
                data = await _read_bounded(response)
        except httpx.TransportError as e:
            raise _Transient(
                f"{type(e).__name__}: {e}" if str(e) else type(e).__name__,
                # Nobody listens there (a controller that died): another may be active.
                failover=isinstance(e, httpx.ConnectError),
            ) from e
        except httpx.DecodingError as e:
            # A body its Content-Encoding does not decode (a broken proxy, say): not an
            # answer, so retried like a broken connection rather than raised at the caller.
            raise _Transient(f"undecodable answer: {e}") from e
        return _decode(response, data)

    async def _reregister(self, generation: int) -> None:
        assert self._on_unknown_session is not None
        async with self._register_lock:
            # Another request already registered again since this one was sent.
            if self._generation != generation:
                return
            log.warning("the controller forgot session %s; registering again", self.session)
            await self._on_unknown_session(self)


def _reply(endpoint: str, body: dict[str, Any], cls: type[T]) -> T:
    """A success's body as its message; one that does not fit is a final error naming
    the field (a controller that answers like that will not answer better on a retry)."""
    try:
        return protocol.structure(body, cls)
    except ProtocolError as e:
        raise ControllerError(
            200, "bad_response", f"{endpoint} answered a malformed body: {e}"
        ) from None


def parse_retry_after(value: str | None, *, now: float | None = None) -> float | None:
    """Seconds to wait from a ``Retry-After`` header (delta-seconds or an HTTP date).

    ``now`` defaults to the wall clock: a reported timestamp, not a timeout,
    and the only place wall time is read.
    """
    return retry_after_seconds(value, now=time.time() if now is None else now)


def endpoint_of(path: str) -> str:
    """The endpoint's name for logs and metrics: the path's last segment (``heartbeat``)."""
    return path.rstrip("/").rsplit("/", 1)[-1] or path


class _Transient(Exception):
    def __init__(
        self,
        message: str,
        retry_after: float | None = None,
        status: int | None = None,
        *,
        failover: bool = False,
    ) -> None:
        super().__init__(message)
        self.retry_after = retry_after
        self.status = status
        self.failover = failover


async def _read_bounded(response: httpx.Response) -> bytes:
    """The answer's body, refusing (as a transient failure, so with backoff) one above
    :data:`MAX_RESPONSE_BYTES` without holding more than that in memory."""
    data = await read_bounded(response, MAX_RESPONSE_BYTES)
    if data is None:
        raise _Transient(
            f"answer larger than {MAX_RESPONSE_BYTES} bytes (status {response.status_code})"
        )
    return data


def _decode(response: httpx.Response, data: bytes) -> dict[str, Any]:
    status = response.status_code
    try:
        body = boundedjson.loads(data) if data else {}
    except ValueError as e:
        if 200 <= status < 300:
            # A success we cannot read is not a success: retry it like a broken connection.
            raise _Transient(f"unreadable answer (status {status}): {e}") from None
        body = {}
    if not isinstance(body, dict):
        body = {}
    if 200 <= status < 300:
        return body
    retry_after = parse_retry_after(response.headers.get("Retry-After"))
    try:
        said = protocol.structure(body, ErrorReply)
    except ProtocolError:
        said = ErrorReply()
    if is_transient_status(status):
        standby = status == 503 and said.error == "standby"
        raise _Transient(f"status {status}", retry_after, status, failover=standby)
    code = said.error or f"http_{status}"
    message = said.message or response.reason_phrase
    if status == 409 and code == "unknown_session":
        raise UnknownSession(status, code, message, body)
    raise ControllerError(status, code, message, body)
