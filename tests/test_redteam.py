"""Red-team findings: each test demonstrates one contract violation, now fixed.

A new finding lands as an ``xfail(strict=True)`` test, its root cause in the
``reason``: it fails while the bug is there (the suite stays green) and turns the
suite red (XPASS) once the bug is fixed, so whoever fixes it removes the marker. The
contract is ``shared/DESIGN.md`` (invariants 1-8 in section 4, the failure model in
section 5) and the documented API (docs/api.md, docstrings, ``base/errors.py``).
"""

from __future__ import annotations

import contextlib
import json
import os
import sqlite3
import struct
import threading
import time
from pathlib import Path

import pytest
from conftest import (
    BT,
    BugAtFirstUnlink,
    Gate,
    assert_restores,
    make_layout,
    node_at,
    seg_tensors,
    snap_tensors,
    store_tokens,
    tokens_for,
)

from prefixstore.base.errors import (
    CatalogIOError,
    EngineClosedError,
    InvalidInputError,
    SimulatedCrash,
)
from prefixstore.base.keys import Prefix
from prefixstore.engine import lifecycle, replace
from prefixstore.engine.api import Engine
from prefixstore.fuzz.faultfs import ChainHook
from prefixstore.gpu import shards
from prefixstore.gpu.fileio import FaultHook

CAP = 16 << 20
WAIT = 10.0  # seconds any single handshake may take before the test gives up


def _rows(eng: Engine) -> list[tuple[int, int, int, int, bool]]:
    return sorted((n.id, n.start, n.end, n.generation, n.has_snapshot) for n in eng.index)


def _split_tree(eng: Engine) -> tuple[list[int], list[int]]:
    """A (0,6] chain split at block 2 by a diverging store: E=(0,2] is a ready interior
    row WITHOUT a snapshot (a split at a fork keeps none), U=(2,6] and B=(2,5] below."""
    a = tokens_for(1, 6)
    b = a[: 2 * BT] + tokens_for(2, 3)
    assert store_tokens(eng, a).status == "stored"
    assert store_tokens(eng, b).status == "stored"
    e = node_at(eng, a[: 2 * BT])
    assert (e.start, e.end, e.has_snapshot, e.ready, len(e.children)) == (0, 2, False, True, 2)
    return a, b


class _BlockOnce(FaultHook):
    """Blocks the first effect ``op`` (a shard write; 'commit': the store's intent
    commit) run by the thread named ``thread`` until ``go``."""

    def __init__(self, thread: str, op: str = "write") -> None:
        self.thread, self.op = thread, op
        self.reached, self.go = threading.Event(), threading.Event()

    def before(self, op, target, rank):
        if (
            op == self.op
            and (op != "commit" or target == "store.intent")
            and threading.current_thread().name == self.thread
            and not self.reached.is_set()
        ):
            self.reached.set()
            self.go.wait(WAIT)


class _HoldFileEffects(FaultHook):
    """Once ``armed``, every shard file effect waits for ``event`` (effects that run
    outside the engine lock: a commit's hook runs under it)."""

    def __init__(self, event: threading.Event) -> None:
        self.event, self.armed = event, False

    def before(self, op, target, rank):
        if self.armed and op != "commit":
            self.event.wait(WAIT)


def _until(cond, timeout: float = WAIT) -> bool:
    """Whether ``cond()`` came true within ``timeout`` (checked every millisecond)."""
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.001)
    return True


# --------------------------------------------------------------------------- invariant 6


