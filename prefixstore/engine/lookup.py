"""Lookup: the deepest usable checkpoint of a prefix, and the cost decision."""

from __future__ import annotations

import attrs

from prefixstore.base.keys import Prefix
from prefixstore.base.layout import Layout
from prefixstore.engine.counters import Counters
from prefixstore.engine.index import Index, Node
from prefixstore.engine.results import Match, new_match
from prefixstore.engine.settings import Settings
from prefixstore.statemachine.cost import choose

Candidate = tuple[Node, int, int, int]
"""(node, blocks covered, bytes to transfer, nodes to read)."""


@attrs.frozen(slots=True, eq=False)
class Looking:
    """What a lookup reads: the index, the cost rule (``settings.cost``), the layout;
    it records its decision in the counters and stamps its Match with ``cache_id``."""

    layout: Layout
    index: Index
    settings: Settings
    counters: Counters
    cache_id: str


def lookup(lk: Looking, prefix: Prefix, gpu_blocks: int, total_tokens: int | None) -> Match:
    """The deepest checkpoint of ``prefix`` worth restoring (see ``Engine.lookup``). Lock held."""
    L = lk.layout
    index = lk.index
    keys = prefix.keys
    n = len(keys)
    p, owner = index.deepest_owner(keys, n)
    if owner is None:
        return new_match("miss", n, L.block_tokens, gpu_blocks, cache=lk.cache_id)
    # Without snapshots a request that leaves a node inside its span can still use
    # the node's leading rows (a partial hit at block p); with snapshots it stops at
    # the deepest whole checkpoint (the recurrent state exists only at a node's end).
    partial = owner.end != p and not L.has_snapshot
    node = owner if owner.end == p or partial else index.get(owner.parent) if owner.parent is not None else None
    if node is None:
        return new_match("miss", n, L.block_tokens, gpu_blocks, cache=lk.cache_id)
    reach = p if partial else node.end  # blocks the deepest candidate covers
    if reach <= gpu_blocks:
        return new_match("gpu_resident", n, L.block_tokens, gpu_blocks, reach, node.id, cache=lk.cache_id)
    if lk.settings.cost is None and not L.has_snapshot:
        return deepest_hit(lk, n, node, reach, gpu_blocks)
    usable, damaged_below = usable_path(index, node, gpu_blocks)
    if lk.settings.cost is None:  # the deepest candidate always wins: only it is sized
        j = deepest_candidate(L, usable)
        if j is None:
            return new_match("damaged" if damaged_below else "miss", n, L.block_tokens, gpu_blocks, cache=lk.cache_id)
        x = usable[j]
        blocks = x.end if x.end < reach else reach
        return hit(lk, n, usable, j, blocks, candidate_bytes(L, usable, j, gpu_blocks), gpu_blocks, None, None)
    cands = candidates(L, usable, gpu_blocks, reach)
    if not cands:
        return new_match("damaged" if damaged_below else "miss", n, L.block_tokens, gpu_blocks, cache=lk.cache_id)
    total = total_tokens if total_tokens is not None else n * L.block_tokens
    return decide(lk, prefix, cands, usable, gpu_blocks, total)


def deepest_hit(lk: Looking, n: int, node: Node, reach: int, gpu_blocks: int) -> Match:
    """Without a cost rule or snapshots: the deepest usable node of ``node``'s path wins
    (as ``usable_path``, then ``hit``), found in one walk up that also collects the
    Match's path. Its bytes are the rows from ``gpu_blocks`` to the blocks it covers:
    the path's nodes tile that span (each starts at its parent's end)."""
    L = lk.layout
    nodes = lk.index.nodes
    path: list[tuple[int, int]] = []
    chosen = None
    damaged = False
    x = node
    while x.end > gpu_blocks:  # ends fall going up: the rest is GPU-resident
        if x.state == "ready":
            if chosen is None:
                chosen = x
            path.append((x.id, x.generation))
        else:  # a node not ready drops every node below it
            path.clear()
            chosen = None
            damaged = True
        parent = x.parent
        if parent is None:
            break
        x = nodes[parent]
    bt = L.block_tokens
    if chosen is None:
        return new_match("damaged" if damaged else "miss", n, bt, gpu_blocks, cache=lk.cache_id)
    path.reverse()
    end = chosen.end
    blocks = end if end < reach else reach
    return new_match("hit", n, bt, gpu_blocks, blocks, chosen.id, tuple(path),
                     L.ranks * L.payload_bytes((blocks - gpu_blocks) * bt, False), None, None, lk.cache_id,
                     chosen.key)


def usable_path(index: Index, node: Node, gpu_blocks: int) -> tuple[list[Node], bool]:
    """The nodes of ``node``'s path below the GPU-resident part, up to the first one not
    ready (the deepest usable endpoint is above it), *deepest first*; and whether there
    was one. One walk up the parent links: a node not ready drops every node below it."""
    usable: list[Node] = []
    damaged = False
    nodes = index.nodes
    x = node
    while x.end > gpu_blocks:  # ends fall going up: the rest is GPU-resident
        if x.state == "ready":
            usable.append(x)
        else:
            usable.clear()
            damaged = True
        parent = x.parent
        if parent is None:
            break
        x = nodes[parent]
    return usable, damaged


