"""The reference controller's errors, each one a wire error.

Every error the store or the app raises on purpose is an :class:`ApiError`
carrying the HTTP status, the machine code and a human sentence, so the app
turns it into ``{"error": code, "message": message, ...extra}`` in one place.
The codes are listed in docs/protocol.md.
"""

from __future__ import annotations

from collections.abc import Mapping

from rc_worker.core.errors import RcWorkerError
from rc_worker.core.protocol import ErrorReply, unstructure

__all__ = [
    "ApiError",
    "BadRequest",
    "Conflict",
    "Forbidden",
    "NotFound",
    "StaleAttempt",
    "StoreUnavailable",
    "TooLarge",
    "Unauthorized",
    "UnknownSession",
]


class ApiError(RcWorkerError):
    """An error with a wire form: status, machine code, human message, optional extra fields."""

    status: int = 500
    default_code: str = "internal"

    def __init__(
        self, message: str, *, code: str | None = None, extra: Mapping[str, object] | None = None
    ) -> None:
        super().__init__(message)
        self.code = code or self.default_code
        self.message = message
        self.extra: dict[str, object] = dict(extra or {})

    def to_json(self) -> dict[str, object]:
        return {**unstructure(ErrorReply(self.code, self.message)), **self.extra}


class BadRequest(ApiError):
    """400: the request is malformed; the message names the field."""

    status = 400
    default_code = "bad_request"


class Unauthorized(ApiError):
    """401: no token, or a token the controller does not know."""

    status = 401
    default_code = "unauthorized"


class Forbidden(ApiError):
    """403: a valid token that may not do this (wrong role, or another host's token)."""

    status = 403
    default_code = "forbidden"


class NotFound(ApiError):
    """404: no such job, host or device."""

    status = 404
    default_code = "not_found"


class Conflict(ApiError):
    """409: the request is well-formed but the state says no (``gap``, ``cancelled``, ...)."""

    status = 409
    default_code = "conflict"


class UnknownSession(Conflict):
    """409 ``unknown_session``: the worker must register again, then carry on."""

    default_code = "unknown_session"


class StaleAttempt(Conflict):
    """409 ``stale_attempt``: the attempt named is no longer the job's current one."""

    default_code = "stale_attempt"


class TooLarge(ApiError):
    """413 ``too_large``: a request body above the controller's limit."""

    status = 413
    default_code = "too_large"


class StoreUnavailable(ApiError):
    """503 ``store_unavailable``: the controller could not store the change; retry later.

    Sent with ``Retry-After``. Nothing answered this way was acknowledged: the
    worker (or person) sends it again, and every operation is idempotent.
    """

    status = 503
    default_code = "store_unavailable"
    retry_after_s = 2
    """Every answer of this error carries ``Retry-After`` with it."""
