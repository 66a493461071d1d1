"""A rebuild of the catalog from the shards' headers through rank servers
(``repair(..., ranks=..., rebuild_catalog=True)``, i.e. ``audit --ranks ... --repair
--rebuild``) SIGKILLed at each of its effects.

The cache (two ranks, each on its own "host"): acknowledged stores (a chain of two and a
conversation of its own); a checkpoint P whose rank-1 shard was lost, below which C is
stored whole (P is kept as C's damaged ancestor); V, whose rank-1 shard is cut short, and
W, whose rank-1 header is corrupt (both quarantined on both ranks); on rank 1 an orphan
that is no shard, a temporary of a live shard and a foreign file. Its catalog still
reads (the engine that wrote it was SIGKILLed: its log and index lie beside it), or, in the
second variant, is lost (emptied). A forked child runs the coordinator and both rank servers (threads) and SIGKILLs
itself at one effect point of the repair: a rank server's quarantine rename or directory
fsync, the move of
the old catalog into ``lost+found/catalog-N/``, the fsync of that directory, of
``lost+found/`` or of the cache's root, a catalog commit or log sync, or an
effect of the recovery that follows. What comes next (the rebuild again, or an open of
the catalog it committed) must then reach what an uninterrupted rebuild reaches: the
same rows, a clean audit, every acknowledged store restoring bit for bit, every rank
directory holding exactly the files the catalog names, and every entry that was there
before (none unlinked) in its rank directory or in ``lost+found/``.

CI kills at five points of each variant (``ci_points`` and the last point);
``PREFIXSTORE_MULTIHOST_FULL=1`` at every point (34 and 30, each before and after its effect). After a kill before the rebuilt
catalog's commit the rebuild runs again; after it, the engine opens that catalog as it is.
A power loss (each rank directory, the cache's root and ``lost+found/catalog-N/`` back to
their last fsync) after the commit, or after the rebuild returned, changes none of that.
"""

from __future__ import annotations

import functools
import json
import os
import re
import signal

import pytest
from conftest import (
    BT,
    KillAt,
    assert_restores,
    host_rank_dir,
    key_at,
    killed_points,
    make_layout,
    report_points,
    report_quarantines,
    run_killed,
    serve_rank,
    store_tokens,
    tokens_for,
)

from prefixstore.base.keys import Prefix
from prefixstore.engine.api import Engine
from prefixstore.engine.repair import repair
from prefixstore.fuzz import plants
from prefixstore.gpu.distributed import RankGroup
from prefixstore.gpu.ranks import LocalRank, shard_name

CAP = 16 << 20
FULL = os.environ.get("PREFIXSTORE_MULTIHOST_FULL") == "1"
A = tokens_for(71, 4)
ACKED = [A[:8], A, tokens_for(72, 3)]
P = tokens_for(73, 2)
C = P + tokens_for(74, 2)
V, W = tokens_for(75, 2), tokens_for(76, 2)
ORPHAN = "e" * 32 + "-g1.st"
FOREIGN = "notes.txt"
LAYOUT = make_layout(ranks=2)


def name_of(tokens: list[int]) -> str:
    return shard_name(key_at(tokens), 1)


def store_then_die(root: str, base: str, out: int) -> None:
    """A child: the stores of the module docstring, then SIGKILL (the catalog's log stays beside it)."""
    eng = Engine.open(root, LAYOUT, CAP, ranks=[LocalRank(r, host_rank_dir(base, r)) for r in range(2)])
    for t in [*ACKED, P, C, V, W]:
        assert store_tokens(eng, t).status == "stored"
    os.kill(os.getpid(), signal.SIGKILL)


def build(base: str, lost: bool = False) -> str:
    """The cache of the module docstring, closed; its root. ``lost``: its catalog emptied
    (0 bytes, no log): the rebuild takes the layout and the capacity from the shards."""
    root = os.path.join(base, "cache")
    run_killed(functools.partial(store_then_die, root, base), [])
    assert os.path.getsize(os.path.join(root, "catalog.sqlite-wal")) > 0
    if lost:
        for suffix in ("-wal", "-shm"):
            os.unlink(os.path.join(root, "catalog.sqlite" + suffix))
        os.truncate(os.path.join(root, "catalog.sqlite"), 0)
    one = host_rank_dir(base, 1)
    os.unlink(os.path.join(one, name_of(P)))
    path = os.path.join(one, name_of(V))
    os.truncate(path, os.path.getsize(path) - 8)
    with open(os.path.join(one, name_of(W)), "r+b") as f:
        f.write(b"\xff" * 16)
    for entry, data in ((ORPHAN, b"o" * 100), (name_of(A) + ".tmp", b"t" * 50), (FOREIGN, b"not a shard")):
        with open(os.path.join(one, entry), "wb") as f:
            f.write(data)
    return root


