"""Counters (DESIGN.md section 6): Prometheus metrics, a stats() snapshot, log events."""

from __future__ import annotations

import logging
import os
import sys
import threading
from collections import Counter as _Tally
from typing import Any

import structlog
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

# The library's own structured log: to stderr, WARNING and above unless
# PREFIXSTORE_LOG_LEVEL says otherwise (e.g. INFO for every restore decision).
# An embedding server can rebind ``prefixstore.engine.counters.log``.
_LEVEL = getattr(logging, os.environ.get("PREFIXSTORE_LOG_LEVEL", "WARNING").upper(), logging.WARNING)
log = structlog.wrap_logger(
    structlog.PrintLogger(file=sys.stderr),
    wrapper_class=structlog.make_filtering_bound_logger(_LEVEL),
    processors=[structlog.processors.add_log_level, structlog.processors.TimeStamper(fmt="iso"),
                structlog.processors.KeyValueRenderer(key_order=["event"])],
    logger_name="prefixstore",
)

LOOKUP_OUTCOMES = ("hit", "gpu_resident", "miss", "rejected_cost", "damaged")


class Counters:
    """Every counter the engine keeps, mirrored into a Prometheus registry.

    Mount ``counters.registry`` in the embedding server (e.g. with
    ``prometheus_client.make_wsgi_app(registry)``).
    """

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self._lock = threading.Lock()
        self.tally: _Tally[str] = _Tally()
        self.last_decision: dict[str, Any] | None = None
        self.lookups = Counter("prefixstore_lookups", "Lookup outcomes", ["outcome"], registry=r)
        self.stores = Counter("prefixstore_stores", "Store results", ["result"], registry=r)
        self.skips = Counter("prefixstore_store_skips", "Stores skipped, by reason", ["reason"], registry=r)
        self.retries = Counter("prefixstore_store_retries", "Refused-store retries", ["event"], registry=r)
        self.refills = Counter("prefixstore_row_refills", "Damaged rows refilled by a later store", registry=r)
        self.evictions = Counter("prefixstore_evictions", "Eviction victims by action", ["action"], registry=r)
        self.faults = Counter("prefixstore_io_errors", "I/O errors seen by effect", ["op"], registry=r)
        self.replaces = Counter("prefixstore_compactions", "Compact-replace transactions by use", ["use"], registry=r)
        self.bytes = Gauge("prefixstore_bytes", "Backing bytes by kind", ["kind"], registry=r)
        self.transfer_s = Histogram(
            "prefixstore_restore_estimated_transfer_seconds", "Estimated restore transfer time",
            registry=r, buckets=(0.001, 0.01, 0.1, 0.5, 1, 2, 5, 10, 30, 60),
        )
        self.prefill_s = Histogram(
            "prefixstore_restore_estimated_prefill_seconds", "Estimated prefill time saved",
            registry=r, buckets=(0.001, 0.01, 0.1, 0.5, 1, 2, 5, 10, 30, 60),
        )

    def inc(self, family: str, label: str | None = None, n: int = 1) -> None:
        metric = getattr(self, family)
        (metric.labels(label) if label is not None else metric).inc(n)
        with self._lock:
            self.tally[f"{family}.{label}" if label is not None else family] += n

    def decision(self, **fields: Any) -> None:
        for end_tokens, transfer, saved in fields.get("estimates", ()):
            del end_tokens
            self.transfer_s.observe(transfer)
            self.prefill_s.observe(saved)
        with self._lock:
            self.last_decision = fields
        log.info("restore_decision", **fields)

    def set_bytes(self, **kinds: int) -> None:
        for k, v in kinds.items():
            self.bytes.labels(k).set(v)

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return dict(self.tally)
