"""Engine core: round trips, lookup semantics, damage detection, bad input."""

from __future__ import annotations

import glob
import os
import sqlite3
from pathlib import Path

import pytest
import torch
from conftest import (
    assert_restores,
    make_layout,
    seg_tensors,
    snap_tensors,
    store_tokens,
    tokens_for,
)

from prefixstore.base import errors as E
from prefixstore.base.keys import ROOT, Prefix, chain
from prefixstore.base.layout import Layout, TensorSpec
from prefixstore.engine import replace
from prefixstore.engine.api import Engine

CAP = 16 << 20


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32", "int8"])
@pytest.mark.parametrize("ranks", [1, 2])
def test_round_trip_bit_identical_across_reopen(cache_dir, dtype, ranks):
    L = Layout(
        segments=[TensorSpec("k", dtype, (2, 3)), TensorSpec("v", dtype, (3,))],
        snapshots=[TensorSpec("ssm", dtype, (2, 5)), TensorSpec("conv", "float32", (4,))],
        block_tokens=4, ranks=ranks,
    )
    g = torch.Generator().manual_seed(7)

    def rnd(shape, dt):
        if dt == torch.int8:
            return torch.randint(-128, 127, shape, generator=g, dtype=torch.int8)
        return torch.randn(shape, generator=g, dtype=torch.float32).to(dt)

    toks = tokens_for(1, 6)
    segs = [{s.name: rnd((24, *s.shape), s.torch_dtype) for s in L.segments} for _ in range(ranks)]
    snaps = {b: [{s.name: rnd(s.shape, s.torch_dtype) for s in L.snapshots} for _ in range(ranks)]
             for b in (2, 6)}
    with Engine.open(cache_dir, L, CAP) as eng:
        for b in (2, 6):
            r = eng.store(Prefix.from_tokens(toks[: b * 4], 4), [{k: v[: b * 4] for k, v in s.items()} for s in segs],
                          snaps[b])
            assert r.status == "stored"
    with Engine.open(cache_dir, L, CAP) as eng:
        for b in (2, 6):
            m = eng.lookup(Prefix.from_tokens(toks[: b * 4], 4))
            assert m.hit and m.blocks == b
            got = eng.restore(m)
            for rank in range(ranks):
                for name in segs[rank]:
                    want = segs[rank][name][: b * 4]
                    assert got.segments[rank][name].dtype == want.dtype
                    assert torch.equal(got.segments[rank][name], want)
                for name in snaps[b][rank]:
                    assert torch.equal(got.snapshot[rank][name], snaps[b][rank][name])
        assert eng.audit().ok


def test_lookup_returns_deepest_ready_ancestor_of_diverging_prefix(cache_dir, layout):
    toks = tokens_for(2, 10)
    with Engine.open(cache_dir, layout, CAP) as eng:
        for b in (2, 5, 10):
            assert store_tokens(eng, toks[: b * 4]).status == "stored"
        probe = toks[:28] + tokens_for(99, 3)  # diverges inside block 8
        m = eng.lookup(Prefix.from_tokens(probe, 4))
        assert m.hit and m.blocks == 5 and m.tokens == 20
        assert_restores(eng, probe, blocks=5)
        # a prefix diverging in block 1 misses
        assert eng.lookup(Prefix.from_tokens(tokens_for(3, 4), 4)).outcome == "miss"
        # the exact prefix hits at its end
        assert eng.lookup(Prefix.from_tokens(toks, 4)).blocks == 10


def test_gpu_resident_prefix_is_bypassed_and_partially_restored(cache_dir, layout):
    toks = tokens_for(4, 8)
    with Engine.open(cache_dir, layout, CAP) as eng:
        store_tokens(eng, toks[:12])
        store_tokens(eng, toks)
        m = eng.lookup(Prefix.from_tokens(toks, 4), gpu_blocks=8)
        assert m.outcome == "gpu_resident"
        m = eng.lookup(Prefix.from_tokens(toks, 4), gpu_blocks=5)
        r = eng.restore(m)
        want = seg_tensors(layout, toks)
        assert (r.start_tokens, r.end_tokens) == (20, 32)
        assert torch.equal(r.segments[0]["k"], want[0]["k"][20:32])
        assert r.files_read == 1  # the ancestor ending at block 3 is on the GPU