def deepest_candidate(L: Layout, usable: list[Node]) -> int | None:
    """The index in ``usable`` (deepest first) of the deepest node a restore can end
    at (for layouts with snapshots, the deepest that has its snapshot)."""
    if not L.has_snapshot:
        return 0 if usable else None
    return next((j for j, x in enumerate(usable) if x.has_snapshot), None)


def candidate_bytes(L: Layout, usable: list[Node], j: int, gpu_blocks: int) -> int:
    """Bytes a restore ending at ``usable[j]`` transfers (all ranks): the segment rows
    of it and the nodes above it past the GPU-resident part, plus one snapshot."""
    blocks = 0
    for x in usable[j:]:
        blocks += x.end - (x.start if x.start > gpu_blocks else gpu_blocks)
    return L.ranks * L.payload_bytes(blocks * L.block_tokens, L.has_snapshot)


def candidates(L: Layout, usable: list[Node], gpu_blocks: int, reach: int) -> list[Candidate]:
    """Candidates, deepest first (``usable`` is deepest first). The bytes are the segment
    rows above the GPU-resident part plus one snapshot, all ranks; a partial candidate
    is charged its node's whole rows (its shard is read and verified whole)."""
    bt, snapped = L.block_tokens, L.has_snapshot
    blocks = 0
    for x in usable:
        blocks += x.end - (x.start if x.start > gpu_blocks else gpu_blocks)
    cands: list[Candidate] = []
    k = len(usable)
    for x in usable:
        if x.has_snapshot or not snapped:
            cands.append((x, x.end if x.end < reach else reach, L.ranks * L.payload_bytes(blocks * bt, snapped), k))
        blocks -= x.end - (x.start if x.start > gpu_blocks else gpu_blocks)
        k -= 1
    return cands


def decide(lk: Looking, prefix: Prefix, cands: list[Candidate], usable: list[Node], gpu_blocks: int,
           total: int) -> Match:
    """The cost rule's choice among ``cands`` (recorded in the counters) as a Match."""
    bt = lk.layout.block_tokens
    gpu_tokens = gpu_blocks * bt
    decision = choose(lk.settings.cost, [(e * bt, b, k) for _, e, b, k in cands], gpu_tokens, total)
    est = decision.deciding
    if est is not None:
        lk.counters.decision(
            result=decision.result, transfer_s=est[1], prefill_s=est[2],
            key=prefix.keys[-1].hex()[:12], gpu_tokens=gpu_tokens, total_tokens=total,
            deepest_tokens=cands[0][1] * bt,
            chosen_tokens=None if decision.chosen is None else est[0],
            estimates=[list(e) for e in decision.estimates],
        )
    if decision.chosen is None:
        return new_match("rejected_cost", len(prefix), bt, gpu_blocks, cache=lk.cache_id,
                     transfer_s=est[1], prefill_s=est[2])
    _, blocks, nbytes, k = cands[decision.chosen]
    transfer_s, prefill_s = (est[1], est[2]) if est else (None, None)
    return hit(lk, len(prefix), usable, len(usable) - k, blocks, nbytes, gpu_blocks, transfer_s, prefill_s)


def hit(lk: Looking, n: int, usable: list[Node], j: int, blocks: int, nbytes: int, gpu_blocks: int,
        transfer_s: float | None, prefill_s: float | None) -> Match:
    """The hit restoring ``usable[j]`` (``usable`` deepest first) up to block ``blocks``:
    its path is that node and the nodes above it, root first."""
    L = lk.layout
    chosen = usable[j]
    path = tuple([(x.id, x.generation) for x in usable[j:]][::-1])
    if blocks < chosen.end:  # a partial hit: only the rows up to `blocks` are uploaded
        nbytes = L.ranks * L.payload_bytes((blocks - gpu_blocks) * L.block_tokens, False)
    return new_match("hit", n, L.block_tokens, gpu_blocks, blocks, chosen.id, path, nbytes, transfer_s, prefill_s,
                 lk.cache_id, chosen.key)


def path_current(index: Index, match: Match) -> bool:
    """True when ``match``'s nodes are unchanged and still tile its span exactly: a
    parent chain ending at the node of ``match.node_key``."""
    if not match.path:
        return False
    prev = None
    for nid, gen in match.path:
        node = index.get(nid)
        if node is None or node.generation != gen or not node.ready:
            return False
        if prev is None:
            if not node.start <= match.gpu_blocks < node.end:
                return False
        elif node.parent != prev.id or node.start != prev.end:
            return False
        prev = node
    if node.key != match.node_key:
        return False
    prev_end = node.end
    # the last node holds block `blocks` (at its end, or inside it for a partial hit)
    return prev_end - node.blocks < match.blocks <= prev_end
