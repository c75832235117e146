"""The verify pass: drop-in scripts that must all pass before a device is offered again.

The scripts of ``verify_dir`` (the one listing rule of ``scripts.py``) run in
name order, each under ``verify_timeout``, the whole pass under
``verify_pass_budget`` (not the per-script timeouts summed). The first
failure ends the pass; a script not started because the budget is spent is a
failure, and so is one that cannot be looked at, or a directory that exists
but cannot be listed: verify fails closed. A missing directory means the
feature is off.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

from rc_worker.core.model import VERIFY_REASON_PREFIX, VerifyResult
from rc_worker.hooks import HOOK_GRACE
from rc_worker.host import Host, RunAs
from rc_worker.scripts import Budget, describe, list_scripts, log_skipped, run_script
from rc_worker.statestore import LINUX_STORE

log = logging.getLogger("rc_worker.verify")

_SKIPS_REPORTED: set[str] = set()
"""Skipped entries already warned about: a README in verify.d is news once, not every job."""


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
    try:
        listing = list_scripts(verify_dir, host.store if host is not None else LINUX_STORE)
    except OSError as e:
        return _failed(f"could not list {verify_dir}: {e.strerror or e}")
    log_skipped(listing.skipped, _SKIPS_REPORTED)
    budget = Budget(script_timeout, pass_budget)
    for script in listing.scripts:
        if script.problem:
            return _failed(f"{script.name}: {script.problem}")
        limit = budget.next()
        if limit is None:
            return _failed(
                f"{script.name}: not started, the pass budget of {pass_budget:g}s is spent"
            )
        run = await run_script(
            [script.path], env=env, limit=limit, grace=HOOK_GRACE, host=host, run_as=run_as
        )
        if not run.ok:
            return _failed(describe(run, script.name))
    return VerifyResult(ok=True)


def _failed(detail: str) -> VerifyResult:
    reason = VERIFY_REASON_PREFIX + detail
    log.warning("%s", reason)
    return VerifyResult(ok=False, reason=reason)
