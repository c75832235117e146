"""Bounded answers: GET /v1/jobs pages, `rc ps` shows the most recent, capped output is marked."""

from __future__ import annotations

import base64
import json

import httpx
import pytest
import trio
from starlette.applications import Starlette

from rc_worker.controller import Store, StoreConfig, create_app, rc_cli

from .helpers import USER_TOKEN, USER_TOKENS, WORKER_TOKENS, FakeWorker


async def test_jobs_page_forwards_and_backwards(user: httpx.AsyncClient, store: Store) -> None:
    ids = [store.submit(["echo", str(i)]) for i in range(5)]
    r = await user.get("/v1/jobs", params={"limit": 2})
    body = r.json()
    assert [j["job_id"] for j in body["jobs"]] == ids[:2]
    seen = [j["job_id"] for j in body["jobs"]]
    while body["next"] is not None:
        body = (await user.get("/v1/jobs", params={"limit": 2, "after": body["next"]})).json()
        seen += [j["job_id"] for j in body["jobs"]]
    assert seen == ids
    r = await user.get("/v1/jobs", params={"limit": 3, "order": "desc"})
    assert [j["job_id"] for j in r.json()["jobs"]] == ids[::-1][:3]
    r = await user.get("/v1/jobs", params={"limit": 0})
    assert (r.status_code, r.json()["error"]) == (400, "bad_request")
    assert "limit" in r.json()["message"]
    # Without paging parameters: every job, as before.
    assert len((await user.get("/v1/jobs")).json()["jobs"]) == 5


async def test_rc_ps_shows_the_most_recent(
    app: Starlette, store: Store, capsys: pytest.CaptureFixture[str]
) -> None:
    ids = [store.submit(["echo", str(i)]) for i in range(4)]
    transport = httpx.ASGITransport(app=app)
    env = {"RC_URL": "http://rc", "RC_USER_TOKEN": USER_TOKEN}
    with trio.fail_after(10):
        assert await rc_cli.amain(["ps", "--limit", "2"], env=env, transport=transport) == 0
    out = capsys.readouterr().out
    assert ids[2] in out
    assert ids[3] in out
    assert ids[0] not in out
    assert out.index(ids[2]) < out.index(ids[3])
    with trio.fail_after(10):
        assert await rc_cli.amain(["ps", "--all"], env=env, transport=transport) == 0
    out = capsys.readouterr().out
    assert all(i in out for i in ids)


async def test_rc_logs_ends_with_a_marker_when_output_was_capped(
    capsys: pytest.CaptureFixture[str],
) -> None:
    store = Store(StoreConfig(max_output_bytes=4), instance="t")
    app = create_app(store=store, worker_tokens=WORKER_TOKENS, user_tokens=USER_TOKENS)
    transport = httpx.ASGITransport(app=app)
    env = {"RC_URL": "http://rc", "RC_USER_TOKEN": USER_TOKEN}
    async with httpx.AsyncClient(transport=transport, base_url="http://rc") as c:
        w = FakeWorker(c)
        await w.register()
        job_id = store.submit(["yes"])
        a = await w.run_one(b"y\ny\ny\n")
    assert store.job(job_id).output_truncated
    with trio.fail_after(10):
        assert await rc_cli.amain(["logs", job_id], env=env, transport=transport) == 0
    out = capsys.readouterr().out
    assert out.startswith("y\ny\n")
    assert out.rstrip("\n").splitlines()[-1].startswith("[rc: output truncated")
    assert a["job_id"] == job_id


@pytest.mark.parametrize("follow", [False, True])
async def test_rc_logs_json_ends_with_a_truncation_object(
    capsys: pytest.CaptureFixture[str], follow: bool
) -> None:
    store = Store(StoreConfig(max_output_bytes=4), instance="t")
    app = create_app(store=store, worker_tokens=WORKER_TOKENS, user_tokens=USER_TOKENS)
    transport = httpx.ASGITransport(app=app)
    env = {"RC_URL": "http://rc", "RC_USER_TOKEN": USER_TOKEN}
    async with httpx.AsyncClient(transport=transport, base_url="http://rc") as c:
        w = FakeWorker(c)
        await w.register()
        capped = store.submit(["yes"])
        await w.run_one(b"y\ny\ny\n")
        whole = store.submit(["echo"])
        await w.run_one(b"ok\n")
    argv = ["logs", "--json", *(["--follow"] if follow else [])]
    with trio.fail_after(10):
        assert await rc_cli.amain([*argv, capped], env=env, transport=transport) == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert lines[0]["offset"] == 0
    assert base64.b64decode(lines[0]["data"]) == b"y\ny\n"
    assert lines[-1]["output_truncated"] is True
    assert lines[-1]["committed_bytes"] == 4
    assert "--max-output-bytes" in lines[-1]["message"]
    # A job whose output was not capped ends with its last chunk, no marker.
    with trio.fail_after(10):
        assert await rc_cli.amain([*argv, whole], env=env, transport=transport) == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [base64.b64decode(line["data"]) for line in lines] == [b"ok\n"]


async def test_rc_run_says_on_stderr_when_the_output_was_capped(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """``rc run`` prints the job's output as kept on stdout, and says that it was cut on
    stderr (``rc logs`` ends its output with the marker instead)."""
    store = Store(StoreConfig(max_output_bytes=4), instance="t")
    app = create_app(store=store, worker_tokens=WORKER_TOKENS, user_tokens=USER_TOKENS)
    transport = httpx.ASGITransport(app=app)
    env = {"RC_URL": "http://rc", "RC_USER_TOKEN": USER_TOKEN}
    async with httpx.AsyncClient(transport=transport, base_url="http://rc") as c:
        w = FakeWorker(c)
        await w.register()
        status: list[int] = []

        async def run() -> None:
            status.append(await rc_cli.amain(["run", "--", "yes"], env=env, transport=transport))

        with trio.fail_after(10):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(run)
                await w.run_one(b"y\ny\ny\n")
    assert status == [0]
    captured = capsys.readouterr()
    assert captured.out == "y\ny\n"
    assert "rc: output truncated: the controller kept only the first" in captured.err
