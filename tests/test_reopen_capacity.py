"""Reopening a cache with a smaller capacity: open evicts by policy down to it (journaled
like any eviction) or refuses with CapacityError; the audit lists a violation once."""

from __future__ import annotations

import pytest
from conftest import FailUnlinks, assert_restores, make_layout, store_tokens, tokens_for

from prefixstore.base import errors as E
from prefixstore.base.keys import Prefix
from prefixstore.engine.api import Engine
from prefixstore.engine.audit import audit_dir

CAP = 16 << 20
CONVS = [tokens_for(100 + i, 6) for i in range(6)]


def _fill(root: str, layout) -> int:
    """Six conversations, the first one used last (so it is the most recent)."""
    with Engine.open(root, layout, CAP) as eng:
        for toks in CONVS:
            assert store_tokens(eng, toks).status == "stored"
        assert_restores(eng, CONVS[0])
        return eng.account.charged


def test_reopen_with_smaller_capacity_evicts_down_to_it(cache_dir):
    L = make_layout(ranks=2, snapshot=False)
    charged = _fill(cache_dir, L)
    cap = charged // 2
    with Engine.open(cache_dir, L, cap) as eng:
        assert eng.account.charged <= cap
        assert eng.counters.snapshot().get("evictions.evict", 0) > 0  # evicted as any eviction
        rep = eng.audit()
        assert rep.ok, rep.violations
        assert not eng.catalog.journal()
        # the policy kept the most recently used conversation
        assert_restores(eng, CONVS[0])
        kept = [t for t in CONVS if eng.lookup(Prefix.from_tokens(t, L.block_tokens)).hit]
        assert 0 < len(kept) < len(CONVS)
        for toks in kept:
            assert_restores(eng, toks)
    # nothing left for a later open or an outside audit to complain about
    assert audit_dir(cache_dir).ok
    with Engine.open(cache_dir, L, cap) as eng:
        assert len(eng.index) == sum(1 for _ in kept)


def test_reopen_that_cannot_reach_the_capacity_refuses_and_releases_the_directory(cache_dir):
    """Evicted files that cannot be unlinked stay charged: open cannot reach the capacity."""
    L = make_layout(ranks=1, snapshot=False)
    _fill(cache_dir, L)
    with pytest.raises(E.CapacityError, match="capacity_bytes=100"):
        Engine.open(cache_dir, L, 100, hook=FailUnlinks())
    # the directory is not held; the evictions committed are finished by the next open
    with Engine.open(cache_dir, L, CAP) as eng:
        rep = eng.audit()
        assert rep.ok, rep.violations
        assert eng.account.charged == rep.accounting["live"]


def test_audit_lists_an_over_capacity_engine_once(cache_dir):
    L = make_layout(ranks=1, snapshot=False)
    with Engine.open(cache_dir, L, CAP) as eng:
        for toks in CONVS[:2]:
            store_tokens(eng, toks)
        # the state a reopen with a smaller capacity used to leave: capacity and its
        # catalog row below the charged bytes
        eng.capacity = eng.account.charged - 1
        with eng.catalog.txn("capacity") as c:
            eng.catalog.set_meta(c, "capacity", str(eng.capacity))
        found = [v for v in eng.audit().violations if v.invariant == 3]
        assert len(found) == 1, found
        assert "exceeds capacity" in found[0].detail
