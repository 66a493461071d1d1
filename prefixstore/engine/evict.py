"""The evict transaction: remove nodes (leaves first) and unlink their files."""

from __future__ import annotations

from collections.abc import Set

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


def evict_nodes(ev: Evicting, nodes: list[Node], offered: Set[int] = frozenset()) -> None:
    """One evict transaction removing ``nodes`` (each after its descendants: leaves
    first), in one commit of their removal (synced by SQLite whatever the catalog's
    level: durable before any file goes, so the reclaim's barrier has nothing to do) and
    one of their reclaim (grouped, ``journal.GROUPED_COMMITS``); each parent it
    leaves without a child is offered to the victim heap, unless in ``offered``
    (offered as a leaf already).

    On a full disk with no reserve left, the nodes' files are unlinked before the
    commit, so the commit has room: the lock is held and the nodes are neither
    pinned nor fenced, so nothing reads them meanwhile; after a crash there,
    recovery finds them damaged (charged, evictable).
    """
    ids = [n.id for n in nodes]
    cat = ev.ledger.catalog
    if ev.account.disk.tight():
        journal.unlink_rows(ev.ledger, cat.files_of(ids))

    owned: list[tuple] = []
    with cat.txn("evict.remove", durable=True) as c:  # under NORMAL too: it is the unlinks' barrier
        txn = journal.begin(ev.ledger, c, "evict", {"nodes": ids},
                            rows=lambda tid: owned.extend(cat.evict_nodes(c, tid, ids)))
    try:  # the removal is published: an unexpected error must not strand the txn
        for n in nodes:
            ev.index.remove(n.id)
            ev.recency.forget(n.id)
        for pid in dict.fromkeys(n.parent for n in nodes if n.parent is not None and n.parent not in offered):
            parent = ev.index.get(pid)
            if parent is not None and parent.is_leaf:
                ev.recency.heap.offer(parent)
        # its reclaim unlinks the files the removal handed it (no read of them again)
        journal.run(ev.ledger, attrs.evolve(txn, files=tuple(owned)), txn.outputs)
    except BaseException as exc:
        abort.fail_txn(ev.abort, txn, exc)
        raise
