"""Failures as an operator reads them: one line naming the cause and the fix.

``rc-worker run`` never prints an exception group or a traceback (unless
``--log-level debug``). The exit status tells a service manager whether a
restart can help:

- ``2``: a configuration or permission problem a restart will not fix (a
  config error, a token the controller refuses at register, a state directory
  another worker holds or the worker cannot use, a status address in use);
- ``1``: anything else (restart it).
"""

from __future__ import annotations

from rc_worker.core.errors import ConfigError, ControllerError

EXIT_RESTART_WONT_HELP = 2
EXIT_FAILED = 1


class RegisterRefused(ConfigError):
    """The controller refused this worker's first ``register`` (401 or 403)."""


def register_refused(e: ControllerError, *, url: str, host: str) -> RegisterRefused | None:
    """The operator's reading of a refused first register, or None if not a token problem."""
    if e.status == 401:
        return RegisterRefused(
            f"the controller at {url} does not know this worker's token (401 unauthorized); "
            "set token, token_file or RC_TOKEN to a worker token the controller was started "
            "with (rc serve --worker-token)"
        )
    if e.status == 403:
        return RegisterRefused(
            f"the controller at {url} does not allow this token to act for host {host!r} "
            "(403 forbidden); use a worker token issued for that host, or set host "
            "(or RC_HOST) to the host the token is for"
        )
    return None


def unexpected(exc: BaseException) -> str:
    """One line for a failure nobody foresaw, pointing at how to learn more."""
    text = str(exc) or "(no message)"
    return (
        f"internal error: {type(exc).__name__}: {text}; rerun with --log-level debug "
        "for the traceback, and report it"
    )
