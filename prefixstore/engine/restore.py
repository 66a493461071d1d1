"""Restore: read, verify and return a match's tensors; the shard checks shared with
stores, compaction and audits."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from prefixstore.engine import health, holds, lookup, pipeline, recency
from prefixstore.engine.index import Node
from prefixstore.engine.results import Match, Restored
from prefixstore.gpu import shards, verify

if TYPE_CHECKING:
    from prefixstore.engine.api import Engine

FileRows = dict[int, tuple[str, int, str]]
"""``{rank: (name, size, checksum)}`` of one node's live files."""


def restore(eng: Engine, match: Match, into: list[dict[str, torch.Tensor]] | None = None) -> Restored | None:
    """Read, verify and return the tensors of ``match`` (a hit); None on a miss.
    ``into``: the output tensors per rank (checked by ``validate.into``)."""
    with eng._lock:
        if not lookup.path_current(eng, match):
            eng.counters.inc("lookups", "stale")
            return None
        nodes = [eng.index.nodes[nid] for nid, _ in match.path]
        end = nodes[-1]
        if eng.layout.has_snapshot and not end.has_snapshot:
            return None
        rows = file_rows(eng, nodes)
        ids = [x.id for x in nodes]
        holds.take(eng._pins, ids)
    try:
        # Reads overlap uploads; each shard lands in its slice of the output (no cat).
        got = pipeline.restore_nodes(eng, nodes, rows, match, into)
        if isinstance(got, pipeline.Damage):
            with eng._lock:
                # only the generation this restore read can be declared damaged
                if got.node.generation == dict(match.path).get(got.node.id):
                    health.invalidate(eng, got.node, got.why)
            eng.counters.inc("lookups", "damaged_on_restore")
            return None
        if got is None:
            return None
        segments, snaps, files = got
    finally:
        with eng._lock:
            holds.drop(eng._pins, ids)
    with eng._lock:
        now = recency.tick(eng)
        for x in nodes:
            x.last_used = now
            eng._dirty_recency.add(x.id)
            eng.heap.offer(x)
        end.snap_used = now
        eng.heap.offer(end)
    return Restored(match, segments, snaps, match.gpu_tokens, match.tokens, files)


def file_rows(eng: Engine, nodes: list[Node]) -> dict[int, FileRows]:
    """``{node id: {rank: (name, size, checksum)}}`` of the live files of ``nodes``
    (current generations), from each node's cache or the catalog. Under the lock."""
    rows: dict[int, FileRows] = {}
    todo: list[Node] = []
    for x in nodes:
        f = x.files
        if f is not None and f[0] == x.generation:
            rows[x.id] = f[1]
        else:
            rows[x.id] = {}
            todo.append(x)
    for i in range(0, len(todo), 500):  # one query per 500 nodes (SQLite's variable limit)
        for nid, r, name, size, ck in eng.catalog.live_files_of([x.id for x in todo[i : i + 500]]):
            rows[nid][r] = (name, size, ck)
    for x in todo:
        x.files = (x.generation, rows[x.id])
    return rows


def read_node(eng: Engine, node: Node, rows: FileRows, with_snap: bool):
    """Read and verify ``node``'s shards on every rank.

    Returns per-rank (segments, snapshot), a damage description (str) when a shard
    is missing or fails verification, or None on a transient I/O error.
    """
    L = eng.layout
    if set(rows) != set(range(L.ranks)):
        return f"shards recorded on ranks {sorted(rows)}"
    meta = shards.meta(node.key, node.generation, node.start, node.end, node.has_snapshot)
    tokens = node.blocks * L.block_tokens

    def one(r: int):
        name, size, ck = rows[r]
        header = verify.Header(L, tokens, node.has_snapshot, {**meta, "rank": str(r)})
        got = verify.read(eng.ranks[r], name, size, ck, header=header)
        if isinstance(got, verify.Damage):
            return f"rank {r}: {got.why}"
        if isinstance(got, verify.Transient):  # an I/O error or a rank process down: a miss
            eng.counters.inc("faults", "rank_unavailable" if got.unavailable else "read")
            return None
        return got.segments, (got.snapshot if with_snap else {})

    out = [one(0)] if L.ranks == 1 else list(eng._pool.map(one, range(L.ranks)))
    for o in out:
        if isinstance(o, str):
            return o
    if any(o is None for o in out):
        return None
    return out


def verify_shards(eng: Engine, rows: FileRows, deep: set[int]) -> str | None:
    """What is wrong with a node's shards (None: nothing found). Ranks in ``deep``
    are read and checksummed, the others stat'ed."""
    if set(rows) != set(range(eng.layout.ranks)):
        return f"shards recorded on ranks {sorted(rows)}"

    def one(r: int) -> str | None:
        name, size, ck = rows[r]
        got = (verify.stat(eng.ranks[r], name, size) if r not in deep
               else verify.read(eng.ranks[r], name, size, ck))
        if isinstance(got, verify.Transient):
            eng.counters.inc("faults", "verify")
        return f"rank {r}: {got.why}" if isinstance(got, verify.Damage) else None

    found = [one(0)] if eng.layout.ranks == 1 else list(eng._pool.map(one, range(eng.layout.ranks)))
    return next((w for w in found if w), None)
