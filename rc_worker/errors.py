"""The exception hierarchy of rc_worker, in one place.

Every message names the problem and the fix. Exceptions that stand for bad
input (a config file, an assignment, a probe's output) never carry a
traceback to the operator: the CLI prints the message and exits 2.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


class RcWorkerError(Exception):
    """Base class of every error rc_worker raises on purpose."""


class ConfigError(RcWorkerError):
    """The worker's configuration is unusable.

    The message reads ``PATH:LINE:COLUMN: key.path: what is wrong; what is
    expected`` whenever the problem can be located in the file.
    """


class ControllerError(RcWorkerError):
    """The controller answered a request with a final (non-retryable) error."""

    def __init__(
        self, status: int, code: str, message: str, body: Mapping[str, Any] | None = None
    ) -> None:
        super().__init__(f"controller answered {status} {code}: {message}")
        self.status = status
        self.code = code
        self.message = message
        self.body: Mapping[str, Any] = body or {}


class UnknownSession(ControllerError):
    """The controller has forgotten this worker process; register again."""


class AssignmentError(RcWorkerError):
    """An assignment from the controller cannot be run as given."""
