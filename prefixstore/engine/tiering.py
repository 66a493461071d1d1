"""The engine's side of its tiers: the catalog's ``backing`` row, volatile rows, stats, audit.

The tiers themselves (``gpu/tier.py``, ``gpu/tiers/``) never see the catalog; this
module talks to them through the tier protocol only:

- ``open_backing``: before recovery, with the catalog open: look the ``backing=`` name
  up in the registry, drop the rows of a cache last opened with a volatile backing (its
  bytes died with that process), refuse a volatile backing over durable rows, record
  the name, build the backing.
- ``stats``/``audit``: each tier's capacity and counters, and the RAM tier's accounting
  against the catalog (DESIGN.md invariant 3): its used bytes are exactly the sizes of
  the shards it holds, never above its capacity, and every shard it holds is a catalog
  file of the same size and (for live files) checksum.
- ``local_dirs``, ``audit_dirs``, ``ranks_down``: what the engine needs to know about
  its tiers, read from their declared capabilities.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from prefixstore.base.errors import InvalidInputError
from prefixstore.engine.driver import Journal
from prefixstore.gpu import tiers, verify
from prefixstore.gpu.tier import Backing, Capability, Tier, TierOptions, has

if TYPE_CHECKING:
    from prefixstore.engine.api import Engine
    from prefixstore.engine.audit import AuditReport


def open_backing(eng: Engine, kind: str, ram_bytes: int | None) -> Backing:
    """Validate the options, prepare the catalog (drop volatile rows), build the backing.

    A cache last opened with a volatile backing loses every row here, in one commit:
    nothing it described survived the process. A durable cache holding rows cannot be
    reopened with a volatile backing (its files would be orphaned); open it durable.
    """
    factory = tiers.lookup(kind)
    if ram_bytes is not None and int(ram_bytes) <= 0:
        raise InvalidInputError(f"ram_bytes must be positive, got {ram_bytes}")
    cat = eng.catalog
    stored = cat.meta(tiers.META_KEY) or "disk"
    if stored == kind:
        was_volatile = factory.volatile
    else:
        was_volatile = tiers.lookup(stored).volatile if stored in tiers.TIERS else False
    if was_volatile:
        drop_volatile_rows(eng)
    elif factory.volatile and cat.query("SELECT 1 FROM files LIMIT 1"):
        raise InvalidInputError(
            f"{eng.root} holds a durable ({stored}) cache; open it with backing='disk' or 'composite'"
        )
    if stored != kind:
        with cat.txn("backing") as c:
            cat.set_meta(c, tiers.META_KEY, kind)
    return factory(TierOptions(eng.capacity, None if ram_bytes is None else int(ram_bytes), eng.executor.pool))


def drop_volatile_rows(eng: Engine) -> int:
    """Forget every row of a volatile cache in one commit; returns the rows dropped."""
    cat = eng.catalog
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


def stats(eng: Engine) -> dict[str, Any]:
    """The backing's kind, the disk's budget and use (a durable backing), its RAM tier's."""
    b = eng.backing
    out: dict[str, Any] = {"kind": b.kind}
    if not b.volatile:
        out["disk"] = {"capacity_bytes": eng.capacity, "used_bytes": eng._charged}
    if b.tier is not None:
        out["ram"] = b.tier.stats()
    return out


def audit(eng: Engine, rep: AuditReport, checksums: bool) -> None:
    """Invariant 3 for the RAM tier: exact, bounded, and only catalog files."""
    kind, tier = eng.backing.kind, eng.backing.tier
    if tier is None:
        return
    rows = {
        (r, name): (size, ck, status)
        for r, name, size, ck, status in eng.catalog.query("SELECT rank, name, size, checksum, status FROM files")
    }
    total = 0
    for (r, name), buf in tier.items():
        total += buf.nbytes
        row = rows.get((r, name))
        if row is None:
            rep.add(3, f"RAM tier holds rank{r}/{name}, unknown to the catalog")
            continue
        size, ck, status = row
        if buf.nbytes != size:
            rep.add(3, f"RAM tier holds rank{r}/{name} as {buf.nbytes} bytes, catalog says {size}")
        elif checksums and status == "live" and ck and verify.problem(buf.mv(), None, ck) is not None:
            rep.add(1, f"RAM tier copy of rank{r}/{name} fails its checksum")
    if total != tier.used:
        rep.add(3, f"RAM tier counts {tier.used} used bytes, its shards sum to {total}")
    if tier.used > tier.capacity:
        rep.add(3, f"RAM tier uses {tier.used} bytes, above its capacity {tier.capacity}")
    rep.accounting[f"ram_{kind}_used"] = tier.used
    rep.accounting[f"ram_{kind}_capacity"] = tier.capacity
