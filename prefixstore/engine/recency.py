"""The engine's logical clock and the recency of used nodes, flushed to the catalog."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from prefixstore.engine.api import Engine


def tick(eng: Engine) -> int:
    """The next value of the engine's clock."""
    eng._clock += 1
    return eng._clock


def flush(eng: Engine, c=None) -> None:
    """Write the recency of the nodes used since the last flush (in ``c``, or its own commit)."""
    if not eng._dirty_recency:
        return
    nodes = eng.index.nodes
    rows = [(nodes[i].last_used, nodes[i].snap_used, i) for i in eng._dirty_recency if i in nodes]
    if c is None:
        with eng.catalog.txn("recency") as cc:
            eng.catalog.set_recency(cc, rows)
    else:
        eng.catalog.set_recency(c, rows)
    eng._dirty_recency.clear()
