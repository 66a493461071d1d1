"""Partial hits: without snapshots, a request that leaves a stored node inside its span
restores the node's leading rows (up to the last shared block), never more and never
other bytes; with snapshots a lookup still stops at the deepest whole checkpoint."""

from __future__ import annotations

import os

import pytest
import torch
from conftest import (
    BT,
    assert_restores,
    make_layout,
    node_at,
    seg_tensors,
    store_tokens,
    tokens_for,
)

from prefixstore.base.keys import Prefix
from prefixstore.engine.api import Engine

CAP = 16 << 20


def branch(tokens: list[int], shared_blocks: int, seed: int, extra_blocks: int) -> list[int]:
    """``tokens``' first ``shared_blocks`` blocks, then new blocks."""
    return tokens[: shared_blocks * BT] + tokens_for(seed, extra_blocks)


@pytest.mark.parametrize("backing", ["disk", "memory", "composite"])
@pytest.mark.parametrize("ranks", [1, 2])
def test_a_request_leaving_a_node_inside_its_span_restores_the_shared_rows(tmp_path, backing, ranks):
    L = make_layout(ranks=ranks, snapshot=False)
    with Engine.open(str(tmp_path / "c"), L, CAP, backing=backing, ram_bytes=CAP) as eng:
        a = tokens_for(1, 8)
        assert store_tokens(eng, a[: 3 * BT]).ok
        assert store_tokens(eng, a).ok  # nodes (0,3] and (3,8]
        for shared in (1, 3, 5, 7):
            assert_restores(eng, branch(a, shared, 100 + shared, 4), blocks=shared)
        m = eng.lookup(Prefix.from_tokens(branch(a, 5, 9, 4), BT))
        assert m.path == tuple((x.id, x.generation) for x in eng.index.path(node_at(eng, a)))
        assert m.nbytes == ranks * L.payload_bytes(5 * BT, False)
        r = eng.restore(m)
        assert r.end_tokens == 5 * BT and r.files_read == 2 * ranks
        assert all(t.shape[0] == 5 * BT for seg in r.segments for t in seg.values())
        assert eng.audit().ok


def test_partial_hit_above_gpu_resident_blocks_restores_only_the_rows_between(tmp_path):
    L = make_layout(snapshot=False)
    with Engine.open(str(tmp_path / "c"), L, CAP) as eng:
        a = tokens_for(2, 8)
        assert store_tokens(eng, a).ok
        req = branch(a, 6, 20, 2)
        prefix = Prefix.from_tokens(req, BT)
        m = eng.lookup(prefix, gpu_blocks=2)
        assert m.hit and (m.gpu_blocks, m.blocks) == (2, 6)
        r = eng.restore(m)
        want = seg_tensors(L, req[: 6 * BT])[0]
        for name, t in r.segments[0].items():
            assert torch.equal(t, want[name][2 * BT :]), name
        assert (r.start_tokens, r.end_tokens) == (2 * BT, 6 * BT)
        m = eng.lookup(prefix, gpu_blocks=6)
        assert m.outcome == "gpu_resident" and m.blocks == 6


def test_with_snapshots_a_lookup_stops_at_the_deepest_whole_checkpoint(tmp_path):
    L = make_layout()
    with Engine.open(str(tmp_path / "c"), L, CAP) as eng:
        a = tokens_for(3, 8)
        assert store_tokens(eng, a[: 2 * BT]).ok
        assert store_tokens(eng, a).ok
        assert_restores(eng, branch(a, 6, 30, 2), blocks=2)
        m = eng.lookup(Prefix.from_tokens(branch(a, 1, 31, 2), BT))
        assert m.outcome == "miss"


def test_a_damaged_node_is_never_partially_restored(tmp_path):
    L = make_layout(snapshot=False)
    root = str(tmp_path / "c")
    with Engine.open(root, L, CAP) as eng:
        a = tokens_for(4, 8)
        assert store_tokens(eng, a[: 2 * BT]).ok
        assert store_tokens(eng, a).ok
        n = node_at(eng, a)
        with open(os.path.join(root, "rank0", f"{n.key.hex()}-g{n.generation}.st"), "r+b") as f:
            f.seek(-1, os.SEEK_END)  # the last row: not one a partial hit uploads
            f.write(b"\x01")
        req = branch(a, 5, 40, 2)
        assert eng.restore(eng.lookup(Prefix.from_tokens(req, BT))) is None  # verified whole: a miss
        assert n.state == "damaged"
        assert_restores(eng, req, blocks=2)  # stops above the damaged node


def test_a_partial_match_goes_stale_when_its_node_is_split(tmp_path):
    L = make_layout(snapshot=False)
    with Engine.open(str(tmp_path / "c"), L, CAP) as eng:
        a = tokens_for(5, 8)
        assert store_tokens(eng, a).ok
        req = branch(a, 5, 50, 3)
        m = eng.lookup(Prefix.from_tokens(req, BT))
        assert m.hit and m.blocks == 5
        assert store_tokens(eng, req).ok  # the branch splits (0,8] at 5
        assert eng.restore(m) is None  # the node it named changed: stale, never other rows
        assert_restores(eng, req, blocks=8)
        assert_restores(eng, a, blocks=8)
        assert_restores(eng, branch(a, 6, 51, 2), blocks=6)
        assert eng.audit().ok


def test_pins_of_a_partial_hit_hold_the_whole_node(tmp_path):
    L = make_layout(snapshot=False)
    with Engine.open(str(tmp_path / "c"), L, CAP) as eng:
        a = tokens_for(6, 8)
        assert store_tokens(eng, a).ok
        m = eng.lookup(Prefix.from_tokens(branch(a, 3, 60, 2), BT))
        assert eng.pin(m)
        assert eng.evict(prefix=Prefix.from_tokens(a, BT)) == 0  # pinned: never evicted
        eng.unpin(m)
        assert eng.evict(prefix=Prefix.from_tokens(a, BT)) > 0
        assert not eng.lookup(Prefix.from_tokens(a, BT)).hit
