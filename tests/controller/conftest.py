from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import httpx
import pytest
from starlette.applications import Starlette

from rc_worker.controller import Store, create_app

from . import pgserver
from .helpers import USER_TOKEN, USER_TOKENS, WORKER_TOKENS, auth
from .persistkit import StorePlace, close_opened
from .pgserver import PgServer


@pytest.fixture(autouse=True)
def close_opened_backends() -> Iterator[None]:
    """A test that fails before closing its stores must not leave them open (a SQLite
    state-directory lock held, a PostgreSQL session) for the tests after it."""
    yield
    close_opened()


@pytest.fixture
def store() -> Store:
    return Store(instance="t")


@pytest.fixture
def app(store: Store) -> Starlette:
    return create_app(store=store, worker_tokens=WORKER_TOKENS, user_tokens=USER_TOKENS)


@pytest.fixture
async def client(app: Starlette) -> AsyncIterator[httpx.AsyncClient]:
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://rc") as c:
        yield c


@pytest.fixture
async def user(app: Starlette) -> AsyncIterator[httpx.AsyncClient]:
    """A client carrying a user token."""
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(
        transport=transport, base_url="http://rc", headers=auth(USER_TOKEN)
    ) as c:
        yield c


# --- persistence: one behavioural suite, run against each backend --------------------------


@pytest.fixture(scope="session")
def pg_server() -> Iterator[PgServer]:
    """A real PostgreSQL server for this test session, stopped and removed at its end."""
    if not pgserver.available():
        pytest.fail(
            f"PostgreSQL binaries not found in {pgserver.BIN}: install the 'postgresql' "
            "package (.ci/run does), or set RC_TEST_PG_BIN"
        )
    with pgserver.running_server() as server:
        yield server


@pytest.fixture
def db(pg_server: PgServer) -> Iterator[str]:
    """The URL of a fresh database on the session's server, dropped after the test."""
    url = pg_server.new_database()
    try:
        yield url
    finally:
        pg_server.drop_database(url)


@pytest.fixture(params=["sqlite", "postgres"])
def store_place(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[StorePlace]:
    """Where a controller keeps its state: a fresh SQLite state dir, or a fresh database."""
    if request.param == "sqlite":
        yield StorePlace("sqlite", state_dir=tmp_path / "state")
        return
    server: PgServer = request.getfixturevalue("pg_server")
    place = StorePlace("postgres", db=server.new_database(), server=server)
    try:
        yield place
    finally:
        close_opened()  # its sessions, before their database is dropped
        assert place.db is not None  # a test may have swapped in a fresh database
        server.drop_database(place.db)
