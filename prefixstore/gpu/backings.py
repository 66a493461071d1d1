"""Backings: where shard bytes live. ``disk``, ``memory`` and ``composite``.

- ``disk`` (durable, the default): ``LocalRank`` files; what survives a restart is
  what the catalog says.
- ``memory`` (volatile): shards live in host RAM (``RamTier``, pinned buffers on a
  CUDA executor, so a restore uploads straight from them). The engine's capacity is
  the RAM budget. The catalog is still a SQLite file in the cache directory and every
  mutation is still journaled; its meta row ``backing=memory`` marks its rows volatile:
  the next open drops them all (one commit) before recovery, since the bytes they
  described died with the process.
- ``composite``: RAM in front of disk, write-through. A store writes the file durably
  (exactly as ``disk``) and then keeps the staged buffer in an LRU RAM tier of
  ``ram_bytes``; a restore reads RAM when it holds the shard and the file otherwise
  (and then promotes it into RAM). After a restart the RAM is empty and the disk
  copies serve; the engine's capacity is the disk budget.

Each tier keeps its own capacity and counters (``stats()``), and ``audit`` checks its
accounting against the catalog (DESIGN.md invariant 3): the RAM tier's used bytes are
exactly the sizes of the shards it holds, never above its capacity, and every shard
it holds is a catalog file of the same size and (for live files) checksum.

The rank objects implement ``gpu.ranks.RankIO`` plus optional methods the engine uses
when present: ``adopt_shard(name, buffer)`` (take a staged buffer as the stored copy,
no copy), ``view_shard(name)`` (a retained ``Buffer`` of a RAM-resident shard, or
None), ``promote(name, buffer)`` and ``read_shard_into(name, out)``.
"""

from __future__ import annotations

import errno
import threading
from collections import OrderedDict
from typing import TYPE_CHECKING, Any

from prefixstore.engine.errors import InvalidInputError
from prefixstore.gpu import shards
from prefixstore.gpu.executor import Buffer, StagingPool

if TYPE_CHECKING:
    from prefixstore.engine.api import Engine
    from prefixstore.engine.audit import AuditReport
    from prefixstore.gpu.ranks import RankIO

BACKINGS = ("disk", "memory", "composite")
META_KEY = "backing"


class RamTier:
    """Shard buffers in host RAM under a byte budget, keyed by (rank, name).

    ``evictable`` (composite): inserting makes room by dropping least recently used
    entries. Not evictable (memory): a full tier refuses with ENOSPC (the engine's
    capacity accounting keeps that from happening).
    """

    def __init__(self, capacity: int, pool: StagingPool, *, evictable: bool, name: str) -> None:
        if capacity <= 0:
            raise InvalidInputError(f"{name} RAM budget must be positive, got {capacity}")
        self.capacity = int(capacity)
        self.pool = pool
        self.evictable = evictable
        self.name = name
        self._lock = threading.Lock()
        self._entries: OrderedDict[tuple[int, str], Buffer] = OrderedDict()
        self.used = 0
        self.counters = dict.fromkeys(
            ("hits", "misses", "inserts", "evictions", "removes", "rejected", "promotions", "copied_in"), 0
        )

    def insert(self, rank: int, name: str, buf: Buffer) -> bool:
        """Take ``buf`` (the caller's reference) as the copy of ``name``; False if it cannot fit."""
        key = (rank, name)
        size = buf.nbytes
        dropped: list[Buffer] = []
        with self._lock:
            if key in self._entries:
                raise FileExistsError(errno.EEXIST, "shard already in RAM", name)
            if self.used + size > self.capacity:
                if not self.evictable:
                    self.counters["rejected"] += 1
                    raise OSError(errno.ENOSPC, f"{self.name} RAM tier full", name)
                if size > self.capacity:
                    self.counters["rejected"] += 1
                    return False
                while self.used + size > self.capacity:
                    _, old = self._entries.popitem(last=False)
                    self.used -= old.nbytes
                    self.counters["evictions"] += 1
                    dropped.append(old)
            self._entries[key] = buf
            self.used += size
            self.counters["inserts"] += 1
        for old in dropped:
            old.release()
        return True

    def get(self, rank: int, name: str) -> Buffer | None:
        """The resident buffer of ``name``, retained for the caller (who releases it)."""
        with self._lock:
            buf = self._entries.get((rank, name))
            if buf is None:
                self.counters["misses"] += 1
                return None
            self._entries.move_to_end((rank, name))
            self.counters["hits"] += 1
            return buf.retain()

    def peek(self, rank: int, name: str) -> Buffer | None:
        """The resident buffer without touching recency or counters (not retained)."""
        with self._lock:
            return self._entries.get((rank, name))

    def remove(self, rank: int, name: str) -> bool:
        with self._lock:
            buf = self._entries.pop((rank, name), None)
            if buf is None:
                return False
            self.used -= buf.nbytes
            self.counters["removes"] += 1
        buf.release()
        return True

    def names(self, rank: int) -> list[str]:
        with self._lock:
            return sorted(n for r, n in self._entries if r == rank)

    def items(self) -> list[tuple[tuple[int, str], Buffer]]:
        with self._lock:
            return list(self._entries.items())

    def clear(self) -> None:
        with self._lock:
            bufs = list(self._entries.values())
            self._entries.clear()
            self.used = 0
        for b in bufs:
            b.release()

    def stats(self) -> dict[str, int]:
        with self._lock:
            return {"capacity_bytes": self.capacity, "used_bytes": self.used,
                    "entries": len(self._entries), **self.counters}


