"""One sync shared by the changes made before it began: the rank directory's fsync.

Each change (a shard renamed into the directory) joins the open ``Round`` right after
it is made (``changed``); its caller then waits for that round (``wait``). A waiter
whose round is still open (no sync began since its change) leads at once, whether or
not other syncs run: it closes the round, opens the next one and runs the sync, which
covers every change of the closed round (all made before it began). A waiter whose
round is closed sleeps until that round's sync ends. So a sync that began before a
change never counts for it, and no change waits behind a sync that cannot cover it:
the syncs of one directory may run at once (the file system merges them into its
journal's commit). The pattern is the catalog log's (``engine/walsync.py``), without
its one-sync-at-a-time rule.

A failed sync fails every waiter of its round (each raises an OSError of its own;
none of them is moved to a later sync as if nothing happened); later rounds run their
own sync, as a store's own directory fsync did before it was shared.
"""

from __future__ import annotations

import errno
import threading
from collections.abc import Callable

import attrs


@attrs.define(slots=True, eq=False)
class Round:
    """The changes one sync makes durable: done once it ran, ``error`` if it failed."""

    size: int = 0
    """The changes that joined it."""
    done: bool = False
    error: str | None = None
    errno: int = errno.EIO


@attrs.define(slots=True, eq=False)
class SharedSync:
    """A sync run by the first waiter of each round, for every change before it."""

    run: Callable[[], None]
    """The sync itself (raises OSError when it fails)."""
    what: str = "sync"
    """Named in the error a follower of a failed round raises."""
    cv: threading.Condition = attrs.field(factory=threading.Condition)
    open: Round = attrs.field(factory=Round)
    running: list[Round] = attrs.field(factory=list)
    """The rounds whose sync runs now, oldest first."""
    waiting: int = 0
    """Waiters asleep behind a running sync (their round's)."""
    changes: int = 0
    syncs: int = 0
    """Syncs run: ``changes / syncs`` is how many changes one sync covered."""

    def changed(self) -> Round:
        """Count a change just made; the round whose sync will cover it."""
        with self.cv:
            self.changes += 1
            self.open.size += 1
            return self.open

    def wait(self, rnd: Round) -> None:
        """Return once ``rnd``'s sync succeeded, leading it when it has not begun;
        OSError when it failed. Never call it holding a lock the leader needs."""
        with self.cv:
            while not rnd.done:
                if rnd is not self.open:  # its sync runs (it began after every change of rnd)
                    self.waiting += 1
                    self.cv.wait()
                    self.waiting -= 1
                    continue
                self.open = Round()
                self.running.append(rnd)
                self.cv.release()
                try:
                    self.run()
                except OSError as exc:
                    self._settle(rnd, f"{type(exc).__name__}: {exc}", exc.errno or errno.EIO)
                    raise
                except BaseException as exc:  # a crash inside the sync: it covered nothing
                    self._settle(rnd, f"interrupted ({type(exc).__name__}: {exc})", errno.EIO)
                    raise
                self._settle(rnd, None, 0)
                return
            if rnd.error is not None:
                raise OSError(rnd.errno, f"shared {self.what} failed: {rnd.error}")

    def _settle(self, rnd: Round, error: str | None, err: int) -> None:
        """End a lead (``cv`` released): record its round's outcome, wake the others;
        ``cv`` is held again on return."""
        self.cv.acquire()
        rnd.done, rnd.error, rnd.errno = True, error, err or errno.EIO
        self.running.remove(rnd)
        self.syncs += 1
        self.cv.notify_all()
