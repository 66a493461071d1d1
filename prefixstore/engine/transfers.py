"""Moving checkpoint bytes to the device: the engine's transfer machinery (reader
threads, the commit and retry workers, the last restore's timings) and the pipelined
restore.

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
outputs are the caller's tensors when it passes ``into``. A shard of several pieces is
read by piece helpers beside the thread that hashes it while reads with helpers are
measured faster than reads without (``gpu/pieces.py``).
"""

from __future__ import annotations

import bisect
import itertools
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import attrs
import torch

from prefixstore.base.destination import Pieces
from prefixstore.base.layout import Layout
from prefixstore.engine.counters import Counters
from prefixstore.engine.guard import CallGuard
from prefixstore.engine.index import Node
from prefixstore.engine.results import Match
from prefixstore.engine.tiering import Tiers
from prefixstore.gpu import shards, verify
from prefixstore.gpu.executor import Buffer
from prefixstore.gpu.pieces import Helpers, nbytes, usable_cpus
from prefixstore.gpu.tier import Capability, has
from prefixstore.gpu.workers import Worker


@attrs.define(slots=True, eq=False, init=False, repr=False)
class Transfers:
    """The engine's transfer machinery: reader threads, workers, last-restore timings.
    Its own lock guards only whether a retry is queued; the rest is thread-safe by
    itself (pools, workers, the semaphore) or written by one restore at a time."""

    readers: ThreadPoolExecutor
    pieces: Helpers
    """Threads that read pieces of one shard beside the thread hashing it (never the
    readers: a reader waits for its pieces)."""
    window: int
    """Reads in flight per restore, at most."""
    commit: Worker
    retry: Worker
    slots: threading.BoundedSemaphore
    """Async stores staged and not yet committed, at most ``max_inflight_stores``."""
    last_restore: dict[str, float]
    restaged: int
    _retry_queued: bool
    _lock: threading.Lock

    def __init__(self, ranks: int, *, max_inflight_stores: int = 8) -> None:
        self.readers = ThreadPoolExecutor(max_workers=max(2, 2 * ranks), thread_name_prefix="reader")
        helpers = max(1, min(4, usable_cpus() - 1))
        self.pieces = Helpers(ThreadPoolExecutor(max_workers=helpers, thread_name_prefix="piece"), helpers)
        self.window = max(2, 2 * ranks)
        self.commit = Worker("commit")
        self.retry = Worker("retry")
        self.slots = threading.BoundedSemaphore(max_inflight_stores)
        self._retry_queued = False
        self._lock = threading.Lock()
        self.last_restore: dict[str, float] = {}
        self.restaged = 0

    def schedule_retry(self, guard: CallGuard, retry: Callable[[], None]) -> None:
        """Run ``retry`` (the queued stores' retry) on the retry worker, once however
        often asked, unless the engine is closing by then."""
        with self._lock:
            if self._retry_queued:
                return
            self._retry_queued = True

        def run() -> None:
            with self._lock:
                self._retry_queued = False
            if not (guard.closed or guard.closing):
                retry()

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
        self.pieces.pool.shutdown(wait=False, cancel_futures=True)

    def stats(self) -> dict[str, Any]:
        return {"workers": {"commit": self.commit.stats(), "retry": self.retry.stats()},
                "restaged": self.restaged, "last_restore": dict(self.last_restore)}


@attrs.frozen(slots=True, eq=False)
class Fetch:
    """What a restore's reads and uploads use: the tiers, the executor, the reader
    threads and window (``Transfers``), the fault counters."""

    layout: Layout
    tiers: Tiers
    executor: Any
    transfers: Transfers
    counters: Counters


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


def _fetch_placed(f: Fetch, x: Node, r: int, row: tuple[str, int, str], place: verify.Placement,
                  snap: dict[str, torch.Tensor]) -> Any:
    """One shard read straight into ``place`` (``verify.read_placed``): a ``_Placed``,
    a damage string, or None on an I/O error."""
    name, size, ck = row
    L = f.layout
    meta = {**shards.meta(x.key, x.generation, x.start, x.end, x.has_snapshot), "rank": str(r)}
    got = verify.read_placed(f.tiers.ranks[r], name, size, ck, verify.Header(L, x.blocks * L.block_tokens,
                             x.has_snapshot, meta), place, f.executor.stats,
                             f.transfers.pieces)
    if isinstance(got, verify.Transient):
        f.counters.inc("faults", "read")
        return None
    if isinstance(got, verify.Damage):
        return f"rank {r}: {got.why}"
    return _Placed(snap, sum(nbytes(d) for _, d in place.values()))


