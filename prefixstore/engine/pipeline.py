"""Moving checkpoint bytes: zero-copy staging for stores, pipelined restores, async stores.

Store (``stage_store``, used by ``Engine._store``): each rank's tensors are copied by
the executor straight into a host buffer laid out as the shard file; the checksum is
taken over that buffer and the file is written from it (``write_shard``), or a tier
that declares ``ADOPTS_BUFFERS`` adopts the buffer as its copy. No other host copy is made.

Asynchronous store (``store_async``): the caller's thread validates, peeks at the
plan as ``store`` decides it, reserves the parent and the row it refills, and enqueues
the device to host copies. A reservation (``Engine._reserved``, counted in the fences)
keeps eviction and merges from removing the row, so the plan cannot move earlier; but
no transaction is in flight on it, so a store or compact-replace that keeps the row
(a split or refill by a job queued ahead on the commit worker, or by a store on
another thread) neither waits for it nor is refused by it. When the job starts, its reservations become its own
fences, which it passes to ``Engine._store`` as ``held``. The returned ``StoreTicket``
says when the copies are done (``released``: the GPU blocks may be reused) and, later,
the store's result (``result()``), which the commit worker produces by running the
ordinary journaled store (intent, durable writes, publish) on the staged bytes. The
journal rules are unchanged: a crash after the release and before the publish commit
leaves an INTENT (or nothing) that recovery rolls back: the store is simply absent.

Restore (``restore_nodes``): the output tensors are allocated once on the device;
shards are fetched in order (a RAM-resident buffer is used in place; otherwise a
reader thread reads the shard from its tier into a staging buffer and verifies it
there, through ``gpu/verify.py``) with up to ``window`` reads
in flight, so reading the next shards overlaps uploading the current one; each shard
is uploaded straight into its slice of the output. A staging buffer returns to the
pool once its upload completed. Where the outputs are host memory (the CPU executor)
and the tier reads from a descriptor (``READS_FD``), a shard is read straight into its
slices of the output instead (``verify.read_placed``: hashed as each piece lands, no
staging buffer, no second copy), several shards at once on the reader threads. The
outputs are the caller's tensors when it passes ``into``.
"""

from __future__ import annotations

import errno
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import CancelledError, Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import attrs
import torch

from prefixstore.base.errors import (
    CatalogIOError,
    EngineClosedError,
    InvalidInputError,
    SimulatedCrash,
)
from prefixstore.engine import (
    holds,
    journal,
    lifecycle,
    loading,
    replace,
    retry,
    spans,
    store,
    validate,
)
from prefixstore.engine.driver import Txn
from prefixstore.engine.results import DUPLICATE, QUEUED, REFUSED, StoreResult
from prefixstore.gpu import shards, verify
from prefixstore.gpu.executor import Buffer, Copy, Staged
from prefixstore.gpu.tier import Capability, has
from prefixstore.gpu.workers import Worker

if TYPE_CHECKING:
    from prefixstore.engine.api import Engine
    from prefixstore.engine.index import Node
    from prefixstore.engine.results import Match


# ------------------------------------------------------------------------------ state


