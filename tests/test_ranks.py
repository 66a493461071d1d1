"""Tensor-parallel stores: the seed's partial-rank failure cases, each on 2 and 4 ranks
with the failing rank first, in the middle and last.

Every case is checked as a journaled path: ``transitions`` records each state-machine
step the engine takes (kind, state, event, next state) and ``Recorder`` records each
file effect and, after each catalog commit, the journal rows it left, so a test can
see that a state was committed before the effects of the next step ran.

Cases (DESIGN.md section 3):

- a failure on some ranks that leaves every prior file intact rolls back to the
  previous record and reclaims the partial new files;
- a prior record found damaged (shard missing, short, altered) is invalidated, its
  descendants keep their links, its full size stays charged, and a later store of the
  same checkpoint refills it (counted);
- a cleanup that finds a file already missing completes;
- a failed cleanup leaves garbage that stays charged and is reclaimed later;
- an all-rank write failure rolls back;
- a prefix already resident on the GPU is bypassed (never read from the host);
- a coordinator crash at every effect of a multi-rank store whose ranks live in
  separate directories: recovery finds every rank's files.
"""

from __future__ import annotations

import os
import sqlite3
from collections import Counter

import pytest
import torch
from conftest import (
    BT,
    Gate,
    assert_restores,
    crash_points,
    make_layout,
    node_at,
    seg_tensors,
    store_tokens,
    store_until_crash,
    tokens_for,
)

from prefixstore.base.keys import Prefix
from prefixstore.engine import health, replace
from prefixstore.engine.api import Engine
from prefixstore.engine.driver import Driver
from prefixstore.fuzz.faultfs import ChainHook, CountingHook, CrashAt, FaultFS, FaultPlan, flip_bit
from prefixstore.gpu.fileio import FaultHook
from prefixstore.gpu.ranks import LocalRank, rank_dir_name

CAP = 16 << 20
CASES = [(2, 0), (2, 1), (4, 0), (4, 2), (4, 3)]
IDS = ["2r-first", "2r-last", "4r-first", "4r-middle", "4r-last"]

ROLLED_BACK = [("store", "INTENT", "failed", "ROLLING_BACK"), ("store", "ROLLING_BACK", "cleaned", "ROLLED_BACK")]
CLEANUP_FAILED = [
    ("store", "INTENT", "failed", "ROLLING_BACK"),
    ("store", "ROLLING_BACK", "cleanup_failed", "ROLLED_BACK"),
]
PUBLISHED = [("store", "INTENT", "durable", "PUBLISHED"), ("store", "PUBLISHED", "retired", "DONE")]


class Recorder(FaultHook):
    """Every file effect ``(op, rank, name)`` and, after each commit, ``('commit', label,
    journal rows)`` read through a separate read-only connection (what is durable)."""

    def __init__(self, root: str) -> None:
        self.root = root
        self.events: list[tuple] = []

    def after(self, op: str, target: str, rank: int | None) -> None:
        if op != "commit":
            self.events.append((op, rank, os.path.basename(target)))
            return
        conn = sqlite3.connect(f"file:{os.path.join(self.root, 'catalog.sqlite')}?mode=ro", uri=True)
        try:
            rows = tuple(conn.execute("SELECT kind, state FROM journal ORDER BY id").fetchall())
        finally:
            conn.close()
        self.events.append(("commit", target, rows))

    def commits(self, since: int = 0) -> list[tuple[str, tuple]]:
        return [(e[1], e[2]) for e in self.events[since:] if e[0] == "commit"]

    def index_of_commit(self, label: str, since: int = 0) -> int:
        return next(i for i, e in enumerate(self.events) if i >= since and e[0] == "commit" and e[1] == label)


@pytest.fixture
def transitions(monkeypatch) -> list[tuple[str, str, str, str]]:
    """Every state-machine step the engine commits: (kind, state, event, next)."""
    seen: list[tuple[str, str, str, str]] = []
    orig = Driver.fire

    def fire(self, c, txn, event, *then, **kw):
        state = self.journal.state(c, txn.id)[1]
        outs = orig(self, c, txn, event, *then, **kw)
        for ev in (event, *then):  # each edge a multi-event fire passes through
            nxt = self.machines[txn.kind].next(state, ev)
            seen.append((txn.kind, state, ev, nxt))
            state = nxt
        return outs

    monkeypatch.setattr(Driver, "fire", fire)
    return seen


