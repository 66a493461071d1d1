"""The file operations executors apply, behind one small interface.

Every effect the engine runs goes through a ``FileSystem`` so that tests can swap in
a fault-injecting one (``prefixstore.fuzz.faultfs``) and so that a ``FaultHook`` sees
each effect before and after it runs (crash points). Operations are file-granular:
``write_new`` creates a file that must not exist, ``fsync`` syncs a named file,
``fsync_dir`` makes creates/renames/unlinks in a directory durable.

``OsFS`` opens files ``O_NOFOLLOW``, refuses a path whose directory is a symlink, and
reads only regular files, opened without blocking (``open_regular``): a shard path
replaced by a symlink, FIFO or device raises ``NotRegularFileError`` (damage) at once.
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
from typing import Protocol

from prefixstore.base.debug import debug_from_env
from prefixstore.base.errors import NotRegularFileError


class FileSystem(Protocol):
    """The file operations the engine needs. Paths are absolute strings."""

    def write_new(self, path: str, data: bytes | memoryview) -> None: ...
    def fsync(self, path: str) -> None: ...
    def rename_new(self, src: str, dst: str) -> None: ...
    def fsync_dir(self, path: str) -> None: ...
    def unlink(self, path: str) -> None: ...
    def read(self, path: str) -> bytes: ...
    def size(self, path: str) -> int | None: ...
    def exists(self, path: str) -> bool: ...
    def listdir(self, path: str) -> list[str]: ...
    def makedirs(self, path: str) -> None: ...


_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_READ_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC


def _check_dir_of(path: str) -> None:
    """NotRegularFileError when the directory holding ``path`` is a symlink or not a
    directory (a missing one raises FileNotFoundError)."""
    d = os.path.dirname(path) or "."
    mode = os.lstat(d).st_mode
    if not stat.S_ISDIR(mode):
        raise NotRegularFileError(errno.ENOTDIR, "its directory is a symlink or not a directory", path)


def _not_regular(mode: int) -> str:
    kind = ("a symlink" if stat.S_ISLNK(mode) else "a FIFO" if stat.S_ISFIFO(mode)
            else "a directory" if stat.S_ISDIR(mode) else "a socket" if stat.S_ISSOCK(mode) else "a device")
    return f"not a regular file ({kind})"


def open_regular(path: str, flags: int = 0) -> int:
    """Open the regular file ``path`` for reading; return its descriptor.

    Never follows a symlink (neither the file nor its directory), never blocks (a FIFO
    is refused, not waited on) and never opens a device: the directory and the entry
    are lstat'ed, the file opened ``O_NOFOLLOW | O_NONBLOCK`` and its descriptor
    fstat'ed. Anything but a regular file raises NotRegularFileError; a missing one
    FileNotFoundError. ``flags`` are added to the open (e.g. ``O_NOATIME``).
    """
    _check_dir_of(path)
    mode = os.lstat(path).st_mode
    if not stat.S_ISREG(mode):
        raise NotRegularFileError(errno.EINVAL, _not_regular(mode), path)
    try:
        fd = os.open(path, _READ_FLAGS | flags)
    except OSError as exc:
        if exc.errno == errno.ELOOP:  # replaced by a symlink since the lstat
            raise NotRegularFileError(exc.errno, _not_regular(stat.S_IFLNK), path) from None
        raise
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise NotRegularFileError(errno.EINVAL, _not_regular(mode), path)
    except BaseException:
        os.close(fd)
        raise
    return fd


READ_CHUNK = 1 << 20
"""Bytes per read of a hashed read: few system calls, and hashed while still in the
CPU's caches (1 MiB pieces read as fast as whole-file reads here; 256 KiB ones cost
a third more in system calls)."""


def advise_sequential(fd: int) -> None:
    """Tell the kernel the file is read once, front to back (a doubled readahead
    window for a cold read). ``POSIX_FADV_WILLNEED`` is not asked: on a file already in
    the page cache it cost 280 us per 4 MiB here (as much as reading it), and it did
    not make cold reads faster on this machine's disk."""
    with contextlib.suppress(OSError):  # a file system without advice: a plain read
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)


def read_hashed(fd: int, pos: int, out: memoryview, hasher, chunk: int = READ_CHUNK) -> int:
    """Read ``len(out)`` bytes at ``pos`` into ``out``, feeding each piece to ``hasher``
    right after it lands (still in cache); the bytes read (fewer at end of file)."""
    got, n = 0, len(out)
    while got < n:
        view = out[got : got + chunk]
        k = os.preadv(fd, [view], pos + got)
        if k <= 0:
            break
        hasher.update(view[:k])
        got += k
    return got