def _fetch(f: Fetch, x: Node, r: int, row: tuple[str, int, str], from_ram: bool) -> Any:
    """One shard as views of a host buffer; a damage string; None on an I/O error.

    ``from_ram``: only take the rank's RAM-resident copy (the marker ``_NOT_RESIDENT``
    when it holds none); otherwise read it from the tier into a staging buffer and
    verify it there (``gpu/verify.py``), then offer it to a tier that ``PROMOTES``."""
    name, size, ck = row
    rank = f.tiers.ranks[r]
    ex = f.executor
    got = (verify.resident(rank, name, size) if from_ram
           else verify.read(rank, name, size, ck, pool=ex.pool, stats=ex.stats, helpers=f.transfers.pieces))
    if got is None:
        return _NOT_RESIDENT
    if isinstance(got, verify.Transient):
        f.counters.inc("faults", "read")
        return None
    if isinstance(got, verify.Damage):
        return f"rank {r}: {got.why}"
    buf = got.buffer
    assert buf is not None
    parsed = _parsed(f.layout, x, r, row, buf)
    if isinstance(parsed, verify.Damage):
        buf.release()
        return f"rank {r}: {parsed.why}"
    if not from_ram and has(rank, Capability.PROMOTES):
        rank.promote(name, buf)  # type: ignore[attr-defined]
    return _Fetched(parsed[0], parsed[1], buf)


def _parsed(L: Layout, x: Node, r: int, row: tuple[str, int, str], buf: Buffer) -> Any:
    """(segment offsets, snapshot views) of the verified shard in ``buf``, its header
    checked; a ``Damage`` when it names another shard. A RAM-tier buffer is immutable
    while held: its header is validated once (the result is kept on the buffer)."""
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


def restore_nodes(f: Fetch, nodes: list[Node], rows: dict[int, dict[int, tuple]], match: Match,
                  into: list[dict[str, torch.Tensor | Pieces]] | None = None) -> Any:
    """Read, verify and upload the shards of ``nodes`` (root first).

    Returns ``(segments, snapshot, files)`` per rank, a ``Damage``, or None on a
    transient I/O error. Records the time spent moving bytes (waiting for reads,
    uploading) in ``Transfers.last_restore``.

    Every shard resident in a RAM tier is taken (and its header checked) before any
    byte moves, so that bookkeeping does not run between copies (which evict the CPU
    caches); the others are read by reader threads, ``window`` at a time ahead of the
    uploads, in order.
    """
    t0 = time.perf_counter()
    all_ranks = set(range(f.layout.ranks))
    for x in nodes:
        if rows[x.id].keys() != all_ranks:
            return Damage(x, f"shards recorded on ranks {sorted(rows[x.id])}")
    run = _Restore(f, nodes, rows, match, into)
    outs = run.run()
    if outs is None or isinstance(outs, Damage):
        return outs
    f.transfers.last_restore = {"total_s": time.perf_counter() - t0, "move_s": run.move,
                                  "move_cpu_s": run.move_cpu, "bytes": run.moved, "chunks": len(run.chunks)}
    return outs, run.snaps, len(run.chunks)


