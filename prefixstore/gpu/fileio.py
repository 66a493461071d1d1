"""The file operations executors apply, behind one small interface.

Every effect the engine runs goes through a ``FileSystem`` so that tests can swap in
a fault-injecting one (``prefixstore.fuzz.faultfs``) and so that a ``FaultHook`` sees
each effect before and after it runs (crash points). Operations are file-granular:
``write_new`` creates a file that must not exist, ``fsync`` syncs a named file,
``fsync_dir`` makes creates/renames/unlinks in a directory durable.
"""

from __future__ import annotations

import errno
import os
from typing import Protocol


class FileSystem(Protocol):
    """The file operations the engine needs. Paths are absolute strings."""

    def write_new(self, path: str, data: bytes | memoryview) -> None: ...
    def fsync(self, path: str) -> None: ...
    def rename_new(self, src: str, dst: str) -> None: ...
    def fsync_dir(self, path: str) -> None: ...
    def unlink(self, path: str) -> None: ...
    def read(self, path: str) -> bytes: ...
    def size(self, path: str) -> int | None: ...
    def listdir(self, path: str) -> list[str]: ...
    def makedirs(self, path: str) -> None: ...


class OsFS:
    """The real file system."""

    def write_new(self, path: str, data: bytes | memoryview) -> None:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            view = memoryview(data).cast("B")
            while view:
                n = os.write(fd, view)
                view = view[n:]
        finally:
            os.close(fd)

    def fsync(self, path: str) -> None:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def rename_new(self, src: str, dst: str) -> None:
        # Files are never overwritten in place: refuse to rename over a live file.
        if os.path.lexists(dst):
            raise FileExistsError(errno.EEXIST, "refusing to rename over an existing file", dst)
        os.rename(src, dst)

    def fsync_dir(self, path: str) -> None:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def unlink(self, path: str) -> None:
        os.unlink(path)

    def read(self, path: str) -> bytes:
        with open(path, "rb", buffering=0) as f:
            return f.read()

    def read_into(self, path: str, out: memoryview) -> int:
        """Read the file into ``out`` (up to its length, no intermediate copy); returns
        the file's size, which may differ from ``len(out)``."""
        fd = os.open(path, os.O_RDONLY)
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

    def size(self, path: str) -> int | None:
        try:
            return os.stat(path).st_size
        except FileNotFoundError:
            return None

    def listdir(self, path: str) -> list[str]:
        try:
            return sorted(os.listdir(path))
        except FileNotFoundError:
            return []

    def makedirs(self, path: str) -> None:
        os.makedirs(path, exist_ok=True)


class FaultHook:
    """Called before and after every effect; the default does nothing.

    ``op`` is one of: write, fsync, rename, fsync_dir, unlink, read, commit.
    ``rank`` is the rank the effect belongs to (None for the catalog).
    Tests subclass this to crash (raise) or inject errors at chosen points.
    """

    def before(self, op: str, target: str, rank: int | None) -> None:
        """Runs before the effect; raising prevents it."""

    def after(self, op: str, target: str, rank: int | None) -> None:
        """Runs after the effect succeeded; raising models a crash inside it."""


class HookedFS:
    """A FileSystem whose effects are reported to a FaultHook, tagged with a rank."""

    def __init__(self, inner: FileSystem, hook: FaultHook, rank: int | None) -> None:
        self.inner, self.hook, self.rank = inner, hook, rank

    def _run(self, op: str, target: str, fn, *args):
        self.hook.before(op, target, self.rank)
        out = fn(*args)
        self.hook.after(op, target, self.rank)
        return out

    def write_new(self, path: str, data: bytes | memoryview) -> None:
        self._run("write", path, self.inner.write_new, path, data)

    def fsync(self, path: str) -> None:
        self._run("fsync", path, self.inner.fsync, path)

    def rename_new(self, src: str, dst: str) -> None:
        self._run("rename", dst, self.inner.rename_new, src, dst)

    def fsync_dir(self, path: str) -> None:
        self._run("fsync_dir", path, self.inner.fsync_dir, path)

    def unlink(self, path: str) -> None:
        self._run("unlink", path, self.inner.unlink, path)

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

    def size(self, path: str) -> int | None:
        return self.inner.size(path)

    def listdir(self, path: str) -> list[str]:
        return self.inner.listdir(path)

    def makedirs(self, path: str) -> None:
        self.inner.makedirs(path)