class Durable(KillAt):
    """``KillAt`` that also records each rank directory's listing once its fsync returned
    (``durable{R}.json`` in ``base``): what a power loss leaves of it."""

    def __init__(self, spec: list | None, base: str) -> None:
        super().__init__(spec)
        self.base = base

    def after(self, op: str, target: str, rank: int | None) -> None:
        if op == "fsync_dir" and rank is not None and os.path.basename(target) == f"rank{rank}":
            record_durable(self.base, rank)
        elif op == "fsync_dir" and rank is None:
            record_durable_dir(self.base, target)
        super().after(op, target, rank)


def record_durable(base: str, r: int) -> None:
    with open(os.path.join(base, f"durable{r}.json"), "w") as f:
        json.dump(sorted(os.listdir(host_rank_dir(base, r))), f)


def lose_power(base: str) -> None:
    """Each rank directory as a power loss leaves it: an entry moved into ``lost+found/``
    since its directory's last fsync is back."""
    for r in range(2):
        with open(os.path.join(base, f"durable{r}.json")) as f:
            durable = json.load(f)
        d, found = host_rank_dir(base, r), os.path.join(base, f"host{r}", "lost+found", f"rank{r}")
        for name in sorted(set(durable) - set(os.listdir(d))):
            if os.path.lexists(os.path.join(found, name)):
                os.rename(os.path.join(found, name), os.path.join(d, name))


def record_durable_dir(base: str, path: str) -> None:
    """The entries (name: inode) of a directory of the cache (its root, ``lost+found/``,
    ``lost+found/catalog-N/``) once its fsync returned, in ``durable-dirs.json``."""
    where = os.path.join(base, "durable-dirs.json")
    durable = {}
    if os.path.exists(where):
        with open(where) as f:
            durable = json.load(f)
    listing = {e: os.lstat(os.path.join(path, e)).st_ino for e in os.listdir(path)}
    durable[os.path.relpath(path, os.path.join(base, "cache"))] = listing
    with open(where, "w") as f:
        json.dump(durable, f)


def lose_power_at_root(base: str, root: str) -> None:
    """The cache's root and each ``lost+found/catalog-N/`` as a power loss leaves them:
    as their last fsync (``record_durable_dir``) left them (the tree ``build`` left
    counts as durable; a directory's own entry once made, as in ``fuzz/faultfs.py``).
    In the root, a file made or moved in since is gone, one moved out since (into
    ``catalog-N/``) is back under its name; in ``catalog-N/`` a file moved in since is
    gone. One unlinked since (the log and index SQLite checkpointed and removed at
    close) is not brought back: its bytes are gone here, and the database holds its
    frames. SQLite fsyncs the root itself when it first syncs a new catalog's journal
    (3.40 here, ``synchronous=FULL``) but ignores a failure of that fsync: the model
    counts only the engine's own directory fsyncs (reported to the hook)."""
    with open(os.path.join(base, "durable-dirs.json")) as f:
        durable = json.load(f)
    lf = os.path.join(root, "lost+found")
    moved = [os.path.join(lf, d) for d in sorted(os.listdir(lf)) if d.startswith("catalog-")]
    kept = durable["."]
    for name in sorted(os.listdir(root)):
        path = os.path.join(root, name)
        if not os.path.isdir(path) and kept.get(name) != os.lstat(path).st_ino:
            os.unlink(path)
    where = {os.lstat(os.path.join(d, e)).st_ino: os.path.join(d, e) for d in moved for e in os.listdir(d)}
    for name, ino in sorted(kept.items()):
        if not os.path.lexists(os.path.join(root, name)) and ino in where:
            os.rename(where[ino], os.path.join(root, name))
    for d in moved:
        synced = durable.get(os.path.relpath(d, root), {})
        for name in sorted(os.listdir(d)):
            if synced.get(name) != os.lstat(os.path.join(d, name)).st_ino:
                os.unlink(os.path.join(d, name))


def rebuild_child(base: str, root: str, spec: list | None, out: int) -> None:
    """The child: both rank servers up, the repair with ``--rebuild`` through them, the
    points armed; writes the points seen to ``out``."""
    hook = Durable(spec, base)
    report_quarantines(hook)
    group = RankGroup(op_timeout=5, connect_timeout=10, gloo_host="127.0.0.1")
    for r in range(2):
        serve_rank(base, r, group.port, hook)
    ranks = group.connect(range(2), timeout=20)
    hook.armed = True
    fix, rep = repair(root, ranks=ranks, rebuild_catalog=True, hook=hook)
    hook.armed = False
    assert fix.rebuilt is not None and rep.ok, rep.to_dict()
    report_points(out, hook)
    for rr in ranks:
        rr.close()
    group.close()


