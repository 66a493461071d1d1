"""A fast block-level prefix-cache simulator for comparing eviction policies on a trace.

Pure: no engine, no files. The cache holds nodes of the prefix tree. A node is a chain
position ``(parent node, block id)``; in Mooncake traces ids are already prefix-unique,
so a node is just a block id whose parent is the previous id of any request holding it.
Every block costs ``block_bytes``; the capacity is ``capacity_bytes // block_bytes``
blocks.

Per request (file order):

1. **Lookup**: the hit is the leading run of the request's blocks that are cached. The
   cache is always *whole* (a cached node's ancestors are cached), so this is every
   cached block of the request. Token hits are ``min(hit * block_tokens, input_length)``.
2. **Touch** the hit blocks, root to leaf (``Policy.on_access``).
3. **Store** the missing blocks root to leaf. The policy may refuse one
   (``Policy.admit``: an engine counts a skipped store, reason ``'admission'``); then
   the rest of the request is not stored either, keeping the tree whole. A full cache
   asks ``Policy.choose_victim`` for a node to evict; an interior victim takes its
   cached subtree with it. The request's own blocks are pinned while it is stored: a
   pinned victim (or ``None``) means no room, and the rest of the request is skipped.

Prefill seconds come from a cumulative curve ``prefill_s(tokens)`` (default
``5e-5*t + 1e-10*t**2``): prefilling ``(h, T]`` on top of ``h`` cached tokens costs
``prefill_s(T) - prefill_s(h)``, so a hit of ``h`` tokens saves ``prefill_s(h)``.

Policies (``POLICIES``, read from the registry whenever asked): the engine's, from
the registry of :mod:`prefixstore.statemachine.policy` (a new policy goes there, one
entry, and runs here unchanged), each hosted by :class:`TreePolicy`; a policy that takes the shared
retention rule by :class:`PrefixStorePolicy`. A host compiles the policy's ordering
once per run into a container of its own (:func:`compile_order`: a leaf heap or a
recency list), so no event asks the policy anything. Here every node is one ready
block without a snapshot, so a policy's damaged-first and retirement cases never
occur:

- ``leaf-lru``: evict the least recently used *leaf* (the tree stays whole for free).
- ``lru``: evict the least recently used block; its cached descendants go with it.
  Blocks are touched root to leaf, so a chain's root is its oldest block: this is the
  prefix-oblivious baseline (a per-block LRU whose orphaned descendants are dropped).
- ``prefixstore``: see :class:`PrefixStorePolicy`: leaf eviction by recency plus a
  retention bonus earned by reuse (remembered across evictions by a ghost table), and
  admission that skips partial last blocks and, when the cache keeps too little of
  what comes back, the long never-seen tails of requests.

Measured on the Mooncake conversation trace (hit ratio by blocks, as a share of the
optimum of :mod:`prefixstore.replay.optimal`; capacity as a share of unique bytes):

=============  =====  =====  =====  =====  =====
capacity          1%     2%     5%    10%    25%
=============  =====  =====  =====  =====  =====
lru            0.212  0.250  0.533  0.760  0.965
leaf-lru       0.213  0.252  0.534  0.761  0.965
prefixstore    0.448  0.496  0.631  0.807  0.965
=============  =====  =====  =====  =====  =====

Other ideas tried there and not kept: segmented LRU (probation + protected: at best
0.574 at 5%, worse with a large protected segment, since a conversation's next turn
needs its newest blocks, not only its reused ones); admission by request features (hit
length, turn count, new-suffix length, output length: none separates reused blocks from
the rest well: at most about +0.01 at 5%); class-weighted expiry with oracle per-class reuse
probabilities (0.587 at 5%); strict second-hit admission (0.575 at 5%, 0.64 at 10%:
it loses every first reuse, 42% of all reuses); a window fixed at 16 blocks (0.637 at
5% but 0.77 at 10% and 0.87 at 25%). Even oracle admission (storing exactly the
blocks that will be reused) with leaf-lru reaches only 0.82 at 5%. The optimum is
the unbounded cache's hit count from 4.45% of unique bytes (8,138 blocks) up; the
online gap is which conversations continue (about a quarter of new blocks are ever
reused) and when (reuse gaps: median 114 s, p90 519 s).
"""