def skip_hashed(fd: int, pos: int, n: int, hasher, scratch: memoryview) -> int:
    """Feed ``n`` bytes at ``pos`` to ``hasher`` through ``scratch`` (kept nowhere);
    the bytes read."""
    got = 0
    while got < n:
        k = read_hashed(fd, pos + got, scratch[: min(len(scratch), n - got)], hasher)
        if k <= 0:
            break
        got += k
    return got


def read_fd(fd: int) -> bytes:
    """Everything left to read on ``fd``."""
    chunks = []
    while True:
        b = os.read(fd, 1 << 20)
        if not b:
            return b"".join(chunks)
        chunks.append(b)


class OsFS:
    """The real file system. No call follows a symlink: the directory holding a path
    must be a real directory, and files are opened ``O_NOFOLLOW`` (reads through
    ``open_regular``). The calls are the plain path-based ones (open, rename, unlink),
    which libfiu's preload wraps (``prefixstore.fuzz.fiu``)."""

    def write_new(self, path: str, data: bytes | memoryview) -> None:
        _check_dir_of(path)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
        try:
            view = memoryview(data).cast("B")
            while view:
                n = os.write(fd, view)
                view = view[n:]
        finally:
            os.close(fd)

    def fsync(self, path: str) -> None:
        fd = open_regular(path)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def rename_new(self, src: str, dst: str) -> None:
        _check_dir_of(src)
        _check_dir_of(dst)
        # Files are never overwritten in place: refuse to rename over a live file.
        if os.path.lexists(dst):
            raise FileExistsError(errno.EEXIST, "refusing to rename over an existing file", dst)
        os.rename(src, dst)

    def fsync_dir(self, path: str) -> None:
        fd = os.open(path, _DIR_FLAGS)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def unlink(self, path: str) -> None:
        """Remove the entry itself (a symlink, not what it points to)."""
        _check_dir_of(path)
        os.unlink(path)

    def read(self, path: str) -> bytes:
        fd = open_regular(path)
        try:
            return read_fd(fd)
        finally:
            os.close(fd)

    def read_into(self, path: str, out: memoryview) -> int:
        """Read the file into ``out`` (up to its length, no intermediate copy); returns
        the file's size, which may differ from ``len(out)``."""
        fd = open_regular(path)
        try:
            size = os.fstat(fd).st_size
            got, view = 0, out[: min(size, len(out))]
            while view:
                n = os.preadv(fd, [view], got)
                if n <= 0:
                    return got  # the file shrank while being read
                got += n
                view = view[n:]
            return size
        finally:
            os.close(fd)

    def read_with(self, path: str, fn):
        """``fn(fd)`` on the regular file ``path`` opened for reading (``open_regular``),
        closed afterwards; what ``fn`` returns."""
        fd = open_regular(path)
        try:
            return fn(fd)
        finally:
            os.close(fd)

    def size(self, path: str) -> int | None:
        """The size of the regular file ``path``; None if it is missing or not a regular file."""
        try:
            _check_dir_of(path)
            st = os.lstat(path)
        except (FileNotFoundError, NotRegularFileError):
            return None
        return st.st_size if stat.S_ISREG(st.st_mode) else None

    def exists(self, path: str) -> bool:
        """Whether the entry ``path`` exists, whatever it is (a symlink counts, dangling or not)."""
        try:
            _check_dir_of(path)
        except FileNotFoundError:
            return False
        return os.path.lexists(path)

    def listdir(self, path: str) -> list[str]:
        try:
            fd = os.open(path, _DIR_FLAGS)
        except FileNotFoundError:
            return []
        except OSError as exc:
            if exc.errno in (errno.ELOOP, errno.ENOTDIR):
                raise NotRegularFileError(exc.errno, "a symlink or not a directory", path) from None
            raise
        try:
            return sorted(os.listdir(fd))
        finally:
            os.close(fd)

    def makedirs(self, path: str) -> None:
        os.makedirs(path, exist_ok=True)


class FaultHook:
    """Called before and after every effect; the default does nothing.

    ``op`` is one of: write, fsync, rename, fsync_dir, unlink, read, commit, sync (the
    catalog log's sync that makes grouped commits durable, ``engine/walsync.py``).
    ``rank`` is the rank the effect belongs to (None for the catalog).
    Tests subclass this to crash (raise) or inject errors at chosen points.
    """

    def before(self, op: str, target: str, rank: int | None) -> None:
        """Runs before the effect; raising prevents it."""

    def after(self, op: str, target: str, rank: int | None) -> None:
        """Runs after the effect succeeded; raising models a crash inside it."""


