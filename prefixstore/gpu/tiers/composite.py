"""The ``composite`` backing: RAM in front of disk, write-through.

A store writes the file durably (exactly as ``disk``) and then keeps the staged buffer
in an LRU ``RamTier`` of ``ram_bytes``; a restore reads RAM when it holds the shard and
the file otherwise (and then promotes it into RAM). After a restart the RAM is empty
and the disk copies serve; the engine's capacity is the disk budget.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from prefixstore.gpu.executor import Buffer
from prefixstore.gpu.tier import Capability, Tier, TierOptions, has
from prefixstore.gpu.tiers.disk import as_tier
from prefixstore.gpu.tiers.ram import RamTier

_OWN = Capability.ADOPTS_BUFFERS | Capability.RESIDENT_VIEWS | Capability.PROMOTES | Capability.READS_INTO
_FROM_DISK = Capability.COPIES_ON_READ | Capability.LOCAL_FILES | Capability.REPORTS_DURABILITY


class CompositeRank:
    """RAM (an LRU ``RamTier``) in front of a durable tier, write-through."""

    def __init__(self, disk: Tier, tier: RamTier, *, promote_on_read: bool = True) -> None:
        self.disk = disk
        self.rank = disk.rank
        self.directory = disk.directory
        self.tier = tier
        self.promote_on_read = promote_on_read

    @property
    def capabilities(self) -> Capability:
        return _OWN | (self.disk.capabilities & _FROM_DISK)

    @property
    def available(self) -> bool:
        return self.disk.available

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

    def durable(self, name: str) -> bool | None:
        return self.disk.durable(name)  # type: ignore[attr-defined]

    def read_shard(self, name: str) -> bytes:
        return self.disk.read_shard(name)

    def read_shard_into(self, name: str, out: memoryview) -> int:
        if has(self.disk, Capability.READS_INTO):
            return self.disk.read_shard_into(name, out)  # type: ignore[attr-defined]
        data = self.disk.read_shard(name)
        n = min(len(data), len(out))
        out[:n] = data[:n]
        return len(data)

    def is_file(self, entry: str) -> bool:
        return self.disk.is_file(entry)  # type: ignore[attr-defined]

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


class CompositeBacking:
    """Each rank a ``CompositeRank`` over its durable rank, sharing one LRU ``RamTier``."""

    kind = "composite"
    volatile = False

    def __init__(self, options: TierOptions) -> None:
        self.tier = RamTier(int(options.ram_bytes or options.capacity), options.pool, evictable=True,
                            name="composite")

    def bind(self, ranks: Sequence[Any], *, given: bool) -> list[Tier]:
        return [CompositeRank(as_tier(r), self.tier) for r in ranks]
