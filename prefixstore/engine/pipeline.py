"""Asynchronous stores: the device to host copies now, the journaled commit later.

``store_async``: the caller's thread validates, peeks at the plan as ``store`` decides
it, reserves the parent and the row it refills, and enqueues the device to host
copies (staged as the shard files, ``staging.py``). A reservation (``Holds.reserved``,
counted in the fences) keeps eviction and merges from removing the row, so the plan
cannot move earlier; but no transaction is in flight on it, so a store or
compact-replace that keeps the row (a split or refill by a job queued ahead on the
commit worker, or by a store on another thread) neither waits for it nor is refused
by it. When the job starts, its reservations become its own fences, which it passes
to ``store.store`` as ``held``. The returned ``StoreTicket`` says when the copies are
done (``released``: the GPU blocks may be reused) and, later, the store's result
(``result()``), which the commit worker produces by running the ordinary journaled
store (intent, durable writes, publish) on the staged bytes. The journal rules are
unchanged: a crash after the release and before the publish commit leaves an INTENT
(or nothing) that recovery rolls back: the store is simply absent.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import CancelledError, Future
from typing import Any

import attrs

from prefixstore.base.errors import EngineClosedError, InvalidInputError
from prefixstore.base.layout import Layout
from prefixstore.engine import plan as planning
from prefixstore.engine import replace, retry, spans, staging, store, validate
from prefixstore.engine.catalog import Catalog
from prefixstore.engine.counters import Counters
from prefixstore.engine.guard import CallGuard
from prefixstore.engine.holds import Holds
from prefixstore.engine.results import DUPLICATE, QUEUED, REFUSED, StoreResult
from prefixstore.engine.transfers import Transfers
from prefixstore.gpu import shards
from prefixstore.gpu.executor import Copy, Staged


@attrs.frozen(slots=True, eq=False)
class AsyncStores:
    """What an asynchronous store uses: the lock and the holds it reserves rows with,
    the plan it peeks at (``storing``, ``spans``), the executor's background copies,
    the commit and retry workers and their slots (``transfers``), the retry queue."""

    guard: CallGuard
    layout: Layout
    catalog: Catalog
    holds: Holds
    counters: Counters
    executor: Any
    transfers: Transfers
    spans: spans.Spans
    storing: store.Storing
    retrying: retry.Retrying


@attrs.define(eq=False)
class StoreTicket:
    """An asynchronous store: ``released`` (device tensors reusable) and its result.

    ``released`` has ``is_set()`` and ``wait(timeout)``. ``result(timeout)`` returns
    the ``StoreResult`` once the store committed (or failed), re-raising what its job
    raised (an ``EngineClosedError`` if the engine closed first).
    """

    released: Any
    committed: Future

    def wait_released(self, timeout: float | None = None) -> bool:
        return self.released.wait(timeout)

    def result(self, timeout: float | None = None) -> StoreResult:
        try:
            return self.committed.result(timeout)
        except CancelledError:  # never ran: the engine stopped first
            raise EngineClosedError("the engine closed before this store committed") from None

    def done(self) -> bool:
        return self.committed.done()

    @classmethod
    def finished(cls, result: StoreResult) -> StoreTicket:
        fut: Future = Future()
        fut.set_result(result)
        return cls(Copy(), fut)


def store_async(
    a: AsyncStores,
    prefix: Any,
    segments: Any,
    snapshot: Any,
    tokens_from: int,
    valid: Callable[[], bool] | None,
) -> StoreTicket:
    """Stage the checkpoint now, commit it on the commit worker (see module doc)."""
    segs, snaps = validate.store_args(a.layout, prefix, segments, snapshot, tokens_from, valid)
    tr = a.transfers
    with a.guard:
        with a.guard.lock:
            peek = _peek(a, prefix, tokens_from)
        if isinstance(peek, StoreTicket):
            return peek
        gen, held, first = peek
        job = _QueuedStore(a, prefix, snaps is not None, valid, first, held)
        tr.slots.acquire()
        try:
            job.stage(gen, segs, snaps, tokens_from)
        except BaseException:
            job.cleanup()
            raise
    released = job.staged[0].copy
    for s in job.staged[1:]:
        released = released + s.copy
    try:
        fut = tr.commit.submit(job.run)
    except RuntimeError as exc:  # the worker stopped: the engine closed or died meanwhile
        job.cleanup()
        raise EngineClosedError("the engine closed before this store was queued") from exc
    # Cancelled unrun (the engine closed at once, or died): its buffers, fences and slot go back.
    fut.add_done_callback(lambda f: job.cleanup() if f.cancelled() else None)
    return StoreTicket(released, fut)


def _peek(a: AsyncStores, prefix: Any, tokens_from: int) -> StoreTicket | tuple[int, list[int], int]:
    """The plan ``store`` would take now (caller holds the engine lock): a finished
    ticket for a duplicate, else (generation, node ids reserved, first block staged)."""
    bt = a.layout.block_tokens
    # The decisions store() takes, in its order: bad tokens_from, a compact-replace
    # (split, republish), then the ordinary plan.
    spans.check_tokens_from(a.spans, prefix, tokens_from)
    plan = None if spans.route(a.spans, prefix, tokens_from) else store.plan(a.storing, prefix)
    if isinstance(plan, StoreResult) and plan.status == DUPLICATE:
        planning.count_skip(a.counters, plan)
        return StoreTicket.finished(plan)
    if plan is not None and not isinstance(plan, StoreResult):  # a plan: a new node or a refill
        start = plan.start
        gen = replace.next_generation(a.catalog, a.layout.ranks, prefix.keys[-1], plan.existing.generation if plan.existing else 0)
        if tokens_from > start * bt:
            raise InvalidInputError(
                f"the new node needs tokens from {start * bt}, but segments start at tokens_from={tokens_from}"
            )
        # Reserved while queued; the job's own fences once it runs (passed to store.store).
        held = [x.id for x in (plan.parent, plan.existing) if x is not None]
        first = spans.refill_from(a.spans, prefix, tokens_from, start)  # < start: refills
    else:  # a compact-replace, in flight or inside a span: the commit re-plans (and may stage again)
        gen, held, first = 1, [], tokens_from // bt
    a.holds.reserve(held)
    return gen, held, first


@attrs.define(slots=True, eq=False, init=False, repr=False)
class _QueuedStore:
    """An asynchronous store between its staging and its commit: its staged shards,
    its reservations (fences once it runs) and its slot, given back once."""

    a: AsyncStores
    prefix: Any
    with_snap: bool
    valid: Callable[[], bool] | None
    first: int
    held: list[int]
    staged: list[Staged]
    cleaned: threading.Lock
    """Taken once: by a failed staging, the job's ``finally`` or its cancellation."""
    started: threading.Event
    """Set when the job runs: its reservations are then fences of its transaction."""

    def __init__(self, a: AsyncStores, prefix: Any, with_snap: bool, valid: Callable[[], bool] | None,
                 first: int, held: list[int]) -> None:
        self.a, self.prefix, self.with_snap, self.valid = a, prefix, with_snap, valid
        self.first, self.held = first, held
        self.staged = []
        self.cleaned = threading.Lock()
        self.started = threading.Event()

    def stage(self, gen: int, segs: Any, snaps: Any, tokens_from: int) -> None:
        """Start the device to host copies of every rank's shard. Staged from ``first``:
        the rows of damaged ancestors the commit refills, too (then the plan's shard is
        staged again at the commit, from these host rows)."""
        a, L = self.a, self.a.layout
        bt, n = L.block_tokens, len(self.prefix)
        meta = {**shards.meta(self.prefix.keys[-1], gen, self.first, n, L.has_snapshot),
                **shards.span_provenance(L, self.prefix.keys, self.prefix.digests, self.first, n)}
        lo, hi = self.first * bt - tokens_from, n * bt - tokens_from
        for r in range(L.ranks):
            tensors = {f"seg.{k}": v[lo:hi] for k, v in segs[r].items()}
            if snaps is not None:
                tensors.update({f"snap.{k}": v for k, v in snaps[r].items()})
            plan_r = shards.plan_for_layout(L, hi - lo, L.has_snapshot, {**meta, "rank": str(r)})
            self.staged.append(a.executor.stage(plan_r, tensors, background=True))

    def cleanup(self) -> None:
        if self.cleaned.acquire(blocking=False):
            staging.release(self.staged)
            _unfence(self.a, self.held, reserved=not self.started.is_set())
            self.a.transfers.slots.release()

    def run(self) -> StoreResult:
        """The commit worker's job: the ordinary journaled store of the staged bytes."""
        a, staged, bt = self.a, self.staged, self.a.layout.block_tokens
        try:
            _start(a, self.held, self.started)
            with a.guard:
                ex = a.executor
                for s in staged:
                    s.checksum(ex.gate, ex.stats)
                ex.gate.yield_(ex.stats)
                views = [s.tensors() for s in staged]
                host_segs = [{k[4:]: v for k, v in vw.items() if k.startswith("seg.")} for vw in views]
                host_snaps = ([{k[5:]: v for k, v in vw.items() if k.startswith("snap.")} for vw in views]
                              if self.with_snap else None)
                res = store.store(a.storing, self.prefix, host_segs, host_snaps, self.first * bt, staged=staged,
                                 held=frozenset(self.held))
                if res.status == REFUSED and self.valid is not None:
                    for s in staged:
                        s.detach()  # the queued retry keeps views of these buffers
                    retry.enqueue(a.retrying, retry.Pending(self.prefix, host_segs, host_snaps, self.first * bt, self.valid))
                    res = attrs.evolve(res, status=QUEUED)
                if res.ok:
                    a.transfers.schedule_retry(a.guard, lambda: retry.run(a.retrying))
                return res
        finally:
            self.cleanup()


def _start(a: AsyncStores, ids: list[int], started: threading.Event) -> None:
    """A queued store's job begins: its reservations on ``ids`` become plain fences."""
    with a.guard.lock:
        a.holds.begin_reserved(ids)
        started.set()


def _unfence(a: AsyncStores, ids: list[int], reserved: bool) -> None:
    """Drop the fences on ``ids`` (``reserved``: still the reservations of a queued job)."""
    if not ids:
        return
    with a.guard.lock:
        if reserved:
            a.holds.unreserve(ids)
        else:
            a.holds.unfence(ids)
        a.guard.settled.notify_all()
