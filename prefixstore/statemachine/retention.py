"""The ``prefixstore`` retention and admission rule, shared by the trace simulator and
the engine. Pure: no I/O, no locks; it decides from what its host tells it.

Two hosts drive one :class:`RetentionRule`, so a change here changes both:

- the simulator's ``prefixstore`` policy (``replay/sim.py``, ``PrefixStorePolicy``),
  block by block on a compiled trace;
- the engine's retention and admission (``statemachine/admission.py``,
  ``RetentionAdmission``), node by node, behind a lock.

The rule (see the simulator's module docstring for why and what was measured):

- **Sightings**: how many requests held a block. Hosts keep the counts (the rule only
  reads them), remembering blocks that left or were never admitted in a bounded
  recency map (:class:`Sightings`, a *ghost*).
- **Clock**: time is counted in *block touches* (:meth:`RetentionRule.tick`).
- **Eviction**: a leaf's key is ``t + theta * R * log2(sightings)``
  (:meth:`RetentionRule.priority`), fixed when it is touched at clock ``t``; the
  smallest goes first. ``R`` is the cache's retention, a running mean (weight
  ``retention_alpha``) of the age, in block touches, at which never-reused blocks are
  evicted (:meth:`RetentionRule.learn_eviction`; it starts at the capacity in blocks).
  A block used twice stays about ``theta * R`` longer than one used once.
- **Admission**: ``F``, the reuse hit fraction, is a running mean (weight
  ``gate_alpha``) over sightings of blocks seen before of whether they were hits
  (:meth:`RetentionRule.observe`). While the cache is full and ``F < gate``, a
  request may store at most ``window = max(1, window_share * capacity)`` never-seen
  blocks past its hit; past that only blocks seen before (:meth:`RetentionRule.window`,
  :meth:`RetentionRule.admits`, :meth:`RetentionRule.limit`). ``admit_window=k`` fixes
  the window at ``k`` whenever the cache is full; ``admission=False`` turns the gated
  window off.

What stays with each host: how it counts sightings (the simulator per node, with a
ghost of ``ghost_factor * capacity`` keys beside the cached blocks' counts; the engine
in one map of ``(ghost_factor + 1) * capacity`` keys, cached blocks included), what
*full* means (the simulator: the cache holds ``capacity`` blocks now; the engine: a
victim was ever taken), and when it ticks the clock.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Callable, Hashable

import attrs

from prefixstore.base.errors import InvalidInputError


@attrs.frozen
class RetentionParams:
    """The rule's tuning, validated once for every host."""

    theta: float = 1.0
    ghost_factor: float = 4.0
    retention_alpha: float = 0.01
    gate: float = 0.7
    window_share: float = 0.001
    gate_alpha: float = 0.001
    admission: bool = True
    """The gated window (``F < gate``); off: only ``admit_window``, if set, limits."""
    admit_window: int | None = None
    """A fixed window whenever the cache is full, whatever ``F`` (None: the gated one)."""

    def __attrs_post_init__(self) -> None:
        floats = ("theta", "ghost_factor", "retention_alpha", "gate", "window_share", "gate_alpha")
        for name in floats:
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
                raise InvalidInputError(f"{name} must be a finite number, got {v!r}")
        if not 0 <= self.gate <= 1:
            raise InvalidInputError(f"gate must be in [0, 1] (a reuse-hit fraction), got {self.gate}")
        if self.theta < 0 or self.ghost_factor < 0 or self.window_share < 0:
            raise InvalidInputError("theta, ghost_factor and window_share must be >= 0")
        if not (0 < self.retention_alpha <= 1 and 0 < self.gate_alpha <= 1):
            raise InvalidInputError("retention_alpha and gate_alpha must be in (0, 1]")
        if self.admit_window is not None and self.admit_window < 0:
            raise InvalidInputError(f"admit_window must be >= 0, got {self.admit_window}")


class Sightings(OrderedDict[Hashable, int]):
    """Block key -> sightings, bounded to the ``limit`` most recently sighted or
    remembered keys (the oldest are forgotten first, on :meth:`trim`). A plain
    ordered dict otherwise: ``self[key] = count`` remembers a count (a new key is the
    most recent), ``pop(key, None)`` forgets one, ``get(key, 0)`` reads one."""

    def __init__(self, limit: int) -> None:
        super().__init__()
        self.limit = limit

    def sight(self, key: Hashable) -> int:
        """Count one more sighting of ``key`` (now the most recent) and return it."""
        count = self.pop(key, 0) + 1
        self[key] = count
        return count

    def trim(self) -> None:
        """Forget the oldest keys past ``limit``."""
        limit = self.limit
        while len(self) > limit:
            self.popitem(last=False)


