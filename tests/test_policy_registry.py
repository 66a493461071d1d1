"""The eviction policy registry (``statemachine/policy.py``): one class and one entry
make a policy, and both hosts (the engine's ``VictimHeap`` and the simulator) drive it."""

from __future__ import annotations

import random

import attrs
import pytest

from prefixstore.base.errors import InvalidInputError
from prefixstore.replay import sim
from prefixstore.replay.sim import PrefixStorePolicy, TreePolicy, compile_trace, simulate
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
    takes = [pol.takes_retention(n) for n in (*pol.POLICIES, "no-such")]
    assert takes == [True, False, False, False]
    for bad in ("no-such", "", None, 3):
        with pytest.raises(InvalidInputError, match="unknown policy"):
            pol.policy_named(bad)  # type: ignore[arg-type]
        with pytest.raises(InvalidInputError, match="unknown policy"):
            pol.VictimHeap(bad, False)  # type: ignore[arg-type]
    with pytest.raises(InvalidInputError, match="unknown policy"):
        simulate(compile_trace([[1]]), 1, "no-such", block_bytes=1)


def chains(rng: random.Random, n: int) -> list[list[int]]:
    """Requests that extend a random prefix of a recent one by fresh ids."""
    out: list[list[int]] = []
    fresh = 0
    for _ in range(n):
        prefix: list[int] = []
        if out and rng.random() < 0.7:
            base = rng.choice(out[-10:])
            prefix = base[: rng.randint(1, len(base))]
        new = list(range(fresh + 1, fresh + 1 + rng.randint(0 if prefix else 1, 6)))
        fresh += len(new)
        out.append(prefix + new)
    return out


def host(name: str, compiled: bool) -> sim.Policy:
    if pol.policy_named(name).uses_retention:
        return PrefixStorePolicy(policy=name, compiled=compiled)
    return TreePolicy(name, compiled=compiled)


@pytest.mark.parametrize("name", pol.POLICIES)
def test_the_simulators_compiled_order_decides_as_the_policys_action(name: str) -> None:
    """The simulator compiles a registered ordering into its own container; asking the
    policy's ``action`` at every change instead gives the same run, bit for bit."""
    rng = random.Random(11)
    for _ in range(15):
        trace = compile_trace(chains(rng, 120))
        for cap in (2, 5, 13, 40):
            fast, ref = host(name, True), host(name, False)
            got = simulate(trace, cap, fast, block_bytes=1, check=True)
            want = simulate(trace, cap, ref, block_bytes=1, check=True)
            assert got == want, (name, cap)
            assert not isinstance(fast.order, sim._PolicyHeap)  # type: ignore[attr-defined]
            assert isinstance(ref.order, sim._PolicyHeap)  # type: ignore[attr-defined]


def test_an_ordering_entry_alone_makes_a_policy(monkeypatch: pytest.MonkeyPatch) -> None:
    lru_too = pol.OrderedPolicy("lru-too", pol.Ordering(pol.SUBTREE))
    monkeypatch.setitem(pol.REGISTRY, "lru-too", lru_too)
    trace = compile_trace(chains(random.Random(3), 200))
    for cap in (3, 10):
        r = simulate(trace, cap, "lru-too", block_bytes=1, check=True)
        assert r.policy == "lru-too"
        assert r.hits == simulate(trace, cap, "lru", block_bytes=1).hits
    node = Node(1, 7, children={2})
    assert pol.action_for("lru-too", node, True) == (pol.SUBTREE, (pol.NORMAL, 7))
    assert not pol.policy_named("lru-too").retires(True)


def test_orderings_give_each_node_its_action() -> None:
    leaf, damaged = Node(1, 5, snap_used=2), Node(2, 6, state="damaged")
    inner = Node(3, 9, children={1}, has_snapshot=True, snap_used=4)
    assert pol.action_for("prefixstore", damaged, True) == (pol.EVICT, (pol.DAMAGED_FIRST, 6))
    assert pol.action_for("leaf-lru", damaged, True) == (pol.EVICT, (pol.NORMAL, 6))
    assert pol.action_for("lru", leaf, True) == (pol.EVICT, (pol.NORMAL, 5))
    assert pol.action_for("prefixstore", inner, True) == (pol.RETIRE, (pol.NORMAL, 4))
    assert pol.action_for("prefixstore", inner, False) is None
    assert pol.action_for("leaf-lru", inner, True) is None
    assert pol.action_for("lru", inner, True) == (pol.SUBTREE, (pol.NORMAL, 9))
    with pytest.raises(InvalidInputError, match="interior"):
        pol.Ordering("evict")  # type: ignore[arg-type]


def test_a_host_subclass_keeps_its_own_hooks() -> None:
    """Hooks a subclass overrides are called; the others go straight to the container."""

    class Counting(TreePolicy):
        def __init__(self) -> None:
            super().__init__("leaf-lru")
            self.touches = 0

        def on_access(self, node: int) -> None:
            self.touches += 1
            super().on_access(node)

    trace = compile_trace(chains(random.Random(5), 150))
    counting = Counting()
    r = simulate(trace, 6, counting, block_bytes=1, check=True)
    assert counting.touches == r.blocks_hit > 0
    assert r == simulate(trace, 6, "leaf-lru", block_bytes=1)
    assert counting.on_evict == counting.order.on_evict
