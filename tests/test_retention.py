"""Retention under pressure: the seed scenario, eviction order and accounting,
refused-store retries, the restore cost rule, pins and fences, counters."""

from __future__ import annotations

import json
import os
import tempfile

import pytest
import torch
from conftest import (
    FailUnlinks,
    Gate,
    assert_restores,
    make_layout,
    node_at,
    seg_tensors,
    snap_tensors,
    store_tokens,
    tokens_for,
)
from hypothesis import given
from hypothesis import strategies as st
from prometheus_client import generate_latest

from prefixstore import cli
from prefixstore.base.keys import Prefix
from prefixstore.base.layout import Layout, TensorSpec
from prefixstore.engine.api import Engine
from prefixstore.gpu.fileio import FaultHook
from prefixstore.replay.seed import run_seed
from prefixstore.statemachine.cost import CostModel

CAP = 16 << 20


def big_snapshot_layout(ranks: int = 1) -> Layout:
    """Small per-token segments (24 B/token/rank), a 4 KiB snapshot: as on DeepSeek V4."""
    return Layout(
        segments=[TensorSpec("k", "bfloat16", (2, 3)), TensorSpec("v", "bfloat16", (2, 3))],
        snapshots=[TensorSpec("state", "float32", (32, 32))],
        block_tokens=4,
        ranks=ranks,
    )


# ----------------------------------------------------------------------------- the seed


def test_seed_scenario_classifier_keeps_restoring_and_collapses_under_leaf_lru(tmp_path, capsys):
    assert cli.main(["replay", "--scenario", "seed", str(tmp_path / "prefixstore"), "--json"]) == 0
    fixed = json.loads(capsys.readouterr().out)
    before = run_seed(str(tmp_path / "leaf-lru"), "leaf-lru")
    for r in (fixed, before):
        assert r["audit_ok"] and r["wrong_bytes"] == 0, r
        assert r["classifier_calls"] >= 100
    # The fix: after its first call the classifier is restored every time (~2 s calls).
    assert fixed["classifier_restore_ratio"] >= 0.99, fixed
    assert fixed["classifier_latency_s_p50"] < 3 and fixed["classifier_latency_s_p99"] < 3, fixed
    assert fixed["counters"]["evictions.retire_snapshot"] > 0  # interior snapshots went instead
    assert "evictions.evict" not in fixed["counters"]  # no leaf had to go
    assert fixed["conversation_restore_hits"] == fixed["conversation_restores"] > 0
    # Before the fix: the classifier's checkpoint is evicted and calls become full prefills.
    assert before["classifier_restore_ratio"] <= 0.25, before
    assert before["classifier_latency_s_p50"] > 5 * fixed["classifier_latency_s_p50"], before
    assert before["classifier_latency_s_p50"] == pytest.approx(before["classifier_miss_s"])


def test_replay_command_arguments(tmp_path, capsys):
    assert cli.main(["replay"]) == 2  # neither a trace nor a scenario
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "x").write_text("x")
    assert cli.main(["replay", "--scenario", "seed", str(busy)]) == 2  # not an empty tier
    assert cli.main(["replay", "trace.jsonl", str(busy), "--scenario", "seed"]) == 2
    assert "not empty" in capsys.readouterr().err
    assert os.listdir(busy) == ["x"]


# ----------------------------------------------------------------------------- eviction


def _long_beside_recent(root: str, policy: str) -> tuple[bool, Engine]:
    """A conversation growing by 2 blocks a turn beside a 6-block one restored every
    turn, in a tier holding about 7 snapshots. True when the recent one always hit."""
    L = big_snapshot_layout()
    long, recent = tokens_for(1, 40), tokens_for(2, 6)
    eng = Engine.open(root, L, 40 << 10, policy=policy)
    assert store_tokens(eng, recent).ok
    survived = True
    for end in range(2, 41, 2):
        assert store_tokens(eng, long[: end * 4]).status in ("stored", "refused"), end
        m = eng.lookup(Prefix.from_tokens(recent, 4))
        if not m.hit:
            survived = False
            assert store_tokens(eng, recent).ok
        else:
            assert_restores(eng, recent, blocks=6)
    return survived, eng


