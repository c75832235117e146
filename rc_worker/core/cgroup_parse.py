"""Sans-IO parsers for the cgroup v2 filesystem and the /proc files that locate it."""

from __future__ import annotations

from typing import Literal

CgroupMode = Literal["auto", "required", "off"]
CGROUP_MODES: tuple[CgroupMode, ...] = ("auto", "required", "off")
"""The values of the ``cgroup`` config key."""


def unescape_mountinfo(field: str) -> str:
    """Undo the octal escapes (``\\040`` for a space) of a mountinfo field."""
    out: list[str] = []
    i = 0
    while i < len(field):
        if field[i] == "\\" and i + 3 < len(field) and field[i + 1 : i + 4].isdigit():
            out.append(chr(int(field[i + 1 : i + 4], 8)))
            i += 4
        else:
            out.append(field[i])
            i += 1
    return "".join(out)


def parse_mountinfo(text: str) -> str | None:
    """The mount point of the cgroup v2 (unified) hierarchy, or ``None``.

    Never assumed to be ``/sys/fs/cgroup``: beside v1 controllers it is often
    ``/sys/fs/cgroup/unified``. Format: ``proc(5)``, the filesystem type is
    the first field after the ``-`` separator.
    """
    for line in text.splitlines():
        fields = line.split()
        if "-" not in fields:
            continue
        sep = fields.index("-")
        if len(fields) > sep + 1 and fields[sep + 1] == "cgroup2" and len(fields) > 4:
            return unescape_mountinfo(fields[4])
    return None


def parse_proc_cgroup(text: str) -> str | None:
    """A process's v2 cgroup from ``/proc/<pid>/cgroup``: the ``0::`` line."""
    for line in text.splitlines():
        if line.startswith("0::"):
            path = line[3:].strip()
            # " (deleted)" after a path whose cgroup was removed.
            return path.removesuffix(" (deleted)") or "/"
    return None


def parse_keyed(text: str) -> dict[str, int]:
    """A flat-keyed cgroup file (``cgroup.events``, ``cpu.stat``): ``key value`` lines."""
    out: dict[str, int] = {}
    for line in text.splitlines():
        key, _, value = line.partition(" ")
        try:
            out[key] = int(value)
        except ValueError:
            continue
    return out


def parse_pids(text: str) -> tuple[int, ...]:
    return tuple(int(word) for word in text.split() if word.isdigit())


def parse_io_stat(text: str) -> dict[str, int]:
    """``io.stat`` summed over devices: ``io_read_bytes``, ``io_write_bytes`` and the op counts.

    One line per device: ``MAJ:MIN rbytes=N wbytes=N rios=N wios=N dbytes=N dios=N``.
    """
    names = {"rbytes": "io_read_bytes", "wbytes": "io_write_bytes", "rios": "io_reads",
             "wios": "io_writes"}  # fmt: skip
    out = dict.fromkeys(names.values(), 0)
    for line in text.splitlines():
        for field in line.split()[1:]:
            key, _, value = field.partition("=")
            if key in names and value.isdigit():
                out[names[key]] += int(value)
    return out
