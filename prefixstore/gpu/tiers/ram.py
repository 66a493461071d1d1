"""``RamTier``: shard buffers in host RAM under a byte budget (the RAM of the
``memory`` and ``composite`` backings)."""

from __future__ import annotations

import errno
import threading
from collections import OrderedDict

from prefixstore.base.errors import InvalidInputError
from prefixstore.gpu.executor import Buffer, StagingPool


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