class Transfers:
    """The engine's transfer machinery: reader threads, workers, last-restore timings."""

    def __init__(self, ranks: int, *, max_inflight_stores: int = 8) -> None:
        self.readers = ThreadPoolExecutor(max_workers=max(2, 2 * ranks), thread_name_prefix="reader")
        self.window = max(2, 2 * ranks)
        self.commit = Worker("commit")
        self.retry = Worker("retry")
        self._slots = threading.BoundedSemaphore(max_inflight_stores)
        self._retry_queued = False
        self._lock = threading.Lock()
        self.last_restore: dict[str, float] = {}
        self.restaged = 0

    def schedule_retry(self, eng: Engine) -> None:
        """Run ``retry_pending`` on the retry worker (once, however often asked)."""
        with self._lock:
            if self._retry_queued:
                return
            self._retry_queued = True

        def run() -> None:
            with self._lock:
                self._retry_queued = False
            if not (eng._closed or eng._closing):
                eng.retry_pending()

        try:
            self.retry.submit(run)
        except RuntimeError:  # stopped: the engine is closing
            with self._lock:
                self._retry_queued = False

    def drain(self, timeout: float | None = None) -> None:
        self.commit.drain(timeout)
        self.retry.drain(timeout)

    def stop(self, wait: bool) -> None:
        self.commit.stop(wait=wait)
        self.retry.stop(wait=wait)
        self.readers.shutdown(wait=False, cancel_futures=True)

    def stats(self) -> dict[str, Any]:
        return {"workers": {"commit": self.commit.stats(), "retry": self.retry.stats()},
                "restaged": self.restaged, "last_restore": dict(self.last_restore)}


# ------------------------------------------------------------------------------ store


def stage_store(
    eng: Engine,
    staged: list[Staged] | None,
    meta: dict[str, str],
    segs: Sequence[Any],
    snaps: Sequence[Any] | None,
    lo: int,
    hi: int,
) -> list[Staged]:
    """The staged shards of a store (``staged`` itself when it already matches)."""
    L = eng.layout
    plans = [shards.plan_for_layout(L, hi - lo, L.has_snapshot, {**meta, "rank": str(r)}) for r in range(L.ranks)]
    if staged is not None:
        if all(s.plan.header == p.header for s, p in zip(staged, plans, strict=True)):
            return staged
        eng.transfers.restaged += 1  # the plan moved since the peek: stage again from the host copy
    out: list[Staged] = []
    try:
        for r in range(L.ranks):
            tensors = {f"seg.{k}": v[lo:hi] for k, v in segs[r].items()}
            if snaps is not None:
                tensors.update({f"snap.{k}": v for k, v in snaps[r].items()})
            out.append(eng.executor.stage(plans[r], tensors))
    except BaseException:
        release(out)
        raise
    return out


def release(datas: Sequence[Any]) -> None:
    """Release staged shards (bytes need nothing)."""
    for d in datas:
        if isinstance(d, Staged):
            d.release()


def size_of(d: Any) -> int:
    return d.size if isinstance(d, Staged) else len(d)


def checksum_of(d: Any) -> str:
    return d.checksum() if isinstance(d, Staged) else shards.checksum(d)


def write_shard(eng: Engine, r: int, name: str, d: Any) -> None:
    """Apply one rank's write of a store: bytes, or a staged buffer (adopted by a RAM
    tier, or written from in place). Any failure of the effect is an OSError, so it
    fails the transaction (rolled back), never the thread that ran it."""
    rank = eng.ranks[r]
    try:
        if not isinstance(d, Staged):
            rank.write_shard(name, d)
            return
        if has(rank, Capability.ADOPTS_BUFFERS):
            d.buffer.retain()  # the tier's reference
            try:
                rank.adopt_shard(name, d.buffer)  # type: ignore[attr-defined]
            except BaseException:
                d.buffer.release()
                raise
        else:
            rank.write_shard(name, d.buffer.mv())
    except OSError:
        raise
    except Exception as exc:
        raise OSError(errno.EIO, f"rank {r} write failed: {type(exc).__name__}: {exc}") from exc


