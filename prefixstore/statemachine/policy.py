"""Eviction policies: which node to reclaim next, and how. Pure: no I/O.

The engine's :class:`VictimHeap` keeps a heap of ``(key, seq, node_id, action)``
entries with lazy invalidation: an entry is checked against the node's current state
when popped, so touching a node just pushes a fresh entry. Selection is O(log n)
amortised per victim; the heap is rebuilt when stale entries outnumber live nodes.

Actions:

- ``evict``: remove a leaf (its whole backing is freed).
- ``retire_snapshot``: a compactable ancestor (interior, ready, has a snapshot)
  keeps its segment for its descendants; its snapshot backing is freed. The new
  segment-only generation is written (and charged) before the old one is freed, so
  a retirement needs ``retire_rewrite_bytes`` of headroom and frees
  ``nbytes - rewrite`` (the old generation counted once, the new one charged).
- ``evict_subtree``: plain LRU's action on an interior node (it and every
  descendant go).

Policies (the registry ``REGISTRY``, one :class:`Ordering` each; hosts look them up by name):

- ``prefixstore`` (the seed's fix): leaves by recency of use, and compactable
  ancestors by recency of their *snapshot's* use, in one order. A long
  conversation's interior snapshots, never restored as endpoints, age out first.
  Damaged leaves (charged in full, never served) go before every ready candidate.
  Hosts order its leaves by the shared retention rule (``statemachine/retention.py``)
  when they plug one in (``uses_retention``).
- ``leaf-lru`` (the pre-fix behaviour): only leaves, by recency.
- ``lru``: any node by recency; an interior victim takes its subtree with it.

Both hosts drive these policies: the engine asks ``action`` through :class:`VictimHeap`;
the trace simulator (``replay/sim.py``, ``TreePolicy``) compiles each ``ordering`` once
into a container of its own (a leaf heap, a recency list) and asks ``action`` only for
a policy without one. A new policy is an :class:`OrderedPolicy` entry in ``REGISTRY``
(or any object satisfying :class:`EvictionPolicy`); the engine's ``policy=`` option,
the CLI choices, the engine replay and its ``--compare``, the simulator and the fuzzer
read the registry when they run (``registered()``), so an entry added at any time is
picked up with no list of names to edit (with ``uses_retention``, the replay and the
simulator also plug in the retention rule). ``POLICIES``: the built-in names.

Pressure and recency. The *order* is recency (within the damaged-first class). The
*amount* is actual backing pressure: the engine keeps taking victims until the real
charged bytes (ready + damaged + garbage files) fall below its goal, crediting each
victim with what it really freed, and it reclaims loose garbage before any victim.
Bytes deliberately do not reorder victims (no GreedyDual-Size weighting): the most
valuable checkpoints are the long ones (prefill is superlinear in context), and a
size-weighted order would evict exactly those first.

Retention (opt-in, ``VictimHeap.set_retention``): an object with ``priority(node)``
replaces a leaf's recency in its key (e.g. ``statemachine.admission.RetentionAdmission``:
recency plus a bonus earned by reuse). The priority must stay the same while the
node's ``last_used`` does (entries are checked by recomputing it); it is asked for
every node offered, interior ones included, so it is fixed when the node is touched
(an interior node becoming a leaf keeps the key of its last use). The object is told
of every leaf popped as a victim (``on_victim``). Without one, keys are as above.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from prefixstore.base.errors import InvalidInputError

EVICT = "evict"
RETIRE = "retire_snapshot"
SUBTREE = "evict_subtree"
DAMAGED_FIRST = 0
NORMAL = 1

Key = tuple[int, float]  # (class, recency or retention priority): smaller goes first
Entry = tuple[Key, int, int, str]  # (key, seq, node_id, action)


@runtime_checkable
class Retention(Protocol):
    """Leaf eviction keys replacing recency (see the module docstring)."""

    def priority(self, node: NodeView) -> float: ...
    def on_victim(self, node: NodeView) -> None: ...
    def forget(self, live_ids: set[int]) -> None: ...


class NodeView(Protocol):
    id: int
    state: str
    has_snapshot: bool
    last_used: int
    snap_used: int
    nbytes: int

    @property
    def is_leaf(self) -> bool: ...


class EvictionPolicy(Protocol):
    """Which action a policy takes on a node, and its ordering key (smaller goes first).

    ``action`` must be a pure function of the node's fields, ``layout_has_snapshot``
    and ``retention.priority(node)`` (a leaf's key: its recency ``last_used``, or that
    priority when a retention object is plugged in): hosts ask again whenever one of
    them changes, and the engine recomputes it to tell stale heap entries. An
    :class:`OrderedPolicy` also states its order as data (``ordering``), which a host
    may compile into its own container; any other policy is driven by ``action`` alone.
    """

    name: str
    uses_retention: bool
    """Whether hosts plug in the shared retention rule for this policy's leaf keys."""

    def retires(self, layout_has_snapshot: bool) -> bool:
        """Whether it may return ``RETIRE`` on a layout like this."""
        ...

    def action(
        self, node: NodeView, layout_has_snapshot: bool, retention: Retention | None
    ) -> tuple[str, Key] | None: ...


