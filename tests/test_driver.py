"""The journal driver over a real catalog and real rank directories (no Engine).

The handlers here do what the engine's do (unlink the owned files, then fire the
event that ends the state) so that whole transactions run through the tables.
"""

from __future__ import annotations

import os

import attrs
import pytest
from conftest import make_layout, node_at, store_tokens, tokens_for

from prefixstore.base.errors import CatalogCorruptError, IllegalTransitionError
from prefixstore.engine import health, journal
from prefixstore.engine.api import Engine
from prefixstore.engine.catalog import Catalog
from prefixstore.engine.driver import (
    DEBUG_ENV,
    Driver,
    DriverDefinitionError,
    InvariantViolation,
    Txn,
)
from prefixstore.gpu.fileio import FaultHook
from prefixstore.gpu.ranks import TMP_SUFFIX, LocalRank, shard_name
from prefixstore.statemachine.machine import Machine, T
from prefixstore.statemachine.rows import FILE, NODE, FileRow, NodeRow
from prefixstore.statemachine.transactions import MACHINES, TxnSnapshot, violations

RANKS = 2
KEY = bytes(range(32))


class Durability(FaultHook):
    """What a rank's own completed effects made durable: a file whose data was
    fsynced under its temporary name, renamed into place, and whose directory was
    fsynced after the rename."""

    def __init__(self) -> None:
        self.synced: set[str] = set()
        self.pending: dict[str, bool] = {}
        self.durable: set[str] = set()

    def after(self, op: str, target: str, rank: int | None) -> None:
        if op == "fsync":
            self.synced.add(target)
        elif op == "rename":
            self.pending[target] = target + TMP_SUFFIX in self.synced
        elif op == "fsync_dir":
            for path, synced in list(self.pending.items()):
                if os.path.dirname(path) == target and synced:
                    self.durable.add(path)
                    del self.pending[path]
        elif op == "unlink":
            self.durable.discard(target)


class SkipsDirSync(LocalRank):
    """A planted bug: writes a shard without the directory fsync."""

    def write_shard(self, name: str, data: bytes) -> None:
        final = self.path(name)
        self.fs.write_new(final + TMP_SUFFIX, data)
        self.fs.fsync(final + TMP_SUFFIX)
        self.fs.rename_new(final + TMP_SUFFIX, final)


