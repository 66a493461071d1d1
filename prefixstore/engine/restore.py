"""Restore: read, verify and return a match's tensors; the shard checks shared with
stores, compaction and audits."""

from __future__ import annotations

import attrs
import torch

from prefixstore.base.destination import Pieces
from prefixstore.base.layout import Layout
from prefixstore.engine import health, lookup, transfers
from prefixstore.engine.catalog import Catalog
from prefixstore.engine.counters import Counters
from prefixstore.engine.guard import CallGuard
from prefixstore.engine.health import Health
from prefixstore.engine.holds import Holds
from prefixstore.engine.index import Index, Node
from prefixstore.engine.recency import Recency
from prefixstore.engine.results import Match, Restored
from prefixstore.engine.tiering import Tiers
from prefixstore.gpu import shards, verify

FileRows = dict[int, tuple[str, int, str]]
"""``{rank: (name, size, checksum)}`` of one node's live files."""


@attrs.frozen(slots=True, eq=False)
class Reader:
    """What reading and verifying one node's shards uses: the layout, the tiers and
    their pool, the fault counters."""

    layout: Layout
    tiers: Tiers
    counters: Counters


@attrs.frozen(slots=True, eq=False)
class Restoring:
    """What a restore uses: the lock and the index it checks the match against, the
    catalog's file rows, the pins it holds while reading, the pipelined reads
    (``transfers.Fetch``), the recency it records, and health for a shard found bad."""

    guard: CallGuard
    layout: Layout
    index: Index
    catalog: Catalog
    holds: Holds
    recency: Recency
    counters: Counters
    health: Health
    fetch: transfers.Fetch


def restore(rs: Restoring, match: Match, into: list[dict[str, torch.Tensor | Pieces]] | None = None) -> Restored | None:
    """Read, verify and return the tensors of ``match`` (a hit); None on a miss.
    ``into``: the output tensors per rank (checked by ``validate.into``)."""
    with rs.guard.lock:
        if not lookup.path_current(rs.index, match):
            rs.counters.inc("lookups", "stale")
            return None
        nodes = [rs.index.nodes[nid] for nid, _ in match.path]
        end = nodes[-1]
        if rs.layout.has_snapshot and not end.has_snapshot:
            return None
        rows = file_rows(rs.catalog, nodes)
        ids = [x.id for x in nodes]
        rs.holds.pin(ids)
    got = None
    try:
        # Reads overlap uploads; each shard lands in its slice of the output (no cat).
        got = transfers.restore_nodes(rs.fetch, nodes, rows, match, into)
    finally:
        with rs.guard.lock:
            rs.holds.unpin(ids)
            if got is not None and not isinstance(got, transfers.Damage):  # read: record the use in this hold
                now = rs.recency.tick()
                end.snap_used = now  # before its offer below: one heap entry for the end, with both stamps
                for x in nodes:
                    rs.recency.used(x, now)
                # each use adds a heap entry: without this a cache that only serves hits
                # (never making room) grows its victim heap without bound
                rs.recency.heap.compact_if_stale(len(rs.index), lambda: rs.index)
    if isinstance(got, transfers.Damage):
        with rs.guard.lock:
            # only the generation this restore read can be declared damaged
            if got.node.generation == dict(match.path).get(got.node.id):
                health.invalidate(rs.health, got.node, got.why)
        rs.counters.inc("lookups", "damaged_on_restore")
        return None
    if got is None:
        return None
    segments, snaps, files = got
    return Restored(match, segments, snaps, match.gpu_tokens, match.tokens, files)


def file_rows(catalog: Catalog, nodes: list[Node]) -> dict[int, FileRows]:
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
        for nid, r, name, size, ck in catalog.live_files_of([x.id for x in todo[i : i + 500]]):
            rows[nid][r] = (name, size, ck)
    for x in todo:
        x.files = (x.generation, rows[x.id])
    return rows


def read_node(rd: Reader, node: Node, rows: FileRows, with_snap: bool):
    """Read and verify ``node``'s shards on every rank.

    Returns per-rank (segments, snapshot), a damage description (str) when a shard
    is missing or fails verification, or None on a transient I/O error.
    """
    L = rd.layout
    if set(rows) != set(range(L.ranks)):
        return f"shards recorded on ranks {sorted(rows)}"
    meta = shards.meta(node.key, node.generation, node.start, node.end, node.has_snapshot)
    tokens = node.blocks * L.block_tokens

    def one(r: int):
        name, size, ck = rows[r]
        header = verify.Header(L, tokens, node.has_snapshot, {**meta, "rank": str(r)})
        got = verify.read(rd.tiers.ranks[r], name, size, ck, header=header)
        if isinstance(got, verify.Damage):
            return f"rank {r}: {got.why}"
        if isinstance(got, verify.Transient):  # an I/O error or a rank process down: a miss
            rd.counters.inc("faults", "rank_unavailable" if got.unavailable else "read")
            return None
        return got.segments, (got.snapshot if with_snap else {})

    out = [one(0)] if L.ranks == 1 else list(rd.tiers.pool.map(one, range(L.ranks)))
    for o in out:
        if isinstance(o, str):
            return o
    if any(o is None for o in out):
        return None
    return out


def verify_shards(rd: Reader, rows: FileRows, deep: set[int]) -> str | None:
    """What is wrong with a node's shards (None: nothing found). Ranks in ``deep``
    are read and checksummed, the others stat'ed."""
    ranks = rd.layout.ranks
    if set(rows) != set(range(ranks)):
        return f"shards recorded on ranks {sorted(rows)}"

    def one(r: int) -> str | None:
        name, size, ck = rows[r]
        got = (verify.stat(rd.tiers.ranks[r], name, size) if r not in deep
               else verify.read(rd.tiers.ranks[r], name, size, ck))
        if isinstance(got, verify.Transient):
            rd.counters.inc("faults", "verify")
        return f"rank {r}: {got.why}" if isinstance(got, verify.Damage) else None

    found = [one(0)] if ranks == 1 else list(rd.tiers.pool.map(one, range(ranks)))
    return next((w for w in found if w), None)
