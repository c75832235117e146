"""One thin path through everything: controller and worker in one nursery, no sockets."""

from __future__ import annotations

from pathlib import Path

import trio

from rc_worker.testing import local_system, make_config


async def test_echo_hello_succeeds_with_its_output_committed(tmp_path: Path) -> None:
    with trio.fail_after(30):
        async with local_system(make_config(tmp_path)) as system:
            job_id = system.submit(["echo", "hello"])
            info = await system.wait_job(job_id)
            assert info.state == "succeeded"
            assert info.exit_code == 0
            assert info.killed is False
            assert system.output(job_id) == b"hello\n"


async def test_exit_3_fails_with_exit_code_3(tmp_path: Path) -> None:
    with trio.fail_after(30):
        async with local_system(make_config(tmp_path)) as system:
            job_id = system.submit(["sh", "-c", "echo going; exit 3"])
            info = await system.wait_job(job_id)
            assert info.state == "failed"
            assert info.exit_code == 3
            assert system.output(job_id) == b"going\n"


async def test_jobs_run_one_at_a_time_per_device_and_all_finish(tmp_path: Path) -> None:
    with trio.fail_after(60):
        async with local_system(make_config(tmp_path, devices=("gpu0", "gpu1"))) as system:
            jobs = [system.submit(["sh", "-c", f"echo {i}"]) for i in range(6)]
            for i, job_id in enumerate(jobs):
                info = await system.wait_job(job_id)
                assert info.state == "succeeded"
                assert system.output(job_id) == f"{i}\n".encode()
            assert {system.job(j).device for j in jobs} <= {"gpu0", "gpu1"}
