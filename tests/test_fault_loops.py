"""SQLite-style fault loops: fail effect 1, then 2, then 3, ... until the operation
completes, once as a one-off fault and once as a persistent one; and the same for
recovery, plus a crash at every point of recovery.

Transaction kinds: a store (a new child node), a refill (a damaged row stored again),
an evict (a leaf), a snapshot retirement (eviction pressure, ``evict(nbytes)``, with
the interior snapshots the oldest candidates) and a compaction (a merge). Each on 1,
2 and 4 ranks; effects are counted per rank (each rank in turn) so that the nth
effect is the same one on every run although ranks write in parallel.

After every run, with the engine still open and again after a reopen: the audit is
clean, the journal empty, and every checkpoint the scenario acknowledged restores
bit-identically (those the operation may have legitimately removed restore exactly
or miss).
"""

from __future__ import annotations

import contextlib
import os
import pathlib
import shutil
import tempfile

import pytest
from conftest import BT, assert_restores, key_at, make_layout, store_tokens, tokens_for

from prefixstore.base.errors import SimulatedCrash
from prefixstore.base.keys import Prefix
from prefixstore.engine.api import Engine
from prefixstore.fuzz.driver import compaction_policy
from prefixstore.fuzz.faultfs import CountingHook, CrashAt, FaultFS, FaultPlan, FaultRule, Injected
from prefixstore.gpu.fileio import FaultHook

CAP = 16 << 20
CONV = tokens_for(60, 12)
OTHER = tokens_for(61, 4)
KINDS = ["store", "refill", "evict", "retire"] + (["compact"] if hasattr(Engine, "compact") else [])


class NthEffect(FaultPlan):
    """Fails the nth effect of any kind on one rank (and every later one if persistent).

    Writes fail with ENOSPC (leaving a short file), everything else with EIO.
    """

    def __init__(self, n: int, persistent: bool, rank: int) -> None:
        super().__init__()
        self.n, self.persistent, self.rank = n, persistent, rank
        self.seen = 0

    def check(self, op: str, target: str, rank: int | None) -> FaultRule | None:
        self.calls[op] += 1
        if not self.enabled or rank != self.rank:
            return None
        self.seen += 1
        if self.seen == self.n or (self.persistent and self.seen > self.n):
            rule = FaultRule(op, "ENOSPC" if op == "write" else "EIO", rank=rank)
            self.injected[f"{op}:{rule.err}"] += 1
            self.log.append(Injected(op, target, rank, rule.err, self.calls[op]))
            return rule
        return None


def _build(root: str, ranks: int, kind: str) -> None:
    """The state before the operation: a 3-node chain and another conversation."""
    with Engine.open(root, make_layout(ranks=ranks), CAP, fs=FaultFS()) as eng:
        for b in (3, 6, 9):
            assert store_tokens(eng, CONV[: b * BT]).status == "stored"
        assert store_tokens(eng, OTHER).status == "stored"
        if kind == "refill":
            node = eng.index.nodes[eng.index.by_key[key_at(OTHER)]]
            os.unlink(os.path.join(root, f"rank{ranks - 1}", f"{node.key.hex()}-g{node.generation}.st"))
            assert eng.restore(eng.lookup(Prefix.from_tokens(OTHER, BT))) is None  # now damaged
        if kind == "retire":  # the leaves are used later than the interior snapshots
            assert_restores(eng, CONV[: 9 * BT], blocks=9)
            assert_restores(eng, OTHER, blocks=4)


def _run_op(eng: Engine, kind: str):
    if kind == "store":
        return store_tokens(eng, CONV)
    if kind == "refill":
        return store_tokens(eng, OTHER)
    if kind == "evict":
        return eng.evict(prefix=Prefix.from_tokens(OTHER, BT))
    if kind == "retire":
        return eng.evict(1)
    return eng.compact(compaction_policy(interior=True))


