"""One edited catalog value never destroys an intact node (DESIGN.md section 9).

The two-rank tree of ``test_hostile`` is built, then one value of the catalog is
edited while no engine runs: ``meta.backing`` set to ``memory`` on a disk cache; a
ready node's live file row set to ``garbage`` or ``writing``, deleted, given another
node, or pointed at an unfinished INTENT or PUBLISHED journal row (left by a crash);
a live row given a negative size. Every shard file stays intact.

For each: the audit reports it (exit 1) and changes nothing; opening an engine either
refuses with a typed error (nothing changed) or keeps every node and serves it
bit-identically, with exact accounting; ``audit --repair`` returns the directory to a
clean audit, and every node still restores bit-identically afterwards.
"""

from __future__ import annotations

import contextlib
import os
import shutil

import pytest
from conftest import Gate, store_tokens, tokens_for
from test_hostile import (
    CAP,
    TREE,
    L,
    audit_json,
    build,
    node_id,
    served_bytes_are_right,
    sql,
    tree_hash,
)

from prefixstore.base import errors as E
from prefixstore.engine.api import Engine
from prefixstore.fuzz.faultfs import CrashAt

VICTIM = "A4"  # whose rank-1 row is edited
NEW = tokens_for(9, 3)  # a store that crashes before it publishes


def _victim_row(root: str) -> str:
    return f"node={node_id(root, VICTIM)} AND rank=1 AND status='live'"


def _crashed_store(root: str, tokens: list[int], op: str) -> int:
    """Run a store of ``tokens`` that crashes at its first ``op``; return its journal row."""
    gate = Gate()
    eng = Engine.open(root, L, CAP, hook=gate)
    gate.arm(CrashAt(0, ops=[op]))
    with contextlib.suppress(E.SimulatedCrash):
        store_tokens(eng, tokens)
    gate.disarm()
    if not eng.guard.closed:
        eng.close()
    (tid,) = sql(root, "SELECT max(id) FROM journal")[0]
    assert tid is not None, "the crash left no unfinished transaction"
    return tid


def _backing_memory(root):
    sql(root, "INSERT OR REPLACE INTO meta VALUES('backing', 'memory')")


def _row_garbage(root):
    sql(root, f"UPDATE files SET status='garbage' WHERE {_victim_row(root)}")


def _row_writing(root):
    sql(root, f"UPDATE files SET status='writing' WHERE {_victim_row(root)}")


def _row_deleted(root):
    sql(root, f"DELETE FROM files WHERE {_victim_row(root)}")


def _row_other_node(root):
    sql(root, f"UPDATE files SET node=? WHERE {_victim_row(root)}", (node_id(root, "B3"),))


def _row_generation_column(root):
    sql(root, f"UPDATE files SET generation=3 WHERE {_victim_row(root)}")


def _row_renamed(root):
    sql(root, f"UPDATE files SET name=? WHERE {_victim_row(root)}", (f"{'ef' * 16}-g1.st",))


def _row_intent_txn(root):
    tid = _crashed_store(root, NEW, "write")  # INTENT: its files are 'writing'
    assert sql(root, "SELECT state FROM journal WHERE id=?", (tid,))[0][0] == "INTENT"
    sql(root, f"UPDATE files SET txn=? WHERE {_victim_row(root)}", (tid,))


def _row_published_txn(root):
    sql(root, "UPDATE nodes SET state='damaged' WHERE id=?", (node_id(root, "D2"),))
    tid = _crashed_store(root, TREE["D2"], "unlink")  # the refill published, then died retiring
    assert sql(root, "SELECT state FROM journal WHERE id=?", (tid,))[0][0] == "PUBLISHED"
    sql(root, f"UPDATE files SET txn=? WHERE {_victim_row(root)}", (tid,))


def _row_negative_size(root):
    sql(root, f"UPDATE files SET size=? WHERE {_victim_row(root)}", (-(CAP * 4),))


CASES = {
    "backing-memory-on-a-disk-cache": _backing_memory,
    "live-row-set-to-garbage": _row_garbage,
    "live-row-set-to-writing": _row_writing,
    "live-row-deleted": _row_deleted,
    "live-row-given-another-node": _row_other_node,
    "live-row-given-another-generation": _row_generation_column,
    "live-row-given-another-name": _row_renamed,
    "live-row-pointed-at-an-intent-txn": _row_intent_txn,
    "live-row-pointed-at-a-published-txn": _row_published_txn,
    "live-row-negative-size": _row_negative_size,
}


