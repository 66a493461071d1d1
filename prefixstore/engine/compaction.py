"""Merging single-child chains, on demand (``Engine.compact``) or in the background.

A pass scans the index once under the engine lock for runs ``n_0 -> ... -> n_k``:
``n_0 .. n_{k-1}`` ready, exactly one child, neither pinned nor fenced, and (with
``keep_interior_checkpoints``) not restore targets: on a snapshot layout, rows whose
snapshot was retired; ``n_k`` ready, neither pinned nor fenced. The pure policy
(``statemachine.compaction``) cuts each run into merges and says which pay. Each merge
is one compact-replace (``engine.replace``): the merged row keeps ``n_k``'s key, id,
snapshot and children; the rows above it disappear, and with them their positions as
checkpoints. Reads and writes run outside the engine lock, so lookups and restores go
on (a restore that pinned the run makes the swap wait, then give up).

The worker (``Engine.open(..., compaction=True)`` or a ``CompactionPolicy``) runs a pass
every ``interval_s`` when the cache changed since the last one. A failed merge fails its
transaction (rolled back, counted as ``replaces{use="merge_aborted"}``), never the worker.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import attrs

from prefixstore.base.errors import EngineClosedError, InvalidInputError, SimulatedCrash
from prefixstore.base.layout import Layout
from prefixstore.base.log import log
from prefixstore.engine import replace
from prefixstore.engine.account import Account
from prefixstore.engine.counters import Counters
from prefixstore.engine.driver import InvariantViolation
from prefixstore.engine.guard import CallGuard
from prefixstore.engine.holds import Holds
from prefixstore.engine.index import Index, Node
from prefixstore.engine.recency import Recency
from prefixstore.engine.replace import Replacing
from prefixstore.engine.settings import Settings
from prefixstore.statemachine.compaction import (
    CompactionPolicy,
    RunStats,
    Verdict,
    chunks,
    merge_verdict,
)


@attrs.frozen(slots=True, eq=False)
class Compacting:
    """What a compaction pass uses: the call guard, the index and holds it finds runs
    in, the clock (a run's age), the compact-replace it runs each merge as."""

    guard: CallGuard
    layout: Layout
    index: Index
    holds: Holds
    recency: Recency
    account: Account
    counters: Counters
    settings: Settings
    replacing: Replacing


@attrs.define
class CompactionReport:
    """What one pass did."""

    rows_before: int = 0
    rows_after: int = 0
    runs: int = 0  # candidate runs found
    merges: int = 0  # merges swapped in
    rows_merged: int = 0  # old rows those merges replaced
    declined: dict[str, int] = attrs.field(factory=dict)  # verdict reason -> merges not worth doing
    aborted: list[str] = attrs.field(factory=list)  # why started merges did not swap


def compact(
    cp: Compacting,
    policy: CompactionPolicy | None = None,
    *,
    should_stop: Callable[[], bool] = lambda: False,
) -> CompactionReport:
    """One pass: plan merges under the lock, run each as its own transaction."""
    policy = policy or cp.settings.compaction_policy or CompactionPolicy()
    rep = CompactionReport()
    with cp.guard:
        with cp.guard.lock:
            rep.rows_before = len(cp.index)
            jobs = plan(cp, policy, rep)
        for job in jobs[: policy.max_jobs]:
            if should_stop() or cp.guard.closed:
                break
            out = replace.run(cp.replacing, job, space="watermark", pin_wait_s=policy.pin_wait_s)
            if out.ok:
                rep.merges += 1
                rep.rows_merged += len(job.old)
            else:
                rep.aborted.append(out.reason or "?")
        with cp.guard.lock:
            rep.rows_after = len(cp.index)
    return rep


def plan(cp: Compacting, policy: CompactionPolicy, rep: CompactionReport | None = None) -> list[replace.Job]:
    """Merge jobs the policy approves, cheapest-first order irrelevant. Lock held."""
    rep = rep if rep is not None else CompactionReport()
    jobs = []
    ranks = cp.layout.ranks
    for run in find_runs(cp, policy):
        rep.runs += 1
        cut = chunks(policy, [x.nbytes // ranks for x in run])
        if not cut:
            rep.declined["too_large"] = rep.declined.get("too_large", 0) + 1
        for lo, hi in cut:
            rows = run[lo:hi]
            v = verdict(cp, policy, rows)
            if v.merge:
                jobs.append(merge_job(cp, rows))
            else:
                rep.declined[v.reason] = rep.declined.get(v.reason, 0) + 1
    return jobs


def verdict(cp: Compacting, policy: CompactionPolicy, rows: list[Node]) -> Verdict:
    stats = RunStats(
        rows=len(rows),
        bytes_per_rank=sum(x.nbytes for x in rows) // cp.layout.ranks,
        age=cp.recency.clock - max(x.last_used for x in rows),
        rows_total=len(cp.index),
    )
    return merge_verdict(policy, stats)


def find_runs(cp: Compacting, policy: CompactionPolicy) -> list[list[Node]]:
    """Maximal mergeable runs, root first (see the module docstring). Lock held."""
    L = cp.layout

    def free(x: Node) -> bool:
        return x.ready and not cp.holds.pins[x.id] and not cp.holds.fences[x.id]

    def interior(x: Node) -> bool:
        if not (free(x) and len(x.children) == 1):
            return False
        return not policy.keep_interior_checkpoints or (L.has_snapshot and not x.has_snapshot)

    runs = []
    for x in cp.index:
        if not interior(x):
            continue
        parent = cp.index.get(x.parent) if x.parent is not None else None
        if parent is not None and interior(parent):
            continue  # not the top of its run
        run, cur = [x], x
        while interior(cur):
            cur = cp.index.nodes[next(iter(cur.children))]
            run.append(cur)
        if not free(run[-1]):
            run.pop()
        if len(run) >= 2:
            runs.append(run)
    return runs


def merge_job(cp: Compacting, rows: list[Node]) -> replace.Job:
    """The compact-replace of ``rows`` (a chain, root first) by one row: the last one's."""
    end = rows[-1]
    ranks = cp.layout.ranks
    row = replace.NewRow(end.key, rows[0].start, end.end, b"".join(x.digests for x in rows), end.has_snapshot,
                 max(x.last_used for x in rows), end.snap_used, keep=end.id)
    reads = {x.id: False for x in rows}
    reads[end.id] = end.has_snapshot

    def assemble(got):
        segs = replace.concat_parts([got[x.id] for x in rows], ranks)
        return [[(segs[r], got[end.id][r][1]) for r in range(ranks)]]

    return replace.Job("merge", list(rows), [row], reads, assemble)


# ------------------------------------------------------------------ the worker


@attrs.define(slots=True, eq=False, init=False, repr=False)
class Compactor:
    """The background compaction thread of one engine. Its counts and last report are
    written by that thread only; a pass takes the engine lock as ``compact`` says."""

    cp: Compacting
    policy: CompactionPolicy
    passes: int
    errors: int
    violation: str | None
    """An InvariantViolation (the debug checks) that stopped the worker."""
    last_report: CompactionReport | None
    _stop: threading.Event
    _wake: threading.Event
    _thread: threading.Thread
    _force: bool
    """Run the next pass whether or not the cache changed (``nudge``)."""

    def __init__(self, cp: Compacting, policy: CompactionPolicy) -> None:
        self.cp = cp
        self.policy = policy
        self.passes = 0
        self.errors = 0
        self.violation = None
        self.last_report = None
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="prefixstore-compactor", daemon=True)
        self._force = False

    def start(self) -> Compactor:
        self._thread.start()
        return self

    def nudge(self) -> None:
        """Run a pass now (whether or not the cache changed)."""
        self._force = True
        self._wake.set()

    def stop(self, timeout: float = 30.0) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def _loop(self) -> None:
        cp = self.cp
        last = None
        while not self._stop.is_set():
            self._wake.wait(self.policy.interval_s)
            self._wake.clear()
            if self._stop.is_set() or cp.guard.closed:
                return
            sig = (cp.recency.clock, len(cp.index), cp.account.charged)
            if sig == last and not self._force:
                continue
            self._force = False
            try:
                rep = compact(cp, self.policy, should_stop=self._stop.is_set)
            except (EngineClosedError, SimulatedCrash):
                return  # closed, or died (the engine abandoned itself)
            except InvariantViolation as exc:  # the debug check: no more background changes
                self.violation = str(exc)
                cp.counters.inc("replaces", "invariant_violation")
                log.error("compaction_invariant_violation", error=str(exc))
                return
            except Exception as exc:  # a failed pass fails its transaction, never the worker
                self.errors += 1
                cp.counters.inc("replaces", "worker_error")
                log.warning("compaction_failed", error=repr(exc))
                last = None
                continue
            self.passes += 1
            self.last_report = rep
            last = sig if not rep.merges and not rep.aborted else None


def start_worker(cp: Compacting, option: Any) -> Compactor | None:
    """Start the worker ``Engine.open(compaction=...)`` asks for (None/False: none)."""
    if option is None or option is False:
        return None
    if option is True:
        policy = CompactionPolicy()
    elif isinstance(option, CompactionPolicy):
        policy = option
    else:
        raise InvalidInputError("compaction= takes True, False/None or a CompactionPolicy")
    cp.settings.compaction_policy = policy
    return Compactor(cp, policy).start()
