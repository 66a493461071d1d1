"""The ``memory`` backing: shards live only in host RAM (volatile).

Shards are ``RamTier`` buffers (pinned on a CUDA executor, so a restore uploads
straight from them). The engine's capacity is the RAM budget. The catalog is still a
SQLite file in the cache directory and every mutation is still journaled; its meta row
``backing=memory`` marks its rows volatile: the next open drops them all (one commit)
before recovery, since the bytes they described died with the process.
"""

from __future__ import annotations

import errno
from collections.abc import Sequence
from typing import Any

from prefixstore.base.errors import InvalidInputError
from prefixstore.gpu.executor import Buffer
from prefixstore.gpu.tier import Capability, Tier, TierOptions
from prefixstore.gpu.tiers.ram import RamTier


class MemoryRank:
    """A rank whose shards live only in a ``RamTier``."""

    capabilities = Capability.VOLATILE | Capability.ADOPTS_BUFFERS | Capability.RESIDENT_VIEWS
    available = True

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


class MemoryBacking:
    """Every rank a ``MemoryRank`` over one non-evicting ``RamTier``."""

    kind = "memory"
    volatile = True

    def __init__(self, options: TierOptions) -> None:
        ram = options.ram_bytes
        if ram is not None and int(ram) < options.capacity:
            raise InvalidInputError(
                "backing='memory': capacity_bytes is the RAM budget; ram_bytes, if given, must not be smaller"
            )
        self.tier = RamTier(int(ram or options.capacity), options.pool, evictable=False, name="memory")

    def bind(self, ranks: Sequence[Any], *, given: bool) -> list[Tier]:
        if given:
            raise InvalidInputError("backing='memory' keeps shards in this process; it takes no ranks=")
        return [MemoryRank(r.rank, self.tier) for r in ranks]