class World:
    """A catalog, ranks and a driver whose handlers unlink and fire as the engine's do."""

    def __init__(self, root, debug: bool = True, rank_cls=LocalRank) -> None:
        self.catalog = Catalog(str(root))
        self.hook = Durability()
        self.ranks = [rank_cls(r, str(root / f"rank{r}"), hook=self.hook) for r in range(RANKS)]
        self.ran: list[tuple[int, str]] = []
        self.driver = Driver(
            handlers={
                "store": {"retire_old": self.retire("retired", "retire_failed"),
                          "clean_up": self.retire("cleaned", "cleanup_failed")},
                "compact": {"retire_old": self.retire("retired", "retire_failed"),
                            "clean_up": self.retire("cleaned", "cleanup_failed")},
                "evict": {"reclaim": self.retire("reclaimed", "reclaim_failed")},
            },
            ranks=RANKS,
            durable=lambda r, name: self.ranks[r].path(name) in self.hook.durable,
            debug=debug,
        )

    def retire(self, ok: str, failed: str):
        def handler(txn: Txn) -> None:
            self.ran.append((txn.id, ok))
            rows = self.catalog.query("SELECT rank, name FROM files WHERE txn=?", (txn.id,))
            for r, name in rows:
                self.ranks[r].remove(name)
            for r in range(RANKS):
                self.ranks[r].sync_dir()
            with self.catalog.txn(ok) as c:
                c.execute("DELETE FROM files WHERE txn=?", (txn.id,))
                outs = self.driver.fire(c, txn, ok)
            self.driver.run_outputs(txn, outs)
        return handler

    # -- a store, as the engine runs it ------------------------------------------------

    def intent(self, gen: int = 1, node: int | None = None) -> tuple[Txn, str]:
        name = shard_name(KEY, gen)
        payload = {"key": KEY.hex(), "generation": gen, "name": name, "start": 0, "end": 1,
                   "parent": None, "node": node}
        with self.catalog.txn("store.intent") as c:
            txn = self.driver.begin(c, "store", payload, rows=lambda tid: c.executemany(
                "INSERT INTO files(rank, name, node, generation, size, checksum, status, txn) "
                "VALUES(?, ?, NULL, ?, 3, NULL, ?, ?)",
                [(r, name, gen, FILE.next("absent", "reserved"), tid) for r in range(RANKS)]))
        return txn, name

    def write(self, name: str) -> None:
        for rank in self.ranks:
            rank.write_shard(name, b"abc")

    def publish(self, txn: Txn, name: str, gen: int = 1, node: int | None = None) -> int:
        with self.catalog.txn("store.publish") as c:
            old = 0
            if node is None:
                nid = c.execute(
                    "INSERT INTO nodes(key, parent, start_block, end_block, digests, has_snapshot, state, "
                    "generation, last_used, snap_used) VALUES(?, NULL, 0, 1, x'', 0, ?, ?, 0, 0)",
                    (KEY, NODE.next("absent", "published"), gen)).lastrowid
            else:
                nid = node
                old = c.execute("UPDATE files SET status=?, node=NULL, txn=? WHERE node=? AND status='live'",
                                (FILE.next("live", "retired"), txn.id, nid)).rowcount
                c.execute("UPDATE nodes SET state=?, generation=? WHERE id=?",
                          (NODE.next("ready", "published"), gen, nid))
            c.execute("UPDATE files SET status=?, node=?, txn=NULL WHERE txn=? AND status='writing'",
                      (FILE.next("writing", "published"), nid, txn.id))
            outs = self.driver.fire(c, txn, "durable")
            if not old:
                outs = self.driver.fire(c, txn, "retired")
        self.driver.run_outputs(txn, outs)
        return nid

    def rollback(self, txn: Txn, event: str = "failed") -> None:
        with self.catalog.txn("store.rollback") as c:
            c.execute("UPDATE files SET status=? WHERE txn=?", (FILE.next("writing", "abandoned"), txn.id))
            outs = self.driver.fire(c, txn, event)
        self.driver.run_outputs(txn, outs)

    def store(self, gen: int = 1, node: int | None = None) -> int:
        txn, name = self.intent(gen, node)
        self.write(name)
        return self.publish(txn, name, gen, node)

    def journal(self):
        return self.catalog.query("SELECT id, kind, state FROM journal")

    def files(self):
        return self.catalog.query("SELECT rank, name, node, status, txn FROM files ORDER BY rank, name")


@pytest.fixture
def world(tmp_path):
    w = World(tmp_path)
    yield w
    w.catalog.close()


# ------------------------------------------------------------------ tables, handlers


def test_illegal_transition_is_refused_and_leaves_the_row(world):
    txn, _ = world.intent()
    with pytest.raises(IllegalTransitionError, match="retired.*INTENT"), world.catalog.txn("x") as c:
        world.driver.fire(c, txn, "retired")
    assert [tuple(r) for r in world.journal()] == [(txn.id, "store", "INTENT")]


def test_state_is_read_from_the_journal_not_the_caller(world):
    txn, name = world.intent()
    with world.catalog.txn("hand") as c:  # the journal moved on behind the caller's back
        c.execute("UPDATE journal SET state='ROLLING_BACK' WHERE id=?", (txn.id,))
        c.execute("UPDATE files SET status='garbage' WHERE txn=?", (txn.id,))
    with pytest.raises(IllegalTransitionError, match="durable.*ROLLING_BACK"), world.catalog.txn("x") as c:
        world.driver.fire(c, txn, "durable")
    with world.catalog.txn("x") as c:
        c.execute("DELETE FROM files WHERE txn=?", (txn.id,))
        assert world.driver.fire(c, txn, "cleaned") == ()
    assert world.journal() == []
    with pytest.raises(IllegalTransitionError, match="no journal row"), world.catalog.txn("x") as c:
        world.driver.fire(c, txn, "cleaned")  # a stale Txn whose transaction ended


