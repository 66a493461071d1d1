"""Crash at every effect of a store, enumerated (not sampled), on 1, 2 and 4 ranks.

Each point is crossed both before the effect (it never ran) and after it (it ran but
the engine died inside it, e.g. inside the rename). After each crash the directory is
reopened: recovery must leave the audit clean, every store that returned success must
restore bit-identically, and the interrupted store is either wholly there or wholly
absent.
"""

from __future__ import annotations

import contextlib
import os
from collections import Counter

import pytest
from conftest import (
    Gate,
    assert_restores,
    crash_points,
    make_layout,
    node_at,
    store_tokens,
    store_until_crash,
    tokens_for,
)

from prefixstore.base.errors import SimulatedCrash
from prefixstore.base.keys import Prefix
from prefixstore.engine.api import Engine
from prefixstore.fuzz.faultfs import CountingHook, CrashAt

CAP = 16 << 20


def _scenario(root: str, ranks: int, hook, kind: str):
    """Set up two acknowledged checkpoints, then run the store under test with ``hook``
    (and a follow-up store: crash points after its acknowledgement)."""
    L = make_layout(ranks=ranks)
    a, b = tokens_for(10, 6), tokens_for(11, 4)
    gate = Gate()
    eng = Engine.open(root, L, CAP, hook=gate)
    acked = [(a[:8], 2), (b, 4)]
    for t, _ in acked:
        assert store_tokens(eng, t).ok
    if kind == "refill":
        node = node_at(eng, b)
        os.unlink(os.path.join(root, "rank0", f"{node.key.hex()}-g1.st"))
        assert eng.restore(eng.lookup(Prefix.from_tokens(b, 4))) is None  # marks it damaged
        target, acked = b, acked[:1]
    elif kind == "child":
        target = a  # lands below the acknowledged a[:8]
    else:
        target = tokens_for(12, 5)  # a new root child
    result = store_until_crash(eng, gate, hook, target)
    return L, acked, target, result, gate.acked_at


def _check_after_crash(root, L, acked, target, result) -> str:
    """Recover and check; returns which case the interrupted store was in: 'acknowledged'
    (its result came back before the crash), 'published' (no result, but its publish
    committed) or 'absent'."""
    with Engine.open(root, L, CAP) as eng:
        rep = eng.audit()
        assert rep.ok, rep.to_dict()
        for t, blocks in acked:
            assert_restores(eng, t, blocks=blocks)
        m = eng.lookup(Prefix.from_tokens(target, 4))
        if result is not None and result.ok:
            assert_restores(eng, target, blocks=len(target) // 4)
            case = "acknowledged"
        elif m.hit and m.blocks == len(target) // 4:
            assert_restores(eng, target, blocks=len(target) // 4)  # published before the crash
            case = "published"
        else:
            case = "absent"
        assert not eng.catalog.journal()
    return case


@pytest.mark.parametrize("ranks", [1, 2, 4])
@pytest.mark.parametrize("kind", ["new", "child", "refill"])
def test_crash_at_every_effect_of_a_store(tmp_path, ranks, kind):
    counter = CountingHook()
    *_, acked_at = _scenario(str(tmp_path / "count"), ranks, counter, kind)
    ops = {op for _, op, _, _ in counter.points[:acked_at]}
    assert {"write", "fsync", "rename", "fsync_dir", "commit"} <= ops, ops
    assert acked_at >= 2 * (4 * ranks + 2) and counter.count > acked_at
    cases = Counter()
    for i in crash_points(counter.count, acked_at):
        root = str(tmp_path / f"c{i}")
        hook = CrashAt(i)
        L, acked, target, result, _ = _scenario(root, ranks, hook, kind)
        assert hook.fired is not None, f"point {i} not reached"
        assert (result is not None) == (i >= acked_at), (i, acked_at, result)
        cases[_check_after_crash(root, L, acked, target, result)] += 1
    # Each case's check ran: crashes after the acknowledgement, before the publish, after it.
    assert cases["acknowledged"] == 3 and cases["published"] and cases["absent"], cases


@pytest.mark.parametrize("ranks", [1, 2])
def test_crash_during_recovery_is_recovered(tmp_path, ranks):
    """Crash a store, then crash recovery itself at each of its points, then recover."""
    L = make_layout(ranks=ranks)
    for first in (3, 9):
        root = str(tmp_path / f"r{first}")
        L, acked, target, _, _ = _scenario(root, ranks, CrashAt(first), "new")
        counter = CountingHook()
        Engine.open(root, L, CAP, hook=counter).close()  # learns nothing: already recovered
        # Rebuild the crashed state and crash recovery at each point.
        n = 0
        while True:
            root2 = str(tmp_path / f"r{first}-{n}")
            _scenario(root2, ranks, CrashAt(first), "new")
            hook = CrashAt(n)
            with contextlib.suppress(SimulatedCrash):
                Engine.open(root2, L, CAP, hook=hook).close()
            _check_after_crash(root2, L, acked, target, None)
            if hook.fired is None:
                break
            n += 1
        assert n >= 1