def test_snapshot_layout_only_matches_nodes_with_their_snapshot(cache_dir, layout):
    toks = tokens_for(5, 6)
    with Engine.open(cache_dir, layout, CAP) as eng:
        store_tokens(eng, toks[:8])
        store_tokens(eng, toks)
        node = eng.index.by_key[Prefix.from_tokens(toks[:8], 4).keys[-1]]
        with eng.guard.lock:
            assert eng.index.nodes[node].children
            replace.retire_snapshot(eng.flows.replacing, eng.index.nodes[node])
        assert not eng.index.nodes[node].has_snapshot
        probe = toks[:16] + tokens_for(6, 2)
        m = eng.lookup(Prefix.from_tokens(probe, 4))
        assert m.outcome == "miss", "KV without the recurrent state must not be a hit"
        assert_restores(eng, toks, blocks=6)  # the descendant still restores through it
        assert eng.audit().ok


def test_duplicate_store_is_skipped_and_counted(cache_dir, layout):
    toks = tokens_for(6, 3)
    with Engine.open(cache_dir, layout, CAP) as eng:
        assert store_tokens(eng, toks).status == "stored"
        assert store_tokens(eng, toks).status == "duplicate"
        assert eng.stats()["counters"]["skips.duplicate"] == 1


@pytest.mark.parametrize("damage", ["truncate", "bitflip", "delete", "zero"])
def test_damaged_shard_is_a_miss_never_other_bytes(cache_dir, layout, damage):
    toks = tokens_for(7, 6)
    with Engine.open(cache_dir, layout, CAP) as eng:
        store_tokens(eng, toks[:8])
        store_tokens(eng, toks)
        deep = eng.index.nodes[eng.index.by_key[Prefix.from_tokens(toks, 4).keys[-1]]]
        path = os.path.join(cache_dir, "rank0", f"{deep.key.hex()}-g{deep.generation}.st")
        data = Path(path).read_bytes()
        if damage == "truncate":
            Path(path).write_bytes(data[:-7])
        elif damage == "bitflip":
            b = bytearray(data)
            b[-3] ^= 0x10
            Path(path).write_bytes(bytes(b))
        elif damage == "delete":
            os.unlink(path)
        else:
            Path(path).write_bytes(b"")
        m = eng.lookup(Prefix.from_tokens(toks, 4))
        assert m.hit and m.blocks == 6
        assert eng.restore(m) is None
        assert deep.state == "damaged"
        # lookup now stops above the damaged node, and the shallower one restores
        assert_restores(eng, toks, blocks=2)
        assert eng.stats()["nodes_damaged"] == 1
    with Engine.open(cache_dir, layout, CAP) as eng:
        assert eng.lookup(Prefix.from_tokens(toks, 4)).blocks == 2
        # a later store of the same checkpoint refills it
        assert store_tokens(eng, toks).status == "refilled"
        assert eng.stats()["counters"]["refills"] == 1
        assert_restores(eng, toks, blocks=6)
        assert eng.audit().ok


def _snapshot_state(cache_dir):
    conn = sqlite3.connect(os.path.join(cache_dir, "catalog.sqlite"))
    rows = (conn.execute("SELECT * FROM nodes ORDER BY id").fetchall(),
            conn.execute("SELECT * FROM files ORDER BY rank, name").fetchall())
    conn.close()
    files = {p: Path(p).read_bytes() for p in glob.glob(os.path.join(cache_dir, "rank*", "*"))}
    return rows, files


