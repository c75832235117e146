"""A device's ``job_user`` is looked up per job, off the event loop; one that cannot be
found (deleted since the config was read, an unreachable LDAP or sssd) refuses the job,
which goes elsewhere, and quarantines the device, instead of an internal error that
finishes the job ``error`` (or, after the job, loses its outcome).

Real processes on the real host; switching user needs a root worker (skipped otherwise).
"""

from __future__ import annotations

import contextlib
import os
import pwd
import shutil
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import trio

from rc_worker import context
from rc_worker.core.config import DeviceConfig
from rc_worker.host import RunAs, resolve_user
from rc_worker.testing import local_system, make_config

pytestmark = pytest.mark.skipif(
    not hasattr(os, "geteuid") or os.geteuid() != 0, reason="switching user needs root"
)

USER = "nobody"


async def test_a_job_user_that_cannot_be_found_quarantines_the_device_and_requeues(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    uid = pwd.getpwnam(USER).pw_uid
    looked_up: list[str] = []
    gone = True

    def lookup(name: str) -> RunAs:
        looked_up.append(name)
        if gone:
            raise KeyError(f"getpwnam(): name not found: {name!r}")
        return resolve_user(name)

    monkeypatch.setattr(context, "resolve_user", lookup)
    config = make_config(tmp_path, devices=(DeviceConfig(name="gpu0", job_user=USER),))
    with trio.fail_after(60):
        async with local_system(config) as system:
            job_id = system.submit(["id", "-u"])
            await system.wait_until(lambda: system.device("gpu0").state == "quarantined")
            [fault] = system.device("gpu0").faults
            assert fault.kind == "job_user"
            assert f"job_user {USER!r} cannot be resolved" in fault.detail
            assert "getent passwd" in fault.detail
            info = system.job(job_id)
            assert info.state == "queued"  # refused: requeued, not failed
            assert [a.status for a in info.attempts] == ["requeued"]
            assert "cannot be resolved" in info.attempts[0].note
            assert looked_up == [USER]
            # The directory is back and an operator clears the fault: the job runs as the
            # user, looked up afresh.
            gone = False
            system.store.clear(config.host, "gpu0")
            done = await system.wait_job(job_id)
            assert done.state == "succeeded", done
            assert system.output(job_id) == f"{uid}\n".encode()
            assert looked_up == [USER, USER]


async def test_a_lookup_is_made_once_per_job_in_a_thread(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The acquire hook, the job and its verify pass share one lookup, and it does not run
    on the event loop's thread."""
    threads: list[bool] = []

    def lookup(name: str) -> RunAs:
        threads.append(threading.current_thread() is threading.main_thread())
        return resolve_user(name)

    monkeypatch.setattr(context, "resolve_user", lookup)
    with scripts_the_user_can_run() as scripts:
        device = DeviceConfig(name="gpu0", job_user=USER, on_acquire=str(scripts / "acquire"))
        config = make_config(tmp_path, devices=(device,), verify_dir=str(scripts / "verify.d"))
        with trio.fail_after(60):
            async with local_system(config) as system:
                job_id = system.submit(["id", "-u"])
                assert (await system.wait_job(job_id)).state == "succeeded"
                assert system.output(job_id) == f"{pwd.getpwnam(USER).pw_uid}\n".encode()
                assert system.device("gpu0").state != "quarantined"  # hook and verify ran
    assert threads == [False]


@contextlib.contextmanager
def scripts_the_user_can_run() -> Iterator[Path]:
    """An acquire hook and a verify script that succeed, where ``nobody`` can run them
    (pytest's own temporary directories are private to root)."""
    base = Path(tempfile.mkdtemp(prefix="rc-job-user-"))
    try:
        base.chmod(0o755)
        (base / "verify.d").mkdir(mode=0o755)
        for script in (base / "acquire", base / "verify.d" / "10-ok"):
            script.write_text("#!/bin/sh\nexit 0\n")
            script.chmod(0o755)
        yield base
    finally:
        shutil.rmtree(base, ignore_errors=True)
