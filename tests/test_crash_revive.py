"""A rank's deferred recovery (``recovery.recover_rank``, run when a rank that was down
at ``Engine.open`` serves again) SIGKILLed at each of its effects.

The cache: two acknowledged stores; a store that died before its publish (its shard on
rank 1 becomes garbage when the degraded open rolls it back); on rank 1 an orphan
shard, a leftover temporary of a live shard and a foreign file; three sacrificial
checkpoints whose rank-1 part is wrong (V's shard cut short, W's row lost and its header
corrupt, X's row lost, its bytes intact). A forked child runs the coordinator and both
rank servers (threads): it opens degraded without rank 1, starts rank 1's server and
brings it back (``reconnect_ranks``), and SIGKILLs itself at one effect point of the
revival: a catalog commit or log sync of the coordinator, or an unlink, fsync of a
directory or quarantine rename (``LocalRank.quarantine``, reported here as ``rename``)
in a rank server. A fresh ``Engine.open`` with both ranks up must then leave the audit
clean, the acknowledged stores restoring bit for bit, the sacrificial ones restoring
bit for bit or missing, no file the catalog does not name, an empty journal, the
charged bytes the catalog's, and the same rows as after a revival that was not killed.

CI kills at four points; ``PREFIXSTORE_MULTIHOST_FULL=1`` at every point.
"""

from __future__ import annotations

import functools
import os
import sqlite3

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

from prefixstore.base.errors import SimulatedCrash
from prefixstore.base.keys import Prefix
from prefixstore.engine import lifecycle
from prefixstore.engine.api import Engine
from prefixstore.gpu.distributed import RankGroup
from prefixstore.gpu.fileio import FaultHook
from prefixstore.gpu.ranks import LocalRank, shard_name

CAP = 16 << 20
FULL = os.environ.get("PREFIXSTORE_MULTIHOST_FULL") == "1"
A = tokens_for(61, 4)
ACKED = [(A[:8], 2), (A, 4), (tokens_for(62, 3), 3)]
V, W, X = tokens_for(63, 2), tokens_for(64, 2), tokens_for(65, 2)
LOST = tokens_for(66, 2)  # the store that dies before its publish
ORPHAN = "f" * 32 + "-g1.st"
FOREIGN = "notes.txt"


def name_of(tokens: list[int]) -> str:
    return shard_name(key_at(tokens), 1)


class CrashBeforePublish(FaultHook):
    """Process death just before a store's publish commit (every shard written), once armed."""

    armed = False

    def before(self, op: str, target: str, rank: int | None) -> None:
        if self.armed and op == "commit" and target == "store.publish":
            self.armed = False
            raise SimulatedCrash(target)


def build(base: str) -> str:
    """The cache described in the module docstring, closed; its root."""
    root = os.path.join(base, "cache")
    hook = CrashBeforePublish()
    ranks = [LocalRank(r, host_rank_dir(base, r)) for r in range(2)]
    eng = Engine.open(root, make_layout(ranks=2), CAP, hook=hook, ranks=ranks)
    for t in [*(t for t, _ in ACKED), V, W, X]:
        assert store_tokens(eng, t).status == "stored"
    hook.armed = True
    with pytest.raises(SimulatedCrash):
        store_tokens(eng, LOST)
    lifecycle.abandon(eng.life)
    one = host_rank_dir(base, 1)
    path = os.path.join(one, name_of(V))
    os.truncate(path, os.path.getsize(path) - 8)
    with open(os.path.join(one, name_of(W)), "r+b") as f:
        f.write(b"\xff" * 16)  # its header: it no longer reads as W's shard
    with sqlite3.connect(os.path.join(root, "catalog.sqlite")) as db:
        for t in (W, X):
            db.execute("DELETE FROM files WHERE rank=1 AND name=?", (name_of(t),))
    db.close()
    for entry, data in ((ORPHAN, b"o" * 100), (name_of(A) + ".tmp", b"t" * 50), (FOREIGN, b"not a shard")):
        with open(os.path.join(one, entry), "wb") as f:
            f.write(data)
    return root


