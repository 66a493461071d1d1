"""Hostile and damaged files: detected by the audit and by restore, never served, repaired.

A two-rank cache holds a small tree (A2 -> A4 -> A6, A2 -> C5, B3, D2). Each case
damages it at rest while no engine runs: shard files truncated, bit-flipped, emptied,
swapped between nodes or ranks (also with the catalog's sizes and checksums fixed up
so only the header check can tell), renamed, replaced by a symlink; foreign entries
dropped in; a shard re-encoded with a header that lies (fixed-up checksum); catalog
rows tampered (size, checksum, parent, digests, key, generation, snapshot flag, a
path for a name, an unknown rank, an unknown journal row); a newer catalog version.

For each: the audit names the violated invariant and exits 1 (2 for the newer
version); opening an engine either works or refuses with a typed error and changes
nothing; no lookup+restore ever returns bytes other than the stored ones; every
intact node restores bit-identically; ``audit --repair`` brings the directory back to
a clean audit without losing an intact node, and a refill serves the victim again.
"""

from __future__ import annotations

import hashlib
import json
import os
import sqlite3
import struct
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from conftest import make_layout, seg_tensors, snap_tensors, store_tokens, tokens_for

from prefixstore.base import errors as E
from prefixstore.base.keys import Prefix
from prefixstore.cli import main as cli_main
from prefixstore.engine.api import Engine
from prefixstore.fuzz.faultfs import flip_bit, swap_contents

CAP = 16 << 20
L = make_layout(ranks=2)
A, B, D = tokens_for(1, 6), tokens_for(2, 3), tokens_for(4, 2)
C = A[:8] + tokens_for(3, 3)
TREE = {"A2": A[:8], "A4": A[:16], "A6": A, "C5": C, "B3": B, "D2": D}
BELOW = {"A2": ["A4", "A6", "C5"], "A4": ["A6"]}


def build(root: str) -> None:
    with Engine.open(root, L, CAP) as eng:
        for toks in TREE.values():
            assert store_tokens(eng, toks).status == "stored"
        assert eng.audit().ok


def key_of(label: str) -> bytes:
    return Prefix.from_tokens(TREE[label], 4).keys[-1]


def shard(root: str, label: str, rank: int = 0, gen: int = 1) -> str:
    return os.path.join(root, f"rank{rank}", f"{key_of(label).hex()}-g{gen}.st")


def sql(root: str, stmt: str, args: tuple = ()) -> list:
    conn = sqlite3.connect(os.path.join(root, "catalog.sqlite"))
    try:
        rows = conn.execute(stmt, args).fetchall()
        conn.commit()
        return rows
    finally:
        conn.close()


def node_id(root: str, label: str) -> int:
    return sql(root, "SELECT id FROM nodes WHERE key=?", (key_of(label),))[0][0]


def fix_catalog(root: str, path: str) -> None:
    """Make the catalog's size and checksum agree with the file now at ``path``."""
    from prefixstore.gpu import shards

    data = Path(path).read_bytes()
    rank = int(os.path.basename(os.path.dirname(path))[4:])
    sql(root, "UPDATE files SET size=?, checksum=? WHERE rank=? AND name=?",
        (len(data), shards.checksum(data), rank, os.path.basename(path)))


def rewrite_header(path: str, edit: Callable[[dict], None]) -> None:
    """Re-encode a shard with an edited safetensors header (same tensor bytes)."""
    data = Path(path).read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + n])
    edit(header)
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    Path(path).write_bytes(struct.pack("<Q", len(text)) + text + data[8 + n :])


# ---------------------------------------------------------------------- the cases
# Each: (damage(root), victim labels ('+'-joined) or None, invariant the audit must report,
#        whether Engine.open refuses with CatalogCorruptError)


def _truncate(root):
    p = shard(root, "A4", 1)
    os.truncate(p, os.path.getsize(p) - 9)


def _bitflip_data(root):
    p = shard(root, "A4", 0)
    flip_bit(p, os.path.getsize(p) - 5, 3)


def _bitflip_header(root):
    flip_bit(shard(root, "A4", 1), 40, 1)


def _zero_length(root):
    os.truncate(shard(root, "A6", 0), 0)


def _swap_nodes(root):
    swap_contents(shard(root, "A2", 0), shard(root, "D2", 0))  # same size, other bytes


def _swap_nodes_fixed(root):
    swap_contents(shard(root, "A2", 1), shard(root, "D2", 1))
    fix_catalog(root, shard(root, "A2", 1))
    fix_catalog(root, shard(root, "D2", 1))


def _swap_ranks(root):
    swap_contents(shard(root, "B3", 0), shard(root, "B3", 1))


def _swap_ranks_fixed(root):
    swap_contents(shard(root, "A4", 0), shard(root, "A4", 1))
    fix_catalog(root, shard(root, "A4", 0))
    fix_catalog(root, shard(root, "A4", 1))


