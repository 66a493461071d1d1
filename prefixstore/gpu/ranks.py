"""Per-rank file effects: durable shard writes, reads and idempotent removal.

``RankIO`` (``gpu/tier.py``) is what the engine talks to for one rank. ``LocalRank`` applies the
effects in this process on a rank directory; ``prefixstore.gpu.distributed``
provides the same interface for a rank living in its own process.
"""

from __future__ import annotations

import contextlib
import os
import stat

from prefixstore.base.errors import UnsafeDirectoryError
from prefixstore.gpu.fileio import FaultHook, FileSystem, HookedFS, OsFS
from prefixstore.gpu.tier import Capability

SHARD_SUFFIX = ".st"
TMP_SUFFIX = ".tmp"


def shard_name(key: bytes, generation: int) -> str:
    """File name of a node's shard (the same on every rank, in that rank's directory)."""
    return f"{key.hex()}-g{generation}{SHARD_SUFFIX}"


def rank_dir_name(rank: int) -> str:
    return f"rank{rank}"


class LocalRank:
    """A rank whose directory this process writes directly.

    ``directory`` is named by the caller and resolved once (a symlink to it is
    followed here); every effect after that refuses to follow a symlink. A tier with
    ``READS_INTO`` and ``LOCAL_FILES`` (and ``COPIES_ON_READ`` when its file system
    cannot read in place; ``READS_FD`` when it reads from a descriptor).
    """

    available = True

    def __init__(self, rank: int, directory: str, fs: FileSystem | None = None,
                 hook: FaultHook | None = None) -> None:
        self.rank = rank
        self.directory = os.path.realpath(directory)
        self.fs = HookedFS(fs or OsFS(), hook or FaultHook(), rank)
        self.fs.makedirs(directory)

    def path(self, name: str) -> str:
        return os.path.join(self.directory, name)

    def write_shard(self, name: str, data: bytes) -> None:
        """Write to a temporary name, fsync, rename into place, fsync the directory.

        Raises OSError on any failure; a failed fsync is a failed write (never retried).
        """
        final = self.path(name)
        tmp = final + TMP_SUFFIX
        self.fs.write_new(tmp, data)
        self.fs.fsync(tmp)
        self.fs.rename_new(tmp, final)
        self.fs.fsync_dir(self.directory)

    def read_shard(self, name: str) -> bytes:
        return self.fs.read(self.path(name))

    def durable(self, name: str) -> bool | None:
        """Whether ``name`` would survive a power loss now, from what the file system
        knows (the fault file system) or what this process's writes completed; None
        for a file this process did not write."""
        return self.fs.is_durable(self.path(name))

    def read_shard_into(self, name: str, out: memoryview) -> int:
        """Read ``name`` into ``out``; returns the file's size."""
        return self.fs.read_into(self.path(name), out)

    def read_shard_with(self, name: str, fn):
        """``fn(fd)`` on ``name`` opened for reading (a regular file); what it returns."""
        return self.fs.read_with(self.path(name), fn)

    @property
    def capabilities(self) -> Capability:
        """What this rank declares, worked out once (its file system and class are
        fixed): a restore asks several times per shard."""
        caps = self.__dict__.get("_capabilities")
        if caps is None:
            caps = Capability.READS_INTO | Capability.LOCAL_FILES | Capability.REPORTS_DURABILITY
            if self.fs.reads_fd and self._reads_are_own():
                caps |= Capability.READS_FD
            if self.fs.copies_on_read:
                caps |= Capability.COPIES_ON_READ
            self.__dict__["_capabilities"] = caps
        return caps

    def _reads_are_own(self) -> bool:
        """False for a subclass that overrides ``read_shard`` or ``read_shard_into``: its
        reads go through its own methods, never around them by descriptor."""
        cls = type(self)
        return cls.read_shard is LocalRank.read_shard and cls.read_shard_into is LocalRank.read_shard_into

    def remove(self, name: str) -> bool:
        """Unlink ``name`` and its temporary (the entries themselves, whatever they are; a
        directory in their place goes to ``lost+found``); a file already missing is success.

        Returns True when something was unlinked. Does not fsync the directory:
        call ``sync_dir`` once after a batch.
        """
        removed = False
        for p in (self.path(name), self.path(name) + TMP_SUFFIX):
            if not self.fs.exists(p):  # a symlink or FIFO in its place is unlinked too
                continue
            if os.path.isdir(p) and not os.path.islink(p):  # a directory in its place: moved aside whole
                self.quarantine(os.path.basename(p))
                removed = True
                continue
            try:
                self.fs.unlink(p)
                removed = True
            except FileNotFoundError:
                pass
        return removed

    def remove_temp(self, name: str) -> None:
        """Unlink ``name``'s leftover temporary (missing is success)."""
        p = self.path(name) + TMP_SUFFIX
        if self.fs.exists(p):
            with contextlib.suppress(FileNotFoundError):
                self.fs.unlink(p)

    def is_file(self, entry: str) -> bool:
        """True when ``entry`` is a regular file (not a directory, link or device)."""
        return stat.S_ISREG(os.lstat(self.path(entry)).st_mode)

    def quarantine(self, entry: str) -> str:
        """Move a foreign entry (itself, never what a symlink points to) out of the
        rank directory into ``lost+found``; UnsafeDirectoryError when ``lost+found`` or
        its rank folder is a symlink or not a directory. The entry's new directory is
        fsynced after the move (and a folder made for it, in its parent); the caller
        fsyncs the rank directory it left."""
        parent = os.path.join(os.path.dirname(self.directory), "lost+found")
        dest_dir = os.path.join(parent, os.path.basename(self.directory))
        made: list[str] = []
        for d in (parent, dest_dir):
            with contextlib.suppress(FileExistsError):
                os.mkdir(d)
                made.append(os.path.dirname(d))
            if os.path.islink(d) or not os.path.isdir(d):
                raise UnsafeDirectoryError(f"{d} is a symlink or not a directory; nothing was moved into it")
        n, dest = 0, entry
        while os.path.lexists(os.path.join(dest_dir, dest)):
            n += 1
            dest = f"{entry}.{n}"
        src_fd = os.open(self.directory, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
        try:
            dst_fd = os.open(dest_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
            try:
                os.rename(entry, dest, src_dir_fd=src_fd, dst_dir_fd=dst_fd)
                os.fsync(dst_fd)
            finally:
                os.close(dst_fd)
        finally:
            os.close(src_fd)
        for d in reversed(made):  # lost+found/ before the root: each new folder's entry
            OsFS().fsync_dir(d)
        return os.path.join(dest_dir, dest)

    def sync_dir(self) -> None:
        self.fs.fsync_dir(self.directory)

    def size(self, name: str) -> int | None:
        return self.fs.size(self.path(name))

    def listdir(self) -> list[str]:
        return self.fs.listdir(self.directory)
