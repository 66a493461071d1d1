"""Crash at every effect of each compact-replace use, enumerated, on 1, 2 and 4 ranks.

Uses: merge (a single-child chain into its endpoint), split (a checkpoint stored inside
a span), republish (a merged endpoint given a snapshot by a store), refill (a damaged
row republished from a store's rows) and snapshot retirement (eviction's use). Each
point is crossed before the effect and after it. After each crash the directory is
reopened: the audit is clean, the journal empty, the catalog holds exactly the old
rows or exactly the new ones (never a mix), and every checkpoint restores the same
bytes it did before.
"""

from __future__ import annotations

import contextlib
import os
import shutil

import pytest
from conftest import (
    BT,
    Gate,
    assert_restores,
    make_layout,
    node_at,
    seg_tensors,
    snap_tensors,
    store_tokens,
    tokens_for,
)

from prefixstore.base.errors import SimulatedCrash
from prefixstore.base.keys import ROOT, Prefix
from prefixstore.engine import health, journal, replace
from prefixstore.engine.api import Engine
from prefixstore.fuzz.faultfs import CountingHook, CrashAt, FaultFS
from prefixstore.statemachine.compaction import CompactionPolicy

CAP = 16 << 20
CONV = tokens_for(40, 12)  # one conversation: checkpoints at blocks 3, 6, 9, 12
OTHER = tokens_for(41, 4)
USES = ["merge", "split", "republish", "refill", "retire"]


def rows(eng: Engine, among: frozenset | None = None) -> frozenset:
    """The catalog's rows as (key, parent key, start, end, has_snapshot, state);
    with ``among``, only those whose key is one of ``among``'s."""
    keys = {i: bytes(k) for i, k in eng.catalog.query("SELECT id, key FROM nodes")}
    out = frozenset(
        (bytes(k), keys[p] if p is not None else ROOT, s, e, bool(h), st)
        for k, p, s, e, h, st in eng.catalog.query(
            "SELECT key, parent, start_block, end_block, has_snapshot, state FROM nodes"
        )
    )
    if among is not None:
        wanted = {r[0] for r in among}
        out = frozenset(r for r in out if r[0] in wanted)
    return out


def _retire(eng: Engine, *ends: int) -> None:
    with eng.guard.lock:
        for b in ends:
            assert replace.retire_snapshot(eng.flows.replacing, node_at(eng, CONV[: b * BT]))


def _acked(use: str) -> list[tuple[list[int], int | None]]:
    """Checkpoints that restore the same bytes before and after ``use``: (tokens, blocks)."""
    if use == "refill":
        return [(OTHER, 4)]  # the conversation sits below the damaged row
    acked = [(CONV, 12), (OTHER, 4)]
    if use == "merge":
        acked.append((CONV[: 7 * BT], None))  # inside the chain, no snapshot: a miss either way
    elif use == "split":
        acked += [(CONV[: 3 * BT], 3), (CONV[: 6 * BT], 6), (CONV[: 9 * BT], 9)]
    elif use == "retire":  # the snapshot at block 6 goes: a lookup there hits it or its parent
        acked += [(CONV[: 3 * BT], 3), (CONV[: 6 * BT], None), (CONV[: 9 * BT], 9)]
    return acked


def _prepare(root: str, ranks: int, use: str) -> None:
    """Build the old rows of ``use`` in ``root`` (unhooked) and close the engine."""
    with Engine.open(root, make_layout(ranks=ranks), CAP, fs=FaultFS()) as eng:
        for b in (3, 6, 9, 12):
            assert store_tokens(eng, CONV[: b * BT]).ok
        assert store_tokens(eng, OTHER).ok
        if use in ("merge", "republish"):
            _retire(eng, 3, 6, 9)
        if use == "republish":  # rows (0, 9] without a snapshot, then (9, 12]
            assert eng.compact(CompactionPolicy(max_merge_rows=3)).merges == 1
        if use == "refill":
            _retire(eng, 3)
            node = node_at(eng, CONV[: 3 * BT])
            os.unlink(os.path.join(root, "rank0", f"{node.key.hex()}-g{node.generation}.st"))
            with eng.guard.lock:
                health.invalidate(eng.flows.health, node, "test damage")


def _scenario(root: str, ranks: int, hook, use: str, template: str | None = None):
    """Copy the old rows from ``template`` (or build them), then run ``use`` with
    ``hook`` armed.

    Returns (layout, checkpoints that must restore as (tokens, blocks), old rows, new
    rows (None after a crash), the operation's result). For a refill the rows compared
    are the old rows' keys (the store then adds its own node in a second transaction).
    """
    if template is None:
        _prepare(root, ranks, use)
    else:
        shutil.copytree(template, root)
    L = make_layout(ranks=ranks)
    gate = Gate()
    eng = Engine.open(root, L, CAP, hook=gate, fs=FaultFS())  # durability simulated: no real fsync
    acked = _acked(use)
    for t, blocks in acked:
        _restores(eng, t, blocks)
    old = rows(eng)
    gate.arm(hook)
    result = None
    try:
        if use == "merge":
            result = eng.compact(CompactionPolicy())
        elif use == "split":
            result = store_tokens(eng, CONV[: 5 * BT])
        elif use == "republish":
            t = CONV[: 9 * BT]
            segs = [{k: v[8 * BT :] for k, v in s.items()} for s in seg_tensors(L, t)]
            result = eng.store(Prefix.from_tokens(t, BT), segs, snap_tensors(L, t), tokens_from=8 * BT)
        elif use == "refill":
            result = store_tokens(eng, CONV[: 6 * BT] + tokens_for(42, 2))  # covers the damaged row
        else:
            with eng.guard, eng.guard.lock:
                result = replace.retire_snapshot(eng.flows.replacing, node_at(eng, CONV[: 6 * BT]))
    except SimulatedCrash:
        pass
    gate.disarm()
    new = None if eng.guard.closed else rows(eng, old if use == "refill" else None)
    if not eng.guard.closed:
        eng.close()
    return L, acked, old, new, result