def _renamed_as_shard(root):
    p = shard(root, "A6", 1)
    os.rename(p, p.replace("-g1.st", "-g7.st"))


def _renamed_foreign(root):
    p = shard(root, "B3", 0)
    os.rename(p, p + ".bak")


def _symlink(root):
    p = shard(root, "A2", 0)
    os.unlink(p)
    os.symlink(shard(root, "D2", 0), p)  # same size, another node's bytes


def _foreign_files(root):
    Path(root, "rank0", "notes.txt").write_text("hello")
    os.mkdir(os.path.join(root, "rank1", "subdir"))
    Path(root, "rank1", f"{'ab' * 16}-g1.st").write_bytes(os.urandom(300))
    os.mkfifo(os.path.join(root, "rank0", "a.fifo"))


def _header_dtype_lies(root):
    p = shard(root, "A4", 0)
    rewrite_header(p, lambda h: h["seg.k"].update(dtype="F16"))  # same bytes, other dtype
    fix_catalog(root, p)


def _header_shape_lies(root):
    p = shard(root, "A6", 1)
    rewrite_header(p, lambda h: h["seg.v"].update(shape=[h["seg.v"]["shape"][0], 3, 2]))
    fix_catalog(root, p)


def _header_rows_lie(root):
    p = shard(root, "B3", 0)

    def edit(h):  # claim 4 fewer rows for k: offsets shrink, v's start moves up
        k, v = h["seg.k"], h["seg.v"]
        k["shape"][0] -= 4
        k["data_offsets"][1] -= 4 * 12
        v["data_offsets"][0] -= 4 * 12

    rewrite_header(p, edit)
    fix_catalog(root, p)


def _header_other_key(root):
    p = shard(root, "D2", 1)
    rewrite_header(p, lambda h: h["__metadata__"].update(key=key_of("A2").hex()))
    fix_catalog(root, p)


def _header_length_lies(root):
    p = shard(root, "C5", 0)
    data = bytearray(Path(p).read_bytes())
    data[:8] = struct.pack("<Q", len(data) * 4)
    Path(p).write_bytes(bytes(data))
    fix_catalog(root, p)


def _row_size(root):
    sql(root, "UPDATE files SET size=size+16 WHERE node=? AND rank=1", (node_id(root, "A4"),))


def _row_checksum(root):
    sql(root, "UPDATE files SET checksum=? WHERE node=? AND rank=0", ("0" * 32, node_id(root, "B3")))


def _row_generation(root):
    nid = node_id(root, "A6")
    sql(root, "UPDATE nodes SET generation=2 WHERE id=?", (nid,))


def _row_snapshot_flag(root):
    sql(root, "UPDATE nodes SET has_snapshot=0 WHERE id=?", (node_id(root, "A4"),))


def _row_parent(root):
    sql(root, "UPDATE nodes SET parent=? WHERE id=?", (node_id(root, "D2"), node_id(root, "C5")))


def _row_parent_missing(root):
    sql(root, "UPDATE nodes SET parent=999 WHERE id=?", (node_id(root, "C5"),))


def _row_digests(root):
    sql(root, "UPDATE nodes SET digests=? WHERE id=?", (os.urandom(32), node_id(root, "A4")))


def _row_key(root):
    sql(root, "UPDATE nodes SET key=? WHERE id=?", (os.urandom(16), node_id(root, "B3")))


def _row_start(root):
    sql(root, "UPDATE nodes SET start_block=1 WHERE id=?", (node_id(root, "D2"),))


def _row_path_name(root):
    # a garbage row naming a file outside the cache: must never be unlinked
    sql(root, "INSERT INTO files VALUES(0, '../../sentinel', NULL, 1, 5, NULL, 'garbage', NULL)")


def _row_unknown_rank(root):
    sql(root, "UPDATE files SET rank=7 WHERE node=? AND rank=1", (node_id(root, "B3"),))


def _row_live_orphan(root):
    sql(root, "INSERT INTO files VALUES(1, ?, 4242, 1, 10, 'x', 'live', NULL)", (f"{'cd' * 16}-g1.st",))


def _journal_unknown(root):
    sql(root, "INSERT INTO journal(kind, state, payload) VALUES('teleport', 'HALFWAY', '{}')")


def _journal_corrupt_payload(root):
    sql(root, "INSERT INTO journal(kind, state, payload) VALUES('store', 'INTENT', 'not json')")