class MemoryRank:
    """A rank whose shards live only in a ``RamTier`` (volatile)."""

    volatile = True

    def __init__(self, rank: int, tier: RamTier) -> None:
        self.rank = rank
        self.directory = ""
        self.tier = tier

    def adopt_shard(self, name: str, buf: Buffer) -> None:
        """Keep ``buf`` (a staged shard) as the stored copy: no byte is copied."""
        self.tier.insert(self.rank, name, buf)

    def write_shard(self, name: str, data: bytes | memoryview) -> None:
        """Store bytes built elsewhere (compaction): copied once into a tier buffer."""
        mv = memoryview(data).cast("B")
        buf = self.tier.pool.acquire(len(mv))
        buf.mv()[:] = mv
        self.tier.counters["copied_in"] += len(mv)
        try:
            self.tier.insert(self.rank, name, buf)
        except BaseException:
            buf.release()
            raise

    def view_shard(self, name: str) -> Buffer | None:
        return self.tier.get(self.rank, name)

    def read_shard(self, name: str) -> bytes:
        buf = self.tier.peek(self.rank, name)
        if buf is None:
            raise FileNotFoundError(errno.ENOENT, "shard not in RAM", name)
        return bytes(buf.mv())

    def remove(self, name: str) -> bool:
        return self.tier.remove(self.rank, name)

    def remove_temp(self, name: str) -> None:
        """RAM holds no temporaries."""

    def quarantine(self, entry: str) -> str:
        self.tier.remove(self.rank, entry)
        return ""

    def sync_dir(self) -> None:
        """Nothing to make durable."""

    def size(self, name: str) -> int | None:
        buf = self.tier.peek(self.rank, name)
        return None if buf is None else buf.nbytes

    def listdir(self) -> list[str]:
        return self.tier.names(self.rank)


class CompositeRank:
    """RAM (an LRU ``RamTier``) in front of a durable rank, write-through."""

    volatile = False

    def __init__(self, disk: RankIO, tier: RamTier, *, promote_on_read: bool = True) -> None:
        self.disk = disk
        self.rank = disk.rank
        self.directory = disk.directory
        self.tier = tier
        self.promote_on_read = promote_on_read

    @property
    def copies_on_read(self) -> bool:
        return bool(getattr(self.disk, "copies_on_read", False))

    @property
    def available(self) -> bool:
        return bool(getattr(self.disk, "available", True))

    def adopt_shard(self, name: str, buf: Buffer) -> None:
        """Write the file durably from ``buf``, then keep ``buf`` in RAM."""
        self.disk.write_shard(name, buf.mv())
        if not self.tier.insert(self.rank, name, buf):
            buf.release()

    def write_shard(self, name: str, data: bytes | memoryview) -> None:
        self.disk.write_shard(name, data)

    def view_shard(self, name: str) -> Buffer | None:
        return self.tier.get(self.rank, name)

    def promote(self, name: str, buf: Buffer) -> None:
        """Keep a verified buffer read from disk in RAM (takes one reference of ``buf``)."""
        if not self.promote_on_read or self.tier.peek(self.rank, name) is not None:
            return
        buf.retain()
        try:
            ok = self.tier.insert(self.rank, name, buf)
        except FileExistsError:
            ok = False
        if ok:
            self.tier.counters["promotions"] += 1
        else:
            buf.release()

    def read_shard(self, name: str) -> bytes:
        return self.disk.read_shard(name)

    def read_shard_into(self, name: str, out: memoryview) -> int:
        reader = getattr(self.disk, "read_shard_into", None)
        if reader is not None:
            return reader(name, out)
        data = self.disk.read_shard(name)
        n = min(len(data), len(out))
        out[:n] = data[:n]
        return len(data)

    def remove(self, name: str) -> bool:
        self.tier.remove(self.rank, name)
        return self.disk.remove(name)

    def remove_temp(self, name: str) -> None:
        self.disk.remove_temp(name)

    def quarantine(self, entry: str) -> str:
        return self.disk.quarantine(entry)

    def sync_dir(self) -> None:
        self.disk.sync_dir()

    def size(self, name: str) -> int | None:
        return self.disk.size(name)

    def listdir(self) -> list[str]:
        return self.disk.listdir()


