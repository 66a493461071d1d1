"""A read-only engine: what a cache whose disk is full may still serve.

When the disk is full (out of bytes or of inodes), the catalog's reserve is spent
and nothing can be freed without a commit, ``Engine.open`` opens the cache read-only
(unless ``read_only_fallback=False``): the catalog is opened without writing
(``Catalog.open_read_only``), no recovery runs, no reserve file is created and no
file is unlinked or written. When recovery can run (a crash left the catalog's log)
but the disk is still full once it has, the open goes read-only the same way after
it, with the recovery's report kept: evicting checkpoints by policy to make room is
never what an open does. Ready nodes are looked up and restored (every restore
verifies its shards; a shard that fails is a miss, its node damaged in memory only);
every mutation raises ReadOnlyError naming the reason. Pins are in memory and stay
allowed.

Without recovery, a node an unfinished transaction touches (its rows or files, or a
row it publishes, evicts or replaces) is held out of service: it is ``unsettled`` in
memory, a lookup stops above it as above a damaged node, and a later open, once the
disk has room, recovers it as usual.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from prefixstore.engine.catalog import Catalog
from prefixstore.engine.index import Index

UNSETTLED = "unsettled"
"""In-memory state of a node held out of service by a read-only engine."""

_ID_FIELDS = ("node", "nodes", "old")
"""Journal payload fields naming the node ids a transaction changes (a store's
``parent`` and a replacement's ``parent`` are only built on, never changed)."""


def touched(journal: Iterable[tuple[int, str, str, dict]], txn_nodes: Iterable[Any],
            keys: dict[bytes, int]) -> set[int]:
    """Node ids the unfinished transactions of ``journal`` touch: those its payloads
    name (by id, or by the key of a row it writes), and ``txn_nodes`` (the nodes of
    file rows a transaction holds)."""
    out = {n for n in txn_nodes if isinstance(n, int)}
    for _tid, _kind, _state, payload in journal:
        if not isinstance(payload, dict):
            continue
        for field in _ID_FIELDS:
            value = payload.get(field)
            for nid in value if isinstance(value, list) else [value]:
                if isinstance(nid, int) and not isinstance(nid, bool):
                    out.add(nid)
        new = payload.get("new")
        written = [payload.get("key")]
        if isinstance(new, list):
            written += [r.get("key") for r in new if isinstance(r, dict)]
        for key in written:
            try:
                nid = keys.get(bytes.fromhex(key)) if isinstance(key, str) else None
            except ValueError:
                nid = None
            if nid is not None:
                out.add(nid)
    return out


def hold_out(catalog: Catalog, index: Index) -> frozenset[int]:
    """Mark ``unsettled`` (in memory) every indexed node an unfinished transaction
    touches; returns their ids."""
    journal = catalog.journal()
    if not journal:
        return frozenset()
    txn_nodes = catalog.nodes_with_txn_files()
    held = touched(journal, txn_nodes, dict(index.by_key)) & set(index.nodes)
    for nid in held:
        index.nodes[nid].state = UNSETTLED
    return frozenset(held)
