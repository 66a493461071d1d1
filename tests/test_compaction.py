"""Compaction and compact-replace: merge, split, republish, refill, the policy, the worker.

Crash enumeration for every use lives in tests/test_crash_compaction.py.
"""

from __future__ import annotations

import os
import threading
import time

import pytest
import torch
from conftest import (
    assert_restores,
    make_layout,
    node_at,
    seg_tensors,
    snap_tensors,
    store_tokens,
    tokens_for,
)

from prefixstore.base.errors import InvalidInputError
from prefixstore.base.keys import Prefix
from prefixstore.engine import replace
from prefixstore.engine.api import Engine
from prefixstore.engine.driver import Driver
from prefixstore.engine.index import Index, Node
from prefixstore.fuzz.faultfs import FaultFS, FaultPlan
from prefixstore.gpu.fileio import FaultHook
from prefixstore.statemachine.compaction import CompactionPolicy, RunStats, chunks, merge_verdict

CAP = 16 << 20
BT = 4
CONV = tokens_for(70, 12)


def P(tokens: list[int]) -> Prefix:
    return Prefix.from_tokens(tokens, BT)


def chain(eng: Engine, ends=(3, 6, 9, 12), retire=(3, 6, 9)) -> None:
    """The conversation's checkpoints at ``ends``; snapshots retired at ``retire``."""
    for b in ends:
        assert store_tokens(eng, CONV[: b * BT]).ok
    with eng.guard.lock:
        for b in retire:
            assert replace.retire_snapshot(eng.flows.replacing, node_at(eng, CONV[: b * BT]))


def spans(eng: Engine) -> list[tuple[int, int, bool]]:
    return sorted((n.start, n.end, n.has_snapshot) for n in eng.index)


def shard_files(root: str) -> int:
    return sum(len(os.listdir(os.path.join(root, d))) for d in os.listdir(root) if d.startswith("rank"))


def restored(eng: Engine, tokens: list[int]):
    m = eng.lookup(P(tokens))
    assert m.hit, m
    r = eng.restore(m)
    assert r is not None
    return m, r


def same(a, b) -> bool:
    return all(torch.equal(x[k], y[k]) for x, y in zip(a, b, strict=True) for k in x)


def counters(eng: Engine) -> dict:
    return eng.stats()["counters"]


def clean(eng: Engine) -> None:
    """Audit clean, no open transaction, and the in-memory index equal to one rebuilt
    from the catalog (nodes, parents, children, by_key, blocks, charged bytes)."""
    rep = eng.audit()
    assert rep.ok, rep.to_dict()
    assert not eng.catalog.journal()
    sizes = dict(eng.catalog.query("SELECT node, sum(size) FROM files WHERE node IS NOT NULL GROUP BY node"))
    fresh = Index()
    for r in eng.catalog.query(
        "SELECT id, key, parent, start_block, end_block, digests, has_snapshot, state, generation "
        "FROM nodes ORDER BY end_block, id"
    ):
        fresh.add(Node(id=r[0], key=bytes(r[1]), parent=r[2], start=r[3], end=r[4], digests=bytes(r[5]),
                       has_snapshot=bool(r[6]), state=r[7], generation=r[8], last_used=0, snap_used=0,
                       nbytes=sizes.get(r[0], 0)))

    def view(idx: Index) -> dict:
        return {n.id: (n.key, n.parent, n.start, n.end, n.digests, n.has_snapshot, n.state, n.generation,
                       n.nbytes, frozenset(n.children)) for n in idx}

    assert view(eng.index) == view(fresh)
    assert eng.index.by_key == fresh.by_key and eng.index.blocks == fresh.blocks


# ------------------------------------------------------------------ the policy (pure)