def test_bad_input_gets_typed_errors_and_changes_nothing(cache_dir):
    L = make_layout(ranks=2)
    toks = tokens_for(8, 4)
    p = Prefix.from_tokens(toks, 4)
    segs, snaps = seg_tensors(L, toks), snap_tensors(L, toks)
    with Engine.open(cache_dir, L, CAP) as eng:
        assert eng.store(p[:2], [{k: v[:8] for k, v in s.items()} for s in segs], snaps).ok
        before = _snapshot_state(cache_dir)
        bad_dtype = [{**s, "k": s["k"].float()} for s in segs]
        with pytest.raises(E.DtypeError):
            eng.store(p, bad_dtype, snaps)
        bad_shape = [{**s, "v": s["v"][:, :1]} for s in segs]
        with pytest.raises(E.ShapeError):
            eng.store(p, bad_shape, snaps)
        with pytest.raises(E.ShapeError):
            eng.store(p, [{k: v[:-1] for k, v in s.items()} for s in segs], snaps)  # unaligned length
        with pytest.raises(E.UnalignedError):
            eng.store(p, [{k: v[2:] for k, v in s.items()} for s in segs], snaps, tokens_from=2)
        with pytest.raises(E.RankError):
            eng.store(p, segs[:1], snaps[:1])
        with pytest.raises(E.ShapeError):
            eng.store(p, segs, None)  # snapshot layout needs a snapshot
        with pytest.raises(E.ShapeError):
            eng.store(p, [{"k": s["k"]} for s in segs], snaps)  # missing tensor
        with pytest.raises(E.InvalidInputError):
            eng.store(p[:0], segs, snaps)
        with pytest.raises(E.InvalidInputError):
            eng.lookup(p, gpu_blocks=9)
        assert _snapshot_state(cache_dir) == before
        assert eng.audit().ok


def test_directory_that_is_not_a_cache(tmp_path, layout):
    d = tmp_path / "junk"
    d.mkdir()
    (d / "notes.txt").write_text("hello")
    with pytest.raises(E.NotACacheError):
        Engine.open(str(d), layout, CAP)
    f = tmp_path / "file"
    f.write_text("x")
    with pytest.raises(E.NotACacheError):
        Engine.open(str(f), layout, CAP)
    (d / "catalog.sqlite").write_bytes(b"this is not sqlite" * 100)
    with pytest.raises(E.NotACacheError):
        Engine.open(str(d), layout, CAP)
    assert (d / "notes.txt").read_text() == "hello"
    with pytest.raises(E.NotACacheError):
        Engine.open(str(tmp_path / "missing"), layout, CAP, create=False)


def test_newer_schema_and_layout_mismatch_are_refused(cache_dir, layout):
    toks = tokens_for(9, 3)
    with Engine.open(cache_dir, layout, CAP) as eng:
        store_tokens(eng, toks)
    with pytest.raises(E.LayoutMismatchError):
        Engine.open(cache_dir, make_layout(ranks=2), CAP)
    conn = sqlite3.connect(os.path.join(cache_dir, "catalog.sqlite"))
    conn.execute("PRAGMA user_version=99")
    conn.commit()
    conn.close()
    with pytest.raises(E.SchemaVersionError):
        Engine.open(cache_dir, layout, CAP)
    conn = sqlite3.connect(os.path.join(cache_dir, "catalog.sqlite"))
    conn.execute("PRAGMA user_version=1")
    conn.commit()
    conn.close()
    with Engine.open(cache_dir, layout, CAP) as eng:
        assert_restores(eng, toks, blocks=3)


def test_second_engine_on_same_directory_is_locked_out(cache_dir, layout):
    with Engine.open(cache_dir, layout, CAP), pytest.raises(E.LockedError):
        Engine.open(cache_dir, layout, CAP)


def test_closed_engine_refuses_calls(cache_dir, layout):
    eng = Engine.open(cache_dir, layout, CAP)
    eng.close()
    with pytest.raises(E.EngineClosedError):
        eng.lookup(Prefix.from_tokens(tokens_for(1, 1), 4))


def test_prefix_keys_are_chained():
    p = Prefix.from_ids([5, 6, 7])
    assert p.keys[0] == chain(ROOT, p.digests[0])
    assert p.keys[2] == chain(p.keys[1], p.digests[2])
    assert Prefix.from_ids([5, 6]).keys == p.keys[:2]
    assert Prefix.from_ids([9, 6]).keys[1] != p.keys[1]  # same block, other prefix
    assert len(Prefix.from_tokens(list(range(10)), 4)) == 2  # partial block dropped


def test_layout_validation():
    with pytest.raises(E.LayoutError):
        TensorSpec("k", "float13", (2,))
    with pytest.raises(E.LayoutError):
        Layout(segments=[], block_tokens=4)
    with pytest.raises(E.LayoutError):
        Layout(segments=[TensorSpec("k", "int8", (1,))], block_tokens=0)
    with pytest.raises(E.LayoutError):
        Layout(segments=[TensorSpec("k", "int8", (1,)), TensorSpec("k", "int8", (2,))], block_tokens=4)
    L = make_layout(ranks=4)
    assert Layout.from_json(L.to_json()) == L


