"""Sans-IO: how a process ended or failed to start, in words and in the shell convention."""

from __future__ import annotations

import os
from collections.abc import Sequence


def exit_status(returncode: int) -> tuple[int, int | None]:
    """``(exit_code, signal)`` in the shell convention from a Popen-style returncode."""
    if returncode < 0:
        return 128 - returncode, -returncode
    return returncode, None


def describe_spawn_error(
    exc: OSError, command: Sequence[str], cwd: str | None, path: str | None
) -> str:
    """A readable sentence for a job that could not be started.

    ``path`` is the PATH of the job's environment, ``None`` when it has none.
    """
    why = exc.strerror or str(exc)
    if cwd is not None and exc.filename == cwd:
        return f"cannot start {command[0]!r}: working directory {cwd!r}: {why}"
    if isinstance(exc, FileNotFoundError) and "/" not in command[0]:
        if path is None:
            return (
                f"cannot start {command[0]!r}: command not found; the job's environment "
                f"has no PATH (JobSpec.env is the whole environment), so {os.defpath} "
                "was searched"
            )
        return f"cannot start {command[0]!r}: command not found on the job's PATH ({path})"
    return f"cannot start {command[0]!r}: {why}"
