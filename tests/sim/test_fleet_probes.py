"""Probes in the simulated fleet: a scripted nvidia-smi and drop-ins, and invariant 4.

A device whose facts a probe pass could not confirm keeps its previous facts.
The fleet checks it at every labels payload (register and ``PUT labels``): when
the host's last nvidia-smi run failed, no GPU it speaks for may be sent.
"""

from __future__ import annotations

from typing import Any

import pytest
import trio

from rc_worker import worker as worker_module
from rc_worker.core.labels import ProbeResult
from rc_worker.testing.fleet import Fleet, simulate
from rc_worker.testing.sim import Script, Sleep, Write

H100 = "NVIDIA H100 80GB HBM3"
SMI_OK = Script(
    (
        Write(
            f"0, {H100}, GPU-5c1a9e3b-7f2d-4e8a-9b61-0d3f2a7c4e15, 81559, 590.48.01, "
            "00000000:00:09.0, 9.0, Disabled, 41, 0\n"
            f"1, {H100}, GPU-6d2b0f4c-8a3e-4f9b-ac72-1e4a3b8d5f26, 81559, 590.48.01, "
            "00000000:00:0A.0, 9.0, Disabled, 40, 0\n".encode()
        ),
    )
)
SMI_FAILS = Script(
    (
        Write(
            b"NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver. "
            b"Make sure that the latest NVIDIA driver is installed and running.\n"
        ),
    ),
    exit_code=9,
)
SMI_HANGS = Script((Sleep(3600),))


def facts(fleet: Fleet, device: str) -> dict[str, str]:
    return dict(fleet.store.device("h0", device).facts)


async def _smi_breaks_after_a_good_pass(fleet: Fleet, broken: Script) -> None:
    fleet.probe_script("10-rack", Script((Write(b'{"rack": "r12"}'),)))
    await fleet.wait_until(lambda: bool(fleet.store.devices()))
    await fleet.wait_until(lambda: facts(fleet, "gpu0").get("product") == H100)
    fleet.program_nvidia_smi(broken)
    node = fleet.nodes["h0"]
    assert node.worker is not None
    node.worker.reprobe()
    await trio.sleep(120)  # the pass runs, times out if it hangs, and sends labels
    # Preserved, not wiped on a guess; the drop-in's host fact still updates.
    assert facts(fleet, "gpu0").get("product") == H100
    assert facts(fleet, "gpu1").get("product") == H100


@pytest.mark.parametrize("broken", [SMI_FAILS, SMI_HANGS], ids=["fails", "hangs"])
def test_a_failing_nvidia_smi_keeps_the_gpus_facts(broken: Script) -> None:
    async def main(fleet: Fleet) -> list[str]:
        await _smi_breaks_after_a_good_pass(fleet, broken)
        await fleet.drain()
        return fleet.check()

    assert simulate(main, devices=("gpu0", "gpu1"), nvidia_smi=SMI_OK) == []


def test_a_worker_that_wipes_unconfirmed_facts_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    real = worker_module.labels_payload

    def wipe_unconfirmed(result: ProbeResult) -> dict[str, Any]:
        body = real(result)
        for name in result.unconfirmed:  # the bug: an unconfirmed device sent empty
            body["devices"][name] = {}
        return body

    monkeypatch.setattr(worker_module, "labels_payload", wipe_unconfirmed)

    async def main(fleet: Fleet) -> list[str]:
        with pytest.raises(AssertionError):
            await _smi_breaks_after_a_good_pass(fleet, SMI_FAILS)
        await fleet.drain()
        return fleet.check()

    found = simulate(main, devices=("gpu0", "gpu1"), nvidia_smi=SMI_OK)
    assert any("although nvidia-smi failed" in p for p in found), found


def test_an_unchanged_probe_pass_sends_no_labels_and_a_change_sends_one() -> None:
    async def main(fleet: Fleet) -> list[int]:
        node = fleet.nodes["h0"]
        await fleet.wait_until(lambda: bool(fleet.store.devices()))
        assert node.worker is not None

        def puts() -> int:
            return sum(1 for x in node.transport.log if x.endpoint == "labels")

        before = puts()
        for _ in range(5):  # five passes that find what the controller already has
            node.worker.reprobe()
            await trio.sleep(30)
        unchanged = puts() - before
        fleet.program_nvidia_smi(
            Script((Write(SMI_OK.steps[0].data.replace(b"590.48.01", b"595.10.02")),))  # type: ignore[union-attr]
        )
        node.worker.reprobe()
        await fleet.wait_until(lambda: facts(fleet, "gpu0").get("driver_version") == "595.10.02")
        changed = puts() - before - unchanged
        await fleet.drain()
        return [unchanged, changed]

    assert simulate(main, devices=("gpu0", "gpu1"), nvidia_smi=SMI_OK) == [0, 1]