CASES = {
    "truncated": (_truncate, "A4", 1, False),
    "bitflip-data": (_bitflip_data, "A4", 1, False),
    "bitflip-header": (_bitflip_header, "A4", 1, False),
    "zero-length": (_zero_length, "A6", 1, False),
    "swapped-between-nodes": (_swap_nodes, "A2+D2", 1, False),
    "swapped-between-nodes-catalog-fixed": (_swap_nodes_fixed, "A2+D2", 1, False),
    "swapped-between-ranks": (_swap_ranks, "B3", 1, False),
    "swapped-between-ranks-catalog-fixed": (_swap_ranks_fixed, "A4", 1, False),
    "renamed-to-another-shard-name": (_renamed_as_shard, "A6", 1, False),
    "renamed-to-foreign-name": (_renamed_foreign, "B3", 1, False),
    "symlink-to-another-shard": (_symlink, "A2", 1, False),
    "foreign-files": (_foreign_files, None, 3, False),
    "header-lies-dtype": (_header_dtype_lies, "A4", 1, False),
    "header-lies-shape": (_header_shape_lies, "A6", 1, False),
    "header-lies-rows": (_header_rows_lie, "B3", 1, False),
    "header-other-key": (_header_other_key, "D2", 1, False),
    "header-length-lies": (_header_length_lies, "C5", 1, False),
    "row-size": (_row_size, None, 3, False),  # the file matches its checksum: the row's size is wrong
    "row-checksum": (_row_checksum, "B3", 1, False),
    "row-generation": (_row_generation, None, 1, False),  # every rank's live shard is generation 1
    "row-snapshot-flag": (_row_snapshot_flag, "A4", 1, False),
    "row-parent": (_row_parent, "C5", 2, True),
    "row-parent-missing": (_row_parent_missing, "C5", 2, True),
    "row-digests": (_row_digests, "A4", 2, True),
    "row-key": (_row_key, "B3", 2, True),
    "row-start": (_row_start, "D2", 2, True),
    "row-path-name": (_row_path_name, None, 3, True),
    "row-unknown-rank": (_row_unknown_rank, "B3", 3, True),
    "row-live-orphan": (_row_live_orphan, None, 3, True),
    "journal-unknown-kind": (_journal_unknown, None, 7, True),
    "journal-corrupt-payload": (_journal_corrupt_payload, None, 7, True),
}
# Rows whose parent link alone was wrong are relinked by repair: nothing is lost.
RELINKED = {"row-parent", "row-parent-missing"}


def served_bytes_are_right(eng: Engine, toks: list[int]) -> int:
    """Lookup + restore ``toks``; whatever is returned must be the stored bytes. Blocks served."""
    m = eng.lookup(Prefix.from_tokens(toks, 4))
    if not m.hit:
        return 0
    r = eng.restore(m)
    if r is None:
        return 0
    want_s, want_n = seg_tensors(L, toks[: m.tokens]), snap_tensors(L, toks[: m.tokens])
    for rank in range(L.ranks):
        for name, t in r.segments[rank].items():
            assert t.dtype == want_s[rank][name].dtype and torch.equal(t, want_s[rank][name]), (rank, name)
        for name, t in r.snapshot[rank].items():
            assert torch.equal(t, want_n[rank][name]), (rank, name)
    return m.blocks


def audit_json(root: str, *extra: str, capsys) -> tuple[int, dict]:
    capsys.readouterr()
    rc = cli_main(["audit", root, "--json", *extra])
    return rc, json.loads(capsys.readouterr().out)


def tree_hash(root: str) -> dict[str, str]:
    out = {}
    for d, dirs, files in os.walk(root):
        for f in files + [x for x in dirs if os.path.islink(os.path.join(d, x))]:
            p = os.path.join(d, f)
            if os.path.islink(p):
                out[p] = "link:" + os.readlink(p)
            elif os.path.isfile(p):
                out[p] = hashlib.sha256(Path(p).read_bytes()).hexdigest()
            else:
                out[p] = "special"
    return out