def open_engine(tmp_path, ranks: int, plan: FaultPlan, snapshot: bool = True):
    root = str(tmp_path / "cache")
    rec = Recorder(root)
    eng = Engine.open(root, make_layout(ranks=ranks, snapshot=snapshot), CAP, fs=FaultFS(plan), hook=rec)
    return eng, rec


def shard_path(eng: Engine, node, rank: int) -> str:
    return os.path.join(eng.ranks[rank].directory, f"{node.key.hex()}-g{node.generation}.st")


def disk(eng: Engine) -> dict[tuple[int, str], bytes]:
    out = {}
    for r, rk in enumerate(eng.ranks):
        for e in os.listdir(rk.directory):
            with open(os.path.join(rk.directory, e), "rb") as f:
                out[(r, e)] = f.read()
    return out


def catalog_state(eng: Engine):
    return (
        eng.catalog.query("SELECT * FROM nodes ORDER BY id"),
        eng.catalog.query("SELECT * FROM files ORDER BY rank, name"),
        eng.account.charged,
    )


def assert_clean(eng: Engine) -> None:
    rep = eng.audit()
    assert rep.ok, rep.to_dict()
    assert not rep.unknown_files
    assert eng.account.charged == eng.catalog.charged()
    assert not eng.catalog.journal()