def test_refill_of_a_ready_row_never_replaces_it_under_a_restore_pin(cache_dir):
    L = make_layout()
    gate = Gate()
    eng = Engine.open(cache_dir, L, CAP, hook=gate)
    try:
        a, _ = _split_tree(eng)
        e = node_at(eng, a[: 2 * BT])
        old_file = os.path.join(cache_dir, "rank0", f"{e.key.hex()}-g{e.generation}.st")
        m = eng.lookup(Prefix.from_tokens(a, BT))
        assert m.hit and m.path[0] == (e.id, e.generation)

        s_blocked, s_go, r_reading, r_go = (threading.Event() for _ in range(4))

        class Interleave(FaultHook):
            def before(self, op, target, rank):
                if (
                    op == "write"
                    and threading.current_thread().name == "refill"
                    and not s_blocked.is_set()
                ):
                    s_blocked.set()  # the refill planned (row not pinned yet), wrote nothing
                    s_go.wait(WAIT)
                if op == "read" and target == old_file and not r_reading.is_set():
                    r_reading.set()  # the restore pinned the path and is about to read E
                    r_go.wait(WAIT)

        out: dict[str, object] = {}
        refill = threading.Thread(
            name="refill", target=lambda: out.update(s=store_tokens(eng, a[: 2 * BT]))
        )
        restore = threading.Thread(name="restore", target=lambda: out.update(r=eng.restore(m)))
        gate.arm(Interleave())
        refill.start()
        assert s_blocked.wait(WAIT)
        restore.start()
        assert r_reading.wait(WAIT)
        s_go.set()
        refill.join(2.0)  # a fixed engine may make the refill wait for the pin instead
        pinned_generation_still_there = os.path.exists(old_file)
        r_go.set()
        restore.join(WAIT)
        refill.join(WAIT)
        gate.disarm()
        assert not refill.is_alive() and not restore.is_alive()

        assert pinned_generation_still_there, (
            "the pinned generation's shard was unlinked under the pin"
        )
        assert e.state == "ready", "an intact row was marked damaged"
        assert_restores(eng, a, blocks=6)
        assert eng.audit().ok
    finally:
        gate.disarm()
        eng.close()


# --------------------------------------------------------------------------- bad input


def test_invalid_tokens_from_raises_and_changes_nothing(cache_dir):
    L = make_layout()
    with Engine.open(cache_dir, L, CAP) as eng:
        a = tokens_for(1, 4)
        assert store_tokens(eng, a).status == "stored"
        before = _rows(eng)
        m = eng.lookup(Prefix.from_tokens(a, BT))
        assert m.hit
        b = a[: 2 * BT] + tokens_for(2, 3)  # diverges after block 2; the new node needs rows from 8
        late = [{k: v[4 * BT :] for k, v in s.items()} for s in seg_tensors(L, b)]
        with pytest.raises(InvalidInputError):
            eng.store(Prefix.from_tokens(b, BT), late, snap_tensors(L, b), tokens_from=4 * BT)
        assert _rows(eng) == before, "a store rejected as bad input split an existing row"
        assert eng.restore(m) is not None, "a Match taken before the rejected call went stale"


def test_lookup_rejects_a_non_integer_gpu_blocks(cache_dir):
    L = make_layout()
    with Engine.open(cache_dir, L, CAP) as eng:
        a = tokens_for(1, 4)
        assert store_tokens(eng, a).ok
        with pytest.raises(InvalidInputError):
            eng.lookup(Prefix.from_tokens(a, BT), gpu_blocks=1.5)


# --------------------------------------------------------------------------- foreign / hostile files


@pytest.mark.parametrize("suffix", [".st", ".st.tmp"])
def test_directory_named_like_a_shard_does_not_brick_the_cache(cache_dir, suffix):
    L = make_layout()
    a = tokens_for(1, 4)
    with Engine.open(cache_dir, L, CAP) as eng:
        assert store_tokens(eng, a).ok
    os.mkdir(os.path.join(cache_dir, "rank0", f"{'ab' * 16}-g1{suffix}"))
    with Engine.open(cache_dir, L, CAP) as eng:
        assert_restores(eng, a, blocks=4)
        assert eng.audit().ok


