"""Retention and admission for attention-only prefix caches: the simulator's
``prefixstore`` policy (``prefixstore.replay.sim.PrefixStorePolicy``) ported to the
engine. Pure: no I/O; it only counts what it is told and answers.

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

The rules (see the simulator's docstring for why and what was measured):

- **Sightings**: how many requests held a block key, in a bounded LRU map of
  ``(ghost_factor + 1) * capacity_blocks`` keys (cached blocks are refreshed by every
  sighting; evicted and never-admitted ones are remembered as a *ghost* until pushed
  out). A node's count is its end block's (the deepest, least seen of its span).
- **Eviction**: a leaf's key is ``t + theta * R * log2(sightings)``, frozen when the
  node is touched: ``t`` is a clock in *block touches* (the hit blocks of each request
  and the new blocks of each admitted store), ``R`` the cache's retention, a running
  mean (weight ``retention_alpha``) of the age in block touches at which never-reused
  leaves are taken (it starts at ``capacity_blocks``). A block used twice stays about
  ``theta * R`` longer than one used once.
- **Admission**: ``F`` is a running mean (weight ``gate_alpha``) over sightings of
  blocks seen before of whether they were hits. Once the tier is full (a victim was
  taken) and while ``F < gate``, a checkpoint may end at most ``window`` blocks past
  the request's hit, and past that only over blocks seen before (``window = max(1,
  window_share * capacity_blocks)``); the rest waits for a later sighting. Long
  never-seen suffixes are the least likely to return soon, and admitting them
  flushes everyone else.

Differences from the simulator, which works block by block: the engine evicts whole
nodes (a node spans the blocks between two checkpoints), a node's count is its end
block's, and the admission hook, which does not know the request's hit, takes the
deepest stored block of the prefix (``plan.start``) for it.

Thread-safe (one internal lock; it never calls into the engine, so it cannot
deadlock with the engine's lock, under which the hook and the heap call it).
"""

from __future__ import annotations

import math
import threading
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any, Protocol

from prefixstore.engine.errors import InvalidInputError


class _Node(Protocol):
    id: int
    key: bytes
    last_used: int


class _Prefix(Protocol):
    keys: tuple[bytes, ...]

    def __len__(self) -> int: ...


class RetentionAdmission:
    """The ported ``prefixstore`` retention and admission (see the module docstring)."""

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
    ) -> None:
        if isinstance(capacity_blocks, bool) or not isinstance(capacity_blocks, int) or capacity_blocks < 1:
            raise InvalidInputError(f"capacity_blocks must be a positive integer, got {capacity_blocks!r}")
        if theta < 0 or ghost_factor < 0 or window_share < 0:
            raise InvalidInputError("theta, ghost_factor and window_share must be >= 0")
        if not (0 < retention_alpha <= 1 and 0 < gate_alpha <= 1):
            raise InvalidInputError("retention_alpha and gate_alpha must be in (0, 1]")
        self.capacity_blocks = capacity_blocks
        self.theta = theta
        self.retention_alpha = retention_alpha
        self.gate = gate
        self.gate_alpha = gate_alpha
        self.admission = admission
        self.window = max(1, int(window_share * capacity_blocks))
        self.max_keys = max(1, int((ghost_factor + 1) * capacity_blocks))
        self.retention = float(capacity_blocks)
        self.reuse_hit_fraction = 1.0
        self.full = False
        self.clock = 0
        self.refused = 0
        self._seen: OrderedDict[bytes, int] = OrderedDict()
        self._touch: dict[int, tuple[int, int, float]] = {}  # node id -> (last_used, clock, key)
        self._lock = threading.Lock()

    # ------------------------------------------------------------------ request side

    def observe(self, keys: Sequence[bytes], hit: int) -> None:
        """A request holding block ``keys`` found its first ``hit`` blocks in the tier."""
        with self._lock:
            seen = self._seen
            returned = 0
            for i, k in enumerate(keys):
                count = seen.pop(k, 0) + 1
                seen[k] = count
                if i >= hit and count > 1:
                    returned += 1
            while len(seen) > self.max_keys:
                seen.popitem(last=False)
            # F moves towards 1 once per hit block, towards 0 once per returning miss.
            a, f = self.gate_alpha, self.reuse_hit_fraction
            f = 1.0 - (1.0 - f) * (1.0 - a) ** hit
            self.reuse_hit_fraction = f * (1.0 - a) ** returned
            self.clock += hit

    @property
    def gated(self) -> bool:
        """Whether admission limits never-seen suffixes now."""
        return self.admission and self.full and self.reuse_hit_fraction < self.gate

    def admit_limit(self, keys: Sequence[bytes], hit: int, end: int) -> int:
        """The deepest block (<= ``end``) a checkpoint of this request, whose first
        ``hit`` blocks were found in the tier, may end at."""
        with self._lock:
            return end if not self.gated else self._limit(keys, hit, end)

    def _limit(self, keys: Sequence[bytes], hit: int, end: int) -> int:
        """``window`` blocks past ``hit``, then on while the blocks were seen before."""
        seen = self._seen
        p = hit + self.window
        while p < end and seen.get(keys[p], 0) > 1:
            p += 1
        return min(p, end)

    def __call__(self, engine: Any, prefix: _Prefix, plan: Any) -> bool:
        """The engine's admission hook: whether to store the checkpoint at the end of
        ``prefix`` (its new node spans blocks ``(plan.start, len(prefix)]``; the
        deepest stored block, ``plan.start``, stands for the request's hit)."""
        n = len(prefix)
        start = getattr(plan, "start", 0)
        with self._lock:
            if self.gated and n > self._limit(prefix.keys, start, n):
                self.refused += 1
                return False
            self.clock += max(0, n - start)
            return True

    # ------------------------------------------------------------------ retention side

    def priority(self, node: _Node) -> float:
        """The eviction key of leaf ``node``: fixed when it was last touched."""
        with self._lock:
            t = self._touch.get(node.id)
            if t is not None and t[0] == node.last_used:
                return t[2]
            count = self._seen.get(node.key, 1)
            key = self.clock + self.theta * self.retention * math.log2(max(count, 1))
            self._touch[node.id] = (node.last_used, self.clock, key)
            return key

    def on_victim(self, node: _Node) -> None:
        """A leaf was taken as a victim: the tier is full; learn its age if never reused."""
        with self._lock:
            self.full = True
            t = self._touch.get(node.id)
            if t is not None and self._seen.get(node.key, 1) <= 1:
                self.retention += self.retention_alpha * ((self.clock - t[1]) - self.retention)

    def forget(self, live_ids: set[int]) -> None:
        """Drop touch records of nodes no longer in the tier (called on heap rebuilds)."""
        with self._lock:
            self._touch = {i: t for i, t in self._touch.items() if i in live_ids}

    def stats(self) -> dict[str, float | int | bool]:
        with self._lock:
            return {
                "reuse_hit_fraction": round(self.reuse_hit_fraction, 4),
                "retention_blocks": round(self.retention, 1),
                "gated": self.gated,
                "window_blocks": self.window,
                "refused": self.refused,
                "keys_remembered": len(self._seen),
            }