def _restores(eng: Engine, tokens: list[int], blocks: int | None) -> None:
    """``tokens`` restores the expected bytes (at ``blocks``; None: a miss or any hit)."""
    if blocks is not None or eng.lookup(Prefix.from_tokens(tokens, BT)).hit:
        assert_restores(eng, tokens, blocks=blocks)


def _check(root, L, acked, old, new, use) -> bool:
    """Recover ``root``; True when it holds the new rows, False when the old ones."""
    with Engine.open(root, L, CAP, fs=FaultFS()) as eng:
        rep = eng.audit()
        assert rep.ok, rep.to_dict()
        assert not eng.catalog.journal()
        now = rows(eng, old if use == "refill" else None)
        assert now in (old, new), f"{use}: a mix of old and new rows"
        for t, blocks in acked:
            _restores(eng, t, blocks)
        if now == new and use == "split":
            assert_restores(eng, CONV[: 5 * BT], blocks=5)
        if now == new and use == "republish":
            assert_restores(eng, CONV[: 9 * BT], blocks=9)
        if use == "refill":
            m = eng.lookup(Prefix.from_tokens(CONV, BT))
            if now == new:
                assert_restores(eng, CONV, blocks=12)
            else:
                assert m.outcome == "damaged", m
        return now == new


@pytest.mark.parametrize("ranks", [1, 2, 4])
@pytest.mark.parametrize("use", USES)
def test_crash_at_every_effect_of_a_compact_replace(tmp_path, ranks, use):
    template = str(tmp_path / "template")
    _prepare(template, ranks, use)
    counter = CountingHook()
    L, acked, old, new, _ = _scenario(str(tmp_path / "count"), ranks, counter, use, template)
    assert new is not None and new != old, f"{use} changed nothing"
    ops = {op for _, op, _, _ in counter.points}
    assert {"write", "fsync", "rename", "fsync_dir", "commit"} <= ops, ops
    assert "unlink" in ops or (use, ranks) == ("refill", 1), ops  # its one old shard is gone
    outcomes = set()
    for i in range(counter.count):
        root = str(tmp_path / f"c{i}")
        hook = CrashAt(i)
        _, _, old_i, _, _ = _scenario(root, ranks, hook, use, template)
        assert hook.fired is not None, f"point {i} not reached"
        assert old_i == old
        outcomes.add(_check(root, L, acked, old, new, use))
    assert outcomes == {False, True}, "crashes must land on both sides of the swap"


@pytest.mark.parametrize("side", ["before_swap", "after_swap"])
def test_crash_during_recovery_of_a_compaction_is_recovered(tmp_path, side):
    """Crash a merge on either side of its swap, then crash recovery at each of its
    points in turn; the next open still ends with exactly the old or the new rows."""
    template = str(tmp_path / "template")
    _prepare(template, 2, "merge")
    counter = CountingHook()
    L, acked, old, new, _ = _scenario(str(tmp_path / "count"), 2, counter, "merge", template)
    publish = next(i for i, (w, op, t, _) in enumerate(counter.points)
                   if (w, op, t) == ("after", "commit", "compact.publish"))
    first = publish - 3 if side == "before_swap" else publish + 2
    n = 0
    while True:
        root = str(tmp_path / f"r{n}")
        _scenario(root, 2, CrashAt(first), "merge", template)
        hook = CrashAt(n)
        with contextlib.suppress(SimulatedCrash):
            Engine.open(root, L, CAP, hook=hook, fs=FaultFS()).close()
        assert _check(root, L, acked, old, new, "merge") == (side == "after_swap")
        if hook.fired is None:
            break
        n += 1
    assert n >= 3


def test_a_planted_non_atomic_swap_is_caught(tmp_path, monkeypatch):
    """The enumeration above is strong enough to catch a swap that frees the old
    generation before its commit (a crash in between loses committed data)."""
    real = replace._swap

    def unlink_first(eng, job, tid):
        rows = [(r, name, size) for n in job.old for r, (name, size, _) in eng.catalog.live_file_rows(n.id).items()]
        journal.unlink_rows(eng.ledger, rows)  # BUG: the old generation goes before the swap is committed
        return real(eng, job, tid)

    monkeypatch.setattr(replace, "_swap", unlink_first)
    template = str(tmp_path / "template")
    _prepare(template, 1, "merge")
    counter = CountingHook()
    L, acked, old, new, _ = _scenario(str(tmp_path / "count"), 1, counter, "merge", template)
    caught = []
    for i in range(counter.count):
        root = str(tmp_path / f"c{i}")
        _scenario(root, 1, CrashAt(i), "merge", template)
        try:
            _check(root, L, acked, old, new, "merge")
        except AssertionError as exc:
            caught.append(str(exc))
    assert caught, "the planted bug went unnoticed"
