"""Crash at every effect of an eviction, enumerated (not sampled), on 1 and 2 ranks.

Kinds: a leaf evict, a subtree evict (plain LRU), a snapshot retirement (a compactable
ancestor keeps its segment), a store under pressure whose space check retires a
snapshot and evicts a leaf before the store itself runs, and a batch: one pass whose
victims (a leaf, the parent it leaves a leaf, another leaf) go in one evict
transaction, crashed before its removal commit, after it before any unlink, and
between the unlinks of one victim's files and the next's. The setup pins the oldest
checkpoint, so every policy would take it first if pins were not honoured; in the
store kind the store's parent is fenced. After each crash the directory is reopened:
recovery must leave the audit clean and the journal empty, the pinned and fenced
checkpoints must be untouched, every acknowledged checkpoint that was not a victim must
restore bit-identically, and each victim is wholly there or wholly gone.

The batch kind is also cut by a power loss at each of its points, and once it returned:
the catalog goes back to its last durability point (an evict's reclaim commit is
grouped, ``journal.GROUPED_COMMITS``, and may be lost; its removal may not, once its
unlinks began). The plant ``evict-removal-unsynced`` (the removal grouped too, the
unlinks not waiting for it) brings its victims back damaged there. Under
``synchronous=NORMAL`` the removal is the one commit SQLite syncs (``txn(durable=True)``),
so the reclaim has no barrier commit of its own; the plant ``removal-taken-as-synced``
(the removal written unsynced, the barrier skipped anyway) brings the victims back
damaged there.
"""

from __future__ import annotations

import contextlib
import os
import sqlite3

import pytest
from conftest import Gate, assert_restores, key_at, make_layout, node_at, store_tokens, tokens_for

from prefixstore.base.errors import SimulatedCrash
from prefixstore.base.keys import Prefix
from prefixstore.engine.api import Engine
from prefixstore.engine.catalog import catalog_path
from prefixstore.fuzz import plants
from prefixstore.fuzz.faultfs import ChainHook, CountingHook, CrashAt
from prefixstore.gpu.fileio import FaultHook

CAP = 16 << 20
PINNED = tokens_for(40, 2)
A = tokens_for(41, 8)  # a[:8] (2 blocks) is the interior node, a (8 blocks) its child
B = tokens_for(42, 3)
C = A + tokens_for(43, 3)  # the store under pressure: a child of a (fenced while it runs)
D = tokens_for(44, 3)  # the batch kind's survivor: younger than its victims


def _setup(eng: Engine):
    for t in (PINNED, A[:8], A, B):
        assert store_tokens(eng, t).ok
    m = eng.lookup(Prefix.from_tokens(PINNED, 4))
    assert eng.pin(m)
    return m


def _store_cap(ranks: int, root: str) -> int:
    """A capacity at which storing C needs a retirement and a leaf eviction first."""
    with Engine.open(root, make_layout(ranks=ranks), CAP) as eng:
        _setup(eng)
        charged = eng.account.charged
        need = store_tokens(eng, C).nbytes
    return charged + need - 1


class DurableCatalog(FaultHook):
    """The catalog as a power loss would leave it: its database and log copied at each
    durability point (a commit after which every commit is durable, as the catalog's
    log sync records it, or a sync of the log), put back by ``lose_power``."""

    def __init__(self, root: str) -> None:
        self.root, self.wal, self.saved, self.catalog = root, None, {}, None

    def arm(self, eng: Engine) -> None:
        self.wal, self.catalog = eng.catalog.wal, eng.catalog
        self.save()

    def synced(self) -> bool:
        """Whether the commit just written made every commit durable: under NORMAL,
        whether SQLite synced it (the connection's level), not what the catalog records."""
        if self.catalog.synchronous == "NORMAL":
            return self.catalog.conn.execute("PRAGMA synchronous").fetchone()[0] == 2
        return self.wal.synced == self.wal.written

    def save(self) -> None:
        for suffix in ("", "-wal"):
            path = catalog_path(self.root) + suffix
            with open(path, "rb") as f:
                self.saved[path] = f.read()

    def after(self, op, target, rank):
        if op == "sync" or (op == "commit" and self.synced()):
            self.save()

    def lose_power(self) -> None:
        for path, data in self.saved.items():
            with open(path, "wb") as f:
                f.write(data)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(catalog_path(self.root) + "-shm")


def _scenario(root: str, ranks: int, hook, kind: str, cap: int, armed=None, synchronous: str = "FULL"):
    L = make_layout(ranks=ranks)
    gate = Gate()
    policy = {"subtree": "lru", "batch": "leaf-lru"}.get(kind, "prefixstore")
    eng = Engine.open(root, L, cap, hook=gate, policy=policy, synchronous=synchronous)
    _setup(eng)
    if kind == "batch":
        assert store_tokens(eng, D).ok
        victims = sum(node_at(eng, t).nbytes for t in (A, A[:8], B))
    if armed is not None:
        armed(eng)
    gate.arm(hook)
    try:
        if kind == "leaf":
            eng.evict(prefix=Prefix.from_tokens(B, 4))
        elif kind == "batch":
            assert eng.evict(victims) == victims  # a, then a[:8] (a leaf now), then b
        elif kind in ("subtree", "retire"):
            eng.evict(1)  # the oldest unpinned candidate: a[:8] (its subtree, or its snapshot)
        else:
            store_tokens(eng, C)
    except SimulatedCrash:
        pass
    gate.disarm()
    if not eng.guard.closed:
        eng.close()
    return L, policy