@dataclass(frozen=True, slots=True)
class Ordering:
    """A policy's candidates and keys as data (smaller goes first).

    Leaves are always candidates (``evict``), keyed ``(class, last_used)``, or the
    retention priority in place of ``last_used`` when one is plugged in; with
    ``damaged_first`` a leaf that is not ready has class ``DAMAGED_FIRST``. Interior
    nodes: with ``interior=None`` never; with ``RETIRE`` a ready one holding a
    snapshot, on a snapshot layout, keyed ``(NORMAL, snap_used)``; with ``SUBTREE``
    every one, keyed ``(NORMAL, last_used)``. :class:`OrderedPolicy` derives the
    action from it; a host may compile it into its own container instead (the
    simulator does), which must order exactly as that action.
    """

    interior: str | None = None
    damaged_first: bool = False

    def __post_init__(self) -> None:
        if self.interior not in (None, RETIRE, SUBTREE):
            raise InvalidInputError(
                f"interior must be None, {RETIRE!r} or {SUBTREE!r}, got {self.interior!r}"
            )


class OrderedPolicy:
    """A policy defined by its :class:`Ordering` (each registered one)."""

    __slots__ = ("name", "uses_retention", "ordering", "_interior", "_damaged_first")

    def __init__(self, name: str, ordering: Ordering, *, uses_retention: bool = False) -> None:
        self.name = name
        self.uses_retention = uses_retention
        self.ordering = ordering
        self._interior = ordering.interior
        self._damaged_first = ordering.damaged_first

    def retires(self, layout_has_snapshot: bool) -> bool:
        return layout_has_snapshot and self._interior == RETIRE

    def action(
        self, node: NodeView, layout_has_snapshot: bool, retention: Retention | None
    ) -> tuple[str, Key] | None:
        if node.is_leaf:
            cls = DAMAGED_FIRST if self._damaged_first and node.state != "ready" else NORMAL
            return EVICT, (cls, node.last_used if retention is None else retention.priority(node))
        if self._interior == SUBTREE:
            return SUBTREE, (NORMAL, node.last_used)
        if (
            self._interior == RETIRE
            and layout_has_snapshot
            and node.state == "ready"
            and node.has_snapshot
        ):
            return RETIRE, (NORMAL, node.snap_used)
        return None


REGISTRY: dict[str, EvictionPolicy] = {
    p.name: p
    for p in (
        # leaves (damaged first), and snapshot retirements by the snapshot's recency
        OrderedPolicy("prefixstore", Ordering(RETIRE, damaged_first=True), uses_retention=True),
        # only leaves, by recency
        OrderedPolicy("leaf-lru", Ordering()),
        # any node by recency; an interior victim takes its subtree
        OrderedPolicy("lru", Ordering(SUBTREE)),
    )
}
POLICIES = tuple(REGISTRY)
"""The built-in policies' names (the registry as this module defines it)."""
DEFAULT = "prefixstore"
"""The engine's policy unless told otherwise."""


def registered() -> tuple[str, ...]:
    """The names of every policy registered now, in registration order."""
    return tuple(REGISTRY)


def policy_named(name: str) -> EvictionPolicy:
    """The registered policy ``name``; InvalidInputError naming the known ones."""
    found = REGISTRY.get(name) if isinstance(name, str) else None
    if found is None:
        raise InvalidInputError(f"unknown policy {name!r}; known: {', '.join(REGISTRY)}")
    return found


def takes_retention(name: str) -> bool:
    """Whether ``name`` is a registered policy whose hosts plug in the retention rule."""
    found = REGISTRY.get(name) if isinstance(name, str) else None
    return found is not None and found.uses_retention


def action_for(
    policy: str, node: NodeView, layout_has_snapshot: bool, retention: Retention | None = None
) -> tuple[str, Key] | None:
    """The action ``policy`` would take on ``node`` and its ordering key, or None."""
    return policy_named(policy).action(node, layout_has_snapshot, retention)


def retire_rewrite_bytes(nbytes: int, snapshot_bytes_all_ranks: int) -> int:
    """Upper bound of a node's segment-only generation, from its current backing.

    The new shards drop the snapshot payload and its header entry (which is longer
    than any header growth: a generation digit, the 8-byte padding).
    """
    return max(0, nbytes - snapshot_bytes_all_ranks)


