"""How ``rc-worker`` writes its log: text or JSON lines, UTC timestamps, context fields.

Every line says which host it is from; a line about a device, a job attempt
or a fault also carries ``device``, ``job_id``, ``attempt`` and ``fault_id``.
Those come either from ``extra=`` at the call, or from the task's context
(``log_context``): a device's task sets ``device`` once and every line logged
by it, and by the tasks it starts, carries it (Trio copies the context into
each task it spawns).

- ``text``: ``2026-11-30T16:40:00.123Z INFO rc_worker.worker: message [device=gpu0 ...]``
- ``json``: one object per line with ``time`` (UTC, RFC 3339, milliseconds),
  ``level``, ``logger``, ``message``, and the context fields present.

A logged exception is its type and message on the same line (``error`` in
JSON); its traceback only at ``debug`` (``traceback`` in JSON).

Third-party loggers (httpx, httpcore, hypercorn) stay at WARNING unless the
level asked for is ``debug``: their per-request lines drown the worker's own.
"""

from __future__ import annotations

import contextvars
import json
import logging
import sys
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any, TextIO

CONTEXT_KEYS = ("host", "device", "job_id", "attempt", "fault_id")
THIRD_PARTY = ("httpx", "httpcore", "hypercorn", "hpack", "h11", "h2")

_context: contextvars.ContextVar[Mapping[str, Any] | None] = contextvars.ContextVar(
    "rc_worker_log_context", default=None
)


def _current() -> dict[str, Any]:
    return dict(_context.get() or {})


@contextmanager
def log_context(**fields: Any) -> Iterator[None]:
    """Add context fields to every line logged in this task (and tasks it starts) within."""
    token = _context.set({**_current(), **{k: v for k, v in fields.items() if v is not None}})
    try:
        yield
    finally:
        _context.reset(token)


def set_log_context(**fields: Any) -> None:
    """Add context fields for the rest of this task (a task's lifetime-long fields)."""
    _context.set({**_current(), **{k: v for k, v in fields.items() if v is not None}})


def utc_timestamp(seconds: float) -> str:
    """RFC 3339 in UTC with milliseconds: ``2026-11-30T16:40:00.123Z``."""
    whole = int(seconds)
    millis = int((seconds - whole) * 1000)
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(whole)) + f".{millis:03d}Z"


def fields_of(record: logging.LogRecord) -> dict[str, Any]:
    """The context fields a record carries: the task's, then the call's ``extra=``."""
    fields = dict(getattr(record, "rc_context", None) or {})
    for key in CONTEXT_KEYS:
        value = getattr(record, key, None)
        if value is not None:
            fields[key] = value
    return fields


class _ContextFilter(logging.Filter):
    """Stamp each record with the task's context and the worker's host name."""

    def __init__(self, host: str | None) -> None:
        super().__init__()
        self.host = host

    def filter(self, record: logging.LogRecord) -> bool:
        context = _current()
        if self.host and "host" not in context:
            context["host"] = self.host
        record.rc_context = context
        return True


class _Formatter(logging.Formatter):
    """Tracebacks only when asked for (``--log-level debug``); else the error in one line."""

    def __init__(self, *, tracebacks: bool = False) -> None:
        super().__init__()
        self.tracebacks = tracebacks

    def _error(self, record: logging.LogRecord) -> str | None:
        if not record.exc_info or record.exc_info[1] is None:
            return None
        if self.tracebacks:
            return self.formatException(record.exc_info)
        exc = record.exc_info[1]
        return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__


class JsonFormatter(_Formatter):
    def format(self, record: logging.LogRecord) -> str:
        line: dict[str, Any] = {
            "time": utc_timestamp(record.created),
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
        }
        line.update(fields_of(record))
        error = self._error(record)
        if error is not None:
            line["traceback" if self.tracebacks else "error"] = error
        return json.dumps(line, default=str, ensure_ascii=False)


class TextFormatter(_Formatter):
    def format(self, record: logging.LogRecord) -> str:
        fields = fields_of(record)
        fields.pop("host", None)  # one host per process: it would only repeat
        tail = " ".join(f"{k}={v}" for k, v in fields.items())
        text = (
            f"{utc_timestamp(record.created)} {record.levelname} {record.name}: "
            f"{record.getMessage()}" + (f" [{tail}]" if tail else "")
        )
        error = self._error(record)
        if error is not None:
            text += ("\n" if self.tracebacks else " (") + error + ("" if self.tracebacks else ")")
        return text


class _StderrHandler(logging.StreamHandler):  # type: ignore[type-arg]
    """Writes to whatever ``sys.stderr`` is at each line, not the one at set-up."""

    @property
    def stream(self) -> TextIO:
        return sys.stderr

    @stream.setter
    def stream(self, value: TextIO) -> None:
        pass


def setup_logging(
    level: str = "info",
    fmt: str = "text",
    *,
    host: str | None = None,
    stream: TextIO | None = None,
) -> None:
    """Configure the root logger for the ``rc-worker`` process.

    Replaces the handler an earlier call installed, and only that one (a
    test's capture handlers stay).
    """
    handler: logging.Handler = (
        logging.StreamHandler(stream) if stream is not None else _StderrHandler()
    )
    debug = level == "debug"
    handler.setFormatter(
        JsonFormatter(tracebacks=debug) if fmt == "json" else TextFormatter(tracebacks=debug)
    )
    handler.addFilter(_ContextFilter(host))
    handler._rc_worker = True  # type: ignore[attr-defined]
    root = logging.getLogger()
    for old in list(root.handlers):
        if getattr(old, "_rc_worker", False):
            root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(getattr(logging, level.upper()))
    for name in THIRD_PARTY:
        logging.getLogger(name).setLevel(logging.NOTSET if level == "debug" else logging.WARNING)
