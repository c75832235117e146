"""systemd's ``Type=notify`` protocol, with the standard library alone.

A datagram per message to the Unix socket named by ``$NOTIFY_SOCKET`` (a
path, or ``@name`` for the abstract namespace); see sd_notify(3). Without the
variable every call is a no-op, so the worker runs the same under
supervisord, in a terminal, or in a test.

What the worker sends (``rc_worker.worker_main``):

- ``READY=1`` after its first successful register;
- ``STATUS=...`` with the device counts whenever they change;
- ``STOPPING=1`` when a signal makes it drain;
- ``WATCHDOG=1`` every half ``$WATCHDOG_USEC`` when the unit sets
  ``WatchdogSec=`` (only while the event loop runs, which is what it proves).
"""

from __future__ import annotations

import logging
import os
import socket
from collections.abc import Mapping

log = logging.getLogger("rc_worker.sd_notify")


class Notifier:
    """Sends sd_notify messages; inert when ``NOTIFY_SOCKET`` is unset."""

    def __init__(self, environ: Mapping[str, str] | None = None) -> None:
        env = os.environ if environ is None else environ
        path = env.get("NOTIFY_SOCKET") or None
        self.address: str | None = None
        if path is not None:
            # A leading '@' names the abstract namespace: a NUL byte on the wire.
            self.address = "\0" + path[1:] if path.startswith("@") else path
        self.watchdog_interval = _watchdog_interval(env)
        self._failed = False

    @property
    def enabled(self) -> bool:
        return self.address is not None

    def notify(self, *lines: str) -> None:
        if self.address is None:
            return
        message = "\n".join(lines).encode()
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
                sock.sendto(message, self.address)
        except OSError as e:
            # Never fatal: systemd gone (or a stale variable) must not stop jobs.
            if not self._failed:
                log.warning("cannot notify the service manager at %s: %s", self.address, e)
            self._failed = True


def _watchdog_interval(env: Mapping[str, str]) -> float | None:
    """Half of ``WATCHDOG_USEC`` in seconds, when it is set for this process."""
    usec = env.get("WATCHDOG_USEC", "")
    pid = env.get("WATCHDOG_PID", "")
    if not usec.isdigit() or int(usec) == 0:
        return None
    if pid and pid != str(os.getpid()):
        return None  # meant for another process (a wrapper's)
    return int(usec) / 2 / 1_000_000


def status_line(counts: Mapping[str, int]) -> str:
    """``STATUS=`` text: ``3 devices: 1 running, 2 free``."""
    total = sum(counts.values())
    parts = ", ".join(f"{n} {state}" for state, n in sorted(counts.items()) if n)
    return f"STATUS={total} device{'s' if total != 1 else ''}" + (f": {parts}" if parts else "")