def test_merge_pays_for_small_rows_not_for_large_ones():
    pol = CompactionPolicy()
    small = merge_verdict(pol, RunStats(rows=8, bytes_per_rank=8 * 16_384, age=0, rows_total=100))
    assert small.merge and small.reason == "file_overhead" and small.saved_s > small.cost_s
    big = merge_verdict(pol, RunStats(rows=8, bytes_per_rank=8 * (4 << 20), age=0, rows_total=100))
    assert not big.merge and big.reason == "not_worth_it" and big.cost_s > big.saved_s
    assert merge_verdict(pol, RunStats(8, 1 << 40, 0, 100)).reason == "too_large"
    assert merge_verdict(pol, RunStats(1, 10, 0, 100)).reason == "single_row"


def test_row_count_and_read_pattern_change_the_verdict():
    pol = CompactionPolicy(row_budget=1000)
    run = RunStats(rows=4, bytes_per_rank=4 * (100 << 10), age=0, rows_total=10)
    hot = merge_verdict(pol, run)
    cold = merge_verdict(pol, attrs_replace(run, age=pol.hot_window + 1))
    assert hot.merge and not cold.merge  # the same run pays only if it is read
    assert hot.saved_s == pytest.approx(cold.saved_s * pol.expected_reads / pol.cold_reads)
    crowded = merge_verdict(pol, attrs_replace(run, age=pol.hot_window + 1, rows_total=5000))
    assert crowded.merge and crowded.reason == "row_count"


def attrs_replace(run: RunStats, **kw) -> RunStats:
    import attrs

    return attrs.evolve(run, **kw)


def test_chunks_respect_rows_and_bytes():
    pol = CompactionPolicy(max_merge_rows=3, max_merge_bytes=100)
    assert chunks(pol, [10] * 7) == [(0, 3), (3, 6)]  # a trailing single row is left alone
    assert chunks(pol, [10, 95, 10, 10]) == [(2, 4)]
    assert chunks(pol, [200, 10, 10]) == [(1, 3)]
    with pytest.raises(ValueError):
        CompactionPolicy(max_merge_rows=1)


# ------------------------------------------------------------------ split


@pytest.mark.parametrize("ranks", [1, 2])
def test_store_inside_a_span_splits_it(cache_dir, ranks):
    L = make_layout(ranks=ranks)
    with Engine.open(cache_dir, L, CAP) as eng:
        chain(eng, ends=(6, 12), retire=())
        upper, child = node_at(eng, CONV[:24]), node_at(eng, CONV)
        _, before = restored(eng, CONV)
        res = store_tokens(eng, CONV[:16])
        assert res.status == "stored", res
        assert spans(eng) == [(0, 4, True), (4, 6, True), (6, 12, True)]
        lower = node_at(eng, CONV[:16])
        # the upper part keeps the old row's id and key, so the descendant's link holds
        assert node_at(eng, CONV[:24]) is upper and upper.parent == lower.id and child.parent == upper.id
        assert lower.children == {upper.id} and upper.start == 4
        _, after = restored(eng, CONV)
        assert same(before.segments, after.segments) and same(before.snapshot, after.snapshot)
        assert after.files_read == 3 * ranks
        for b in (4, 6, 12):
            assert_restores(eng, CONV[: b * BT], blocks=b)
        assert counters(eng)["replaces.split"] == 1
        clean(eng)
    with Engine.open(cache_dir, L, CAP) as eng:
        for b in (4, 6, 12):
            assert_restores(eng, CONV[: b * BT], blocks=b)
        clean(eng)


def test_split_on_an_attention_only_layout(cache_dir):
    L = make_layout(snapshot=False)
    with Engine.open(cache_dir, L, CAP) as eng:
        chain(eng, ends=(6,), retire=())
        assert store_tokens(eng, CONV[:8]).status == "stored"
        assert spans(eng) == [(0, 2, False), (2, 6, False)]
        for b in (2, 6):
            assert_restores(eng, CONV[: b * BT], blocks=b)
        assert_restores(eng, CONV[:20], blocks=5)  # inside (2, 6]: a partial hit on it
        clean(eng)