from __future__ import annotations

import functools
import heapq
from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping, Sequence

from prefixstore.base.errors import InvalidInputError
from prefixstore.replay.compiled import (
    DEFAULT_BLOCK_BYTES,
    PREFILL_A,
    PREFILL_B,
    CompiledTrace,
    PrefillFn,
    SimResult,
    as_compiled,
    capacity_in_blocks,
    compile_trace,
    default_prefill_s,
    summarize,
)
from prefixstore.replay.optimal import belady
from prefixstore.replay.trace import Request
from prefixstore.statemachine import policy as eviction
from prefixstore.statemachine.policy import Key
from prefixstore.statemachine.retention import RetentionParams, RetentionRule, RuleHost, Sightings

__all__ = [  # with the compiled-trace names it re-exports
    "CacheState",
    "CompiledTrace",
    "DEFAULT_BLOCK_BYTES",
    "LRU",
    "LeafLRU",
    "POLICIES",
    "PREFILL_A",
    "PREFILL_B",
    "Policy",
    "PrefillFn",
    "PrefixStorePolicy",
    "SimResult",
    "TreePolicy",
    "as_compiled",
    "capacity_in_blocks",
    "compile_order",
    "compile_trace",
    "default_prefill_s",
    "evaluate",
    "make_policy",
    "policy_for",
    "simulate",
    "summarize",
]

# ----------------------------------------------------------------------------------
# Cache state and the policy interface


class CacheState:
    """The simulator's tree state, readable by policies (they must not change it)."""

    __slots__ = (
        "parent",
        "depth",
        "cached",
        "nchild",
        "pin",
        "req",
        "size",
        "capacity",
        "block_tokens",
        "_children",
        "_trace",
    )

    def __init__(self, trace: CompiledTrace, capacity_blocks: int) -> None:
        n = trace.n_nodes
        self._trace = trace
        self.parent = trace.parent
        self.depth = trace.depth
        self.cached = bytearray(n)
        self.nchild = [0] * n  # cached children
        self.pin = [-1] * n  # request index whose path pins the node
        self.req = -1
        self.size = 0
        self.capacity = capacity_blocks
        self.block_tokens = trace.block_tokens
        self._children: list[list[int]] | None = None

    def is_leaf(self, node: int) -> bool:
        """A cached node with no cached children."""
        return bool(self.cached[node]) and self.nchild[node] == 0

    def is_pinned(self, node: int) -> bool:
        """On the path of the request being served."""
        return self.pin[node] == self.req

    def children(self) -> list[list[int]]:
        if self._children is None:
            self._children = self._trace.children()
        return self._children


class Policy:
    """An online policy. Hooks are called by the simulator; defaults do nothing.

    ``choose_victim`` must return a cached node (a leaf, or an interior node whose
    subtree should go with it) or ``None`` when it has nothing to offer; it should not
    return pinned nodes unless nothing else is evictable. It must not change state:
    the simulator calls ``on_evict`` for every node it removes.
    """

    name = "policy"
    state: CacheState

    def bind(self, state: CacheState) -> None:
        self.state = state

    def begin_request(self, req: int, path: Sequence[int], hit: int, input_length: int) -> None:
        """A request arrives; ``hit`` of its ``path`` nodes are cached."""

    def on_access(self, node: int) -> None:
        """A cached node of the request was hit (called root to leaf)."""

    def admit(self, node: int, pos: int) -> bool:
        """Whether to store ``node`` (position ``pos`` in the request); False skips the rest."""
        return True

    def on_insert(self, node: int) -> None:
        """``node`` was stored."""

    def choose_victim(self) -> int | None:
        raise NotImplementedError

    def on_evict(self, node: int) -> None:
        """``node`` was removed (its parent's ``nchild`` is already updated)."""


