"""Lookup outcomes are counted exactly under concurrency, in ``stats()`` and in the
Prometheus export (read from the tally at scrape time)."""

from __future__ import annotations

import sys
import threading

from conftest import make_layout, store_tokens, tokens_for

from prefixstore import Prefix
from prefixstore.engine.api import Engine
from prefixstore.engine.counters import Counters

THREADS, PER_THREAD = 8, 400


def _run_threads(work) -> None:
    start = threading.Barrier(THREADS)

    def worker(i: int) -> None:
        start.wait()
        work(i)

    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # switch threads as often as possible: a lost update shows
    try:
        threads = [threading.Thread(target=worker, args=(i,)) for i in range(THREADS)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        sys.setswitchinterval(old)


def test_concurrent_lookups_are_counted_exactly(cache_dir) -> None:
    L = make_layout(snapshot=False)
    with Engine.open(cache_dir, L, 64 << 20) as eng:
        stored = tokens_for(1, 4)
        assert store_tokens(eng, stored).ok
        hit, miss = Prefix.from_tokens(stored, L.block_tokens), Prefix.from_tokens(tokens_for(2, 4), L.block_tokens)
        assert eng.lookup(hit).hit and eng.lookup(miss).outcome == "miss"
        before = eng.stats()["counters"]

        def work(i: int) -> None:
            for k in range(PER_THREAD):
                eng.lookup(hit if (i + k) % 2 else miss)

        _run_threads(work)
        got = eng.stats()["counters"]
        half = THREADS * PER_THREAD // 2
        assert got["lookups.hit"] - before["lookups.hit"] == half
        assert got["lookups.miss"] - before["lookups.miss"] == half
        reg = eng.counters.registry
        assert reg.get_sample_value("prefixstore_lookups_total", {"outcome": "hit"}) == got["lookups.hit"]
        assert reg.get_sample_value("prefixstore_lookups_total", {"outcome": "miss"}) == got["lookups.miss"]


def test_counter_increments_from_threads_are_exact() -> None:
    c = Counters()

    def work(i: int) -> None:
        for _ in range(PER_THREAD * 5):
            c.inc("lookups", "hit")
            c.inc("stores", "stored")

    _run_threads(work)
    n = THREADS * PER_THREAD * 5
    assert c.snapshot()["lookups.hit"] == n and c.snapshot()["stores.stored"] == n
    assert c.registry.get_sample_value("prefixstore_lookups_total", {"outcome": "hit"}) == n
    assert c.registry.get_sample_value("prefixstore_stores_total", {"result": "stored"}) == n
