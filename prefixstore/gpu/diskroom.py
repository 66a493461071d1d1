"""Room on the file systems under a cache: free bytes, free inodes and the catalog's reserve file.

A file system can run out of bytes or of inodes (files); both are counted wherever
room is judged. The catalog's own bytes (its write-ahead log, bounded by
``WAL_LIMIT_BYTES``, and about a kilobyte per node) are not charged against
capacity. Instead the engine keeps them room on the file system that holds the
catalog:

- the catalog's next growth is allocated inside its own files without growing them
  (``hold_catalog_room``: its log up to ``WAL_LIMIT_BYTES``, ``ROW_ROOM`` bytes past
  the database's end), so a commit seldom needs a free byte, even when another
  writer takes every free byte between a check and that commit;
- a store's space step keeps ``CATALOG_MARGIN`` bytes (less what those files hold
  allocated, at least ``MARGIN_FLOOR``) and ``INODE_MARGIN`` inodes free there beyond
  the shards it writes (evicting by policy when the disk, not the capacity, is short,
  and only when eviction can make the room at all);
- a reserve file (``RESERVE_NAME``, ``reserve_bytes`` preallocated) is held there
  and released before a catalog write that finds less than ``LOW_WATER`` bytes or
  ``INODE_LOW_WATER`` inodes free, so the commits that free bytes (evict, reclaim,
  recovery) never need the disk to grow first; it is taken back once the disk has
  room for it again, never by evicting for it.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import stat
import time
from collections.abc import Iterable

import attrs

from prefixstore.base.log import log
from prefixstore.statemachine.room import NO_INODES, NO_SPACE

RESERVE_NAME = "catalog.reserve"
WAL_LIMIT_BYTES = 1 << 20
"""The catalog's write-ahead log is truncated back to this size after a checkpoint (and
held allocated at it, see ``DiskRoom.hold_catalog_room``)."""
WAL_AUTOCHECKPOINT_PAGES = (WAL_LIMIT_BYTES - 32) // (4096 + 24) - 16
"""The log is checkpointed (and then reused from its start) past this many frames
of a 4 KiB page each: 16 frames short of the size limit, so a log that reached its
size is reused, never grown (growing needs free bytes a full disk may not have)."""
ROW_ROOM = 256 << 10
"""Bytes the catalog's database may grow by (new rows, copied in by a checkpoint)."""
CATALOG_MARGIN = WAL_LIMIT_BYTES + ROW_ROOM
"""Free bytes a store leaves on the catalog's file system (log growth, new rows), less
what the catalog's files hold allocated for them already, never below ``MARGIN_FLOOR``."""
INODE_MARGIN = 4
"""Free inodes a store leaves on the catalog's file system (the log, its index, the
reserve's temporary file, one spare)."""
RESERVE_BYTES = 2 << 20
LOW_WATER = 512 << 10
"""Below this many free bytes on the catalog's file system, the reserve is released."""
MARGIN_FLOOR = LOW_WATER + (256 << 10)
"""The least the byte margin comes to, however much the catalog's files hold: above the
low-water mark, so the cache's own stores never make the catalog release its reserve."""
INODE_LOW_WATER = 2
"""Below this many free inodes there (the log and its index need one each to be
created), the reserve is released and the disk counts as full."""
ROOM_FRESH_S = 0.002
"""How old a measure of the catalog's file system (``shortfall``'s, or a catalog
write's own) may be for the next catalog write's reserve check to take it instead of
measuring again; each measure serves one check, so no check sees one older than this.
A fresh measure races another writer between it and the commit's write anyway; this
widens that window by at most this much (a store's intent commit follows its space
step by ~0.1 ms, so it takes that step's measure)."""


FALLOC_FL_KEEP_SIZE = 1
try:
    _fallocate = ctypes.CDLL(None, use_errno=True).fallocate
    _fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]
except (AttributeError, OSError):  # not Linux: the catalog's room stays free space only
    _fallocate = None