class Durability:
    """What this process's completed effects made durable: a file whose data was
    fsynced, renamed into place, and whose directory was fsynced after the rename."""

    __slots__ = ("durable", "pending", "synced", "unsynced")

    def __init__(self) -> None:
        self.synced: set[str] = set()  # data fsynced (under its temporary name)
        self.unsynced: set[str] = set()  # renamed into place without a data fsync
        self.pending: dict[str, str] = {}  # renamed, its directory not fsynced since: path -> dir
        self.durable: set[str] = set()

    def fsynced(self, path: str) -> None:
        self.synced.add(path)

    def renamed(self, src: str, dst: str) -> None:
        self.unlinked(dst)
        if src in self.synced:
            self.synced.discard(src)
            self.pending[dst] = os.path.dirname(dst)
        else:
            self.unsynced.add(dst)

    def dir_synced(self, path: str) -> None:
        for p in [p for p, d in self.pending.items() if d == path]:
            del self.pending[p]
            self.durable.add(p)

    def unlinked(self, path: str) -> None:
        self.synced.discard(path)
        self.unsynced.discard(path)
        self.durable.discard(path)
        self.pending.pop(path, None)

    def is_durable(self, path: str) -> bool | None:
        """True: written durably here; False: written here, not (yet) durable; None:
        not written by this process."""
        if path in self.durable:
            return True
        return False if path in self.pending or path in self.unsynced else None


class HookedFS:
    """A FileSystem whose effects are reported to a FaultHook, tagged with a rank,
    and whose completed writes are tracked for ``is_durable``."""

    def __init__(self, inner: FileSystem, hook: FaultHook, rank: int | None) -> None:
        self.inner, self.hook, self.rank = inner, hook, rank
        # tracked only for the invariant checks (debug): the hot path pays one test
        self.log = Durability() if debug_from_env() else None

    def _run(self, op: str, target: str, fn, *args):
        self.hook.before(op, target, self.rank)
        out = fn(*args)
        self.hook.after(op, target, self.rank)
        return out

    def write_new(self, path: str, data: bytes | memoryview) -> None:
        self._run("write", path, self.inner.write_new, path, data)

    def fsync(self, path: str) -> None:
        self._run("fsync", path, self.inner.fsync, path)
        if self.log is not None:
            self.log.fsynced(path)

    def rename_new(self, src: str, dst: str) -> None:
        self._run("rename", dst, self.inner.rename_new, src, dst)
        if self.log is not None:
            self.log.renamed(src, dst)

    def fsync_dir(self, path: str) -> None:
        self._run("fsync_dir", path, self.inner.fsync_dir, path)
        if self.log is not None:
            self.log.dir_synced(path)

    def unlink(self, path: str) -> None:
        self._run("unlink", path, self.inner.unlink, path)
        if self.log is not None:
            self.log.unlinked(path)

    def is_durable(self, path: str) -> bool | None:
        """Whether ``path`` would survive a power loss now: the inner file system's
        answer when it knows (the fault file system), else what this process's own
        completed fsync, rename and directory fsync made durable (None: a file it
        did not write, or the checks were off when this file system was built)."""
        inner = getattr(self.inner, "is_durable", None)
        if inner is not None:
            return inner(path)
        return None if self.log is None else self.log.is_durable(path)

    def read(self, path: str) -> bytes:
        return self._run("read", path, self.inner.read, path)

    @property
    def copies_on_read(self) -> bool:
        """True when ``read_into`` must copy (the inner file system has no ``read_into``)."""
        return not hasattr(self.inner, "read_into")

    def read_into(self, path: str, out: memoryview) -> int:
        """``OsFS.read_into`` through the hook (op 'read'); a file system without it is
        read whole and copied into ``out``."""
        return self._run("read", path, self._read_into, path, out)

    def _read_into(self, path: str, out: memoryview) -> int:
        inner = getattr(self.inner, "read_into", None)
        if inner is not None:
            return inner(path, out)
        data = self.inner.read(path)
        n = min(len(data), len(out))
        out[:n] = memoryview(data)[:n]
        return len(data)

    @property
    def reads_fd(self) -> bool:
        """True when the inner file system runs ``read_with`` (reads from a descriptor)."""
        return hasattr(self.inner, "read_with")

    def read_with(self, path: str, fn):
        """``OsFS.read_with`` through the hook (op 'read')."""
        return self._run("read", path, self.inner.read_with, path, fn)  # type: ignore[attr-defined]

    def size(self, path: str) -> int | None:
        return self.inner.size(path)

    def exists(self, path: str) -> bool:
        return self.inner.exists(path)

    def listdir(self, path: str) -> list[str]:
        return self.inner.listdir(path)

    def makedirs(self, path: str) -> None:
        self.inner.makedirs(path)
