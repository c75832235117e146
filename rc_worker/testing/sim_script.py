"""Scripts of simulated processes: what each does, step by step, in virtual time.

A :class:`Script` is frozen data: its steps (:class:`Sleep`, :class:`Write`,
:class:`Hang`, :class:`EchoStdin`, :class:`Fork`), then an exit code, plus what
SIGTERM does (:class:`OnSigterm`). ``rc_worker.testing.sim`` runs them.
"""

from __future__ import annotations

from collections.abc import Iterable

import attrs

__all__ = [
    "EchoStdin",
    "Fork",
    "Hang",
    "HostFacts",
    "OnSigterm",
    "Script",
    "Sleep",
    "Step",
    "Write",
]


@attrs.frozen
class Sleep:
    """Run (asleep, state ``S``) for ``seconds`` of virtual time."""

    seconds: float


@attrs.frozen
class Write:
    """Write ``data`` to stdout, or to stderr (which is stdout unless spawned separate).

    ``repeat`` writes it that many times over, in one go: a big output that
    still reads (and prints in a failing example) in one line.
    """

    data: bytes
    stderr: bool = False
    repeat: int = 1

    @property
    def payload(self) -> bytes:
        return self.data * self.repeat


@attrs.frozen
class Hang:
    """Uninterruptible sleep (state ``D``) for ``seconds``; ``math.inf`` for ever.

    Signals sent meanwhile are held and acted on when it ends: a SIGKILL
    then kills at once. This is the process that survives SIGKILL.
    """

    seconds: float


@attrs.frozen
class EchoStdin:
    """Read standard input to its end, writing each piece to stdout as it comes."""


@attrs.frozen
class Fork:
    """Start ``child`` alongside and carry on at once.

    The child inherits the environment (``RC_JOB_ID`` included). With
    ``setsid`` it leaves the process group and session (it escapes group
    teardown); with ``holds_output`` (the default) it holds the parent's
    stdout and stderr open, else its output goes to ``/dev/null``.
    """

    child: Script
    setsid: bool = False
    holds_output: bool = True


@attrs.frozen
class OnSigterm:
    """What a process does on SIGTERM.

    The default dies of it. ``ignore`` ignores it (only SIGKILL works then);
    otherwise a handler runs ``delay`` seconds (the rest of the script does
    not), then exits with ``exit_code``, or dies of the signal when ``None``.
    """

    ignore: bool = False
    delay: float = 0.0
    exit_code: int | None = None


def _steps(steps: Iterable[Step]) -> tuple[Step, ...]:
    return tuple(steps)


@attrs.frozen
class Script:
    """What a simulated process does: ``steps`` in order, then exit with ``exit_code``.

    Frozen and built from frozen parts, so scripts compose (:meth:`then`) and
    hypothesis can build them (``st.builds(Script, ...)``). ``environ_readable``
    False makes the process's environment unreadable to the worker (another
    user's process, for a worker that is not root): sweeps go blind.
    ``uid`` is the owner the process table shows.
    """

    steps: tuple[Step, ...] = attrs.field(default=(), converter=_steps)
    exit_code: int = 0
    on_sigterm: OnSigterm = OnSigterm()
    environ_readable: bool = True
    uid: int = 0

    @classmethod
    def sleeping(cls, seconds: float, *, exit_code: int = 0) -> Script:
        """Run ``seconds`` of virtual time, print nothing, exit with ``exit_code``."""
        return cls((Sleep(seconds),), exit_code=exit_code)

    @classmethod
    def printing(cls, *chunks: tuple[float, bytes], exit_code: int = 0) -> Script:
        """Print each ``(at, data)`` at ``at`` seconds after the start (in order), then exit."""
        steps: list[Step] = []
        now = 0.0
        for at, data in chunks:
            if at > now:
                steps.append(Sleep(at - now))
                now = at
            steps.append(Write(data))
        return cls(steps, exit_code=exit_code)

    def then(self, *steps: Step) -> Script:
        """This script with ``steps`` appended."""
        return attrs.evolve(self, steps=(*self.steps, *steps))

    def exiting(self, exit_code: int) -> Script:
        return attrs.evolve(self, exit_code=exit_code)

    def ignoring_sigterm(self) -> Script:
        return attrs.evolve(self, on_sigterm=OnSigterm(ignore=True))

    def on_term(self, delay: float, exit_code: int | None = 0) -> Script:
        """On SIGTERM, stop, spend ``delay`` seconds cleaning up, then exit."""
        return attrs.evolve(self, on_sigterm=OnSigterm(delay=delay, exit_code=exit_code))

    @property
    def duration(self) -> float:
        """Virtual seconds its own steps take when nothing blocks or signals it."""
        return sum(s.seconds for s in self.steps if isinstance(s, Sleep | Hang))

    @property
    def output(self) -> bytes:
        """What its own steps write (stdout and stderr), forks and stdin left out."""
        return b"".join(s.payload for s in self.steps if isinstance(s, Write))


Step = Sleep | Write | Hang | EchoStdin | Fork
"""One step of a :class:`Script`."""


@attrs.frozen
class HostFacts:
    """The built-in facts a SimHost reports; replace ``SimHost.facts`` to change them."""

    hostname: str = "sim-host"
    kernel: str = "6.1.0-sim"
    cpu_count: int = 8
    mem_total_bytes: int = 64 * 2**30
    disk_free_bytes: int = 500 * 10**9
