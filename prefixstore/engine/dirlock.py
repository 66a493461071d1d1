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
import time

import attrs

from prefixstore.base.errors import LockedError

LOCK_NAME = "LOCK"


@attrs.define(slots=True, eq=False)
class DirLock:
    """The descriptors holding a directory's locks; ``release`` closes them."""

    fds: list[int]

    def release(self) -> None:
        while self.fds:
            os.close(self.fds.pop())


PROBE_GRACE_S = 0.5
"""How long ``acquire`` tries again before it reports a lock as held: ``is_held``'s
shared lock lasts an instant (a few microseconds, more if its process is descheduled),
an engine's exclusive lock its whole life."""


def _flock(fd: int, mode: int) -> bool:
    try:
        fcntl.flock(fd, mode | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    return True


def _flock_past_probes(fd: int) -> bool:
    """Take ``fd``'s exclusive lock, waiting out probes for up to ``PROBE_GRACE_S``."""
    deadline = time.monotonic() + PROBE_GRACE_S
    pause = 0.0005
    while not _flock(fd, fcntl.LOCK_EX):
        if time.monotonic() >= deadline:
            return False
        time.sleep(pause)
        pause = min(pause * 2, 0.02)
    return True


def acquire(root: str, why: str) -> DirLock:
    """Lock ``root`` (then its ``LOCK`` file, created if missing) exclusively; raise
    ``LockedError(f"{root} {why}")`` if another holder has either (a probe's instant
    lock is waited out)."""
    held = DirLock([])
    try:
        for path, flags in ((root, os.O_RDONLY | os.O_DIRECTORY), (os.path.join(root, LOCK_NAME), os.O_RDWR | os.O_CREAT)):
            fd = os.open(path, flags | os.O_CLOEXEC, 0o644)
            held.fds.append(fd)
            if not _flock_past_probes(fd):
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