def run_child(base: str, root: str, spec: list | None) -> str:
    return run_killed(functools.partial(rebuild_child, base, root, spec), spec)


def entries(base: str) -> dict[int, list[str]]:
    """Each rank's entries, in its directory or (the collision suffix dropped) in ``lost+found/``."""
    out = {}
    for r in range(2):
        found = os.path.join(base, f"host{r}", "lost+found", f"rank{r}")
        moved = [re.sub(r"\.\d+$", "", e) for e in (os.listdir(found) if os.path.isdir(found) else [])]
        out[r] = sorted(os.listdir(host_rank_dir(base, r)) + moved)
    return out


def reopened(base: str, root: str, before: dict[int, list[str]]) -> tuple:
    """A fresh open with both ranks up; the checks of the module docstring. Returns the
    rows (nodes' keys and states, file rows) for comparison between runs."""
    with Engine.open(root, LAYOUT, CAP, ranks=[LocalRank(r, host_rank_dir(base, r)) for r in range(2)]) as eng:
        rep = eng.audit()
        assert rep.ok and not rep.notes, rep.to_dict()
        assert not eng.catalog.journal()
        for t in ACKED:
            assert_restores(eng, t)
        for t in (P, C, V, W):  # P damaged (C below it not served), V and W gone
            assert not eng.lookup(Prefix.from_tokens(t, BT)).hit, t
        assert eng.stats()["garbage_bytes"] == 0
        assert eng.account.charged == eng.catalog.charged()
        for r in range(2):
            names = sorted(n for (n,) in eng.catalog.query("SELECT name FROM files WHERE rank=?", (r,)))
            assert sorted(os.listdir(host_rank_dir(base, r))) == names, r
        nodes = sorted(tuple(r) for r in eng.catalog.query("SELECT key, state FROM nodes"))
        files = sorted(tuple(r) for r in eng.catalog.query("SELECT rank, name, status, size, checksum FROM files"))
    assert entries(base) == before  # nothing unlinked, nothing moved twice
    old = [d for d in os.listdir(os.path.join(root, "lost+found")) if d.startswith("catalog-")]
    assert any("catalog.sqlite" in os.listdir(os.path.join(root, "lost+found", d)) for d in old), old
    states = dict(nodes)
    assert states[key_at(P)] == "damaged" and states[key_at(C)] == "ready", states
    assert key_at(V) not in states and key_at(W) not in states, states
    return nodes, files


COMMIT = ["after", "commit", "repair.rebuild", None, 0]


def ci_points() -> list[list]:
    """CI's points: V's rank-1 shard quarantined and its rank-0 one not yet; the old
    catalog's main file moved and its log not yet; just before and just after the
    rebuild's commit (the last point of the run is added by the test)."""
    return [["after", "rename", name_of(V), 1, 0], ["after", "rename", "catalog.sqlite", None, 0],
            ["before", *COMMIT[1:]], COMMIT]


def killed_then_redone(base: str, root: str, kill: list, committed: bool) -> None:
    """The child SIGKILLed at ``kill``, then what an operator does next: the rebuild
    again, unless ``committed`` (the rebuilt catalog committed: the engine opens it as it is)."""
    run_child(base, root, kill)
    if not committed:
        run_child(base, root, None)


@pytest.mark.parametrize("lost", [False, True], ids=["readable-catalog", "lost-catalog"])
def test_rebuild_through_rank_servers_killed_at_each_effect(tmp_path, lost):
    """The child SIGKILLed at each point (CI: ``ci_points`` and the last one; with
    ``PREFIXSTORE_MULTIHOST_FULL=1``: every point, each before and after its effect);
    after each, ``killed_then_redone`` leaves what an uninterrupted rebuild leaves (``reopened``)."""
    base = str(tmp_path / "count")
    root = build(base, lost)
    before = entries(base)
    points = killed_points(run_child(base, root, None))
    assert (["before", "rename", "catalog.sqlite-wal", None, 0] in points) is not lost, points
    quarantines = [sum(p[1] == "rename" and p[3] == r for p in points) for r in range(2)]
    assert quarantines == [2 * 2, 2 * 5], points  # V's and W's shards; and the orphan, temporary, foreign file
    want = reopened(base, root, before)
    chosen = points if FULL else [*ci_points(), points[-1]]
    assert all(p in points for p in chosen), points
    for i, kill in enumerate(chosen):
        base = str(tmp_path / f"kill{i}")
        root = build(base, lost)
        killed_then_redone(base, root, kill, points.index(kill) >= points.index(COMMIT))
        assert reopened(base, root, before) == want, kill


