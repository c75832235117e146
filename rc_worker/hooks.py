"""Lease hooks: ``on_acquire`` and ``on_release``.

A hook runs under the same supervision as a job (own process group, its
timeout as the deadline, SIGTERM → grace → SIGKILL) but is never swept: a
hook hunting for processes by job id is a mechanism nobody asked for. A
killed hook is a failed hook; a hook that exits 0 and leaves a background
process behind is a successful hook (the seed's 2026-08-17 incident).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

import attrs

from rc_worker.dropins import TailBuffer
from rc_worker.host import Host, RunAs
from rc_worker.supervise import JobSpec, Result, run_job

log = logging.getLogger("rc_worker.hooks")

HOOK_GRACE = 5.0


@attrs.frozen
class HookOutcome:
    ok: bool
    reason: str = ""


def describe_failure(what: str, result: Result, stderr_tail: str) -> str:
    """One line saying why a hook or script failed, with the tail of its stderr."""
    if result.error is not None:
        why = f"could not start: {result.error}"
    elif result.killed and result.reason == "max_runtime":
        why = "timed out"
    elif result.killed:
        why = f"killed ({result.reason})"
    elif result.signal is not None:
        why = f"died of signal {result.signal}"
    else:
        why = f"exited {result.exit_code}"
    return f"{what} {why}" + (f": {stderr_tail}" if stderr_tail else "")


async def run_hook(
    hook: str,
    path: str,
    *,
    time_limit: float,
    env: Mapping[str, str],
    host: Host | None = None,
    run_as: RunAs | None = None,
) -> HookOutcome:
    """Run one lease hook; ``env`` is the full environment it gets."""
    stderr = TailBuffer()
    stdout = TailBuffer()
    spec = JobSpec(
        command=[path],
        env={**env, "RC_HOOK": hook},
        grace_ceiling=min(HOOK_GRACE, time_limit),
        max_runtime=time_limit,
        stderr=stderr,
        run_as=run_as,
    )
    result = await run_job(spec, stdout, host=host)
    if result.error is None and not result.killed and result.exit_code == 0:
        return HookOutcome(ok=True)
    reason = describe_failure(f"{hook} hook {path}", result, stderr.text())
    log.warning("%s (stdout tail: %s)", reason, stdout.text(200) or "empty")
    return HookOutcome(ok=False, reason=reason)