def fail_txn(eng: Engine, txn: Txn, exc: BaseException) -> None:
    """End ``txn`` after an unexpected error in its flow, by its table's abort step:
    forward if it had published, back otherwise. A simulated crash is left to recovery,
    and so is a transaction the catalog can no longer read or end (it then refuses
    writes until reopened); the caller raises ``exc`` either way, never this step's error."""
    if isinstance(exc, SimulatedCrash) or eng._closed:
        return
    with eng._lock:
        try:
            with eng.catalog.reading() as c:
                step = eng.driver.abort(c, txn)
            if step is None:
                return
            journal.end(eng, txn, step)
        except CatalogIOError as err:
            eng.catalog.fail(f"{txn.kind} transaction {txn.id} left to recovery: {err}")
            eng.counters.inc("faults", "txn_left_to_recovery")
            return
        if step.direction == "forward":
            loading.load(eng, keep=True)  # the publish committed; make the index agree with it
    eng.counters.inc("faults", "txn_error")


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
    eng: Engine,
    prefix: Any,
    segments: Any,
    snapshot: Any,
    tokens_from: int,
    valid: Callable[[], bool] | None,
) -> StoreTicket:
    """Stage the checkpoint now, commit it on the commit worker (see module doc)."""
    segs, snaps = validate.store_args(eng, prefix, segments, snapshot, tokens_from, valid)
    tr = eng.transfers
    with lifecycle.guard(eng):
        with eng._lock:
            peek = _peek(eng, prefix, tokens_from)
        if isinstance(peek, StoreTicket):
            return peek
        gen, held, first = peek
        job = _QueuedStore(eng, prefix, snaps is not None, valid, first, held)
        tr._slots.acquire()
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


def _peek(eng: Engine, prefix: Any, tokens_from: int) -> StoreTicket | tuple[int, list[int], int]:
    """The plan ``store`` would take now (caller holds the engine lock): a finished
    ticket for a duplicate, else (generation, node ids reserved, first block staged)."""
    bt = eng.layout.block_tokens
    # The decisions store() takes, in its order: bad tokens_from, a compact-replace
    # (split, republish), then the ordinary plan.
    spans.check_tokens_from(eng, prefix, tokens_from)
    plan = None if spans.route(eng, prefix, tokens_from) else store.plan(eng, prefix)
    if isinstance(plan, StoreResult) and plan.status == DUPLICATE:
        store.count_skip(eng, plan)
        return StoreTicket.finished(plan)
    if plan is not None and not isinstance(plan, StoreResult):  # a plan: a new node or a refill
        start = plan.start
        gen = replace.next_generation(eng, prefix.keys[-1], plan.existing.generation if plan.existing else 0)
        if tokens_from > start * bt:
            raise InvalidInputError(
                f"the new node needs tokens from {start * bt}, but segments start at tokens_from={tokens_from}"
            )
        # Reserved while queued; the job's own fences once it runs (passed to _store).
        held = [x.id for x in (plan.parent, plan.existing) if x is not None]
        first = spans.refill_from(eng, prefix, tokens_from, start)  # < start: refills
    else:  # a compact-replace, in flight or inside a span: the commit re-plans (and may stage again)
        gen, held, first = 1, [], tokens_from // bt
    holds.reserve(eng, held)
    return gen, held, first