@attrs.define(slots=True, eq=False, init=False, repr=False)
class _Restore:
    """One restore's chunks, fetches and uploads (``restore_nodes``), on one thread.

    A chunk is (node, rank, file row, output row, rows cut, rows copied): the rows the
    GPU holds already are cut, and a partial hit stops inside the last node.
    """

    f: Fetch
    into: list[dict[str, torch.Tensor | Pieces]] | None
    """The caller's output tensors per rank (None: allocated here)."""
    end: Node
    chunks: list[tuple[Node, int, tuple, int, int, int]]
    rows_out: int
    seg_rows: list[tuple[str, int]]
    """Bytes per token row of each segment tensor."""
    got: list[Any]
    missing: list[int]
    move: float
    """Wall seconds spent moving bytes (``move_cpu``: this thread's CPU seconds)."""
    move_cpu: float
    moved: int
    copies: int
    snaps: list[dict[str, torch.Tensor]]
    flats: list[dict[str, Any]]
    ready: list[tuple[int, _Fetched]]
    """Fetched, not yet uploaded."""
    nxt: int
    placed: bool
    """The outputs are host memory: shards are read straight into them."""
    uploads: bool
    """Some shard was uploaded from a buffer (not read in place)."""

    def __init__(self, f: Fetch, nodes: list[Node], rows: dict[int, dict[int, tuple]], match: Match,
                 into: list[dict[str, torch.Tensor | Pieces]] | None = None) -> None:
        L = f.layout
        self.into = into
        bt = L.block_tokens
        self.f, self.end = f, nodes[-1]
        self.chunks: list[tuple[Node, int, tuple, int, int, int]] = []
        off = 0
        for x in nodes:
            cut = max(0, match.gpu_blocks - x.start) * bt
            ntok = (min(x.end, match.blocks) - x.start) * bt - cut
            self.chunks += [(x, r, rows[x.id][r], off, cut, ntok) for r in range(L.ranks)]
            off += ntok
        self.rows_out = off
        self.seg_rows = [(s.name, s.nbytes) for s in L.segments]  # bytes per token row
        self.got: list[Any] = [_fetch(f, x, r, row, True) for x, r, row, _, _, _ in self.chunks]
        self.missing = [i for i, g in enumerate(self.got) if g is _NOT_RESIDENT]
        self.move = self.move_cpu = 0.0  # wall and this thread's CPU seconds spent moving bytes
        self.moved = self.copies = 0
        self.snaps: list[dict[str, torch.Tensor]] = [{} for _ in range(L.ranks)]
        self.flats: list[dict[str, Any]] = []
        self.ready: list[tuple[int, _Fetched]] = []  # fetched, not yet uploaded
        self.nxt = 0
        self.placed = f.executor.host_outputs
        self.uploads = False

    def run(self) -> Any:
        """The output tensors per rank, a ``Damage``, or None (a transient error)."""
        f, ex, L = self.f, self.f.executor, self.f.layout
        got, clock, cpu = self.got, time.perf_counter, time.thread_time
        try:
            for g, (x, _, _, _, _, _) in zip(got, self.chunks, strict=True):
                if isinstance(g, str):  # a RAM copy failed its check
                    return Damage(x, g)
            with ex.gate.foreground():
                outs = self.into if self.into is not None else [
                    {s.name: ex.empty((self.rows_out, *s.shape), s.torch_dtype) for s in L.segments}
                    for _ in range(L.ranks)]
                self.flats = [{n: _Dest.of(ex, t) for n, t in o.items()} for o in outs]  # byte views: cheap slices
                while self.nxt < min(f.transfers.window, len(self.missing)):
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
                if self.uploads:  # placed reads need no finishing (nor the CPU clock's system calls)
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
        rank, readers = self.f.tiers.ranks[r], self.f.transfers.readers
        if self.placed and has(rank, Capability.READS_FD) and not has(rank, Capability.PROMOTES):
            place, snap = self.placement(i)
            if len(self.missing) == 1:  # one shard to read: this thread reads it (no hand-off)
                self.got[i] = _fetch_placed(self.f, x, r, row, place, snap)
            else:
                self.got[i] = readers.submit(_fetch_placed, self.f, x, r, row, place, snap)
        else:
            self.got[i] = readers.submit(_fetch, self.f, x, r, row, False)
        self.nxt += 1

    def took_placed(self, i: int, item: _Placed) -> None:
        """A shard read into its place: keep its snapshot, count its bytes (the
        snapshot's as an upload of its own, as ``upload`` counts them)."""
        self.snaps[self.chunks[i][1]].update(item.snap)
        self.moved += item.nbytes
        self.copies += 1
        if item.snap:
            snap_bytes = sum(t.numel() * t.element_size() for t in item.snap.values())
            self.f.executor.stats.add(h2d_bytes=snap_bytes, h2d_copies=len(item.snap))
        self.got[i] = None

    def placement(self, i: int) -> tuple[verify.Placement, dict[str, torch.Tensor]]:
        """Where chunk ``i``'s shard goes: its rows into their slices of the outputs,
        the snapshot (of the last node) into tensors of its own."""
        x, r, _, o, cut, ntok = self.chunks[i]
        ex, L, flat = self.f.executor, self.f.layout, self.flats[r]
        place: dict[str, tuple[int, Any]] = {
            f"seg.{name}": (cut * rb, flat[name].views(o * rb, ntok * rb)) for name, rb in self.seg_rows}
        snap: dict[str, torch.Tensor] = {}
        if x is self.end and L.has_snapshot:
            for s in L.snapshots:
                t = snap[s.name] = ex.empty(tuple(s.shape), s.torch_dtype)
                place[f"snap.{s.name}"] = (0, memoryview(ex.flat(t)))
        return place, snap

    def upload_ready(self) -> None:
        """Upload every fetched chunk (a tight loop: no bookkeeping between copies)."""
        if not self.ready:
            return
        ex, L, chunks, flats, seg_rows = self.f.executor, self.f.layout, self.chunks, self.flats, self.seg_rows
        clock, cpu = time.perf_counter, time.thread_time
        self.uploads = True
        ops = []  # each node's rows land in their slice of the output
        for i, item in self.ready:
            x, r, _, o, cut, ntok = chunks[i]
            src, offs, dst = ex.source(item.buffer), item.offs, flats[r]
            for name, rb in seg_rows:
                ops += dst[name].ops(o * rb, src, offs[name] + cut * rb, ntok * rb)
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


