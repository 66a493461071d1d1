"""The evict transaction: remove nodes (leaves first) and unlink their files."""

from __future__ import annotations

from typing import TYPE_CHECKING

from prefixstore.engine import journal, pipeline
from prefixstore.engine.index import Node

if TYPE_CHECKING:
    from prefixstore.engine.api import Engine


def evict_nodes(eng: Engine, nodes: list[Node]) -> None:
    """One evict transaction removing ``nodes`` (leaves first).

    On a full disk with no reserve left, the nodes' files are unlinked before the
    commit, so the commit has room: the lock is held and the nodes are neither
    pinned nor fenced, so nothing reads them meanwhile; after a crash there,
    recovery finds them damaged (charged, evictable).
    """
    ids = [n.id for n in nodes]
    if eng.account.disk.tight():
        journal.unlink_rows(eng, eng.catalog.files_of(ids))
    def remove(tid: int) -> None:
        for n in nodes:
            eng.catalog.evict_node(c, tid, n.id)

    with eng.catalog.txn("evict.remove") as c:
        txn = journal.begin(eng, c, "evict", {"nodes": ids}, rows=remove)
    try:  # the removal is published: an unexpected error must not strand the txn
        for n in nodes:
            eng.index.remove(n.id)
            eng.recency.forget(n.id)
        parent = eng.index.get(nodes[-1].parent) if nodes[-1].parent is not None else None
        if parent is not None:
            eng.recency.heap.offer(parent)
        journal.run(eng, txn, txn.outputs)
    except BaseException as exc:
        pipeline.fail_txn(eng, txn, exc)
        raise
