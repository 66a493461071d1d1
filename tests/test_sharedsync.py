"""SharedSync's rules, with a sync the test holds: a change waits only for a sync
that began after it, leads one at once when none has (even while another runs), and a
failed sync fails the waiters of its round alone."""

from __future__ import annotations

import errno
import threading
import time

import pytest

from prefixstore.gpu.sharedsync import SharedSync

LIMIT_S = 10.0


class HeldSync:
    """A sync that records when each call began and blocks until the test releases it."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.began: list[threading.Event] = []
        self.release: list[threading.Event] = []
        self.fail: set[int] = set()
        """Calls (by number, from 0) that raise EIO once released."""

    def __call__(self) -> None:
        with self.lock:
            n = len(self.began)
            self.began.append(threading.Event())
            self.release.append(threading.Event())
        self.began[n].set()
        assert self.release[n].wait(LIMIT_S), "the test never released the sync"
        if n in self.fail:
            raise OSError(errno.EIO, f"injected EIO on sync {n}")

    def started(self, n: int) -> bool:
        """Wait (bounded) for call ``n`` to begin."""
        deadline = time.monotonic() + LIMIT_S
        while len(self.began) <= n:
            if time.monotonic() > deadline:
                return False
            time.sleep(0.001)
        return self.began[n].wait(LIMIT_S)


def change_and_wait(ss: SharedSync, out: dict, key: str) -> threading.Thread:
    """A thread that makes a change, then waits for it; ``out[key]`` says how it ended."""

    def work() -> None:
        try:
            ss.wait(ss.changed())
            out[key] = "ok"
        except OSError as exc:
            out[key] = f"error: {exc}"

    t = threading.Thread(target=work)
    t.start()
    return t


def test_a_change_made_while_a_sync_runs_starts_its_own_at_once():
    sync = HeldSync()
    ss = SharedSync(sync)
    out: dict[str, str] = {}
    a = change_and_wait(ss, out, "a")
    assert sync.started(0)
    b = change_and_wait(ss, out, "b")  # its change is after sync 0 began: 0 cannot cover it
    assert sync.started(1), "the second change waited behind a sync begun before it"
    assert len(ss.running) == 2
    sync.release[1].set()
    b.join(LIMIT_S)
    assert out == {"b": "ok"}  # returned on its own sync, sync 0 still running
    sync.release[0].set()
    a.join(LIMIT_S)
    assert out == {"a": "ok", "b": "ok"}
    assert (ss.changes, ss.syncs, ss.running) == (2, 2, [])


def test_a_change_never_returns_before_a_sync_begun_after_it_completed():
    sync = HeldSync()
    ss = SharedSync(sync)
    first = ss.changed()
    second = ss.changed()  # joins the same open round: one sync covers both
    out: dict[str, str] = {}

    def lead(rnd, key):
        ss.wait(rnd)
        out[key] = "ok"

    a = threading.Thread(target=lead, args=(first, "a"))
    a.start()
    assert sync.started(0)
    b = threading.Thread(target=lead, args=(second, "b"))
    b.start()
    time.sleep(0.05)
    assert out == {} and len(sync.began) == 1  # b sleeps behind the sync covering it
    assert ss.waiting == 1
    sync.release[0].set()
    a.join(LIMIT_S)
    b.join(LIMIT_S)
    assert out == {"a": "ok", "b": "ok"}
    assert (ss.changes, ss.syncs) == (2, 1)


def test_a_failed_sync_fails_its_round_and_no_other():
    sync = HeldSync()
    sync.fail = {0}
    ss = SharedSync(sync, "fsync of d")
    first, second = ss.changed(), ss.changed()
    out: dict[str, str] = {}

    def lead(rnd, key):
        try:
            ss.wait(rnd)
            out[key] = "ok"
        except OSError as exc:
            out[key] = f"error: {exc}"

    a = threading.Thread(target=lead, args=(first, "a"))
    a.start()
    assert sync.started(0)
    b = threading.Thread(target=lead, args=(second, "b"))
    b.start()
    c = change_and_wait(ss, out, "c")  # made after sync 0 began: its own sync
    assert sync.started(1)
    sync.release[0].set()
    a.join(LIMIT_S)
    b.join(LIMIT_S)
    assert out["a"].startswith("error: ") and "injected EIO on sync 0" in out["a"]
    assert out["b"].startswith("error: ") and "shared fsync of d failed" in out["b"]
    assert "c" not in out
    sync.release[1].set()
    c.join(LIMIT_S)
    assert out["c"] == "ok"


def test_a_sync_interrupted_by_something_else_fails_its_round():
    calls = []

    def run() -> None:
        calls.append(1)
        if len(calls) == 1:
            raise KeyboardInterrupt

    ss = SharedSync(run)
    rnd = ss.changed()
    with pytest.raises(KeyboardInterrupt):
        ss.wait(rnd)
    assert rnd.done and rnd.error is not None and ss.running == []
    ss.wait(ss.changed())  # a later change runs a sync of its own
    assert len(calls) == 2
