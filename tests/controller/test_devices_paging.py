"""``GET /v1/devices`` pages and filters server-side; ``rc devices`` pages and filters through
it. A real ``rc serve --memory`` process and real ``rc`` processes."""

from __future__ import annotations

import json
import subprocess
from typing import Any

import httpx
import trio

from .helpers import FakeWorker, auth
from .rc_procs import RC, USER, WORKER, rc_env, rc_serve

N = 1005  # more than one page of rc devices' requests (1000)


def _labels(n: int) -> dict[str, Any]:
    return {
        "host": {"zone": "z1"},
        "devices": {f"g{i:04d}": {"product": "H100" if i % 2 else "A100"} for i in range(n)},
    }


async def _rc(url: str, *argv: str) -> subprocess.CompletedProcess[bytes]:
    return await trio.run_process(
        [RC, *argv], env=rc_env(url), capture_stdout=True, capture_stderr=True, check=False
    )


async def test_devices_page_filter_and_rc_devices() -> None:
    async with rc_serve() as served, httpx.AsyncClient(base_url=served.url) as http:
        names = [f"g{i:04d}" for i in range(N)]
        w = FakeWorker(http, token=WORKER, devices=names, labels=_labels(N))
        with trio.fail_after(60):
            await w.register()
        user = auth(USER)

        async def get(**params: Any) -> httpx.Response:
            return await http.get("/v1/devices", params=params, headers=user)

        # Pages follow each other in address order, and cover every device once.
        seen: list[str] = []
        body = (await get(limit=400)).json()
        pages = 1
        while True:
            seen += [d["device"] for d in body["devices"]]
            if body["next"] is None:
                break
            body = (await get(limit=400, after=body["next"])).json()
            pages += 1
        assert pages == 3
        assert seen == names

        # Filters: a selector over the labels, a host, a state.
        h100 = (await get(select="product=H100")).json()
        assert len(h100["devices"]) == N // 2
        assert {d["labels"]["product"] for d in h100["devices"]} == {"H100"}
        assert h100["next"] is None
        assert len((await get(select="product=H100,zone=z1", limit=10)).json()["devices"]) == 10
        assert (await get(host="nobody")).json()["devices"] == []
        assert len((await get(host="box1", state="free")).json()["devices"]) == N
        assert (await get(state="busy")).json()["devices"] == []

        # Bad input: 400 with a message naming the parameter.
        for params, name in (
            ({"state": "sleepy"}, "state"),
            ({"limit": 0}, "limit"),
            ({"select": "product>=fast"}, "select"),
            ({"after": "no-slash"}, "after"),
        ):
            r = await get(**params)
            assert r.status_code == 400, params
            assert r.json()["message"].startswith(f"{name}:")

        # rc devices: every device, fetched page by page; filters and --limit pass through.
        with trio.fail_after(120):
            out = await _rc(served.url, "devices", "--json")
        assert out.returncode == 0, out.stderr
        listed = json.loads(out.stdout)["devices"]
        assert [d["device"] for d in listed] == names
        with trio.fail_after(60):
            out = await _rc(served.url, "devices", "--json", "--select", "product=A100")
        assert out.returncode == 0, out.stderr
        assert len(json.loads(out.stdout)["devices"]) == (N + 1) // 2
        with trio.fail_after(60):
            out = await _rc(
                served.url, "devices", "--host", "box1", "--state", "free", "--limit", "3"
            )
        assert out.returncode == 0, out.stderr
        text = out.stdout.decode()
        assert "g0002" in text
        assert "g0003" not in text
        with trio.fail_after(60):
            out = await _rc(served.url, "devices", "--state", "sleepy")
        assert out.returncode != 0
        err = out.stderr.decode().strip().splitlines()
        assert len(err) == 1
        assert "state" in err[0]
        assert "Traceback" not in out.stderr.decode()