def allocate_beyond(path: str, offset: int, length: int) -> bool:
    """Allocate ``path``'s blocks over [offset, offset + length) without changing its
    size (Linux ``fallocate`` with ``FALLOC_FL_KEEP_SIZE``): its writers there then
    need no free byte. False where that cannot be done (no room, no support)."""
    if _fallocate is None:
        return False
    try:
        fd = os.open(path, os.O_WRONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return False
    try:
        return _fallocate(fd, FALLOC_FL_KEEP_SIZE, offset, length) == 0
    finally:
        os.close(fd)


def _allocated(path: str) -> tuple[int, int]:
    """``path``'s size and the bytes it holds allocated ((0, 0) when missing)."""
    try:
        st = os.stat(path)
    except OSError:
        return 0, 0
    return st.st_size, st.st_blocks * 512


@attrs.frozen
class Room:
    """What a file system has free for an unprivileged writer (None: unknown or unlimited)."""

    bytes: int | None
    inodes: int | None
    block: int = 4096
    """The allocation unit: a file takes whole blocks."""


def free_room(path: str) -> Room:
    """Free bytes and inodes on ``path``'s file system (``f_bavail``, ``f_favail``);
    inodes are None where the file system sets no limit (``f_files`` is 0)."""
    try:
        st = os.statvfs(path)
    except OSError:
        return Room(None, None)
    return Room(st.f_bavail * st.f_frsize, st.f_favail if st.f_files else None, st.f_frsize or 4096)


def free_bytes(path: str) -> int | None:
    """Bytes an unprivileged writer may still use on ``path``'s file system (None: unknown)."""
    return free_room(path).bytes


def free_inodes(path: str) -> int | None:
    """Inodes an unprivileged writer may still use there (None: unknown or unlimited)."""
    return free_room(path).inodes


def low(room: Room) -> bool:
    """Whether ``room`` is below the low-water marks (bytes or inodes)."""
    return (room.bytes is not None and room.bytes < LOW_WATER) or (
        room.inodes is not None and room.inodes < INODE_LOW_WATER)


def enospc_reason(path: str, nbytes: int = 0) -> str | None:
    """After ENOSPC writing ``nbytes`` under ``path``: ``no_inodes`` when its file
    system is (nearly) out of inodes, ``no_space`` when it has too few bytes for that
    write, with what it has free; None when it has room (the error came from elsewhere)."""
    room = free_room(path)
    if room.inodes is not None and room.inodes < INODE_MARGIN:
        return f"{NO_INODES}: its file system is out of inodes ({room.inodes} inodes, {room.bytes} bytes free)"
    if room.bytes is not None and room.bytes < nbytes + LOW_WATER:
        return f"{NO_SPACE}: its file system is full ({room.bytes} bytes, {room.inodes} inodes free)"
    return None


@attrs.frozen
class Shortfall:
    """What eviction must free for a write to fit the disk: bytes of shards and shard
    files (inodes), both counted over all ranks. False when nothing is lacking."""

    bytes: int = 0
    files: int = 0

    def __bool__(self) -> bool:
        return self.bytes > 0 or self.files > 0

    @property
    def reason(self) -> str:
        """The refusal reason naming what is lacking."""
        return NO_INODES if self.files > 0 else NO_SPACE


def _device(path: str) -> int | None:
    try:
        return os.stat(path).st_dev
    except OSError:
        return None


def _lack(need: int, free: int | None, n: int, ranks: int) -> int:
    """A device's lack, scaled to all ranks (a node frees its shard on every rank)."""
    if free is None or need <= free:
        return 0
    return -(-(need - free) * ranks // n)


class DiskRoom:
    """Free-space checks for one cache and the catalog's reserve file in its root."""

    def __init__(self, root: str, reserve_bytes: int = RESERVE_BYTES, margin: int = CATALOG_MARGIN,
                 catalog: str | None = None) -> None:
        """``catalog``: the catalog's database file (its log beside it), whose room is
        held in its files and counted toward the margin (None: neither)."""
        self.root = root
        self.catalog = catalog
        self.path = os.path.join(root, RESERVE_NAME)
        self.reserve_bytes = reserve_bytes
        self.margin = margin
        self.releases = 0
        self._dirs: dict[int, tuple[str, int]] = {}  # device -> (a directory on it, ranks there)
        self._ranks = 1
        self._root_dev: int | None = None  # the catalog's file system (``bind``)
        self._measured: tuple[float, Room] | None = None  # the root's last measure, once (``ROOM_FRESH_S``)
        try:
            self.held = stat.S_ISREG(os.lstat(self.path).st_mode)
        except OSError:
            self.held = False

    def bind(self, rank_dirs: Iterable[str | None], ranks: int) -> None:
        """Watch the file systems of the ranks' local directories (others are skipped)."""
        self._ranks = max(1, ranks)
        self._dirs = {}
        self._root_dev = _device(self.root)
        for d in rank_dirs:
            dev = _device(d) if d else None
            if dev is not None:
                path, n = self._dirs.get(dev, (d, 0))
                self._dirs[dev] = (path, n + 1)

    # -- the reserve ----------------------------------------------------------------

    def before_catalog_write(self) -> None:
        """Release the reserve when the catalog's file system is nearly out of bytes or
        inodes (measured now, or at most ``ROOM_FRESH_S`` ago by the step before)."""
        if self.held and low(self.root_room()):
            self.release()

    def root_room(self) -> Room:
        """The catalog's file system's free room: the last measure when it is at most
        ``ROOM_FRESH_S`` old and has served no check yet (it is then spent), else
        measured now (and kept for the next check)."""
        m, self._measured = self._measured, None
        if m is not None and time.monotonic() - m[0] <= ROOM_FRESH_S:
            return m[1]
        room = free_room(self.root)
        self._measured = (time.monotonic(), room)
        return room

    def _spent(self) -> bool:
        return not (self.held and os.path.lexists(self.path))

    def tight(self) -> bool:
        """Whether the catalog's file system is nearly out of bytes with no reserve left
        to give (a commit may then find no byte to grow into); measured only when the
        reserve is spent."""
        if not self._spent():
            return False
        free = free_bytes(self.root)
        return free is not None and free < LOW_WATER

    def full(self) -> bool:
        """Whether the catalog's file system is nearly out of bytes or of inodes with no
        reserve left to give: the catalog may not open, nor a shard be created."""
        return self._spent() and low(free_room(self.root))

    def lack(self) -> tuple[str, str]:
        """For a message: what the catalog's file system has free, and what to free there."""
        room = free_room(self.root)
        if room.inodes is not None and room.inodes < INODE_LOW_WATER:
            return (f"no free inodes: {room.inodes} inodes and {room.bytes} bytes free",
                    f"{INODE_LOW_WATER} inodes (files)")
        return f"{room.bytes} bytes free", f"{LOW_WATER} bytes"

    def hold_catalog_room(self) -> int:
        """Allocate the catalog's next growth inside its files, without growing them:
        its log up to ``WAL_LIMIT_BYTES`` (reused from its start after a checkpoint)
        and ``ROW_ROOM`` past the database's end (a checkpoint's truncation gives that
        back; it is taken again here). Best effort: a full disk leaves it free space.
        Returns ``catalog_room()`` as the files stand after it (for ``shortfall``)."""
        if self.catalog is None:
            return self._room(0, 0, 0, 0)
        log = self.catalog + "-wal"
        log_size, log_held = _allocated(log)
        if log_size and log_held < WAL_LIMIT_BYTES and allocate_beyond(log, 0, WAL_LIMIT_BYTES):
            log_size, log_held = _allocated(log)
        size, held = _allocated(self.catalog)
        if size and held - size < ROW_ROOM and allocate_beyond(self.catalog, size, ROW_ROOM):
            size, held = _allocated(self.catalog)
        return self._room(log_size, log_held, size, held)

    def catalog_room(self) -> int:
        """Free bytes the catalog's file system keeps for the catalog: the margin, less
        what its files hold allocated for their growth (``hold_catalog_room``), and at
        least ``MARGIN_FLOOR``."""
        if self.catalog is None:
            return self._room(0, 0, 0, 0)
        return self._room(*_allocated(self.catalog + "-wal"), *_allocated(self.catalog))

    def _room(self, log_size: int, log_held: int, size: int, db_held: int) -> int:
        held = min(max(log_held, log_size), WAL_LIMIT_BYTES) + min(max(0, db_held - size), ROW_ROOM)
        return max(self.margin - held, min(self.margin, MARGIN_FLOOR))

    def release(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)
        self.held = False
        self.releases += 1
        log.warning("disk_reserve_released", root=self.root, bytes=self.reserve_bytes)

    def restore(self) -> bool:
        """Take the reserve back when the disk has room for it and the margins (bytes
        and inodes); True if held. Nothing is ever evicted for it."""
        if self.held or not self.reserve_bytes:
            return self.held
        room = free_room(self.root)
        if room.bytes is None or room.bytes < self.reserve_bytes + self.catalog_room():
            return False
        if room.inodes is not None and room.inodes < INODE_MARGIN + 1:
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
        """The reserve's state and the catalog file system's free bytes and inodes."""
        room = free_room(self.root)
        return {"reserve_held": self.held, "reserve_bytes": self.reserve_bytes,
                "reserve_releases": self.releases, "free_bytes": room.bytes, "free_inodes": room.inodes}

    # -- room for shards --------------------------------------------------------------

    def shortfall(self, nbytes: int, files: int = 0, catalog_room: int | None = None) -> Shortfall:
        """Bytes of shards and shard files to free so that writing ``nbytes`` more in
        ``files`` new files (both split evenly over the ranks; each file may take up
        to a block more than its bytes) leaves every watched file system its room: the
        catalog's one keeps the byte and inode margins (``catalog_room``: what
        ``hold_catalog_room`` just returned; None: measured). The reserve is not
        counted: taking it back is never a reason to evict."""
        root_dev = self._root_dev
        if root_dev not in self._dirs:
            catalog_room = 0
        elif catalog_room is None:
            catalog_room = self.catalog_room()
        short_bytes = short_files = 0
        for dev, (path, n) in self._dirs.items():
            catalog = dev == root_dev
            room = free_room(path)
            if catalog:  # the next catalog write's reserve check may take it (``root_room``)
                self._measured = (time.monotonic(), room)
            need_files = -(-files * n // self._ranks)
            need_bytes = nbytes * n // self._ranks + need_files * room.block + (catalog_room if catalog else 0)
            need_files += INODE_MARGIN if catalog else 0
            short_bytes = max(short_bytes, _lack(need_bytes, room.bytes, n, self._ranks))
            short_files = max(short_files, _lack(need_files, room.inodes, n, self._ranks))
        return Shortfall(short_bytes, short_files)
