"""``max_grace``: a job's requested grace ceiling is cut to the worker's cap."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import trio

from rc_worker.testing import local_system, make_config


async def test_a_longer_grace_is_cut_to_max_grace(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="rc_worker.device")
    config = make_config(tmp_path, max_grace=0.5)
    with trio.fail_after(30):  # the job asks for 600 s; only the cap can end it sooner
        async with local_system(config) as system:
            job_id = system.submit(
                ["sh", "-c", "trap '' TERM; echo a; while :; do sleep 0.1; done"], grace_s=600
            )
            await system.wait_until(lambda: system.output(job_id) == b"a\n")
            system.store.cancel(job_id, "enough")
            info = await system.wait_job(job_id)
    assert info.state == "killed"
    assert "asked for a 600s grace; cut to max_grace (0.5s)" in caplog.text


def test_max_grace_is_a_config_key_with_a_five_minute_default(tmp_path: Path) -> None:
    from rc_worker.core.config_convert import parse_text

    plain = parse_text("devices: [gpu0]\n", name="w.yaml", base_dir=tmp_path, read_token=False)
    assert plain.max_grace == 300.0
    capped = parse_text(
        "devices: [gpu0]\nmax_grace: 30s\n", name="w.yaml", base_dir=tmp_path, read_token=False
    )
    assert capped.max_grace == 30.0
