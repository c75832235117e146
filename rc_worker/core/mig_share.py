"""A physical GPU shared by MIG slices: where its faults go (sans-IO).

Some facts belong to the physical GPU, whichever device read them: its ECC
counters, retired pages and remapped rows count for the whole card, so
growth read through one slice is growth on every slice of it. Such a fault
is raised once, on the GPU's own device, and every slice of the GPU holds a
fault naming it (``parent_fault``), so clearing the GPU's device at the
controller clears them all (docs/operations.md, "GPU health").
"""

from __future__ import annotations

from collections.abc import Collection, Sequence

import attrs


@attrs.frozen
class GpuFaultPlan:
    """Which device holds a physical GPU's fault, and which hold one naming it."""

    holder: str
    children: tuple[str, ...] = ()


def gpu_fault_plan(
    parent: str, slices: Sequence[str], devices: Collection[str]
) -> GpuFaultPlan | None:
    """Where a fault of physical GPU ``parent`` (a device name) goes.

    The GPU's device holds it and each of its ``slices`` gets a child. A
    validated config always declares the GPU's device (``mig_of`` must name
    one), but should the worker have no device by that name, the first slice
    holds the fault in its place: every slice is still quarantined, and
    clearing that slice clears its siblings' children, as clearing the GPU
    would. Only names in ``devices`` are planned for; None when none is.
    """
    present = tuple(s for s in slices if s in devices and s != parent)
    if parent in devices:
        return GpuFaultPlan(parent, present)
    if not present:
        return None
    return GpuFaultPlan(present[0], present[1:])
