"""The status and metrics endpoint on status_listen, and rc-worker status."""

from __future__ import annotations

import json
from pathlib import Path

import attrs
import httpx
import pytest
import trio

from rc_worker.cli import main
from rc_worker.status import format_status
from rc_worker.testing import local_system, make_config


async def test_status_metrics_and_health_describe_the_worker(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = make_config(tmp_path, devices=("gpu0", "gpu1"), status_listen="127.0.0.1:0")
    with trio.fail_after(30):
        async with local_system(config) as system:
            [url] = system.worker.status_urls
            job_id = system.submit(["echo", "hi"], device="test-host/gpu1")
            assert (await system.wait_job(job_id)).state == "succeeded"
            async with httpx.AsyncClient(base_url=url) as http:
                status = (await http.get("/status")).json()
                metrics = (await http.get("/metrics")).text
                health = await http.get("/healthz")
            code = await trio.to_thread.run_sync(main, ["status", "--url", url, "--json"])
    assert status["host"] == "test-host"
    assert status["registered"] is True
    assert set(status["devices"]) == {"gpu0", "gpu1"}
    assert status["devices"]["gpu0"]["state"] == "free"
    assert status["devices"]["gpu0"]["idle_behavior"] == "run"
    assert status["last_probe"][0]["name"] == "builtin"
    assert health.status_code == 200
    assert 'rc_worker_jobs_finished_total{outcome="succeeded"} 1.0' in metrics
    assert 'rc_worker_devices{state="free"}' in metrics
    assert "rc_worker_job_run_seconds_count 1.0" in metrics
    assert "rc_worker_registered 1.0" in metrics
    assert code == 0
    assert json.loads(capsys.readouterr().out)["host"] == "test-host"


def test_status_table_shows_jobs_and_faults() -> None:
    text = format_status(
        {
            "host": "h1",
            "session": "s-1",
            "draining": True,
            "reports_pending": 2,
            "ready": False,
            "not_ready_reason": "draining: taking no new work",
            "devices": {
                "gpu0": {"state": "running", "idle_behavior": "run", "job_id": "j-1", "attempt": 2},
                "gpu1": {"state": "quarantined", "idle_behavior": "hold", "faults": ["f-7"]},
            },
        }
    )
    assert "(draining)" in text
    assert "j-1#2" in text
    assert "f-7" in text
    assert "reports pending: 2" in text
    assert "not ready: draining: taking no new work" in text


def test_status_without_status_listen_names_the_fix(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "w.yaml"
    path.write_text("devices: [gpu0]\n")
    assert main(["status", "--config", str(path)]) == 2
    assert "set it (e.g. status_listen: 127.0.0.1:9100)" in capsys.readouterr().err


def test_status_of_a_worker_that_is_not_there(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["status", "--url", "http://127.0.0.1:9"]) == 1
    assert "cannot read the worker's status" in capsys.readouterr().err


def test_status_needs_neither_the_token_nor_its_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """An operator without the worker's secret can still ask it how it is."""
    path = tmp_path / "w.yaml"
    path.write_text(
        "devices: [gpu0]\ncontroller_url: http://ctl:8080\n"
        "token_file: /nonexistent/worker.token\nstatus_listen: 127.0.0.1:9\n"
    )
    assert main(["status", "--config", str(path)]) == 1
    err = capsys.readouterr().err
    assert "cannot read the worker's status at http://127.0.0.1:9" in err
    assert "token" not in err


async def test_a_status_address_in_use_is_a_clear_error(tmp_path: Path) -> None:
    from rc_worker.core.errors import ConfigError

    with trio.socket.socket() as taken:
        await taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        config = make_config(tmp_path, status_listen=f"127.0.0.1:{port}")
        with (
            trio.fail_after(30),
            pytest.RaisesGroup(
                pytest.RaisesExc(
                    ConfigError, match=f"status_listen: cannot listen on 127.0.0.1:{port}"
                ),
                flatten_subgroups=True,
            ),
        ):
            async with local_system(config):
                pass


async def test_an_unusable_state_dir_is_a_clear_error(tmp_path: Path) -> None:
    from rc_worker.core.errors import ConfigError

    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    config = attrs.evolve(make_config(tmp_path), state_dir=str(blocker / "state"))
    with (
        trio.fail_after(30),
        pytest.RaisesGroup(
            pytest.RaisesExc(ConfigError, match="state_dir: cannot create or use"),
            flatten_subgroups=True,
        ),
    ):
        async with local_system(config):
            pass


async def test_status_hides_job_ids_unless_private_or_token(tmp_path: Path) -> None:
    sock = tmp_path / "status.sock"
    configs = {
        "tcp": make_config(tmp_path / "a", status_listen="127.0.0.1:0"),
        "token": make_config(tmp_path / "b", status_listen="127.0.0.1:0", status_token="st"),
        "unix": make_config(tmp_path / "c", status_listen=f"unix:{sock}"),
    }
    seen: dict[str, list[object]] = {}
    for kind, config in configs.items():
        with trio.fail_after(30):
            async with local_system(config) as system:
                job_id = system.submit(["sleep", "30"], grace_s=0.1)
                await system.wait_job(job_id, frozenset({"running"}))
                if kind == "unix":
                    transport = httpx.AsyncHTTPTransport(uds=str(sock))
                    async with httpx.AsyncClient(transport=transport, base_url="http://w") as h:
                        answers = [(await h.get("/status")).json()]
                    assert sock.stat().st_mode & 0o077 == 0
                else:
                    [url] = system.worker.status_urls
                    async with httpx.AsyncClient(base_url=url) as h:
                        answers = [
                            (await h.get("/status")).json(),
                            (await h.get("/status", headers={"Authorization": "Bearer st"})).json(),
                        ]
                seen[kind] = [a["devices"]["gpu0"]["job_id"] for a in answers]
                system.store.cancel(job_id)
                await system.wait_job(job_id)
        seen[kind].append(job_id)
    tcp, token, unix = seen["tcp"], seen["token"], seen["unix"]
    assert tcp[:2] == [None, None]  # no status_token: nobody sees ids over TCP
    assert token[0] is None  # shown only with the token
    assert token[1] == token[2]
    assert unix[0] == unix[1]  # a Unix socket is private


async def test_metrics_for_operations(tmp_path: Path) -> None:
    from prometheus_client import generate_latest

    from rc_worker._version import __version__

    config = make_config(
        tmp_path, devices=("gpu0",), status_listen="127.0.0.1:0", spool_max_bytes=100
    )
    with trio.fail_after(30):
        async with local_system(config) as system:
            [url] = system.worker.status_urls
            job_id = system.submit(["sh", "-c", "head -c 500 /dev/zero"])
            assert (await system.wait_job(job_id)).state == "succeeded"
            # The job's directory goes just after its finish is acknowledged.
            await system.wait_until(lambda: system.worker.status()["reports_pending"] == 0)
            async with httpx.AsyncClient(base_url=url) as http:
                metrics = (await http.get("/metrics")).text
            system.worker.drain()
            draining = generate_latest(system.worker.metrics.registry).decode()
    assert f'rc_worker_build_info{{version="{__version__}"}} 1.0' in metrics
    assert "process_resident_memory_bytes" in metrics
    assert "rc_worker_output_truncated_total 1.0" in metrics
    assert 'rc_worker_controller_requests_total{endpoint="register",status="200"} 1.0' in metrics
    assert 'rc_worker_controller_requests_total{endpoint="finish",status="200"} 1.0' in metrics
    [stamp] = [
        line.split()[-1]
        for line in metrics.splitlines()
        if line.startswith("rc_worker_controller_last_success_timestamp_seconds ")
    ]
    assert float(stamp) > 1.7e9
    assert "rc_worker_spool_bytes 0.0" in metrics  # everything delivered, nothing kept
    assert "rc_worker_draining 0.0" in metrics
    assert "rc_worker_draining 1.0" in draining


async def test_spool_bytes_count_what_the_controller_has_not_taken(tmp_path: Path) -> None:
    from faults import FaultyTransport

    config = make_config(tmp_path, devices=("gpu0",), status_listen="127.0.0.1:0")
    transports: list[FaultyTransport] = []

    def wrap(inner: httpx.AsyncBaseTransport) -> FaultyTransport:
        transports.append(FaultyTransport(inner))
        transports[0].outage("output")
        return transports[0]

    with trio.fail_after(30):
        async with local_system(config, transport_wrapper=wrap) as system:
            t = transports[0]
            [url] = system.worker.status_urls
            system.submit(["sh", "-c", "printf 0123456789"])
            await t.wait_until(lambda: len(t.exchanges("output")) > 0)
            async with httpx.AsyncClient(base_url=url) as http:
                metrics = (await http.get("/metrics")).text
            t.restore("output")
    [size] = [
        float(line.split()[-1])
        for line in metrics.splitlines()
        if line.startswith("rc_worker_spool_bytes ")
    ]
    assert size >= 10  # the output, and the journal beside it