class _LeafHeap:
    """Leaves ordered by a per-node key, ties to the smaller node id: a min-heap of
    ``(key, node)`` with lazy invalidation (an entry is current while its node is a
    cached leaf holding that key). Compiled from an ordering whose only candidates
    here are leaves; keyed by the clock (``touch``) or by the host (``set``)."""

    __slots__ = ("heap", "key", "state", "clock")

    def __init__(self, state: CacheState) -> None:
        self.state = state
        self.heap: list[tuple[float, int]] = []
        self.key: list[float] = [0.0] * len(state.parent)
        self.clock = 0

    def set(self, node: int, key: float) -> None:
        """``node`` was touched and keyed ``key``."""
        self.key[node] = key
        if self.state.nchild[node] == 0:
            heapq.heappush(self.heap, (key, node))

    def touch(self, node: int) -> None:
        """``node`` was touched: keyed by its recency (one clock tick per touch)."""
        self.clock += 1
        self.key[node] = self.clock
        if self.state.nchild[node] == 0:
            heapq.heappush(self.heap, (self.clock, node))

    on_insert = touch  # its parent gained a child: its entries are stale by ``nchild``

    def on_evict(self, node: int) -> None:
        p = self.state.parent[node]
        if p >= 0 and self.state.nchild[p] == 0:
            heapq.heappush(self.heap, (self.key[p], p))  # it became a leaf

    def choose_victim(self) -> int | None:
        st = self.state
        heap = self.heap
        cached, nchild, key, pin, req = st.cached, st.nchild, self.key, st.pin, st.req
        skipped: list[tuple[float, int]] = []
        found: int | None = None
        while heap:
            k, node = heap[0]
            if not cached[node] or nchild[node] or key[node] != k:
                heapq.heappop(heap)
                continue
            if pin[node] == req:  # the request's own leaf: look past it
                skipped.append(heapq.heappop(heap))
                continue
            found = node
            break
        for item in skipped:
            heapq.heappush(heap, item)
        return found


class _RecencyList:
    """Every cached node, least recently touched first (an ordered dict). Compiled
    from an ordering of all nodes by recency: the oldest node is the victim, and if it
    is the request's own, so is every other (they were all touched later), so there
    is no room."""

    __slots__ = ("order",)

    def __init__(self) -> None:
        self.order: OrderedDict[int, None] = OrderedDict()

    def touch(self, node: int) -> None:
        self.order[node] = None
        self.order.move_to_end(node)

    on_insert = touch

    def on_evict(self, node: int) -> None:
        del self.order[node]

    def choose_victim(self) -> int | None:
        for node in self.order:
            return node
        return None


class _NodeView:
    """A simulator node as the shared policies read it (``statemachine.policy.NodeView``).

    One view is reused: :meth:`at` points it at a node. The simulator has neither
    damaged nodes nor snapshots, so every node is ``ready`` and never retires.
    """

    __slots__ = ("id", "last_used", "is_leaf", "_cached", "_nchild", "_last")

    state = "ready"
    has_snapshot = False
    snap_used = 0
    nbytes = 1

    def __init__(self, state: CacheState, last: list[int]) -> None:
        self._cached, self._nchild, self._last = state.cached, state.nchild, last
        self.id = self.last_used = 0
        self.is_leaf = False

    def at(self, node: int) -> _NodeView:
        self.id = node
        self.last_used = self._last[node]
        self.is_leaf = bool(self._cached[node]) and self._nchild[node] == 0
        return self


class _TouchKeys(list[float]):
    """Each node's retention priority, fixed at its touch, as the shared policies ask
    it (``statemachine.policy.Retention``)."""

    def priority(self, node: eviction.NodeView) -> float:
        return self[node.id]

    def on_victim(self, node: eviction.NodeView) -> None:
        """Nothing: the host learns from each eviction itself (``on_evict``)."""

    def forget(self, live_ids: set[int]) -> None:
        """Nothing: a list of every node's key, never trimmed."""


