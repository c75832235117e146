"""`GET /v1/jobs?host=&select=` and `rc ps --host/--select/--all` (issue 14: lists filter
server-side and page). Jobs are kept by where their current attempt is placed; the filter
applies before a page is cut; finished jobs read back from the store beneath are filtered
too (SQLite and a real PostgreSQL)."""

from __future__ import annotations

from typing import Any

import httpx
import pytest
import trio
from starlette.applications import Starlette

from rc_worker.controller import Store, rc_cli

from .helpers import USER_TOKEN, FakeWorker
from .persistkit import StorePlace, clients, open_controller

GUARD = 30
H100 = {"host": {}, "devices": {"gpu0": {"product": "H100"}}}
A100 = {"host": {}, "devices": {"gpu0": {"product": "A100"}}}


async def _two_hosts(bare: httpx.AsyncClient, submit: Any) -> dict[str, str]:
    """h1 (an H100) ran one job and runs another; h2 (an A100) ran one; one waits."""
    h1 = FakeWorker(bare, "h1", labels=H100)
    h2 = FakeWorker(bare, "h2", labels=A100)
    await h1.register()
    await h2.register()
    ids = {"h1_done": await submit(["true"], "product=H100")}
    await h1.run_one(b"x\n")
    ids["h2_done"] = await submit(["true"], "product=A100")
    await h2.run_one()
    ids["h1_running"] = await submit(["sleep", "9"], "product=H100")
    [a] = await h1.poll(wait_s=5)
    assert (await h1.start(a)).status_code == 200
    ids["queued"] = await submit(["true"], "product=H100")
    return ids


async def _listed(user: httpx.AsyncClient, **params: Any) -> list[str]:
    r = await user.get("/v1/jobs", params=params)
    assert r.status_code == 200, r.text
    return [j["job_id"] for j in r.json()["jobs"]]


async def test_jobs_are_filtered_by_host_and_selector(
    user: httpx.AsyncClient, app: Starlette, store: Store
) -> None:
    async def submit(command: list[str], select: str) -> str:
        return store.submit(command, select=select)

    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://rc") as bare:
        with trio.fail_after(GUARD):
            ids = await _two_hosts(bare, submit)
    assert await _listed(user, host="h1") == [ids["h1_done"], ids["h1_running"]]
    assert await _listed(user, host="h2") == [ids["h2_done"]]
    assert await _listed(user, select="product=A100") == [ids["h2_done"]]
    assert await _listed(user, host="h1", select="product=A100") == []
    assert await _listed(user, host="h1", state="running") == [ids["h1_running"]]
    assert await _listed(user, host="nowhere") == []
    # Cut after filtering: a page of one still finds the next match.
    r = await user.get("/v1/jobs", params={"host": "h1", "limit": 1})
    assert [j["job_id"] for j in r.json()["jobs"]] == [ids["h1_done"]]
    r = await user.get("/v1/jobs", params={"host": "h1", "limit": 1, "after": r.json()["next"]})
    assert [j["job_id"] for j in r.json()["jobs"]] == [ids["h1_running"]]
    r = await user.get("/v1/jobs", params={"select": "product=="})
    assert (r.status_code, r.json()["error"]) == (400, "bad_request")
    assert r.json()["message"].startswith("select: ")


@pytest.mark.parametrize("store_place", ["sqlite", "postgres"], indirect=True)
async def test_finished_jobs_read_back_from_the_store_are_filtered_too(
    store_place: StorePlace,
) -> None:
    with trio.fail_after(GUARD):
        opened = open_controller(store_place.open(), keep_finished=0)
        async with clients(opened.app) as (bare, user):

            async def submit(command: list[str], select: str) -> str:
                r = await user.post("/v1/jobs", json={"command": command, "select": select})
                assert r.status_code == 200, r.text
                job_id: str = r.json()["job_id"]
                return job_id

            ids = await _two_hosts(bare, submit)
            # Both finished jobs left memory: they are read from the database.
            assert not opened.store.in_memory(ids["h1_done"])
            assert await _listed(user, host="h1") == [ids["h1_done"], ids["h1_running"]]
            assert await _listed(user, select="product=A100") == [ids["h2_done"]]
            assert await _listed(user, host="h2", limit=5) == [ids["h2_done"]]
        opened.backend.close()


class _Counting(httpx.AsyncBaseTransport):
    def __init__(self, inner: httpx.AsyncBaseTransport) -> None:
        self.inner = inner
        self.paths: list[str] = []

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        self.paths.append(str(request.url.copy_with(scheme=None, host=None)))
        return await self.inner.handle_async_request(request)


async def test_rc_ps_filters_and_pages_through_every_job(
    app: Starlette,
    store: Store,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(rc_cli, "JOBS_PAGE", 2)
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://rc") as bare:
        with trio.fail_after(GUARD):

            async def submit(command: list[str], select: str) -> str:
                return store.submit(command, select=select)

            ids = await _two_hosts(bare, submit)
    env = {"RC_URL": "http://rc", "RC_USER_TOKEN": USER_TOKEN}
    counting = _Counting(transport)
    with trio.fail_after(GUARD):
        assert await rc_cli.amain(["ps", "--all"], env=env, transport=counting) == 0
    out = capsys.readouterr().out
    assert all(job_id in out for job_id in ids.values())
    assert len(counting.paths) == 2  # four jobs, two a page
    with trio.fail_after(GUARD):
        assert await rc_cli.amain(["ps", "--host", "h1"], env=env, transport=transport) == 0
    out = capsys.readouterr().out
    assert ids["h1_done"] in out
    assert ids["h1_running"] in out
    assert ids["h2_done"] not in out
    assert ids["queued"] not in out
    with trio.fail_after(GUARD):
        assert (
            await rc_cli.amain(["ps", "--select", "product=A100"], env=env, transport=transport)
            == 0
        )
    out = capsys.readouterr().out
    assert ids["h2_done"] in out
    assert ids["h1_done"] not in out