def test_prefix_diverging_inside_a_span_splits_without_a_snapshot(cache_dir, layout):
    branch = CONV[:12] + tokens_for(71, 3)  # shares 3 of the 6 blocks of (0, 6]
    with Engine.open(cache_dir, layout, CAP) as eng:
        chain(eng, ends=(6,), retire=())
        res = store_tokens(eng, branch)
        assert res.status == "stored", res
        assert spans(eng) == [(0, 3, False), (3, 6, True), (3, 6, True)]
        assert eng.lookup(P(CONV[:12])).outcome == "miss"  # no snapshot at block 3
        assert_restores(eng, branch, blocks=6)
        assert_restores(eng, CONV[:24], blocks=6)
        clean(eng)


def test_split_of_a_row_held_by_pin_is_skipped_at_once_until_unpinned(cache_dir, layout):
    """pin() is a request using the row: a split is not waited for, it is skipped."""
    with Engine.open(cache_dir, layout, CAP) as eng:
        chain(eng, ends=(6,), retire=())
        with eng.pinned(eng.lookup(P(CONV[:24]))):
            t0 = time.monotonic()
            res = store_tokens(eng, CONV[:16])
            assert (res.status, res.reason) == ("skipped", "pinned")
            assert time.monotonic() - t0 < eng.pin_wait_s / 2  # not waited for
            assert spans(eng) == [(0, 6, True)]
        assert store_tokens(eng, CONV[:16]).status == "stored"
        clean(eng)


class _BlockReads(FaultHook):
    """Holds the first shard read (a restore in progress) until ``go`` is set;
    ``written`` is set once ``writes`` directory fsyncs (new shards in place) ended."""

    def __init__(self, writes: int) -> None:
        self.armed, self.reached, self.go = False, threading.Event(), threading.Event()
        self.written, self.left = threading.Event(), writes

    def before(self, op, target, rank):
        if self.armed and op == "read" and not self.reached.is_set():
            self.reached.set()
            self.go.wait(30)

    def after(self, op, target, rank):
        if self.armed and op == "fsync_dir":
            self.left -= 1
            if self.left == 0:
                self.written.set()


@pytest.mark.parametrize("pin_wait_s", [5.0, 0.2])
def test_split_of_a_row_a_restore_pins_waits_for_the_restore(cache_dir, layout, pin_wait_s):
    """The split is prepared beside a row a running restore pins and swapped once the
    restore ends (it got the old generation's bytes); past pin_wait_s it is skipped."""
    hook = _BlockReads(writes=2 * layout.ranks)  # the split writes two rows: 0-4 and 4-6
    with Engine.open(cache_dir, layout, CAP, hook=hook) as eng:
        eng.pin_wait_s = pin_wait_s
        chain(eng, ends=(6,), retire=())
        m = eng.lookup(P(CONV[:24]))
        hook.armed = True
        got = {}
        reader = threading.Thread(target=lambda: got.setdefault("restored", eng.restore(m)))
        reader.start()
        assert hook.reached.wait(10)  # the restore holds its pin, mid-read
        out = {}
        writer = threading.Thread(target=lambda: out.setdefault("res", store_tokens(eng, CONV[:16])))
        writer.start()
        assert hook.written.wait(10)  # the split's rows are written: it waits for the pin now
        if pin_wait_s < 1:
            writer.join(10)  # it gives up by itself while the restore still pins the row
        else:
            assert writer.is_alive()  # waiting for the pin (up to 5 s), not done under it
        hook.go.set()
        reader.join(10)
        writer.join(10)
        assert not reader.is_alive() and not writer.is_alive()
        r = got["restored"]
        assert r is not None and r.end_tokens == 24  # the old generation, whole
        if pin_wait_s > 1:
            assert out["res"].status == "stored", out["res"]
            assert spans(eng) == [(0, 4, True), (4, 6, True)]
            assert eng.restore(m) is None  # replaced: the old match is stale
            for b in (4, 6):
                assert_restores(eng, CONV[: b * BT], blocks=b)
        else:
            assert (out["res"].status, out["res"].reason) == ("skipped", "pinned")
            assert spans(eng) == [(0, 6, True)]
        clean(eng)