@attrs.define(slots=True, eq=False)
class _Dest:
    """One output segment as bytes: ``flat`` (``ex.flat`` of the tensor, or of a
    ``Pieces``' memory) and the byte ranges of it the segment's bytes fill in order
    (``at``: where each begins in ``flat``; ``starts``: its first byte in the segment)."""

    flat: Any
    at: list[int]
    lens: list[int]
    starts: list[int]
    mv: memoryview | None = None

    @classmethod
    def of(cls, ex: Any, out: torch.Tensor | Pieces) -> _Dest:
        if not isinstance(out, Pieces):
            flat = ex.flat(out)
            return cls(flat, [0], [len(flat)], [0])
        es = out.memory.element_size()
        at = (out.spans[:, 0] * es).tolist()
        lens = (out.spans[:, 1] * es).tolist()
        starts = [0, *itertools.accumulate(lens)][:-1]
        return cls(ex.flat(out.memory), at, lens, starts)

    def ranges(self, lo: int, n: int) -> Iterator[tuple[int, int]]:
        """(offset in ``flat``, bytes) covering the segment's bytes ``[lo, lo + n)``."""
        if len(self.at) == 1:
            yield self.at[0] + lo, n
            return
        k = bisect.bisect_right(self.starts, lo) - 1
        end = lo + n
        while lo < end:
            inside = lo - self.starts[k]
            take = min(self.lens[k] - inside, end - lo)
            if take > 0:
                yield self.at[k] + inside, take
                lo += take
            k += 1

    def views(self, lo: int, n: int) -> memoryview | list[memoryview]:
        """The destination of a placed read of bytes ``[lo, lo + n)`` (``verify.Placement``)."""
        if len(self.at) == 1:
            a = self.at[0] + lo
            return memoryview(self.flat[a : a + n])
        if self.mv is None:
            self.mv = memoryview(self.flat)
        mv, at, lens, starts, end = self.mv, self.at, self.lens, self.starts, lo + n
        k0 = bisect.bisect_right(starts, lo) - 1
        k1 = bisect.bisect_left(starts, end, k0)  # spans k0..k1-1 hold [lo, end)
        out = [mv[a : a + k] for a, k in zip(at[k0:k1], lens[k0:k1], strict=True)]
        cut = end - starts[k1 - 1]  # the last span's bytes inside the range
        if cut < lens[k1 - 1]:
            out[-1] = out[-1][:cut]
        skip = lo - starts[k0]  # the first span's bytes before it
        if skip:
            out[0] = out[0][skip:]
        return out

    def ops(self, lo: int, src: Any, src_off: int, n: int) -> list[tuple[Any, int, Any, int, int]]:
        """``upload_batch`` ops copying ``src[src_off:]`` into bytes ``[lo, lo + n)``."""
        if len(self.at) == 1:
            return [(self.flat, self.at[0] + lo, src, src_off, n)]
        out = []
        for a, k in self.ranges(lo, n):
            out.append((self.flat, a, src, src_off, k))
            src_off += k
        return out


def _discard(item: Any) -> None:
    """Release the buffer of a fetch that will not be used (waiting for a running read)."""
    if isinstance(item, Future):
        try:
            item = item.result()
        except BaseException:
            return
    if isinstance(item, _Fetched):
        item.buffer.release()
