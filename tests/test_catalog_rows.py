"""The catalog's named row operations of recovery, repair, compact-replace and audit,
on a real SQLite catalog file: each changes exactly the rows it names."""

from __future__ import annotations

import sqlite3

import pytest

from prefixstore.engine.catalog import Catalog, CatalogView, catalog_path
from prefixstore.gpu.ranks import shard_name

KEY_A, KEY_B = bytes(range(16)), bytes(range(16, 32))


@pytest.fixture
def cat(tmp_path):
    c = Catalog(str(tmp_path))
    try:
        yield c
    finally:
        c.close()


def _fields(parent, start, end, gen=1):
    """(parent, start, end, digests, has_snapshot, generation, last_used, snap_used)."""
    return (parent, start, end, b"\0" * (16 * (end - start)), 0, gen, 0, 0)


def _published_node(cat: Catalog, key: bytes, parent, start: int, end: int, ranks: int = 2) -> tuple[int, int]:
    """A node with a live shard on each rank, written as a compact-replace does; (node id, txn)."""
    name = shard_name(key, 1)
    with cat.txn("test.intent") as c:
        c.execute("INSERT INTO journal(id, kind, state, payload) VALUES(NULL, 'compact', 'INTENT', '{}')")
        tid = c.execute("SELECT max(id) FROM journal").fetchone()[0]
        cat.insert_writing_files(c, tid, [(r, name, 1, 100 + r, f"ck{r}") for r in range(ranks)])
    with cat.txn("test.publish") as c:
        nid = cat.insert_node_fields(c, key, _fields(parent, start, end))
        cat.publish_file(c, tid, name, nid)
    return nid, tid


def test_publish_then_retire_moves_rows_between_states(cat):
    a, tid = _published_node(cat, KEY_A, None, 0, 2)
    name = shard_name(KEY_A, 1)
    assert cat.live_file_rows(a) == {0: (name, 100, "ck0"), 1: (name, 101, "ck1")}
    assert cat.ready_node_ids() == [a]
    assert cat.max_generation(KEY_A.hex(), 2) == 1
    assert cat.max_generation(KEY_A.hex(), 1) == 1
    assert cat.max_generation(KEY_B.hex(), 2) == 0
    with cat.txn("test.retire") as c:
        old = cat.retire_node_files(c, [a], tid)
    assert sorted(old) == [(0, name, 100), (1, name, 101)]
    assert cat.live_file_rows(a) == {}
    assert sorted(tuple(r) for r in cat.garbage_files()) == sorted(old)
    assert sorted(tuple(r) for r in cat.files_of_txn(tid)) == sorted(old)
    assert sorted(tuple(r) for r in cat.unpublished_files_of_txn(tid)) == sorted(old)
    assert cat.max_generation(KEY_A.hex(), 2) == 1  # garbage keeps its generation taken


def test_drop_nodes_makes_their_files_garbage_and_keeps_others(cat):
    a, _ = _published_node(cat, KEY_A, None, 0, 2)
    b, _ = _published_node(cat, KEY_B, a, 2, 3)
    with cat.txn("test.drop") as c:
        cat.drop_nodes(c, [b])
    assert set(cat.node_rows_by_id()) == {a}
    assert {r[0] for r in cat.all_live_files()} == {a}
    assert sorted(r[1] for r in cat.garbage_files()) == [shard_name(KEY_B, 1)] * 2


def test_rewrite_mark_damaged_and_generation(cat):
    a, _ = _published_node(cat, KEY_A, None, 0, 2)
    with cat.txn("test.rewrite") as c:
        cat.rewrite_node(c, a, _fields(None, 0, 2, gen=5))
        cat.mark_nodes_damaged(c, [a])
    assert cat.node_fields()[a] == (None, 0, 2, "damaged", 5, 0)
    assert cat.ready_node_ids() == []
    with cat.txn("test.gen") as c:
        cat.set_node_generation(c, a, 7)
    assert [tuple(r) for r in cat.node_generations()] == [(KEY_A, 7)]


def test_file_row_fixes(cat):
    a, tid = _published_node(cat, KEY_A, None, 0, 2)
    name = shard_name(KEY_A, 1)
    with cat.txn("test.fix") as c:
        cat.garbage_file(c, 0, name)
        cat.set_file_size(c, 1, name, 7)
        cat.insert_live_file(c, 2, name, a, 1, 9, "ck2")
    assert cat.live_file_rows(a) == {1: (name, 7, "ck1"), 2: (name, 9, "ck2")}
    with cat.txn("test.attach") as c:
        cat.attach_file(c, 0, name, a, 1)
        cat.set_file_sizes(c, [(3, 0, name)])
    assert cat.live_file_rows(a)[0] == (name, 3, "ck0")
    assert sorted(tuple(r) for r in cat.file_names()) == [(0, name), (1, name), (2, name)]


def test_writing_rows_released_and_forgotten(cat):
    with cat.txn("test.write") as c:
        cat.insert_writing_files(c, 9, [(0, "x-g1.st", 1, 5, "ck"), (1, "x-g1.st", 1, 5, "ck")])
    assert cat.nodes_with_txn_files() == [None]
    with cat.txn("test.release") as c:
        cat.release_txn_files(c, 9)
    assert cat.files_of_txn(9) == []
    assert len(cat.garbage_files()) == 2
    with cat.txn("test.stray") as c:
        cat.insert_writing_files(c, 10, [(0, "y-g1.st", 1, 5, "ck")])
        cat.garbage_stray_writing(c)
    assert cat.files_of_txn(10) == [] and len(cat.garbage_files()) == 3
    with cat.txn("test.forget") as c:
        cat.forget_file(c, 0, "x-g1.st")
        cat.forget_file(c, 1, "no such row")
    assert sorted(tuple(r) for r in cat.file_names()) == [(0, "y-g1.st"), (1, "x-g1.st")]


def test_catalog_view_reads_one_snapshot(cat, tmp_path):
    a, _ = _published_node(cat, KEY_A, None, 0, 2)
    conn = sqlite3.connect(f"file:{catalog_path(str(tmp_path))}?mode=ro", uri=True, isolation_level=None)
    try:
        view = CatalogView(conn)
        with view.snapshot():
            assert view.meta()["format"] == "prefixstore"
            assert view.user_version() == 1
            assert set(view.node_rows()) == {a}
            assert [f[:2] for f in view.file_rows()] == [(0, shard_name(KEY_A, 1)), (1, shard_name(KEY_A, 1))]
            assert [j[:3] for j in view.journal_rows()] == [(1, "compact", "INTENT")]
            assert view.quick_check() == "ok"
            assert view.node_states() == {"ready": 1}
            assert view.file_statuses() == {"live": (2, 201)}
        assert not conn.in_transaction
    finally:
        conn.close()
