"""Shared by every handler: the :class:`Controller` (store, clock, tokens, waiting) and
request helpers.

Time: every decision reads :meth:`Controller.now`, which is the ``clock``
given to :func:`~rc_worker.controller.create_app`, else the running event
loop's clock (under Trio, ``trio.current_time``, so a ``MockClock`` drives the
whole controller in virtual time), else ``time.monotonic``. Waits use the
event loop's clock, so a custom ``clock`` must advance with it.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import math
import time
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence

import anyio
import attrs
from starlette.requests import Request

from rc_worker.controller.durable import Durability
from rc_worker.controller.errors import BadRequest, Forbidden, TooLarge, Unauthorized
from rc_worker.controller.messages import Event, HeartbeatRequest, RegisterRequest
from rc_worker.controller.state import ANY, OutputElsewhere
from rc_worker.controller.stdin import StdinPipes
from rc_worker.controller.store import Store
from rc_worker.controller.wire import decode

log = logging.getLogger("rc_worker.controller")

LOOP_WATCH_S = 0.5
LOOP_STALL_S = 2.0
"""A silence of the event loop longer than this is a pause, credited to every timer."""

MAX_JSON_BYTES = 8 * 1024 * 1024
"""Large enough for a registration carrying every usage sheet of a big host."""


def _default_clock() -> float:
    try:
        return anyio.current_time()
    except Exception:
        # Outside any event loop (a sync caller poking the app): the OS clock.
        return time.monotonic()


@attrs.frozen
class User:
    """A person's token: their name (recorded in jobs and events) and whether they are admin."""

    name: str
    admin: bool = False


def parse_user_token(text: str) -> tuple[str, User]:
    """``TOKEN=NAME[:admin]`` (or ``:user``), or a bare ``TOKEN``: a plain user whose name is
    derived from the token (``user-`` and 8 hex digits of its SHA-256), never the token itself.

    Raises ``ValueError`` with a message naming the fix.
    """
    token, sep, rest = text.rpartition("=")
    if not sep or not rest:
        # A bare token (one that merely ends in '=', as base64 may, stays whole).
        token = text
        digest = hashlib.sha256(token.encode()).hexdigest()[:8]
        user = User(f"user-{digest}")
    else:
        name, _, role = rest.partition(":")
        if role not in ("", "user", "admin"):
            raise ValueError(
                f"user token role {role!r} is not 'user' or 'admin'; write TOKEN=NAME[:admin]"
            )
        if not name or not name.strip() == name:
            raise ValueError("user token: NAME must be non-empty; write TOKEN=NAME[:admin]")
        user = User(name, admin=role == "admin")
    if not token:
        raise ValueError("user token: TOKEN must be non-empty; write TOKEN=NAME[:admin]")
    return token, user


@attrs.frozen
class Principal:
    """Who a bearer token speaks for: a worker for ``host`` (``"*"``: any host), and/or a user."""

    worker_host: str | None
    user: User | None


class Changes:
    """Wakes the waiters a change of the store (or a stdin pipe) can matter to.

    A waiter notes :attr:`version`, checks its condition, and waits on one
    topic (:func:`~rc_worker.controller.state.host_topic` for a host's long polls,
    :func:`~rc_worker.controller.state.job_topic` for a job's followers, or
    :data:`~rc_worker.controller.state.ANY`); a change wakes only the topics it
    touched (the store says which), plus ``ANY``. One event per topic, made
    lazily (so the app can be built outside an event loop) and dropped once set:
    a thousand parked polls cost nothing until their own host changes.
    """

    def __init__(self) -> None:
        self.version = 0
        self._events: dict[str, anyio.Event] = {}
        self.wakes = 0
        """Waiter events set so far (each wakes every waiter of its topic)."""

    def poke(self, topics: Collection[str] | None = None) -> None:
        """Wake the waiters of ``topics`` and of ``ANY``; None wakes every waiter."""
        self.version += 1
        if topics is None:
            events, self._events = list(self._events.values()), {}
        else:
            events = [e for t in {*topics, ANY} if (e := self._events.pop(t, None)) is not None]
        for event in events:
            event.set()
        self.wakes += len(events)

    def event(self, topic: str = ANY) -> anyio.Event:
        event = self._events.get(topic)
        if event is None:
            event = self._events[topic] = anyio.Event()
        return event

    def parked(self) -> int:
        """Topics with a waiter parked on them now."""
        return len(self._events)