def _check(root: str, L, policy: str, kind: str, cap: int) -> None:
    with Engine.open(root, L, cap, policy=policy) as eng:
        rep = eng.audit()
        assert rep.ok, rep.to_dict()
        assert not eng.catalog.journal()
        pinned = node_at(eng, PINNED)
        assert pinned is not None and pinned.generation == 1 and pinned.has_snapshot
        assert_restores(eng, PINNED, blocks=2)
        present = {k: key_at(t) in eng.index.by_key for k, t in (("mid", A[:8]), ("a", A), ("b", B), ("c", C))}
        if kind == "leaf":
            assert present["mid"] and present["a"]
            assert_restores(eng, A, blocks=8)
        elif kind == "batch":
            assert present["mid"] == present["a"] == present["b"], present  # one transaction: all or none
            assert key_at(D) in eng.index.by_key
            assert_restores(eng, D, blocks=3)
        elif kind == "subtree":
            assert present["mid"] == present["a"], present  # one transaction: both or neither
            assert present["b"]
            assert_restores(eng, B, blocks=3)
        elif kind == "retire":
            assert present["mid"] and present["a"] and present["b"]  # nothing leaves the tree
            mid = node_at(eng, A[:8])
            assert mid.generation in (1, 2) and mid.has_snapshot == (mid.generation == 1)
            assert_restores(eng, B, blocks=3)
        else:
            assert present["mid"] and present["a"], present  # c's ancestors: a was fenced
            if present["c"]:
                assert_restores(eng, C, blocks=11)
        if present["a"]:
            assert_restores(eng, A, blocks=8)  # through a[:8], with or without its snapshot
        if present["b"]:
            assert_restores(eng, B, blocks=3)
    return present


def _power_cut(root: str, point: int | None, synchronous: str = "FULL") -> CrashAt:
    """The batch kind crashed at ``point`` (None: not at all), then a power loss."""
    saver, crash = DurableCatalog(root), CrashAt(point)
    _scenario(root, 1, ChainHook(saver, crash), "batch", CAP, armed=saver.arm, synchronous=synchronous)
    saver.lose_power()
    return crash


def test_power_loss_at_every_point_of_a_batch_loses_at_most_its_reclaim(tmp_path):
    """Its removal is durable before its first unlink; its reclaim commit (grouped) is
    lost with the power after it returned, and recovery reclaims again."""
    counter = CountingHook()
    _scenario(str(tmp_path / "count"), 1, counter, "batch", CAP)
    commits = [(i, t) for i, (w, op, t, _) in enumerate(counter.points) if op == "commit" and w == "after"]
    assert [t for _, t in commits] == ["evict.remove", "evict.reclaimed"], commits
    removed = commits[0][0]  # the point after the removal commit: durable from there on
    L = make_layout()
    for i in [*range(counter.count), None]:
        root = str(tmp_path / f"p{i}")
        crash = _power_cut(root, i)
        assert (crash.fired is None) == (i is None), f"point {i} not reached"
        if i is None:  # returned: the grouped reclaim commit was not durable yet
            with contextlib.closing(sqlite3.connect(catalog_path(root))) as conn:
                assert conn.execute("SELECT kind, state FROM journal").fetchall() == [("evict", "REMOVED")]
        present = _check(root, L, "leaf-lru", "batch", CAP)
        assert present["a"] == (i is not None and i < removed), (i, present)


def test_unlinks_before_the_removal_is_durable_are_caught_by_a_power_loss(tmp_path):
    """The plant ``evict-removal-unsynced``: a power loss after its first unlink takes
    its removal back, and its victims come back damaged."""
    counter = CountingHook()
    _scenario(str(tmp_path / "count"), 1, counter, "batch", CAP)
    first_unlink = next(i for i, (w, op, _, _) in enumerate(counter.points) if op == "unlink" and w == "after")
    root = str(tmp_path / "planted")
    with plants.get("evict-removal-unsynced").active():
        _power_cut(root, first_unlink)
    with pytest.raises(AssertionError):
        _check(root, make_layout(), "leaf-lru", "batch", CAP)
    with Engine.open(root, make_layout(), CAP, policy="leaf-lru") as eng:
        back = [node_at(eng, t) for t in (A, A[:8], B)]
        assert any(n is not None and n.state == "damaged" for n in back), back


