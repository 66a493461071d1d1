"""The engine's side of its tiers: the catalog's ``backing`` rows, volatile rows, stats.

The tiers themselves (``gpu/tier.py``, ``gpu/tiers/``) never see the catalog; this
module talks to them through the tier protocol and the registry's declarations only
(no backing is named here):

- ``open_backing``: before recovery, with the catalog open: look the ``backing=`` name
  up in the registry, drop the rows of a cache last opened with a volatile backing (its
  bytes died with that process), refuse a volatile backing over durable rows, record
  the name and whether it is volatile, build the backing.
- ``stats``: the backing's kind, the disk's budget and use, its RAM tier's counters
  (the RAM tier's own audit is ``audit.audit_engine``'s).
- ``local_dirs``, ``audit_dirs``, ``ranks_down``: what the engine needs to know about
  its tiers, read from their declared capabilities.
- ``DownRanks``, ``unreachable``: the ranks an engine opened without (``engine/degraded.py``).
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Any

import attrs

from prefixstore.base.errors import InvalidInputError, RankUnavailableError
from prefixstore.engine.account import Account
from prefixstore.engine.catalog import Catalog
from prefixstore.engine.driver import Journal
from prefixstore.gpu import tiers
from prefixstore.gpu.executor import StagingPool
from prefixstore.gpu.tier import Backing, Capability, Tier, TierOptions, has


@attrs.define(slots=True, eq=False)
class DownRanks:
    """The ranks the engine opened without (their tier could not serve at open), each
    with why; their part of recovery waits until each is back (``engine/degraded.py``).
    Changed under the engine lock."""

    why: dict[int, str] = attrs.field(factory=dict)
    probed: float = 0.0
    """When (``time.monotonic()``) a call last asked the down ranks' tiers whether they are back."""


@attrs.define(slots=True, eq=False)
class Tiers:
    """The tiers an engine runs on: its backing, one tier per rank, the pool that
    runs the ranks' reads and writes in parallel, and the ranks it opened without."""

    backing: Backing
    ranks: list[Tier]
    pool: ThreadPoolExecutor
    down: DownRanks = attrs.field(factory=DownRanks)


def recorded(catalog: Catalog) -> dict[str, str | None]:
    """The catalog's rows naming the backing it was last opened with (``gpu/tiers``)."""
    return {key: catalog.meta(key) for key in (tiers.META_KEY, tiers.VOLATILE_KEY)}


def open_backing(catalog: Catalog, root: str, capacity: int, pool: StagingPool, kind: str,
                 ram_bytes: int | None) -> Backing:
    """Validate the options, prepare the catalog (drop volatile rows), build the backing.

    A cache last opened with a volatile backing loses every row here, in one commit:
    nothing it described survived the process. A durable cache holding rows cannot be
    reopened with a volatile backing (its files would be orphaned); open it durable.
    """
    factory = tiers.lookup(kind)
    if ram_bytes is not None and int(ram_bytes) <= 0:
        raise InvalidInputError(f"ram_bytes must be positive, got {ram_bytes}")
    cat = catalog
    meta = recorded(cat)
    stored = tiers.recorded(meta)
    was_volatile = factory.volatile if stored == kind else tiers.recorded_volatile(meta)
    if was_volatile:
        drop_volatile_rows(cat)
    elif factory.volatile and cat.query("SELECT 1 FROM files LIMIT 1"):
        durable = " or ".join(repr(n) for n in tiers.durable_names())
        raise InvalidInputError(f"{root} holds a durable ({stored}) cache; open it with backing={durable}")
    if stored != kind:
        with cat.txn("backing") as c:
            cat.set_meta(c, tiers.META_KEY, kind)
            cat.set_meta(c, tiers.VOLATILE_KEY, "1" if factory.volatile else "0")
    return factory(TierOptions(capacity, None if ram_bytes is None else int(ram_bytes), pool))


def drop_volatile_rows(cat: Catalog) -> int:
    """Forget every row of a volatile cache in one commit; returns the rows dropped."""
    n = cat.query("SELECT (SELECT count(*) FROM nodes) + (SELECT count(*) FROM files)")[0][0]
    if not n and not cat.query("SELECT 1 FROM journal LIMIT 1"):
        return 0
    with cat.txn("backing.drop_volatile") as c:
        c.execute("DELETE FROM files")
        Journal().delete_all(c)
        c.execute("UPDATE nodes SET parent=NULL")
        c.execute("DELETE FROM nodes")
    return int(n)


def local_dirs(ranks: list[Tier]) -> list[str | None]:
    """Each rank's directory on this machine's disk (None for a volatile tier)."""
    return [None if has(r, Capability.VOLATILE) else r.directory for r in ranks]


def audit_dirs(ranks: list[Tier]) -> list[Any]:
    """What the audit reads per rank: its directory when the tier's files are local to
    this process (``LOCAL_FILES``, not volatile), else the tier itself (a RAM tier, a
    rank served by a rank server on another host)."""
    return [r.directory if has(r, Capability.LOCAL_FILES) and not has(r, Capability.VOLATILE) else r
            for r in ranks]


def ranks_down(ranks: list[Tier]) -> list[int]:
    """Ranks whose tier says it cannot serve now (a rank process down)."""
    return [r for r, rk in enumerate(ranks) if not rk.available]


def unreachable(ranks: list[Tier]) -> dict[int, str]:
    """The ranks that cannot serve now, each with why: a tier whose files are not local
    (a rank server) that says it is unavailable, or whose listing fails as an
    unavailable rank (``RankUnavailableError``: not registered, connection refused,
    timed out). Each listing is bounded by the tier's own timeouts."""
    out: dict[int, str] = {}
    for r, rk in enumerate(ranks):
        if has(rk, Capability.LOCAL_FILES):
            continue
        try:
            rk.listdir()
        except RankUnavailableError as exc:
            out[r] = str(exc)
    return out


def stats(t: Tiers, account: Account) -> dict[str, Any]:
    """The backing's kind, the disk's budget and use (a durable backing), its RAM tier's."""
    b = t.backing
    out: dict[str, Any] = {"kind": b.kind}
    if not b.volatile:
        out["disk"] = {"capacity_bytes": account.capacity, "used_bytes": account.charged}
    if b.tier is not None:
        out["ram"] = b.tier.stats()
    return out
