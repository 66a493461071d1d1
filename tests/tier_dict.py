"""A test-only tier: each rank's shards in a dict, every read counted.

The whole of adding a tier: this module (a rank class implementing the tier protocol
and a backing that builds one per rank) plus ``tiers.register("dict", DictBacking)``.
It declares ``VOLATILE`` and ``READS_INTO`` only; its ``adopt_shard``, ``view_shard``
and ``promote`` exist but refuse to be called: an engine that looked for methods by
name instead of reading the declaration would call them.
"""

from __future__ import annotations

import errno
import threading
from collections.abc import Sequence
from typing import Any

from prefixstore.gpu.tier import Capability, Tier, TierOptions


class UndeclaredCall(AssertionError):
    """The engine called an operation this tier does not declare."""


class DictRank:
    """One rank's shards as bytes in a dict."""

    capabilities = Capability.VOLATILE | Capability.READS_INTO
    available = True

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.directory = ""
        self.shards: dict[str, bytearray] = {}
        self.reads = 0  # read_shard and read_shard_into calls
        self._lock = threading.Lock()

    def write_shard(self, name: str, data: bytes | memoryview) -> None:
        with self._lock:
            self.shards[name] = bytearray(memoryview(data).cast("B"))

    def read_shard(self, name: str) -> bytes:
        with self._lock:
            self.reads += 1
            if name not in self.shards:
                raise FileNotFoundError(errno.ENOENT, "no such shard", name)
            return bytes(self.shards[name])

    def read_shard_into(self, name: str, out: memoryview) -> int:
        with self._lock:
            self.reads += 1
            data = self.shards.get(name)
            if data is None:
                raise FileNotFoundError(errno.ENOENT, "no such shard", name)
            n = min(len(data), len(out))
            out[:n] = data[:n]
            return len(data)

    def remove(self, name: str) -> bool:
        with self._lock:
            return self.shards.pop(name, None) is not None

    def remove_temp(self, name: str) -> None:
        """A dict holds no temporaries."""

    def quarantine(self, entry: str) -> str:
        self.remove(entry)
        return ""

    def sync_dir(self) -> None:
        """Nothing to make durable."""

    def size(self, name: str) -> int | None:
        with self._lock:
            data = self.shards.get(name)
            return None if data is None else len(data)

    def listdir(self) -> list[str]:
        with self._lock:
            return sorted(self.shards)

    def adopt_shard(self, name: str, buf: Any) -> None:
        raise UndeclaredCall("adopt_shard called on a tier without ADOPTS_BUFFERS")

    def view_shard(self, name: str) -> Any:
        raise UndeclaredCall("view_shard called on a tier without RESIDENT_VIEWS")

    def promote(self, name: str, buf: Any) -> None:
        raise UndeclaredCall("promote called on a tier without PROMOTES")


class DictBacking:
    """Every rank a ``DictRank``; no RAM tier of its own."""

    kind = "dict"
    volatile = True
    tier = None

    def __init__(self, options: TierOptions) -> None:
        self.ranks: list[DictRank] = []

    def bind(self, ranks: Sequence[Any], *, given: bool) -> list[Tier]:
        self.ranks = [DictRank(r.rank) for r in ranks]
        return list(self.ranks)
