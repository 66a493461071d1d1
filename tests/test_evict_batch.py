"""A space-making pass evicts its victims together: one evict transaction (one commit of
their removal, one of their reclaim) for up to ``space.EVICT_BATCH`` nodes, in the order
a victim-at-a-time pass takes them (a parent its chosen children leave a leaf is a
candidate at once), pins and fences untouched, each victim credited with what it freed."""

from __future__ import annotations

from conftest import assert_restores, key_at, make_layout, store_tokens, tokens_for

from prefixstore.base.keys import Prefix
from prefixstore.engine import space
from prefixstore.engine.api import Engine
from prefixstore.fuzz.faultfs import CountingHook
from prefixstore.gpu.fileio import FaultHook

CAP = 64 << 20


class Commits(FaultHook):
    """The labels of the catalog commits made while ``on``."""

    def __init__(self) -> None:
        self.on, self.labels = False, []

    def before(self, op, target, rank):
        if self.on and op == "commit":
            self.labels.append(target)


def _open(root: str, hook: FaultHook | None = None, ranks: int = 1) -> Engine:
    return Engine.open(root, make_layout(ranks=ranks, snapshot=False), CAP, policy="leaf-lru", hook=hook)


def _nbytes(eng: Engine, tokens: list[int]) -> int:
    return eng.index.nodes[eng.index.by_key[key_at(tokens)]].nbytes


def test_one_pass_evicts_its_victims_in_one_evict_commit(tmp_path):
    """64 victims of one ``evict`` call: one removal commit and one reclaim commit
    (victim at a time: 64 of each); the 64 oldest go, the 8 youngest stay."""
    hook = Commits()
    convs = [tokens_for(1000 + i, 1) for i in range(72)]
    with _open(str(tmp_path / "c"), hook) as eng:
        for t in convs:
            assert store_tokens(eng, t).ok
        want = sum(_nbytes(eng, t) for t in convs[:64])
        before = eng.counters.snapshot()
        hook.on = True
        assert eng.evict(want) == want
        hook.on = False
        after = eng.counters.snapshot()
        assert after["evictions.evict"] - before.get("evictions.evict", 0) == 64
        assert after["evicted_bytes.evict"] - before.get("evicted_bytes.evict", 0) == want
        assert hook.labels.count("evict.remove") == 1, hook.labels
        assert hook.labels.count("evict.reclaimed") == 1, hook.labels
        assert len(hook.labels) <= 3, hook.labels  # and at most the loose-garbage look
        assert not any(key_at(t) in eng.index.by_key for t in convs[:64])
        for t in convs[64:]:
            assert_restores(eng, t, blocks=1)
        assert eng.audit().ok
        assert not eng.catalog.journal()


def test_a_pass_takes_more_than_a_batch_in_bounded_batches(tmp_path, monkeypatch):
    monkeypatch.setattr(space, "EVICT_BATCH", 8)
    hook = Commits()
    convs = [tokens_for(2000 + i, 1) for i in range(22)]
    with _open(str(tmp_path / "c"), hook) as eng:
        for t in convs:
            assert store_tokens(eng, t).ok
        want = sum(_nbytes(eng, t) for t in convs[:20])
        hook.on = True
        assert eng.evict(want) == want
        assert hook.labels.count("evict.remove") == 3, hook.labels  # 8 + 8 + 4
        assert len(eng.index) == 2
        assert eng.audit().ok


def test_a_parent_left_a_leaf_goes_in_the_same_batch_in_recency_order(tmp_path):
    """Victim at a time: the old chain's leaf, then its parent (now the oldest leaf),
    before any younger leaf; a pinned old leaf stays, and so does its parent. All in
    one evict transaction."""
    hook = Commits()
    chain = tokens_for(3000, 4)
    pinned = tokens_for(3001, 4)
    young = [tokens_for(3100 + i, 1) for i in range(6)]
    with _open(str(tmp_path / "c"), hook) as eng:
        for t in (pinned[:8], pinned, chain[:8], chain, *young):
            assert store_tokens(eng, t).ok
        m = eng.lookup(Prefix.from_tokens(pinned, 4))
        assert eng.pin(m)
        want = _nbytes(eng, chain) + _nbytes(eng, chain[:8]) + _nbytes(eng, young[0])
        hook.on = True
        assert eng.evict(want) == want
        assert hook.labels.count("evict.remove") == 1, hook.labels
        gone = {key_at(t) for t in (chain, chain[:8], young[0])}
        assert not gone & set(eng.index.by_key)
        for t in (pinned, pinned[:8], *young[1:]):
            assert key_at(t) in eng.index.by_key
        eng.unpin(m)
        assert_restores(eng, pinned, blocks=4)
        assert eng.audit().ok


def test_the_victim_heap_offers_each_parent_once_the_batch_is_gone(tmp_path):
    """After a batched pass, the parents it left as leaves are the next victims (their
    heap entries are current), and nothing the pass set aside is lost from the heap."""
    convs = [tokens_for(4000 + i, 4) for i in range(5)]
    with _open(str(tmp_path / "c")) as eng:
        for t in convs:
            for b in (1, 2, 4):
                assert store_tokens(eng, t[: b * 4]).ok
        for t in convs:  # the interior checkpoints are used after the leaves
            assert_restores(eng, t[:8], blocks=2)
        leaves = sum(_nbytes(eng, t) for t in convs)
        assert eng.evict(leaves) == leaves
        mids = [eng.index.nodes[eng.index.by_key[key_at(t[:8])]] for t in convs]
        assert all(n.is_leaf for n in mids)
        # victim at a time: each mid, then its root (used with it, so as old), in turn
        assert eng.evict(2 * mids[0].nbytes) == 2 * mids[0].nbytes
        assert key_at(convs[0][:8]) not in eng.index.by_key and key_at(convs[0][:4]) not in eng.index.by_key
        assert len(eng.index) == 8
        assert eng.evict(1 << 30) > 0 and len(eng.index) == 0
        assert eng.account.charged == 0 and eng.audit().ok


