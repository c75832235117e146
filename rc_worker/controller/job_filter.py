"""Which jobs a listing keeps when it is asked for a host or a selector (sans-IO).

``GET /v1/jobs?host=H&select=S`` (and ``rc ps --host/--select``) keep the jobs whose
current attempt is placed on host ``H`` and on a device that satisfies ``S``: the
same words as ``GET /v1/devices`` filters by, so "what runs on the H100s of rack 4" is
one request. A queued job is placed nowhere and is left out by either filter. Applied
before the page is cut, so a page is full whenever more jobs match.
"""

from __future__ import annotations

from collections.abc import Callable, Collection

from rc_worker.controller.matching import Address
from rc_worker.controller.records import Job

JobFilter = Callable[[Job], bool]


def placement_filter(host: str | None, devices: Collection[Address] | None) -> JobFilter | None:
    """Keep jobs placed on ``host`` (if given) and on one of ``devices`` (if given);
    None when neither narrows anything."""
    if host is None and devices is None:
        return None

    def keep(job: Job) -> bool:
        placed = job.current
        if placed is None:
            return False
        if host is not None and placed.host != host:
            return False
        return devices is None or (placed.host, placed.device) in devices

    return keep
