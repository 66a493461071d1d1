"""Group commit: commits written to the catalog's write-ahead log without a sync of
their own become durable together, by one ``fdatasync`` of the log.

Each such commit takes a sequence number (``wrote``) under the engine lock; its caller
then waits, outside that lock, until the log is synced through that number (``wait``).
The first waiter that finds no sync running leads: it syncs the log for every commit
written so far, the waiters behind it included, while the followers sleep; commits
written during its sync wait for the next leader. A commit SQLite synced itself
(``synchronous=FULL``) makes every earlier one durable too (``all_durable``): the log is
replayed in order and stops at its first frame that did not reach the disk.

A failed sync is sticky (a failed fsync is never retried as if nothing happened):
every commit not yet durable, and every later wait, raises CatalogIOError.
"""

from __future__ import annotations

import os
import threading

import attrs

from prefixstore.base.errors import CatalogIOError
from prefixstore.gpu.fileio import FaultHook


@attrs.define(slots=True, eq=False)
class WalSync:
    """The log's durability point: commits written, commits durable, the leader."""

    path: str
    """The write-ahead log (``catalog.sqlite-wal``)."""
    hook: FaultHook
    cv: threading.Condition = attrs.field(factory=threading.Condition)
    io: threading.Lock = attrs.field(factory=threading.Lock)
    """Held around the sync itself and ``close``: the descriptor is never closed under a sync."""
    written: int = 0
    synced: int = 0
    leading: bool = False
    failed: str | None = None
    fd: int | None = None
    syncs: int = 0
    """Syncs run: ``written / syncs`` is how many commits one sync made durable."""

    def wrote(self) -> int:
        """Count a commit just written without a sync; its sequence number."""
        with self.cv:
            self.written += 1
            return self.written

    def all_durable(self) -> None:
        """Every commit written so far is durable (SQLite synced the log at a commit)."""
        with self.cv:
            self.synced = self.written
            self.cv.notify_all()

    def wait(self, seq: int) -> None:
        """Return once commit ``seq`` and every one before it are durable, leading the
        sync when none runs. Never call it holding a lock the leader needs."""
        with self.cv:
            while self.synced < seq:
                if self.failed is not None:
                    raise CatalogIOError(f"catalog log sync failed ({self.failed}); reopen the engine")
                if self.leading:
                    self.cv.wait()
                    continue
                self.leading, target = True, self.written
                self.cv.release()
                try:
                    self._sync()
                except OSError as exc:
                    self._settle(None, f"{type(exc).__name__}: {exc}")
                    raise CatalogIOError(f"catalog log sync failed: {exc}") from exc
                except BaseException:
                    self._settle(None, None)
                    raise
                self._settle(target, None)

    def _settle(self, target: int | None, failed: str | None) -> None:
        """End a lead (``cv`` released): record what it made durable, wake the others;
        ``cv`` is held again on return."""
        self.cv.acquire()
        self.leading = False
        if target is not None:
            self.synced = max(self.synced, target)
        if failed is not None and self.failed is None:
            self.failed = failed
        self.cv.notify_all()

    def _sync(self) -> None:
        """The leader's effect: ``fdatasync`` of the log (op ``sync`` to the fault hook)."""
        with self.io:
            self.hook.before("sync", "catalog.wal", None)
            if self.fd is None:
                self.fd = os.open(self.path, os.O_RDWR | os.O_CLOEXEC)
            os.fdatasync(self.fd)
            self.syncs += 1
            self.hook.after("sync", "catalog.wal", None)

    def close(self) -> None:
        with self.io:
            if self.fd is not None:
                os.close(self.fd)
                self.fd = None