def _expected(kind: str) -> list[tuple[list[int], int | None]]:
    """(tokens, blocks) that must restore exactly; blocks None: exact bytes or a miss."""
    chain = [(CONV[: 3 * BT], 3), (CONV[: 6 * BT], 6), (CONV[: 9 * BT], 9)]
    if kind == "store":
        return [*chain, (OTHER, 4), (CONV, None)]
    if kind == "refill":
        return [*chain, (OTHER, None)]
    if kind == "evict":
        return [*chain, (OTHER, None)]
    if kind == "retire":  # a failed retirement lets eviction go on to the leaves
        return [(t, None) for t, _ in chain] + [(OTHER, None)]
    # compact: the merged interior checkpoints lose their rows
    return [(CONV[: 3 * BT], None), (CONV[: 6 * BT], None), (CONV[: 9 * BT], 9), (OTHER, 4)]


def _check(eng: Engine, kind: str) -> None:
    rep = eng.audit()
    assert rep.ok, rep.to_dict()
    assert not eng.catalog.journal()
    for tokens, blocks in _expected(kind):
        if blocks is not None or eng.lookup(Prefix.from_tokens(tokens, BT)).hit:
            assert_restores(eng, tokens, blocks=blocks)
    if kind == "refill":  # refilled, or still damaged: never served stale or wrong
        m = eng.lookup(Prefix.from_tokens(OTHER, BT))
        assert m.hit or m.outcome == "damaged", m


def _reopen_and_check(root: str, ranks: int, kind: str) -> None:
    with Engine.open(root, make_layout(ranks=ranks), CAP, fs=FaultFS()) as eng:
        _check(eng, kind)


def _outcome_holds(eng: Engine, kind: str, result) -> None:
    """When the operation reports success, its effect is there."""
    if kind == "store" and result.ok:
        assert_restores(eng, CONV, blocks=12)
    if kind == "refill" and result.ok:
        assert_restores(eng, OTHER, blocks=4)
    if kind == "evict" and result:
        assert key_at(OTHER) not in eng.index.by_key


def _shm_dir(fallback) -> str:
    """A directory in /dev/shm when there is one (the catalog's fsyncs cost nothing)."""
    if os.access("/dev/shm", os.W_OK):
        return tempfile.mkdtemp(prefix="prefixstore-loops-", dir="/dev/shm")
    return str(fallback)


@pytest.fixture
def tmp_path(tmp_path):  # noqa: F811 - shadows pytest's, in this module only
    d = _shm_dir(tmp_path)
    yield pathlib.Path(d)
    if d != str(tmp_path):
        shutil.rmtree(d, ignore_errors=True)


@pytest.fixture(scope="module")
def templates(tmp_path_factory):
    """One built directory per (ranks, kind), copied for every run."""
    base = pathlib.Path(_shm_dir(tmp_path_factory.mktemp("fault-loop-templates")))
    cache: dict[tuple[int, str], str] = {}

    def get(ranks: int, kind: str) -> str:
        if (ranks, kind) not in cache:
            root = str(base / f"{kind}-{ranks}")
            _build(root, ranks, kind)
            cache[(ranks, kind)] = root
        return cache[(ranks, kind)]

    yield get
    shutil.rmtree(base, ignore_errors=True)


def _fresh(templates, tmp_path, ranks: int, kind: str, name: str) -> str:
    root = str(tmp_path / name)
    shutil.copytree(templates(ranks, kind), root)
    return root


def test_scenarios_do_what_they_say(templates, tmp_path):
    """Fault-free, each operation does its transaction (so the loops test something)."""
    for kind in KINDS:
        root = _fresh(templates, tmp_path, 2, kind, kind)
        with Engine.open(root, make_layout(ranks=2), CAP, fs=FaultFS()) as eng:
            result = _run_op(eng, kind)
            tally = eng.counters.snapshot()
            if kind == "store":
                assert result.status == "stored"
            elif kind == "refill":
                assert result.status == "refilled"
            elif kind == "evict":
                assert result > 0 and key_at(OTHER) not in eng.index.by_key
            elif kind == "retire":
                assert tally.get("evictions.retire_snapshot", 0) == 1, tally
                assert tally.get("evictions.evict", 0) == 0, tally
            else:
                assert result.merges == 1, result
            _check(eng, kind)