class VictimHeap:
    """Candidates for eviction under one policy, cheapest (oldest) first.

    Also tracks the largest retirement candidate (``largest_retire``), so the engine
    can keep enough headroom for the rewrite a retirement needs.
    """

    def __init__(self, policy: str, layout_has_snapshot: bool) -> None:
        self.impl = policy_named(policy)
        self.policy = policy
        self.layout_has_snapshot = layout_has_snapshot
        self.retires = self.impl.retires(layout_has_snapshot)
        self._heap: list[Entry] = []
        self._sizes: list[tuple[int, int, int]] = []  # (-nbytes, seq, node_id) of RETIRE candidates
        self._seq = itertools.count()
        self.retention: Retention | None = None

    def set_retention(self, retention: Retention | None, nodes: Iterable[NodeView]) -> None:
        """Order leaves by ``retention.priority`` (None: by recency) and rebuild."""
        self.retention = retention
        self.rebuild(nodes)

    def __len__(self) -> int:
        return len(self._heap)

    def offer(self, node: NodeView) -> None:
        """(Re)consider ``node`` after it was created, touched, or gained/lost children."""
        if self.retention is not None:
            self.retention.priority(node)  # fixed at the touch, for interior nodes too
        a = self.impl.action(node, self.layout_has_snapshot, self.retention)
        if a is None:
            return
        seq = next(self._seq)
        heapq.heappush(self._heap, (a[1], seq, node.id, a[0]))
        if a[0] == RETIRE:
            heapq.heappush(self._sizes, (-node.nbytes, seq, node.id))

    def rebuild(self, nodes: Iterable[NodeView]) -> None:
        self._heap, self._sizes = [], []
        live: set[int] = set()
        for n in nodes:
            live.add(n.id)
            a = self.impl.action(n, self.layout_has_snapshot, self.retention)
            if a is not None:
                seq = next(self._seq)
                self._heap.append((a[1], seq, n.id, a[0]))
                if a[0] == RETIRE:
                    self._sizes.append((-n.nbytes, seq, n.id))
        heapq.heapify(self._heap)
        heapq.heapify(self._sizes)
        if self.retention is not None:
            self.retention.forget(live)

    def pop_valid(self, lookup: Callable[[int], NodeView | None]) -> Entry | None:
        """Remove and return the oldest entry that is still current; None when empty.

        Stale entries (node gone, or its action or key changed since) are dropped.
        """
        while self._heap:
            entry = heapq.heappop(self._heap)
            if self.is_current(entry, lookup):
                if self.retention is not None and entry[3] == EVICT:
                    self.retention.on_victim(lookup(entry[2]))
                return entry
            # stale: a fresh entry exists if the node is still a candidate
        return None

    def is_current(self, entry: Entry, lookup: Callable[[int], NodeView | None]) -> bool:
        """Whether ``entry`` still names its node's current action and key."""
        key, _seq, nid, action = entry
        node = lookup(nid)
        return node is not None and self.impl.action(
            node, self.layout_has_snapshot, self.retention
        ) == (action, key)

    def push(self, entry: Entry) -> None:
        """Put back an entry taken by ``pop_valid`` (e.g. a blocked candidate)."""
        heapq.heappush(self._heap, entry)

    def pop(
        self,
        lookup: Callable[[int], NodeView | None],
        blocked: Callable[[int, str], bool],
    ) -> tuple[int, str] | None:
        """The oldest valid, unblocked candidate ``(node_id, action)``; None if none.

        Blocked candidates (pinned, fenced, no room to rewrite) are put back.
        """
        held: list[Entry] = []
        try:
            while (entry := self.pop_valid(lookup)) is not None:
                if blocked(entry[2], entry[3]):
                    held.append(entry)
                    continue
                return entry[2], entry[3]
            return None
        finally:
            for entry in held:
                self.push(entry)

    def largest_retire(self, lookup: Callable[[int], NodeView | None]) -> int:
        """Backing bytes of the largest current retirement candidate (0 if none)."""
        while self._sizes:
            neg, _seq, nid = self._sizes[0]
            node = lookup(nid)
            if (
                node is not None
                and node.nbytes == -neg
                and (a := self.impl.action(node, self.layout_has_snapshot, self.retention))
                and a[0] == RETIRE
            ):
                return -neg
            heapq.heappop(self._sizes)
        return 0

    def compact_if_stale(self, live: int, nodes: Callable[[], Iterable[NodeView]]) -> None:
        if len(self._heap) > 4 * max(live, 1024) or len(self._sizes) > 4 * max(live, 1024):
            self.rebuild(nodes())
