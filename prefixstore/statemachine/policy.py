"""Eviction policies: which node to reclaim next, and how. Pure: no I/O.

A policy keeps a heap of ``(recency, seq, node_id, action)`` entries with lazy
invalidation: an entry is checked against the node's current state when popped, so
touching a node just pushes a fresh entry. Selection is O(log n) amortised per
victim; the heap is rebuilt when stale entries outnumber live nodes.

Actions:

- ``evict``: remove a leaf (its whole backing is freed).
- ``retire_snapshot``: a compactable ancestor (interior, ready, has a snapshot)
  keeps its segment for its descendants; its snapshot backing is freed.
- ``evict_subtree``: plain LRU's action on an interior node (it and every
  descendant go).

Policies:

- ``prefixstore`` (the seed's fix): leaves by recency of use, and compactable
  ancestors by recency of their *snapshot's* use, in one order. A long
  conversation's interior snapshots, never restored as endpoints, age out first.
- ``leaf-lru`` (the pre-fix behaviour): only leaves, by recency.
- ``lru``: any node by recency; an interior victim takes its subtree with it.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable, Iterable
from typing import Protocol

EVICT = "evict"
RETIRE = "retire_snapshot"
SUBTREE = "evict_subtree"
POLICIES = ("prefixstore", "leaf-lru", "lru")


class NodeView(Protocol):
    id: int
    state: str
    has_snapshot: bool
    last_used: int
    snap_used: int

    @property
    def is_leaf(self) -> bool: ...


def action_for(policy: str, node: NodeView, layout_has_snapshot: bool) -> tuple[str, int] | None:
    """The action ``policy`` would take on ``node`` and its recency key, or None."""
    if node.is_leaf:
        return EVICT, node.last_used
    if policy == "lru":
        return SUBTREE, node.last_used
    if (
        policy == "prefixstore"
        and layout_has_snapshot
        and node.state == "ready"
        and node.has_snapshot
    ):
        return RETIRE, node.snap_used
    return None


class VictimHeap:
    """Candidates for eviction under one policy, cheapest (oldest) first."""

    def __init__(self, policy: str, layout_has_snapshot: bool) -> None:
        if policy not in POLICIES:
            raise ValueError(f"unknown policy {policy!r}; known: {', '.join(POLICIES)}")
        self.policy = policy
        self.layout_has_snapshot = layout_has_snapshot
        self._heap: list[tuple[int, int, int, str]] = []
        self._seq = itertools.count()

    def __len__(self) -> int:
        return len(self._heap)

    def offer(self, node: NodeView) -> None:
        """(Re)consider ``node`` after it was created, touched, or gained/lost children."""
        a = action_for(self.policy, node, self.layout_has_snapshot)
        if a is not None:
            heapq.heappush(self._heap, (a[1], next(self._seq), node.id, a[0]))

    def rebuild(self, nodes: Iterable[NodeView]) -> None:
        self._heap = []
        for n in nodes:
            a = action_for(self.policy, n, self.layout_has_snapshot)
            if a is not None:
                self._heap.append((a[1], next(self._seq), n.id, a[0]))
        heapq.heapify(self._heap)

    def pop(
        self,
        lookup: Callable[[int], NodeView | None],
        blocked: Callable[[int, str], bool],
    ) -> tuple[int, str] | None:
        """The oldest valid, unblocked candidate ``(node_id, action)``; None if none.

        Blocked candidates (pinned, fenced, no room to rewrite) are put back.
        """
        held = []
        try:
            while self._heap:
                recency, seq, nid, action = heapq.heappop(self._heap)
                node = lookup(nid)
                if node is None:
                    continue
                current = action_for(self.policy, node, self.layout_has_snapshot)
                if current is None or current != (action, recency):
                    continue  # stale entry; a fresh one exists if still a candidate
                if blocked(nid, action):
                    held.append((recency, seq, nid, action))
                    continue
                return nid, action
            return None
        finally:
            for entry in held:
                heapq.heappush(self._heap, entry)

    def compact_if_stale(self, live: int, nodes: Callable[[], Iterable[NodeView]]) -> None:
        if len(self._heap) > 4 * max(live, 1024):
            self.rebuild(nodes())
