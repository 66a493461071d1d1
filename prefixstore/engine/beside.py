"""A wait run in a thread of its own while the caller does something else: a store's
intent log sync beside its shard writes (``store.write_and_publish``)."""

from __future__ import annotations

import errno
import threading
from collections.abc import Callable

import attrs


@attrs.define(eq=False)
class Beside:
    """``fn()`` started in its own thread at construction. ``gate()`` (any thread) waits
    for it and raises OSError when it failed; ``result()`` waits and re-raises its own
    exception; ``join()`` only waits."""

    fn: Callable[[], None]
    what: str = "wait"
    """Named in the error ``gate`` raises."""
    error: BaseException | None = None
    thread: threading.Thread = attrs.field(init=False)

    def __attrs_post_init__(self) -> None:
        self.thread = threading.Thread(target=self._run, name="prefixstore-beside", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        try:
            self.fn()
        except BaseException as exc:  # handed to whoever waits, never lost in the thread
            self.error = exc

    def join(self) -> None:
        self.thread.join()

    def gate(self) -> None:
        self.join()
        if self.error is not None:
            raise OSError(errno.EIO, f"{self.what} failed: {type(self.error).__name__}: {self.error}")

    def result(self) -> None:
        self.join()
        if self.error is not None:
            raise self.error