def shard_bytes(root: str) -> int:
    return sum(os.path.getsize(os.path.join(root, f"rank{r}", n))
               for r in range(L.ranks) for n in os.listdir(os.path.join(root, f"rank{r}")))


def all_served(root: str) -> None:
    """Every node of the tree restores bit-identically; accounting is exact and clean."""
    with Engine.open(root, L, CAP) as eng:
        for lbl, toks in TREE.items():
            assert served_bytes_are_right(eng, toks) == len(toks) // 4, lbl
        rep = eng.audit()
        assert rep.ok, rep.to_dict()
        assert eng.account.charged == shard_bytes(root) <= CAP
        assert not eng.catalog.query("SELECT 1 FROM nodes WHERE state!='ready'")


@pytest.mark.parametrize("case", sorted(CASES))
def test_one_edited_catalog_value_never_destroys_an_intact_node(tmp_path, case, capsys):
    root, fresh = str(tmp_path / "cache"), str(tmp_path / "fresh")
    build(root)
    CASES[case](root)
    shutil.copytree(root, fresh)

    # 1. the audit reports it and changes nothing
    before = tree_hash(str(tmp_path))
    rc, rep = audit_json(root, capsys=capsys)
    assert rc == 1 and not rep["ok"] and rep["violations"], rep
    assert tree_hash(str(tmp_path)) == before

    # 2. an engine refuses (typed, nothing changed) or keeps and serves every node
    try:
        all_served(root)
    except E.CatalogCorruptError as exc:
        assert "audit --repair" in str(exc)
        assert tree_hash(str(tmp_path)) == before

    # 3. repair gives a clean audit (also of the copy no engine opened); nothing is lost
    rc, rep = audit_json(fresh, "--repair", capsys=capsys)
    assert rc == 0 and rep["ok"], rep
    assert rep["repair"]["changed"], rep["repair"]
    rc, rep = audit_json(root, "--repair", capsys=capsys)
    assert rc == 0 and rep["ok"], rep
    for d in (fresh, root):
        rc, rep = audit_json(d, capsys=capsys)
        assert rc == 0, rep
        all_served(d)


def test_a_rowless_file_under_a_current_shard_name_that_does_not_verify_is_moved_aside(tmp_path, capsys):
    """The row is gone and the file under its name holds another node's bytes: recovery
    moves it to lost+found/ (never unlinks it); the node is damaged, a refill serves it."""
    root = str(tmp_path / "cache")
    build(root)
    name = sql(root, f"SELECT name FROM files WHERE {_victim_row(root)}")[0][0]
    other = sql(root, "SELECT name FROM files WHERE node=? AND rank=1", (node_id(root, "D2"),))[0][0]
    _row_deleted(root)
    path = os.path.join(root, "rank1", name)
    with open(os.path.join(root, "rank1", other), "rb") as f:
        foreign = f.read()
    with open(path, "wb") as f:
        f.write(foreign)
    rc, rep = audit_json(root, capsys=capsys)
    assert rc == 1 and any(name in v["detail"] for v in rep["violations"]), rep
    with Engine.open(root, L, CAP) as eng:
        assert f"rank1/{name}" in eng.recovery_report.quarantined
        with open(os.path.join(root, "lost+found", "rank1", name), "rb") as f:
            assert f.read() == foreign
        assert not os.path.exists(path)
        assert served_bytes_are_right(eng, TREE[VICTIM]) < len(TREE[VICTIM]) // 4
        assert store_tokens(eng, TREE[VICTIM]).ok  # a refill
    all_served(root)


def test_backing_memory_over_shards_on_disk_is_refused_by_name(tmp_path):
    root = str(tmp_path / "cache")
    build(root)
    _backing_memory(root)
    before = tree_hash(str(tmp_path))
    for backing in ("disk", "memory", "composite"):
        with pytest.raises(E.BackingContradictionError, match=r"backing=memory.* 12 shard files .*rank0/"):
            Engine.open(root, L, CAP, backing=backing)
    assert tree_hash(str(tmp_path)) == before
