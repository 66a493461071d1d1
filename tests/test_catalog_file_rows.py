"""A file-row event names its rows by (rank, name), the files table's key: its work
does not grow with the catalog (counted in SQLite virtual-machine steps, not timed)."""

from __future__ import annotations

from conftest import make_layout, store_tokens, tokens_for

from prefixstore.engine.api import Engine


def steps_to_evict_one(root: str, stored: int) -> int:
    """SQLite VM steps of ``Engine.evict`` of one victim from a cache of ``stored`` nodes."""
    L = make_layout(snapshot=False)
    with Engine.open(root, L, 1 << 30, synchronous="NORMAL") as eng:
        for i in range(stored):
            assert store_tokens(eng, tokens_for(10_000 + i, 1)).ok
        eng.evict(1)  # the first eviction also sweeps for loose garbage
        count = [0]

        def step() -> int:
            count[0] += 1
            return 0

        eng.catalog.conn.set_progress_handler(step, 100)
        try:
            assert eng.evict(1) > 0
        finally:
            eng.catalog.conn.set_progress_handler(None, 0)
        return count[0]


def test_evicting_a_victim_costs_the_same_in_a_catalog_ten_times_larger(tmp_path):
    small = steps_to_evict_one(str(tmp_path / "small"), 40)
    large = steps_to_evict_one(str(tmp_path / "large"), 400)
    assert large < 2 * small + 20, (small, large)