# ------------------------------------------------------------------ merge


def test_merge_reduces_rows_files_and_reads_and_keeps_bytes(cache_dir):
    L = make_layout(ranks=2)
    twigs = [CONV + tokens_for(72 + i, 2) for i in range(2)]
    with Engine.open(cache_dir, L, CAP) as eng:
        chain(eng)
        for t in twigs:
            assert store_tokens(eng, t).ok
        end = node_at(eng, CONV)
        kids = {node_at(eng, t).id for t in twigs}
        m0, before = restored(eng, twigs[0])
        files0, rows0 = shard_files(cache_dir), len(eng.index)
        rep = eng.compact()
        assert (rep.merges, rep.rows_merged, rep.rows_before, rep.rows_after) == (1, 4, 6, 3)
        # the endpoint keeps its id, key and snapshot; its children keep their parent
        assert node_at(eng, CONV) is end and (end.start, end.end, end.has_snapshot) == (0, 12, True)
        assert end.children == kids and all(eng.index.nodes[k].parent == end.id for k in kids)
        assert shard_files(cache_dir) == files0 - 3 * 2 and len(eng.index) == rows0 - 3
        assert eng.restore(m0) is None  # a Match taken before the swap is stale
        _, after = restored(eng, twigs[0])
        assert (before.files_read, after.files_read) == (5 * 2, 2 * 2)
        assert same(before.segments, after.segments) and same(before.snapshot, after.snapshot)
        for t in (*twigs, CONV):
            assert_restores(eng, t)
        assert counters(eng)["replaces.merge"] == 1
        assert eng.compact().merges == 0  # nothing left to merge
        clean(eng)
    with Engine.open(cache_dir, L, CAP) as eng:
        for t in (*twigs, CONV):
            assert_restores(eng, t)
        clean(eng)


def test_merge_keeps_interior_checkpoints_unless_the_policy_drops_them(cache_dir):
    L = make_layout(snapshot=False)  # attention only: every row is a restore target
    with Engine.open(cache_dir, L, CAP) as eng:
        chain(eng, retire=())
        assert eng.compact().runs == 0
        m = eng.lookup(P(CONV[:28]))
        assert m.blocks == 7 and len(m.path) == 3  # a partial hit inside (6, 9]
        _, before = restored(eng, CONV)
        rep = eng.compact(CompactionPolicy(keep_interior_checkpoints=False))
        assert rep.merges == 1 and spans(eng) == [(0, 12, False)]
        m = eng.lookup(P(CONV[:28]))  # interior checkpoints merged away: one row serves
        assert m.blocks == 7 and len(m.path) == 1
        assert_restores(eng, CONV[:28], blocks=7)
        _, after = restored(eng, CONV)
        assert same(before.segments, after.segments) and after.files_read == 1
        clean(eng)


def test_merge_never_touches_pinned_or_fenced_rows_and_declines_large_runs(cache_dir, layout):
    with Engine.open(cache_dir, layout, CAP) as eng:
        chain(eng)
        with eng.pinned(eng.lookup(P(CONV))):
            assert eng.compact().merges == 0
        mid = node_at(eng, CONV[:24])
        with eng.guard.lock:
            eng.holds.fences[mid.id] += 1
        rep = eng.compact()  # only the run below the fenced row can merge
        assert rep.merges == 1 and spans(eng) == [(0, 3, False), (3, 6, False), (6, 12, True)]
        assert node_at(eng, CONV[:24]) is mid
        with eng.guard.lock:
            eng.holds.fences[mid.id] -= 1
            del eng.holds.fences[mid.id]
        rep = eng.compact(CompactionPolicy(max_merge_bytes=100))
        assert rep.merges == 0 and rep.declined
        assert eng.compact().merges == 1 and spans(eng) == [(0, 12, True)]
        clean(eng)


