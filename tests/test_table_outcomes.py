"""What the transaction tables declare besides their edges, and who reads it:

- each output's ``ok`` / ``failed`` events (``outcomes``), which the engine's handlers
  fire, checked when a table is defined;
- the row event a transition's commit feeds the rows the transaction owns (``owned``),
  which ``journal.end`` / ``journal.rollback`` apply;
- ``targeted`` row tables (an event names one state);
- the node-row invariants, asserted by the driver's debug check with the
  transaction invariants.

Each check is shown failing on a planted table (or row) bug."""

from __future__ import annotations

import types

import attrs
import pytest
from conftest import make_layout, node_at, store_tokens, tokens_for

from prefixstore.engine import health, journal
from prefixstore.engine.api import Engine
from prefixstore.engine.catalog import Catalog
from prefixstore.engine.driver import Driver, InvariantViolation, Txn
from prefixstore.gpu.ranks import shard_name
from prefixstore.statemachine import transactions
from prefixstore.statemachine.machine import Machine, MachineDefinitionError, Outcome, T
from prefixstore.statemachine.rows import FILE, NODE, FileRow, NodeRow
from prefixstore.statemachine.transactions import (
    COMPACT,
    EVICT,
    MACHINES,
    STORE,
    TxnSnapshot,
    violations,
)

RANKS = 2


# ------------------------------------------------------------------ the declarations


def test_each_output_declares_the_events_that_end_its_state():
    for m in (STORE, COMPACT):
        assert m.outcome("retire_old") == Outcome(ok="retired", failed="retire_failed")
        assert m.outcome("clean_up") == Outcome(ok="cleaned", failed="cleanup_failed")
        assert m.runs_in("retire_old") == {"PUBLISHED"} and m.runs_in("clean_up") == {"ROLLING_BACK"}
    assert EVICT.outcome("reclaim") == Outcome(ok="reclaimed", failed="reclaim_failed")
    assert EVICT.runs_in("reclaim") == {"REMOVED"}
    for m in MACHINES.values():  # recovery re-runs a state's output, which fires its ok
        for s in m.states - m.finals:
            for out in m.entry[s]:
                assert m.outcome(out).ok == m.recovery_event(s)
                assert {m.outcome(out).ok, m.outcome(out).failed} <= m.events(s)


def test_rollbacks_abandon_the_rows_they_own_and_nothing_else_does():
    owned = {(kind, t.src, t.event): t.owned for kind, m in MACHINES.items() for t in m.transitions() if t.owned}
    assert owned == {(k, "INTENT", e): "abandoned" for k in ("store", "compact") for e in ("failed", "recover")} | {
        ("compact", "INTENT", "stale"): "abandoned"}
    assert FILE.sources("abandoned") == {"writing"} and FILE.target("abandoned") == "garbage"


def test_row_tables_name_one_target_per_event():
    assert {e: FILE.target(e) for e in FILE.all_events()} == {
        "reserved": "writing", "published": "live", "abandoned": "garbage", "retired": "garbage",
        "unlinked": "removed", "unlink_failed": "garbage"}
    assert {e: NODE.target(e) for e in NODE.all_events()} == {
        "published": "ready", "invalidated": "damaged", "removed": "removed"}
    assert NODE.sources("published") == {"absent", "ready", "damaged"}


# ------------------------------------------------------------------ definition checks (planted)

_EDGES = [T("A", "go", "B", "work"), T("A", "undo", "U", recovery=True),
          T("B", "done", "C", recovery=True), T("B", "gave_up", "C")]


def _table(outcomes=None) -> Machine:
    return Machine("m", "A", {"C", "U"}, _EDGES, published={"B"}, outcomes=outcomes)


def test_a_table_whose_outputs_declare_their_events_is_accepted():
    assert _table(outcomes={"work": Outcome("done", "gave_up")}).outcome("work").failed == "gave_up"


@pytest.mark.parametrize("outcomes,error", [
    (None, "output work .run in B. declares no outcome events"),
    ({"work": Outcome("done", "lost")}, r"output work fires \['lost'\], which B cannot take"),
    ({"work": Outcome("gave_up", "done")}, "ends B with gave_up, but recovery of B feeds done"),
    ({"work": Outcome("done", "gave_up"), "other": Outcome("done", "gave_up")},
     r"outcomes for \['other'\], which run in no unfinished state"),
])
def test_an_outputs_events_must_exist_in_the_state_it_runs_in(outcomes, error):
    with pytest.raises(MachineDefinitionError, match=error):
        _table(outcomes=outcomes)


