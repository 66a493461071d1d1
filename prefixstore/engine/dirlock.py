"""One engine per cache directory: OS-level locks held for the engine's whole life.

The lock that counts is an exclusive ``flock`` on the cache directory's own descriptor:
a directory cannot be deleted while it holds files, nor replaced under an open
descriptor, so whatever happens to the names inside it (``LOCK`` deleted, or replaced
by another file), a second opener still finds it locked. ``LOCK`` is flock'ed as well,
for tools that only know that file.
"""

from __future__ import annotations

import fcntl
import os

from prefixstore.base.errors import LockedError

LOCK_NAME = "LOCK"


class DirLock:
    """The descriptors holding a directory's locks; ``release`` closes them."""

    __slots__ = ("fds",)

    def __init__(self, fds: list[int]) -> None:
        self.fds = fds

    def release(self) -> None:
        while self.fds:
            os.close(self.fds.pop())


def _flock(fd: int, mode: int) -> bool:
    try:
        fcntl.flock(fd, mode | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    return True


def acquire(root: str, why: str) -> DirLock:
    """Lock ``root`` (then its ``LOCK`` file, created if missing) exclusively; raise
    ``LockedError(f"{root} {why}")`` if another holder has either."""
    held = DirLock([])
    try:
        for path, flags in ((root, os.O_RDONLY | os.O_DIRECTORY), (os.path.join(root, LOCK_NAME), os.O_RDWR | os.O_CREAT)):
            fd = os.open(path, flags | os.O_CLOEXEC, 0o644)
            held.fds.append(fd)
            if not _flock(fd, fcntl.LOCK_EX):
                raise LockedError(f"{root} {why}")
    except BaseException:
        held.release()
        raise
    return held


def is_held(root: str) -> bool:
    """Whether an engine holds ``root`` (its directory or its ``LOCK``); never blocks.

    The probe takes a shared lock for an instant and releases it at once; nothing is
    created.
    """
    for path, flags in ((root, os.O_RDONLY | os.O_DIRECTORY), (os.path.join(root, LOCK_NAME), os.O_RDONLY)):
        try:
            fd = os.open(path, flags | os.O_CLOEXEC | os.O_NONBLOCK)
        except (FileNotFoundError, NotADirectoryError):
            continue
        try:
            if not _flock(fd, fcntl.LOCK_SH):
                return True
        finally:
            os.close(fd)  # closing releases the probe's lock
    return False
