"""Retention and admission for attention-only prefix caches: the engine's host of the
shared ``prefixstore`` rule (``statemachine/retention.py``, ``RetentionRule``), which
the simulator's ``prefixstore`` policy (``replay/sim.py``, ``PrefixStorePolicy``) drives
too. Pure: no I/O; it only counts what it is told and answers.

One object plays three roles:

- **Request side** (the caller, once per request after its lookup):
  ``observe(keys, hit)`` counts a *sighting* of each of the request's block keys and
  updates the reuse-hit fraction ``F``; ``admit_limit(keys, end)`` says how deep a
  checkpoint of the request may go.
- **Admission hook** (``Engine.open(..., admission=obj)``): ``obj(engine, prefix,
  plan)`` refuses a store whose checkpoint ends past that limit (the engine counts a
  skipped store, reason ``'admission'``).
- **Retention** (``VictimHeap.set_retention(obj, nodes)``): ``priority(node)`` is a
  leaf's eviction key and ``on_victim(node)`` learns from every leaf taken.

The rule itself (sightings, the eviction key ``t + theta * R * log2(sightings)``, the
gated admission window) is ``RetentionRule``'s; see ``statemachine/retention.py``.
What this host decides:

- **Sightings** are counted per block key in one bounded recency map of
  ``(ghost_factor + 1) * capacity_blocks`` keys (cached blocks are refreshed by every
  sighting; evicted and never-admitted ones are remembered as a *ghost* until pushed
  out). A node's count is its end block's (the deepest, least seen of its span).
- **Clock**: it moves by the hit blocks of each request (``observe``) and the new
  blocks of each admitted store (the hook). A leaf's key is fixed when the node is
  touched (``priority`` is asked with a new ``last_used``).
- **Full** means a victim was ever taken.

Differences from the simulator, which works block by block: the engine evicts whole
nodes (a node spans the blocks between two checkpoints), a node's count is its end
block's, and the admission hook, which does not know the request's hit, takes the
deepest stored block of the prefix (``plan.start``) for it.

Thread-safe (one internal lock; it never calls into the engine, so it cannot
deadlock with the engine's lock, under which the hook and the heap call it).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any, Protocol

from prefixstore.base.errors import InvalidInputError
from prefixstore.statemachine.retention import RetentionParams, RetentionRule, RuleHost, Sightings


class _Node(Protocol):
    id: int
    key: bytes
    last_used: int


class _Prefix(Protocol):
    keys: tuple[bytes, ...]

    def __len__(self) -> int: ...


class RetentionAdmission(RuleHost):
    """The engine's host of the shared ``prefixstore`` rule (see the module docstring)."""

    def __init__(
        self,
        capacity_blocks: int,
        *,
        theta: float = 1.0,
        ghost_factor: float = 4.0,
        retention_alpha: float = 0.01,
        gate: float = 0.7,
        window_share: float = 0.001,
        gate_alpha: float = 0.001,
        admission: bool = True,
        admit_window: int | None = None,
    ) -> None:
        if isinstance(capacity_blocks, bool) or not isinstance(capacity_blocks, int) or capacity_blocks < 1:
            raise InvalidInputError(f"capacity_blocks must be a positive integer, got {capacity_blocks!r}")
        params = RetentionParams(
            theta=theta,
            ghost_factor=ghost_factor,
            retention_alpha=retention_alpha,
            gate=gate,
            window_share=window_share,
            gate_alpha=gate_alpha,
            admission=admission,
            admit_window=admit_window,
        )
        self.rule = RetentionRule(params, capacity_blocks)
        self.capacity_blocks = capacity_blocks
        self.full = False
        self.refused = 0
        self._seen = Sightings(self.rule.sighting_keys)
        self._touch: dict[int, tuple[int, int, float]] = {}  # node id -> (last_used, clock, key)
        self._lock = threading.Lock()

    @property
    def window(self) -> int:
        """The window in blocks a limited request gets: ``admit_window`` when set, else
        the gated one, ``max(1, window_share * capacity_blocks)``."""
        p = self.rule.params
        return p.admit_window if p.admit_window is not None else self.rule.auto_window

    # ------------------------------------------------------------------ request side

    def observe(self, keys: Sequence[bytes], hit: int) -> None:
        """A request holding block ``keys`` found its first ``hit`` blocks in the tier."""
        with self._lock:
            seen = self._seen
            returned = 0
            for i, k in enumerate(keys):
                count = seen.sight(k)
                if i >= hit and count > 1:
                    returned += 1
            seen.trim()
            self.rule.observe(hit, returned)
            self.rule.tick(hit)

    @property
    def gated(self) -> bool:
        """Whether admission limits never-seen suffixes now."""
        return self.rule.window(self.full) is not None

    def admit_limit(self, keys: Sequence[bytes], hit: int, end: int) -> int:
        """The deepest block (<= ``end``) a checkpoint of this request, whose first
        ``hit`` blocks were found in the tier, may end at."""
        with self._lock:
            return self._limit(keys, hit, end)

    def _limit(self, keys: Sequence[bytes], hit: int, end: int) -> int:
        seen = self._seen
        return self.rule.limit(hit, end, lambda p: seen.get(keys[p], 0), self.full)

    def __call__(self, engine: Any, prefix: _Prefix, plan: Any) -> bool:
        """The engine's admission hook: whether to store the checkpoint at the end of
        ``prefix`` (its new node spans blocks ``(plan.start, len(prefix)]``; the
        deepest stored block, ``plan.start``, stands for the request's hit)."""
        n = len(prefix)
        start = getattr(plan, "start", 0)
        with self._lock:
            if n > self._limit(prefix.keys, start, n):
                self.refused += 1
                return False
            self.rule.tick(max(0, n - start))
            return True

    # ------------------------------------------------------------------ retention side

    def priority(self, node: _Node) -> float:
        """The eviction key of leaf ``node``: fixed when it was last touched."""
        with self._lock:
            t = self._touch.get(node.id)
            if t is not None and t[0] == node.last_used:
                return t[2]
            key = self.rule.priority(self._seen.get(node.key, 1))
            self._touch[node.id] = (node.last_used, self.rule.clock, key)
            return key

    def on_victim(self, node: _Node) -> None:
        """A leaf was taken as a victim: the tier is full; learn its age if never reused."""
        with self._lock:
            self.full = True
            t = self._touch.get(node.id)
            if t is not None:
                self.rule.learn_eviction(t[1], self._seen.get(node.key, 1))

    def forget(self, live_ids: set[int]) -> None:
        """Drop touch records of nodes no longer in the tier (called on heap rebuilds)."""
        with self._lock:
            self._touch = {i: t for i, t in self._touch.items() if i in live_ids}

    def stats(self) -> dict[str, float | int | bool]:
        with self._lock:
            return {
                "reuse_hit_fraction": round(self.rule.reuse_hit_fraction, 4),
                "retention_blocks": round(self.rule.retention, 1),
                "gated": self.gated,
                "window_blocks": self.window,
                "refused": self.refused,
                "keys_remembered": len(self._seen),
            }
