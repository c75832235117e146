"""What the GPU checks look at (``gpu_health_run._targets``), for any config that loads.

Fail closed starts here: a device the checks have no target for is never checked, and
nothing says so. Every config the loader accepts with the checks on must give every
``gpu<N>`` device and every MIG slice a target, on its physical GPU's NVML index.
"""

from __future__ import annotations

import json

from hypothesis import event, given
from hypothesis import strategies as st

from rc_worker.config_load import load_config_text
from rc_worker.core.errors import ConfigError
from rc_worker.core.gpu_query import gpu_scope
from rc_worker.gpu_health_run import _targets, mig_parent

# GPU devices, names that only look like one, and plain devices a slice may name.
_PARENTS = ["gpu0", "gpu1", "gpu7", "gpu01", "a100", "0", "card-3"]
# What mig_of may say: any of those, or an NVML index (declared or not).
_MIG_OF = [*_PARENTS, "1", "7", "01", "2", "gpu2"]


def _index(name: str) -> int | None:
    """The NVML index nvidia-smi speaks for ``name`` by, if any (``gpu<N>``)."""
    return next(iter(gpu_scope([name])), None)


@st.composite
def _config_texts(draw: st.DrawFn) -> tuple[str, str]:
    parents = draw(st.lists(st.sampled_from(_PARENTS), min_size=1, max_size=4, unique=True))
    devices: list[object] = list(parents)
    for i in range(draw(st.integers(0, 4))):
        mig: dict[str, object] = {
            "name": f"slice{i}",
            "mig_of": draw(st.sampled_from(parents) | st.sampled_from(_MIG_OF)),
        }
        if draw(st.booleans()):
            mig["mig_index"] = i
        else:
            mig["mig_uuid"] = f"MIG-{i}"
        devices.append(mig)
    enabled = draw(st.sampled_from(["auto", "true", "false"]))
    text = json.dumps({"devices": devices, "gpu_health": {"enabled": enabled}})
    return text, enabled


@given(_config_texts())
def test_every_gpu_device_and_every_slice_of_a_loaded_config_has_a_target(
    case: tuple[str, str],
) -> None:
    text, enabled = case
    try:
        config = load_config_text(text)
    except ConfigError:
        event("refused")
        return
    event(f"loaded, gpu_health {enabled}")
    if enabled == "false":
        return  # nothing is checked, by the operator's choice
    targets = _targets(config)
    for dev in config.devices:
        if dev.mig_of is not None:
            event("a slice")
            parent = mig_parent(config, dev)
            assert parent is not None
            index = _index(parent)
            assert index is not None, (dev.name, dev.mig_of)
            assert dev.name in targets, dev.name
            assert (targets[dev.name].parent, targets[dev.name].index) == (parent, index)
            assert parent in targets
        elif _index(dev.name) is not None:
            assert targets[dev.name].index == _index(dev.name)