class Controller:
    """What every handler needs: the store, the clock, the tokens, and a way to wait."""

    def __init__(
        self,
        store: Store,
        *,
        worker_tokens: Mapping[str, str],
        user_tokens: Collection[str] | Mapping[str, User],
        clock: Callable[[], float] | None,
        webhooks: Sequence[str],
    ) -> None:
        self.store = store
        self.clock = clock or _default_clock
        self.worker_tokens = dict(worker_tokens)
        if isinstance(user_tokens, Mapping):
            self.user_tokens: dict[str, User] = dict(user_tokens)
        else:
            self.user_tokens = dict(parse_user_token(t) for t in user_tokens)
        self.webhooks = tuple(webhooks)
        self.changes = Changes()
        store.subscribe_topics(self.changes.poke)
        self.housekeeping = False
        """Set while ``rc serve``'s housekeeping task applies the store's timers: waiters on
        a host or job topic then leave the timers to it and sleep until their own change."""
        self.loop_seen: float | None = None
        # Since when the store beneath refuses writes (heartbeats are answered 503 then).
        self.store_down_since: float | None = None
        # Stdin pipes live here, not in the store: they are flow control, not state.
        self.stdin = StdinPipes(self.changes)
        self.durability: Durability | None = None
        """Set by :func:`~rc_worker.controller.create_app` when the store is persisted."""

    def now(self) -> float:
        return self.clock()

    async def read_events(self, after: int, limit: int) -> list[Event]:
        """Events after ``after``: from memory, or, for those older than the in-memory ring
        keeps, from the store beneath (so ``after=N`` always gets exactly the events after N)."""
        first = self.store.first_event_seq()
        if self.durability is not None and first is not None and after + 1 < first:
            older = await self.durability.read_events(after, min(limit, first - after - 1))
            if older:
                return older
        return self.store.events(after, limit)

    async def read_output(self, job_id: str, offset: int, limit: int | None = None) -> bytes:
        """A job's committed output from ``offset``: from memory, or from the store beneath
        for what was committed there and dropped from memory."""
        if self.durability is not None and not self.store.in_memory(job_id):
            # A finished job whose record left memory: every byte is in the store beneath.
            return await self.durability.read_output(job_id, offset, limit)
        try:
            return self.store.output(job_id, offset, limit)
        except OutputElsewhere as e:
            if self.durability is None:
                raise
            base = e.base
        want = base - offset if limit is None else min(limit, base - offset)
        data = await self.durability.read_output(job_id, offset, want)
        if len(data) < want or (limit is not None and len(data) >= limit):
            return data
        try:
            rest = self.store.output(job_id, base, None if limit is None else limit - len(data))
        except OutputElsewhere:
            rest = b""  # trimmed further meanwhile: the caller asks again from the new end
        return data + rest

    async def ensure_jobs(self, job_ids: Iterable[str]) -> None:
        """Bring back into memory the named jobs that only the store beneath holds, before a
        decision about them (a registration's claims and recovery entries, a heartbeat's
        reports): without it, a finished job would look never seen, and be adopted."""
        if self.durability is not None:
            await self.durability.ensure_jobs(job_ids)

    def tick(self) -> float:
        """Apply the store's due timers (lazily, on every request); returns ``now``."""
        now = self.now()
        self.check_loop(now)
        if self.durability is not None and self.durability.failed is not None:
            # Every heartbeat is answered 503 while the store is down: no host can be
            # heard, so none is declared lost for it. The outage is credited once the
            # store works again, as a pause of the controller's own is.
            if self.store_down_since is None:
                self.store_down_since = now
            return now
        if self.store_down_since is not None:
            self.store.credit_pause(now - self.store_down_since)
            self.store_down_since = None
        self.store.tick(now)
        return now

    def check_loop(self, now: float) -> None:
        """Credit the store with any time the event loop did not run (see
        :meth:`StoreState.credit_pause`). Active only while :func:`watch_loop` runs (``rc
        serve``): it notes the loop running every :data:`LOOP_WATCH_S`; a longer silence
        than :data:`LOOP_STALL_S` means the whole process was stopped or starved."""
        if self.loop_seen is not None and now - self.loop_seen > LOOP_STALL_S:
            stalled = now - self.loop_seen - LOOP_WATCH_S
            log.warning(
                "the controller did not run for %.1fs (paused or starved); "
                "host and assignment timers are extended by that much",
                stalled,
            )
            self.store.credit_pause(stalled)
        if self.loop_seen is not None:
            self.loop_seen = now

    async def watch_loop(self) -> None:
        """Note, every :data:`LOOP_WATCH_S`, that the loop runs; runs until cancelled."""
        self.loop_seen = self.now()
        while True:
            await anyio.sleep(LOOP_WATCH_S)
            self.check_loop(self.now())

    async def wait_change(self, seen: int, deadline: float | None, topic: str = ANY) -> None:
        """Return once :attr:`Changes.version` differs from ``seen`` (anything changed since
        the caller looked), a change touching ``topic`` is made, ``deadline`` passes, or
        one of the store's own timers is due (the caller then ticks; with housekeeping
        running, only an ``ANY`` waiter wakes for the timers)."""
        if self.changes.version != seen:
            return
        event = self.changes.event(topic)
        until = None if topic != ANY and self.housekeeping else self.store.next_deadline()
        if deadline is not None:
            until = deadline if until is None else min(until, deadline)
        if until is None:
            await event.wait()
            return
        # An absolute deadline on the loop's clock, not a delay: the clock (a MockClock's
        # autojump) then stops exactly at `until`, so the tick that follows sees it due.
        if self.clock is not _default_clock:
            loop_now = anyio.current_time()
            # Never a deadline that has already passed while the controller's is still ahead:
            # that would wake at once, tick nothing, and spin.
            until = max(loop_now + (until - self.now()), math.nextafter(loop_now, math.inf))
        with anyio.CancelScope(deadline=until):
            await event.wait()

    # --- auth -------------------------------------------------------------------------------

    def principal(self, request: Request) -> Principal:
        header = request.headers.get("authorization", "")
        scheme, _, token = header.partition(" ")
        token = token.strip()
        if scheme.lower() != "bearer" or not token:
            raise Unauthorized("send Authorization: Bearer <token>")
        given = token.encode()
        host = None
        for candidate, allowed in self.worker_tokens.items():
            if hmac.compare_digest(candidate.encode(), given):
                host = allowed
        user = None
        for candidate, who in self.user_tokens.items():
            if hmac.compare_digest(candidate.encode(), given):
                user = who
        if host is None and user is None:
            raise Unauthorized("unknown token")
        return Principal(worker_host=host, user=user)

    def require_user(self, request: Request) -> User:
        user = self.principal(request).user
        if user is None:
            raise Forbidden("this endpoint needs a user token, not a worker token")
        return user

    def require_admin(self, request: Request, what: str) -> User:
        user = self.require_user(request)
        if not user.admin:
            raise Forbidden(
                f"{what} needs an admin token; {user.name} is a user "
                "(rc serve --user-token TOKEN=NAME:admin)"
            )
        return user

    def require_worker(self, request: Request, host: str | None = None) -> Principal:
        p = self.principal(request)
        if p.worker_host is None:
            raise Forbidden("this endpoint needs a worker token, not a user token")
        if host is not None:
            self.check_host(p, host)
        return p

    @staticmethod
    def check_host(p: Principal, host: str) -> None:
        if p.worker_host not in ("*", host):
            raise Forbidden(f"this worker token may act only as host {p.worker_host}, not {host}")


