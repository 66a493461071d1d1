"""Compact-replace: swap a node's backing for a new generation in one commit.

The REPLACE transaction (see ``statemachine.transactions``): new-generation files are
written and made durable on every rank, then the row is swapped to them in a single
catalog commit, then the old generation's files are retired. Descendants keep their
parent id throughout. Used here to retire a compactable ancestor's snapshot.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from prefixstore.engine.counters import log
from prefixstore.gpu import shards
from prefixstore.gpu.ranks import shard_name

if TYPE_CHECKING:
    from prefixstore.engine.core import Engine
    from prefixstore.engine.index import Node


def retire_snapshot(eng: Engine, node: Node) -> bool:
    """Rewrite ``node`` without its snapshot; True when it was replaced.

    Runs under the engine lock. The node is fenced while its new generation is
    written; a failure on any rank rolls back and leaves the old rows serving.
    """
    rows = {
        r: (name, size, ck)
        for r, name, size, ck in eng.catalog.query(
            "SELECT rank, name, size, checksum FROM files WHERE node=? AND status='live'", (node.id,)
        )
    }
    got = eng._read_node(node, rows, with_snap=False)
    if isinstance(got, str):
        eng._invalidate(node, got)
        return False
    if got is None:
        return False
    gen = node.generation + 1
    name = shard_name(node.key, gen)
    meta = eng._shard_meta(node.key, gen, node.start, node.end, False)
    datas = [shards.encode(segs, {}, {**meta, "rank": str(r)}) for r, (segs, _) in enumerate(got)]
    needed = sum(len(d) for d in datas)
    if eng._charged + needed > eng.capacity:
        return False
    with eng.catalog.txn("replace.intent") as c:
        tid = eng._journal_begin(
            c, "replace", {"use": "retire_snapshot", "node": node.id, "name": name, "generation": gen}
        )
        c.executemany(
            "INSERT INTO files(rank, name, node, generation, size, checksum, status, txn) "
            "VALUES(?, ?, NULL, ?, ?, ?, 'writing', ?)",
            [(r, name, gen, len(d), shards.checksum(d), tid) for r, d in enumerate(datas)],
        )
    eng._charged += needed
    eng._fences[node.id] += 1
    try:
        errors = eng._write_all(name, datas)
        if errors:
            eng._rollback(tid, "replace", "INTENT", "failed")
            return False
        with eng.catalog.txn("replace.publish") as c:
            old = c.execute(
                "SELECT rank, name, size FROM files WHERE node=? AND status='live'", (node.id,)
            ).fetchall()
            c.execute(
                "UPDATE files SET status='garbage', node=NULL, txn=? WHERE node=? AND status='live'",
                (tid, node.id),
            )
            c.execute(
                "UPDATE files SET status='live', node=?, txn=NULL WHERE txn=? AND status='writing'",
                (node.id, tid),
            )
            c.execute("UPDATE nodes SET has_snapshot=0, generation=? WHERE id=?", (gen, node.id))
            eng._advance(c, tid, "replace", "INTENT", "durable")
        node.has_snapshot, node.generation, node.nbytes = False, gen, needed
        eng._finish_retire(tid, "replace", old)
        eng.counters.inc("replaces", "retire_snapshot")
        log.debug("snapshot_retired", node=node.id, freed=sum(s for _, _, s in old) - needed)
        return True
    finally:
        eng._fences[node.id] -= 1
        if not eng._fences[node.id]:
            del eng._fences[node.id]
        eng.heap.offer(node)
