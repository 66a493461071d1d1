"""An unexpected (non-OSError) error after a compact-replace published must not strand
its transaction: it is finished forward, its old files reclaimed (DESIGN 'Garbage')."""

from __future__ import annotations

import contextlib

from conftest import (
    BT,
    BugAtFirstUnlink,
    Gate,
    assert_restores,
    make_layout,
    node_at,
    store_tokens,
    tokens_for,
)

from prefixstore.engine.api import Engine

CAP = 16 << 20


def test_unexpected_error_after_snapshot_retirement_publish_ends_its_transaction(cache_dir):
    L = make_layout()
    gate = Gate()
    eng = Engine.open(cache_dir, L, CAP, hook=gate)
    try:
        a = tokens_for(1, 6)
        assert store_tokens(eng, a[: 4 * BT]).status == "stored"
        assert store_tokens(eng, a).status == "stored"  # (0,4] is now a compactable ancestor
        n = node_at(eng, a[: 4 * BT])
        assert n.has_snapshot
        bug = BugAtFirstUnlink()  # at the cleanup after the publish
        gate.arm(bug)
        with contextlib.suppress(RuntimeError):
            eng.evict(1)  # policy 'prefixstore': retires (0,4]'s snapshot (a compact-replace)
        gate.disarm()
        assert bug.fired, "setup: the retirement's cleanup never unlinked"
        eng.reclaim()
        st = eng.stats()
        assert not eng.catalog.journal(), "a compact transaction is stranded in the running engine"
        assert st["garbage_bytes"] == 0 and st["charged_bytes"] == st["live_bytes"], st
        assert eng.audit().ok
        assert_restores(eng, a, blocks=6)
    finally:
        gate.disarm()
        eng.close()