def test_long_conversation_retires_its_interior_snapshots_not_others_recent_leaves(tmp_path):
    ok, eng = _long_beside_recent(str(tmp_path / "a"), "prefixstore")
    with eng:
        assert ok
        tip = node_at(eng, tokens_for(1, 40))
        path = eng.index.path(tip)
        assert len(path) == 20 and tip.has_snapshot  # the whole chain is still there
        assert sum(not x.has_snapshot for x in path) >= 10  # its interior snapshots went
        assert_restores(eng, tokens_for(1, 40), blocks=40)  # through segment-only ancestors
        assert eng.stats()["counters"]["evictions.retire_snapshot"] >= 10
        assert eng.audit().ok
    ok, eng = _long_beside_recent(str(tmp_path / "b"), "leaf-lru")
    with eng:
        assert not ok, "leaf-lru was expected to push the recent conversation out"
        assert eng.audit().ok


def test_retirement_frees_the_old_generation_once_and_charges_the_new(tmp_path):
    L = big_snapshot_layout(ranks=2)
    toks = tokens_for(3, 6)
    with Engine.open(str(tmp_path / "c"), L, CAP) as eng:
        store_tokens(eng, toks[:8])
        store_tokens(eng, toks)
        mid = node_at(eng, toks[:8])
        old, charged = mid.nbytes, eng._charged
        freed = eng.evict(1)  # the oldest candidate: the interior node's snapshot
        assert not mid.has_snapshot and mid.generation == 2
        new = mid.nbytes
        assert 0 < new < old - 2 * L.snapshot_bytes + 1
        assert freed == old - new == charged - eng._charged
        c = eng.stats()["counters"]
        assert c["evictions.retire_snapshot"] == 1
        assert c["evicted_bytes.retire_snapshot"] == old - new
        assert_restores(eng, toks, blocks=6)
        assert eng.audit().ok


