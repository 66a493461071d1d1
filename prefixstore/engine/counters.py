"""Counters (DESIGN.md section 6): Prometheus metrics, a stats() snapshot, log events.

Families (``stats()["counters"]`` keys are ``family.label``): ``lookups`` (outcome),
``stores`` (result), ``skips`` (reason), ``retries`` (queued, succeeded, dropped,
superseded, abandoned, overflow), ``refills``, ``evictions`` and ``evicted_bytes``
(action: evict, retire_snapshot, evict_subtree, garbage; bytes actually freed),
``decisions`` (deepest, shallower, rejected) with the estimated transfer and prefill
seconds behind each (histograms; sums in ``stats()``), ``faults`` (op), ``replaces``
(use), ``degraded`` (opened_without, lookup_missed, revived: the ranks an engine
opened without, ``engine/degraded.py``). Gauges: ``prefixstore_bytes`` (refreshed by
``stats()``), ``prefixstore_state`` (live values read at scrape time, see ``watch``)
and ``prefixstore_rank_down`` (rank: 1 while the engine runs without it).

``lookups`` (one per lookup, the request path) and ``decisions`` with its two
histograms (one per lookup the cost rule decides) are exported from tallies at scrape
time (``TallyCounter``, ``TallyHistogram``): a decision is one lock and a few updates
instead of a Prometheus child's lock and two histograms' on top. ``Engine.lookup``
counts its outcome in ``looked``, a tally of its own changed only under the engine lock,
which the lookup holds anyway: one dict update per lookup and no lock of its own, still
exact. Other ``lookups`` labels (a restore's stale or damaged match) go through ``inc``
and the counters' lock.
"""

from __future__ import annotations

import bisect
import logging
import math
import threading
from collections import Counter as _Tally
from collections.abc import Callable
from typing import Any

import attrs
from prometheus_client import CollectorRegistry, Counter, Gauge
from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily
from prometheus_client.utils import floatToGoString

from prefixstore.base.log import log

LOOKUP_OUTCOMES = ("hit", "gpu_resident", "miss", "rejected_cost", "damaged")
_SECONDS = (0.001, 0.01, 0.1, 0.5, 1, 2, 5, 10, 20, 30, 60, 120)


@attrs.frozen(slots=True, eq=False)
class TallyCounter:
    """A labelled Prometheus counter whose values are read from ``Counters.tally`` at
    scrape time (entries ``family.label``): incrementing it is the tally's update alone."""

    counters: Counters = attrs.field(repr=False)
    family: str
    name: str
    doc: str
    label: str

    def collect(self) -> list[CounterMetricFamily]:
        metric = CounterMetricFamily(self.name, self.doc, labels=[self.label])
        head = self.family + "."
        for key, value in sorted(self.counters.tallies().items()):
            if key.startswith(head):
                metric.add_metric([key[len(head):]], value)
        return [metric]


@attrs.define(slots=True, eq=False)
class TallyHistogram:
    """A Prometheus histogram whose bucket counts and sum change under the counters'
    lock (``add``, the caller holding it) and are exported at scrape time."""

    counters: Counters = attrs.field(repr=False)
    name: str
    doc: str
    bounds: tuple[float, ...]
    """Upper bounds (``le``), ascending, without +Inf."""
    counts: list[int] = attrs.field(init=False)
    """Observations per bucket (not cumulative); the last is above every bound."""
    total: float = 0.0

    def __attrs_post_init__(self) -> None:
        self.counts = [0] * (len(self.bounds) + 1)

    def add(self, value: float) -> None:
        """One observation (``value <= bound`` counts in that bound's bucket). Counters' lock held."""
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.total += value

    def collect(self) -> list[HistogramMetricFamily]:
        counts, total = self.counters.read(lambda: (list(self.counts), self.total))
        cumulative, acc = [], 0
        for bound, n in zip((*self.bounds, math.inf), counts, strict=True):
            acc += n
            cumulative.append((floatToGoString(bound), acc))
        return [HistogramMetricFamily(self.name, self.doc, buckets=cumulative, sum_value=total)]