class _QueuedStore:
    """An asynchronous store between its staging and its commit: its staged shards,
    its reservations (fences once it runs) and its slot, given back once."""

    def __init__(self, eng: Engine, prefix: Any, with_snap: bool, valid: Callable[[], bool] | None,
                 first: int, held: list[int]) -> None:
        self.eng, self.prefix, self.with_snap, self.valid = eng, prefix, with_snap, valid
        self.first, self.held = first, held
        self.staged: list[Staged] = []
        self.cleaned = threading.Lock()  # a failed staging, the job's finally, or its cancellation: once
        self.started = threading.Event()  # the job runs: its reservations are fences of its transaction

    def stage(self, gen: int, segs: Any, snaps: Any, tokens_from: int) -> None:
        """Start the device to host copies of every rank's shard. Staged from ``first``:
        the rows of damaged ancestors the commit refills, too (then the plan's shard is
        staged again at the commit, from these host rows)."""
        eng, L = self.eng, self.eng.layout
        bt, n = L.block_tokens, len(self.prefix)
        meta = {**shards.meta(self.prefix.keys[-1], gen, self.first, n, L.has_snapshot),
                **shards.span_provenance(L, self.prefix.keys, self.prefix.digests, self.first, n)}
        lo, hi = self.first * bt - tokens_from, n * bt - tokens_from
        for r in range(L.ranks):
            tensors = {f"seg.{k}": v[lo:hi] for k, v in segs[r].items()}
            if snaps is not None:
                tensors.update({f"snap.{k}": v for k, v in snaps[r].items()})
            plan_r = shards.plan_for_layout(L, hi - lo, L.has_snapshot, {**meta, "rank": str(r)})
            self.staged.append(eng.executor.stage(plan_r, tensors, background=True))

    def cleanup(self) -> None:
        if self.cleaned.acquire(blocking=False):
            release(self.staged)
            _unfence(self.eng, self.held, reserved=not self.started.is_set())
            self.eng.transfers._slots.release()

    def run(self) -> StoreResult:
        """The commit worker's job: the ordinary journaled store of the staged bytes."""
        eng, staged, bt = self.eng, self.staged, self.eng.layout.block_tokens
        try:
            _start(eng, self.held, self.started)
            with lifecycle.guard(eng):
                ex = eng.executor
                for s in staged:
                    s.checksum(ex.gate, ex.stats)
                ex.gate.yield_(ex.stats)
                views = [s.tensors() for s in staged]
                host_segs = [{k[4:]: v for k, v in vw.items() if k.startswith("seg.")} for vw in views]
                host_snaps = ([{k[5:]: v for k, v in vw.items() if k.startswith("snap.")} for vw in views]
                              if self.with_snap else None)
                res = store.store(eng, self.prefix, host_segs, host_snaps, self.first * bt, staged=staged,
                                 held=frozenset(self.held))
                if res.status == REFUSED and self.valid is not None:
                    for s in staged:
                        s.detach()  # the queued retry keeps views of these buffers
                    retry.enqueue(eng, retry.Pending(self.prefix, host_segs, host_snaps, self.first * bt, self.valid))
                    res = attrs.evolve(res, status=QUEUED)
                if res.ok:
                    eng.transfers.schedule_retry(eng)
                return res
        finally:
            self.cleanup()


def _start(eng: Engine, ids: list[int], started: threading.Event) -> None:
    """A queued store's job begins: its reservations on ``ids`` become plain fences."""
    with eng._lock:
        holds.begin_reserved(eng, ids)
        started.set()


def _unfence(eng: Engine, ids: list[int], reserved: bool) -> None:
    """Drop the fences on ``ids`` (``reserved``: still the reservations of a queued job)."""
    if not ids:
        return
    with eng._lock:
        if reserved:
            holds.unreserve(eng, ids)
        else:
            holds.unfence(eng, ids)
        eng._settled.notify_all()


# ------------------------------------------------------------------------------ restore


@attrs.frozen
class Damage:
    """A shard of ``node`` failed verification during a restore."""

    node: Node
    why: str


@attrs.define(eq=False, slots=True)
class _Fetched:
    offs: dict[str, int]  # segment name -> byte offset of its rows in the buffer
    snap: dict[str, torch.Tensor]
    buffer: Buffer


@attrs.define(eq=False, slots=True)
class _Placed:
    """A shard read and verified in its final place: only its snapshot tensors to keep."""

    snap: dict[str, torch.Tensor]
    nbytes: int


def _fetch_placed(eng: Engine, x: Node, r: int, row: tuple[str, int, str], place: verify.Placement,
                  snap: dict[str, torch.Tensor]) -> Any:
    """One shard read straight into ``place`` (``verify.read_placed``): a ``_Placed``,
    a damage string, or None on an I/O error."""
    name, size, ck = row
    L = eng.layout
    meta = {**shards.meta(x.key, x.generation, x.start, x.end, x.has_snapshot), "rank": str(r)}
    got = verify.read_placed(eng.ranks[r], name, size, ck, verify.Header(L, x.blocks * L.block_tokens,
                             x.has_snapshot, meta), place, eng.executor.stats)
    if isinstance(got, verify.Transient):
        eng.counters.inc("faults", "read")
        return None
    if isinstance(got, verify.Damage):
        return f"rank {r}: {got.why}"
    return _Placed(snap, sum(len(d) for _, d in place.values()))