def test_a_row_tables_event_must_lead_to_one_state():
    edges = [T("absent", "made", "x"), T("x", "moved", "y"), T("y", "moved", "gone"), T("x", "dropped", "gone")]
    Machine("row", "absent", {"gone"}, edges)  # not a row table: allowed
    with pytest.raises(MachineDefinitionError, match=r"event moved leads to \['gone', 'y'\]"):
        Machine("row", "absent", {"gone"}, edges, targeted=True)


def test_an_owned_row_event_must_be_a_file_event(monkeypatch):
    bad = Machine("store", "INTENT", {"DONE", "ROLLED_BACK"},
                  [attrs.evolve(t, owned="vanished") if t.owned else t for t in STORE.transitions()],
                  published=STORE.published, outcomes=STORE.outcomes)
    monkeypatch.setitem(transactions.MACHINES, "store", bad)
    with pytest.raises(MachineDefinitionError, match="feeds its rows 'vanished', no event of the file row table"):
        transactions._check_coverage()


# ------------------------------------------------------------------ the handlers fire the table's events


def test_the_engines_handlers_fire_the_events_their_table_declares(tmp_path, monkeypatch):
    """An EVICT table whose output ends REMOVED with other event names: the engine's
    ``reclaim`` fires those (the handlers name no event of their own)."""
    renamed = Machine("evict", "REMOVED", {"DONE"},
                      [T("REMOVED", "freed", "DONE", recovery=True), T("REMOVED", "free_failed", "DONE")],
                      published={"REMOVED"}, initial_outputs=("reclaim",),
                      outcomes={"reclaim": Outcome(ok="freed", failed="free_failed")})
    monkeypatch.setitem(transactions.MACHINES, "evict", renamed)
    fired: list[str] = []
    fire = Driver.fire
    monkeypatch.setattr(Driver, "fire", lambda self, c, txn, event, *then, **kw:
                        fired.extend((event, *then)) or fire(self, c, txn, event, *then, **kw))
    eng = Engine.open(str(tmp_path / "c"), make_layout(ranks=RANKS), 1 << 24)
    try:
        store_tokens(eng, tokens_for(3, 2))
        assert eng.evict(1) > 0
        assert eng.catalog.journal() == [] and eng.catalog.file_rows() == []
    finally:
        eng.close()
    assert "freed" in fired and "reclaimed" not in fired


def test_handlers_unlink_after_the_barrier_only_in_a_published_state(tmp_path, monkeypatch):
    calls: list[tuple] = []
    unlink = lambda txn, ok, failed, barrier: calls.append((txn.kind, ok, failed, barrier))  # noqa: E731
    for kind, hs in journal.handlers(unlink).items():
        for h in hs.values():
            h(Txn(1, kind, {}))
    assert sorted(calls) == [
        ("compact", "cleaned", "cleanup_failed", False), ("compact", "retired", "retire_failed", True),
        ("evict", "reclaimed", "reclaim_failed", True),
        ("store", "cleaned", "cleanup_failed", False), ("store", "retired", "retire_failed", True)]


# ------------------------------------------------------------------ journal.end from the table


def _world(tmp_path, machines, handled: list[tuple[int, str]]):
    cat = Catalog(str(tmp_path))
    noop = {kind: {o: (lambda txn, o=o: handled.append((txn.id, o))) for o in m.all_outputs()}
            for kind, m in machines.items()}
    drv = Driver(handlers=noop, machines=machines, ranks=RANKS, debug=True)
    return types.SimpleNamespace(catalog=cat, driver=drv)


def _stranded_intent(eng, gen: int = 1) -> tuple[Txn, str]:
    """A store found in INTENT (its writing rows reserved), as recovery finds it."""
    key = bytes(range(16))
    name = shard_name(key, gen)
    payload = {"key": key.hex(), "generation": gen, "name": name, "start": 0, "end": 1, "parent": None, "node": None}
    with eng.catalog.txn("store.intent") as c:
        txn = eng.driver.begin(c, "store", payload,
                               rows=lambda tid: eng.catalog.add_writing(c, tid, name, gen, [(3, None)] * RANKS))
    return txn, name


