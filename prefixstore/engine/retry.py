"""The retry queue: stores refused for lack of space, retried while their caller's
checkpoint is still valid."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import attrs

from prefixstore.base.errors import InvalidInputError, SimulatedCrash
from prefixstore.base.keys import Prefix
from prefixstore.base.layout import RankTensors
from prefixstore.base.log import log
from prefixstore.engine import lifecycle, store
from prefixstore.engine.results import DUPLICATE, REFILLED, REFUSED, STORED

if TYPE_CHECKING:
    from prefixstore.engine.api import Engine

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


def run(eng: Engine) -> None:
    """The body of ``Engine.retry_pending`` (see there)."""
    if not eng._pending and not eng._closed:  # the common case, without the lock
        return
    with lifecycle.guard(eng):
        with eng._lock:
            if eng._retrying or not eng._pending:
                return
            eng._retrying = True
            todo = list(eng._pending)
            eng._pending.clear()
        keep: list[Pending] = []
        i = 0
        try:
            while i < len(todo):
                p = todo[i]
                i += 1
                if retry_logged(eng, p) == "kept":
                    keep.append(p)
        finally:
            with eng._lock:
                eng._pending.extendleft(reversed(keep + todo[i:]))
                eng._retrying = False


def retry_logged(eng: Engine, p: Pending) -> str:
    """Retry ``p``, counting and logging its outcome; the outcome."""
    try:
        event, reason = retry_one(eng, p)
    except BaseException as exc:  # the retry's failure, not its caller's
        eng.counters.inc("retries", "abandoned")
        log.warning("store_retry", outcome="abandoned", reason=f"{type(exc).__name__}: {exc}",
                    blocks=len(p.prefix), key=p.prefix.keys[-1].hex()[:12])
        if isinstance(exc, FATAL):
            raise
        return "abandoned"
    if event != "kept":
        eng.counters.inc("retries", event)
        log.info("store_retry", outcome=event, reason=reason, blocks=len(p.prefix),
                 key=p.prefix.keys[-1].hex()[:12])
    return event


def retry_one(eng: Engine, p: Pending) -> tuple[str, str | None]:
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
        r = store.store(eng, p.prefix, p.segments, p.snapshot, p.tokens_from)
    except InvalidInputError as exc:  # e.g. its parent went: the rows held start too late
        return "abandoned", str(exc)
    if r.status == REFUSED:
        return "kept", None
    if r.status in (STORED, REFILLED):
        return "succeeded", None
    if r.status == DUPLICATE:
        return "superseded", None
    return "abandoned", r.reason or r.status


def enqueue(eng: Engine, p: Pending) -> None:
    """Queue a refused store; a queued store of the same checkpoint is superseded."""
    key = p.prefix.keys[-1]
    events: list[str] = []
    with eng._lock:
        for old in list(eng._pending):
            if old.prefix.keys[-1] == key:
                eng._pending.remove(old)
                events.append("superseded")
        eng._pending.append(p)
        while len(eng._pending) > eng.MAX_PENDING:
            eng._pending.popleft()
            events.append("overflow")
    eng.counters.inc("retries", "queued")
    for event in events:
        eng.counters.inc("retries", event)