@pytest.mark.parametrize("case", sorted(CASES))
def test_hostile_file_is_detected_never_served_and_repaired(tmp_path, case, capsys):
    damage, victims, invariant, refused = CASES[case]
    victims = victims.split("+") if victims else []
    root, fresh = str(tmp_path / "cache"), str(tmp_path / "fresh")
    for d in (root, fresh):  # two copies: one meets an engine first, one goes straight to repair
        build(d)
        damage(d)
    (tmp_path / "sentinel").write_text("outside the cache")
    affected = {lbl for v in victims for lbl in (v, *BELOW.get(v, []))}
    intact = [lbl for lbl in TREE if lbl not in affected]

    # 1. the audit names it, changes nothing
    before = tree_hash(str(tmp_path))
    rc, rep = audit_json(root, capsys=capsys)
    assert rc == 1 and not rep["ok"], rep
    assert invariant in {v["invariant"] for v in rep["violations"]}, rep["violations"]
    assert all(set(v) == {"invariant", "detail"} for v in rep["violations"])
    assert tree_hash(str(tmp_path)) == before

    # 2. an engine either refuses (typed, nothing changed) or serves only right bytes
    if refused:
        with pytest.raises(E.CatalogCorruptError, match="audit --repair"):
            Engine.open(root, L, CAP)
        assert tree_hash(str(tmp_path)) == before
    else:
        with Engine.open(root, L, CAP) as eng:
            for _ in range(2):  # the second pass sees what the first marked damaged
                for lbl, toks in TREE.items():
                    got = served_bytes_are_right(eng, toks)
                    if lbl in intact:
                        assert got == len(toks) // 4, (lbl, got)
                    elif lbl in victims:
                        assert got < len(toks) // 4, f"{lbl} was served"
            for v in victims:
                assert eng.index.nodes[eng.index.by_key[key_of(v)]].state == "damaged", v

    # 3. repair (of the copy no engine touched, then of the other): a clean audit,
    #    intact nodes kept, the sentinel outside untouched
    rc, rep = audit_json(fresh, "--repair", capsys=capsys)
    assert rc == 0 and rep["ok"], rep
    assert rep["repair"]["changed"] and rep["repair"]["changes"]
    rc, rep = audit_json(root, "--repair", capsys=capsys)
    assert rc == 0 and rep["ok"], rep
    assert (tmp_path / "sentinel").read_text() == "outside the cache"
    for d in (fresh, root):
        rc, rep = audit_json(d, capsys=capsys)
        assert rc == 0, rep
        rc, again = audit_json(d, "--repair", capsys=capsys)
        assert rc == 0 and not again["repair"]["changed"], again["repair"]
    with Engine.open(fresh, L, CAP) as eng:
        kept = intact + (sorted(affected) if case in RELINKED else [])
        for lbl in kept:
            assert served_bytes_are_right(eng, TREE[lbl]) == len(TREE[lbl]) // 4, lbl
        for lbl in affected - set(kept):
            served_bytes_are_right(eng, TREE[lbl])
        # a refill of the victim serves it (and what hangs below it) again
        for lbl in sorted(affected - set(kept), key=lambda x: len(TREE[x])):
            assert store_tokens(eng, TREE[lbl]).ok
            assert served_bytes_are_right(eng, TREE[lbl]) == len(TREE[lbl]) // 4, lbl
        assert eng.audit().ok


def test_newer_catalog_version_is_refused_everywhere_and_nothing_changes(tmp_path, capsys):
    root = str(tmp_path / "cache")
    build(root)
    sql(root, "PRAGMA user_version=2")
    before = tree_hash(str(tmp_path))
    rc, rep = audit_json(root, capsys=capsys)
    assert rc == 2 and "newer" in rep["error"]
    rc, rep = audit_json(root, "--repair", capsys=capsys)
    assert rc == 2 and "newer" in rep["error"]
    with pytest.raises(E.SchemaVersionError):
        Engine.open(root, L, CAP)
    assert tree_hash(str(tmp_path)) == before


def test_every_case_names_its_violation_in_human_output(tmp_path, capsys):
    root = str(tmp_path / "cache")
    build(root)
    _truncate(root)
    _row_parent(root)
    capsys.readouterr()
    assert cli_main(["audit", root]) == 1
    out = capsys.readouterr().out
    assert "invariant 1 (every ready node has a verified shard on every rank): 1 VIOLATION(S)" in out
    assert "invariant 2 (ancestry is whole and keys are chained hashes): 1 VIOLATION(S)" in out
    assert "refuse to open" in out and "is 568 bytes" not in out


FILE_CASES = sorted(k for k, v in CASES.items() if not v[3] and not k.startswith("row-"))


@pytest.mark.parametrize("case", FILE_CASES)
def test_damage_under_a_running_engine_is_never_served(tmp_path, case):
    """The same files damaged while an engine has the directory open: restores detect it."""
    damage, victims, _invariant, _refused = CASES[case]
    victims = victims.split("+") if victims else []
    affected = {lbl for v in victims for lbl in (v, *BELOW.get(v, []))}
    root = str(tmp_path / "cache")
    build(root)
    with Engine.open(root, L, CAP) as eng:
        for toks in TREE.values():  # everything serves before the damage
            assert served_bytes_are_right(eng, toks) == len(toks) // 4
        damage(root)
        for _ in range(2):
            for lbl, toks in TREE.items():
                got = served_bytes_are_right(eng, toks)
                if lbl not in affected:
                    assert got == len(toks) // 4, (lbl, got)
                elif lbl in victims:
                    assert got < len(toks) // 4, f"{lbl} was served"
        for v in victims:
            assert eng.index.nodes[eng.index.by_key[key_of(v)]].state == "damaged", v
        rep = eng.audit()  # damaged nodes are a legal state: the audit lists them
        assert {eng.index.by_key[key_of(v)] for v in victims} <= set(rep.damaged_nodes)
    rc = cli_main(["audit", root, "--repair"])
    assert rc == 0