def _fetch(eng: Engine, x: Node, r: int, row: tuple[str, int, str], from_ram: bool) -> Any:
    """One shard as views of a host buffer; a damage string; None on an I/O error.

    ``from_ram``: only take the rank's RAM-resident copy (the marker ``_NOT_RESIDENT``
    when it holds none); otherwise read it from the tier into a staging buffer and
    verify it there (``gpu/verify.py``), then offer it to a tier that ``PROMOTES``."""
    name, size, ck = row
    rank = eng.ranks[r]
    ex = eng.executor
    got = (verify.resident(rank, name, size) if from_ram
           else verify.read(rank, name, size, ck, pool=ex.pool, stats=ex.stats))
    if got is None:
        return _NOT_RESIDENT
    if isinstance(got, verify.Transient):
        eng.counters.inc("faults", "read")
        return None
    if isinstance(got, verify.Damage):
        return f"rank {r}: {got.why}"
    buf = got.buffer
    assert buf is not None
    parsed = _parsed(eng, x, r, row, buf)
    if isinstance(parsed, verify.Damage):
        buf.release()
        return f"rank {r}: {parsed.why}"
    if not from_ram and has(rank, Capability.PROMOTES):
        rank.promote(name, buf)  # type: ignore[attr-defined]
    return _Fetched(parsed[0], parsed[1], buf)


def _parsed(eng: Engine, x: Node, r: int, row: tuple[str, int, str], buf: Buffer) -> Any:
    """(segment offsets, snapshot views) of the verified shard in ``buf``, its header
    checked; a ``Damage`` when it names another shard. A RAM-tier buffer is immutable
    while held: its header is validated once (the result is kept on the buffer)."""
    L = eng.layout
    key = (*row, x.start, x.end, x.has_snapshot, r)
    cached = buf.parsed
    if cached is not None and cached[0] == key:
        return cached[1], cached[2]
    meta = {**shards.meta(x.key, x.generation, x.start, x.end, x.has_snapshot), "rank": str(r)}
    got = verify.parse_header(buf, verify.Header(L, x.blocks * L.block_tokens, x.has_snapshot, meta))
    if isinstance(got, verify.Damage):
        return got
    segs, snap = got
    base = buf.tensor.data_ptr()
    offs = {n: v.data_ptr() - base for n, v in segs.items()}
    buf.parsed = (key, offs, snap)
    return offs, snap


_NOT_RESIDENT = object()


def restore_nodes(eng: Engine, nodes: list[Node], rows: dict[int, dict[int, tuple]], match: Match,
                  into: list[dict[str, torch.Tensor]] | None = None) -> Any:
    """Read, verify and upload the shards of ``nodes`` (root first).

    Returns ``(segments, snapshot, files)`` per rank, a ``Damage``, or None on a
    transient I/O error. Records the time spent moving bytes (waiting for reads,
    uploading) in ``eng.transfers.last_restore``.

    Every shard resident in a RAM tier is taken (and its header checked) before any
    byte moves, so that bookkeeping does not run between copies (which evict the CPU
    caches); the others are read by reader threads, ``window`` at a time ahead of the
    uploads, in order.
    """
    t0 = time.perf_counter()
    all_ranks = set(range(eng.layout.ranks))
    for x in nodes:
        if rows[x.id].keys() != all_ranks:
            return Damage(x, f"shards recorded on ranks {sorted(rows[x.id])}")
    run = _Restore(eng, nodes, rows, match, into)
    outs = run.run()
    if outs is None or isinstance(outs, Damage):
        return outs
    eng.transfers.last_restore = {"total_s": time.perf_counter() - t0, "move_s": run.move,
                                  "move_cpu_s": run.move_cpu, "bytes": run.moved, "chunks": len(run.chunks)}
    return outs, run.snaps, len(run.chunks)


