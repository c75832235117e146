"""Following a job's output from ``rc``, through a controller that may go away.

``rc run`` and ``rc logs -f`` read ``GET /v1/jobs/{id}/output?follow=true``. When the
connection drops (the controller was killed, restarted, or a proxy cut it), the
controller answers ``503`` (a standby not yet active, a store it cannot read now), or a
reverse proxy in front of it answers ``502``/``504`` (the controller behind it is not
reachable, restarting), they
reconnect and resume at the offset they already have, for up to ``--reconnect D``
counted from the last time the controller answered. Past that, or if a restarted
controller no longer knows the job (its store is in memory), they give up with
:class:`ControllerGone`: one line on stderr and exit status 3.
"""

from __future__ import annotations

import base64
import json
import os
import select
import sys
import time
from collections.abc import Callable
from typing import Any, Final

import httpx
import trio

from rc_worker.controller.messages import TERMINAL_STATES
from rc_worker.controller.rc_input import path_segment
from rc_worker.core import boundedjson
from rc_worker.core.durations import format_duration
from rc_worker.core.retry import retry_after_seconds
from rc_worker.http_body import read_bounded

EXIT_CONTROLLER_GONE = 3
RETRY_FIRST_S = 0.25
RETRY_MAX_S = 2.0
LOG_CHUNK = 64 * 1024

ANSWER_MAX_BYTES: Final = 256 << 20
"""The largest answer ``rc`` reads (a page of 1,000 jobs is a few MiB): past it the other end
is not a controller answering one request, and reading on would only fill this machine's
memory."""
ANSWER_TIMEOUT_S: Final = 60.0
"""How long ``rc`` waits for the next byte of an answer that is not a followed stream (a
controller answers in milliseconds; a long-poll of events waits 30 s): one that never
answers is reported rather than waited on for ever."""
ANSWER_TIMEOUT: Final = httpx.Timeout(ANSWER_TIMEOUT_S, connect=10.0)

Sink = Callable[[int, bytes], None]
"""Takes ``(offset, data)`` for each chunk of output, in order."""


class CliError(Exception):
    """A failure to report on stderr with an exit status (1 refused, 2 usage, 3 unreachable)."""

    def __init__(self, message: str, status: int = 1) -> None:
        super().__init__(message)
        self.status = status


class ControllerGone(CliError):
    def __init__(self, message: str) -> None:
        super().__init__(message, EXIT_CONTROLLER_GONE)


class StdoutClosed(CliError):
    """Whoever read stdout closed it (``rc logs J | head -c 10``): it has what it wanted.

    Every ``rc`` command then stops quietly with status 0 (``rc_cli.amain``), as
    ``rc-worker``'s commands do, except ``rc run`` (``--json`` or not), which still reports
    it: its status is the job's, and a quiet 0 would say the job succeeded."""

    def __init__(self, unwritten: int, why: str = "Broken pipe") -> None:
        super().__init__(
            f"cannot write the output to stdout ({why}); {unwritten} bytes were not written"
        )
        self.why = why
        """``Broken pipe``, or ``not open`` for an ``rc`` started without a stdout (``>&-``)."""


NOT_OPEN: Final = "not open"
"""Why nothing can be written to a stream ``rc`` was started without (``rc ps >&-``): Python
then has ``sys.stdout`` (or ``sys.stderr``) None."""


