"""The exception hierarchy of rc_worker, in one place.

Every message names the problem and the fix. Exceptions that stand for bad
input (a config file, an assignment, a probe's output) never carry a
traceback to the operator: the CLI prints the message and exits 2.

The hierarchy::

    RcWorkerError
    ├── ConfigError          the worker's config is unusable (PATH:LINE:COLUMN: ...)
    ├── AssignmentError      an assignment cannot be run as given (answered "rejected")
    ├── ControllerError      the controller answered a request with a final error
    │   └── UnknownSession   409 unknown_session: register again
    └── rc_worker.controller.errors.ApiError
                             the reference controller's wire errors (400, 401, 403,
                             404, 409 ...), each with its status and machine code

Bad arguments to the library's own constructors (``JobSpec``, say) raise
``ValueError`` / ``TypeError`` with a message naming the fix, as Python does.
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


class JobUserError(RcWorkerError):
    """A device's ``job_user`` cannot be looked up (deleted since the config was read, or
    the name service unreachable): nothing may run as it, so the device takes no work."""
