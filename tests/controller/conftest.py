from __future__ import annotations

from collections.abc import AsyncIterator

import httpx
import pytest
from starlette.applications import Starlette

from rc_worker.controller import Store, create_app

from .helpers import USER_TOKEN, USER_TOKENS, WORKER_TOKENS, auth


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
