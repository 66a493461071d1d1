"""The retry queue: stores refused for lack of space, retried while their caller's
checkpoint is still valid."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

import attrs

from prefixstore.base.errors import InvalidInputError, SimulatedCrash
from prefixstore.base.keys import Prefix
from prefixstore.base.layout import RankTensors
from prefixstore.base.log import log
from prefixstore.engine import store
from prefixstore.engine.counters import Counters
from prefixstore.engine.guard import CallGuard
from prefixstore.engine.results import DUPLICATE, REFILLED, REFUSED, STORED

FATAL = (SimulatedCrash, KeyboardInterrupt, SystemExit)
"""What a queued store's retry lets through to the call that ran it (process death)."""


@attrs.define
class Pending:
    """A store refused for lack of space, retried while ``valid()`` holds."""

    prefix: Prefix
    segments: list[RankTensors]
    snapshot: list[RankTensors] | None
    tokens_from: int
    valid: Callable[[], bool]


@attrs.define(slots=True, eq=False)
class RetryQueue:
    """The queued stores, oldest first, at most ``max_pending``; whether a retry pass
    is running (one at a time). Changed under the engine lock."""

    max_pending: int
    pending: deque[Pending] = attrs.field(factory=deque)
    retrying: bool = False

    def take_all(self) -> list[Pending] | None:
        """Start a retry pass: every queued store (the queue empties); None when a pass
        is running or nothing is queued. Lock held."""
        if self.retrying or not self.pending:
            return None
        self.retrying = True
        todo = list(self.pending)
        self.pending.clear()
        return todo

    def put_back(self, kept: list[Pending]) -> None:
        """End a retry pass: ``kept`` go back at the head of the queue. Lock held."""
        self.pending.extendleft(reversed(kept))
        self.retrying = False

    def add(self, p: Pending) -> list[str]:
        """Queue ``p``; the events of the stores it pushed out (``superseded``: a queued
        store of the same checkpoint; ``overflow``: the oldest, beyond ``max_pending``). Lock held."""
        key = p.prefix.keys[-1]
        events: list[str] = []
        for old in list(self.pending):
            if old.prefix.keys[-1] == key:
                self.pending.remove(old)
                events.append("superseded")
        self.pending.append(p)
        while len(self.pending) > self.max_pending:
            self.pending.popleft()
            events.append("overflow")
        return events


@attrs.frozen(slots=True, eq=False)
class Retrying:
    """What retrying queued stores uses: the call guard (a retry pass is a call of its
    own), the queue, the store flow, the counters."""

    guard: CallGuard
    queue: RetryQueue
    storing: store.Storing
    counters: Counters


def run(rt: Retrying) -> None:
    """The body of ``Engine.retry_pending`` (see there)."""
    queue = rt.queue
    if not queue.pending and not rt.guard.closed:  # the common case, without the lock
        return
    with rt.guard:
        with rt.guard.lock:
            todo = queue.take_all()
        if todo is None:
            return
        keep: list[Pending] = []
        i = 0
        try:
            while i < len(todo):
                p = todo[i]
                i += 1
                if retry_logged(rt, p) == "kept":
                    keep.append(p)
        finally:
            with rt.guard.lock:
                queue.put_back(keep + todo[i:])


def retry_logged(rt: Retrying, p: Pending) -> str:
    """Retry ``p``, counting and logging its outcome; the outcome."""
    try:
        event, reason = retry_one(rt.storing, p)
    except BaseException as exc:  # the retry's failure, not its caller's
        rt.counters.inc("retries", "abandoned")
        log.warning("store_retry", outcome="abandoned", reason=f"{type(exc).__name__}: {exc}",
                    blocks=len(p.prefix), key=p.prefix.keys[-1].hex()[:12])
        if isinstance(exc, FATAL):
            raise
        return "abandoned"
    if event != "kept":
        rt.counters.inc("retries", event)
        log.info("store_retry", outcome=event, reason=reason, blocks=len(p.prefix),
                 key=p.prefix.keys[-1].hex()[:12])
    return event


def retry_one(st: store.Storing, p: Pending) -> tuple[str, str | None]:
    """Retry one queued store: ('kept' | 'succeeded' | 'dropped' | 'superseded' |
    'abandoned', reason)."""
    try:
        still_valid = bool(p.valid())
    except BaseException as exc:  # the caller's check failing means the checkpoint is gone
        if isinstance(exc, FATAL):
            raise
        return "dropped", f"valid() raised {type(exc).__name__}"
    if not still_valid:
        return "dropped", "invalid"
    try:
        r = store.store(st, p.prefix, p.segments, p.snapshot, p.tokens_from)
    except InvalidInputError as exc:  # e.g. its parent went: the rows held start too late
        return "abandoned", str(exc)
    if r.status == REFUSED:
        return "kept", None
    if r.status in (STORED, REFILLED):
        return "succeeded", None
    if r.status == DUPLICATE:
        return "superseded", None
    return "abandoned", r.reason or r.status


def enqueue(rt: Retrying, p: Pending) -> None:
    """Queue a refused store; a queued store of the same checkpoint is superseded."""
    with rt.guard.lock:
        events = rt.queue.add(p)
    rt.counters.inc("retries", "queued")
    for event in events:
        rt.counters.inc("retries", event)
