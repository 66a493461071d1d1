"""The engine's logical clock, the recency of used nodes (flushed to the catalog), and
the victim heap the eviction policy orders them in."""

from __future__ import annotations

from typing import Any

import attrs

from prefixstore.engine.catalog import Catalog
from prefixstore.engine.index import Index, Node
from prefixstore.statemachine.policy import VictimHeap


@attrs.define(slots=True, eq=False)
class Recency:
    """The clock, the nodes used since the last flush, and the victim heap. Read and
    changed under the engine lock."""

    heap: VictimHeap
    clock: int = 0
    dirty: set[int] = attrs.field(factory=set)
    """Nodes whose recency changed since the last flush."""

    def tick(self) -> int:
        """The next value of the clock."""
        self.clock += 1
        return self.clock

    def used(self, node: Node, now: int) -> None:
        """``node`` was read at ``now``: its recency, to be flushed, and its heap entry."""
        node.last_used = now
        self.dirty.add(node.id)
        self.heap.offer(node)

    def forget(self, nid: int) -> None:
        """Node ``nid`` left the index: nothing of it to flush."""
        self.dirty.discard(nid)

    def flush(self, index: Index, catalog: Catalog, c: Any = None) -> None:
        """Write the recency of the nodes used since the last flush (in ``c``, or its own commit)."""
        if not self.dirty:
            return
        nodes = index.nodes
        rows = [(nodes[i].last_used, nodes[i].snap_used, i) for i in self.dirty if i in nodes]
        if c is None:
            with catalog.txn("recency") as cc:
                catalog.set_recency(cc, rows)
        else:
            catalog.set_recency(c, rows)
        self.dirty.clear()
