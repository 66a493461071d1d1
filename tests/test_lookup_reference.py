"""``lookup.lookup`` against a plain reference of the lookup rule, on random trees.

The reference walks each candidate path root first and sizes every candidate, as the
rule is written in ``Engine.lookup``'s docstring: only nodes whose whole path below
the GPU-resident part is ready qualify, for layouts with snapshots only nodes that
have theirs, and the cost rule picks among them deepest first. The engine's lookup
(one walk up the parent links, the deepest candidate alone sized when there is no
cost rule) must give the same Match on every tree, state and argument.
"""

from __future__ import annotations

import random

import pytest

from prefixstore.base.keys import Prefix
from prefixstore.base.layout import Layout, TensorSpec
from prefixstore.engine.counters import Counters
from prefixstore.engine.index import Index, Node
from prefixstore.engine.lookup import Looking, lookup
from prefixstore.engine.results import Match
from prefixstore.engine.settings import Settings
from prefixstore.statemachine.cost import CostModel, choose

BT = 4


def reference(L: Layout, index: Index, cost: CostModel | None, prefix: Prefix, gpu: int, total: int | None,
              cache: str) -> Match:
    keys, n = prefix.keys, len(prefix)
    base = dict(prefix_blocks=n, block_tokens=BT, gpu_blocks=gpu, cache=cache)
    p = max((i + 1 for i in range(n) if keys[i] in index.blocks), default=0)
    owner = index.nodes[index.blocks[keys[p - 1]]] if p else None
    if owner is None:
        return Match("miss", **base)
    partial = owner.end != p and not L.has_snapshot
    node = owner if owner.end == p or partial else index.nodes.get(owner.parent) if owner.parent else None
    if node is None:
        return Match("miss", **base)
    reach = p if partial else node.end
    if reach <= gpu:
        return Match("gpu_resident", blocks=reach, node_id=node.id, **base)
    chain = [node]
    while chain[-1].parent is not None:
        chain.append(index.nodes[chain[-1].parent])
    usable, damaged = [], False
    for x in reversed(chain):  # root first
        if x.end <= gpu:
            continue
        if x.state != "ready":
            damaged = True
            break
        usable.append(x)
    cands, tokens = [], 0
    for i, x in enumerate(usable):
        tokens += (x.end - max(x.start, gpu)) * BT
        if x.has_snapshot or not L.has_snapshot:
            cands.append((x, min(x.end, reach), L.ranks * L.payload_bytes(tokens, L.has_snapshot), i + 1))
    cands.reverse()
    if not cands:
        return Match("damaged" if damaged else "miss", **base)
    total = total if total is not None else n * BT
    d = choose(cost, [(e * BT, b, k) for _, e, b, k in cands], gpu * BT, total)
    est = d.deciding
    if d.chosen is None:
        return Match("rejected_cost", **base, transfer_s=est[1], prefill_s=est[2])
    chosen, blocks, nbytes, _ = cands[d.chosen]
    if blocks < chosen.end:
        nbytes = L.ranks * L.payload_bytes((blocks - gpu) * BT, False)
    return Match("hit", blocks=blocks, node_id=chosen.id, node_key=chosen.key, nbytes=nbytes,
                 path=tuple((x.id, x.generation) for x in usable if x.end <= chosen.end),
                 transfer_s=est[1] if est else None, prefill_s=est[2] if est else None, **base)


def random_tree(rng: random.Random, snapshots: bool) -> tuple[Index, list[list[int]]]:
    """Chains of nodes of 1-3 blocks branching off earlier chains; some nodes damaged,
    some without their snapshot."""
    index, chains, nid = Index(), [], 0
    for _ in range(rng.randint(1, 12)):
        if chains and rng.random() < 0.7:
            src = rng.choice(chains)
            cut_nodes = rng.randint(1, len(src[1]))
            ids, nodes = src[0][: src[1][cut_nodes - 1][1]], list(src[1][:cut_nodes])
        else:
            ids, nodes = [], []
        ids = ids + [rng.randrange(1 << 40) for _ in range(rng.randint(1, 12))]
        p = Prefix.from_ids(ids)
        start = nodes[-1][1] if nodes else 0
        parent = nodes[-1][0] if nodes else None
        while start < len(ids):
            end = min(len(ids), start + rng.randint(1, 3))
            nid += 1
            index.add(Node(id=nid, key=p.keys[end - 1], parent=parent, start=start, end=end,
                           digests=b"".join(p.digests[start:end]),
                           has_snapshot=(not snapshots) or rng.random() < 0.7,
                           state="ready" if rng.random() < 0.85 else "damaged",
                           generation=rng.randint(1, 3), last_used=0, snap_used=0, nbytes=1))
            nodes.append((nid, end))
            parent, start = nid, end
        chains.append((ids, nodes))
    return index, [c[0] for c in chains]


