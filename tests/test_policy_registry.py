"""The eviction policy registry (``statemachine/policy.py``): one class and one entry
make a policy, and both hosts (the engine's ``VictimHeap`` and the simulator) drive it."""

from __future__ import annotations

import attrs
import pytest

from prefixstore.engine.errors import InvalidInputError
from prefixstore.replay.sim import compile_trace, simulate
from prefixstore.statemachine import policy as pol


class NewestLeafFirst:
    """A test policy: the most recently used leaf goes first."""

    name = "mru-leaf"
    uses_retention = False

    def retires(self, layout_has_snapshot: bool) -> bool:
        return False

    def action(self, node, layout_has_snapshot, retention):  # type: ignore[no-untyped-def]
        return (pol.EVICT, (pol.NORMAL, -node.last_used)) if node.is_leaf else None


@attrs.define
class Node:
    id: int
    last_used: int
    children: set[int] = attrs.field(factory=set)
    state: str = "ready"
    has_snapshot: bool = False
    snap_used: int = 0
    nbytes: int = 1

    @property
    def is_leaf(self) -> bool:
        return not self.children


@pytest.fixture
def mru(monkeypatch: pytest.MonkeyPatch) -> str:
    monkeypatch.setitem(pol.REGISTRY, NewestLeafFirst.name, NewestLeafFirst())
    return NewestLeafFirst.name


def test_a_registered_policy_orders_the_engines_heap(mru: str) -> None:
    nodes = {n.id: n for n in (Node(1, 10), Node(2, 30), Node(3, 20, children={4}), Node(4, 5))}
    heap = pol.VictimHeap(mru, layout_has_snapshot=True)
    assert not heap.retires
    heap.rebuild(nodes.values())
    assert heap.pop(nodes.get, lambda nid, action: False) == (2, pol.EVICT)  # newest leaf
    assert heap.pop(nodes.get, lambda nid, action: nid == 1) == (4, pol.EVICT)  # 1 blocked
    assert heap.pop(nodes.get, lambda nid, action: False) == (1, pol.EVICT)  # put back
    assert heap.pop(nodes.get, lambda nid, action: False) is None  # 3 is interior


def test_a_registered_policy_runs_in_the_simulator(mru: str) -> None:
    # capacity 2. r2 needs room: leaf-lru evicts 1 (oldest), mru-leaf evicts 2 (newest),
    # so r3's [1] hits; r4 then evicts 1 (just touched) for 2.
    trace = compile_trace([[1], [2], [3], [1], [2]])
    assert simulate(trace, 2, "leaf-lru", block_bytes=1, check=True).hits == (0, 0, 0, 0, 0)
    r = simulate(trace, 2, mru, block_bytes=1, check=True)
    assert r.policy == mru
    assert r.hits == (0, 0, 0, 1, 0)
    assert (r.stored, r.evicted) == (4, 2)


def test_registered_policies_and_unknown_names() -> None:
    assert pol.POLICIES == ("prefixstore", "leaf-lru", "lru")
    assert all(pol.policy_named(name).name == name for name in pol.POLICIES)
    assert pol.policy_named("prefixstore").retires(True)
    assert not pol.policy_named("prefixstore").retires(False)
    assert not pol.policy_named("lru").retires(True)
    assert [pol.takes_retention(n) for n in (*pol.POLICIES, "no-such")] == [True, False, False, False]
    for bad in ("no-such", "", None, 3):
        with pytest.raises(InvalidInputError, match="unknown policy"):
            pol.policy_named(bad)  # type: ignore[arg-type]
        with pytest.raises(InvalidInputError, match="unknown policy"):
            pol.VictimHeap(bad, False)  # type: ignore[arg-type]
    with pytest.raises(InvalidInputError, match="unknown policy"):
        simulate(compile_trace([[1]]), 1, "no-such", block_bytes=1)