def test_shard_header_with_non_object_metadata_is_damage_not_a_crash(cache_dir):
    L = make_layout()
    a = tokens_for(1, 4)
    with Engine.open(cache_dir, L, CAP) as eng:
        assert store_tokens(eng, a).ok
        n = node_at(eng, a)
        path = os.path.join(cache_dir, "rank0", f"{n.key.hex()}-g{n.generation}.st")
    data = Path(path).read_bytes()
    (hlen,) = struct.unpack("<Q", data[:8])
    head = json.loads(data[8 : 8 + hlen])
    head["__metadata__"] = ["not", "an", "object"]
    text = json.dumps(head, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    new = struct.pack("<Q", len(text)) + text + data[8 + hlen :]
    Path(path).write_bytes(new)
    conn = sqlite3.connect(os.path.join(cache_dir, "catalog.sqlite"))
    conn.execute(
        "UPDATE files SET size=?, checksum=? WHERE rank=0 AND name=?",
        (len(new), shards.checksum(new), os.path.basename(path)),
    )
    conn.commit()
    conn.close()
    with Engine.open(cache_dir, L, CAP) as eng:
        rep = eng.audit()  # the shard is ready in the catalog but not a valid shard
        assert not rep.ok and rep.status(1) != "ok"
        m = eng.lookup(Prefix.from_tokens(a, BT))
        assert m.hit
        assert eng.restore(m) is None  # a miss, never an exception or other bytes
        assert node_at(eng, a).state == "damaged"


# --------------------------------------------------------------------------- concurrency


def test_split_racing_a_snapshot_retirement_does_not_raise(cache_dir, monkeypatch):
    L = make_layout()
    with Engine.open(cache_dir, L, CAP) as eng:
        a = tokens_for(1, 6)
        assert store_tokens(eng, a[: 4 * BT]).status == "stored"  # N = (0,4] with snapshot
        assert store_tokens(eng, a).status == "stored"  # child (4,6]: N is a compactable ancestor
        n = node_at(eng, a[: 4 * BT])
        assert n.has_snapshot and n.children
        real_run = replace.run
        window: list[bool] = []
        entered: list[str] = []

        def run_after_another_thread_evicts(e, job, **kw):
            if job.use == "split" and not entered:  # on_store planned it and released the lock
                entered.append(job.use)
                e.evict(1)  # policy 'prefixstore': retires N's snapshot (its oldest candidate)
                window.append(n.has_snapshot)
            return real_run(e, job, **kw)

        monkeypatch.setattr(replace, "run", run_after_another_thread_evicts)
        res = store_tokens(eng, a[: 2 * BT])  # lands inside N's span: a split
        monkeypatch.undo()
        assert window == [False], "setup: the eviction in the window did not retire N's snapshot"
        assert res.status in ("stored", "skipped", "refused", "failed"), res
        assert eng.audit().ok
        assert_restores(eng, a, blocks=6)


# --------------------------------------------------------------------------- store_async


def test_store_async_refills_a_damaged_checkpoint(cache_dir):
    """store_async fenced the row it refills at its peek; the commit's own _plan then
    skipped it as 'fenced'. The commit now passes the fences it holds (``held``)."""
    L = make_layout()
    with Engine.open(cache_dir, L, CAP) as eng:
        a = tokens_for(1, 4)
        assert store_tokens(eng, a).ok
        n = node_at(eng, a)
        os.unlink(os.path.join(cache_dir, "rank0", f"{n.key.hex()}-g{n.generation}.st"))
        assert eng.restore(eng.lookup(Prefix.from_tokens(a, BT))) is None
        assert n.state == "damaged"
        ticket = eng.store_async(Prefix.from_tokens(a, BT), seg_tensors(L, a), snap_tensors(L, a))
        res = ticket.result(WAIT)
        assert res.status == "refilled", res
        assert_restores(eng, a, blocks=4)


def test_store_async_accepts_what_store_accepts(cache_dir):
    """The peek checked tokens_from against the ordinary plan, ignoring the republish
    (snapshot only) that store() takes for the same call; it now routes as store()."""
    L = make_layout()
    with Engine.open(cache_dir, L, CAP) as eng:
        d = tokens_for(5, 6)
        f = d[: 4 * BT] + tokens_for(6, 2)
        for t in (d[:BT], d, f):  # f splits (1,6] at 4 at a fork: (1,4] has no snapshot
            assert store_tokens(eng, t).status == "stored"
        e = node_at(eng, d[: 4 * BT])
        assert (e.start, e.end, e.has_snapshot) == (1, 4, False)
        tail = [{k: v[2 * BT :] for k, v in s.items()} for s in seg_tensors(L, d[: 4 * BT])]
        prefix, snap = Prefix.from_tokens(d[: 4 * BT], BT), snap_tensors(L, d[: 4 * BT])
        ticket = eng.store_async(prefix, tail, snap, tokens_from=2 * BT)
        assert ticket.result(WAIT).status == "refilled"
        assert_restores(eng, d[: 4 * BT], blocks=4)


def test_store_async_refills_a_damaged_parent_like_store(cache_dir):
    """The peek staged rows from the new node's start only and fenced the parent, so
    the commit could not refill the damaged parent store() refills from the same rows."""
    L = make_layout()
    with Engine.open(cache_dir, L, CAP) as eng:
        a = tokens_for(1, 6)
        assert store_tokens(eng, a[: 4 * BT]).ok and store_tokens(eng, a).ok
        p = node_at(eng, a[: 4 * BT])
        os.unlink(os.path.join(cache_dir, "rank0", f"{p.key.hex()}-g{p.generation}.st"))
        assert eng.restore(eng.lookup(Prefix.from_tokens(a[: 4 * BT], BT))) is None
        assert p.state == "damaged"
        b = a[: 4 * BT] + tokens_for(2, 2)  # a sibling of (4,6]: its parent is the damaged row
        ticket = eng.store_async(Prefix.from_tokens(b, BT), seg_tensors(L, b), snap_tensors(L, b))
        assert ticket.result(WAIT).status == "stored"
        assert p.state == "ready", "store() refills the parent its rows cover; store_async did not"
        assert eng.stats()["counters"].get("refills") == 1
        assert_restores(eng, b, blocks=6)
        assert eng.audit().ok


# --------------------------------------------------------------------------- exception safety


def test_unexpected_error_during_evict_cleanup_does_not_strand_its_transaction(cache_dir):
    L = make_layout()
    gate = Gate()
    eng = Engine.open(cache_dir, L, CAP, hook=gate)
    try:
        a, b = tokens_for(1, 4), tokens_for(2, 4)
        assert store_tokens(eng, a).ok and store_tokens(eng, b).ok
        gate.arm(BugAtFirstUnlink())
        with contextlib.suppress(RuntimeError):  # may propagate; what it leaves behind matters
            eng.evict(prefix=Prefix.from_tokens(a, BT))
        gate.disarm()
        eng.reclaim()
        st = eng.stats()
        assert not eng.catalog.journal(), "an evict transaction is stranded in the running engine"
        assert st["garbage_bytes"] == 0 and st["charged_bytes"] == st["live_bytes"], st
        assert eng.audit().ok
        assert_restores(eng, b, blocks=4)
    finally:
        gate.disarm()
        eng.close()


# --------------------------------------------------------------------------- queued retries


class _Cancelled(BaseException):
    """A caller's BaseException (as asyncio's CancelledError is) raised by ``valid()``."""


def _queue_behind_a_pin(tmp_path, hook=None):
    """An engine with room for one checkpoint, ``a`` stored and pinned, and a store of
    ``b`` queued (its ``valid`` is the returned dict's 'valid' callable)."""
    L = make_layout()
    a, b = tokens_for(9, 3), tokens_for(10, 3)
    with Engine.open(str(tmp_path / "probe"), L, CAP) as probe:
        size = store_tokens(probe, a).nbytes
    eng = Engine.open(str(tmp_path / "c"), L, size + 8, hook=hook)
    assert store_tokens(eng, a).ok
    ma = eng.lookup(Prefix.from_tokens(a, BT))
    assert eng.pin(ma)
    ctl = {"valid": lambda: True}
    assert store_tokens(eng, b, valid=lambda: ctl["valid"]()).status == "queued"
    return eng, ma, a, b, ctl


@pytest.mark.parametrize("caller", ["unpin", "evict", "reclaim"])
def test_a_queued_store_whose_valid_raises_does_not_escape_into_the_caller(tmp_path, caller):
    eng, ma, a, b, ctl = _queue_behind_a_pin(tmp_path)
    try:

        def cancelled():
            raise _Cancelled()

        ctl["valid"] = cancelled
        if caller == "unpin":
            eng.unpin(ma)  # must not raise: the unpin did its job
            assert eng.stats()["pinned"] == 0
        elif caller == "evict":
            eng.evict(0)
        else:
            eng.reclaim()
        st = eng.stats()
        assert st["pending_retries"] == 0 and st["counters"].get("retries.dropped") == 1, st["counters"]
        assert eng.audit().ok
    finally:
        eng.close()


def test_a_queued_store_failing_unexpectedly_is_abandoned_not_raised(tmp_path):
    gate = Gate()
    eng, ma, a, b, _ = _queue_behind_a_pin(tmp_path, hook=gate)
    try:

        class Bug(FaultHook):
            def before(self, op, target, rank):
                if op == "commit" and target == "store.intent":
                    raise RuntimeError("a bug in the retried store")

        gate.arm(Bug())
        eng.unpin(ma)  # the retry runs (a is evicted for it) and fails: not the unpin's error
        gate.disarm()
        st = eng.stats()
        assert st["pinned"] == 0 and st["pending_retries"] == 0
        assert st["counters"].get("retries.abandoned") == 1, st["counters"]
        assert st["transfers"]["staging_pool"]["outstanding_bytes"] == 0
        assert store_tokens(eng, b).status == "stored"  # the engine goes on
        assert eng.audit().ok
    finally:
        gate.disarm()
        eng.close()


def test_a_simulated_crash_in_a_retry_still_propagates(tmp_path):
    gate = Gate()
    eng, ma, a, b, _ = _queue_behind_a_pin(tmp_path, hook=gate)
    root = eng.root

    class Crash(FaultHook):
        def before(self, op, target, rank):
            if op == "commit" and target == "store.intent":
                raise SimulatedCrash("process death in the retry")

    gate.arm(Crash())
    with pytest.raises(SimulatedCrash):
        eng.unpin(ma)
    gate.disarm()
    assert eng._closed  # abandoned, as a dead process
    with Engine.open(root, eng.layout, eng.capacity) as again:
        assert again.audit().ok and not again.catalog.journal()


# --------------------------------------------------------------------------- close


def _store_on_a_thread(eng: Engine, tokens: list[int]) -> tuple[threading.Thread, dict[str, object]]:
    """``store_tokens`` started on a thread named 'storer'; ``out['store']`` gets its
    result, or what it raised."""
    out: dict[str, object] = {}

    def run_store():
        try:
            out["store"] = store_tokens(eng, tokens)
        except BaseException as exc:  # noqa: BLE001 - the test inspects it
            out["store"] = exc

    storer = threading.Thread(name="storer", target=run_store)
    storer.start()
    return storer, out


def test_close_waits_for_an_in_flight_store_and_refuses_new_calls(cache_dir):
    L = make_layout()
    gate = Gate()
    eng = Engine.open(cache_dir, L, CAP, hook=gate)
    a = tokens_for(1, 4)
    hook = _BlockOnce("storer")
    gate.arm(hook)
    storer, out = _store_on_a_thread(eng, a)
    assert hook.reached.wait(WAIT)
    closer = threading.Thread(name="closer", target=eng.close)
    closer.start()
    assert _until(lambda: eng._closing or not closer.is_alive()), "close() never began"
    waited = closer.is_alive()  # it refuses new calls now, and waits for the store
    refused = None
    if waited:
        try:
            eng.lookup(Prefix.from_tokens(a, BT))
        except EngineClosedError as exc:
            refused = exc
    hook.go.set()
    storer.join(WAIT)
    closer.join(WAIT)
    gate.disarm()
    assert not storer.is_alive() and not closer.is_alive()
    assert not isinstance(out["store"], BaseException), f"the in-flight store raised {out['store']!r}"
    assert out["store"].status == "stored"
    assert waited, "close() did not wait for the store in flight"
    assert refused is not None, "a call started while close() waited was not refused"
    with Engine.open(cache_dir, L, CAP) as again:
        assert again.audit().ok
        assert_restores(again, a, blocks=4)


@pytest.mark.parametrize(("ranks", "op"), [(1, "write"), (2, "commit")])
def test_a_call_outliving_close_gets_a_typed_error_and_loses_nothing(cache_dir, ranks, op, monkeypatch):
    """Blocked in its write (the catalog closes under it) or at its intent commit
    under the engine lock (close waits for the lock; the rank pool is then shut
    down under the store's writes, or the catalog under its publish)."""
    L = make_layout(ranks=ranks)
    gate = Gate()
    eng = Engine.open(cache_dir, L, CAP, hook=gate)
    a, b = tokens_for(1, 4), tokens_for(2, 4)
    assert store_tokens(eng, a).ok
    eng.close_wait_s = 0.2  # close gives up waiting for the blocked store
    gave_up, shutting = threading.Event(), threading.Event()
    quiesce, shutdown = lifecycle.quiesce, lifecycle.shutdown
    monkeypatch.setattr(lifecycle, "quiesce", lambda e, deadline: (quiesce(e, deadline), gave_up.set()))
    monkeypatch.setattr(lifecycle, "shutdown", lambda e: (shutting.set(), shutdown(e)))
    hook = _BlockOnce("storer", op)
    hold = _HoldFileEffects(shutting)  # after its intent: the store's files wait for the shutdown
    gate.arm(ChainHook(hook, hold))
    storer, out = _store_on_a_thread(eng, b)
    assert hook.reached.wait(WAIT)
    closer = threading.Thread(name="closer", target=eng.close)
    closer.start()
    assert gave_up.wait(WAIT) and closer.is_alive()  # past close_wait_s: close gave up waiting
    if op == "write":
        closer.join(WAIT)  # and closed the engine under the blocked write
        assert not closer.is_alive()
    else:
        hold.armed = True  # close waits for the lock the store holds at its intent commit
    hook.go.set()
    closer.join(WAIT)
    storer.join(WAIT)
    gate.disarm()
    assert not storer.is_alive()
    assert isinstance(out["store"], EngineClosedError), f"got {out['store']!r}"
    with Engine.open(cache_dir, L, CAP) as again:
        assert again.audit().ok and not again.catalog.journal()
        assert_restores(again, a, blocks=4)
        assert not again.lookup(Prefix.from_tokens(b, BT)).hit  # never acknowledged


# --------------------------------------------------------------------------- staging buffers


def _io_error() -> sqlite3.OperationalError:
    exc = sqlite3.OperationalError("disk I/O error")
    exc.sqlite_errorcode = 10  # SQLITE_IOERR: the catalog turns it into CatalogIOError
    return exc


@pytest.mark.parametrize(
    ("label", "raise_"),
    [
        ("store.intent", _io_error),
        ("store.intent", lambda: SimulatedCrash("death at the intent commit")),
        ("evict.remove", _io_error),  # inside the store's make-space step
        ("evict.remove", lambda: SimulatedCrash("death while making space")),
    ],
)
def test_a_store_failing_before_its_writes_releases_its_staging_buffers(tmp_path, label, raise_):
    L = make_layout()
    a, b = tokens_for(9, 3), tokens_for(10, 3)
    with Engine.open(str(tmp_path / "probe"), L, CAP) as probe:
        size = store_tokens(probe, a).nbytes
    gate = Gate()
    eng = Engine.open(str(tmp_path / "c"), L, size + 8, hook=gate)  # b needs a evicted
    try:
        assert store_tokens(eng, a).ok

        class Fail(FaultHook):
            def before(self, op, target, rank):
                if op == "commit" and target == label:
                    raise raise_()

        gate.arm(Fail())
        with pytest.raises((CatalogIOError, SimulatedCrash)):
            store_tokens(eng, b)
        gate.disarm()
        assert eng.executor.pool.stats()["outstanding_bytes"] == 0
    finally:
        gate.disarm()
        if not eng._closed:
            eng.close()
    with Engine.open(str(tmp_path / "c"), L, size + 8) as again:
        assert again.audit().ok


class _UnreadableJournal:
    """The catalog's connection once its pages can no longer be read: every statement
    on the journal fails as SQLite reports a failed page read (SQLITE_CORRUPT)."""

    def __init__(self, conn: sqlite3.Connection) -> None:
        self.conn = conn

    def execute(self, sql, *args):
        if "journal" in sql:
            exc = sqlite3.DatabaseError("database disk image is malformed")
            exc.sqlite_errorcode = 11
            raise exc
        return self.conn.execute(sql, *args)

    def __getattr__(self, name):
        return getattr(self.conn, name)


@pytest.mark.parametrize("label", ["store.publish", "evict.reclaimed"])
def test_a_transaction_that_cannot_be_ended_raises_its_own_typed_error(tmp_path, label):
    """A commit fails with an I/O error, then ending its transaction cannot even read
    the journal: the caller gets the commit's CatalogIOError (never the raw sqlite3
    error of the clean-up), the engine refuses writes until reopened, and recovery
    finishes the transaction with nothing lost."""
    L = make_layout()
    root = str(tmp_path / "c")
    a, b = tokens_for(11, 3), tokens_for(12, 3)
    gate = Gate()
    eng = Engine.open(root, L, CAP, hook=gate)
    try:
        assert store_tokens(eng, a).ok

        class Fail(FaultHook):
            def before(self, op, target, rank):
                if op == "commit" and target == label:
                    eng.catalog.conn = _UnreadableJournal(eng.catalog.conn)
                    raise _io_error()

        gate.arm(Fail())
        with pytest.raises(CatalogIOError):
            if label == "store.publish":
                store_tokens(eng, b)
            else:
                eng.evict(prefix=Prefix.from_tokens(a, BT))
        gate.disarm()
        eng.catalog.conn = eng.catalog.conn.conn
        assert eng.catalog.failed is not None
        with pytest.raises(CatalogIOError, match="reopen"):
            store_tokens(eng, b)
    finally:
        gate.disarm()
        if isinstance(eng.catalog.conn, _UnreadableJournal):
            eng.catalog.conn = eng.catalog.conn.conn
        eng.close()
    with Engine.open(root, L, CAP) as again:
        assert again.audit().ok and not again.catalog.journal()
        if label == "store.publish":
            assert_restores(again, a, blocks=3)
        else:  # the eviction had published: recovery finished it
            assert not again.lookup(Prefix.from_tokens(a, BT)).hit
        assert store_tokens(again, b).ok


# --------------------------------------------------------------------------- index reload


def test_a_failed_transaction_reload_keeps_in_flight_nodes_current(cache_dir):
    """fail_txn rebuilt the index from scratch: a refill in flight then published into
    its stale Node object, and the index kept the damaged row with its old generation."""
    L = make_layout()
    gate = Gate()
    eng = Engine.open(cache_dir, L, CAP, hook=gate)
    try:
        a, b = tokens_for(1, 4), tokens_for(2, 4)
        assert store_tokens(eng, a).ok and store_tokens(eng, b).ok
        x = node_at(eng, a)
        os.unlink(os.path.join(cache_dir, "rank0", f"{x.key.hex()}-g{x.generation}.st"))
        assert eng.restore(eng.lookup(Prefix.from_tokens(a, BT))) is None
        assert x.state == "damaged"

        block = _BlockOnce("refill")

        class Hooks(FaultHook):
            bug = True

            def before(self, op, target, rank):
                block.before(op, target, rank)
                if op == "unlink" and threading.current_thread().name != "refill" and self.bug:
                    self.bug = False
                    raise RuntimeError("a rank agent bug, not an I/O error")

        out: dict[str, object] = {}
        refill = threading.Thread(name="refill", target=lambda: out.update(r=store_tokens(eng, a)))
        gate.arm(Hooks())
        refill.start()
        assert block.reached.wait(WAIT)  # the refill planned, fenced x, and is writing
        with contextlib.suppress(RuntimeError):
            eng.evict(prefix=Prefix.from_tokens(b, BT))  # fails after its publish: fail_txn
        block.go.set()
        refill.join(WAIT)
        gate.disarm()
        assert not refill.is_alive()
        assert out["r"].status == "refilled", out
        rows = dict(eng.catalog.query("SELECT id, generation FROM nodes"))
        live = node_at(eng, a)
        assert (live.state, live.generation) == ("ready", rows[live.id]), "the index disagrees with the catalog"
        assert_restores(eng, a, blocks=4)
        assert eng.audit().ok
    finally:
        gate.disarm()
        eng.close()