class Backing:
    """The engine's backing: its kind, its RAM tier (if any), and its checks."""

    def __init__(self, kind: str, tier: RamTier | None) -> None:
        self.kind = kind
        self.tier = tier

    @property
    def volatile(self) -> bool:
        return self.kind == "memory"

    def bind(self, ranks: list[RankIO], *, given: bool) -> list[RankIO]:
        """The rank objects the engine uses, built over the durable ``ranks``."""
        if self.kind == "disk":
            return ranks
        assert self.tier is not None
        if self.kind == "memory":
            if given:
                raise InvalidInputError("backing='memory' keeps shards in this process; it takes no ranks=")
            return [MemoryRank(r.rank, self.tier) for r in ranks]
        return [CompositeRank(r, self.tier) for r in ranks]

    def stats(self, eng: Engine) -> dict[str, Any]:
        out: dict[str, Any] = {"kind": self.kind}
        if self.kind != "memory":
            out["disk"] = {"capacity_bytes": eng.capacity, "used_bytes": eng._charged}
        if self.tier is not None:
            out["ram"] = self.tier.stats()
        return out

    def audit(self, eng: Engine, rep: AuditReport, checksums: bool) -> None:
        """Invariant 3 for the RAM tier: exact, bounded, and only catalog files."""
        tier = self.tier
        if tier is None:
            return
        rows = {
            (r, name): (size, ck, status)
            for r, name, size, ck, status in eng.catalog.query("SELECT rank, name, size, checksum, status FROM files")
        }
        total = 0
        items = tier.items()
        for (r, name), buf in items:
            total += buf.nbytes
            row = rows.get((r, name))
            if row is None:
                rep.add(3, f"RAM tier holds rank{r}/{name}, unknown to the catalog")
                continue
            size, ck, status = row
            if buf.nbytes != size:
                rep.add(3, f"RAM tier holds rank{r}/{name} as {buf.nbytes} bytes, catalog says {size}")
            elif checksums and status == "live" and ck and shards.checksum(buf.mv()) != ck:
                rep.add(1, f"RAM tier copy of rank{r}/{name} fails its checksum")
        if total != tier.used:
            rep.add(3, f"RAM tier counts {tier.used} used bytes, its shards sum to {total}")
        if tier.used > tier.capacity:
            rep.add(3, f"RAM tier uses {tier.used} bytes, above its capacity {tier.capacity}")
        rep.accounting[f"ram_{self.kind}_used"] = tier.used
        rep.accounting[f"ram_{self.kind}_capacity"] = tier.capacity


def open_backing(eng: Engine, kind: str, ram_bytes: int | None) -> Backing:
    """Validate the options, prepare the catalog (drop volatile rows), build the tier.

    Runs before recovery, with the catalog open. A cache last opened with
    ``backing='memory'`` loses every row here, in one commit: nothing it described
    survived the process. A durable cache holding rows cannot be reopened as
    ``memory`` (its files would be orphaned); open it as ``disk`` or ``composite``.
    """
    if kind not in BACKINGS:
        raise InvalidInputError(f"backing must be one of {BACKINGS}, got {kind!r}")
    if ram_bytes is not None and int(ram_bytes) <= 0:
        raise InvalidInputError(f"ram_bytes must be positive, got {ram_bytes}")
    cat = eng.catalog
    stored = cat.meta(META_KEY) or "disk"
    if stored == "memory":
        drop_volatile_rows(eng)
    elif kind == "memory" and cat.query("SELECT 1 FROM files LIMIT 1"):
        raise InvalidInputError(
            f"{eng.root} holds a durable ({stored}) cache; open it with backing='disk' or 'composite'"
        )
    if stored != kind:
        with cat.txn("backing") as c:
            cat.set_meta(c, META_KEY, kind)
    tier = None
    if kind == "memory":
        if ram_bytes is not None and int(ram_bytes) < eng.capacity:
            raise InvalidInputError(
                "backing='memory': capacity_bytes is the RAM budget; ram_bytes, if given, must not be smaller"
            )
        tier = RamTier(int(ram_bytes or eng.capacity), eng.executor.pool, evictable=False, name="memory")
    elif kind == "composite":
        tier = RamTier(int(ram_bytes or eng.capacity), eng.executor.pool, evictable=True, name="composite")
    return Backing(kind, tier)


def drop_volatile_rows(eng: Engine) -> int:
    """Forget every row of a volatile cache in one commit; returns the rows dropped."""
    cat = eng.catalog
    n = cat.query("SELECT (SELECT count(*) FROM nodes) + (SELECT count(*) FROM files)")[0][0]
    if not n and not cat.query("SELECT 1 FROM journal LIMIT 1"):
        return 0
    with cat.txn("backing.drop_volatile") as c:
        c.execute("DELETE FROM files")
        c.execute("DELETE FROM journal")
        c.execute("UPDATE nodes SET parent=NULL")
        c.execute("DELETE FROM nodes")
    return int(n)