def test_txn_of_another_kind_is_refused(world):
    txn, _ = world.intent()
    with pytest.raises(IllegalTransitionError, match="is a store"), world.catalog.txn("x") as c:
        world.driver.fire(c, Txn(txn.id, "evict", {}), "reclaimed")


def _handlers(**drop):
    noop = lambda txn: None  # noqa: E731
    h = {"store": {"retire_old": noop, "clean_up": noop}, "compact": {"retire_old": noop, "clean_up": noop},
         "evict": {"reclaim": noop}}
    for kind, name in drop.items():
        del h[kind][name]
    return h


def test_missing_handler_fails_when_the_driver_is_built():
    Driver(handlers=_handlers())  # complete: builds
    with pytest.raises(DriverDefinitionError, match="compact: no handler for outputs \\['clean_up'\\]"):
        Driver(handlers=_handlers(compact="clean_up"))
    with pytest.raises(DriverDefinitionError, match="evict"):
        Driver(handlers={k: v for k, v in _handlers().items() if k != "evict"})


def test_handler_for_no_output_or_kind_fails_when_built():
    h = _handlers()
    h["store"]["publish_twice"] = lambda txn: None
    with pytest.raises(DriverDefinitionError, match="publish_twice"):
        Driver(handlers=h)
    with pytest.raises(DriverDefinitionError, match="unknown transaction kinds \\['replace'\\]"):
        Driver(handlers={**_handlers(), "replace": {}})


def test_outputs_run_in_table_order_after_the_fire(tmp_path):
    m = Machine("m", "A", {"B"}, [T("A", "go", "B", "one", "two", "three", recovery=True)], published={"A"})
    ran: list[str] = []
    drv = Driver(handlers={"m": {n: (lambda txn, n=n: ran.append(n)) for n in ("one", "two", "three")}},
                 machines={"m": m})
    cat = Catalog(str(tmp_path))
    try:
        with cat.txn("begin") as c:
            txn = drv.begin(c, "m", {})
        with cat.txn("go") as c:
            outs = drv.fire(c, txn, "go")
            assert ran == []  # nothing runs inside the commit
        drv.run_outputs(txn, outs)
        assert ran == ["one", "two", "three"]
        assert cat.query("SELECT count(*) FROM journal")[0][0] == 0
    finally:
        cat.close()


# ------------------------------------------------------------------ whole transactions


def test_store_publishes_and_ends_with_invariants_on(world):
    nid = world.store()
    assert world.journal() == []
    assert [tuple(r) for r in world.files()] == [(r, shard_name(KEY, 1), nid, "live", None) for r in range(RANKS)]


def test_refill_retires_the_old_generation_through_its_output(world):
    nid = world.store()
    txn, name = world.intent(2, nid)
    world.write(name)
    world.publish(txn, name, 2, nid)
    assert (txn.id, "retired") in world.ran
    assert world.journal() == []
    assert {r[1] for r in world.files()} == {shard_name(KEY, 2)}
    assert not os.path.exists(world.ranks[0].path(shard_name(KEY, 1)))


def test_failed_store_rolls_back_through_clean_up(world):
    txn, name = world.intent()
    world.ranks[0].write_shard(name, b"abc")  # rank 1 "failed"
    world.rollback(txn)
    assert world.ran == [(txn.id, "cleaned")]
    assert world.journal() == [] and world.files() == []
    assert not os.path.exists(world.ranks[0].path(name))


def test_evict_reclaims_through_its_begin_output(world):
    nid = world.store()

    def remove(tid: int) -> None:
        c.execute("UPDATE files SET status=?, node=NULL, txn=? WHERE node=?", (FILE.next("live", "retired"), tid, nid))
        c.execute("DELETE FROM nodes WHERE id=?", (nid,))

    with world.catalog.txn("evict.remove") as c:
        txn = world.driver.begin(c, "evict", {"nodes": [nid]}, rows=remove)
    assert txn.outputs == ("reclaim",)
    world.driver.run_outputs(txn, txn.outputs)
    assert world.journal() == [] and world.files() == []


# ------------------------------------------------------------------ invariants


