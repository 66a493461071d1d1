"""Node health: marking a node damaged when its shards are found wrong."""

from __future__ import annotations

from typing import TYPE_CHECKING

from prefixstore.base.log import log
from prefixstore.engine.index import Node
from prefixstore.statemachine.rows import NODE

if TYPE_CHECKING:
    from prefixstore.engine.api import Engine


def invalidate(eng: Engine, node: Node, why: str) -> None:
    """Mark ``node`` damaged (one commit); descendants keep their links."""
    if node.state == "damaged":
        return
    if eng.read_only is None:  # read-only: damaged in memory, found again by the next open
        with eng.catalog.txn("invalidate") as c:
            eng.catalog.mark_damaged(c, node.id)
    node.state = NODE.next(node.state, "invalidated")
    eng.recency.heap.offer(node)
    eng.counters.inc("faults", "damaged_node")
    log.warning("node_damaged", node=node.id, key=node.key.hex()[:12], why=why)
