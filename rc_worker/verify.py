"""The verify pass: drop-in scripts that must all pass before a device is offered again.

Scripts in ``verify_dir`` run in name order, each under ``verify_timeout``,
the whole pass under ``verify_pass_budget`` (not the per-script timeouts
summed). The first failure ends the pass; a script not started because the
budget is spent is a failure. A missing directory means the feature is off.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

import trio

from rc_worker.dropins import TailBuffer, list_executables
from rc_worker.hooks import HOOK_GRACE, describe_failure
from rc_worker.host import Host, RunAs
from rc_worker.model import VERIFY_REASON_PREFIX, VerifyResult
from rc_worker.statestore import LINUX_STORE
from rc_worker.supervise import JobSpec, run_job

log = logging.getLogger("rc_worker.verify")


async def run_verify(
    verify_dir: str,
    *,
    script_timeout: float,
    pass_budget: float,
    env: Mapping[str, str],
    host: Host | None = None,
    run_as: RunAs | None = None,
) -> VerifyResult:
    """Run the verify pass over ``verify_dir``; ``env`` is each script's whole environment."""
    scripts = list_executables(verify_dir, host.store if host is not None else LINUX_STORE)
    deadline = trio.current_time() + pass_budget
    for script in scripts:
        left = deadline - trio.current_time()
        if left <= 0:
            return _failed(
                f"{script.name}: not started, the pass budget of {pass_budget:g}s is spent"
            )
        stderr = TailBuffer()
        limit = min(script_timeout, left)
        result = await run_job(
            JobSpec(
                command=[str(script)],
                env=dict(env),
                grace_ceiling=min(HOOK_GRACE, limit),
                max_runtime=limit,
                stderr=stderr,
                run_as=run_as,
            ),
            TailBuffer(),
            host=host,
        )
        if limit < script_timeout and result.killed and result.reason == "max_runtime":
            return _failed(
                f"{script.name}: stopped when the pass budget of {pass_budget:g}s ran out"
            )
        if result.error is not None or result.killed or result.exit_code != 0:
            return _failed(describe_failure(script.name, result, stderr.text(200)))
    return VerifyResult(ok=True)


def _failed(detail: str) -> VerifyResult:
    reason = VERIFY_REASON_PREFIX + detail
    log.warning("%s", reason)
    return VerifyResult(ok=False, reason=reason)
