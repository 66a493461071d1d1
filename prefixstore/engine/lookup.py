"""Lookup: the deepest usable checkpoint of a prefix, and the cost decision."""

from __future__ import annotations

import attrs

from prefixstore.base.keys import Prefix
from prefixstore.base.layout import Layout
from prefixstore.engine.counters import Counters
from prefixstore.engine.index import Index, Node
from prefixstore.engine.results import Match
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
    n = len(prefix)
    keys = prefix.keys
    base = dict(prefix_blocks=n, block_tokens=L.block_tokens, gpu_blocks=gpu_blocks, cache=lk.cache_id)
    p = lk.index.deepest_block(keys, n)
    owner = lk.index.owner(keys, p)
    if owner is None:
        return Match("miss", **base)
    # Without snapshots a request that leaves a node inside its span can still use
    # the node's leading rows (a partial hit at block p); with snapshots it stops at
    # the deepest whole checkpoint (the recurrent state exists only at a node's end).
    partial = owner.end != p and not L.has_snapshot
    node = owner if owner.end == p or partial else lk.index.get(owner.parent) if owner.parent is not None else None
    if node is None:
        return Match("miss", **base)
    reach = p if partial else node.end  # blocks the deepest candidate covers
    if reach <= gpu_blocks:
        return Match("gpu_resident", blocks=reach, node_id=node.id, **base)
    usable, damaged_below = usable_path(lk.index, node, gpu_blocks)
    cands = candidates(L, usable, gpu_blocks, reach)
    if not cands:
        return Match("damaged" if damaged_below else "miss", **base)
    total = total_tokens if total_tokens is not None else n * L.block_tokens
    return decide(lk, keys[-1], cands, usable, gpu_blocks, total, base)


def usable_path(index: Index, node: Node, gpu_blocks: int) -> tuple[list[Node], bool]:
    """The nodes of ``node``'s path below the GPU-resident part, up to the first one not
    ready (the deepest usable endpoint is above it); and whether there was one."""
    usable: list[Node] = []
    for x in index.path(node):
        if x.end <= gpu_blocks:
            continue
        if not x.ready:
            return usable, True
        usable.append(x)
    return usable, False


def candidates(L: Layout, usable: list[Node], gpu_blocks: int, reach: int) -> list[Candidate]:
    """Candidates, deepest first. The bytes are the segment rows above the GPU-resident
    part plus one snapshot, all ranks; a partial candidate is charged its node's whole
    rows (its shard is read and verified whole)."""
    cands: list[Candidate] = []
    tokens = 0
    for i, x in enumerate(usable):
        tokens += (x.end - max(x.start, gpu_blocks)) * L.block_tokens
        if x.has_snapshot or not L.has_snapshot:
            cands.append((x, min(x.end, reach), L.ranks * L.payload_bytes(tokens, L.has_snapshot), i + 1))
    cands.reverse()
    return cands


def decide(lk: Looking, key: bytes, cands: list[Candidate], usable: list[Node], gpu_blocks: int,
           total: int, base: dict) -> Match:
    """The cost rule's choice among ``cands`` (recorded in the counters) as a Match."""
    L = lk.layout
    gpu_tokens = gpu_blocks * L.block_tokens
    decision = choose(lk.settings.cost, [(e * L.block_tokens, b, k) for _, e, b, k in cands], gpu_tokens, total)
    est = decision.deciding
    if est is not None:
        lk.counters.decision(
            result=decision.result, transfer_s=est[1], prefill_s=est[2],
            key=key.hex()[:12], gpu_tokens=gpu_tokens, total_tokens=total,
            deepest_tokens=cands[0][1] * L.block_tokens,
            chosen_tokens=None if decision.chosen is None else est[0],
            estimates=[list(e) for e in decision.estimates],
        )
    if decision.chosen is None:
        return Match("rejected_cost", **base, transfer_s=est[1], prefill_s=est[2])
    chosen, blocks, nbytes, _ = cands[decision.chosen]
    chosen_path = tuple((x.id, x.generation) for x in usable if x.end <= chosen.end)
    if blocks < chosen.end:  # a partial hit: only the rows up to `blocks` are uploaded
        nbytes = L.ranks * L.payload_bytes((blocks - gpu_blocks) * L.block_tokens, False)
    return Match(
        "hit", blocks=blocks, node_id=chosen.id, node_key=chosen.key, path=chosen_path, nbytes=nbytes,
        transfer_s=est[1] if est else None, prefill_s=est[2] if est else None, **base,
    )


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
