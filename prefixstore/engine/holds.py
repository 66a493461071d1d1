"""Pins, fences, reservations and in-flight blocks: the engine's holds on nodes.

A pin keeps a node from eviction and replacement (``pin()`` and running restores); a
fence marks a node a transaction is in flight on (or, as a reservation, one a queued
async store builds on); an in-flight block is a block key a store is writing. Every
count is taken and released here, so a count that reaches zero leaves no entry.

Lock discipline: every count is read and changed under the engine lock (the call
guard's); every method expects it held.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Iterator
from contextlib import contextmanager

import attrs


def take(counts: Counter[int], ids: Iterable[int]) -> None:
    """One more hold of each of ``ids`` in ``counts``."""
    for x in ids:
        counts[x] += 1


def drop(counts: Counter[int], ids: Iterable[int]) -> None:
    """One hold less of each of ``ids`` in ``counts``; a zero count leaves no entry."""
    for x in ids:
        counts[x] -= 1
        if not counts[x]:
            del counts[x]


@attrs.define(slots=True, eq=False)
class Holds:
    """The holds on nodes, by node id (block keys for in-flight blocks)."""

    pins: Counter[int] = attrs.field(factory=Counter)
    """Every pin: ``pin()``'s and running restores'."""
    request_pins: Counter[int] = attrs.field(factory=Counter)
    """The pins taken by ``pin()`` (a request holds them)."""
    fences: Counter[int] = attrs.field(factory=Counter)
    reserved: Counter[int] = attrs.field(factory=Counter)
    """The part of ``fences`` that queued async stores hold as reservations of the rows
    they build on: no eviction or merge removes such a row, but no transaction is in
    flight on it, so no store or compact-replace that keeps the row waits for it."""
    inflight_blocks: dict[bytes, int] = attrs.field(factory=dict)
    """Block key -> the store transaction writing it."""

    def fence(self, ids: Iterable[int]) -> None:
        """One more fence on each of ``ids`` (a transaction in flight on them). Lock held."""
        take(self.fences, ids)

    def unfence(self, ids: Iterable[int]) -> None:
        """Release fences taken by ``fence``. Lock held."""
        drop(self.fences, ids)

    def reserve(self, ids: Iterable[int]) -> None:
        """A queued store's reservation on each of ``ids``: a fence that no transaction
        holds yet (no eviction or merge removes the row; nothing waits for it). Lock held."""
        ids = list(ids)
        self.fence(ids)
        take(self.reserved, ids)

    def begin_reserved(self, ids: Iterable[int]) -> None:
        """The queued store's job begins: its reservations on ``ids`` become plain fences. Lock held."""
        drop(self.reserved, ids)

    def unreserve(self, ids: Iterable[int]) -> None:
        """Release reservations taken by ``reserve`` (their fences with them). Lock held."""
        ids = list(ids)
        self.unfence(ids)
        drop(self.reserved, ids)

    def fenced_by_other(self, nid: int, held: frozenset[int] = frozenset()) -> bool:
        """Whether a transaction other than the caller's fences node ``nid`` (the
        caller holds one fence on each node in ``held``; reservations do not count)."""
        return self.fences[nid] - self.reserved[nid] > (nid in held)

    def held(self, nid: int) -> bool:
        """Whether node ``nid`` is pinned or fenced (no eviction or merge may take it)."""
        return bool(self.pins[nid] or self.fences[nid])

    @contextmanager
    def fenced(self, ids: Iterable[int]) -> Iterator[None]:
        """Fence ``ids`` for the block (the caller holds the engine lock at both ends)."""
        ids = list(ids)
        self.fence(ids)
        try:
            yield
        finally:
            self.unfence(ids)

    def pin(self, ids: Iterable[int]) -> None:
        """A running restore's pins. Lock held."""
        take(self.pins, ids)

    def unpin(self, ids: Iterable[int]) -> None:
        """Release pins taken by ``pin``. Lock held."""
        drop(self.pins, ids)

    def pin_request(self, ids: Iterable[int]) -> None:
        """The pins of ``pin()`` (a request holds them). Lock held."""
        ids = list(ids)
        take(self.pins, ids)
        take(self.request_pins, ids)

    def unpin_request(self, ids: Iterable[int]) -> None:
        """Release pins taken by ``pin_request``. Lock held."""
        ids = list(ids)
        drop(self.pins, ids)
        drop(self.request_pins, ids)

    def mark_inflight(self, keys: Iterable[bytes], tid: int) -> None:
        """Mark block ``keys`` as being written by transaction ``tid``. Lock held."""
        for k in keys:
            self.inflight_blocks[k] = tid

    def clear_inflight(self, keys: Iterable[bytes], tid: int) -> None:
        """Clear the marks ``tid`` holds on ``keys``. Lock held."""
        for k in keys:
            if self.inflight_blocks.get(k) == tid:
                del self.inflight_blocks[k]

    def any_inflight(self, keys: Iterable[bytes]) -> bool:
        """Whether a store is writing any of block ``keys``. Lock held."""
        return any(k in self.inflight_blocks for k in keys)