def test_under_normal_the_removal_is_synced_and_the_reclaim_needs_no_barrier_commit(tmp_path):
    """Under NORMAL the removal is the commit SQLite syncs (no ``barrier`` commit before
    the unlinks): a power loss at any point, or after the batch returned, never brings a
    victim back damaged, and loses at most the reclaim."""
    counter = CountingHook()
    _scenario(str(tmp_path / "count"), 1, counter, "batch", CAP, synchronous="NORMAL")
    commits = [(i, t) for i, (w, op, t, _) in enumerate(counter.points) if op == "commit" and w == "after"]
    assert [t for _, t in commits] == ["evict.remove", "evict.reclaimed"], commits
    removed = commits[0][0]
    L = make_layout()
    for i in [*range(counter.count), None]:
        root = str(tmp_path / f"p{i}")
        crash = _power_cut(root, i, synchronous="NORMAL")
        assert (crash.fired is None) == (i is None), f"point {i} not reached"
        present = _check(root, L, "leaf-lru", "batch", CAP)
        assert present["a"] == (i is not None and i < removed), (i, present)


def test_a_removal_taken_as_synced_under_normal_is_caught_by_a_power_loss(tmp_path):
    """The plant ``removal-taken-as-synced``: its victims come back damaged."""
    counter = CountingHook()
    _scenario(str(tmp_path / "count"), 1, counter, "batch", CAP, synchronous="NORMAL")
    first_unlink = next(i for i, (w, op, _, _) in enumerate(counter.points) if op == "unlink" and w == "after")
    root = str(tmp_path / "planted")
    with plants.get("removal-taken-as-synced").active():
        _power_cut(root, first_unlink, synchronous="NORMAL")
    with pytest.raises(AssertionError):
        _check(root, make_layout(), "leaf-lru", "batch", CAP)
    with Engine.open(root, make_layout(), CAP, policy="leaf-lru") as eng:
        back = [node_at(eng, t) for t in (A, A[:8], B)]
        assert any(n is not None and n.state == "damaged" for n in back), back


@pytest.mark.parametrize(
    ("kind", "ranks"),
    # the store kind on one rank only: its store part is crashed on 1, 2, 4 ranks in
    # test_crash_store, its retirement and evict parts here on 2
    # the batch kind on one rank: its victims' files on 2 ranks are the leaf kind's
    [(k, r) for k in ("leaf", "subtree", "retire") for r in (1, 2)] + [("store", 1), ("batch", 1)],
)
def test_crash_at_every_effect_of_an_eviction(tmp_path, kind, ranks):
    cap = _store_cap(ranks, str(tmp_path / "probe")) if kind == "store" else CAP
    counter = CountingHook()
    _scenario(str(tmp_path / "count"), ranks, counter, kind, cap)
    ops = {op for _, op, _, _ in counter.points}
    assert {"unlink", "fsync_dir", "commit"} <= ops, ops
    if kind == "batch":  # one removal commit, then every victim's files unlinked
        labels = [t for _, op, t, _ in counter.points if op == "commit"]
        assert labels.count("evict.remove") == 2, labels  # its before and after points
        assert [op for _, op, _, _ in counter.points].count("unlink") == 2 * 3 * ranks
    if kind in ("retire", "store"):
        assert {"read", "write", "fsync", "rename"} <= ops, ops
    for i in range(counter.count):
        root = str(tmp_path / f"c{i}")
        hook = CrashAt(i)
        L, policy = _scenario(root, ranks, hook, kind, cap)
        assert hook.fired is not None, f"point {i} not reached"
        _check(root, L, policy, kind, cap)


def test_uninterrupted_store_under_pressure_retires_then_evicts(tmp_path):
    cap = _store_cap(1, str(tmp_path / "probe"))
    L, _ = _scenario(str(tmp_path / "run"), 1, CountingHook(), "store", cap)
    with Engine.open(str(tmp_path / "run"), L, cap) as eng:
        assert key_at(C) in eng.index.by_key
        mid = node_at(eng, A[:8])
        assert not mid.has_snapshot  # the oldest unpinned candidate was retired
        assert key_at(B) not in eng.index.by_key  # and the oldest leaf went
        assert key_at(PINNED) in eng.index.by_key
        assert eng.audit().ok


@pytest.mark.parametrize("kind", ["subtree", "retire", "batch"])
def test_crash_during_recovery_of_an_eviction_is_recovered(tmp_path, kind):
    """Crash an eviction after its first commit (a batch: after its removal commit,
    before any victim's unlink), then crash recovery at each point."""
    L = make_layout()
    policy = {"subtree": "lru", "batch": "leaf-lru"}.get(kind, "prefixstore")
    first = 7 if kind == "retire" else 1  # inside the retirement's writes / after evict.remove
    n = 0
    while True:
        root = str(tmp_path / f"r{n}")
        _scenario(root, 1, CrashAt(first), kind, CAP)
        hook = CrashAt(n)
        with contextlib.suppress(SimulatedCrash):
            Engine.open(root, L, CAP, policy=policy, hook=hook).close()
        _check(root, L, policy, kind, CAP)
        if hook.fired is None:
            break
        n += 1
    assert n >= 1