@attrs.define(slots=True, eq=False, init=False, repr=False)
class Counters:
    """Every counter the engine keeps, mirrored into a Prometheus registry.

    Mount ``counters.registry`` in the embedding server (e.g. with
    ``prometheus_client.make_wsgi_app(registry)``). Safe from any thread: the
    tallies and the last decision change under the counters' own lock, never the
    engine's; ``looked`` alone changes under the engine lock (``Engine.lookup``
    holds it), never the counters'.
    """

    registry: CollectorRegistry
    tally: _Tally[str]
    seconds: _Tally[str]
    """Sums of estimated seconds, for ``stats()``."""
    last_decision: dict[str, Any] | None
    looked: _Tally[str]
    """Lookup outcomes counted by ``Engine.lookup``: changed only under the engine lock."""
    lookups: TallyCounter
    stores: Counter
    skips: Counter
    retries: Counter
    refills: Counter
    evictions: Counter
    faults: Counter
    replaces: Counter
    evicted_bytes: Counter
    decisions: TallyCounter
    remote: Counter
    degraded: Counter
    bytes: Gauge
    rank_down: Gauge
    state: Gauge
    transfer_s: TallyHistogram
    prefill_s: TallyHistogram
    _lock: threading.Lock
    _children: dict[tuple[str, str | None], tuple[Any, str]]
    _live: dict[str, Callable[[], float]]

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self._lock = threading.Lock()
        self.tally: _Tally[str] = _Tally()
        self.seconds: _Tally[str] = _Tally()  # sums of estimated seconds, for stats()
        self.last_decision: dict[str, Any] | None = None
        self.looked: _Tally[str] = _Tally()
        self._children: dict[tuple[str, str | None], tuple[Any, str]] = {}
        self._live: dict[str, Callable[[], float]] = {}
        self.lookups = TallyCounter(self, "lookups", "prefixstore_lookups", "Lookup outcomes", "outcome")
        r.register(self.lookups)
        self.stores = Counter("prefixstore_stores", "Store results", ["result"], registry=r)
        self.skips = Counter("prefixstore_store_skips", "Stores skipped, by reason", ["reason"], registry=r)
        self.retries = Counter("prefixstore_store_retries", "Refused-store retries", ["event"], registry=r)
        self.refills = Counter("prefixstore_row_refills", "Damaged rows refilled by a later store", registry=r)
        self.evictions = Counter("prefixstore_evictions", "Eviction victims by action", ["action"], registry=r)
        self.faults = Counter("prefixstore_io_errors", "I/O errors seen by effect", ["op"], registry=r)
        self.replaces = Counter("prefixstore_compactions", "Compact-replace transactions by use", ["use"], registry=r)
        self.evicted_bytes = Counter(
            "prefixstore_evicted_bytes", "Backing bytes actually freed by eviction, by action", ["action"],
            registry=r,
        )
        self.decisions = TallyCounter(self, "decisions", "prefixstore_restore_decisions",
                                      "Restore decisions: deepest, shallower or rejected", "result")
        r.register(self.decisions)
        self.remote = Counter(
            "prefixstore_remote_restores", "Remote-tier matches: restored, missed, kept_local, rejected_cost",
            ["result"], registry=r,
        )
        self.degraded = Counter(
            "prefixstore_degraded", "Ranks down since open: ranks opened without, lookups missed, ranks revived",
            ["event"], registry=r,
        )
        self.rank_down = Gauge("prefixstore_rank_down", "1 while the engine runs without this rank", ["rank"],
                               registry=r)
        self.bytes = Gauge("prefixstore_bytes", "Backing bytes by kind", ["kind"], registry=r)
        self.state = Gauge("prefixstore_state", "Engine state by kind (live values)", ["kind"], registry=r)
        self.transfer_s = TallyHistogram(
            self, "prefixstore_restore_estimated_transfer_seconds",
            "Estimated restore transfer time behind each decision (chosen, or deepest rejected)", _SECONDS)
        self.prefill_s = TallyHistogram(
            self, "prefixstore_restore_estimated_prefill_seconds",
            "Estimated prefill time saved behind each decision (chosen, or deepest rejected)", _SECONDS)
        r.register(self.transfer_s)
        r.register(self.prefill_s)

    def inc(self, family: str, label: str | None = None, n: int = 1) -> None:
        got = self._children.get((family, label))
        if got is None:  # first use of this series: resolve its child and tally name once
            metric = getattr(self, family)
            child = None if isinstance(metric, TallyCounter) else metric.labels(label) if label is not None else metric
            got = (child, f"{family}.{label}" if label is not None else family)
            self._children[(family, label)] = got
        if got[0] is not None:
            got[0].inc(n)
        with self._lock:
            self.tally[got[1]] += n

    def evicted(self, action: str, freed: int) -> None:
        """One eviction victim and the bytes it really freed (a retirement: old - new)."""
        self.inc("evictions", action)
        self.inc("evicted_bytes", action, max(0, freed))

    def decision(self, *, result: str, transfer_s: float, prefill_s: float, **fields: Any) -> None:
        """One restore decision: its result and both estimates behind it.

        ``fields`` (key, tokens, every candidate's estimates) go to ``last_decision``
        and the ``restore_decision`` log event.
        """
        fields["result"], fields["transfer_s"], fields["prefill_s"] = result, transfer_s, prefill_s
        with self._lock:  # everything a decision counts, in one hold
            self.tally["decisions." + result] += 1
            self.transfer_s.add(transfer_s)
            self.prefill_s.add(prefill_s)
            self.last_decision = fields
            seconds = self.seconds
            seconds["decisions.transfer_s"] += transfer_s
            seconds["decisions.prefill_s"] += prefill_s
        if log.enabled(logging.INFO):  # the default log drops INFO: build no event for it
            log.info("restore_decision", **fields)

    def set_bytes(self, **kinds: int) -> None:
        for k, v in kinds.items():
            self.bytes.labels(k).set(v)

    def watch(self, **live: Callable[[], float]) -> None:
        """Expose live values (read at scrape time) as ``prefixstore_state{kind=...}``."""
        for k, fn in live.items():
            self.state.labels(k).set_function(fn)
        self._live.update(live)

    def live(self, kind: str) -> float:
        """The live value ``prefixstore_state{kind}`` reports, read without a scrape (which
        collects every metric of the registry); 0 when nothing watches ``kind``."""
        fn = self._live.get(kind)
        return 0 if fn is None else fn()

    def tallies(self) -> dict[str, int]:
        """The event counts alone (``family.label -> count``), without the seconds sums."""
        with self._lock:
            out = dict(self.tally)
        return self._with_looked(out)

    def _with_looked(self, out: dict[str, Any]) -> dict[str, Any]:
        """``out`` with the lookups ``Engine.lookup`` counted in ``looked`` added."""
        for outcome, n in dict(self.looked).items():  # one C-level copy: no update torn
            key = "lookups." + outcome
            out[key] = out.get(key, 0) + n
        return out

    def read(self, fn: Callable[[], Any]) -> Any:
        """``fn()`` under the counters' lock (a consistent read of what it guards)."""
        with self._lock:
            return fn()

    def snapshot(self) -> dict[str, float]:
        """Every counter as ``family.label -> value`` (plus estimated-seconds sums)."""
        with self._lock:
            out = {**self.tally, **self.seconds}
        return self._with_looked(out)
