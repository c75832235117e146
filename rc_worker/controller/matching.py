"""Indexed matching: which devices a selector can match, without looking at the whole fleet.

The store keeps every device's label view (what a selector sees, built by
:meth:`~rc_worker.controller.records.Device.labels`) here, cached, and an index
from each ``key=value`` and each key to the devices that carry it. A selector's
candidates are then the devices of its most selective term, filtered by the
selector itself, so the answer is always exactly the brute-force one
(:func:`brute_force`), which the property tests check:

- ``k=v`` with a ``v`` that is not a number: only devices whose label is the
  string ``v`` can match (the index of ``(k, v)``);
- ``k=v`` with a number ``v``, and the ordering operators: only devices that
  carry ``k`` can match (the index of ``k``); ``80G`` equals ``80000000000``,
  so numbers are not looked up by their spelling;
- ``k!=v`` narrows nothing (an absent label matches).

A job's candidates are cached per job against the index's :attr:`LabelIndex.epoch`,
which moves whenever any label view changes, so the matcher run by a poll is a set
lookup per queued job. Sans-IO: plain data, no Trio.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import TypeVar

from rc_worker.core.selectors import Selector

__all__ = ["Address", "LabelIndex", "brute_force"]

Address = tuple[str, str]
"""``(host, device)``."""

_K = TypeVar("_K")

MAX_CACHED = 1024
"""Selectors whose candidate sets :meth:`LabelIndex.cached` keeps at once."""


class LabelIndex:
    """Label views per device, and the devices per label, kept in step."""

    def __init__(self) -> None:
        self.views: dict[Address, dict[str, str]] = {}
        self._by_pair: dict[tuple[str, str], set[Address]] = {}
        self._by_key: dict[str, set[Address]] = {}
        self.epoch = 0
        """Moves with every change of any view: cached candidate sets older than it are stale."""
        self._cache: dict[str, set[Address]] = {}
        self._cache_epoch = 0

    def __len__(self) -> int:
        return len(self.views)

    def update(self, addr: Address, view: Mapping[str, str]) -> bool:
        """Set a device's view; False (and nothing done) if it is the one already held."""
        old = self.views.get(addr)
        if old == view:
            return False
        if old is not None:
            self._unindex(addr, old)
        new = dict(view)
        self.views[addr] = new
        for k, v in new.items():
            self._by_pair.setdefault((k, v), set()).add(addr)
            self._by_key.setdefault(k, set()).add(addr)
        self.epoch += 1
        return True

    def remove(self, addr: Address) -> None:
        old = self.views.pop(addr, None)
        if old is not None:
            self._unindex(addr, old)
            self.epoch += 1

    def _unindex(self, addr: Address, view: Mapping[str, str]) -> None:
        for k, v in view.items():
            _discard(self._by_pair, (k, v), addr)
            _discard(self._by_key, k, addr)

    def cached(self, selector: Selector) -> set[Address]:
        """:meth:`candidates`, kept per selector until any view changes: jobs submitted with
        the same selector (the usual case) cost one set lookup each. Do not mutate it."""
        if self._cache_epoch != self.epoch:
            self._cache.clear()
            self._cache_epoch = self.epoch
        key = str(selector)
        found = self._cache.get(key)
        if found is None:
            if len(self._cache) >= MAX_CACHED:
                self._cache.clear()  # bounded: many distinct selectors are computed again
            found = self._cache[key] = self.candidates(selector)
        return found

    def candidates(self, selector: Selector) -> set[Address]:
        """Exactly the devices whose view ``selector`` matches."""
        narrowest: set[Address] | None = None
        for term in selector.terms:
            if term.op == "!=":
                continue
            if term.op == "=" and term.number is None:
                found = self._by_pair.get((term.key, term.value), set())
            else:
                found = self._by_key.get(term.key, set())
            if narrowest is None or len(found) < len(narrowest):
                narrowest = found
            if not narrowest:
                return set()
        pool: Iterable[Address] = self.views if narrowest is None else narrowest
        if not selector.terms:
            return set(pool)
        return {a for a in pool if selector.matches(self.views[a])}


def _discard(index: dict[_K, set[Address]], key: _K, addr: Address) -> None:
    found = index.get(key)
    if found is not None:
        found.discard(addr)
        if not found:
            del index[key]


def brute_force(views: Mapping[Address, Mapping[str, str]], selector: Selector) -> set[Address]:
    """The reference answer: every view tried against the selector."""
    return {a for a, view in views.items() if selector.matches(view)}
