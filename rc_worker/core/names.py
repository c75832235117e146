"""The shapes of device names, label keys and label values (sans-IO).

A label key is flat: a bare ``label`` is host-scoped and ``<device>.<label>``
is device-scoped, so device names never contain a dot. A label value is any
text but a NUL byte (``label_value_problem``).
"""

from __future__ import annotations

import re

DEVICE_NAME_RE = re.compile(r"[a-z0-9][a-z0-9_-]*")
LABEL_NAME_RE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_-]*")

DEVICE_NAME_HELP = "lower-case letters, digits, '_' and '-', starting with a letter or digit"
LABEL_NAME_HELP = "letters, digits, '_' and '-', starting with a letter, digit or '_'"


def is_device_name(name: str) -> bool:
    return DEVICE_NAME_RE.fullmatch(name) is not None


def is_label_name(name: str) -> bool:
    return LABEL_NAME_RE.fullmatch(name) is not None


def split_label_key(key: str) -> tuple[str | None, str]:
    """Split ``gpu0.product`` into ``("gpu0", "product")`` and ``rack`` into ``(None, "rack")``.

    Raises ``ValueError`` for a key that is neither shape.
    """
    device, dot, label = key.partition(".")
    if not dot:
        if not is_label_name(key):
            raise ValueError(f"label key {key!r} is not valid; a label name is {LABEL_NAME_HELP}")
        return None, key
    if not is_device_name(device) or not is_label_name(label):
        raise ValueError(
            f"label key {key!r} is not valid; expected 'label' or '<device>.<label>', "
            f"where a device name is {DEVICE_NAME_HELP} and a label name is {LABEL_NAME_HELP}"
        )
    return device, label


def label_value_problem(value: str) -> str | None:
    """Why ``value`` cannot be a label value, or None when it can.

    Any text but a NUL byte: a device's ``uuid`` or ``mig_uuid`` label becomes a
    job's ``CUDA_VISIBLE_DEVICES``, and no environment variable (a C string) can
    carry a NUL. Accepted, it failed every job on the device at spawn and got the
    device quarantined; rejected where the value comes in, the source fails instead.
    """
    if "\0" in value:
        return "holds a NUL byte; a label value must be text without NUL bytes"
    return None
