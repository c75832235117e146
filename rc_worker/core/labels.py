"""The ProbeResult merger and the labels payload (sans-IO: no Trio, no processes).

A probe pass has several sources: the built-in host facts, ``nvidia-smi``
(read by ``gpu_query``), and the drop-in executables of ``probe_dir`` (read
by ``dropin_output``). The shell in ``probe.py`` runs them; this module
decides what their outcomes mean together:

- ``merge_sources``: every source's outcome this pass, plus which devices
  each drop-in spoke for the last time it worked, into a ``ProbeResult``;
- ``labels_payload``: the ``PUT /v1/hosts/{host}/labels`` body.

The rule the merger exists for (ARCHITECTURE invariant 4): a device whose
facts a pass could not confirm is left out of the payload so it keeps its
previous facts, while host facts from every source that worked are always
sent. Freezing them on one source's failure once advertised a full disk as
free and routed a job onto it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import attrs

BUILTIN = "builtin"


# --------------------------------------------------------------------------
# Results


@attrs.frozen
class ProbeResult:
    """What one probe pass produced.

    ``host`` holds host-wide facts; ``device`` has an entry for every declared
    device (possibly empty); ``unconfirmed`` names the declared devices whose
    own facts this pass could not confirm, because a source understood to
    speak for them failed. Those are left out of the label payload, so the
    controller keeps their previous facts instead of clearing them on a
    guess. None of the three is ever None.
    """

    host: Mapping[str, str] = attrs.field(factory=dict)
    device: Mapping[str, Mapping[str, str]] = attrs.field(factory=dict)
    unconfirmed: frozenset[str] = frozenset()

    @property
    def confirmed(self) -> tuple[str, ...]:
        """The devices whose facts this pass confirmed, in declared order."""
        return tuple(d for d in self.device if d not in self.unconfirmed)


@attrs.frozen
class SourceFacts:
    """One source's outcome this pass, as the merger sees it.

    ``ok`` False means the source failed and none of its output is used.
    ``unconfirmed`` lets a source that worked in part (nvidia-smi with one
    GPU lost) name the devices it could not confirm. ``scope`` is the set of
    devices a source speaks for whatever its history (nvidia-smi's declared
    ``gpu<N>`` devices; empty for the built-ins); None means it is learned:
    the devices it named on its last success in this process.
    """

    name: str
    ok: bool
    host: Mapping[str, str] = attrs.field(factory=dict)
    device: Mapping[str, Mapping[str, str]] = attrs.field(factory=dict)
    unconfirmed: frozenset[str] = frozenset()
    scope: frozenset[str] | None = None

    @classmethod
    def failed(cls, name: str, scope: frozenset[str] | None = None) -> SourceFacts:
        return cls(name=name, ok=False, scope=scope)


History = Mapping[str, frozenset[str]]


@attrs.frozen
class MergedPass:
    result: ProbeResult
    history: History


# --------------------------------------------------------------------------
# The merger


def merge_sources(
    declared: Mapping[str, Mapping[str, str]],
    sources: Sequence[SourceFacts],
    history: History,
) -> MergedPass:
    """Merge one pass's sources, in order, into a ``ProbeResult`` and the next history.

    ``declared`` maps every declared device, in config order, to its declared
    labels, which override every probe. A later source overrides an earlier
    one on the same key. ``history`` maps a learned-scope source's name to
    the devices it named on its last success; sources that did not run this
    pass keep theirs, so one that comes back broken still unconfirms what it
    last spoke for.
    """
    host: dict[str, str] = {}
    device: dict[str, dict[str, str]] = {name: {} for name in declared}
    unconfirmed: set[str] = set()
    next_history = dict(history)
    for source in sources:
        if not source.ok:
            # A source never seen to work speaks for nothing: its failure
            # must not freeze devices it may never have described, or their
            # labels could never be cleared.
            reach = source.scope if source.scope is not None else history.get(source.name)
            unconfirmed.update(reach or ())
            continue
        host.update(source.host)
        for name, facts in source.device.items():
            if name in device:
                device[name].update(facts)
        unconfirmed.update(source.unconfirmed)
        if source.scope is None:
            spoke = set(source.device) | source.unconfirmed
            next_history[source.name] = frozenset(spoke & declared.keys())
    for name, labels in declared.items():
        device[name].update(labels)
    result = ProbeResult(
        host=host, device=device, unconfirmed=frozenset(unconfirmed & declared.keys())
    )
    return MergedPass(result=result, history=next_history)


def labels_payload(result: ProbeResult) -> dict[str, Any]:
    """The body of ``PUT /v1/hosts/{host}/labels`` (less the session).

    Host facts always; every confirmed device, an empty map included (that
    clears its facts); unconfirmed devices left out, so they keep theirs.
    """
    return {
        "host": dict(result.host),
        "devices": {name: dict(result.device[name]) for name in result.confirmed},
    }