def test_publish_without_the_directory_fsync_is_caught_at_the_publish(tmp_path):
    w = World(tmp_path, rank_cls=SkipsDirSync)
    try:
        txn, name = w.intent()
        w.write(name)
        with pytest.raises(InvariantViolation, match=r"store PUBLISHED 2: .*not durable on rank0"):
            w.publish(txn, name)
        # the publish commit was rolled back with the check: the intent still stands
        assert [tuple(r) for r in w.journal()] == [(txn.id, "store", "INTENT")]
    finally:
        w.catalog.close()


def test_the_same_bug_passes_with_the_check_off(tmp_path):
    w = World(tmp_path, debug=False, rank_cls=SkipsDirSync)
    try:
        txn, name = w.intent()
        w.write(name)
        w.publish(txn, name)
        assert w.journal() == []
    finally:
        w.catalog.close()


def test_publish_with_a_writing_row_left_is_caught(world):
    txn, name = world.intent()
    world.write(name)
    with pytest.raises(InvariantViolation, match="rank1 is writing, expected live"), \
            world.catalog.txn("store.publish") as c:
        nid = c.execute("INSERT INTO nodes(key, parent, start_block, end_block, digests, has_snapshot, state, "
                        "generation, last_used, snap_used) VALUES(?, NULL, 0, 1, x'', 0, 'ready', 1, 0, 0)",
                        (KEY,)).lastrowid
        c.execute("UPDATE files SET status='live', node=?, txn=NULL WHERE txn=? AND rank=0", (nid, txn.id))
        world.driver.fire(c, txn, "durable")


def test_debug_flag_comes_from_the_environment(monkeypatch):
    monkeypatch.setenv(DEBUG_ENV, "1")
    assert Driver(handlers=_handlers()).debug is True
    monkeypatch.setenv(DEBUG_ENV, "0")
    assert Driver(handlers=_handlers()).debug is False
    monkeypatch.delenv(DEBUG_ENV)
    assert Driver(handlers=_handlers()).debug is False
    assert Driver(handlers=_handlers(), debug=True).debug is True


def _row(rank, status, node=None, txn=None, name="a.safetensors", gen=1):
    return FileRow(rank, name, node, gen, 3, None, status, txn)


def test_hand_made_violating_snapshots_are_caught():
    payload = {"name": "a.safetensors", "generation": 1, "node": None}
    good = TxnSnapshot(7, "store", "INTENT", "INTENT", payload, 2, (_row(0, "writing", txn=7), _row(1, "writing", txn=7)))
    assert violations(good) == []
    missing_rank = TxnSnapshot(7, "store", "INTENT", "INTENT", payload, 2, (_row(0, "writing", txn=7),))
    assert any(v.startswith("store INTENT 2:") for v in violations(missing_rank))
    wrong_journal = TxnSnapshot(7, "store", "PUBLISHED", "INTENT", payload, 2, ())
    assert any(v.startswith("store PUBLISHED 1:") for v in violations(wrong_journal))
    live = (_row(0, "live", node=3), _row(1, "live", node=3))
    nodes = {3: NodeRow(3, None, 0, 1, "ready", 1, False)}
    published = TxnSnapshot(7, "store", "PUBLISHED", "PUBLISHED", payload, 2, live, nodes,
                            frozenset({(0, "a.safetensors"), (1, "a.safetensors")}))
    assert violations(published) == []
    damaged = attrs.evolve(published, nodes={3: NodeRow(3, None, 0, 1, "damaged", 1, False)})
    assert any(v.startswith("store PUBLISHED 3:") for v in violations(damaged))
    evicted = TxnSnapshot(8, "evict", "REMOVED", "REMOVED", {"nodes": [3]}, 2, live, nodes)
    found = violations(evicted)
    assert any(v.startswith("evict REMOVED 2:") for v in found)
    bad_row = TxnSnapshot(8, "evict", "DONE", None, {"nodes": [3]}, 2, (_row(0, "garbage", node=3),))
    assert any(v.startswith("FILE 3:") for v in violations(bad_row))


# ------------------------------------------------------------------ recovery


