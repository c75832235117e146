"""A physical GPU shared by MIG slices (sans-IO): where its faults go."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from rc_worker.core.mig_share import GpuFaultPlan, gpu_fault_plan

NAMES = st.sampled_from(["gpu0", "gpu0-mig0", "gpu0-mig1", "gpu0-mig2", "gpu1"])


def test_the_gpu_device_holds_the_fault_and_every_slice_names_it() -> None:
    plan = gpu_fault_plan("gpu0", ["gpu0-mig1", "gpu0-mig2"], {"gpu0", "gpu0-mig1", "gpu0-mig2"})
    assert plan == GpuFaultPlan("gpu0", ("gpu0-mig1", "gpu0-mig2"))


def test_without_the_gpu_device_the_first_slice_holds_it_for_its_siblings() -> None:
    # Clearing gpu0-mig1 at the controller then clears gpu0-mig2's child too.
    plan = gpu_fault_plan("gpu0", ["gpu0-mig1", "gpu0-mig2"], {"gpu0-mig1", "gpu0-mig2"})
    assert plan == GpuFaultPlan("gpu0-mig1", ("gpu0-mig2",))


def test_a_whole_gpu_without_slices_holds_its_own_fault() -> None:
    assert gpu_fault_plan("gpu1", [], {"gpu0", "gpu1"}) == GpuFaultPlan("gpu1", ())
    assert gpu_fault_plan("gpu1", [], {"gpu0"}) is None


@given(
    parent=NAMES,
    slices=st.lists(NAMES, unique=True, max_size=4),
    devices=st.sets(NAMES),
)
def test_every_device_of_the_gpu_is_quarantined_once(
    parent: str, slices: list[str], devices: set[str]
) -> None:
    plan = gpu_fault_plan(parent, slices, devices)
    of_gpu = {parent, *slices} & devices
    if plan is None:
        assert of_gpu == set()
        return
    named = [plan.holder, *plan.children]
    assert sorted(named) == sorted(of_gpu)  # each of them, none twice, nothing else
    if parent in devices:
        assert plan.holder == parent
