"""Whether a device is proven clean, and recovery's claim (sans-IO).

One rule, :func:`why_not_clean`, decides both moments at which the worker
must say whether anything of a job may be left on its device:

- at a job's end (``Lease.after_job``): not proven clean means the device
  is quarantined instead of offered again;
- after a crash (``recovery.recover`` through :func:`decide_claim`): not
  proven clean means the claim is not ``gone``.

Proven clean: the verify pass (when one ran) passed, and either a reboot
proves nothing of the job survived or the sweep proves it
(:func:`rc_worker.core.sweep_report.unproven`). Keeping the two moments on one
function is what stops a sweep the worker could not see through from
offering a device at one moment and refusing to at another.

Pure: imports no trio, httpx, os, subprocess, socket or time.
"""

from __future__ import annotations

import attrs

from rc_worker.core.model import Claim, VerifyResult
from rc_worker.core.sweep_report import SweepReport, unproven

# The fault kinds a job's end can raise (docs/protocol.md, ``kind``).
KIND_VERIFY_FAILED = "verify_failed"
KIND_DIRTY = "dirty"


@attrs.frozen
class Doubt:
    """Why a device is not proven clean: the fault ``kind`` to raise, and its ``reason``."""

    kind: str
    reason: str


def why_not_clean(
    sweep: SweepReport, verify: VerifyResult | None = None, *, reboot: bool = False
) -> Doubt | None:
    """THE rule: why the device is not proven clean after a job, or ``None`` when it is.

    ``verify`` is None where no verify pass runs (recovery: the job was
    interrupted, and the controller decides the device from the claim).
    A failed verify pass is named first: it is what an operator has to look
    at, whatever the sweep saw. ``reboot`` (recovery only) proves that no
    process of the job can be running, whatever the sweep could see.
    """
    if verify is not None and not verify.ok:
        return Doubt(KIND_VERIFY_FAILED, verify.reason)
    if reboot:
        return None
    doubt = unproven(sweep)
    if doubt is not None:
        return Doubt(KIND_DIRTY, doubt)
    return None


def proven_clean(
    sweep: SweepReport, verify: VerifyResult | None = None, *, reboot: bool = False
) -> bool:
    """Whether :func:`why_not_clean` finds nothing."""
    return why_not_clean(sweep, verify, reboot=reboot) is None


def decide_claim(sweep: SweepReport, *, reboot: bool, require_manual_clear: bool) -> Claim:
    """The claim for one interrupted job.

    ``gone`` only when proven clean (the rule a job's end decides by too);
    ``alive`` when the sweep saw something survive; ``unknown`` otherwise.
    ``require_manual_clear`` only ever makes the claim more cautious.
    """
    if require_manual_clear:
        return Claim.UNKNOWN
    if proven_clean(sweep, reboot=reboot):
        return Claim.GONE
    if sweep.remaining:
        return Claim.ALIVE
    return Claim.UNKNOWN
