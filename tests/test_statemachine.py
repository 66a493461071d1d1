"""Transition tables: validated at definition, illegal events rejected with context."""

from __future__ import annotations

import pytest

from prefixstore.engine.errors import IllegalTransitionError
from prefixstore.statemachine.machine import Machine, MachineDefinitionError
from prefixstore.statemachine.transactions import (
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