def damage(path: str, how: str) -> None:
    if how == "missing":
        os.unlink(path)
    elif how == "short":
        os.truncate(path, os.path.getsize(path) // 2)
    else:  # altered: same size, one bit of the tensor data flipped
        flip_bit(path, os.path.getsize(path) - 5, 3)


# ---------------------------------------------------------------------------- case 1


@pytest.mark.parametrize("op", ["write", "fsync", "rename", "fsync_dir"])
@pytest.mark.parametrize(("ranks", "bad"), CASES, ids=IDS)
def test_partial_failure_rolls_back_to_parent_record(tmp_path, transitions, ranks, bad, op):
    """A new child fails on one rank: every rank's new file is reclaimed, the parent
    (the previous record) is untouched, and the same store succeeds afterwards."""
    plan = FaultPlan()
    eng, rec = open_engine(tmp_path, ranks, plan)
    a = tokens_for(1, 6)
    assert store_tokens(eng, a[:8]).status == "stored"
    before, files_before = catalog_state(eng), disk(eng)
    plan.fail_nth(op, 1, "EIO", rank=bad)
    mark = len(rec.events)
    transitions.clear()
    res = store_tokens(eng, a)
    assert res.status == "failed" and f"rank {bad}:" in res.reason, res
    assert plan.total_injected == 1
    assert transitions == ROLLED_BACK
    assert rec.commits(mark) == [
        ("store.intent", (("store", "INTENT"),)),
        ("store.rollback", (("store", "ROLLING_BACK"),)),
        ("store.cleaned", ()),
    ]
    # the partial files were removed only after ROLLING_BACK was durable
    rb = rec.index_of_commit("store.rollback", mark)
    unlinks = [i for i, e in enumerate(rec.events) if i >= mark and e[0] == "unlink"]
    assert unlinks and min(unlinks) > rb
    assert catalog_state(eng) == before and disk(eng) == files_before
    assert node_at(eng, a[:8]).state == "ready"
    assert eng.lookup(Prefix.from_tokens(a, BT)).blocks == 2
    assert_restores(eng, a, blocks=2)
    assert eng.stats()["garbage_bytes"] == 0
    assert_clean(eng)
    assert store_tokens(eng, a).status == "stored"
    assert_restores(eng, a, blocks=6)
    assert_clean(eng)
    eng.close()


@pytest.mark.parametrize(("ranks", "bad"), CASES, ids=IDS)
def test_partial_failure_rolls_back_to_previous_generation(tmp_path, transitions, ranks, bad):
    """Re-storing a node (a snapshot-less generation gets its snapshot back) fails on
    one rank: the node keeps its previous generation, and its descendant still restores."""
    plan = FaultPlan()
    eng, rec = open_engine(tmp_path, ranks, plan)
    a = tokens_for(2, 6)
    store_tokens(eng, a[:8])
    store_tokens(eng, a)
    p = node_at(eng, a[:8])
    with eng.guard.lock:
        assert replace.retire_snapshot(eng.flows.replacing, p)
    assert not p.has_snapshot
    gen = p.generation
    before, files_before = catalog_state(eng), disk(eng)
    plan.fail_nth("rename", 1, "EIO", rank=bad)
    transitions.clear()
    res = store_tokens(eng, a[:8])
    assert res.status == "failed", res
    assert transitions == ROLLED_BACK
    assert catalog_state(eng) == before and disk(eng) == files_before
    assert (p.state, p.generation, p.has_snapshot) == ("ready", gen, False)
    assert_restores(eng, a, blocks=6)
    assert_clean(eng)
    assert store_tokens(eng, a[:8]).status == "refilled"
    assert p.has_snapshot and p.generation > gen
    assert_restores(eng, a[:8], blocks=2)
    assert_restores(eng, a, blocks=6)
    assert_clean(eng)
    eng.close()


# ---------------------------------------------------------------------------- case 2


@pytest.mark.parametrize("how", ["missing", "short", "altered"])
@pytest.mark.parametrize(("ranks", "bad"), CASES, ids=IDS)
def test_damaged_prior_record_is_invalidated_then_refilled(tmp_path, transitions, ranks, bad, how):
    plan = FaultPlan()
    eng, rec = open_engine(tmp_path, ranks, plan)
    a = tokens_for(3, 6)
    b = a[:8] + tokens_for(4, 3)  # another child of the same parent
    store_tokens(eng, a[:8])
    store_tokens(eng, a)
    p, c = node_at(eng, a[:8]), node_at(eng, a)
    p_bytes, old_gen = p.nbytes, p.generation
    old_names = {(r, os.path.basename(shard_path(eng, p, r))) for r in range(ranks)}
    damage(shard_path(eng, p, bad), how)  # by the disk or an operator, at rest
    charged = eng.account.charged
    plan.fail_nth("write", 1, "EIO", rank=bad)
    mark = len(rec.events)
    transitions.clear()
    res = store_tokens(eng, b)
    assert res.status == "failed", res
    assert transitions == ROLLED_BACK
    assert [label for label, _ in rec.commits(mark)] == [
        "store.intent", "store.rollback", "store.cleaned", "invalidate"
    ]
    # invalidated; its descendant keeps its link; its full size stays charged
    assert p.state == "damaged"
    assert c.parent == p.id and c.id in p.children
    assert eng.catalog.query("SELECT parent FROM nodes WHERE id=?", (c.id,))[0][0] == p.id
    assert eng.catalog.query("SELECT state FROM nodes WHERE id=?", (p.id,))[0][0] == "damaged"
    assert eng.account.charged == charged
    st = eng.stats()
    assert st["damaged_bytes"] == p_bytes and st["garbage_bytes"] == 0
    assert st["counters"]["faults.damaged_node"] == 1
    assert eng.lookup(Prefix.from_tokens(a, BT)).outcome == "damaged"
    assert_clean(eng)
    # a later store of the same checkpoint refills the row
    transitions.clear()
    assert store_tokens(eng, a[:8]).status == "refilled"
    assert transitions == PUBLISHED
    assert eng.stats()["counters"]["refills"] == 1
    assert p.state == "ready" and p.generation > old_gen and p.id == c.parent
    assert not old_names & set(disk(eng))  # the damaged generation is gone on every rank
    assert eng.account.charged == charged  # the old generation's charge went with it
    assert_restores(eng, a[:8], blocks=2)
    assert_restores(eng, a, blocks=6)
    assert store_tokens(eng, b).status == "stored"
    assert_restores(eng, b, blocks=5)
    assert_clean(eng)
    eng.close()


@pytest.mark.parametrize(("ranks", "bad"), CASES, ids=IDS)
def test_damage_on_another_rank_than_the_failing_one(tmp_path, ranks, bad):
    """A missing shard on any rank is found by the check after a failed store; an
    altered one on a rank that did not fail is found by the next restore instead
    (the check only re-reads the failing ranks). Either way: never other bytes."""
    other = (bad + 1) % ranks
    for how, found_by_check in (("missing", True), ("altered", False)):
        plan = FaultPlan()
        eng, _ = open_engine(tmp_path / how, ranks, plan)
        a = tokens_for(5, 5)
        store_tokens(eng, a[:8])
        p = node_at(eng, a[:8])
        damage(shard_path(eng, p, other), how)
        plan.fail_nth("write", 1, "EIO", rank=bad)
        assert store_tokens(eng, a).status == "failed"
        assert (p.state == "damaged") is found_by_check
        m = eng.lookup(Prefix.from_tokens(a[:8], BT))
        if not found_by_check:
            assert m.hit and eng.restore(m) is None
        assert p.state == "damaged"
        assert store_tokens(eng, a[:8]).status == "refilled"
        assert_restores(eng, a[:8], blocks=2)
        assert_clean(eng)
        eng.close()


# ---------------------------------------------------------------------------- case 3


class _DeleteAfterRename(FaultHook):
    """Deletes a just-renamed shard on one rank (an operator racing the engine)."""

    def __init__(self, rank: int) -> None:
        self.rank, self.armed, self.deleted = rank, False, []

    def after(self, op: str, target: str, rank: int | None) -> None:
        if self.armed and op == "rename" and rank == self.rank:
            os.unlink(target)
            self.deleted.append(os.path.basename(target))


@pytest.mark.parametrize(("ranks", "bad"), CASES, ids=IDS)
def test_cleanup_finding_files_already_missing_completes(tmp_path, transitions, ranks, bad):
    plan = FaultPlan()
    root = str(tmp_path / "cache")
    deleter = _DeleteAfterRename((bad + 1) % ranks)
    eng = Engine.open(root, make_layout(ranks=ranks), CAP, fs=FaultFS(plan), hook=deleter)
    a = tokens_for(6, 5)
    store_tokens(eng, a[:8])
    before, files_before = catalog_state(eng), disk(eng)
    # rank `bad` fails before creating anything; another rank's new file vanishes
    plan.add("write", "ENOSPC", rank=bad, at=1, partial=False)
    deleter.armed = True
    transitions.clear()
    res = store_tokens(eng, a)
    deleter.armed = False
    assert res.status == "failed" and f"rank {bad}: [Errno 28]" in res.reason, res
    assert deleter.deleted
    assert transitions == ROLLED_BACK  # 'cleaned', not 'cleanup_failed'
    assert catalog_state(eng) == before and disk(eng) == files_before
    assert_clean(eng)
    # an evict whose shard is already gone on one rank completes too
    store_tokens(eng, a)
    leaf = node_at(eng, a)
    os.unlink(shard_path(eng, leaf, bad))
    charged = eng.account.charged
    transitions.clear()
    assert eng.evict(prefix=Prefix.from_tokens(a, BT)) == leaf.nbytes
    assert transitions == [("evict", "REMOVED", "reclaimed", "DONE")]
    assert eng.account.charged == charged - leaf.nbytes
    assert eng.stats()["garbage_bytes"] == 0
    assert_clean(eng)
    eng.close()


# ---------------------------------------------------------------------------- case 4


@pytest.mark.parametrize("later", ["reclaim", "reopen"])
@pytest.mark.parametrize(("ranks", "bad"), CASES, ids=IDS)
def test_failed_cleanup_leaves_charged_garbage_reclaimed_later(tmp_path, transitions, ranks, bad, later):
    plan = FaultPlan()
    eng, _ = open_engine(tmp_path, ranks, plan)
    a = tokens_for(7, 5)
    store_tokens(eng, a[:8])
    charged = eng.account.charged
    plan.fail_nth("write", 1, "EIO", rank=bad)  # leaves a short temporary on rank `bad`
    plan.fail_nth("unlink", 1, "EIO", rank=bad)  # and its removal fails
    transitions.clear()
    res = store_tokens(eng, a)
    assert res.status == "failed"
    assert transitions == CLEANUP_FAILED
    rows = eng.catalog.query("SELECT rank, name, size, status, txn FROM files WHERE node IS NULL")
    assert len(rows) == 1
    r, name, size, status, txn = rows[0]
    assert (r, status, txn) == (bad, "garbage", None)
    assert eng.account.charged == charged + size and eng.stats()["garbage_bytes"] == size
    assert (bad, name + ".tmp") in disk(eng)
    assert_clean(eng)  # garbage (and its temporary) is known, charged, journal empty
    # the same checkpoint stores again meanwhile: its new generation avoids the garbage's name
    assert store_tokens(eng, a).status == "stored"
    assert_restores(eng, a, blocks=5)
    assert node_at(eng, a).generation == 2
    assert eng.account.charged == charged + size + node_at(eng, a).nbytes
    assert_clean(eng)
    if later == "reclaim":
        assert eng.reclaim() == size
    else:
        eng.close()
        eng, _ = open_engine(tmp_path, ranks, FaultPlan())
        assert eng.recovery_report.garbage_reclaimed == size
    assert not [k for k in disk(eng) if k[1].startswith(name)]
    assert eng.stats()["garbage_bytes"] == 0
    assert_restores(eng, a, blocks=5)
    assert_clean(eng)
    eng.close()


@pytest.mark.parametrize(("ranks", "bad"), CASES, ids=IDS)
def test_failed_evict_cleanup_stays_charged_until_reclaimed(tmp_path, transitions, ranks, bad):
    plan = FaultPlan()
    eng, _ = open_engine(tmp_path, ranks, plan)
    a = tokens_for(8, 5)
    store_tokens(eng, a)
    leaf = node_at(eng, a)
    size = leaf.nbytes // ranks
    plan.fail_nth("unlink", 1, "EIO", rank=bad)
    transitions.clear()
    assert eng.evict(prefix=Prefix.from_tokens(a, BT)) == leaf.nbytes - size
    assert transitions == [("evict", "REMOVED", "reclaim_failed", "DONE")]
    assert eng.stats()["garbage_bytes"] == size == eng.account.charged
    assert_clean(eng)
    assert eng.reclaim() == size
    assert eng.account.charged == 0 and not disk(eng)
    assert_clean(eng)
    eng.close()


# ---------------------------------------------------------------------------- case 5


@pytest.mark.parametrize("op", ["write", "rename"])
@pytest.mark.parametrize("ranks", [2, 4])
def test_all_rank_write_failure_rolls_back(tmp_path, transitions, ranks, op):
    plan = FaultPlan()
    eng, _ = open_engine(tmp_path, ranks, plan)
    a = tokens_for(9, 5)
    store_tokens(eng, a[:8])
    before, files_before = catalog_state(eng), disk(eng)
    rule = plan.add(op, "EIO", at=1, persistent=True)
    transitions.clear()
    res = store_tokens(eng, a)
    assert res.status == "failed"
    assert all(f"rank {r}:" in res.reason for r in range(ranks)), res.reason
    assert rule.fired == ranks
    assert transitions == ROLLED_BACK
    assert catalog_state(eng) == before and disk(eng) == files_before
    assert node_at(eng, a[:8]).state == "ready"
    assert_restores(eng, a, blocks=2)
    assert_clean(eng)
    plan.rules.remove(rule)
    assert store_tokens(eng, a).status == "stored"
    assert_restores(eng, a, blocks=5)
    eng.close()


# ---------------------------------------------------------------------------- case 6


@pytest.mark.parametrize(("ranks", "bad"), CASES, ids=IDS)
def test_gpu_resident_prefix_is_bypassed(tmp_path, ranks, bad):
    plan = FaultPlan()
    eng, rec = open_engine(tmp_path, ranks, plan)
    a = tokens_for(10, 6)
    store_tokens(eng, a[:8])
    store_tokens(eng, a)
    p = node_at(eng, a[:8])
    p_name = os.path.basename(shard_path(eng, p, bad))
    plan.add("read", "EIO", rank=bad, match=p_name, at=1, persistent=True)
    full = Prefix.from_tokens(a, BT)
    # control: restoring from the host needs the parent, whose read fails: a miss
    m = eng.lookup(full)
    assert m.hit and m.blocks == 6
    assert eng.restore(m) is None
    assert p.state == "ready"  # a read error is not damage
    # the GPU holds the parent's prefix: it is never read
    mark = len(rec.events)
    m = eng.lookup(full, gpu_blocks=2)
    assert m.hit and m.blocks == 6 and [nid for nid, _ in m.path] == [node_at(eng, a).id]
    got = eng.restore(m)
    assert got is not None and (got.start_tokens, got.end_tokens) == (8, 24)
    assert got.files_read == ranks
    assert not [e for e in rec.events[mark:] if e[0] == "read" and e[2] == p_name]
    want = seg_tensors(eng.layout, a)
    for r in range(ranks):
        for k, t in got.segments[r].items():
            assert torch.equal(t, want[r][k][8:24])
    assert eng.lookup(Prefix.from_tokens(a[:8], BT), gpu_blocks=2).outcome == "gpu_resident"
    assert eng.stats()["counters"]["lookups.gpu_resident"] == 1
    # and when the parent is damaged, the GPU-resident part still lets the child serve
    with eng.guard.lock:
        health.invalidate(eng.flows.health, p, "test")
    assert eng.lookup(full).outcome == "damaged"
    assert eng.restore(eng.lookup(full, gpu_blocks=2)) is not None
    assert_clean(eng)
    eng.close()


# ---------------------------------------------------------------------------- crashes


def separate_ranks(base, ranks: int, hook, fs=None) -> list[LocalRank]:
    """Rank directories outside the cache directory, one per 'host'."""
    return [LocalRank(r, os.path.join(base, f"host{r}", rank_dir_name(r)), fs, hook) for r in range(ranks)]


def _crash_scenario(base, ranks: int, hook, kind: str):
    """Acknowledge two checkpoints, then run the store under test with ``hook`` (and a
    follow-up store: crash points after its result)."""
    L = make_layout(ranks=ranks)
    a, b = tokens_for(11, 6), tokens_for(12, 4)
    plan = FaultPlan()
    gate = Gate()
    eng = Engine.open(os.path.join(base, "cache"), L, CAP, hook=gate,
                      ranks=separate_ranks(base, ranks, gate, FaultFS(plan)))
    acked = [(a[:8], 2), (b, 4)]
    for t, _ in acked:
        assert store_tokens(eng, t).ok
    if kind == "failing":  # the last rank fails: the crash points run through the rollback
        plan.fail_nth("rename", 1, "EIO", rank=ranks - 1)
    result = store_until_crash(eng, gate, hook, a)
    return L, acked, a, result, gate.acked_at


def _check_recovered(base, L, acked, target, result) -> str:
    """Recover and check; returns the interrupted store's case: 'acknowledged' (stored
    before the crash), 'published' (no result, but it had published) or 'rolled back'
    (no result, or a failed one)."""
    with Engine.open(os.path.join(base, "cache"), L, CAP, ranks=separate_ranks(base, L.ranks, None)) as eng:
        assert_clean(eng)
        for t, blocks in acked:
            assert_restores(eng, t, blocks=blocks)
        m = eng.lookup(Prefix.from_tokens(target, BT))
        if result is not None and result.ok:
            assert_restores(eng, target, blocks=6)
            return "acknowledged"
        if m.blocks == 6:
            assert result is None  # a store that returned a failure never publishes
            assert_restores(eng, target, blocks=6)  # it had published before the crash
            return "published"
        # rolled back: no rank directory holds a file of it
        names = {e for r in eng.ranks for e in os.listdir(r.directory)}
        key = Prefix.from_tokens(target, BT).keys[-1].hex()
        assert not [e for e in names if e.startswith(key)]
        return "rolled back"


@pytest.mark.parametrize("kind", ["child", "failing"])
@pytest.mark.parametrize("ranks", [2, 4])
def test_coordinator_crash_at_every_effect_ranks_in_separate_dirs(tmp_path, ranks, kind):
    counter = CountingHook()
    *_, acked_at = _crash_scenario(str(tmp_path / "count"), ranks, counter, kind)
    per_rank = {r for _, op, _, r in counter.points[:acked_at] if op == "write"}
    assert per_rank == set(range(ranks))
    assert acked_at >= 2 * (4 * ranks + 2) and counter.count > acked_at
    cases = Counter()
    for i in crash_points(counter.count, acked_at):
        base = str(tmp_path / f"c{i}")
        hook = CrashAt(i)
        L, acked, target, result, _ = _crash_scenario(base, ranks, ChainHook(hook), kind)
        assert hook.fired is not None, f"point {i} not reached"
        assert (result is not None) == (i >= acked_at), (i, acked_at, result)
        cases[_check_recovered(base, L, acked, target, result)] += 1
    # Each case's check ran, crashes after the result included (a failed store's: rolled back).
    if kind == "child":
        assert cases["acknowledged"] == 3 and cases["published"] and cases["rolled back"], cases
    else:
        assert cases["rolled back"] == len(crash_points(counter.count, acked_at)), cases


@pytest.mark.parametrize("made", [True, False])
def test_a_quarantined_entry_is_durable_in_its_new_directory(tmp_path, monkeypatch, made):
    """A quarantine fsyncs ``lost+found/rankR/`` after the move (where its entry now
    is), and a ``lost+found/`` or ``rankR/`` folder it made in that folder's parent:
    a power loss must not leave the entry in neither directory."""
    rank = LocalRank(0, str(tmp_path / rank_dir_name(0)))
    lf = tmp_path / "lost+found"
    if not made:
        (lf / rank_dir_name(0)).mkdir(parents=True)
    with open(rank.path("junk.txt"), "w") as f:
        f.write("x")
    synced: list[str] = []
    real = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: synced.append(os.readlink(f"/proc/self/fd/{fd}")) or real(fd))
    dest = rank.quarantine("junk.txt")
    assert dest == str(lf / rank_dir_name(0) / "junk.txt") and os.path.exists(dest)
    assert synced[0] == str(lf / rank_dir_name(0))
    assert synced[1:] == ([str(lf), str(tmp_path)] if made else [])