def revive(base: str, root: str, spec: list | None, out: int) -> None:
    """The child: open degraded without rank 1, bring it back with the points armed;
    writes the points seen to ``out``."""
    hook = KillAt(spec)
    report_quarantines(hook)
    group = RankGroup(op_timeout=5, connect_timeout=10, gloo_host="127.0.0.1")
    serve_rank(base, 0, group.port, hook)
    ranks = [*group.connect([0], timeout=20), group.remote(1)]
    eng = Engine.open(root, make_layout(ranks=2), CAP, hook=hook, ranks=ranks)
    assert eng.degraded is not None and eng.degraded.ranks == (1,), eng.degraded
    serve_rank(base, 1, group.port, hook)
    hook.armed = True
    left = eng.reconnect_ranks(20)
    hook.armed = False
    assert left == (), left
    report_points(out, hook)
    eng.close()
    group.close()


def run_child(base: str, root: str, spec: list | None) -> str:
    return run_killed(functools.partial(revive, base, root, spec), spec)


def rank_files(eng: Engine, r: int) -> list[str]:
    return sorted(n for (n,) in eng.catalog.query("SELECT name FROM files WHERE rank=?", (r,)))


def reopened(base: str, root: str) -> tuple:
    """A fresh open with both ranks up; the checks of the module docstring. Returns the
    rows (nodes' keys and statuses, file rows) for comparison between runs."""
    with Engine.open(root, make_layout(ranks=2), CAP, ranks=[LocalRank(r, host_rank_dir(base, r)) for r in range(2)]) as eng:
        rep = eng.audit()
        assert rep.ok, rep.to_dict()
        assert not eng.catalog.journal()
        for t, blocks in ACKED:
            assert_restores(eng, t, blocks=blocks)
        for t in (V, W, X, LOST):
            m = eng.lookup(Prefix.from_tokens(t, BT))
            if m.hit and eng.restore(m) is not None:
                assert t is not LOST
                assert_restores(eng, t, blocks=m.blocks)
        assert eng.stats()["garbage_bytes"] == 0
        assert eng.account.charged == eng.catalog.charged()
        for r in range(2):
            assert sorted(os.listdir(host_rank_dir(base, r))) == rank_files(eng, r), r
        found = os.listdir(os.path.join(base, "host1", "lost+found", "rank1"))
        assert FOREIGN in found and name_of(W) in found, found
        nodes = sorted(tuple(r) for r in eng.catalog.query("SELECT key, state FROM nodes"))
        files = sorted(tuple(r) for r in eng.catalog.query("SELECT rank, name, status, size, checksum FROM files"))
        return nodes, files


CI_POINTS = [
    ["after", "rename", name_of(W), 1, 0],  # W's corrupt shard quarantined, nothing committed
    ["after", "commit", "recover.reconcile", None, 0],  # X re-attached, the garbage not reclaimed
    ["after", "unlink", name_of(LOST), 1, 0],  # the garbage unlinked, its row not deleted
    ["before", "commit", "recover.invalidate", None, 0],  # the orphans gone, V not yet damaged
]


def test_revival_killed_at_each_effect(tmp_path):
    """The child SIGKILLed at effects of ``recover_rank`` (CI: ``CI_POINTS``; with
    ``PREFIXSTORE_MULTIHOST_FULL=1``: every point, each before and after its effect);
    after each, a fresh open with both ranks up passes the checks of ``reopened`` and
    holds the rows a revival that was not killed leaves."""
    base = str(tmp_path / "count")
    out = run_child(base, build(base), None)
    points = killed_points(out)
    ops = {p[1] for p in points}
    assert {"rename", "unlink", "fsync_dir", "commit"} <= ops, points
    want = reopened(base, os.path.join(base, "cache"))
    chosen = points if FULL else CI_POINTS
    assert all(p in points for p in chosen), points
    for i, kill in enumerate(chosen):
        base = str(tmp_path / f"kill{i}")
        root = build(base)
        run_child(base, root, kill)
        assert reopened(base, root) == want, kill
