"""Lease hooks: ``on_acquire`` and ``on_release``.

A hook runs as every operator script does (``scripts.run_script``: own
process group, its timeout as the deadline, SIGTERM → grace → SIGKILL) but is
never swept: a hook hunting for processes by job id is a mechanism nobody
asked for. A killed hook is a failed hook; a hook that exits 0 and leaves a
background process behind is a successful hook (the seed's 2026-08-17
incident).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

import attrs

from rc_worker.host import Host, RunAs
from rc_worker.scripts import Budget, describe, run_script, tail_text

log = logging.getLogger("rc_worker.hooks")

HOOK_GRACE = 5.0
"""SIGTERM → SIGKILL window of a hook or a verify script (at most its limit)."""


@attrs.frozen
class HookOutcome:
    ok: bool
    reason: str = ""


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
    limit = Budget(time_limit).next()
    assert limit is not None  # a budget of None is never spent
    run = await run_script(
        [path],
        env={**env, "RC_HOOK": hook},
        limit=limit,
        grace=HOOK_GRACE,
        host=host,
        run_as=run_as,
    )
    if run.ok:
        return HookOutcome(ok=True)
    reason = describe(run, f"{hook} hook {path}")
    log.warning("%s (stdout tail: %s)", reason, tail_text(run.output) or "empty")
    return HookOutcome(ok=False, reason=reason)
