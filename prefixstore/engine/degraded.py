"""Ranks the engine opened without: the degraded state, and bringing a rank back.

A rank whose tier cannot serve when the engine opens (a rank server that has not
registered, a host that does not answer within the tier's timeouts) does not stop the
open: the engine opens **degraded**. ``Engine.degraded`` is then a ``RanksDown``
naming each such rank and why (None once every rank serves). Recovery runs over the
catalog and the ranks that answer (``recovery.recover``); the part that needs a down
rank's files (re-attaching or quarantining what its listing holds, its orphans, its
garbage, checking its live shards' sizes) waits. While any rank is down:

- a lookup that would read shards (a hit) misses instead: every node has a shard on
  every rank (counted ``degraded.lookup_missed``; gpu_resident, rejected_cost and the
  remote tier answer as usual);
- every store is refused, ``StoreResult(status="refused", reason="ranks_down")``
  (counted ``skips.ranks_down``; queued for retry when the caller gave ``valid``);
- an unlink on a down rank fails as on a failed rank: the file stays charged as
  garbage until it is reclaimed.

A down rank is back when its tier says it can serve (a rank server registered again):
asked at most once per ``PROBE_S`` by the next lookup, store or restore, or at once by
``Engine.reconnect_ranks(timeout)``. Its deferred recovery (``recovery.recover_rank``)
then runs under the engine lock, and the rank leaves the state (counted
``degraded.revived``); a rank that fails again meanwhile stays down with the new
reason. The gauges: ``prefixstore_state{kind="ranks_down"}`` (how many) and
``prefixstore_rank_down{rank=...}`` (1 while that rank is down).
"""

from __future__ import annotations

import time
from types import MappingProxyType
from typing import Any

import attrs

from prefixstore.base.errors import PrefixStoreError
from prefixstore.base.log import log
from prefixstore.engine import recovery
from prefixstore.engine.counters import Counters
from prefixstore.engine.guard import CallGuard
from prefixstore.engine.recovery import Recovering
from prefixstore.engine.results import REFUSED, Match, StoreResult
from prefixstore.engine.tiering import Tiers

RANKS_DOWN = "ranks_down"
"""The reason of a store refused while a rank is down."""
PROBE_S = 1.0
"""At most one question per this many seconds to the down ranks' tiers from calls."""
POLL_S = 0.05


@attrs.frozen
class RanksDown:
    """The engine's degraded state: the ranks it runs without (sorted) and why each is down."""

    ranks: tuple[int, ...]
    why: Any = attrs.field(converter=lambda d: MappingProxyType(dict(d)))
    """rank -> why it is down (read-only mapping)."""


@attrs.frozen(slots=True, eq=False)
class Reviving:
    """What bringing a rank back uses: the engine lock, the tiers (their down ranks),
    the counters and gauges, and recovery (its deferred part)."""

    guard: CallGuard
    tiers: Tiers
    counters: Counters
    recovering: Recovering


def state(rv: Reviving) -> RanksDown | None:
    """The degraded state, or None when every rank serves."""
    why = dict(rv.tiers.down.why)
    return RanksDown(tuple(sorted(why)), why) if why else None


def opened(rv: Reviving) -> None:
    """After recovery at open: the gauges, the count and the log of the ranks down."""
    rv.counters.watch(ranks_down=lambda: len(rv.tiers.down.why))
    for r in range(len(rv.tiers.ranks)):
        rv.counters.rank_down.labels(str(r)).set(1 if r in rv.tiers.down.why else 0)
    for r, why in sorted(rv.tiers.down.why.items()):
        rv.counters.inc("degraded", "opened_without")
        log.warning("opened_degraded", rank=r, why=why)
    rv.tiers.down.probed = time.monotonic()


def screen(rv: Reviving, match: Match) -> Match:
    """``match``, or a miss when it would read shards while a rank is down."""
    if not rv.tiers.down.why or not match.hit or match.source != "local":
        return match
    rv.counters.inc("degraded", "lookup_missed")
    return Match("miss", match.prefix_blocks, match.block_tokens, gpu_blocks=match.gpu_blocks, cache=match.cache)


def refused(tiers: Tiers, blocks: int) -> StoreResult | None:
    """The refusal of a store while a rank is down, else None."""
    return StoreResult(REFUSED, blocks, RANKS_DOWN) if tiers.down.why else None


def poll(rv: Reviving) -> list[int]:
    """From a call: at most once per ``PROBE_S``, bring back the down ranks that serve
    again; the ranks brought back."""
    down = rv.tiers.down
    if not down.why or time.monotonic() - down.probed < PROBE_S:
        return []
    down.probed = time.monotonic()
    return revive(rv)


def reconnect(rv: Reviving, timeout: float) -> tuple[int, ...]:
    """Bring back every down rank that serves within ``timeout`` s; the ranks still down."""
    deadline = time.monotonic() + timeout
    while True:
        revive(rv)
        if not rv.tiers.down.why or time.monotonic() >= deadline:
            return tuple(sorted(rv.tiers.down.why))
        time.sleep(POLL_S)


def revive(rv: Reviving) -> list[int]:
    """Run the deferred recovery of each down rank whose tier says it serves; the
    ranks brought back (a rank that fails meanwhile stays down, with its new reason)."""
    back = []
    for r in sorted(rv.tiers.down.why):
        if not rv.tiers.ranks[r].available:
            continue
        with rv.guard.lock:
            if r not in rv.tiers.down.why:
                continue  # brought back by another thread meanwhile
            try:
                rep = recovery.recover_rank(rv.recovering, r)
            except (OSError, PrefixStoreError) as exc:  # down again, or its directory refused
                rv.tiers.down.why[r] = str(exc)
                log.warning("rank_not_revived", rank=r, why=str(exc))
                continue
            del rv.tiers.down.why[r]
        rv.counters.rank_down.labels(str(r)).set(0)
        rv.counters.inc("degraded", "revived")
        log.info("rank_revived", rank=r, orphans_removed=len(rep.orphans_removed),
                 quarantined=len(rep.quarantined), reattached=len(rep.reattached), damaged=rep.damaged,
                 garbage_reclaimed=rep.garbage_reclaimed)
        back.append(r)
    return back
