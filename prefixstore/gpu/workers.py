"""Background workers that survive what their jobs do.

A ``Worker`` runs submitted jobs one at a time on its own thread. A job that raises
an ``Exception`` fails its own future (the engine turns a failed effect into a failed
transaction before that), never the worker. A job that raises a ``BaseException``
(``SystemExit``, a simulated crash, an interpreter-level error) fails its future and
kills the thread, as such an error would; the worker then starts a replacement thread
at once and counts it in ``restarts``. ``submit`` also restarts a thread found dead.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

from prefixstore.base.log import log

_STOP = object()


class Worker:
    """One background thread with a job queue, restarted (and counted) if it dies."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._q: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._stopping = False
        self._thread: threading.Thread | None = None
        self._pending = 0
        self._idle = threading.Condition(self._lock)
        self.restarts = 0
        self.failures = 0
        self.completed = 0
        self._spawn()

    # -- public -----------------------------------------------------------------

    def submit(self, fn: Callable[[], Any]) -> Future:
        """Queue ``fn``; its return value or exception lands on the returned future."""
        fut: Future = Future()
        with self._lock:
            if self._stopping:
                raise RuntimeError(f"worker {self.name} is stopped")
            if self._thread is None or not self._thread.is_alive():
                self._restart_locked("found dead")
            self._pending += 1
        self._q.put((fut, fn))
        return fut

    def drain(self, timeout: float | None = None) -> bool:
        """Wait until every submitted job has finished; False on timeout."""
        with self._idle:
            return self._idle.wait_for(lambda: self._pending == 0, timeout=timeout)

    def stop(self, wait: bool = True, timeout: float | None = None) -> None:
        """Stop after the queued jobs (``wait``) or at once (queued jobs are cancelled)."""
        with self._lock:
            if self._stopping:
                return
            self._stopping = True
            thread = self._thread
        if not wait:
            self._cancel_queued()
        self._q.put(_STOP)
        if wait and thread is not None and thread is not threading.current_thread():
            thread.join(timeout)

    @property
    def current(self) -> bool:
        """Whether the calling thread is this worker's (a job calling back in)."""
        return self._thread is threading.current_thread()

    @property
    def alive(self) -> bool:
        t = self._thread
        return t is not None and t.is_alive()

    def stats(self) -> dict[str, int]:
        with self._lock:
            return {"restarts": self.restarts, "failures": self.failures,
                    "completed": self.completed, "pending": self._pending}

    # -- internal -----------------------------------------------------------------

    def _spawn(self) -> None:
        t = threading.Thread(target=self._run, name=f"prefixstore-{self.name}", daemon=True)
        self._thread = t
        t.start()

    def _restart_locked(self, why: str) -> None:
        self.restarts += 1
        log.warning("worker_restarted", worker=self.name, why=why, restarts=self.restarts)
        self._spawn()

    def _done(self, failed: bool) -> None:
        with self._lock:
            self._pending -= 1
            if failed:
                self.failures += 1
            else:
                self.completed += 1
            if self._pending == 0:
                self._idle.notify_all()

    def _cancel_queued(self) -> None:
        while True:
            try:
                item = self._q.get_nowait()
            except queue.Empty:
                return
            if item is _STOP:
                continue
            fut, _ = item
            fut.cancel()
            self._done(failed=True)

    def _run(self) -> None:
        died: BaseException | None = None
        try:
            while True:
                item = self._q.get()
                if item is _STOP:
                    return
                fut, fn = item
                if not fut.set_running_or_notify_cancel():
                    self._done(failed=True)
                    continue
                try:
                    result = fn()
                except Exception as exc:  # a failed job fails its future, not the worker
                    fut.set_exception(exc)
                    self._done(failed=True)
                except BaseException as exc:  # the thread dies of it
                    fut.set_exception(exc)
                    self._done(failed=True)
                    died = exc
                    return
                else:
                    fut.set_result(result)
                    self._done(failed=False)
        finally:
            with self._lock:
                if self._thread is threading.current_thread() and not self._stopping:
                    self._restart_locked(f"thread died: {type(died).__name__ if died else 'exit'}")