def quiet_stdout() -> None:
    """Point stdout at /dev/null once its reader has gone, so that the interpreter's last
    flush of what is still buffered there cannot fail again (no "Exception ignored")."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (AttributeError, OSError, ValueError):
        pass  # not a real file (captured in tests): nothing to flush at exit


def job_path(job_id: str, *rest: str) -> str:
    """``/v1/jobs/{job_id}[/rest...]`` with the id escaped as one path segment: an id
    holding ``?``, ``#`` or ``%`` (a typo, or an adopted job's id, which comes from a
    worker) must name that job, never cut the path short (``rc logs 'J?x'`` printed
    J's record as its output)."""
    return "/".join(("/v1/jobs", path_segment("job id", job_id), *rest))


def raise_for(r: httpx.Response) -> None:
    if r.is_success:
        return
    raise CliError(f"the controller answered {r.status_code}: {_error_of(r)}")


def _error_of(r: httpx.Response) -> str:
    """``error: message`` from an error answer's body, or ``HTTP N`` if it has none."""
    error = _rc_error(r)
    return f"HTTP {r.status_code}" if error is None else f"{error[0]}: {error[1]}"


UNAVAILABLE: Final = 503
"""A controller that cannot answer now but will (a standby not yet active; the store read
failing, ``store_unavailable``): a followed job waits for it as for a lost connection."""

WAITED_OUT: Final = frozenset({502, UNAVAILABLE, 504})
"""The answers a followed job waits out within ``--reconnect``: :data:`UNAVAILABLE`, and
a reverse proxy's (or gateway's) ``502 Bad Gateway`` and ``504 Gateway Timeout``, which it
answers while the controller behind it restarts (refused, or not answering). An rc
controller never answers 502 or 504 itself. Not ``500``, nor any other 5xx: those are the
controller's own answer to this request, and asking again would get the same."""


def waited_out(status: int) -> bool:
    """Whether an answer of ``status`` to a followed job is waited out (:data:`WAITED_OUT`)
    rather than ends ``rc``."""
    return status in WAITED_OUT


def _rc_error(r: httpx.Response) -> tuple[str, str] | None:
    """``(error, message)`` of an rc controller's error answer, or None for any other body
    (a proxy's HTML page, nothing)."""
    try:
        body: Any = boundedjson.loads(r.content)
        return str(body["error"]), str(body["message"])
    except (ValueError, KeyError, TypeError):
        return None


def _status_line(r: httpx.Response) -> str:
    """``503 standby: message`` for an rc controller's error answer; ``502 Bad Gateway``
    (the status and its reason phrase) for one that is not, as a proxy's."""
    error = _rc_error(r)
    if error is not None:
        return f"{r.status_code} {error[0]}: {error[1]}"
    return f"{r.status_code} {r.reason_phrase or 'HTTP'}".rstrip()


async def read_answer(
    client: httpx.AsyncClient, r: httpx.Response, method: str, path: str
) -> httpx.Response:
    """The whole of the streamed answer ``r`` (to ``method path``), read up to
    :data:`ANSWER_MAX_BYTES`, as a response that holds it; :class:`CliError` past that.

    Every answer ``rc`` reads whole goes through here (its JSON, and the error answer to a
    streamed request): an endless one would otherwise grow this process until killed."""
    data = await read_bounded(r, ANSWER_MAX_BYTES)
    if data is None:
        raise CliError(
            f"the answer to {method} {path} from {client.base_url} is larger than "
            f"{ANSWER_MAX_BYTES >> 20} MiB, which no rc controller sends; check that "
            "--url / RC_URL is an rc controller (rc serve)"
        )
    # Retry-After is kept for a 502/503/504 (Reconnect.unavailable); not the other headers: the
    # content is decoded already, and a Content-Encoding kept with it would decode it again.
    kept = {"Retry-After": r.headers["Retry-After"]} if "Retry-After" in r.headers else {}
    return httpx.Response(r.status_code, headers=kept, content=data)


async def call(client: httpx.AsyncClient, method: str, path: str, **kw: Any) -> Any:
    """One request (``kw`` as for httpx; its ``timeout`` defaults to :data:`ANSWER_TIMEOUT`);
    its answer, a JSON object read up to :data:`ANSWER_MAX_BYTES` (:func:`read_answer`)."""
    kw.setdefault("timeout", ANSWER_TIMEOUT)
    async with client.stream(method, path, **kw) as r:
        answer = await read_answer(client, r, method, path)
    raise_for(answer)
    try:
        body = boundedjson.loads(answer.content)
    except ValueError as e:
        raise CliError(
            f"the controller answered with JSON rc cannot read ({e}); check that "
            "--url / RC_URL is an rc controller (rc serve)"
        ) from None
    if not isinstance(body, dict):
        raise CliError(
            f"the controller answered {method} {path} with a JSON {boundedjson.kind(body)}, not an "
            "object; check that --url / RC_URL is an rc controller (rc serve)"
        )
    return body


def retry_delay(failures: int, left: float, retry_after: float | None = None) -> float:
    """How long to wait after the ``failures``-th failure in a row (1, 2, ...) before the
    next try, with ``left`` seconds of the reconnect window to go.

    Backs off from :data:`RETRY_FIRST_S` to :data:`RETRY_MAX_S`; a controller's
    ``Retry-After`` is a floor (it said when to come back), but never past the window's
    end: a later try would only find the window spent."""
    delay = min(RETRY_FIRST_S * 2.0 ** min(failures - 1, 30), RETRY_MAX_S)
    if retry_after is not None:
        delay = max(delay, retry_after)
    return max(0.0, min(delay, left))


class Reconnect:
    """How long ``rc`` keeps trying while the controller does not answer.

    ``window`` is counted from the first failure since the controller last answered;
    tries back off from 0.25 s to 2 s (:func:`retry_delay`). :meth:`failed` (a lost
    connection) and :meth:`unavailable` (a 502, 503 or 504) sleep before the next try, or raise
    :class:`ControllerGone` once the window is spent.
    """

    def __init__(self, window: float, url: str, job_id: str) -> None:
        self.window = window
        self.url = url
        self.job_id = job_id
        self.since: float | None = None
        self.failures = 0
        self.reconnected = False
        """True once a connection has been lost: a later 404 means the controller forgot it."""

    def answered(self) -> None:
        self.since = None
        self.failures = 0

    async def failed(self, error: httpx.TransportError) -> None:
        self.reconnected = True
        what = f"{type(error).__name__}: {error}" if str(error) else type(error).__name__
        await self._again(f"no answer for {format_duration(self.window)}; {what}", None)

    async def unavailable(self, answer: httpx.Response) -> None:
        """An answer to wait out (:data:`WAITED_OUT`): tried again as after a lost
        connection, not sooner than its ``Retry-After`` (within the window).

        A controller's own 503 (its error body) says it is there, so a later 404 is not
        taken as one that forgot the job; any other (a proxy's 502, 504 or 503) says the
        controller was not reachable, as a lost connection does."""
        if answer.status_code != UNAVAILABLE or _rc_error(answer) is None:
            self.reconnected = True
        retry_after = retry_after_seconds(answer.headers.get("Retry-After"), now=time.time())
        await self._again(
            f"unavailable for {format_duration(self.window)}; {_status_line(answer)}",
            retry_after,
        )

    async def _again(self, why: str, retry_after: float | None) -> None:
        """Sleep before the next try, or raise :class:`ControllerGone` (``why``, on one line)
        once the window is spent."""
        now = trio.current_time()
        if self.since is None:
            self.since = now
        self.failures += 1
        left = self.since + self.window - now
        if left <= 0:
            raise ControllerGone(
                f"lost the controller at {self.url} while following job {self.job_id} "
                f"({why}); the job may still run: rc logs -f {self.job_id}"
            )
        await trio.sleep(retry_delay(self.failures, left, retry_after))

    def forgotten(self, r: httpx.Response) -> None:
        """A 404 for the job after a reconnect: the controller restarted without it."""
        if r.status_code == 404 and self.reconnected:
            raise ControllerGone(
                f"the controller at {self.url} no longer knows job {self.job_id} "
                "(it restarted without its stored state)"
            )


async def get_job(client: httpx.AsyncClient, job_id: str, reconnect: Reconnect) -> Any:
    """The job's record, bounded as every answer (:func:`read_answer`); a request that
    fails in transport, gets no answer within :data:`ANSWER_TIMEOUT`, or is answered 502,
    503 or 504 (:data:`WAITED_OUT`), is tried again within ``reconnect``'s window."""
    path = job_path(job_id)
    while True:
        try:
            async with client.stream("GET", path, timeout=ANSWER_TIMEOUT) as r:
                answer = await read_answer(client, r, "GET", path)
        except httpx.TransportError as e:
            await reconnect.failed(e)
            continue
        if waited_out(answer.status_code):
            await reconnect.unavailable(answer)
            continue
        reconnect.answered()
        reconnect.forgotten(answer)
        raise_for(answer)
        return boundedjson.loads(answer.content)


def read_up_to_a_mebibyte() -> None:
    """Let this process's HTTP connections read up to 1 MiB from the socket at a time.

    httpcore reads 64 KiB at a time (``READ_NUM_BYTES``, a class attribute it
    reads on every read): ``rc logs`` of a large output then spends most of its
    CPU on per-read work (an h11 event, a buffer append, an extraction each
    64 KiB), 4.6 s per GiB where 1 MiB reads take 2.8. A read returns what the
    socket holds, so small answers are unchanged. Called by the ``rc`` command
    (``rc_cli.amain``); it changes every httpcore connection of the process
    (tests that call ``amain`` in-process included). An httpcore without the
    attribute is left alone: only speed depends on it.
    """
    try:
        import httpcore._async.http11 as http11

        connection = http11.AsyncHTTP11Connection
        connection.READ_NUM_BYTES = max(connection.READ_NUM_BYTES, 1 << 20)
    except (ImportError, AttributeError):
        return


async def follow_output(
    client: httpx.AsyncClient, job_id: str, offset: int, sink: Sink, reconnect: Reconnect
) -> Any:
    """Give ``sink`` the job's output from ``offset`` until the job ends; returns its record."""
    path = job_path(job_id, "output")
    while True:
        unavailable = None
        try:
            async with client.stream("GET", path, params={"offset": offset, "follow": "true"}) as r:
                if waited_out(r.status_code):
                    unavailable = await read_answer(client, r, "GET", path)
                elif not r.is_success:
                    answer = await read_answer(client, r, "GET", path)
                    reconnect.forgotten(answer)
                    raise_for(answer)
                else:
                    reconnect.answered()
                    async for chunk in r.aiter_raw():
                        sink(offset, chunk)
                        offset += len(chunk)
        except httpx.TransportError as e:
            await reconnect.failed(e)
            continue
        if unavailable is not None:
            # Waited on out of the request's block: its connection is released first.
            await reconnect.unavailable(unavailable)
            continue
        # The stream ends when the job has ended; check, in case a proxy ended it early.
        job = await get_job(client, job_id, reconnect)
        if job["state"] in TERMINAL_STATES and offset >= int(job.get("committed_bytes") or 0):
            return job


# --- sinks ----------------------------------------------------------------------------------


def to_stream(stream: Any, name: str = "stdout") -> Sink:
    """A sink writing to ``stream``, called ``name`` (``stdout``, or ``stderr`` for the job's
    output with ``rc run --json``) in what it says when it cannot."""

    def sink(offset: int, data: bytes) -> None:
        write_all(stream, data, name)

    return sink


def _closed(name: str, unwritten: int, why: str = "Broken pipe") -> CliError:
    """The error for a stream whose reader has gone: :class:`StdoutClosed` for stdout (quiet
    in every command but ``rc run``), a plain :class:`CliError` naming any other."""
    if name == "stdout":
        return StdoutClosed(unwritten, why)
    return CliError(
        f"cannot write the output to {name} ({why}); {unwritten} bytes were not written"
    )


def write_all(stream: Any, data: bytes, name: str = "stdout") -> None:
    """Write all of ``data`` to ``stream`` (called ``name`` in errors), or fail loudly
    (``CliError``): never a silent short write.

    Straight to the descriptor, in a loop: a pipe whose reader set it non-blocking makes a
    buffered write stop short (``BlockingIOError``), and the rest would be lost unnoticed.
    """
    if stream is None:
        raise _closed(name, len(data), NOT_OPEN)
    try:
        stream.flush()
        fd = _fileno(stream)
        if fd is None:
            written = stream.buffer.write(data)
            if written is not None and written != len(data):
                raise CliError(f"wrote {written} of {len(data)} bytes to {name}")
            stream.buffer.flush()
            return
        stream.buffer.flush()
    except BrokenPipeError:
        raise _closed(name, len(data)) from None
    view = memoryview(data)
    while view:
        try:
            n = os.write(fd, view)
        except BlockingIOError:
            select.select([], [fd], [])
            continue
        except BrokenPipeError:
            raise _closed(name, len(view)) from None
        except OSError as e:
            raise CliError(
                f"cannot write the output to {name} ({e.strerror or e}); "
                f"{len(view)} bytes were not written"
            ) from None
        view = view[n:]


def _fileno(stream: Any) -> int | None:
    try:
        return int(stream.fileno())
    except (AttributeError, OSError, ValueError):
        return None  # not a real file (captured in tests): its buffer takes all or raises


def discard(offset: int, data: bytes) -> None:
    pass


def json_lines(offset: int, data: bytes) -> None:
    """``rc logs --json``: one object per chunk; ``data`` is always base64 (output is bytes)."""
    if sys.stdout is None:
        raise StdoutClosed(len(data), NOT_OPEN)
    for i in range(0, len(data), LOG_CHUNK):
        piece = data[i : i + LOG_CHUNK]
        line = {
            "offset": offset + i,
            "length": len(piece),
            "data": base64.b64encode(piece).decode("ascii"),
        }
        try:
            sys.stdout.write(json.dumps(line) + "\n")
        except BrokenPipeError:
            raise StdoutClosed(len(data) - i) from None
    try:
        sys.stdout.flush()
    except BrokenPipeError:
        raise StdoutClosed(0) from None