def test_a_damaged_row_found_by_a_merge_aborts_it(cache_dir, layout):
    with Engine.open(cache_dir, layout, CAP) as eng:
        chain(eng)
        mid = node_at(eng, CONV[:24])
        os.unlink(os.path.join(cache_dir, "rank0", f"{mid.key.hex()}-g{mid.generation}.st"))
        rep = eng.compact()
        assert rep.merges == 0 and rep.aborted[0].startswith("damaged")
        assert mid.state == "damaged" and len(eng.index) == 4
        assert counters(eng)["replaces.merge_aborted"] == 1
        assert eng.lookup(P(CONV)).outcome == "damaged"
        clean(eng)


# ------------------------------------------------------------------ republish and refill


def test_store_gives_a_merged_endpoint_its_snapshot_back(cache_dir, layout):
    with Engine.open(cache_dir, layout, CAP) as eng:
        chain(eng, ends=(3, 6, 9), retire=(3, 6, 9))
        eng.compact()
        assert spans(eng) == [(0, 9, False)] and eng.lookup(P(CONV[:36])).outcome == "miss"
        t = CONV[:36]
        segs = {k: v[32:] for k, v in seg_tensors(layout, t)[0].items()}  # only its last block
        res = eng.store(P(t), segs, snap_tensors(layout, t), tokens_from=32)
        assert res.status == "refilled", res
        assert spans(eng) == [(0, 9, True)]
        assert_restores(eng, t, blocks=9)
        assert counters(eng)["replaces.republish"] == 1
        clean(eng)


def test_store_covering_a_damaged_row_refills_it(cache_dir, layout):
    with Engine.open(cache_dir, layout, CAP) as eng:
        chain(eng, ends=(3, 6, 12), retire=(3,))
        low = node_at(eng, CONV[:12])
        os.unlink(os.path.join(cache_dir, "rank0", f"{low.key.hex()}-g{low.generation}.st"))
        assert eng.restore(eng.lookup(P(CONV))) is None and low.state == "damaged"
        assert eng.lookup(P(CONV)).outcome == "damaged"
        twig = CONV[:24] + tokens_for(73, 2)
        assert store_tokens(eng, twig).status == "stored"
        assert low.state == "ready" and not low.has_snapshot
        assert_restores(eng, CONV, blocks=12)
        assert_restores(eng, twig, blocks=8)
        c = counters(eng)
        assert c["refills"] == 1 and c["replaces.republish"] == 1
        clean(eng)


# ------------------------------------------------------------------ failures


class OnWrite(FaultHook):
    """Runs ``fn`` once, before the first write whose target contains ``match``."""

    def __init__(self, match: str, fn) -> None:
        self.match, self.fn, self.done = match, fn, False
        self._lock = threading.Lock()

    def before(self, op, target, rank):
        with self._lock:
            if op != "write" or self.match not in target or self.done:
                return
            self.done = True
        self.fn()


def test_partial_rank_failure_while_writing_a_merge_leaves_old_rows_serving(cache_dir):
    L = make_layout(ranks=2)
    plan = FaultPlan()
    with Engine.open(cache_dir, L, CAP, fs=FaultFS(plan)) as eng:
        chain(eng)
        end = node_at(eng, CONV)
        before = spans(eng)
        plan.add("write", "EIO", rank=1, at=1, match=f"{end.key.hex()}-g{end.generation + 1}")
        rep = eng.compact()
        assert rep.merges == 0 and "rank 1" in rep.aborted[0]
        assert spans(eng) == before and end.generation == 1
        assert_restores(eng, CONV, blocks=12)
        clean(eng)  # the partial new files were rolled back: nothing leaked
        assert eng.compact().merges == 1
        assert_restores(eng, CONV, blocks=12)
        clean(eng)