@pytest.mark.parametrize("seed", range(40))
def test_lookup_matches_the_reference_rule(seed: int) -> None:
    rng = random.Random(seed)
    snapshots = seed % 2 == 1
    L = Layout(segments=[TensorSpec("kv", "uint8", (8,))], block_tokens=BT, ranks=1 + seed % 3 // 2,
               snapshots=[TensorSpec("state", "uint8", (32,))] if snapshots else [])
    index, chains = random_tree(rng, snapshots)
    costs = [None, CostModel(), CostModel(bandwidth_bytes_per_s=1e3, restore_s_per_node=1e-4,
                                           prefill_s_per_token=1e-4)]
    hits = 0
    for _ in range(60):
        ids = rng.choice(chains)
        ids = ids[: rng.randint(1, len(ids))] + [rng.randrange(1 << 40) for _ in range(rng.randint(0, 3))]
        prefix = Prefix.from_ids(ids)
        gpu = rng.randint(0, len(ids)) if rng.random() < 0.4 else 0
        total = rng.choice([None, len(ids) * BT + rng.randint(0, 64)])
        cost = rng.choice(costs)
        lk = Looking(L, index, Settings("lru", cost, None, 1.0), Counters(), "c")
        want = reference(L, index, cost, prefix, gpu, total, "c")
        assert lookup(lk, prefix, gpu, total) == want, (ids, gpu, total, cost)
        hits += want.hit
    assert hits, "no hit in this tree: the comparison would not cover the hit path"


def test_lookup_arguments_refused_as_before_the_quick_check() -> None:
    """The one-expression check of the common case lets nothing through that the
    full checks refuse, and still takes what they take (an int-like ``gpu_blocks``)."""
    import numpy as np

    from prefixstore.base.errors import BlockSizeMismatchError, InvalidArgumentError
    from prefixstore.engine import validate

    L = Layout(segments=[TensorSpec("kv", "uint8", (8,))], block_tokens=BT)
    p = Prefix.from_ids([1, 2, 3])
    for gpu, total in [(0, None), (3, 12), (np.int64(2), np.int32(7))]:
        validate.lookup_args(L, p, gpu, total)
    for gpu, total in [(True, None), (-1, None), (4, None), (0, -1), (0, False), (0, 2.0), (1.0, None)]:
        with pytest.raises(InvalidArgumentError):
            validate.lookup_args(L, p, gpu, total)
    with pytest.raises(BlockSizeMismatchError):
        validate.lookup_args(L, Prefix.from_ids([1, 2], block_tokens=BT * 2), 0, None)
    with pytest.raises(InvalidArgumentError):
        validate.lookup_args(L, [1, 2], 0, None)


def test_a_cut_prefix_is_the_prefix_of_its_blocks() -> None:
    """``p[:n]`` keeps ``p``'s first ``n`` keys instead of hashing them again: it must be
    the Prefix built from those blocks (keys, digests, block size, equality, hash)."""
    rng = random.Random(3)
    for block_tokens in (None, BT):
        p = Prefix.from_ids([rng.randrange(1 << 60) for _ in range(20)], block_tokens)
        for n in (0, 1, 7, 20, 25):
            cut, fresh = p[:n], Prefix(p.digests[:n], block_tokens)
            assert (cut.keys, cut.digests, cut.block_tokens) == (fresh.keys, fresh.digests, fresh.block_tokens)
            assert cut == fresh and hash(cut) == hash(fresh) and type(cut) is Prefix
            assert cut.keys == tuple(Prefix(p.digests[:n]).keys) and len(cut) == min(n, 20)
