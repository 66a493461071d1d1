"""Where a store's new checkpoint goes (its parent, the row it refills), or why it
does not; and the count of a store that did not go ahead."""

from __future__ import annotations

import attrs

from prefixstore.base.keys import Prefix
from prefixstore.engine.counters import Counters
from prefixstore.engine.holds import Holds
from prefixstore.engine.index import Index, Node
from prefixstore.engine.results import DUPLICATE, REFUSED, SKIPPED, StoreResult


@attrs.define
class Plan:
    """Where a new checkpoint goes: its parent and the row it refills, if any."""

    parent: Node | None
    existing: Node | None
    start: int


def plan(index: Index, holds: Holds, has_snapshot: bool, prefix: Prefix,
         held: frozenset[int] = frozenset()) -> Plan | StoreResult:
    """Where the store of ``prefix`` goes, or why it does not. ``held``: nodes the
    caller fences itself (an async store's peek), not counted as busy. Lock held."""
    n = len(prefix)
    keys = prefix.keys
    p = index.deepest_block(keys, n)
    owner = index.owner(keys, p)
    if owner is not None and owner.end != p:
        # Inside an existing node's span: spans.on_store splits ready nodes first;
        # this is left for a damaged one (or one changed since).
        return StoreResult(SKIPPED, n, "inside_span")
    existing = owner if (owner is not None and p == n) else None
    parent = owner if existing is None else index.get(existing.parent) if existing.parent is not None else None
    if existing is not None:
        if existing.ready and (existing.has_snapshot or not has_snapshot):
            return StoreResult(DUPLICATE, n, "duplicate")
        if holds.pins[existing.id] or holds.fenced_by_other(existing.id, held):
            return StoreResult(SKIPPED, n, "pinned" if holds.pins[existing.id] else "fenced")
    start = parent.end if parent is not None else 0
    if holds.any_inflight(keys[start:n]):
        return StoreResult(SKIPPED, n, "in_flight")
    return Plan(parent, existing, start)


def count_skip(counters: Counters, res: StoreResult) -> None:
    """Count a store that did not go ahead (skipped, duplicate, refused)."""
    if res.status in (SKIPPED, DUPLICATE, REFUSED):
        counters.inc("skips", res.reason or res.status)