def test_stores_keep_headroom_for_the_next_snapshot_retirement(tmp_path):
    """A retirement writes the segment-only generation before the old one is freed, so
    it needs room; with watermarks at 1.0 a tier could otherwise fill to the byte and
    the retirement would give way to evicting a younger leaf. Every store leaves room
    for the rewrite of the largest retirement candidate."""
    L = big_snapshot_layout()
    long, other = tokens_for(4, 40), tokens_for(5, 2)
    with Engine.open(str(tmp_path / "h"), L, 26 << 10) as eng:  # shards carry their digests (~32 B a block)
        assert store_tokens(eng, other).ok
        for end in range(2, 41, 2):
            assert store_tokens(eng, long[: end * 4]).status == "stored"
            assert_restores(eng, other)
            cands = [n for n in eng.index if n.children and n.ready and n.has_snapshot]
            if cands:
                rewrite = max(n.nbytes for n in cands) - L.snapshot_bytes
                assert eng.capacity - eng._charged >= min(rewrite, eng.capacity // 8)
        c = eng.stats()["counters"]
        assert c["evictions.retire_snapshot"] >= 10
        assert "evictions.evict" not in c  # no leaf had to go
        assert eng.audit().ok


def test_garbage_is_reclaimed_before_any_victim(tmp_path):
    L = make_layout()
    a, b, c = tokens_for(6, 3), tokens_for(7, 3), tokens_for(8, 3)
    gate = Gate()
    with Engine.open(str(tmp_path / "g"), L, CAP, hook=gate) as probe:
        size = store_tokens(probe, a).nbytes
    with Engine.open(str(tmp_path / "g2"), L, 2 * size + 8, hook=gate) as eng:
        store_tokens(eng, a)
        store_tokens(eng, b)
        gate.arm(FailUnlinks())
        assert eng.evict(prefix=Prefix.from_tokens(a, 4)) == 0  # the unlink failed: garbage
        gate.disarm()
        assert eng.stats()["garbage_bytes"] == size
        assert store_tokens(eng, c).status == "stored"
        assert node_at(eng, b) is not None  # the garbage made the room, not b
        assert eng.stats()["counters"]["evicted_bytes.garbage"] == size
        assert eng.audit().ok


# ----------------------------------------------------------------------------- retries


def test_refused_store_is_retried_once_space_frees_and_dropped_once_invalid(tmp_path, layout):
    a, b, c = tokens_for(9, 3), tokens_for(10, 3), tokens_for(11, 3)
    with Engine.open(str(tmp_path / "p"), layout, CAP) as probe:
        size = store_tokens(probe, a).nbytes
    with Engine.open(str(tmp_path / "r"), layout, size + 8) as eng:
        store_tokens(eng, a)
        ma = eng.lookup(Prefix.from_tokens(a, 4))
        assert eng.pin(ma)
        assert store_tokens(eng, b).status == "refused"  # no valid=: not queued
        assert store_tokens(eng, b, valid=lambda: True).status == "queued"
        assert eng.stats()["pending_retries"] == 1
        assert node_at(eng, b) is None and node_at(eng, a) is not None  # a is pinned
        eng.unpin(ma)  # space can now be freed: the queued store runs
        assert node_at(eng, b) is not None and node_at(eng, a) is None
        assert_restores(eng, b)
        stats = eng.stats()
        assert stats["pending_retries"] == 0
        assert stats["counters"]["retries.queued"] == 1 and stats["counters"]["retries.succeeded"] == 1
        # Now one that stops being valid while it waits.
        mb = eng.lookup(Prefix.from_tokens(b, 4))
        eng.pin(mb)
        gpu = {"valid": True}
        assert store_tokens(eng, c, valid=lambda: gpu["valid"]).status == "queued"
        eng.evict(0)  # a retry that still does not fit: kept
        assert eng.stats()["pending_retries"] == 1
        gpu["valid"] = False
        eng.reclaim()  # the next retry drops it
        eng.unpin(mb)  # and it is not retried (or counted) again
        stats = eng.stats()
        assert stats["pending_retries"] == 0 and node_at(eng, c) is None
        assert stats["counters"]["retries.dropped"] == 1
        assert stats["counters"]["retries.succeeded"] == 1
        assert eng.audit().ok


def test_refused_store_is_retried_after_reclaim(tmp_path, layout):
    a, b, c = tokens_for(12, 3), tokens_for(13, 3), tokens_for(14, 3)
    gate = Gate()
    with Engine.open(str(tmp_path / "p"), layout, CAP) as probe:
        size = store_tokens(probe, a).nbytes
    with Engine.open(str(tmp_path / "r"), layout, 2 * size + 8, hook=gate) as eng:
        store_tokens(eng, a)
        store_tokens(eng, b)
        gate.arm(FailUnlinks())
        eng.evict(prefix=Prefix.from_tokens(a, 4))  # a's files stay as charged garbage
        mb = eng.lookup(Prefix.from_tokens(b, 4))
        eng.pin(mb)
        assert store_tokens(eng, c, valid=lambda: True).status == "queued"  # unlink still fails
        gate.disarm()
        assert eng.reclaim() == size
        assert node_at(eng, c) is not None
        assert eng.stats()["counters"]["retries.succeeded"] == 1
        eng.unpin(mb)
        assert eng.audit().ok


def test_a_checkpoint_larger_than_what_can_be_freed_evicts_nothing(tmp_path, layout):
    a, big = tokens_for(15, 2), tokens_for(16, 40)
    with Engine.open(str(tmp_path / "p"), layout, CAP) as probe:
        size = store_tokens(probe, a).nbytes
    with Engine.open(str(tmp_path / "r"), layout, 4 * size) as eng:
        store_tokens(eng, a)
        assert store_tokens(eng, big).status == "refused"
        assert node_at(eng, a) is not None  # nothing was evicted for a hopeless store
        assert eng.stats()["counters"]["skips.no_space"] == 1


# ----------------------------------------------------------------------------- cost rule


def _chain(eng: Engine, toks: list[int], ends: list[int]) -> None:
    for e in ends:
        assert store_tokens(eng, toks[: e * 4]).ok


def test_a_too_costly_deepest_match_falls_back_to_a_shallower_one(tmp_path, layout):
    """A slow tier with a per-file latency: the deep end of the path is many small
    checkpoints whose reads cost more than the prefill they save."""
    toks = tokens_for(17, 40)
    slow = CostModel(bandwidth_bytes_per_s=1e9, restore_s_per_node=0.05,
                     prefill_s_per_token=1e-3, prefill_s_per_token2=0.0)
    with Engine.open(str(tmp_path / "c"), layout, CAP, cost=slow) as eng:
        _chain(eng, toks, [30, *range(31, 41)])  # one 30-block node, then ten 1-block ones
        m = eng.lookup(Prefix.from_tokens(toks, 4))
        assert m.hit and m.blocks < 40, m
        assert m.transfer_s < m.prefill_s
        d = eng.stats()["last_decision"]
        assert d["result"] == "shallower" and d["deepest_tokens"] == 160
        deepest = d["estimates"][0]
        assert deepest[0] == 160 and deepest[1] >= deepest[2]  # transfer >= prefill saved
        assert (d["transfer_s"], d["prefill_s"]) == (m.transfer_s, m.prefill_s)
        c = eng.stats()["counters"]
        assert c["decisions.shallower"] == 1
        assert c["decisions.transfer_s"] == pytest.approx(m.transfer_s)
        assert c["decisions.prefill_s"] == pytest.approx(m.prefill_s)
        text = generate_latest(eng.counters.registry).decode()
        assert 'prefixstore_restore_decisions_total{result="shallower"} 1.0' in text
        assert "prefixstore_restore_estimated_transfer_seconds_count 1.0" in text
        assert "prefixstore_restore_estimated_prefill_seconds_count 1.0" in text
        assert_restores(eng, toks, blocks=m.blocks)


def test_restore_rejected_when_no_match_beats_recomputing(tmp_path, layout):
    toks = tokens_for(18, 8)
    glacial = CostModel(bandwidth_bytes_per_s=10.0, prefill_s_per_token=1e-4, prefill_s_per_token2=0.0)
    with Engine.open(str(tmp_path / "c"), layout, CAP, cost=glacial) as eng:
        _chain(eng, toks, [4, 8])
        m = eng.lookup(Prefix.from_tokens(toks, 4))
        assert m.outcome == "rejected_cost" and m.transfer_s > m.prefill_s
        d = eng.stats()["last_decision"]
        assert d["result"] == "rejected" and len(d["estimates"]) == 2  # both candidates tried
        assert eng.stats()["counters"]["lookups.rejected_cost"] == 1


def test_gpu_resident_blocks_are_not_paid_for(tmp_path, layout):
    toks = tokens_for(19, 8)
    model = CostModel(bandwidth_bytes_per_s=1e6)
    with Engine.open(str(tmp_path / "c"), layout, CAP, cost=model) as eng:
        _chain(eng, toks, [4, 8])
        full = eng.lookup(Prefix.from_tokens(toks, 4))
        part = eng.lookup(Prefix.from_tokens(toks, 4), gpu_blocks=4)
        assert full.blocks == part.blocks == 8
        assert part.nbytes < full.nbytes and part.transfer_s < full.transfer_s
        assert part.prefill_s < full.prefill_s  # it saves only what the GPU lacks


# ----------------------------------------------------------------------------- pins, fences


class _EvictDuringWrite(FaultHook):
    """At the first file write (a store's, or a retirement's while the store makes
    space), with the nodes involved fenced, try to evict everything."""

    def __init__(self, eng_box: dict) -> None:
        self.box, self.fired = eng_box, 0

    def before(self, op, target, rank):
        eng = self.box.get("eng")
        if op == "write" and eng is not None and not self.fired:
            self.fired += 1
            self.box["fenced"] = set(eng._fences)
            self.box["storing"] = bool(eng._inflight_blocks)
            eng.evict(eng.capacity)


@given(st.lists(st.tuples(st.sampled_from(["store", "pin", "unpin", "evict", "store_fenced"]),
                          st.integers(0, 5), st.integers(1, 4)), min_size=4, max_size=24),
       st.sampled_from(["prefixstore", "leaf-lru", "lru"]))
def test_pins_and_fences_are_never_evicted_or_replaced(ops, policy):
    L = big_snapshot_layout()
    convs = [tokens_for(100 + i, 16) for i in range(6)]
    box: dict = {}
    hook = Gate()
    with tempfile.TemporaryDirectory() as root, Engine.open(root, L, 24 << 10, policy=policy, hook=hook) as eng:
        pins: list = []
        for op, i, k in ops:
            toks = convs[i][: k * 4 * 4]
            if op in ("store", "store_fenced"):
                if op == "store_fenced":
                    store_tokens(eng, toks[:8])  # a parent, when it fits
                    box.clear()
                    box["eng"] = eng
                    hook.arm(_EvictDuringWrite(box))
                res = store_tokens(eng, toks)
                hook.disarm()
                for nid in box.pop("fenced", ()):  # what was fenced survived the eviction
                    assert nid in eng.index.nodes
                    if res.ok and box["storing"]:
                        assert eng.index.nodes[nid].children  # the store's parent
                assert res.status in ("stored", "duplicate", "refused", "skipped"), res
            elif op == "pin":
                m = eng.lookup(Prefix.from_tokens(toks, 4))
                if m.hit and eng.pin(m):
                    pins.append((m, toks))
            elif op == "unpin" and pins:
                m, _ = pins.pop(k % len(pins))
                eng.unpin(m)
            elif op == "evict":
                eng.evict(eng.capacity)
            for m, t in pins:  # every pinned node is still there, same generation, restorable
                for nid, gen in m.path:
                    node = eng.index.get(nid)
                    assert node is not None and node.generation == gen and node.ready
                r = eng.restore(m)
                assert r is not None
                want = seg_tensors(L, t[: m.tokens])[0]
                assert torch.equal(r.segments[0]["k"], want["k"][m.gpu_tokens:])
                assert torch.equal(r.snapshot[0]["state"], snap_tensors(L, t[: m.tokens])[0]["state"])
        for m, _ in pins:
            eng.unpin(m)
        assert eng.audit().ok


# ----------------------------------------------------------------------------- counters


def test_counters_are_exposed_in_prometheus_stats_and_live_gauges(tmp_path, layout):
    toks = tokens_for(20, 6)
    with Engine.open(str(tmp_path / "m"), layout, CAP, cost=CostModel()) as eng:
        store_tokens(eng, toks[:8])
        store_tokens(eng, toks)
        store_tokens(eng, toks)  # duplicate
        m = eng.lookup(Prefix.from_tokens(toks, 4))
        eng.pin(m)
        eng.lookup(Prefix.from_tokens(tokens_for(21, 3), 4))  # miss
        eng.lookup(Prefix.from_tokens(toks, 4), gpu_blocks=6)  # GPU-resident
        eng.unpin(m)
        eng.evict(1)
        stats = eng.stats()
        text = generate_latest(eng.counters.registry).decode()
    for needle in (
        'prefixstore_lookups_total{outcome="hit"} 1.0',
        'prefixstore_lookups_total{outcome="miss"} 1.0',
        'prefixstore_lookups_total{outcome="gpu_resident"} 1.0',
        'prefixstore_store_skips_total{reason="duplicate"} 1.0',
        'prefixstore_stores_total{result="stored"} 2.0',
        'prefixstore_evictions_total{action="retire_snapshot"} 1.0',
        'prefixstore_evicted_bytes_total{action="retire_snapshot"}',
        'prefixstore_restore_decisions_total{result="deepest"} 1.0',
        'prefixstore_state{kind="capacity_bytes"} 1.6777216e+07',
        'prefixstore_state{kind="nodes"} 2.0',
        'prefixstore_bytes{kind="snapshot_used"}',
        "prefixstore_restore_estimated_transfer_seconds_bucket",
    ):
        assert needle in text, needle
    assert f'prefixstore_state{{kind="charged_bytes"}} {float(stats["charged_bytes"])!r}' in text
    for key in ("lookups.hit", "lookups.miss", "lookups.gpu_resident", "skips.duplicate",
                "evictions.retire_snapshot", "decisions.deepest"):
        assert stats["counters"][key] == 1, key
    for key in ("capacity_bytes", "charged_bytes", "damaged_bytes", "garbage_bytes",
                "snapshot_bytes_used", "pinned", "fenced", "pending_retries"):
        assert key in stats


def test_admission_stats_report_the_window_in_force():
    from prefixstore.statemachine.admission import RetentionAdmission

    assert RetentionAdmission(1000, window_share=0.01).stats()["window_blocks"] == 10
    assert RetentionAdmission(1000, window_share=0.01, admit_window=3).stats()["window_blocks"] == 3
