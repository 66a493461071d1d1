"""The ``disk`` backing (durable, the default): each rank's shards are files.

A rank is a ``LocalRank`` on its rank directory (``gpu/ranks.py``), or the caller's
rank objects (``ranks=``: e.g. ``gpu/distributed.RemoteRank``, a rank in its own
process). What survives a restart is what the catalog says.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from prefixstore.gpu.distributed import RemoteRank
from prefixstore.gpu.tier import Capability, RankIO, Tier, TierOptions


class DeclaredRank:
    """A ``RankIO`` that declares no capability of its own, as a tier: only the required
    operations are used; ``available`` is the rank process's own when it has one."""

    capabilities = Capability.NONE

    def __init__(self, inner: RankIO) -> None:
        self.inner = inner
        self.rank = inner.rank
        self.directory = inner.directory

    @property
    def available(self) -> bool:
        return self.inner.available if isinstance(self.inner, RemoteRank) else True

    @property
    def location(self) -> str:
        """Where the rank's files are, as the audit names them."""
        return getattr(self.inner, "location", self.directory)

    def write_shard(self, name: str, data: bytes | memoryview) -> None:
        self.inner.write_shard(name, data)  # type: ignore[arg-type]

    def read_shard(self, name: str) -> bytes:
        return self.inner.read_shard(name)

    def remove(self, name: str) -> bool:
        return self.inner.remove(name)

    def remove_temp(self, name: str) -> None:
        self.inner.remove_temp(name)

    def quarantine(self, entry: str) -> str:
        return self.inner.quarantine(entry)

    def sync_dir(self) -> None:
        self.inner.sync_dir()

    def size(self, name: str) -> int | None:
        return self.inner.size(name)

    def listdir(self) -> list[str]:
        return self.inner.listdir()


def as_tier(rank: Any) -> Tier:
    """``rank`` itself when it implements the tier protocol (declares its capabilities),
    else a ``DeclaredRank`` over it."""
    return rank if isinstance(rank, Tier) else DeclaredRank(rank)


class DiskBacking:
    """The durable ranks themselves, no RAM tier."""

    kind = "disk"
    volatile = False
    tier = None

    def __init__(self, options: TierOptions) -> None:
        self.options = options

    def bind(self, ranks: Sequence[Any], *, given: bool) -> list[Tier]:
        return [as_tier(r) for r in ranks]