@pytest.mark.parametrize("kind,state", [(m.name, s) for m in MACHINES.values() for s in sorted(m.states - m.finals)])
def test_recovery_is_derived_from_the_table(tmp_path, kind, state):
    m = MACHINES[kind]
    drv = Driver(handlers=_handlers(), debug=False)
    cat = Catalog(str(tmp_path))
    try:
        with cat.txn("seed") as c:
            tid = drv.journal.insert(c, kind, state, {})
            # the row the caller holds is stale: recovery reads the journal's state
            txn, step = drv.recover(c, (tid, kind, m.initial if state != m.initial else state, {}))
        assert txn.id == tid and txn.kind == kind
        assert step.direction == ("forward" if state in m.published else "back")
        assert step.event in m.events(state)
        if step.fire is not None:  # fired now; its transition's outputs do the work
            assert step.fire == step.event and step.outputs == m.outputs(state, step.event)
        else:  # the state's own outputs, re-run, fire the event
            assert step.outputs and step.outputs == m.entry[state]
        assert set(step.outputs) <= set(drv.handlers[kind])
        want = "DONE" if step.direction == "forward" else "ROLLED_BACK"
        assert m.recovered(state) == want
        with cat.txn("end") as c:
            at = state
            while not m.is_final(at):
                drv.fire(c, txn, m.recovery_event(at))
                at = m.next(at, m.recovery_event(at))
        assert cat.query("SELECT count(*) FROM journal")[0][0] == 0
    finally:
        cat.close()


def test_unknown_journal_row_is_corrupt():
    drv = Driver(handlers=_handlers())
    with pytest.raises(CatalogCorruptError, match="replace/INTENT"):
        drv.txn((1, "replace", "INTENT", {}))


def test_abort_reads_the_journal(world):
    txn, _ = world.intent()
    with world.catalog.txn("x") as c:
        step = world.driver.abort(c, txn)
    assert (step.fire, step.direction, step.outputs) == ("failed", "back", ("clean_up",))
    world.rollback(txn)
    with world.catalog.txn("x") as c:
        assert world.driver.abort(c, txn) is None


# ---------------------------------------------------------------------------- the engine


def test_engine_open_fails_on_an_output_with_no_handler(tmp_path, monkeypatch):
    orig = journal.handlers

    def missing_reclaim(eng):
        out = orig(eng)
        out["evict"] = {}
        return out

    monkeypatch.setattr(journal, "handlers", missing_reclaim)
    with pytest.raises(DriverDefinitionError, match=r"evict: no handler for outputs \['reclaim'\]"):
        Engine.open(str(tmp_path / "c"), make_layout(ranks=RANKS), 1 << 24)


def test_engine_transitions_all_go_through_the_checked_driver(tmp_path, monkeypatch):
    """With the flag on (the suite's default), a store, a refill, a rollback and an
    evict reach every state of their tables through the driver, each one checked."""
    monkeypatch.setenv(DEBUG_ENV, "1")
    seen: list[tuple[str, str]] = []
    orig = Driver.check

    def check(self, c, txn, state):
        seen.append((txn.kind, state))
        return orig(self, c, txn, state)

    monkeypatch.setattr(Driver, "check", check)
    eng = Engine.open(str(tmp_path / "c"), make_layout(ranks=RANKS), 1 << 24, hook=FailWritesOnce())
    try:
        assert eng.driver.debug
        toks = tokens_for(3, 2)
        assert store_tokens(eng, toks).status == "failed"  # the first write fails: rolled back
        assert store_tokens(eng, toks).status == "stored"
        health.invalidate(eng.flows.health, node_at(eng, toks), "test")
        assert store_tokens(eng, toks).status == "refilled"
        assert eng.evict(1) > 0
    finally:
        eng.close()
    assert set(seen) == {("store", s) for s in MACHINES["store"].states} | {
        ("evict", "REMOVED"), ("evict", "DONE")}, seen


class FailWritesOnce(FaultHook):
    def __init__(self) -> None:
        self.failed = False

    def before(self, op: str, target: str, rank: int | None) -> None:
        if op == "write" and not self.failed:
            self.failed = True
            raise OSError(5, "injected write failure", target)
