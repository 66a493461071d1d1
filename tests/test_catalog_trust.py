"""A catalog is trusted only as the schema the engine made (DESIGN.md section 9).

Lost catalogs: an empty (0-byte), missing, schema-less or emptied catalog beside the
two-rank tree of ``test_hostile`` is refused by ``Engine.open`` with a typed error
naming what the directory holds (before, recovery unlinked every shard as an orphan),
``audit`` refuses it (exit 2), and ``audit --repair`` rebuilds the catalog from the
shards' own headers: every intact checkpoint restores bit for bit, what does not
verify is in ``lost+found/``, nothing is unlinked. What a first open leaves before its
schema (``LOCK``, an empty catalog, empty own directories) still opens as a new cache.

Planted schema objects: a trigger on ``meta`` that deletes the rows, a trigger on
``journal`` that marks files garbage, a trigger that raises, a view in place of
``files``, an extra index, an altered table. ``Engine.open`` refuses each with
``ForeignSchemaError`` naming it and nothing changes; ``audit`` reports it (exit 1);
``audit --repair`` drops it (or says why it cannot without losing rows, and
``--rebuild`` then rebuilds); one planted under a running engine stops its next
catalog access with a typed error. Every SQLite error reaching a caller is typed.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import store_tokens, tokens_for
from test_hostile import (
    CAP,
    TREE,
    L,
    build,
    key_of,
    rewrite_header,
    served_bytes_are_right,
    shard,
    sql,
    tree_hash,
)

from prefixstore.base import errors as E
from prefixstore.base.keys import Prefix
from prefixstore.cli import main as cli_main
from prefixstore.engine.api import Engine
from prefixstore.engine.repair import repair
from prefixstore.fuzz.faultfs import CrashAt, flip_bit
from prefixstore.gpu.ranks import LocalRank
from prefixstore.statemachine.compaction import CompactionPolicy

REPO = str(Path(__file__).resolve().parent.parent)
SHARDS = 2 * len(TREE)  # the tree's shard files (two ranks)


def cli(*args: str) -> tuple[int, str]:
    """``python -m prefixstore.cli ARGS`` in a fresh process (this checkout's code)."""
    p = subprocess.run([sys.executable, "-m", "prefixstore.cli", *args], capture_output=True, text=True,
                       env={**os.environ, "PYTHONPATH": REPO}, timeout=600)
    return p.returncode, p.stdout + p.stderr


def audit(root: str, *extra: str, capsys) -> tuple[int, dict]:
    """``prefixstore audit ROOT --json EXTRA`` in this process."""
    capsys.readouterr()
    rc = cli_main(["audit", root, "--json", *extra])
    return rc, json.loads(capsys.readouterr().out)


def shard_count(root: str) -> int:
    return sum(len(os.listdir(os.path.join(root, f"rank{r}"))) for r in range(L.ranks))


def contents(root: str) -> list[str]:
    """The hashes of every shard file's bytes under ``root`` (rank dirs and lost+found/)."""
    return sorted(hashlib.sha256(Path(d, f).read_bytes()).hexdigest()
                  for d, _, files in os.walk(root) for f in files if f.endswith((".st", ".tmp")))


def served(root: str, capacity: int = CAP) -> dict[str, int]:
    """Blocks each node of the tree serves (bit-identically: asserted), with a clean audit."""
    with Engine.open(root, L, capacity) as eng:
        out = {lbl: served_bytes_are_right(eng, toks) for lbl, toks in TREE.items()}
        assert eng.audit().ok, eng.audit().to_dict()
    return out


FULL = {lbl: len(toks) // 4 for lbl, toks in TREE.items()}


# ---------------------------------------------------------------------- lost catalogs


def _empty(root):
    open(os.path.join(root, "catalog.sqlite"), "w").close()


def _missing(root):
    os.unlink(os.path.join(root, "catalog.sqlite"))


def _no_schema(root):  # a SQLite file that held something once, and no table now
    os.unlink(os.path.join(root, "catalog.sqlite"))
    sql(root, "CREATE TABLE t(x)")
    sql(root, "DROP TABLE t")


def _emptied(root):  # the engine's schema, every row deleted
    sql(root, "DELETE FROM files")
    sql(root, "DELETE FROM nodes")
    sql(root, "DELETE FROM meta WHERE key != 'format'")


LOST = {
    "empty": (_empty, "catalog.sqlite is empty (0 bytes)"),
    "missing": (_missing, "catalog.sqlite is missing"),
    "no-schema": (_no_schema, "catalog.sqlite holds no schema"),
    "emptied": (_emptied, "catalog.sqlite records no layout and no row"),
}


@pytest.mark.parametrize("case", sorted(LOST))
def test_a_lost_catalog_beside_shards_is_refused_by_name_and_rebuilt_by_repair(tmp_path, case, capsys):
    root = str(tmp_path / "cache")
    build(root)
    plant, state = LOST[case]
    plant(root)
    before, stored = tree_hash(str(tmp_path)), contents(root)

    for capacity in (CAP, CAP + 1):  # the reproductions: open with the same or another capacity
        with pytest.raises(E.CatalogLostError) as info:
            Engine.open(root, L, capacity)
        msg = str(info.value)
        assert state in msg and "6 shards in rank0/" in msg and "6 shards in rank1/" in msg, msg
        assert "LOCK" in msg and "audit --repair" in msg, msg
    assert shard_count(root) == SHARDS and tree_hash(str(tmp_path)) == before

    rc, out = audit(root, capsys=capsys)
    assert rc == 2 and state in out["error"], out
    capsys.readouterr()
    assert cli_main(["catalog", root]) == (0 if case == "emptied" else 2)  # a listing of what is left
    if case != "emptied":
        assert state in capsys.readouterr().err
    assert tree_hash(str(tmp_path)) == before

    rc, out = audit(root, "--repair", capsys=capsys)
    assert rc == 0 and out["ok"], out
    assert any("rebuilt the catalog" in c and "6 nodes (0 damaged), 12 shard files" in c
               for c in out["repair"]["changes"]), out["repair"]
    assert shard_count(root) == SHARDS and contents(root) == stored  # nothing unlinked, nothing moved
    assert audit(root, capsys=capsys)[0] == 0
    assert served(root) == FULL


def test_the_empty_catalog_reproduction_through_the_command_line(tmp_path):
    """The issue's run, through ``python -m prefixstore.cli``: refused by name, then rebuilt."""
    root = str(tmp_path / "cache")
    build(root)
    _empty(root)
    before = tree_hash(str(tmp_path))
    rc, out = cli("audit", root)
    assert rc == 2 and "catalog.sqlite is empty (0 bytes)" in out and "6 shards in rank0/" in out, out
    with pytest.raises(E.CatalogLostError):
        Engine.open(root, L, CAP + 1)
    assert tree_hash(str(tmp_path)) == before
    rc, out = cli("audit", root, "--repair")
    assert rc == 0 and "rebuilt the catalog from the shards' headers" in out and "CLEAN" in out, out
    assert cli("audit", root)[0] == 0
    assert served(root) == FULL


def _lock_only(root):
    os.makedirs(root)
    open(os.path.join(root, "LOCK"), "w").close()


def _lock_and_empty_catalog(root):
    _lock_only(root)
    _empty(root)
    for s in ("-wal", "-shm"):
        open(os.path.join(root, "catalog.sqlite" + s), "w").close()


def _empty_own_dirs(root):
    _lock_and_empty_catalog(root)
    for d in ("rank0", "rank1", "lost+found"):
        os.mkdir(os.path.join(root, d))


def _crash_at_first_commit(root):
    """A real first open that dies at its first commit (the layout's): the schema, no layout."""
    with pytest.raises(E.SimulatedCrash):
        Engine.open(root, L, CAP, hook=CrashAt(0, ops=["commit"]))
    assert sql(root, "SELECT count(*) FROM meta")[0][0] == 1  # only the format marker


@pytest.mark.parametrize("leftover", [_lock_only, _lock_and_empty_catalog, _empty_own_dirs, _crash_at_first_commit])
def test_what_an_interrupted_first_open_leaves_opens_as_a_new_cache(tmp_path, leftover):
    root = str(tmp_path / "cache")
    leftover(root)
    with Engine.open(root, L, CAP) as eng:
        assert store_tokens(eng, TREE["A4"]).ok
        assert served_bytes_are_right(eng, TREE["A4"]) == 4
        assert eng.audit().ok


def test_an_empty_catalog_with_rank_directories_kept_elsewhere_is_refused(tmp_path):
    root, elsewhere = str(tmp_path / "cache"), tmp_path / "ranks"
    dirs = [str(elsewhere / f"r{r}") for r in range(L.ranks)]

    def ranks():
        return [LocalRank(r, d) for r, d in enumerate(dirs)]

    with Engine.open(root, L, CAP, ranks=ranks()) as eng:
        for toks in TREE.values():
            assert store_tokens(eng, toks).ok
    for plant in (_empty, lambda r: shutil.rmtree(r)):  # an empty catalog; no cache directory at all
        plant(root)
        before = tree_hash(str(elsewhere))
        with pytest.raises(E.CatalogLostError, match=r"6 shards in .*r0.*6 shards in .*r1"):
            Engine.open(root, L, CAP, ranks=ranks())
        assert tree_hash(str(elsewhere)) == before


def _strip_provenance(path: str) -> None:
    def edit(h):
        for k in ("digests", "layout", "parent"):
            h["__metadata__"].pop(k, None)

    rewrite_header(path, edit)


def test_a_rebuild_keeps_every_intact_checkpoint_and_moves_the_rest_to_lost_found(tmp_path, capsys):
    root = str(tmp_path / "cache")
    build(root)
    stored = contents(root)
    os.truncate(shard(root, "A4", 0), 100)  # an interior node (A6 hangs below): adopted damaged
    flip_bit(shard(root, "C5", 1), 40, 1)  # a leaf's header on rank 1: not adopted
    _strip_provenance(shard(root, "D2", 0))  # written before shards named their digests
    Path(root, "rank0", "notes.txt").write_text("not a shard")
    Path(root, "rank1", f"{'ab' * 16}-g1.st.tmp").write_bytes(b"half a write")
    _empty(root)

    rc, out = audit(root, "--repair", capsys=capsys)
    assert rc == 0 and out["ok"], out
    moved = [c for c in out["repair"]["changes"] if c.startswith("moved rank")]
    c5, d2, a4 = (key_of(x).hex() for x in ("C5", "D2", "A4"))
    for want in ("rank0/notes.txt", f"rank1/{'ab' * 16}-g1.st.tmp", f"rank1/{c5}", f"rank0/{c5}",
                 f"rank0/{d2}", f"rank1/{d2}", f"rank0/{a4}"):
        assert any(want in m for m in moved), (want, moved)
    assert len(moved) == 7, moved
    lf = os.path.join(root, "lost+found")
    assert Path(lf, "rank0", "notes.txt").read_text() == "not a shard"
    assert len(contents(root)) == len(stored) + 1  # every file still there (the .tmp added one)

    with Engine.open(root, L, CAP) as eng:
        assert eng.index.get(eng.index.by_key[key_of("A4")]).state == "damaged"
        got = {lbl: served_bytes_are_right(eng, toks) for lbl, toks in TREE.items()}
        assert got == {**FULL, "A4": 2, "A6": 2, "C5": 2, "D2": 0}, got  # above the damaged A4
        for lbl in ("A4", "C5", "D2"):  # refills serve them again
            assert store_tokens(eng, TREE[lbl]).ok
    assert served(root) == FULL


def test_a_rebuild_after_a_merge_left_both_generations_keeps_the_finer_chain(tmp_path, capsys):
    """Compaction merged a chain and died before unlinking the old generation: both are
    on disk when the catalog is lost. The rebuild keeps the chain (more checkpoints) and
    moves the merged endpoint aside."""
    root = str(tmp_path / "cache")
    conv = tokens_for(70, 12)
    with Engine.open(root, L, CAP) as eng:
        for b in (3, 6, 9, 12):
            assert store_tokens(eng, conv[: b * 4]).ok
        old = {(r, n): Path(root, f"rank{r}", n).read_bytes() for r in range(2)
               for n in os.listdir(os.path.join(root, f"rank{r}"))}
        assert eng.compact(CompactionPolicy(keep_interior_checkpoints=False)).merges == 1
        merged = {(r, n) for r in range(2) for n in os.listdir(os.path.join(root, f"rank{r}"))} - set(old)
    assert len(merged) == 2
    for (r, n), data in old.items():
        Path(root, f"rank{r}", n).write_bytes(data)
    _empty(root)
    rc, out = audit(root, "--repair", capsys=capsys)
    assert rc == 0 and out["ok"], out
    assert {os.path.join(root, "lost+found", f"rank{r}", n) for r, n in merged} <= {
        os.path.join(d, f) for d, _, fs in os.walk(os.path.join(root, "lost+found")) for f in fs}
    with Engine.open(root, L, CAP) as eng:
        assert sorted((n.start, n.end) for n in eng.index) == [(0, 3), (3, 6), (6, 9), (9, 12)]
        for b in (3, 6, 9, 12):
            m = eng.lookup(Prefix.from_tokens(conv[: b * 4], 4))
            assert m.hit and m.blocks == b, m
        assert eng.audit().ok


def test_a_rebuild_that_cannot_find_the_layout_or_a_rank_directory_changes_nothing(tmp_path, capsys):
    root = str(tmp_path / "cache")
    build(root)
    _empty(root)
    os.rename(os.path.join(root, "rank1"), str(tmp_path / "rank1-elsewhere"))
    before = tree_hash(str(tmp_path))
    rc, out = audit(root, "--repair", capsys=capsys)
    assert rc == 2 and "rank1" in out["error"] and "--rank-dir" in out["error"], out
    assert tree_hash(str(tmp_path)) == before
    rc, out = audit(root, "--repair", "--rank-dir", os.path.join(root, "rank0"),
                    "--rank-dir", str(tmp_path / "rank1-elsewhere"), capsys=capsys)
    assert rc == 0 and out["ok"], out

    root2 = str(tmp_path / "old-format")
    build(root2)
    for lbl in TREE:
        for r in range(L.ranks):
            _strip_provenance(shard(root2, lbl, r))
    _empty(root2)
    before = tree_hash(root2)
    rc, out = audit(root2, "--repair", capsys=capsys)
    assert rc == 2 and "layout" in out["error"], out
    assert tree_hash(root2) == before


def test_repair_records_the_capacity_it_is_given(tmp_path, capsys):
    root = str(tmp_path / "cache")
    build(root)
    _empty(root)
    rc, out = audit(root, "--repair", "--capacity", str(CAP // 2), capsys=capsys)
    assert rc == 0 and out["accounting"]["capacity"] == CAP // 2, out
    assert sql(root, "SELECT value FROM meta WHERE key='capacity'") == [(str(CAP // 2),)]
    capsys.readouterr()
    assert cli_main(["audit", root, "--capacity", "5"]) == 2  # needs --repair


# ---------------------------------------------------------------------- planted schema objects


def _open_other_capacity(root):
    Engine.open(root, L, CAP + 1).close()


def _store_and_reclaim(root):
    with Engine.open(root, L, CAP) as eng:
        store_tokens(eng, tokens_for(77, 2))
        eng.reclaim()


def _view_in_place_of_files(root):
    sql(root, "ALTER TABLE files RENAME TO files_kept")
    sql(root, "CREATE VIEW files AS SELECT * FROM files_kept")


PLANTED = {
    # name: (plant, the reproduction, what the error names, --repair exit, needs --rebuild)
    "trigger-on-meta-deleting-rows": (
        lambda r: sql(r, "CREATE TRIGGER wipe AFTER INSERT ON meta BEGIN DELETE FROM files; DELETE FROM nodes; END"),
        _open_other_capacity, "trigger wipe on meta", False),
    "trigger-on-journal-marking-garbage": (
        lambda r: sql(r, "CREATE TRIGGER rot AFTER INSERT ON journal BEGIN "
                         "UPDATE files SET status='garbage', node=NULL; END"),
        _store_and_reclaim, "trigger rot on journal", False),
    "trigger-that-raises": (
        lambda r: sql(r, "CREATE TRIGGER no BEFORE INSERT ON journal BEGIN SELECT RAISE(ABORT, 'no'); END"),
        _store_and_reclaim, "trigger no on journal", False),
    "view-in-place-of-files": (_view_in_place_of_files, _open_other_capacity, "table files", True),
    "extra-index": (lambda r: sql(r, "CREATE INDEX spy ON files(name, size)"), _open_other_capacity,
                    "index spy on files", False),
    "column-added": (lambda r: sql(r, "ALTER TABLE nodes ADD COLUMN note TEXT DEFAULT 'x'"),
                     _open_other_capacity, "table nodes is not as the engine created it", False),
    "column-dropped": (lambda r: sql(r, "ALTER TABLE files DROP COLUMN checksum"), _open_other_capacity,
                       "table files is not as the engine created it", True),
}


@pytest.mark.parametrize("case", sorted(PLANTED))
def test_a_planted_schema_object_is_refused_reported_and_repaired(tmp_path, case, capsys):
    root = str(tmp_path / "cache")
    build(root)
    plant, reproduce, named, rebuild = PLANTED[case]
    plant(root)
    before = tree_hash(str(tmp_path))

    with pytest.raises(E.ForeignSchemaError) as info:
        reproduce(root)
    assert named in str(info.value) and "audit --repair" in str(info.value), info.value
    assert shard_count(root) == SHARDS and tree_hash(str(tmp_path)) == before

    rc, out = audit(root, capsys=capsys)
    assert rc == 1 and any(named in v["detail"] for v in out["violations"]), out
    assert any("refuse to open" in line for line in out["recovery"]), out["recovery"]
    assert tree_hash(str(tmp_path)) == before

    rc, out = audit(root, "--repair", capsys=capsys)
    if rebuild:  # an engine table's rows are not where the engine left them: it says so
        assert rc == 2 and "cannot be restored without losing rows" in out["error"], out
        assert "--rebuild" in out["error"] and tree_hash(str(tmp_path)) == before
        rc, out = audit(root, "--repair", "--rebuild", capsys=capsys)
    assert rc == 0 and out["ok"], out
    assert shard_count(root) == SHARDS
    assert audit(root, capsys=capsys)[0] == 0
    assert served(root, CAP + 1) == FULL


def test_the_planted_trigger_reproduction_through_the_command_line(tmp_path):
    root = str(tmp_path / "cache")
    build(root)
    PLANTED["trigger-on-meta-deleting-rows"][0](root)
    rc, out = cli("audit", root)
    assert rc == 1 and "trigger wipe on meta was not created by the engine" in out, out
    rc, out = cli("audit", root, "--repair")
    assert rc == 0 and "dropped trigger wipe on meta" in out and "CLEAN" in out, out
    assert served(root, CAP + 1) == FULL


def test_a_trigger_planted_under_a_running_engine_stops_its_next_catalog_access(tmp_path):
    root = str(tmp_path / "cache")
    build(root)
    with Engine.open(root, L, CAP) as eng:
        PLANTED["trigger-on-journal-marking-garbage"][0](root)
        with pytest.raises(E.ForeignSchemaError, match="trigger rot on journal"):
            store_tokens(eng, tokens_for(77, 2))
        with pytest.raises(E.CatalogCorruptError):
            eng.reclaim()
        assert shard_count(root) == SHARDS
    with pytest.raises(E.ForeignSchemaError):
        Engine.open(root, L, CAP)
    assert shard_count(root) == SHARDS


def test_every_sqlite_error_reaching_a_caller_is_typed(tmp_path, capsys):
    """A row or table changed under a running engine: a UNIQUE violation of the engine's
    own insert, and a table renamed away before a restore, raise typed errors."""
    root = str(tmp_path / "cache")
    build(root)
    new = Prefix.from_tokens(tokens_for(78, 2), 4)
    with Engine.open(root, L, CAP) as eng:
        sql(root, "INSERT INTO nodes(key, parent, start_block, end_block, digests, has_snapshot, state, "
                  "generation, last_used, snap_used) VALUES(?, NULL, 0, 2, ?, 1, 'ready', 5, 0, 0)",
            (new.keys[-1], b"".join(new.digests)))
        with pytest.raises(E.CatalogCorruptError, match="UNIQUE constraint failed"):
            store_tokens(eng, tokens_for(78, 2))
        with pytest.raises(E.CatalogCorruptError, match="an earlier catalog write failed"):
            store_tokens(eng, tokens_for(79, 2))
    with Engine.open(root, L, CAP) as eng:
        m = eng.lookup(Prefix.from_tokens(TREE["B3"], 4))
        assert m.hit
        sql(root, "ALTER TABLE files RENAME TO files_elsewhere")
        with pytest.raises(E.ForeignSchemaError, match="table files of the engine's schema is missing"):
            eng.restore(m)
    assert shard_count(root) == SHARDS
    with pytest.raises(E.ForeignSchemaError):
        Engine.open(root, L, CAP)
    sql(root, "ALTER TABLE files_elsewhere RENAME TO files")  # back, but its SQL text now quotes the name
    with pytest.raises(E.ForeignSchemaError, match="table files is not as the engine created it"):
        Engine.open(root, L, CAP)
    capsys.readouterr()
    assert cli_main(["audit", root, "--repair"]) == 0  # recreated with every row
    assert "recreated table files with the engine's schema (every row kept)" in capsys.readouterr().out
    assert served(root) == FULL


def test_a_rebuild_that_dies_at_its_commit_is_rebuilt_by_the_next_repair(tmp_path, capsys):
    root = str(tmp_path / "cache")
    build(root)
    _empty(root)
    stored = contents(root)
    with pytest.raises(E.SimulatedCrash):
        repair(root, hook=CrashAt(0, ops=["commit"]))
    with pytest.raises(E.CatalogLostError, match="records no layout and no row"):
        Engine.open(root, L, CAP)  # the new catalog's schema, nothing in it: still refused
    assert contents(root) == stored
    rc, out = audit(root, "--repair", capsys=capsys)
    assert rc == 0 and out["ok"], out
    assert served(root) == FULL