class _PolicyHeap:
    """Any policy, asked through its ``action``: whenever something it reads changes
    (a touch; gaining or losing children), its answer is kept as the node's current
    key, and candidates wait in a min-heap of ``(key, node)``, an entry current while
    it holds its cached node's current key. Ties go to the smaller node id.

    A node's ``last_used`` is ``last`` (the clock at its last touch: this container's
    own for ``touch``, the host's for ``set``); with ``keyed`` leaves are keyed by
    ``set``'s keys (``key``) in place of recency.
    """

    def __init__(
        self,
        impl: eviction.EvictionPolicy,
        state: CacheState,
        last: list[int] | None = None,
        keyed: bool = False,
    ) -> None:
        n = len(state.parent)
        self.state = state
        self.last = [0] * n if last is None else last
        self.key = _TouchKeys([0.0] * n)
        self.offered: list[Key | None] = [None] * n  # each node's current key; None: none
        self.heap: list[tuple[int, float, int]] = []  # (class, value, node): a flat Key
        self._action, self._at = impl.action, _NodeView(state, self.last).at
        self._keys = self.key if keyed else None
        self.clock = 0

    def offer(self, node: int) -> None:
        """Ask the policy again about ``node``."""
        a = self._action(self._at(node), False, self._keys)
        if a is None:
            self.offered[node] = None
        elif a[1] != self.offered[node]:
            key = self.offered[node] = a[1]
            heapq.heappush(self.heap, (key[0], key[1], node))

    def set(self, node: int, key: float) -> None:
        """``node`` was touched (``last`` already holds its time) and keyed ``key``;
        its parent is asked again too, in case it just gained ``node``."""
        self.key[node] = key
        self.offer(node)
        p = self.state.parent[node]
        if p >= 0:
            self.offer(p)

    def touch(self, node: int) -> None:
        self.clock += 1
        self.last[node] = self.clock
        self.offer(node)

    def on_insert(self, node: int) -> None:
        self.touch(node)
        p = self.state.parent[node]
        if p >= 0:
            self.offer(p)  # it gained a child

    def on_evict(self, node: int) -> None:
        self.offered[node] = None
        p = self.state.parent[node]
        if p >= 0 and self.state.nchild[p] == 0:
            self.offer(p)  # it lost its last child

    def choose_victim(self) -> int | None:
        st, heap, offered = self.state, self.heap, self.offered
        cached, pin, req = st.cached, st.pin, st.req
        skipped: list[tuple[int, float, int]] = []
        found: int | None = None
        while heap:
            cls, value, node = heap[0]
            key = offered[node]
            if not cached[node] or key is None or key[0] != cls or key[1] != value:
                heapq.heappop(heap)  # stale: the node's current key, if any, is offered
                continue
            if pin[node] == req:  # the request's own node: look past it
                skipped.append(heapq.heappop(heap))
                continue
            found = node
            break
        for item in skipped:
            heapq.heappush(heap, item)
        return found


_Order = _LeafHeap | _RecencyList | _PolicyHeap


def compile_order(
    impl: eviction.EvictionPolicy,
    state: CacheState,
    last: list[int] | None = None,
    *,
    keyed: bool = False,
    compiled: bool = True,
) -> _Order:
    """The container ordering ``impl``'s candidates here, built once per run.

    Every node here is ready without a snapshot, so an :class:`~prefixstore.
    statemachine.policy.Ordering` without ``SUBTREE`` has only leaves as candidates
    (a :class:`_LeafHeap`), and one with it, keyed by recency, every node by recency
    (a :class:`_RecencyList`). Anything else (no ``ordering``; ``SUBTREE`` with keyed
    leaves; ``compiled=False``) asks the policy's ``action`` (a :class:`_PolicyHeap`).
    ``keyed``: leaves take the host's keys (``set``) instead of recency.
    """
    ordering: eviction.Ordering | None = getattr(impl, "ordering", None)
    if compiled and ordering is not None:
        if ordering.interior != eviction.SUBTREE:
            return _LeafHeap(state)
        if not keyed:
            return _RecencyList()
    return _PolicyHeap(impl, state, last, keyed)


class TreePolicy(Policy):
    """The simulator's host of a registered eviction policy (``statemachine/policy.py``,
    the engine's too), by recency: the policy's order is compiled once per run into a
    container (:func:`compile_order`), and the hooks a subclass does not override go
    straight to it. ``compiled=False`` asks the policy's ``action`` at every change
    instead (the reference the compiled containers must match).

    A node's ``last_used`` is the host's clock at its last touch (one tick per hit or
    stored block). An ``evict`` victim is a leaf; an ``evict_subtree`` one is interior,
    and the simulator removes its cached subtree with it.
    """

    def __init__(self, policy: str = "leaf-lru", *, compiled: bool = True) -> None:
        self.impl = eviction.policy_named(policy)
        self.name = self.impl.name
        self.compiled = compiled

    def bind(self, state: CacheState) -> None:
        super().bind(state)
        order = self.order = compile_order(self.impl, state, compiled=self.compiled)
        cls = type(self)
        for hook, fn in (
            ("on_access", order.touch),
            ("on_insert", order.on_insert),
            ("choose_victim", order.choose_victim),
            ("on_evict", order.on_evict),
        ):
            if getattr(cls, hook) is getattr(TreePolicy, hook):
                setattr(self, hook, fn)

    def on_access(self, node: int) -> None:
        self.order.touch(node)

    def on_insert(self, node: int) -> None:
        self.order.on_insert(node)

    def choose_victim(self) -> int | None:
        return self.order.choose_victim()

    def on_evict(self, node: int) -> None:
        self.order.on_evict(node)


