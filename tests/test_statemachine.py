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


def _recovered(m: Machine, by_state: dict[str, str], state: str) -> str:
    """The final state recovery's events drive ``state`` to; fails on a loop."""
    at = state
    for _ in range(len(m.states)):
        if m.is_final(at):
            return at
        at = m.next(at, by_state[at])
    raise AssertionError(f"{m.name}: recovery from {state} never reaches a final state")


def test_every_recovery_event_is_legal():
    for kind, by_state in RECOVERY_EVENT.items():
        m = MACHINES[kind]
        for state, event in by_state.items():
            m.next(state, event)  # raises if illegal
            # recovery ends the transaction: forward to DONE if it had published, else back
            want = "DONE" if recovery_direction(kind, state) == "forward" else "ROLLED_BACK"
            assert _recovered(m, by_state, state) == want, (kind, state)
        # every non-final state has a recovery event
        assert set(by_state) == set(m.states - m.finals), kind


def test_every_recovery_event_is_the_tables_recovery():
    for kind, m in MACHINES.items():
        for state in m.states - m.finals:
            step = m.recovery(state)
            assert step.event == RECOVERY_EVENT[kind][state] == m.recovery_event(state)
            assert step.direction == recovery_direction(kind, state) == m.direction(state)
            assert m.recovered(state) in (m.committed_finals() if state in m.published else m.finals - m.committed_finals())


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