def controller_of(request: Request) -> Controller:
    ctl: Controller = request.app.state.controller
    return ctl


async def read_body(request: Request, limit: int) -> bytes:
    """The request body, refusing more than ``limit`` bytes without buffering them."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise _too_large(limit)
    chunks = bytearray()
    async for chunk in request.stream():
        chunks += chunk
        if len(chunks) > limit:
            raise _too_large(limit)
    return bytes(chunks)


def _too_large(limit: int) -> TooLarge:
    # Made only when raised: every request reads its body through here.
    return TooLarge(f"body larger than {limit} bytes; send less per request")


async def json_body(request: Request, *, empty_ok: bool = False) -> object:
    """The body as decoded JSON (bounded); :mod:`~rc_worker.controller.wire` gives it its type."""
    return decode(await read_body(request, MAX_JSON_BYTES), empty_ok=empty_ok)


def query_int(request: Request, name: str, default: int | None = None) -> int:
    raw = request.query_params.get(name)
    if raw is None:
        if default is None:
            raise BadRequest(f"{name}: required query parameter")
        return default
    try:
        if len(raw) > 20:
            raise ValueError
        value = int(raw)
    except ValueError:
        raise BadRequest(f"{name}: expected an integer, got {raw[:40]!r}") from None
    if not -(2**63) <= value < 2**63:
        raise BadRequest(f"{name}: {value} is out of range")
    return value


def register_job_ids(req: RegisterRequest) -> list[str]:
    """The jobs a registration names: its recovery entries and the attempts it claims."""
    ids = [r.job_id for r in req.recovery]
    ids += [d.running.job_id for d in req.devices if d.running is not None]
    return ids


def heartbeat_job_ids(req: HeartbeatRequest) -> list[str]:
    """The jobs a heartbeat reports on."""
    return [r.job_id for r in req.devices.values() if r.job_id is not None]
