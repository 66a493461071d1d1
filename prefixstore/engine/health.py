"""Node health: marking a node damaged when its shards are found wrong."""

from __future__ import annotations

import attrs

from prefixstore.base.log import log
from prefixstore.engine.catalog import Catalog
from prefixstore.engine.counters import Counters
from prefixstore.engine.index import Node
from prefixstore.engine.readonly import Mode
from prefixstore.engine.recency import Recency
from prefixstore.statemachine.rows import NODE


@attrs.frozen(slots=True, eq=False)
class Health:
    """What marking a node damaged changes: its catalog row (unless read-only), its
    place in the victim heap, the counters."""

    catalog: Catalog
    mode: Mode
    recency: Recency
    counters: Counters


def invalidate(h: Health, node: Node, why: str) -> None:
    """Mark ``node`` damaged (one commit); descendants keep their links. Lock held."""
    if node.state == "damaged":
        return
    if h.mode.read_only is None:  # read-only: damaged in memory, found again by the next open
        with h.catalog.txn("invalidate") as c:
            h.catalog.mark_damaged(c, node.id)
    node.state = NODE.next(node.state, "invalidated")
    h.recency.heap.offer(node)
    h.counters.inc("faults", "damaged_node")
    log.warning("node_damaged", node=node.id, key=node.key.hex()[:12], why=why)
