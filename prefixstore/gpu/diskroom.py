"""Room on the file systems under a cache: free space and the catalog's reserve file.

The catalog's own bytes (its write-ahead log, bounded by ``WAL_LIMIT_BYTES``, and
about a kilobyte per node) are not charged against capacity. Instead the engine
keeps them room on the file system that holds the catalog:

- a store's space step keeps ``CATALOG_MARGIN`` bytes free there beyond the shards
  it writes (evicting by policy when the disk, not the capacity, is short);
- a reserve file (``RESERVE_NAME``, ``reserve_bytes`` preallocated) is held there
  and released before a catalog write that finds less than ``LOW_WATER`` free, so
  the commits that free bytes (evict, reclaim, recovery) never need the disk to
  grow first; it is taken back once the disk has room again.
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
from collections.abc import Iterable

from prefixstore.base.log import log

RESERVE_NAME = "catalog.reserve"
WAL_LIMIT_BYTES = 1 << 20
"""The catalog's write-ahead log is checkpointed and truncated at about this size."""
WAL_AUTOCHECKPOINT_PAGES = WAL_LIMIT_BYTES // 4096
CATALOG_MARGIN = WAL_LIMIT_BYTES + (256 << 10)
"""Free bytes a store leaves on the catalog's file system (log growth, new rows)."""
RESERVE_BYTES = 2 << 20
LOW_WATER = 512 << 10
"""Below this many free bytes on the catalog's file system, the reserve is released."""


def free_bytes(path: str) -> int | None:
    """Bytes an unprivileged writer may still use on ``path``'s file system (None: unknown)."""
    try:
        st = os.statvfs(path)
    except OSError:
        return None
    return st.f_bavail * st.f_frsize


def _device(path: str) -> int | None:
    try:
        return os.stat(path).st_dev
    except OSError:
        return None


class DiskRoom:
    """Free-space checks for one cache and the catalog's reserve file in its root."""

    def __init__(self, root: str, reserve_bytes: int = RESERVE_BYTES, margin: int = CATALOG_MARGIN) -> None:
        self.root = root
        self.path = os.path.join(root, RESERVE_NAME)
        self.reserve_bytes = reserve_bytes
        self.margin = margin
        self.releases = 0
        self._dirs: dict[int, tuple[str, int]] = {}  # device -> (a directory on it, ranks there)
        self._ranks = 1
        try:
            self.held = stat.S_ISREG(os.lstat(self.path).st_mode)
        except OSError:
            self.held = False

    def bind(self, rank_dirs: Iterable[str | None], ranks: int) -> None:
        """Watch the file systems of the ranks' local directories (others are skipped)."""
        self._ranks = max(1, ranks)
        self._dirs = {}
        for d in rank_dirs:
            dev = _device(d) if d else None
            if dev is not None:
                path, n = self._dirs.get(dev, (d, 0))
                self._dirs[dev] = (path, n + 1)

    # -- the reserve ----------------------------------------------------------------

    def before_catalog_write(self) -> None:
        """Release the reserve when the catalog's file system is nearly full."""
        if self.held:
            free = free_bytes(self.root)
            if free is not None and free < LOW_WATER:
                self.release()

    def tight(self) -> bool:
        """Whether the catalog's file system is nearly full with no reserve left to give."""
        if self.held and os.path.lexists(self.path):
            return False
        free = free_bytes(self.root)
        return free is not None and free < LOW_WATER

    def release(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)
        self.held = False
        self.releases += 1
        log.warning("disk_reserve_released", root=self.root, bytes=self.reserve_bytes)

    def restore(self) -> bool:
        """Take the reserve back when the disk has room for it and the margin; True if held."""
        if self.held or not self.reserve_bytes:
            return self.held
        free = free_bytes(self.root)
        if free is None or free < self.reserve_bytes + self.margin:
            return False
        tmp = self.path + ".tmp"
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o644)
            try:
                os.posix_fallocate(fd, 0, self.reserve_bytes)
            finally:
                os.close(fd)
            os.replace(tmp, self.path)
        except OSError as exc:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            if exc.errno != errno.ENOSPC:
                self.reserve_bytes = 0  # this file system cannot hold one: stop trying
            log.warning("disk_reserve_unavailable", root=self.root, error=str(exc))
            return False
        self.held = True
        return True

    def stats(self) -> dict[str, int | bool | None]:
        """The reserve's state and the catalog file system's free bytes."""
        return {"reserve_held": self.held, "reserve_bytes": self.reserve_bytes,
                "reserve_releases": self.releases, "free_bytes": free_bytes(self.root)}

    # -- room for shards --------------------------------------------------------------

    def shortfall(self, nbytes: int, *, reserve: bool = True) -> int:
        """Bytes of shards to free so that writing ``nbytes`` more (split evenly over the
        ranks) leaves every watched file system its room: the catalog's one keeps the
        margin, and (with ``reserve``) room to take the reserve back when it is not held."""
        root_dev = _device(self.root)
        short = 0
        for dev, (path, n) in self._dirs.items():
            need = nbytes * n // self._ranks + (self._catalog_room(reserve) if dev == root_dev else 0)
            free = free_bytes(path)
            if free is not None and need > free:
                # a node frees its shard on every rank: scale this device's lack to all ranks
                short = max(short, -(-(need - free) * self._ranks // n))
        return short

    def _catalog_room(self, reserve: bool) -> int:
        return self.margin + (0 if self.held or not reserve else self.reserve_bytes)
