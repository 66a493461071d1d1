"""Pins, fences, reservations and in-flight blocks: the engine's holds on nodes.

A pin keeps a node from eviction and replacement (``pin()`` and running restores); a
fence marks a node a transaction is in flight on (or, as a reservation, one a queued
async store builds on); an in-flight block is a block key a store is writing. Every
count is taken and released here, so a count that reaches zero leaves no entry.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from prefixstore.engine.api import Engine


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


def fence(eng: Engine, ids: Iterable[int]) -> None:
    """One more fence on each of ``ids`` (a transaction in flight on them). Lock held."""
    take(eng._fences, ids)


def unfence(eng: Engine, ids: Iterable[int]) -> None:
    """Release fences taken by ``fence``. Lock held."""
    drop(eng._fences, ids)


def reserve(eng: Engine, ids: Iterable[int]) -> None:
    """A queued store's reservation on each of ``ids``: a fence that no transaction
    holds yet (no eviction or merge removes the row; nothing waits for it). Lock held."""
    fence(eng, ids)
    take(eng._reserved, ids)


def begin_reserved(eng: Engine, ids: Iterable[int]) -> None:
    """The queued store's job begins: its reservations on ``ids`` become plain fences. Lock held."""
    drop(eng._reserved, ids)


def unreserve(eng: Engine, ids: Iterable[int]) -> None:
    """Release reservations taken by ``reserve`` (their fences with them). Lock held."""
    ids = list(ids)
    unfence(eng, ids)
    drop(eng._reserved, ids)


def fenced_by_other(eng: Engine, nid: int, held: frozenset[int] = frozenset()) -> bool:
    """Whether a transaction other than the caller's fences node ``nid`` (the
    caller holds one fence on each node in ``held``; reservations do not count)."""
    return eng._fences[nid] - eng._reserved[nid] > (nid in held)


@contextmanager
def fenced(eng: Engine, ids: Iterable[int]) -> Iterator[None]:
    """Fence ``ids`` for the block (the caller holds the engine lock at both ends)."""
    ids = list(ids)
    fence(eng, ids)
    try:
        yield
    finally:
        unfence(eng, ids)


@contextmanager
def pinned(eng: Engine, ids: Iterable[int]) -> Iterator[None]:
    """Pin ``ids`` for the block; taken and released under the engine lock."""
    ids = list(ids)
    with eng._lock:
        take(eng._pins, ids)
    try:
        yield
    finally:
        with eng._lock:
            drop(eng._pins, ids)


def pin_request(eng: Engine, ids: Iterable[int]) -> None:
    """The pins of ``pin()`` (a request holds them). Lock held."""
    ids = list(ids)
    take(eng._pins, ids)
    take(eng._request_pins, ids)


def unpin_request(eng: Engine, ids: Iterable[int]) -> None:
    """Release pins taken by ``pin_request``. Lock held."""
    ids = list(ids)
    drop(eng._pins, ids)
    drop(eng._request_pins, ids)


def mark_inflight(eng: Engine, keys: Iterable[bytes], tid: int) -> None:
    """Mark block ``keys`` as being written by transaction ``tid``. Lock held."""
    for k in keys:
        eng._inflight_blocks[k] = tid


def clear_inflight(eng: Engine, keys: Iterable[bytes], tid: int) -> None:
    """Clear the marks ``tid`` holds on ``keys``. Lock held."""
    for k in keys:
        if eng._inflight_blocks.get(k) == tid:
            del eng._inflight_blocks[k]


@contextmanager
def inflight(eng: Engine, keys: Iterable[bytes], tid: int) -> Iterator[None]:
    """Block ``keys`` in flight for transaction ``tid`` during the block (lock held at both ends)."""
    keys = list(keys)
    mark_inflight(eng, keys, tid)
    try:
        yield
    finally:
        clear_inflight(eng, keys, tid)
