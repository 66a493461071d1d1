"""The evict transaction: remove nodes (leaves first) and unlink their files."""

from __future__ import annotations

import attrs

from prefixstore.engine import abort, journal
from prefixstore.engine.abort import Abort
from prefixstore.engine.account import Account
from prefixstore.engine.index import Index, Node
from prefixstore.engine.journal import Ledger
from prefixstore.engine.recency import Recency


@attrs.frozen(slots=True, eq=False)
class Evicting:
    """What an evict changes: the catalog (through the ledger), the index, the recency
    and victim heap; the disk's room decides when files go before the commit."""

    ledger: Ledger
    account: Account
    index: Index
    recency: Recency
    abort: Abort


def evict_nodes(ev: Evicting, nodes: list[Node]) -> None:
    """One evict transaction removing ``nodes`` (leaves first).

    On a full disk with no reserve left, the nodes' files are unlinked before the
    commit, so the commit has room: the lock is held and the nodes are neither
    pinned nor fenced, so nothing reads them meanwhile; after a crash there,
    recovery finds them damaged (charged, evictable).
    """
    ids = [n.id for n in nodes]
    cat = ev.ledger.catalog
    if ev.account.disk.tight():
        journal.unlink_rows(ev.ledger, cat.files_of(ids))
    def remove(tid: int) -> None:
        for n in nodes:
            cat.evict_node(c, tid, n.id)

    with cat.txn("evict.remove") as c:
        txn = journal.begin(ev.ledger, c, "evict", {"nodes": ids}, rows=remove)
    try:  # the removal is published: an unexpected error must not strand the txn
        for n in nodes:
            ev.index.remove(n.id)
            ev.recency.forget(n.id)
        parent = ev.index.get(nodes[-1].parent) if nodes[-1].parent is not None else None
        if parent is not None:
            ev.recency.heap.offer(parent)
        journal.run(ev.ledger, txn, txn.outputs)
    except BaseException as exc:
        abort.fail_txn(ev.abort, txn, exc)
        raise
