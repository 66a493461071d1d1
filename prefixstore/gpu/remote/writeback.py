"""A bounded write-behind queue drained by one background thread.

``offer`` never blocks: beyond ``max_items`` or ``max_bytes`` it refuses (the caller
counts a drop). The drain thread writes items in order, retrying a failed write with a
doubling backoff up to ``attempts`` tries; ``flush(timeout)`` waits, at most ``timeout``
seconds, until everything offered before it was written or given up.
"""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Callable
from typing import Any


class WriteBehind:
    """Items ``(payload, nbytes)`` handed to ``write(payload)`` (raises on failure) in order.
    ``on_retry()`` / ``on_written()`` / ``on_dropped()`` count outcomes."""

    def __init__(
        self,
        write: Callable[[Any], None],
        *,
        max_items: int,
        max_bytes: int,
        attempts: int,
        backoff: float,
        on_retry: Callable[[], None],
        on_written: Callable[[], None],
        on_dropped: Callable[[], None],
        name: str = "prefixstore-remote-writer",
    ) -> None:
        self._write = write
        self._max_items, self._max_bytes = max_items, max_bytes
        self._attempts, self._backoff = attempts, backoff
        self._on_retry, self._on_written, self._on_dropped = on_retry, on_written, on_dropped
        self._cv = threading.Condition()
        self._items: collections.deque[tuple[Any, int]] = collections.deque()
        self._bytes = 0
        self._busy = 0  # items taken by the thread and not finished yet
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    @property
    def depth(self) -> int:
        with self._cv:
            return len(self._items) + self._busy

    @property
    def nbytes(self) -> int:
        with self._cv:
            return self._bytes

    def offer(self, payload: Any, nbytes: int) -> bool:
        """Queue ``payload``; False (nothing queued) if the queue is full or stopping."""
        with self._cv:
            if self._stopping or len(self._items) >= self._max_items or (
                self._items and self._bytes + nbytes > self._max_bytes
            ):
                return False
            self._items.append((payload, nbytes))
            self._bytes += nbytes
            self._cv.notify_all()
            return True

    def flush(self, timeout: float) -> bool:
        """Wait until the queue is empty and idle; False if ``timeout`` seconds passed first."""
        deadline = time.monotonic() + timeout
        with self._cv:
            while self._items or self._busy:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cv.wait(left)
            return True

    def stop(self, timeout: float) -> bool:
        """Flush within ``timeout``, then stop the thread; what is still queued is dropped.
        True if everything was written or given up in time."""
        done = self.flush(timeout)
        with self._cv:
            self._stopping = True
            left = list(self._items)
            self._items.clear()
            self._bytes = 0
            self._cv.notify_all()
        for _ in left:
            self._on_dropped()
        return done

    def _run(self) -> None:
        while True:
            with self._cv:
                while not self._items and not self._stopping:
                    self._cv.wait()
                if self._stopping:
                    return
                payload, nbytes = self._items.popleft()
                self._busy += 1
            try:
                self._deliver(payload)
            finally:
                with self._cv:
                    self._busy -= 1
                    self._bytes -= nbytes
                    self._cv.notify_all()

    def _deliver(self, payload: Any) -> None:
        for attempt in range(self._attempts):
            if self._stopping:
                break
            try:
                self._write(payload)
            except Exception:  # the writer's failure is counted and retried, never raised
                if attempt + 1 < self._attempts:
                    self._on_retry()
                    time.sleep(self._backoff * (2**attempt))
                continue
            self._on_written()
            return
        self._on_dropped()