def test_partial_rank_failure_while_writing_a_split_leaves_old_rows_serving(cache_dir):
    L = make_layout(ranks=2)
    plan = FaultPlan()
    with Engine.open(cache_dir, L, CAP, fs=FaultFS(plan)) as eng:
        chain(eng, ends=(6, 12), retire=())
        plan.add("write", "ENOSPC", rank=0, at=1, match=P(CONV[:16]).keys[-1].hex())
        res = store_tokens(eng, CONV[:16])
        assert res.status == "failed" and "rank 0" in res.reason
        assert spans(eng) == [(0, 6, True), (6, 12, True)]
        assert_restores(eng, CONV[:24], blocks=6)
        assert_restores(eng, CONV, blocks=12)
        clean(eng)
        assert store_tokens(eng, CONV[:16]).status == "stored"
        clean(eng)


# ------------------------------------------------------------------ concurrency


def test_restores_run_during_a_compaction_of_their_own_path(cache_dir):
    """While the merge writes its new generation (engine lock released), another thread
    looks up and restores the very path being merged: it gets the old rows' bytes."""
    L = make_layout(ranks=2)
    with Engine.open(cache_dir, L, CAP) as eng:
        chain(eng)
        end = node_at(eng, CONV)
        _, want = restored(eng, CONV)
        seen = []

        def restore_elsewhere():
            def go():
                m, r = restored(eng, CONV)
                seen.append((m.path, r))

            t = threading.Thread(target=go)
            t.start()
            t.join(10)
            assert not t.is_alive(), "a restore blocked on the compaction"

        hook = OnWrite(f"{end.key.hex()}-g2", restore_elsewhere)
        for r in eng.ranks:
            r.fs.hook = hook
        rep = eng.compact()
        assert hook.done and rep.merges == 1
        (path, got), = seen
        assert len(path) == 4  # it read the old rows, pinned, while the merge wrote
        assert same(got.segments, want.segments) and same(got.snapshot, want.snapshot)
        _, after = restored(eng, CONV)
        assert same(after.segments, want.segments) and after.files_read == 2
        clean(eng)


@pytest.mark.parametrize("released", [False, True])
def test_the_swap_waits_for_pins_and_gives_up_if_they_stay(cache_dir, layout, released):
    with Engine.open(cache_dir, layout, CAP) as eng:
        chain(eng)
        end = node_at(eng, CONV)
        m = eng.lookup(P(CONV))

        def pin_now():
            assert eng.pin(m)
            if released:
                threading.Timer(0.1, eng.unpin, args=(m,)).start()

        hook = OnWrite(f"{end.key.hex()}-g2", pin_now)
        eng.ranks[0].fs.hook = hook
        t0 = time.monotonic()
        rep = eng.compact(CompactionPolicy(pin_wait_s=5.0 if released else 0.05))
        assert hook.done
        if released:
            assert rep.merges == 1 and time.monotonic() - t0 >= 0.1
        else:
            assert rep.merges == 0 and rep.aborted == ["pinned"]
            assert len(eng.index) == 4 and end.generation == 1
            assert_restores(eng, CONV, blocks=12)
            eng.unpin(m)
            assert eng.compact().merges == 1
        assert_restores(eng, CONV, blocks=12)
        clean(eng)


def test_a_row_that_gains_a_child_during_the_write_aborts_the_merge(cache_dir, layout):
    twig = CONV[:24] + tokens_for(74, 2)
    with Engine.open(cache_dir, layout, CAP) as eng:
        chain(eng)
        end = node_at(eng, CONV)
        hook = OnWrite(f"{end.key.hex()}-g2", lambda: store_tokens(eng, twig))
        eng.ranks[0].fs.hook = hook
        rep = eng.compact()
        assert hook.done and rep.merges == 0 and rep.aborted == ["stale"]
        assert_restores(eng, twig, blocks=8)
        assert_restores(eng, CONV, blocks=12)
        clean(eng)
        rep = eng.compact()  # the chain now forks at block 6: two shorter runs merge
        assert rep.merges == 2 and spans(eng) == [(0, 6, False), (6, 8, True), (6, 12, True)]
        assert_restores(eng, twig, blocks=8)
        assert_restores(eng, CONV, blocks=12)
        clean(eng)


