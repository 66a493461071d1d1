"""The remote tier's counters, as a dict and as Prometheus metrics.

Prometheus names (counters end in ``_total`` when exposed):

    prefixstore_remote_lookups, _hits, _misses           deepest() calls and outcomes
    prefixstore_remote_fetches, _fetch_misses             blob reads and failed ones
    prefixstore_remote_bytes_in, _bytes_out               verified bytes read, bytes written
    prefixstore_remote_verify_failures                    manifests or blobs that failed checks
    prefixstore_remote_oversized                          values or replies longer than usable
    prefixstore_remote_timeouts, _errors                  calls past their budget, other failures
    prefixstore_remote_skipped                            calls answered "miss" while down
    prefixstore_remote_writes, _write_retries, _dropped   checkpoints written, retried, given up
    prefixstore_remote_reconnects                         background reconnects that succeeded
    prefixstore_remote_forgotten                          manifests deleted: a blob was evicted
    prefixstore_remote_superseded                         ... not deleted: rewritten since read
    prefixstore_remote_lookup_seconds, _fetch_seconds     time in answered calls (calibration)
    prefixstore_remote_queue_depth, _queue_bytes, _up     gauges
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

COUNTERS = {
    "lookups": "deepest() calls",
    "hits": "Lookups that found a checkpoint",
    "misses": "Lookups that found none (absent, unverifiable, down or past the budget)",
    "fetches": "Blob fetches",
    "fetch_misses": "Fetches that returned no verified bytes",
    "bytes_in": "Verified blob bytes read",
    "bytes_out": "Blob and manifest bytes written",
    "verify_failures": "Manifests or blobs that were truncated, altered, forged or foreign",
    "oversized": "Values refused unread (longer than the call can use, or not a string), "
                 "and replies cut off past the call's byte budget",
    "timeouts": "Calls that ran past their budget",
    "errors": "Calls that failed (connection refused, cluster down, ...)",
    "skipped": "Calls answered as a miss without asking a server that is down",
    "writes": "Checkpoints written",
    "write_retries": "Write attempts that failed and were retried",
    "dropped": "Checkpoints not written (queue full or attempts exhausted)",
    "reconnects": "Background reconnects that succeeded",
    "forgotten": "Manifests deleted because a blob they name was evicted",
    "superseded": "Manifests not deleted after a blob miss: another writer replaced them since they were read",
    "lookup_seconds": "Seconds spent in lookups the server answered",
    "fetch_seconds": "Seconds spent in fetches the server answered (bandwidth: bytes_in / this)",
}
GAUGES = {
    "queue_depth": "Checkpoints waiting in the write-behind queue",
    "queue_bytes": "Bytes waiting in the write-behind queue",
    "up": "1 while the server answers, 0 while it is down",
}
PREFIX = "prefixstore_remote_"


class RemoteStats:
    """Thread-safe counters (ints, but the ``_seconds`` ones); gauges are read from
    ``gauges()`` when asked."""

    def __init__(self, gauges: Callable[[], dict[str, int]]) -> None:
        self._lock = threading.Lock()
        self._counts: dict[str, float] = dict.fromkeys(COUNTERS, 0)
        self._gauges = gauges

    def add(self, name: str, n: float = 1) -> None:
        with self._lock:
            self._counts[name] += n

    def snapshot(self) -> dict[str, float]:
        with self._lock:
            out = dict(self._counts)
        out.update(self._gauges())
        return out


class RemoteCollector:
    """A Prometheus collector reading ``stats()`` at scrape time
    (``registry.register(RemoteCollector(tier.stats))``)."""

    def __init__(self, stats: Callable[[], dict[str, float]]) -> None:
        self._stats = stats

    def collect(self) -> Iterator[CounterMetricFamily | GaugeMetricFamily]:
        s = self._stats()
        for name, doc in COUNTERS.items():
            yield CounterMetricFamily(PREFIX + name, doc, value=s[name])
        for name, doc in GAUGES.items():
            yield GaugeMetricFamily(PREFIX + name, doc, value=s[name])

    def describe(self) -> Iterator[CounterMetricFamily | GaugeMetricFamily]:
        for name, doc in COUNTERS.items():
            yield CounterMetricFamily(PREFIX + name, doc)
        for name, doc in GAUGES.items():
            yield GaugeMetricFamily(PREFIX + name, doc)