def test_an_unlink_that_fails_in_a_batch_leaves_loose_garbage_and_exact_accounting(tmp_path):
    """One victim's file stays (EIO): the batch still commits; that file is loose
    garbage, charged until reclaimed; the call returns what was really freed and the
    counters say the same."""

    class FailOne(FaultHook):
        def __init__(self) -> None:
            self.armed, self.failed = False, None

        def before(self, op, target, rank):
            if self.armed and op == "unlink" and self.failed is None:
                self.failed = target
                raise OSError(5, "injected EIO", target)

    hook = FailOne()
    convs = [tokens_for(5000 + i, 1) for i in range(12)]
    with _open(str(tmp_path / "c"), hook) as eng:
        for t in convs:
            assert store_tokens(eng, t).ok
        sizes = [_nbytes(eng, t) for t in convs]
        want = sum(sizes[:8])
        before = eng.account.charged
        hook.armed = True
        freed = eng.evict(want)
        hook.armed = False
        assert hook.failed is not None
        assert freed == before - eng.account.charged
        c = eng.counters.snapshot()
        assert c["evicted_bytes.evict"] == freed
        rep = eng.audit()
        assert rep.ok, rep.to_dict()
        loose = eng.catalog.loose_garbage()
        assert len(loose) == 1
        assert eng.reclaim() == loose[0][2]
        assert eng.audit().ok


def test_counting_hook_sees_one_removal_commit_per_batch(tmp_path):
    """The effect points of a batched pass: every victim's file unlinked, each rank's
    directory synced once, and two commits."""
    convs = [tokens_for(6000 + i, 1) for i in range(10)]
    counter = CountingHook()
    root = str(tmp_path / "c")
    with _open(root, ranks=2) as eng:
        for t in convs:
            assert store_tokens(eng, t).ok
        want = sum(_nbytes(eng, t) for t in convs[:6])
    with _open(root, counter, ranks=2) as eng:
        counter.points.clear()
        eng.evict(want)
        ops = [(when, op) for when, op, _t, _r in counter.points if when == "before"]
        assert ops.count(("before", "unlink")) == 12
        assert ops.count(("before", "fsync_dir")) == 2
        assert ops.count(("before", "commit")) == 2


def test_a_victim_held_by_the_time_its_batch_is_evicted_stays_with_its_parent(tmp_path, monkeypatch):
    """The batch reads every victim's holds again when it is evicted: one pinned since
    it was chosen stays, and so does the parent it was to leave a leaf (chosen after
    it); the other victims go, and the pass goes on to the next candidates."""
    chain = tokens_for(7000, 2)
    others = [tokens_for(7100 + i, 1) for i in range(4)]
    with _open(str(tmp_path / "c")) as eng:
        for t in (chain[:4], chain, *others):
            assert store_tokens(eng, t).ok
        leaf = eng.index.by_key[key_at(chain)]
        orig = space.evict_batch

        def pin_then_evict(rm, p):
            if leaf in p.batch.chosen and not rm.holds.pins[leaf]:
                rm.holds.pin([leaf])  # as a restore would, had it run meanwhile
            return orig(rm, p)

        monkeypatch.setattr(space, "evict_batch", pin_then_evict)
        want = _nbytes(eng, chain) + _nbytes(eng, chain[:4]) + _nbytes(eng, others[0])
        freed = eng.evict(want)
        assert key_at(chain) in eng.index.by_key and key_at(chain[:4]) in eng.index.by_key
        assert key_at(others[0]) not in eng.index.by_key
        assert freed >= want - _nbytes(eng, chain) - _nbytes(eng, chain[:4])
        eng.holds.unpin([leaf])
        assert_restores(eng, chain, blocks=2)
        assert eng.audit().ok


def test_a_subtree_victim_larger_than_a_batch_goes_in_bounded_transactions(tmp_path, monkeypatch):
    """Plain LRU's interior victim takes its subtree (a root and 19 children): with a
    batch of 8 nodes, in three evict transactions (8 + 8 + 4), leaves first; counted as
    one victim with every byte it freed."""
    monkeypatch.setattr(space, "EVICT_BATCH", 8)
    hook = Commits()
    root_t = tokens_for(8000, 1)
    kids = [root_t + tokens_for(8100 + i, 1) for i in range(19)]
    young = tokens_for(8200, 1)
    with Engine.open(str(tmp_path / "c"), make_layout(snapshot=False), CAP, policy="lru", hook=hook) as eng:
        for t in (root_t, *kids, young):
            assert store_tokens(eng, t).ok
        want = sum(_nbytes(eng, t) for t in (root_t, *kids))
        before = eng.counters.snapshot()
        hook.on = True
        assert eng.evict(1) == want  # the oldest node is the root: its whole subtree goes
        hook.on = False
        after = eng.counters.snapshot()
        assert hook.labels.count("evict.remove") == 3, hook.labels
        assert after["evictions.evict_subtree"] - before.get("evictions.evict_subtree", 0) == 1
        assert after["evicted_bytes.evict_subtree"] - before.get("evicted_bytes.evict_subtree", 0) == want
        assert list(eng.index.by_key) == [key_at(young)]
        assert_restores(eng, young, blocks=1)
        assert eng.audit().ok and not eng.catalog.journal()
