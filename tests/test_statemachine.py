"""Transition tables: validated at definition, illegal events rejected with context."""

from __future__ import annotations

import pytest

from prefixstore.base.errors import IllegalTransitionError
from prefixstore.statemachine.machine import Machine, MachineDefinitionError, T
from prefixstore.statemachine.rows import (
    FILE,
    NODE,
    FileRow,
    NodeRow,
    file_row_violations,
    node_row_violations,
)
from prefixstore.statemachine.transactions import (
    COMPACT,
    EVICT,
    INVARIANTS,
    MACHINES,
    RECOVERY_EVENT,
    STORE,
    recovery_direction,
)


def test_duplicate_edge_is_a_definition_error():
    with pytest.raises(MachineDefinitionError, match="duplicate"):
        Machine("m", "A", {"B"}, [("A", "go", "B"), ("A", "go", "B")])


def test_unreachable_state_is_a_definition_error():
    with pytest.raises(MachineDefinitionError, match="unreachable"):
        Machine("m", "A", {"B", "C"}, [("A", "go", "B")])


def test_final_state_with_outgoing_edge_is_a_definition_error():
    with pytest.raises(MachineDefinitionError, match="final"):
        Machine("m", "A", {"B"}, [("A", "go", "B"), ("B", "back", "A")])


def test_state_that_cannot_finish_is_a_definition_error():
    with pytest.raises(MachineDefinitionError, match="cannot reach"):
        Machine("m", "A", {"F"}, [("A", "go", "L"), ("L", "spin", "L"), ("A", "end", "F")])


def test_illegal_event_names_machine_state_and_event():
    with pytest.raises(IllegalTransitionError) as exc:
        STORE.next("PUBLISHED", "failed")
    msg = str(exc.value)
    assert "store" in msg and "PUBLISHED" in msg and "failed" in msg


def test_store_paths():
    assert STORE.next("INTENT", "durable") == "PUBLISHED"
    assert STORE.next("PUBLISHED", "retired") == "DONE"
    assert STORE.next("INTENT", "failed") == "ROLLING_BACK"
    assert STORE.next("ROLLING_BACK", "cleanup_failed") == "ROLLED_BACK"
    assert STORE.is_final("DONE") and STORE.is_final("ROLLED_BACK")


# What recovery does with a transaction found in each unfinished state, written out
# (docs/ARCHITECTURE.md's tables): the event it feeds, the direction, the final state,
# and whether it fires the event itself (None: re-runs the state's outputs, which do).
_ROLL_BACK_OR_FORWARD = {
    "INTENT": ("recover", "back", "ROLLED_BACK", "recover"),
    "ROLLING_BACK": ("cleaned", "back", "ROLLED_BACK", None),
    "PUBLISHED": ("retired", "forward", "DONE", None),
}
RECOVERY = {
    "store": _ROLL_BACK_OR_FORWARD,
    "compact": _ROLL_BACK_OR_FORWARD,
    "evict": {"REMOVED": ("reclaimed", "forward", "DONE", None)},
}


def test_recovery_of_every_state_is_the_documented_one():
    """Only a published state rolls forward (its effects are durable); every other one
    rolls back. Read from the tables, compared with what is written out above."""
    got = {
        kind: {s: (m.recovery(s).event, m.recovery(s).direction, m.recovered(s), m.recovery(s).fire)
               for s in m.states - m.finals}
        for kind, m in MACHINES.items()
    }
    assert got == RECOVERY
    assert {kind: {s: v[0] for s, v in by_state.items()} for kind, by_state in RECOVERY.items()} == RECOVERY_EVENT
    assert {(k, s): recovery_direction(k, s) for k, m in RECOVERY.items() for s in m} == {
        (k, s): v[1] for k, m in RECOVERY.items() for s, v in m.items()}


def test_tables_name_their_outputs():
    assert STORE.outputs("INTENT", "durable") == ("retire_old",)
    assert STORE.outputs("INTENT", "failed") == STORE.outputs("INTENT", "recover") == ("clean_up",)
    assert STORE.outputs("PUBLISHED", "retired") == ()
    assert STORE.published == {"PUBLISHED"} and EVICT.published == {"REMOVED"}
    assert EVICT.initial_outputs == ("reclaim",)
    assert STORE.all_outputs() == COMPACT.all_outputs() == {"retire_old", "clean_up"}
    assert EVICT.all_outputs() == {"reclaim"}


