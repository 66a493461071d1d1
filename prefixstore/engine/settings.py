"""The engine's tunables read at call time: the policy's name, the cost rule (its
bandwidth calibrated at open), the admission hook, and how long calls wait."""

from __future__ import annotations

from collections.abc import Callable

import attrs

from prefixstore.statemachine.compaction import CompactionPolicy
from prefixstore.statemachine.cost import CostModel


@attrs.define(slots=True, eq=False)
class Settings:
    """What ``Engine.open``'s options set and the flows read when they run."""

    policy: str
    cost: CostModel | None
    """The restore cost rule (None restores the deepest match); its bandwidth is the
    calibrated one once ``bandwidth=`` measured it."""
    admission: Callable[..., bool] | None
    inflight_wait_s: float
    """How long a store waits for an overlapping store in flight before it is skipped."""
    pin_wait_s: float = 2.0
    """How long a refill or split waits for a restore's pin before it rolls back."""
    close_wait_s: float = 30.0
    """How long ``close`` waits for public calls in flight on other threads."""
    remote_flush_s: float = 10.0
    """How long ``close`` waits for the remote tier's queued writes (at most)."""
    compaction_policy: CompactionPolicy | None = None
    """The background worker's policy, and ``compact()``'s default."""
