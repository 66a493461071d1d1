"""Build the engine's index (and charged bytes, clock, victim heap) from the catalog."""

from __future__ import annotations

import attrs

from prefixstore.engine.account import Account
from prefixstore.engine.catalog import Catalog
from prefixstore.engine.index import Index, Node
from prefixstore.engine.recency import Recency


def load(index: Index, catalog: Catalog, recency: Recency, account: Account, keep: bool = False) -> None:
    """Build ``index`` (and the charged bytes, the clock, the victim heap) from the catalog.

    ``keep``: reload a running engine (after a transaction that failed past its
    publish). The Node object of every row that remains is kept and updated in
    place, with its in-memory recency when newer, so operations in flight that
    hold it (a store refilling it, a restore that pinned it) stay on the index's
    own node; pins and fences are keyed by id and untouched. Lock held.
    """
    old = index.nodes if keep else {}
    index.clear()
    sizes = catalog.live_sizes()
    clock = recency.clock if keep else 0
    for r in catalog.node_rows():
        node = Node(
            id=r[0], key=bytes(r[1]), parent=r[2], start=r[3], end=r[4], digests=bytes(r[5]),
            has_snapshot=bool(r[6]), state=r[7], generation=r[8], last_used=r[9],
            snap_used=r[10], nbytes=sizes.get(r[0], 0),
        )
        prev = old.get(node.id)
        if prev is not None and prev.key == node.key:
            node.last_used = max(node.last_used, prev.last_used)
            node.snap_used = max(node.snap_used, prev.snap_used)
            for f in attrs.fields(Node):
                setattr(prev, f.name, getattr(node, f.name))
            node = prev
        index.add(node)
        clock = max(clock, node.last_used, node.snap_used)
    recency.clock = clock
    account.charged = catalog.charged()
    recency.heap.rebuild(index)