def test_compact_is_store_plus_stale_and_replace_is_gone():
    assert set(COMPACT.edges()) - set(STORE.edges()) == {("INTENT", "stale", "ROLLING_BACK")}
    assert set(STORE.edges()) <= set(COMPACT.edges())
    assert set(MACHINES) == {"store", "compact", "evict"}
    with pytest.raises(IllegalTransitionError):
        STORE.next("INTENT", "stale")


def test_abort_is_failed_before_publish_and_recovery_after():
    assert STORE.abort("INTENT").fire == "failed"
    assert STORE.abort("PUBLISHED") == STORE.recovery("PUBLISHED")
    assert STORE.abort("PUBLISHED").fire is None and STORE.abort("PUBLISHED").outputs == ("retire_old",)
    assert EVICT.abort("REMOVED").outputs == ("reclaim",)


def test_edges_into_a_state_must_agree_on_its_outputs():
    with pytest.raises(MachineDefinitionError, match="disagree"):
        Machine("m", "A", {"C"}, [T("A", "x", "B", "one"), T("A", "y", "B", "two"), T("B", "z", "C")])


def test_recovery_must_be_declared_once_per_state():
    with pytest.raises(MachineDefinitionError, match="exactly one recovery"):
        Machine("m", "A", {"C"}, [T("A", "x", "B", recovery=True), T("B", "z", "C")], published={"B"})


def test_recovery_must_go_the_way_the_table_publishes():
    # recovery of an unpublished state must not drive it forward into a published one
    with pytest.raises(MachineDefinitionError, match="wrong way"):
        Machine("m", "A", {"OK", "UNDONE"},
                [T("A", "publish", "P", recovery=True), T("A", "undo", "UNDONE"),
                 T("P", "done", "OK", recovery=True)], published={"P"})
    # a published state's edge must not end where an undone transaction ends
    with pytest.raises(MachineDefinitionError, match="published and unpublished"):
        Machine("m", "A", {"OK", "UNDONE"},
                [T("A", "publish", "P"), T("A", "undo", "UNDONE", recovery=True),
                 T("P", "done", "OK"), T("P", "lost", "UNDONE", recovery=True)], published={"P"})


def test_every_state_has_its_invariants():
    for kind, m in MACHINES.items():
        assert set(INVARIANTS[kind]) == set(m.states), kind
        assert all(INVARIANTS[kind][s] for s in m.states), kind


def test_row_tables():
    assert FILE.next("absent", "reserved") == "writing"
    assert FILE.next("writing", "published") == "live"
    assert FILE.next("live", "retired") == FILE.next("writing", "abandoned") == "garbage"
    assert FILE.next("garbage", "unlinked") == "removed"
    assert FILE.sources("retired") == {"live"}
    with pytest.raises(IllegalTransitionError, match="file.*live.*published|file.*published.*live"):
        FILE.next("live", "published")
    with pytest.raises(IllegalTransitionError):
        FILE.next("garbage", "published")  # garbage never comes back
    assert NODE.next("ready", "invalidated") == "damaged"
    assert NODE.next("damaged", "published") == NODE.next("absent", "published") == "ready"
    assert NODE.next("damaged", "removed") == "removed"
    with pytest.raises(IllegalTransitionError):
        NODE.next("damaged", "invalidated")


def test_row_invariants():
    assert file_row_violations(FileRow(0, "a", None, 1, 3, None, "writing", 5)) == []
    assert file_row_violations(FileRow(0, "a", 2, 1, 3, None, "writing", 5))[0].startswith("FILE 1:")
    assert file_row_violations(FileRow(0, "a", None, 1, 3, None, "live", None))[0].startswith("FILE 2:")
    assert file_row_violations(FileRow(0, "a", 2, 1, 3, None, "garbage", None))[0].startswith("FILE 3:")
    node = NodeRow(2, None, 0, 1, "ready", 1, False)
    rows = [FileRow(r, "a", 2, 1, 3, None, "live", None) for r in range(2)]
    assert node_row_violations(node, rows, 2) == []
    assert node_row_violations(node, rows[:1], 2)[0].startswith("NODE 1:")
    damaged = NodeRow(2, None, 0, 1, "damaged", 1, False)
    assert node_row_violations(damaged, rows[:1], 2) == []
