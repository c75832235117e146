"""The bodies of ``finish`` reports (sans-IO).

A job's ``Result`` (``supervise.py``) and its ``SweepReport`` (``sweep.py``)
belong to the shell that produces them; this module reads them through the
two protocols below, which name exactly the fields a report is made from.

Each report is a :class:`~rc_worker.core.protocol.FinishRequest` built here and turned
into its wire form by the protocol's converter: that JSON object is what the
outbox keeps on disk until the controller acknowledges it, and the client adds
the live session when it sends it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol

from rc_worker.core import protocol
from rc_worker.core.model import Assignment, Outcome, VerifyResult
from rc_worker.core.protocol import NO_SESSION, FinishRequest, Sweep, Verify


class SweepFacts(Protocol):
    """What a report says of a sweep: the fields of ``sweep.SweepReport``."""

    @property
    def scanned(self) -> bool: ...
    @property
    def found(self) -> tuple[int, ...]: ...
    @property
    def remaining(self) -> tuple[int, ...]: ...
    @property
    def blind(self) -> bool: ...
    @property
    def blind_pids(self) -> tuple[int, ...]: ...
    @property
    def method(self) -> str: ...


class JobEnd(Protocol):
    """What a report says of how a job ended: the fields of ``supervise.Result``."""

    @property
    def exit_code(self) -> int | None: ...
    @property
    def killed(self) -> bool: ...
    @property
    def reason(self) -> str: ...
    @property
    def error(self) -> str | None: ...
    @property
    def sweep(self) -> SweepFacts: ...
    @property
    def usage(self) -> Mapping[str, int]: ...


def sweep_json(sweep: SweepFacts | None) -> dict[str, Any] | None:
    if sweep is None:
        return None
    return protocol.unstructure(
        Sweep(
            scanned=sweep.scanned,
            found=tuple(sweep.found),
            remaining=tuple(sweep.remaining),
            blind=sweep.blind,
            blind_pids=tuple(sweep.blind_pids),
            method=sweep.method,
        )
    )


def outcome_of(exit_code: int | None, killed: bool, error: str | None, reason: str) -> Outcome:
    """The protocol outcome of a job's ``Result``.

    A job stopped before its process was spawned has ``error`` set and a stop
    ``reason``: it was killed by its owner, not unable to start.
    """
    if killed or (error is not None and reason):
        return Outcome.KILLED
    if error is not None:
        return Outcome.ERROR
    return Outcome.SUCCEEDED if exit_code == 0 else Outcome.FAILED


def finish_report(
    a: Assignment,
    result: JobEnd,
    *,
    verify: VerifyResult,
    fault_id: str | None,
    output_bytes: int,
) -> dict[str, Any]:
    """The finish of a job that was spawned (or tried to be)."""
    outcome = outcome_of(result.exit_code, result.killed, result.error, result.reason)
    return protocol.unstructure(
        FinishRequest(
            NO_SESSION,
            a.attempt,
            a.device,
            str(outcome),
            exit_code=result.exit_code,
            killed=outcome is Outcome.KILLED,
            reason=result.reason,
            error=result.error,
            output_bytes=output_bytes,
            sweep=sweep_json(result.sweep),
            verify=Verify(ok=verify.ok, reason=verify.reason),
            fault_id=fault_id,
            # The job's cgroup accounting; only with a cgroup (see docs/operations.md).
            usage=dict(result.usage) if result.usage else None,
        )
    )


def stale_offer_report(a: Assignment | tuple[str, int, str], why: str) -> dict[str, Any]:
    """``refused`` because the device's state was in the way, not the assignment:
    the controller requeues it without counting it against the job (docs/protocol.md)."""
    return not_run_report(a, "refused", f"stale offer: {why}", stale_offer=True)


def not_run_report(
    a: Assignment | tuple[str, int, str],
    outcome: str,
    reason: str,
    *,
    error: str | None = None,
    stale_offer: bool = False,
) -> dict[str, Any]:
    """The finish of an attempt whose process never ran: refused, rejected, cancelled early."""
    attempt, device = (a.attempt, a.device) if isinstance(a, Assignment) else (a[1], a[2])
    return protocol.unstructure(
        FinishRequest(
            NO_SESSION,
            attempt,
            device,
            outcome,
            killed=outcome == Outcome.KILLED,
            reason=reason,
            error=error,
            output_bytes=0,
            stale_offer=stale_offer,
        )
    )


def lost_report(
    job_id: str, attempt: int, device: str, *, sweep: SweepFacts | None, output_bytes: int
) -> dict[str, Any]:
    """The finish a restarted worker sends, from its journal, for an interrupted job."""
    return protocol.unstructure(
        FinishRequest(
            NO_SESSION,
            attempt,
            device,
            str(Outcome.LOST),
            reason="the worker process stopped before the job ended",
            output_bytes=output_bytes,
            sweep=sweep_json(sweep),
        )
    )
