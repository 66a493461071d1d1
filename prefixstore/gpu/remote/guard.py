"""What one remote call may read: at most so many bytes, until its deadline.

Every call of the tier runs inside ``bounded(CallBudget(seconds, nbytes))``. The
sockets of the tier's connections (``GuardedSocket``) charge every byte they receive
to the budget of the call running in their thread and never wait past its deadline, so
a reply longer than the call can use (a ``$4000000000`` header) fails the call after
``nbytes``, and a server that trickles bytes fails it at the deadline; redis-py then
closes that connection. A caller that stops waiting first calls ``abort()``, which
shuts the sockets the call is using: its thread stops reading at once.
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

_local = threading.local()


class ReplyTooLarge(OSError):
    """A call received more bytes than its budget allows (the server sent a reply longer
    than anything the call asked for can be)."""


class CallBudget:
    """The bytes one call may still receive and the monotonic time it must end by."""

    def __init__(self, seconds: float, nbytes: int) -> None:
        self.deadline = time.monotonic() + seconds
        self.nbytes = nbytes
        self.received = 0
        self.overran = False
        self._lock = threading.Lock()
        self._sockets: set[GuardedSocket] = set()
        self._over = False

    def charge(self, n: int) -> None:
        """Count ``n`` received bytes; ReplyTooLarge beyond the budget."""
        with self._lock:
            self.received += n
            if self.received > self.nbytes:
                self.overran = True
                raise ReplyTooLarge(f"a reply of more than {self.nbytes} bytes")

    def timeout(self, wanted: float | None) -> float | None:
        """The socket timeout for one wait: ``wanted`` (None: blocking, 0: a poll) cut to
        the time left; ``TimeoutError`` (``socket.timeout``) once the deadline has passed."""
        if wanted == 0:
            return 0.0
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("past the call's budget")
        return left if wanted is None else min(wanted, left)

    def attach(self, sock: GuardedSocket) -> None:
        with self._lock:
            if not self._over:
                sock.owner = self
                self._sockets.add(sock)

    def finish(self) -> None:
        """The call is over: ``abort`` no longer touches its sockets."""
        with self._lock:
            self._over = True
            self._sockets.clear()

    def abort(self) -> None:
        """Shut the sockets the call is reading or writing right now (the thread's wait
        fails at once); ones it is done with, back in their pool, are left alone."""
        with self._lock:
            socks = [s for s in self._sockets if s.owner is self and s.busy] if not self._over else []
            self._over = True
            self._sockets.clear()
        for s in socks:
            s.shut()


def current() -> CallBudget | None:
    """The budget of the call running in this thread, if any."""
    return getattr(_local, "budget", None)


@contextlib.contextmanager
def bounded(budget: CallBudget) -> Iterator[CallBudget]:
    """Run the block as (part of) the call that ``budget`` bounds."""
    before = current()
    _local.budget = budget
    try:
        yield budget
    finally:
        _local.budget = before


@contextlib.contextmanager
def running(budget: CallBudget) -> Iterator[CallBudget]:
    """Run the whole call that ``budget`` bounds (``finish`` it at the end)."""
    with bounded(budget):
        try:
            yield budget
        finally:
            budget.finish()


class GuardedSocket:
    """A connected socket (plain or TLS) that charges what it receives to the current
    call's budget and waits no longer than its deadline; anything else is the socket's."""

    __slots__ = ("_sock", "_timeout", "owner", "busy")

    def __init__(self, sock: Any) -> None:
        self._sock = sock
        self._timeout = sock.gettimeout()
        self.owner: CallBudget | None = None
        self.busy = False  # in a recv or send for ``owner`` right now

    def _io(self, fn: Any, *args: Any) -> Any:
        budget = current()
        if budget is None:
            self._sock.settimeout(self._timeout)
            return fn(*args)
        budget.attach(self)
        self._sock.settimeout(budget.timeout(self._timeout))
        self.busy = True
        try:
            return fn(*args)
        finally:
            self.busy = False

    def settimeout(self, value: float | None) -> None:
        self._timeout = value
        self._sock.settimeout(value)

    def gettimeout(self) -> float | None:
        return self._timeout

    def recv(self, n: int, *flags: int) -> bytes:
        data = self._io(self._sock.recv, n, *flags)
        budget = current()
        if budget is not None:
            budget.charge(len(data))
        return data

    def recv_into(self, buffer: Any, nbytes: int = 0, *flags: int) -> int:
        n = self._io(self._sock.recv_into, buffer, nbytes, *flags)
        budget = current()
        if budget is not None:
            budget.charge(n)
        return n

    def sendall(self, data: Any, *flags: int) -> None:
        self._io(self._sock.sendall, data, *flags)

    def send(self, data: Any, *flags: int) -> int:
        return self._io(self._sock.send, data, *flags)

    def shut(self) -> None:
        """Shut both directions (a read blocked in another thread returns)."""
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._sock, name)
