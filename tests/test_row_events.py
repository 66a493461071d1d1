"""The row tables drive the catalog's row writes (``statemachine/rows.py`` ->
``engine/catalog.py``): each write feeds an event, moves only rows in the event's
source states, writes the table's target, and refuses a selected row in any other
state, naming the table, the row, its state and the event. Real SQLite catalog files.

The planted tables below are wrong in one source state each; the catalog's writes
that the table no longer allows then fail loudly, inside their commit, and change
nothing."""

from __future__ import annotations

import pytest

from prefixstore.base.errors import IllegalTransitionError
from prefixstore.engine import catalog as catalog_mod
from prefixstore.engine.catalog import Catalog
from prefixstore.gpu.ranks import shard_name
from prefixstore.statemachine.machine import Machine, T
from prefixstore.statemachine.rows import FILE, NODE

KEY = bytes(range(16))
RANKS = 2


@pytest.fixture
def cat(tmp_path):
    c = Catalog(str(tmp_path))
    try:
        yield c
    finally:
        c.close()


def _intent(cat: Catalog, name: str, gen: int = 1) -> int:
    """A journal row owning ``name``'s writing rows on every rank; its id."""
    with cat.txn("test.intent") as c:
        tid = c.execute("INSERT INTO journal(kind, state, payload) VALUES('store', 'INTENT', '{}')").lastrowid
        cat.add_writing(c, tid, name, gen, [(10 + r, f"ck{r}") for r in range(RANKS)])
    return tid


def _ready_node(cat: Catalog) -> tuple[int, int, str]:
    """A ready node with a live shard on each rank; (node id, its store's txn, shard name)."""
    name = shard_name(KEY, 1)
    tid = _intent(cat, name)
    with cat.txn("test.publish") as c:
        nid = cat.insert_node(c, KEY, None, 0, 1, b"\0" * 16, False, 1, 0)
        cat.publish_file(c, tid, name, nid)
    return nid, tid, name


def _rows(cat: Catalog) -> list[tuple]:
    return [tuple(r) for r in cat.query("SELECT rank, name, node, status, txn FROM files ORDER BY rank, name")]


def _nodes(cat: Catalog) -> list[tuple]:
    return [tuple(r) for r in cat.query("SELECT id, state, generation FROM nodes ORDER BY id")]


def _without(m: Machine, drop: tuple[str, str, str], *add: tuple[str, str, str]) -> Machine:
    """``m`` with one edge replaced: a planted table bug."""
    edges = [e for e in m.edges() if e != drop] + list(add)
    return Machine(m.name, m.initial, m.finals, [T(*e) for e in edges])


# ------------------------------------------------------------------ planted table bugs


def test_a_node_table_missing_a_source_refuses_that_write(cat, monkeypatch):
    """NODE without ``ready --published--> ready``: refilling a ready node in place (the
    catalog wrote a literal ``damaged`` source before) is now refused, named."""
    nid, _, _ = _ready_node(cat)
    monkeypatch.setattr(catalog_mod, "NODE", _without(NODE, ("ready", "published", "ready")))
    with pytest.raises(IllegalTransitionError, match=rf"node row {nid}: can't handle event 'published' in state "
                                                     r"'ready'") as exc, cat.txn("test.refill") as c:
        cat.refill_node(c, nid, 2, False, 5)
    assert (exc.value.table, exc.value.row, exc.value.state, exc.value.event) == ("node", str(nid), "ready",
                                                                                  "published")
    assert _nodes(cat) == [(nid, "ready", 1)]  # the commit was refused: nothing changed


def test_a_file_table_with_a_wrong_failure_source_refuses_the_settle(cat, monkeypatch):
    """FILE whose ``unlink_failed`` takes ``live`` rows instead of ``garbage``: settling a
    failed unlink (which the catalog wrote without asking the table) is refused."""
    name = shard_name(KEY, 1)
    tid = _intent(cat, name)
    with cat.txn("test.abandon") as c:  # as a rollback leaves them
        c.execute("UPDATE files SET status='garbage' WHERE txn=?", (tid,))
    before = _rows(cat)
    assert {r[3] for r in before} == {"garbage"}
    planted = _without(FILE, ("garbage", "unlink_failed", "garbage"), ("live", "unlink_failed", "garbage"))
    monkeypatch.setattr(catalog_mod, "FILE", planted)
    rows = cat.files_of_txn(tid)
    with pytest.raises(IllegalTransitionError, match=rf"file row rank0/{name}: can't handle event 'unlink_failed' "
                                                     r"in state 'garbage'"), cat.txn("test.settle") as c:
        cat.settle_files(c, rows, {(r, name) for r in range(RANKS)})
    assert _rows(cat) == before