class LeafLRU(TreePolicy):
    """The registered ``leaf-lru``: evict the least recently used leaf."""

    def __init__(self, *, compiled: bool = True) -> None:
        super().__init__("leaf-lru", compiled=compiled)


class LRU(TreePolicy):
    """The registered ``lru``: evict the least recently used block, and its cached
    descendants with it."""

    def __init__(self, *, compiled: bool = True) -> None:
        super().__init__("lru", compiled=compiled)


class PrefixStorePolicy(RuleHost, Policy):
    """Leaf eviction by recency plus a frequency-earned retention bonus, fed by a
    bounded ghost history, with admission that throttles speculative stores when the
    cache is too small to keep what comes back.

    The simulator's host of the rule the engine uses too
    (:class:`prefixstore.statemachine.retention.RetentionRule`; its docstring has
    the rule), ordering the registered policy ``policy`` (``prefixstore``, whose leaves
    are the only candidates here, so the tree stays whole). What this host decides:

    - **Sightings**: how many requests held the block, counted per node while it is
      cached and, after it leaves (evicted or never admitted), in a ghost table of at
      most ``ghost_factor * capacity`` keys (FIFO). A block seen again after eviction
      comes back with its count.
    - **Clock**: one tick per block touched (each hit block, root to leaf, and each
      stored block); a block's eviction key ``t + theta * R * log2(sightings)`` is
      set at its touch.
    - **Full**: the cache holds ``capacity`` blocks now. The gated window
      (``F < gate``, or a fixed ``admit_window=k``) only refuses while it is full.
    - **Partial last blocks** are not admitted (``skip_partial``): when
      ``input_length`` is not a multiple of ``block_tokens`` the next turn re-hashes
      the block, so it is almost never reused (0.8% on the Mooncake trace), and an
      engine cannot checkpoint an unaligned position anyway.

    A refused store is a skipped store (an engine counts reason ``'admission'``). Long
    new suffixes are the least likely to return soon, and admitting them flushes
    everyone else. ``auto_admission=False`` turns the gated window off.
    ``compiled=False`` asks the policy's ``action`` at every change (as :class:`TreePolicy`).

    Every decision uses only the past. An engine needs per node its sighting count
    and last touch, a bounded ghost map of recent keys to counts, ``R`` and ``F``.
    """

    def __init__(
        self,
        *,
        theta: float = 1.0,
        ghost_factor: float = 4.0,
        retention_alpha: float = 0.01,
        skip_partial: bool = True,
        auto_admission: bool = True,
        gate: float = 0.7,
        window_share: float = 0.001,
        gate_alpha: float = 0.001,
        admit_window: int | None = None,
        policy: str = "prefixstore",
        compiled: bool = True,
    ) -> None:
        self.impl = eviction.policy_named(policy)
        self.name = self.impl.name
        self.compiled = compiled
        self.params = RetentionParams(
            theta=theta,
            ghost_factor=ghost_factor,
            retention_alpha=retention_alpha,
            gate=gate,
            window_share=window_share,
            gate_alpha=gate_alpha,
            admission=auto_admission,
            admit_window=admit_window,
        )
        self.skip_partial = skip_partial

    def bind(self, state: CacheState) -> None:
        super().bind(state)
        n = len(state.parent)
        self.rule = RetentionRule(self.params, state.capacity)
        self.last = [0] * n  # the clock at each node's last touch
        order = self.order = compile_order(
            self.impl, state, self.last, keyed=True, compiled=self.compiled
        )
        self.touch_keys = order.key  # each node's eviction key, set at its touch
        self._set, self._evicted = order.set, order.on_evict
        if type(self).choose_victim is PrefixStorePolicy.choose_victim:
            self.choose_victim = order.choose_victim  # type: ignore[method-assign]
        self.sightings = [0] * n  # valid for cached nodes and the current path
        self.ghost = Sightings(self.rule.ghost_keys)
        self._last_pos = -1
        self._hit = 0

    def begin_request(self, req: int, path: Sequence[int], hit: int, input_length: int) -> None:
        n = len(path)
        partial = self.skip_partial and input_length < n * self.state.block_tokens
        self._last_pos = n - 1 if partial else n
        self._hit = hit
        sightings, ghost = self.sightings, self.ghost
        for i in range(hit):
            sightings[path[i]] += 1
        returned = 0  # seen before, missed
        for i in range(hit, n):
            node = path[i]
            count = ghost.sight(node)  # dropped again if the block is stored
            returned += count > 1
            sightings[node] = count
        ghost.trim()
        self.rule.observe(hit, returned)

    def touch(self, node: int) -> None:
        rule = self.rule
        self.last[node] = rule.tick()
        self._set(node, rule.priority(self.sightings[node]))

    on_access = touch

    def admit(self, node: int, pos: int) -> bool:
        if pos >= self._last_pos:
            return False
        st = self.state
        window = self.rule.window(st.size >= st.capacity)
        return self.rule.admits(pos - self._hit, self.sightings[node], window)

    def on_insert(self, node: int) -> None:
        self.ghost.pop(node, None)
        self.touch(node)

    def choose_victim(self) -> int | None:
        return self.order.choose_victim()

    def on_evict(self, node: int) -> None:
        count = self.sightings[node]
        self.rule.learn_eviction(self.last[node], count)
        self.ghost[node] = count
        self.ghost.trim()
        self._evicted(node)


