"""Lookup outcomes are counted exactly under concurrency, in ``stats()`` and in the
Prometheus export (read from the tally at scrape time)."""

from __future__ import annotations

import logging
import sys
import threading

import pytest
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


def test_decisions_export_as_prometheus_would_count_them_from_threads() -> None:
    """Decisions are tallied under the counters' lock and exported at scrape time: the
    counts, buckets (``le`` inclusive, bounds hit exactly), counts and sums equal a
    Prometheus ``Histogram`` fed the same values, and none is lost across threads."""
    from prometheus_client import CollectorRegistry, Histogram

    from prefixstore.engine import counters as counters_mod

    values = [0.0, 0.0005, 0.001, 0.0011, 0.5, 0.75, 2.0, 119.0, 120.0, 1e6]
    c = Counters()
    ref_reg = CollectorRegistry()
    ref = Histogram("ref_transfer_seconds", "reference", registry=ref_reg, buckets=counters_mod._SECONDS)

    def work(i: int) -> None:
        for k in range(PER_THREAD):
            v = values[(i + k) % len(values)]
            c.decision(result="deepest" if k % 2 else "rejected", transfer_s=v, prefill_s=2 * v, key=str(i))

    _run_threads(work)
    for i in range(THREADS):
        for k in range(PER_THREAD):
            ref.observe(values[(i + k) % len(values)])
    n = THREADS * PER_THREAD
    reg = c.registry
    assert reg.get_sample_value("prefixstore_restore_decisions_total", {"result": "deepest"}) == n // 2
    assert reg.get_sample_value("prefixstore_restore_decisions_total", {"result": "rejected"}) == n // 2
    assert c.snapshot()["decisions.deepest"] == n // 2
    name = "prefixstore_restore_estimated_transfer_seconds"
    for le in [*(str(float(b)) for b in counters_mod._SECONDS), "+Inf"]:
        want = ref_reg.get_sample_value("ref_transfer_seconds_bucket", {"le": le})
        assert reg.get_sample_value(f"{name}_bucket", {"le": le}) == want, le
    assert reg.get_sample_value(f"{name}_count") == n
    assert reg.get_sample_value(f"{name}_sum") == pytest.approx(ref_reg.get_sample_value("ref_transfer_seconds_sum"))
    assert reg.get_sample_value("prefixstore_restore_estimated_prefill_seconds_sum") == pytest.approx(
        2 * ref_reg.get_sample_value("ref_transfer_seconds_sum"))
    assert c.snapshot()["decisions.transfer_s"] == pytest.approx(ref_reg.get_sample_value("ref_transfer_seconds_sum"))


class _Recorder:
    """A log target that records events and cannot say which levels it takes."""

    level: int | None = None

    def __init__(self) -> None:
        self.events: list = []

    def info(self, event: str, **kv) -> None:
        assert self.level is None or self.level <= logging.INFO, "info called on a target that drops it"
        self.events.append((event, kv))


class _LevelRecorder(_Recorder):
    """The same, taking ``level`` and above, and saying so (as structlog's loggers do)."""

    def __init__(self, level: int) -> None:
        super().__init__()
        self.level = level

    def is_enabled_for(self, level: int) -> bool:
        return level >= self.level


@pytest.mark.parametrize("level", [None, logging.DEBUG, logging.WARNING])
def test_a_decision_is_logged_unless_the_log_drops_info(level) -> None:
    from prefixstore.base import log as logmod

    c = Counters()
    rec = _Recorder() if level is None else _LevelRecorder(level)
    with logmod.using(rec):
        c.decision(result="shallower", transfer_s=0.25, prefill_s=0.5, key="abc", estimates=[[8, 0.9, 0.5]])
    want = {"result": "shallower", "transfer_s": 0.25, "prefill_s": 0.5, "key": "abc", "estimates": [[8, 0.9, 0.5]]}
    assert c.last_decision == want  # recorded whatever the log takes
    assert rec.events == ([] if level == logging.WARNING else [("restore_decision", want)])