class _Restore:
    """One restore's chunks, fetches and uploads (``restore_nodes``).

    A chunk is (node, rank, file row, output row, rows cut, rows copied): the rows the
    GPU holds already are cut, and a partial hit stops inside the last node.
    """

    def __init__(self, eng: Engine, nodes: list[Node], rows: dict[int, dict[int, tuple]], match: Match,
                 into: list[dict[str, torch.Tensor]] | None = None) -> None:
        L = eng.layout
        self.into = into
        bt = L.block_tokens
        self.eng, self.end = eng, nodes[-1]
        self.chunks: list[tuple[Node, int, tuple, int, int, int]] = []
        off = 0
        for x in nodes:
            cut = max(0, match.gpu_blocks - x.start) * bt
            ntok = (min(x.end, match.blocks) - x.start) * bt - cut
            self.chunks += [(x, r, rows[x.id][r], off, cut, ntok) for r in range(L.ranks)]
            off += ntok
        self.rows_out = off
        self.seg_rows = [(s.name, s.nbytes) for s in L.segments]  # bytes per token row
        self.got: list[Any] = [_fetch(eng, x, r, row, True) for x, r, row, _, _, _ in self.chunks]
        self.missing = [i for i, g in enumerate(self.got) if g is _NOT_RESIDENT]
        self.move = self.move_cpu = 0.0  # wall and this thread's CPU seconds spent moving bytes
        self.moved = self.copies = 0
        self.snaps: list[dict[str, torch.Tensor]] = [{} for _ in range(L.ranks)]
        self.flats: list[dict[str, Any]] = []
        self.ready: list[tuple[int, _Fetched]] = []  # fetched, not yet uploaded
        self.nxt = 0
        self.placed = eng.executor.host_outputs  # shards read straight into the outputs

    def run(self) -> Any:
        """The output tensors per rank, a ``Damage``, or None (a transient error)."""
        eng, ex, L = self.eng, self.eng.executor, self.eng.layout
        got, clock, cpu = self.got, time.perf_counter, time.thread_time
        try:
            for g, (x, _, _, _, _, _) in zip(got, self.chunks, strict=True):
                if isinstance(g, str):  # a RAM copy failed its check
                    return Damage(x, g)
            with ex.gate.foreground():
                outs = self.into if self.into is not None else [
                    {s.name: ex.empty((self.rows_out, *s.shape), s.torch_dtype) for s in L.segments}
                    for _ in range(L.ranks)]
                self.flats = [{n: ex.flat(t) for n, t in o.items()} for o in outs]  # byte views: cheap slices
                while self.nxt < min(eng.transfers.window, len(self.missing)):
                    self.read_next()
                ex.begin_uploads()
                for i, (x, _, _, _, _, _) in enumerate(self.chunks):
                    item = got[i]
                    if item.__class__ is Future:
                        self.upload_ready()  # what is here moves while the read completes
                        tw = clock()
                        item = got[i] = item.result()
                        self.move += clock() - tw
                        if self.nxt < len(self.missing):
                            self.read_next()
                    if item.__class__ is _Placed:
                        self.took_placed(i, item)
                        continue
                    if item.__class__ is not _Fetched:
                        return Damage(x, item) if isinstance(item, str) else None
                    self.ready.append((i, item))
                self.upload_ready()
                tf, cf = clock(), cpu()
                ex.finish_uploads()
                self.move += clock() - tf
                self.move_cpu += cpu() - cf
        finally:
            for item in got:
                if item is not None:
                    _discard(item)
            seg_bytes = self.moved - sum(t.numel() * t.element_size() for s in self.snaps for t in s.values())
            ex.stats.add(h2d_bytes=seg_bytes, h2d_copies=self.copies)
        return outs

    def read_next(self) -> None:
        i = self.missing[self.nxt]
        x, r, row = self.chunks[i][:3]
        rank, readers = self.eng.ranks[r], self.eng.transfers.readers
        if self.placed and has(rank, Capability.READS_FD) and not has(rank, Capability.PROMOTES):
            place, snap = self.placement(i)
            if len(self.missing) == 1:  # one shard to read: this thread reads it (no hand-off)
                self.got[i] = _fetch_placed(self.eng, x, r, row, place, snap)
            else:
                self.got[i] = readers.submit(_fetch_placed, self.eng, x, r, row, place, snap)
        else:
            self.got[i] = readers.submit(_fetch, self.eng, x, r, row, False)
        self.nxt += 1

    def took_placed(self, i: int, item: _Placed) -> None:
        """A shard read into its place: keep its snapshot, count its bytes (the
        snapshot's as an upload of its own, as ``upload`` counts them)."""
        self.snaps[self.chunks[i][1]].update(item.snap)
        self.moved += item.nbytes
        self.copies += 1
        if item.snap:
            snap_bytes = sum(t.numel() * t.element_size() for t in item.snap.values())
            self.eng.executor.stats.add(h2d_bytes=snap_bytes, h2d_copies=len(item.snap))
        self.got[i] = None

    def placement(self, i: int) -> tuple[verify.Placement, dict[str, torch.Tensor]]:
        """Where chunk ``i``'s shard goes: its rows into their slices of the outputs,
        the snapshot (of the last node) into tensors of its own."""
        x, r, _, o, cut, ntok = self.chunks[i]
        ex, L, flat = self.eng.executor, self.eng.layout, self.flats[r]
        place = {f"seg.{name}": (cut * rb, memoryview(flat[name][o * rb : (o + ntok) * rb]))
                 for name, rb in self.seg_rows}
        snap: dict[str, torch.Tensor] = {}
        if x is self.end and L.has_snapshot:
            for s in L.snapshots:
                t = snap[s.name] = ex.empty(tuple(s.shape), s.torch_dtype)
                place[f"snap.{s.name}"] = (0, memoryview(ex.flat(t)))
        return place, snap

    def upload_ready(self) -> None:
        """Upload every fetched chunk (a tight loop: no bookkeeping between copies)."""
        ex, L, chunks, flats, seg_rows = self.eng.executor, self.eng.layout, self.chunks, self.flats, self.seg_rows
        clock, cpu = time.perf_counter, time.thread_time
        ops = []  # each node's rows land in their slice of the output
        for i, item in self.ready:
            x, r, _, o, cut, ntok = chunks[i]
            src, offs, dst = ex.source(item.buffer), item.offs, flats[r]
            ops += [(dst[name], o * rb, src, offs[name] + cut * rb, ntok * rb) for name, rb in seg_rows]
        tu, cu = clock(), cpu()
        ex.upload_batch(ops)
        moved = sum(op[4] for op in ops)
        self.copies += len(ops)
        for i, item in self.ready:
            x, r = chunks[i][:2]
            if x is self.end and L.has_snapshot:
                for s in L.snapshots:
                    t = ex.empty(tuple(s.shape), s.torch_dtype)
                    ex.upload(t, item.snap[s.name])
                    self.snaps[r][s.name] = t
                    moved += t.numel() * t.element_size()
        self.moved += moved
        fence = ex.record()
        for i, item in self.ready:
            self.got[i] = None
            item.buffer.release(after=fence)
        self.ready.clear()
        self.move += clock() - tu
        self.move_cpu += cpu() - cu


def _discard(item: Any) -> None:
    """Release the buffer of a fetch that will not be used (waiting for a running read)."""
    if isinstance(item, Future):
        try:
            item = item.result()
        except BaseException:
            return
    if isinstance(item, _Fetched):
        item.buffer.release()