def policy_for(name: str) -> Policy:
    """A fresh simulator host of the registered policy ``name``: with the retention
    rule when the policy takes one (``uses_retention``)."""
    impl = eviction.policy_named(name)
    return PrefixStorePolicy(policy=name) if impl.uses_retention else TreePolicy(name)


class _Hosts(Mapping[str, Callable[[], Policy]]):
    """Name -> a factory of fresh simulator hosts, for every policy registered now."""

    def __getitem__(self, name: str) -> Callable[[], Policy]:
        if name not in eviction.REGISTRY:
            raise KeyError(name)
        return functools.partial(policy_for, name)

    def __iter__(self) -> Iterator[str]:
        return iter(eviction.registered())

    def __len__(self) -> int:
        return len(eviction.REGISTRY)


POLICIES: Mapping[str, Callable[[], Policy]] = _Hosts()


def make_policy(policy: str | Policy) -> Policy:
    if isinstance(policy, Policy):
        return policy
    if policy not in eviction.REGISTRY:
        raise InvalidInputError(
            f"unknown policy {policy!r}; known: {', '.join(sorted(eviction.REGISTRY))} or 'optimal'"
        )
    return policy_for(policy)


# ----------------------------------------------------------------------------------
# The simulator


def _check_state(st: CacheState) -> None:
    """Assert the cache is whole, its counts exact and within capacity."""
    n = len(st.parent)
    kids = [0] * n
    size = 0
    for node in range(n):
        if st.cached[node]:
            size += 1
            p = st.parent[node]
            if p >= 0:
                assert st.cached[p], f"cached node {node} has an uncached parent {p}"
                kids[p] += 1
    assert size == st.size, f"size {st.size} != {size} cached nodes"
    assert size <= st.capacity, f"{size} blocks cached over a capacity of {st.capacity}"
    for node in range(n):
        if st.cached[node]:
            assert kids[node] == st.nchild[node], (
                f"node {node}: nchild {st.nchild[node]} != {kids[node]}"
            )


