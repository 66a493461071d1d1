"""The call guard every public call runs inside, and the engine's lifetime: what an
open engine holds until it is closed or abandoned.

Lock discipline: ``CallGuard.lock`` (re-entrant) is the engine lock: it guards the
index, the catalog connection, the holds, the space account, the recency and the
retry queue. File reads and writes run outside it, with the nodes involved fenced or
pinned. ``settled`` (on the same lock) is notified when a store or replacement ends,
so a store waiting for an overlapping one re-plans. The calls in flight are counted
without a lock (``CallGuard.inflight``), so ``close`` can wait for them without the
engine lock (on ``calls_cv``, notified as they end once it waits).
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import Executor
from typing import Any, Protocol

import attrs

from prefixstore.base.errors import EngineClosedError, PrefixStoreError, SimulatedCrash
from prefixstore.base.log import log

_ident = threading.get_ident


class _Closes(Protocol):
    def close(self) -> Any: ...


class _Stops(Protocol):
    def stop(self, wait: bool) -> Any: ...


class _Releases(Protocol):
    def release(self) -> Any: ...


class _RemoteEnd(Protocol):
    def close(self, timeout: float) -> Any: ...


@attrs.define(slots=True, eq=False)
class Lifetime:
    """The resources an open engine holds, each set once acquired, and released once,
    in this order, by ``shutdown``: the remote tier, the transfer workers, the rank
    pool, the catalog connection, the directory lock. ``closed`` once shut down."""

    closed: bool = False
    remote: _RemoteEnd | None = None
    transfers: _Stops | None = None
    pool: Executor | None = None
    catalog: _Closes | None = None
    dir_lock: _Releases | None = None

    def shutdown(self) -> None:
        """Release everything now (a close's last step; an abandon models process death:
        the connection drops, uncommitted work rolls back)."""
        self.closed = True
        if self.remote is not None:
            self.remote.close(0.0)
        if self.transfers is not None:
            self.transfers.stop(wait=False)
        if self.pool is not None:
            self.pool.shutdown(wait=False, cancel_futures=True)
        if self.catalog is not None:
            self.catalog.close()
        self.release_lock()

    def release_lock(self) -> None:
        if self.dir_lock is not None:
            self.dir_lock.release()
            self.dir_lock = None


def _settled(guard: CallGuard) -> threading.Condition:
    return threading.Condition(guard.lock)


@attrs.define(slots=True, eq=False)
class CallGuard:
    """Every public call runs inside (``with guard:``): refused once the engine is
    closed or closing (a call nested in one already running on this thread goes on),
    counted in flight for ``close``; a ``SimulatedCrash`` abandons the engine; an
    untyped error from a resource closed under the call becomes ``EngineClosedError``.

    One reusable object per engine (cheaper than a generator on the request path).
    A call is counted in first and checks ``closing`` after; ``close`` sets ``closing``
    first and counts after: whatever the interleaving, either close sees the call (and
    waits for it) or the call sees close (and is refused). Both orders must stay so.
    """

    life: Lifetime
    lock: Any = attrs.field(factory=threading.RLock)
    """The engine lock (see the module docstring)."""
    settled: threading.Condition = attrs.field(default=attrs.Factory(_settled, takes_self=True))
    """Notified (under ``lock``) when a store or replacement ends."""
    closing: bool = False
    """``close`` started: new public calls are refused."""
    inflight: list[int] = attrs.field(factory=list)
    """The thread id of each public call in flight (nested ones too), all threads:
    appended and removed without a lock (one list operation each is atomic), so
    ``close`` counts them all and each thread its own."""
    calls_cv: threading.Condition = attrs.field(factory=threading.Condition)
    """``close`` waits on it (``quiesce``); notified when a call ends while closing."""

    @property
    def closed(self) -> bool:
        """Closed or abandoned: every call is refused."""
        return self.life.closed

    @property
    def calls(self) -> int:
        """Public calls in flight, all threads (``close`` waits for them)."""
        return len(self.inflight)

    @property
    def depth(self) -> int:
        """How many public calls this thread is inside."""
        return self.inflight.count(_ident())

    def held(self) -> bool:
        """Whether this thread holds the engine lock (for assertions)."""
        return self.lock._is_owned()

    def __enter__(self) -> None:
        me = _ident()
        inflight = self.inflight
        inflight.append(me)  # counted before the check (see the class docstring)
        # refused once closed, or while closing unless nested in a call of this thread
        if (self.closing or self.life.closed) and (self.life.closed or inflight.count(me) == 1):
            self._leave(me)
            raise EngineClosedError("engine is closed")

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: Any) -> bool:
        try:
            if kind is not None:
                if issubclass(kind, SimulatedCrash):
                    self.life.shutdown()  # process death
                elif issubclass(kind, Exception) and self.life.closed and not isinstance(exc, PrefixStoreError):
                    # closed under the call (its catalog, pools, workers): a typed error
                    raise EngineClosedError(f"engine closed during the call ({kind.__name__})") from exc
            return False
        finally:
            self._leave(_ident())

    def _leave(self, me: int) -> None:
        """One call of thread ``me`` ends (uncounted before ``closing`` is read: see
        ``quiesce``)."""
        self.inflight.remove(me)
        if self.closing:
            with self.calls_cv:
                self.calls_cv.notify_all()

    def quiesce(self, deadline: float) -> None:
        """Refuse new public calls; wait until those in flight on other threads end (or
        ``deadline``, a ``time.monotonic()`` value, passes)."""
        mine = self.depth  # close() called from inside a call
        with self.calls_cv:
            self.closing = True  # before counting (see the class docstring)
            while len(self.inflight) > mine:
                left = deadline - time.monotonic()
                if left <= 0:
                    log.warning("close_timeout", in_flight=len(self.inflight) - mine)
                    return
                self.calls_cv.wait(left)