def test_a_rebuild_that_quarantines_after_its_commit_is_caught(tmp_path):
    """The plant ``rebuild-quarantine-after-commit``, killed just after the rebuild's
    commit: the next open finds the rejected shards beside a catalog that does not name
    them and unlinks them."""
    base = str(tmp_path / "cache")
    with plants.get("rebuild-quarantine-after-commit").active():
        root = build(base)
        before = entries(base)
        killed_then_redone(base, root, COMMIT, True)
    with Engine.open(root, LAYOUT, CAP, ranks=[LocalRank(r, host_rank_dir(base, r)) for r in range(2)]):
        pass
    lost = {r: sorted(set(before[r]) - set(e)) for r, e in entries(base).items()}
    assert lost[0] == sorted([name_of(V), name_of(W)]), lost  # V's and W's intact rank-0 shards, unlinked


def test_a_power_loss_after_the_rebuild_commits_keeps_what_it_quarantined(tmp_path):
    """Killed just after the rebuilt catalog's commit, then a power loss: each rank
    directory is as its last fsync left it. The rebuild makes its quarantines durable
    before it commits (a fsync of each rank directory it moved entries out of), so no
    rejected shard is back beside a catalog that does not name it (where the next open
    would unlink it as an orphan), and fsyncs the root before its commit (the cache's
    root and ``lost+found/catalog-N/`` are taken back too, ``lose_power_at_root``): the
    open after it leaves what an uninterrupted rebuild leaves."""
    base = str(tmp_path / "count")
    root = build(base)
    before = entries(base)
    run_child(base, root, None)
    want = reopened(base, root, before)
    root = returned_then_power_lost(str(tmp_path / "cache"), at=COMMIT)
    assert reopened(str(tmp_path / "cache"), root, before) == want


def returned_then_power_lost(base: str, lost: bool = False, at: list | None = None) -> str:
    """``build``, the rebuild run to its end (it returns) or killed at point ``at``, then a
    power loss: each rank directory and the cache's root (with ``lost+found/catalog-N/``)
    as their last fsync left them (``lose_power``, ``lose_power_at_root``). The cache's
    root."""
    root = build(base, lost)
    for r in range(2):
        record_durable(base, r)
    record_durable_dir(base, root)
    run_child(base, root, at)
    lose_power(base)
    lose_power_at_root(base, root)
    return root


@pytest.mark.parametrize("lost", [False, True], ids=["readable-catalog", "lost-catalog"])
def test_a_power_loss_after_the_rebuild_returned_keeps_the_rebuilt_catalog(tmp_path, lost):
    """The rebuild returned (the repair reported success), then a power loss
    (``returned_then_power_lost``). The rebuild fsyncs ``lost+found/catalog-N/``
    and ``lost+found/`` once it moved the old catalog there, and the root once the new
    catalog exists, before its commit: the old catalog's names do not come back, its
    files are kept, and the new one's entry is not lost. The next open finds the rebuilt catalog as
    an uninterrupted run leaves it, and the old one in ``lost+found/``."""
    base = str(tmp_path / "count")
    root = build(base, lost)
    before = entries(base)
    run_child(base, root, None)
    want = reopened(base, root, before)
    base = str(tmp_path / "cache")
    root = returned_then_power_lost(base, lost)
    assert reopened(base, root, before) == want


def test_a_rebuild_that_leaves_the_root_unsynced_is_caught(tmp_path):
    """The plant ``rebuild-root-unsynced``: after the power loss the old catalog (its
    log and index too) is back in the root in place of the rebuilt one, and the next open
    takes it: V and W, which the rebuild moved to ``lost+found/`` on both ranks, are
    rows again (damaged), and ``lost+found/catalog-1/`` is empty."""
    base = str(tmp_path / "cache")
    with plants.get("rebuild-root-unsynced").active():
        root = returned_then_power_lost(base)
    assert {"catalog.sqlite", "catalog.sqlite-wal"} <= set(os.listdir(root))
    with Engine.open(root, LAYOUT, CAP, ranks=[LocalRank(r, host_rank_dir(base, r)) for r in range(2)]) as eng:
        states = dict(eng.catalog.query("SELECT key, state FROM nodes"))
    assert states[key_at(V)] == states[key_at(W)] == "damaged", states
    assert not os.listdir(os.path.join(root, "lost+found", "catalog-1")), "the old catalog's files are back"