def test_stale_match_never_restores_another_nodes_bytes(cache_dir, layout):
    """A Match taken before its node was evicted (and a new node stored) is a miss."""
    a, b = tokens_for(20, 3), tokens_for(21, 3)
    with Engine.open(cache_dir, layout, CAP) as eng:
        store_tokens(eng, a)
        stale = eng.lookup(Prefix.from_tokens(a, 4))
        assert stale.hit
        assert eng.evict(prefix=Prefix.from_tokens(a, 4)) > 0
        store_tokens(eng, b)  # would reuse the freed row id without AUTOINCREMENT
        assert eng.restore(stale) is None
        assert_restores(eng, b, blocks=3)


@pytest.mark.parametrize("backing", ["disk", "memory"])
def test_a_restore_releases_its_pins_and_offers_each_node_to_the_victim_heap_once(cache_dir, backing):
    """A restore's unpin and its recency land together; the node it ends at is offered
    to the victim heap once (not once before its snapshot stamp and again after), so a
    restore adds one heap entry per node read."""
    L = make_layout(snapshot=True)
    toks = tokens_for(41, 6)
    with Engine.open(cache_dir, L, CAP, backing=backing) as eng:
        assert store_tokens(eng, toks[: 3 * L.block_tokens]).ok and store_tokens(eng, toks).ok
        m = eng.lookup(Prefix.from_tokens(toks, L.block_tokens))
        assert m.hit and len(m.path) == 2, m
        for _ in range(3):
            before, clock = len(eng.recency.heap), eng.recency.clock
            assert eng.restore(m) is not None
            assert len(eng.recency.heap) - before == len(m.path)
            assert eng.recency.clock == clock + 1
            nodes = [eng.index.nodes[nid] for nid, _ in m.path]
            assert all(x.last_used == clock + 1 for x in nodes) and nodes[-1].snap_used == clock + 1
            assert not eng.holds.pins and eng.stats()["pinned"] == 0
        assert_restores(eng, toks, blocks=6)


@pytest.mark.parametrize("ranks", [1, 2])
def test_a_stored_checkpoint_restores_without_asking_the_catalog_for_its_files(cache_dir, ranks, monkeypatch):
    """A store caches its node's live file rows (the ones its intent reserved) at
    publish, so the first restore reads no file row from the catalog; after a reopen
    the rows come from the catalog again, and the audit finds the cache right."""
    from prefixstore.engine.catalog import Catalog

    asked: list[list[int]] = []
    real = Catalog.live_files_of
    monkeypatch.setattr(Catalog, "live_files_of", lambda self, ids: asked.append(list(ids)) or real(self, ids))
    L = make_layout(snapshot=True, ranks=ranks)
    toks = tokens_for(43, 6)
    with Engine.open(cache_dir, L, CAP) as eng:
        assert store_tokens(eng, toks[: 3 * L.block_tokens]).ok and store_tokens(eng, toks).ok
        asked.clear()
        assert_restores(eng, toks, blocks=6)
        assert asked == []
        assert eng.audit().ok
    with Engine.open(cache_dir, L, CAP) as eng:
        asked.clear()
        assert_restores(eng, toks, blocks=6)
        assert len(asked) == 1 and len(asked[0]) == 2


def test_a_cache_that_only_serves_hits_keeps_its_victim_heap_bounded(cache_dir):
    """Every restore offers its nodes to the victim heap again; restores alone (no
    store ever making room, where the heap used to be compacted) keep it within the
    compaction bound instead of growing by an entry per node per restore."""
    L = make_layout(snapshot=False)
    toks = tokens_for(44, 4)
    with Engine.open(cache_dir, L, CAP) as eng:
        assert store_tokens(eng, toks[: 2 * L.block_tokens]).ok and store_tokens(eng, toks).ok
        m = eng.lookup(Prefix.from_tokens(toks, L.block_tokens))
        assert m.hit and len(m.path) == 2
        bound = 4 * max(len(eng.index), 1024)
        for _ in range(bound):  # 2 entries a restore: twice past the bound if never compacted
            assert eng.restore(m) is not None
        assert len(eng.recency.heap) <= bound
        assert eng.audit().ok
        assert_restores(eng, toks, blocks=4)