class RetentionRule:
    """The rule's state (clock, ``R``, ``F``) and its decisions for a cache of
    ``capacity_blocks`` blocks (see the module docstring)."""

    __slots__ = ("params", "capacity_blocks", "auto_window", "clock", "retention", "reuse_hit_fraction")

    def __init__(self, params: RetentionParams, capacity_blocks: int) -> None:
        if isinstance(capacity_blocks, bool) or not isinstance(capacity_blocks, int) or capacity_blocks < 0:
            raise InvalidInputError(
                f"capacity_blocks must be a non-negative integer, got {capacity_blocks!r}"
            )
        self.params = params
        self.capacity_blocks = capacity_blocks
        self.auto_window = max(1, int(params.window_share * capacity_blocks))
        self.clock = 0
        self.retention = float(max(capacity_blocks, 1))
        self.reuse_hit_fraction = 1.0

    # ------------------------------------------------------------------ sightings

    @property
    def ghost_keys(self) -> int:
        """Bound of a ghost kept beside the cached blocks' counts."""
        return max(1, int(self.params.ghost_factor * self.capacity_blocks))

    @property
    def sighting_keys(self) -> int:
        """Bound of one map holding cached and ghost blocks' counts."""
        return max(1, int((self.params.ghost_factor + 1) * self.capacity_blocks))

    # ------------------------------------------------------------------ requests

    def observe(self, hit: int, returned: int) -> None:
        """A request hit ``hit`` blocks and missed ``returned`` blocks seen before:
        ``F`` moves towards 1 once per hit and towards 0 once per returning miss."""
        a, f = self.params.gate_alpha, self.reuse_hit_fraction
        f = 1.0 - (1.0 - f) * (1.0 - a) ** hit
        self.reuse_hit_fraction = f * (1.0 - a) ** returned

    def window(self, full: bool) -> int | None:
        """How many never-seen blocks past its hit a request may store now (None: no limit)."""
        if not full:
            return None
        p = self.params
        if p.admit_window is not None:
            return p.admit_window
        if p.admission and self.reuse_hit_fraction < p.gate:
            return self.auto_window
        return None

    @staticmethod
    def admits(past_hit: int, sightings: int, window: int | None) -> bool:
        """Whether a block ``past_hit`` blocks past the request's hit, sighted
        ``sightings`` times (this request included), may be stored under ``window``."""
        return window is None or past_hit < window or sightings > 1

    def limit(self, hit: int, end: int, sightings_at: Callable[[int], int], full: bool) -> int:
        """The deepest block (<= ``end``) a request whose first ``hit`` blocks were
        found may be stored to: the first block :meth:`admits` refuses, or ``end``;
        ``sightings_at(p)`` is block ``p``'s count."""
        window = self.window(full)
        if window is None:
            return end
        p = hit + window  # every block before is within the window
        while p < end and self.admits(p - hit, sightings_at(p), window):
            p += 1
        return min(p, end)

    # ------------------------------------------------------------------ retention

    def tick(self, blocks: int = 1) -> int:
        """``blocks`` more block touches; the clock after them."""
        self.clock += blocks
        return self.clock

    def priority(self, sightings: int) -> float:
        """The eviction key of a block sighted ``sightings`` times, touched now."""
        return self.clock + self.params.theta * self.retention * math.log2(max(sightings, 1))

    def learn_eviction(self, touched_at: int, sightings: int) -> None:
        """A block last touched at clock ``touched_at`` was evicted: if it was never
        reused, its age moves ``R``."""
        if sightings <= 1:
            a = self.params.retention_alpha
            self.retention += a * ((self.clock - touched_at) - self.retention)


class RuleHost:
    """What every host of a ``RetentionRule`` reads through to it (the simulator's
    ``PrefixStorePolicy`` and the engine's ``RetentionAdmission``)."""

    rule: RetentionRule

    @property
    def clock(self) -> int:
        """Block touches so far: the hit blocks of each request and each stored block."""
        return self.rule.clock

    @property
    def retention(self) -> float:
        return self.rule.retention

    @property
    def reuse_hit_fraction(self) -> float:
        return self.rule.reuse_hit_fraction