class AuditOnUnlink(FaultHook):
    """Audits the engine once, before the first unlink of a retired shard: the moment
    a merge has swapped its rows in and not yet ended its transaction."""

    def __init__(self, eng: Engine) -> None:
        self.eng, self.report = eng, None

    def before(self, op, target, rank):
        if op == "unlink" and self.report is None:
            self.report = self.eng.audit()


def test_a_merge_holds_no_fence_on_a_row_it_deleted(cache_dir, layout):
    """The rows a merge deletes leave the fence table with the index: an audit at any
    point after the swap (here: while the old generation is unlinked) sees every
    fenced node indexed, and the merge's fences are all gone once it returns."""
    with Engine.open(cache_dir, layout, CAP) as eng:
        chain(eng)
        doomed = {n.id for n in eng.index if n.end != 12}
        hook = AuditOnUnlink(eng)
        eng.ranks[0].fs.hook = hook
        assert eng.compact().merges == 1
        assert hook.report is not None and len(eng.index) == 1
        assert not doomed & set(eng.index.nodes)
        assert hook.report.ok, hook.report.to_dict()
        assert not eng.holds.fences
        assert_restores(eng, CONV, blocks=12)
        clean(eng)


class FailOnce(FaultHook):
    def __init__(self) -> None:
        self.armed = True

    def before(self, op, target, rank):
        if op == "commit" and target == "compact.intent" and self.armed:
            self.armed = False
            raise RuntimeError("planted bug in a compaction")


def test_an_invariant_violation_stops_the_background_worker(cache_dir, layout, monkeypatch):
    """With the debug checks on, a compaction whose transaction breaks an invariant
    stops the worker (no more background changes), counted and recorded, instead of
    being logged and retried; recovery then leaves a clean cache."""
    with Engine.open(cache_dir, layout, CAP) as eng:
        chain(eng)
    real = Driver.check

    def planted(self, c, txn, state):
        return ["planted breach"] if txn.kind == "compact" else real(self, c, txn, state)

    monkeypatch.setattr(Driver, "check", planted)
    with Engine.open(cache_dir, layout, CAP, compaction=CompactionPolicy(interval_s=0.02)) as eng:
        worker = eng.compactor
        deadline = time.monotonic() + 20
        while worker.alive and time.monotonic() < deadline:
            time.sleep(0.02)
        assert not worker.alive, "the worker went on after an invariant violation"
        assert "planted breach" in (worker.violation or "") and worker.errors == 0
        assert counters(eng)["replaces.invariant_violation"] == 1
    monkeypatch.undo()
    with Engine.open(cache_dir, layout, CAP) as eng:
        clean(eng)
        assert_restores(eng, CONV, blocks=12)


def test_background_worker_merges_and_survives_a_failed_compaction(cache_dir, layout):
    with Engine.open(cache_dir, layout, CAP) as eng:
        chain(eng)
    hook = FailOnce()
    pol = CompactionPolicy(interval_s=0.02)
    with Engine.open(cache_dir, layout, CAP, hook=hook, compaction=pol) as eng:
        worker = eng.compactor
        assert worker is not None and worker.alive
        deadline = time.monotonic() + 20
        while len(eng.index) > 1 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert len(eng.index) == 1, "the worker did not merge the chain"
        assert worker.errors == 1 and not hook.armed and worker.alive
        c = counters(eng)
        assert c["replaces.worker_error"] == 1 and c["replaces.merge_aborted"] >= 1
        assert_restores(eng, CONV, blocks=12)
        clean(eng)
    assert not worker.alive
    with pytest.raises(InvalidInputError):
        Engine.open(cache_dir, layout, CAP, compaction="yes")
    with Engine.open(cache_dir, layout, CAP) as eng:
        assert eng.compactor is None
        assert_restores(eng, CONV, blocks=12)
        clean(eng)