@pytest.mark.parametrize("ranks", [1, 2, 4])
@pytest.mark.parametrize("kind", KINDS)
def test_fail_effect_n_until_the_operation_completes(templates, tmp_path, ranks, kind):
    L = make_layout(ranks=ranks)
    for persistent in (False, True):
        for lane in range(ranks):
            n = 1
            while True:
                root = _fresh(templates, tmp_path, ranks, kind, f"{persistent}-{lane}-{n}")
                plan = NthEffect(n, persistent, lane)
                with plan.paused():  # count the operation's effects only
                    eng = Engine.open(root, L, CAP, fs=FaultFS(plan))
                result = _run_op(eng, kind)
                fired = plan.total_injected
                with plan.paused():
                    _check(eng, kind)
                    _outcome_holds(eng, kind, result)
                eng.close()
                _reopen_and_check(root, ranks, kind)
                shutil.rmtree(root)
                if not fired:
                    break  # effect n does not exist: the operation completed unharmed
                n += 1
                assert n < 200, "the operation never completes"
            assert n > 1, f"no effect on rank {lane} failed"


def _crash_op(root: str, ranks: int, kind: str, spec: tuple) -> CrashAt:
    """Run the operation with a crash at ``spec`` = (lane, point); the engine dies."""
    lane, point = spec
    hook = CrashAt(point, ops={"commit"}) if lane == "commit" else CrashAt(point, rank=lane)
    gate = _Armed(hook)
    eng = Engine.open(root, make_layout(ranks=ranks), CAP, fs=FaultFS(), hook=gate)
    gate.armed = True
    with contextlib.suppress(SimulatedCrash):
        _run_op(eng, kind)
    if not eng.guard.closed:
        eng.close()
    return hook


class _Armed(FaultHook):
    """Forwards to ``inner`` once ``armed`` (the open before the operation is not counted)."""

    def __init__(self, inner) -> None:
        self.inner, self.armed = inner, False

    def before(self, op, target, rank):
        if self.armed:
            self.inner.before(op, target, rank)

    def after(self, op, target, rank):
        if self.armed:
            self.inner.after(op, target, rank)


# Where each operation is crashed before recovery is tested: after its first commit
# (its intent, or the evict's removal) and, for those that write, after rank 0's rename.
CRASH_SPECS = [("commit", 1), (0, 5)]


def _crashed(templates, tmp_path, ranks, kind, spec, name) -> str | None:
    root = _fresh(templates, tmp_path, ranks, kind, name)
    if _crash_op(root, ranks, kind, spec).fired is None:
        return None
    return root


@pytest.mark.parametrize("ranks", [1, 2])
@pytest.mark.parametrize("kind", KINDS)
def test_crash_at_every_point_of_recovery(templates, tmp_path, ranks, kind):
    L = make_layout(ranks=ranks)
    tested = 0
    for spec in CRASH_SPECS:
        root = _crashed(templates, tmp_path, ranks, kind, spec, f"count-{spec[0]}")
        if root is None:
            continue  # this operation has no such point (an evict writes nothing)
        counter = CountingHook()
        Engine.open(root, L, CAP, fs=FaultFS(), hook=counter).close()
        for j in range(counter.count):
            root = _crashed(templates, tmp_path, ranks, kind, spec, f"{spec[0]}-{j}")
            hook = CrashAt(j)
            with contextlib.suppress(SimulatedCrash):
                Engine.open(root, L, CAP, fs=FaultFS(), hook=hook).close()
            assert hook.fired is not None, f"recovery point {j} not reached"
            _reopen_and_check(root, ranks, kind)
            shutil.rmtree(root)
            tested += 1
    assert tested > 0


@pytest.mark.parametrize("ranks", [1, 2])
@pytest.mark.parametrize("kind", KINDS)
def test_fail_recovery_effect_n_until_recovery_completes(templates, tmp_path, ranks, kind):
    L = make_layout(ranks=ranks)
    tested = 0
    for spec in CRASH_SPECS:
        for persistent in (False, True):
            for lane in range(ranks):
                n = 1
                while True:
                    root = _crashed(templates, tmp_path, ranks, kind, spec, f"{spec[0]}-{persistent}-{lane}-{n}")
                    if root is None:
                        break
                    plan = NthEffect(n, persistent, lane)
                    try:
                        Engine.open(root, L, CAP, fs=FaultFS(plan)).close()
                    except OSError:
                        assert plan.total_injected  # only an injected fault may fail the open
                    fired = plan.total_injected
                    _reopen_and_check(root, ranks, kind)
                    shutil.rmtree(root)
                    tested += 1
                    if not fired:
                        break
                    n += 1
                    assert n < 200, "recovery never completes"
    assert tested > 0