# ------------------------------------------------------------------ rows not in a source state


def test_a_node_event_on_a_node_in_another_state_or_gone_is_refused(cat):
    nid, _, _ = _ready_node(cat)
    with cat.txn("test.damage") as c:
        cat.mark_damaged(c, nid)
    assert _nodes(cat) == [(nid, "damaged", 1)]
    with pytest.raises(IllegalTransitionError, match=rf"node row {nid}: .*'invalidated' in state 'damaged'"), \
            cat.txn("test.again") as c:
        cat.mark_damaged(c, nid)
    with pytest.raises(IllegalTransitionError, match=r"node row 99: .*'invalidated' in state 'absent'"), \
            cat.txn("test.gone") as c:
        cat.mark_nodes_damaged(c, [nid, 99])
    with pytest.raises(IllegalTransitionError, match=r"node row 99: .*'removed' in state 'absent'"), \
            cat.txn("test.delete") as c:
        cat.delete_node(c, 99)
    assert _nodes(cat) == [(nid, "damaged", 1)]


def test_evicting_a_node_whose_row_is_not_live_is_refused_and_changes_nothing(cat):
    nid, _, name = _ready_node(cat)
    with cat.txn("tamper") as c:  # a row naming the node that FILE 2 says cannot exist
        c.execute("UPDATE files SET status='writing' WHERE rank=1 AND name=?", (name,))
    before, nodes = _rows(cat), _nodes(cat)
    with cat.txn("test.evict.intent") as c:
        tid = c.execute("INSERT INTO journal(kind, state, payload) VALUES('evict', 'REMOVED', '{}')").lastrowid
    with pytest.raises(IllegalTransitionError, match=rf"file row rank1/{name}: .*'retired' in state 'writing'"), \
            cat.txn("test.evict") as c:
        cat.evict_nodes(c, tid, [nid])
    assert (_rows(cat), _nodes(cat)) == (before, nodes)


def test_publishing_a_name_with_no_writing_rows_is_refused(cat):
    tid = _intent(cat, shard_name(KEY, 1))
    with cat.txn("test.node") as c:
        nid = cat.insert_node(c, KEY, None, 0, 1, b"\0" * 16, False, 1, 0)
    with pytest.raises(IllegalTransitionError, match=r"'published' in state 'absent'"), cat.txn("test.pub") as c:
        cat.publish_file(c, tid, shard_name(KEY, 2), nid)  # a name the transaction never reserved


def test_settling_a_row_already_gone_is_refused(cat):
    name = shard_name(KEY, 1)
    tid = _intent(cat, name)
    with cat.txn("test.abandon") as c:
        c.execute("UPDATE files SET status='garbage' WHERE txn=?", (tid,))
    rows = cat.files_of_txn(tid)
    with cat.txn("test.settle") as c:
        cat.settle_files(c, rows, set())
    assert _rows(cat) == []
    with pytest.raises(IllegalTransitionError, match=rf"file row rank0/{name}: .*'unlinked' in state 'absent'"), \
            cat.txn("test.twice") as c:
        cat.delete_files(c, rows, set())


# ------------------------------------------------------------------ the table decides


def test_the_tables_sources_and_targets_are_what_the_writes_use(cat, monkeypatch):
    """The real tables move each row by its event; an edge added to a table is all a
    write needs to accept a new source state."""
    nid, tid, name = _ready_node(cat)
    assert _rows(cat) == [(r, name, nid, FILE.target("published"), None) for r in range(RANKS)]
    with cat.txn("test.retire") as c:
        old = cat.retire_live(c, tid, nid)
    assert sorted(old) == [(r, name, 10 + r) for r in range(RANKS)]
    assert _rows(cat) == [(r, name, None, FILE.target("retired"), tid) for r in range(RANKS)]
    with cat.txn("test.settle") as c:  # one unlink failed: its row stays as loose garbage
        cat.settle_files(c, old, {(1, name)})
    assert _rows(cat) == [(1, name, None, "garbage", None)]
    with cat.txn("test.damage") as c:
        cat.mark_damaged(c, nid)
    monkeypatch.setattr(catalog_mod, "NODE", _without(NODE, ("none", "none", "none"),
                                                      ("damaged", "invalidated", "damaged")))
    with cat.txn("test.again") as c:  # the planted edge allows it: the write follows the table
        cat.mark_damaged(c, nid)
    assert _nodes(cat) == [(nid, "damaged", 1)]