def simulate(
    trace: CompiledTrace | Sequence[Request],
    capacity_bytes: int,
    policy: str | Policy = "leaf-lru",
    *,
    block_bytes: int = DEFAULT_BLOCK_BYTES,
    prefill_s: PrefillFn = default_prefill_s,
    check: bool = False,
) -> SimResult:
    """Replay ``trace`` through a cache of ``capacity_bytes`` under ``policy``.

    ``policy`` is a name from :data:`POLICIES`, ``'optimal'`` (the offline optimum of
    :mod:`prefixstore.replay.optimal`), or a :class:`Policy` instance (fresh per run).
    ``check`` verifies the cache after every request (whole tree, exact counts,
    capacity); it costs O(nodes) per request, for tests.
    """
    if policy == "optimal":
        return belady(trace, capacity_bytes, block_bytes=block_bytes, prefill_s=prefill_s)
    ct = as_compiled(trace)
    cap = capacity_in_blocks(capacity_bytes, block_bytes)
    pol = make_policy(policy)
    st = CacheState(ct, cap)
    pol.bind(st)

    cached, nchild, parent, pin = st.cached, st.nchild, st.parent, st.pin
    begin, on_access, admit = pol.begin_request, pol.on_access, pol.admit
    on_insert, choose_victim, on_evict = pol.on_insert, pol.choose_victim, pol.on_evict
    hits: list[int] = []
    stored = evicted = skip_adm = skip_room = 0

    def remove_subtree(victim: int) -> int:
        """Evict ``victim`` and its cached descendants, deepest first."""
        kids = st.children()
        order = [victim]
        i = 0
        while i < len(order):
            order.extend(c for c in kids[order[i]] if cached[c])
            i += 1
        for node in reversed(order):
            if pin[node] == st.req:
                raise AssertionError(
                    f"policy {pol.name!r} evicted a pinned node {node} (subtree of {victim})"
                )
            cached[node] = 0
            p = parent[node]
            if p >= 0:
                nchild[p] -= 1
            on_evict(node)
        st.size -= len(order)
        return len(order)

    for r, path in enumerate(ct.paths):
        st.req = r
        n = len(path)
        h = 0
        while h < n and cached[path[h]]:
            h += 1
        hits.append(h)
        begin(r, path, h, ct.input_lengths[r])
        for i in range(h):
            node = path[i]
            pin[node] = r
            on_access(node)
        for i in range(h, n):
            node = path[i]
            if not admit(node, i):
                skip_adm += n - i
                break
            room = True
            while st.size >= cap:
                victim = choose_victim()
                if victim is None or pin[victim] == r or not cached[victim]:
                    room = False
                    break
                if nchild[victim] == 0:
                    cached[victim] = 0
                    p = parent[victim]
                    if p >= 0:
                        nchild[p] -= 1
                    st.size -= 1
                    on_evict(victim)
                    evicted += 1
                else:
                    evicted += remove_subtree(victim)
            if not room:
                skip_room += n - i
                break
            cached[node] = 1
            p = parent[node]
            if p >= 0:
                nchild[p] += 1
            st.size += 1
            pin[node] = r
            on_insert(node)
            stored += 1
        if check:
            _check_state(st)
    st.req = -1
    return summarize(
        ct,
        hits,
        policy=pol.name,
        capacity_bytes=capacity_bytes,
        block_bytes=block_bytes,
        prefill_s=prefill_s,
        stored=stored,
        evicted=evicted,
        skipped_admission=skip_adm,
        skipped_no_room=skip_room,
    )


def evaluate(
    trace: CompiledTrace | Sequence[Request],
    fractions: Sequence[float] = (0.05, 0.10, 0.25),
    policies: Sequence[str | Callable[[], Policy]] | None = None,
    *,
    block_bytes: int = DEFAULT_BLOCK_BYTES,
    prefill_s: PrefillFn = default_prefill_s,
) -> list[tuple[float, SimResult]]:
    """Every policy at every capacity given as a fraction of the trace's unique bytes.

    A policy is a name (as for :func:`simulate`) or a factory of fresh instances;
    by default every policy registered now, then ``'optimal'``.
    """
    policies = (*eviction.registered(), "optimal") if policies is None else policies
    ct = as_compiled(trace)
    total = ct.unique_bytes(block_bytes)
    out: list[tuple[float, SimResult]] = []
    for frac in fractions:
        if not frac >= 0:
            raise InvalidInputError(f"capacity fractions must be >= 0, got {frac!r}")
        cap = int(total * frac)
        for pol in policies:
            chosen = pol if isinstance(pol, str) else pol()
            out.append(
                (frac, simulate(ct, cap, chosen, block_bytes=block_bytes, prefill_s=prefill_s))
            )
    return out
