"""The call guard against ``close``, at the points where a close can begin while a call
enters: a call counts itself in and then checks ``closing``; ``close`` sets ``closing``
and then counts. Wherever close begins, it either waits for the call or the call is
refused (this guard refuses every call that has not checked yet). A planted guard that checks before it counts lets a call in behind a close
that has already stopped waiting, and the same checks catch it.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import pytest

from prefixstore.base.errors import EngineClosedError
from prefixstore.engine.guard import CallGuard, Lifetime, _ident

WAIT = 10.0  # seconds a handshake may take before the test gives up


class _Hooked(list):
    """A guard's in-flight list that runs ``before`` and ``after`` around its first append
    (the entering call counting itself in)."""

    def __init__(self, before: Callable[[], None] | None = None, after: Callable[[], None] | None = None) -> None:
        super().__init__()
        self.before, self.after = before, after

    def append(self, item: int) -> None:
        before, self.before = self.before, None
        if before is not None:
            before()
        super().append(item)
        after, self.after = self.after, None
        if after is not None:
            after()


class _CheckThenCount(CallGuard):
    """Planted: checks ``closing`` before counting the call in."""

    __slots__ = ()

    def __enter__(self) -> None:
        if self.closing or self.life.closed:
            raise EngineClosedError("engine is closed")
        self.inflight.append(_ident())


def _close_on_a_thread(guard: CallGuard) -> threading.Thread:
    # it gives up waiting only well after the test stops waiting for it
    closer = threading.Thread(name="closer", target=guard.quiesce, args=(time.monotonic() + 3 * WAIT,), daemon=True)
    closer.start()
    return closer


def _enter_while_close_begins(cls: type[CallGuard], where: str) -> tuple[str, bool, bool]:
    """A call entering ``cls`` while a close (on another thread) begins just ``before``
    or just ``after`` it counts itself in: whether it was 'refused' or 'entered';
    whether, entered, it ran with the close already ended (nothing waits for it); and
    whether the close was left waiting once the call was gone."""
    guard = cls(Lifetime())
    closers: list[threading.Thread] = []

    def begin_close() -> None:
        closers.append(_close_on_a_thread(guard))
        deadline = time.monotonic() + WAIT
        while not guard.closing and time.monotonic() < deadline:
            time.sleep(0.001)
        if where == "before":
            closers[0].join(WAIT)  # no call counted: close ends at once

    guard.inflight = _Hooked(**{where: begin_close})
    unwaited = False
    try:
        with guard:
            outcome, unwaited = "entered", not closers[0].is_alive()
    except EngineClosedError:
        outcome = "refused"
    closers[0].join(WAIT)
    return outcome, unwaited, closers[0].is_alive() or guard.calls != 0


@pytest.mark.parametrize("where", ["before", "after"])
def test_a_call_entering_as_close_begins_is_refused_and_close_ends(where: str) -> None:
    """A call sees a close that began before it checked: it is refused (and uncounts
    itself, so the close is not left waiting for it)."""
    outcome, unwaited, stuck = _enter_while_close_begins(CallGuard, where)
    assert outcome == "refused", f"a call entered after close began ({where} it counted itself in)"
    assert not unwaited and not stuck, "close was left waiting"


def test_the_checks_catch_a_guard_that_checks_before_it_counts() -> None:
    outcome, unwaited, _ = _enter_while_close_begins(_CheckThenCount, "before")
    assert outcome == "entered" and unwaited  # the planted guard's call runs behind a finished close


def test_close_from_inside_a_call_does_not_wait_for_it_and_nested_calls_go_on() -> None:
    guard = CallGuard(Lifetime())
    refused: list[bool] = []

    def other_thread_call() -> None:
        try:
            with guard:
                refused.append(False)
        except EngineClosedError:
            refused.append(True)

    with guard:
        guard.quiesce(time.monotonic() + WAIT)  # returns: only this thread's call is in flight
        assert guard.closing and guard.depth == 1
        with guard:  # nested in a call of this thread
            assert guard.depth == 2
        other = threading.Thread(target=other_thread_call)
        other.start()
        other.join(WAIT)
    assert refused == [True] and guard.calls == 0
    with pytest.raises(EngineClosedError), guard:
        pass