def test_recovery_of_an_intent_fires_its_event_with_the_row_event_the_table_names(tmp_path):
    handled: list[tuple[int, str]] = []
    eng = _world(tmp_path, MACHINES, handled)
    try:
        txn, name = _stranded_intent(eng)
        (row,) = eng.catalog.journal()
        with eng.catalog.reading() as c:
            txn, step = eng.driver.recover(c, row)
        assert (step.fire, step.direction) == ("recover", "back")
        journal.end(eng, txn, step)
        assert [tuple(r[1:]) for r in eng.catalog.journal()] == [("store", "ROLLING_BACK", row[3])]
        assert {tuple(r)[6:] for r in eng.catalog.file_rows()} == {("garbage", txn.id)}
        assert handled == [(txn.id, "clean_up")]  # the transition's output, after the commit
    finally:
        eng.catalog.close()


def test_a_rollback_edge_that_forgets_its_row_event_is_caught_at_the_transition(tmp_path):
    """A planted STORE table whose ``INTENT --recover-->`` names no ``owned`` event:
    recovery's step then leaves the new rows ``writing`` in ROLLING_BACK, which the
    debug check refuses (``journal.end`` abandons only what the table says)."""
    forgot = Machine("store", "INTENT", STORE.finals,
                     [attrs.evolve(t, owned=None) if t.event == "recover" else t for t in STORE.transitions()],
                     published=STORE.published, outcomes=STORE.outcomes)
    eng = _world(tmp_path, {**MACHINES, "store": forgot}, [])
    try:
        txn, _ = _stranded_intent(eng)
        with eng.catalog.reading() as c:
            txn, step = eng.driver.recover(c, eng.catalog.journal()[0])
        with pytest.raises(InvariantViolation, match=r"store ROLLING_BACK 2: owns rank0/\S+ in status writing"):
            journal.end(eng, txn, step)
        assert [r[2] for r in eng.catalog.journal()] == ["INTENT"]  # refused with its commit
    finally:
        eng.catalog.close()


# ------------------------------------------------------------------ node-row invariants in debug mode


def test_node_row_invariants_are_part_of_a_snapshots_violations():
    payload = {"name": "a", "generation": 2, "node": 3}
    live = tuple(FileRow(r, "a", 3, 2, 3, None, "live", None) for r in range(RANKS))
    stale = (FileRow(0, "old", 3, 1, 3, None, "live", None),)
    s = TxnSnapshot(7, "store", "PUBLISHED", "PUBLISHED", payload, RANKS, live + stale,
                    {3: NodeRow(3, None, 0, 1, "ready", 2, False)}, frozenset(f.where for f in live))
    assert [v for v in violations(s) if v.startswith("NODE")] == [
        "NODE 1: ready node 3 has file rows on ranks [0, 0, 1]",
        "NODE 1: ready node 3 has file rows of another generation"]
    assert violations(attrs.evolve(s, files=live)) == []


def test_a_refill_that_keeps_the_old_generation_live_is_caught_at_the_publish(tmp_path, monkeypatch):
    """A planted bug: the refill's publish forgets to retire the node's old files. The
    store's own invariants hold (its new rows are live, its node ready, it owns no
    row); the node's rows do not (NODE 1), and the debug check refuses the commit."""
    monkeypatch.setattr(Catalog, "retire_live", lambda self, c, tid, node_id: [])
    eng = Engine.open(str(tmp_path / "c"), make_layout(ranks=RANKS), 1 << 24)
    try:
        assert eng.driver.debug
        toks = tokens_for(5, 2)
        assert store_tokens(eng, toks).status == "stored"
        node = node_at(eng, toks)
        health.invalidate(eng.flows.health, node, "test")
        with pytest.raises(InvariantViolation, match=rf"NODE 1: ready node {node.id} has file rows on ranks "
                                                     r"\[0, 0, 1, 1\]"):
            store_tokens(eng, toks)
        assert eng.catalog.node_fields()[node.id][3] == "damaged"  # the publish was refused
    finally:
        eng.close()
