"""The engine: public API, journaled transactions and their orchestration.

Public API (section "public"): ``Engine.open``, ``store``, ``lookup``, ``restore``,
``pin`` / ``unpin`` / ``pinned``, ``evict``, ``reclaim``, ``retry_pending``,
``stats``, ``audit``, ``close``. Everything below "internal" is private.

Concurrency: one re-entrant lock guards the index, the catalog connection and the
pin/fence tables. File writes and reads of a store or restore run outside the lock,
with the nodes involved fenced (in flight) or pinned, so lookups never wait on I/O.

Every mutation is a transaction whose states are defined in
``prefixstore.statemachine.transactions``; ``_advance`` commits each state reached
before the effects of the next step run.
"""

from __future__ import annotations

import json
import os
import threading
import time
import uuid
from collections import Counter, deque
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from typing import Any

import attrs

from prefixstore.engine import cachedirs, dirlock, pipeline, readonly, recovery, tiering, validate
from prefixstore.engine.catalog import CATALOG_NAME, Catalog, drop_empty_log, log_files
from prefixstore.engine.counters import Counters, log
from prefixstore.engine.errors import (
    CapacityError,
    CatalogIOError,
    DiskFullError,
    EngineClosedError,
    InvalidInputError,
    LayoutMismatchError,
    NotACacheError,
    PrefixStoreError,
    ReadOnlyError,
    SimulatedCrash,
)
from prefixstore.engine.index import Index, Node
from prefixstore.engine.keys import DIGEST_SIZE, Prefix
from prefixstore.engine.layout import Layout, RankTensors
from prefixstore.engine.results import (
    DUPLICATE,
    FAILED,
    QUEUED,
    REFILLED,
    REFUSED,
    SKIPPED,
    STORED,
    Match,
    Restored,
    StoreResult,
)
from prefixstore.gpu import calibrate, tiers, verify
from prefixstore.gpu.diskroom import LOW_WATER, RESERVE_BYTES, DiskRoom, free_bytes
from prefixstore.gpu.executor import make_executor
from prefixstore.gpu.fileio import FaultHook, FileSystem, OsFS
from prefixstore.gpu.ranks import LocalRank, RankIO, rank_dir_name, shard_name
from prefixstore.statemachine import policy as pol
from prefixstore.statemachine.cost import CostModel, choose
from prefixstore.statemachine.transactions import MACHINES

LOCK_NAME = dirlock.LOCK_NAME
_FATAL = (SimulatedCrash, KeyboardInterrupt, SystemExit)
"""What a queued store's retry lets through to the call that ran it (process death)."""


@attrs.define
class _Pending:
    """A store refused for lack of space, retried while ``valid()`` holds."""

    prefix: Prefix
    segments: list[RankTensors]
    snapshot: list[RankTensors] | None
    tokens_from: int
    valid: Callable[[], bool]


@attrs.define
class _Plan:
    """Where a new checkpoint goes: its parent and the row it refills, if any."""

    parent: Node | None
    existing: Node | None
    start: int


class _Guard:
    """Every public call runs inside: refused once the engine is closed or closing (a
    call nested in one already running on this thread goes on), counted in flight for
    ``close``; a ``SimulatedCrash`` abandons the engine; an untyped error from a
    resource closed under the call becomes ``EngineClosedError``.

    One reusable object per engine (a class: cheaper than a generator on the request
    path); the per-call state is the thread's nesting depth, kept in ``eng._local``.
    """

    __slots__ = ("eng",)

    def __init__(self, eng: Engine) -> None:
        self.eng = eng

    def __enter__(self) -> None:
        eng = self.eng
        depth = getattr(eng._local, "depth", 0)
        with eng._calls_cv:
            if eng._closed or (eng._closing and not depth):
                raise EngineClosedError("engine is closed")
            eng._calls += 1
        eng._local.depth = depth + 1

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: Any) -> bool:
        eng = self.eng
        try:
            if kind is not None:
                if issubclass(kind, SimulatedCrash):
                    eng._abandon()
                elif issubclass(kind, Exception) and eng._closed and not isinstance(exc, PrefixStoreError):
                    # closed under the call (its catalog, pools, workers): a typed error
                    raise EngineClosedError(f"engine closed during the call ({kind.__name__})") from exc
            return False
        finally:
            eng._local.depth -= 1
            with eng._calls_cv:
                eng._calls -= 1
                if eng._closing:
                    eng._calls_cv.notify_all()


class Engine:
    """A prefix-cache host tier over a SQLite WAL catalog and per-rank shard files."""

    MAX_PENDING = 256
    """Refused stores kept for retry at most; the oldest is dropped (and counted) beyond."""
    _garbage_hint = True  # loose garbage may exist (set at open and by a failed unlink)
    disk_reserve_bytes = RESERVE_BYTES
    """Size of the catalog's reserve file (``gpu/diskroom.py``); 0 holds none."""
    read_only: DiskFullError | None = None
    """Why the engine was opened read-only (``engine/readonly.py``); None when writable."""
    unsettled: frozenset[int] = frozenset()
    """Read-only: the nodes held out of service (an unfinished transaction touches them)."""

    # ------------------------------------------------------------------ public

    @classmethod
    def open(cls, path: str | os.PathLike, layout: Layout, capacity_bytes: int, **opts: Any) -> Engine:
        """Open (creating if needed) the cache at ``path`` and recover it.

        Options: ``synchronous`` ('FULL' default, or 'NORMAL'), ``policy``
        ('prefixstore', 'leaf-lru', 'lru'), ``cost`` (a CostModel; None restores the
        deepest match), ``high_watermark`` / ``low_watermark`` (fractions of
        capacity: when a store would pass the high one, evict down to the low one),
        ``create`` (False refuses to create a new cache), ``fs`` / ``hook`` (effect
        layer for fault injection), ``ranks`` (RankIO objects, e.g. rank processes,
        or ``LocalRank(r, path)`` for rank directories kept elsewhere: the only way a
        rank directory may be a symlink; ``rankR/`` and ``lost+found/`` inside ``path``
        must be real directories, else UnsafeDirectoryError with nothing touched),
        ``registry`` (a prometheus CollectorRegistry), ``admission`` (callable
        deciding whether to admit a store), ``inflight_wait_s`` (how long a store waits
        for an overlapping store in flight before it is skipped as 'in_flight'),
        ``compaction`` (True or a ``statemachine.compaction.CompactionPolicy``: run the
        background compaction worker; see ``engine/compaction.py``), ``backing``
        ('disk' default, 'memory', 'composite'; see ``gpu/backings.py``) with
        ``ram_bytes`` (the RAM tier's budget), ``executor`` ('cpu' default, 'cuda',
        'cuda:N' or an executor object; see ``gpu/executor.py``), ``bandwidth`` (None,
        bytes/s, 'measure' or 'remeasure': the cost rule's restore bandwidth; see
        ``gpu/calibrate.py``), ``read_only_fallback`` (True default: on a full disk
        where nothing can be freed without a commit, open read-only, with the reason in
        ``read_only``, instead of raising DiskFullError; see ``engine/readonly.py``).
        """
        root = validate.open_args(cls, path, layout, capacity_bytes, opts)
        return cls(root, layout, capacity_bytes, **opts)

    def __init__(
        self,
        root: str,
        layout: Layout,
        capacity_bytes: int,
        *,
        synchronous: str = "FULL",
        policy: str = "prefixstore",
        cost: CostModel | None = None,
        high_watermark: float = 1.0,
        low_watermark: float = 1.0,
        create: bool = True,
        fs: FileSystem | None = None,
        hook: FaultHook | None = None,
        ranks: Sequence[RankIO] | None = None,
        registry: Any = None,
        admission: Any = None,
        inflight_wait_s: float = 30.0,
        compaction: Any = None,
        backing: str = "disk",
        ram_bytes: int | None = None,
        executor: Any = None,
        bandwidth: Any = None,
        read_only_fallback: bool = True,
    ) -> None:
        self.root = root
        self.layout = layout
        self.capacity = int(capacity_bytes)
        self.high_watermark, self.low_watermark = high_watermark, low_watermark
        self.cost = cost
        self.policy_name = policy
        self.admission = admission
        self.inflight_wait_s = inflight_wait_s
        self.hook = hook or FaultHook()
        self.fs = fs or OsFS()
        self.counters = Counters(registry)
        self.executor = make_executor(executor)
        self._lock = threading.RLock()
        self._settled = threading.Condition(self._lock)  # notified when a store finishes
        self._closed = False
        self._guarded = _Guard(self)
        self._closing = False  # close() started: new public calls are refused
        self._calls = 0  # public calls in flight, all threads (close waits for them)
        self._calls_cv = threading.Condition(threading.Lock())
        self._local = threading.local()  # .depth: this thread's nested public calls
        self._dir_lock: dirlock.DirLock | None = None
        self.identity = uuid.uuid4().hex  # carried by this engine's Matches (validate.match)
        self._pins: Counter[int] = Counter()  # every pin: pin()'s and running restores'
        self._request_pins: Counter[int] = Counter()  # the pins taken by pin() (a request holds them)
        self._fences: Counter[int] = Counter()
        # The part of _fences that queued async stores hold as reservations of the rows
        # they build on: no eviction or merge removes such a row, but no transaction is in
        # flight on it, so no store or compact-replace that keeps the row waits for it.
        self._reserved: Counter[int] = Counter()
        self._inflight_blocks: dict[bytes, int] = {}
        self._pending: deque[_Pending] = deque()
        self._retrying = False
        self._dirty_recency: set[int] = set()
        self.compaction_policy = None  # set by compaction.start_worker; compact() default
        self.compactor = None  # the background compaction worker, when enabled
        self.index = Index()
        self.heap = pol.VictimHeap(policy, layout.has_snapshot)
        self._watch_counters()
        self._check_root(create)
        self._take_lock()
        self.disk = DiskRoom(root, self.disk_reserve_bytes)
        logs = log_files(root)
        try:
            # before the catalog opens: a symlinked own directory is refused with nothing touched
            cachedirs.check_own_dirs(root, layout.ranks if ranks is None and backing != "memory" else 0)
            if ranks is None and self.disk.tight() and os.path.exists(os.path.join(root, CATALOG_NAME)):
                recovery.room_before_open(root, layout.ranks)
            self.catalog = Catalog(root, synchronous=synchronous, hook=self.hook, create=create,
                                   before_write=self.disk.before_catalog_write)
            try:
                self._check_layout()
                recovery.check_backing(self)
                self.backing = tiering.open_backing(self, backing, ram_bytes)
                self.ranks: list[RankIO] = list(ranks) if ranks is not None else [
                    LocalRank(r, os.path.join(root, rank_dir_name(r)), self.fs, self.hook)
                    for r in range(layout.ranks)
                ]
                self.ranks = self.backing.bind(self.ranks, given=ranks is not None)
                if len(self.ranks) != layout.ranks:
                    raise InvalidInputError(f"{len(self.ranks)} rank executors for {layout.ranks} ranks")
                self._pool = ThreadPoolExecutor(max_workers=max(1, layout.ranks), thread_name_prefix="rank")
                self.disk.bind(tiering.local_dirs(self.ranks), layout.ranks)
                self.recovery_report = recovery.recover(self)
                self._load()
                self._fit()
                self.calibration = calibrate.resolve(self, bandwidth)
                self.transfers = pipeline.Transfers(layout.ranks)
                from prefixstore.engine.compaction import start_worker

                self.compactor = start_worker(self, compaction)
            except BaseException:
                pool = getattr(self, "_pool", None)
                if pool is not None:
                    pool.shutdown(wait=False)
                self.catalog.close()
                raise
        except BaseException as exc:
            full = isinstance(exc, CatalogIOError) and self.disk.tight()
            reason = DiskFullError(
                f"{root}: the disk is full ({free_bytes(root)} bytes free, no reserve left, nothing "
                f"this cache can free without a catalog write): free {LOW_WATER} bytes on that "
                "file system and open again"
            ) if full else None
            if reason is not None and read_only_fallback and ranks is None and backing == "disk":
                try:
                    self._open_read_only(reason, bandwidth, logs)
                    return
                except (CatalogIOError, ReadOnlyError, OSError):
                    pass  # cannot even be read without writing: the disk-full error stands
                except BaseException:
                    self._release_lock()
                    raise
            self._release_lock()
            if reason is not None:
                raise reason from exc
            raise

    def _open_read_only(self, reason: DiskFullError, bandwidth: Any, logs: frozenset[str]) -> None:
        """Open this (locked) cache read-only: no recovery, no write (``engine/readonly.py``).
        ``logs``: the catalog's log files before the failed open (those it created are removed)."""
        drop_empty_log(self.root, logs)
        self.catalog = Catalog.open_read_only(self.root, reason, self.hook)
        try:
            self._check_layout()
            recovery.check_structure(self)
            if (self.catalog.meta(tiers.META_KEY) or "disk") != "disk":
                raise reason
            self.backing = tiering.open_backing(self, "disk", None)
            self.ranks = self.backing.bind([LocalRank(r, os.path.join(self.root, rank_dir_name(r)), self.fs, self.hook)
                                            for r in range(self.layout.ranks)], given=False)
            self._pool = ThreadPoolExecutor(max_workers=max(1, self.layout.ranks), thread_name_prefix="rank")
            self.disk.bind([r.directory for r in self.ranks], self.layout.ranks)
            self.recovery_report = recovery.RecoveryReport()
            self._load()
            self.unsettled = readonly.hold_out(self.catalog, self.index)
            self.calibration = calibrate.resolve(self, None if isinstance(bandwidth, str) else bandwidth)
            self.transfers = pipeline.Transfers(self.layout.ranks)
            self.compactor = None
        except BaseException:
            pool = getattr(self, "_pool", None)
            if pool is not None:
                pool.shutdown(wait=False)
            self.catalog.close()
            raise
        self.read_only = reason
        log.warning("opened_read_only", root=self.root, reason=str(reason), unsettled=len(self.unsettled))

    def _check_writable(self, call: str) -> None:
        """Raise ReadOnlyError naming the reason when the engine was opened read-only."""
        if self.read_only is not None:
            raise ReadOnlyError(f"{call}: {self.root} is open read-only: {self.read_only}", self.read_only)

    pin_wait_s = 2.0  # how long a refill waits for a restore's pin before it rolls back
    close_wait_s = 30.0  # how long close() waits for public calls in flight on other threads

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        if not self._closed:
            self.close()

    def store(
        self,
        prefix: Prefix,
        segments: RankTensors | Sequence[RankTensors],
        snapshot: RankTensors | Sequence[RankTensors] | None = None,
        *,
        tokens_from: int = 0,
        valid: Callable[[], bool] | None = None,
    ) -> StoreResult:
        """Store the checkpoint at the end of ``prefix``.

        ``segments`` (one mapping per rank; a bare mapping for one rank) hold the
        prefix's segment rows for tokens ``[tokens_from, len(prefix) * block_tokens)``;
        the engine keeps only the rows its new node needs. ``snapshot`` holds the
        recurrent state at the end (required iff the layout has snapshot tensors).
        ``valid``, when given, tells whether the caller's GPU checkpoint is still
        valid: a store refused for lack of space is then queued and retried until it
        fits or ``valid()`` turns false (then it is dropped and counted).
        """
        segs, snaps = self._check_store_input(prefix, segments, snapshot, tokens_from, valid)
        self._check_writable("store")
        with self._guard():
            result = self._store(prefix, segs, snaps, tokens_from)
            if result.status == REFUSED and valid is not None:
                self._enqueue(_Pending(prefix, segs, snaps, tokens_from, valid))
                result = attrs.evolve(result, status=QUEUED)
            if result.ok:
                self.retry_pending()
            return result

    def store_async(
        self,
        prefix: Prefix,
        segments: RankTensors | Sequence[RankTensors],
        snapshot: RankTensors | Sequence[RankTensors] | None = None,
        *,
        tokens_from: int = 0,
        valid: Callable[[], bool] | None = None,
    ) -> pipeline.StoreTicket:
        """Store like ``store``, returning as soon as the device-to-host copies are queued.

        The ticket's ``released`` (``is_set()`` / ``wait()``) says when the device
        tensors may be released or overwritten (before the durable commit);
        ``result()`` gives the ``StoreResult`` once the commit worker has stored the
        staged bytes (journaled exactly as ``store``). Bad input raises here. A store
        refused for space with ``valid`` given is queued with its staged host copy
        (the device tensors are never read again), retried while ``valid()`` holds.
        """
        self._check_writable("store_async")
        return pipeline.store_async(self, prefix, segments, snapshot, tokens_from, valid)

    def lookup(self, prefix: Prefix, *, gpu_blocks: int = 0, total_tokens: int | None = None) -> Match:
        """The deepest checkpoint of ``prefix`` worth restoring.

        ``gpu_blocks``: leading blocks already resident on the GPU (not restored).
        ``total_tokens``: the request's length (for the cost rule; default the prefix).
        Only nodes whose whole path below the GPU-resident part is ready qualify, and
        for layouts with snapshots only nodes that have their snapshot.
        """
        validate.lookup_args(self, prefix, gpu_blocks, total_tokens)
        with self._guard(), self._lock:
            match = self._lookup(prefix, gpu_blocks, total_tokens)
        self.counters.inc("lookups", match.outcome)
        return match

    def restore(self, match: Match) -> Restored | None:
        """Read, verify and return the tensors of ``match``; None on a miss.

        A shard that is missing, short, or fails its checksum or header check marks
        its node damaged and the restore reports a miss: other bytes are never
        returned.
        """
        validate.match(self, match)
        if not match.hit:
            return None
        with self._guard():
            return self._restore(match)

    def pin(self, match: Match) -> bool:
        """Pin every node of ``match`` (never evicted or replaced until unpinned)."""
        validate.match(self, match)
        with self._guard(), self._lock:
            if not self._path_current(match):
                return False
            for nid, _ in match.path:
                self._pins[nid] += 1
                self._request_pins[nid] += 1
            return True

    def unpin(self, match: Match) -> None:
        """Release a pin taken by ``pin``; unpinning what is not pinned is an error."""
        validate.match(self, match)
        with self._guard():
            with self._lock:
                for nid, _ in match.path:
                    if self._request_pins[nid] <= 0:
                        raise InvalidInputError(f"node {nid} is not pinned")
                for nid, _ in match.path:
                    for pins in (self._pins, self._request_pins):
                        pins[nid] -= 1
                        if not pins[nid]:
                            del pins[nid]
            self.retry_pending()

    @contextmanager
    def pinned(self, match: Match) -> Iterator[bool]:
        """Context manager: pin ``match`` for the duration of the block."""
        ok = self.pin(match)
        try:
            yield ok
        finally:
            if ok:
                self.unpin(match)

    def evict(self, nbytes: int | None = None, *, prefix: Prefix | None = None) -> int:
        """Reclaim space: ``nbytes`` by policy, or the node at the end of ``prefix``
        (a leaf is evicted; an interior node refuses). Returns bytes freed."""
        nbytes, prefix = validate.evict_args(self, nbytes, prefix)
        self._check_writable("evict")
        with self._guard():
            with self._lock:
                before = self._charged
                if prefix is not None:
                    nid = self.index.by_key.get(prefix.keys[-1]) if len(prefix) else None
                    node = self.index.get(nid) if nid is not None else None
                    if node is None:
                        return 0
                    if self._blocked(node.id, pol.EVICT) or not node.is_leaf:
                        return 0
                    self._evict_nodes([node])
                    self.counters.evicted(pol.EVICT, before - self._charged)
                elif nbytes is not None:
                    self._free(min(self._charged, nbytes))
                freed = before - self._charged
            self.retry_pending()
            return freed

    def reclaim(self) -> int:
        """Unlink garbage left by failed cleanups (then retry queued stores); returns
        bytes reclaimed."""
        self._check_writable("reclaim")
        with self._guard():
            with self._lock:
                before = self._charged
                self._reclaim_loose()
                freed = before - self._charged
            self.retry_pending()
            return freed

    def compact(self, policy: Any = None):
        """Run one compaction pass now: merge single-child chains where ``policy`` (a
        ``CompactionPolicy``; default the engine's) says it pays. Reads and writes run
        outside the engine lock. Returns a ``compaction.CompactionReport``."""
        from prefixstore.engine import compaction

        validate.compact_policy(policy)
        self._check_writable("compact")
        return compaction.compact(self, policy)

    def retry_pending(self) -> None:
        """Retry queued stores: drop those no longer valid, store those that now fit.

        Runs after every call that frees space or settles a store (a successful
        store, ``unpin``, ``evict``, ``reclaim``). Counted as ``retries.*``:
        ``succeeded``, ``dropped`` (``valid()`` false or raising), ``superseded``
        (stored meanwhile, or queued again), ``abandoned`` (failed, or no longer
        storable from the rows held, e.g. its parent went, or raised unexpectedly:
        logged, never raised into the call that ran the retry), ``overflow``. Only
        process death (``SimulatedCrash``, ``KeyboardInterrupt``, ``SystemExit``)
        propagates.
        """
        if not self._pending and not self._closed:  # the common case, without the lock
            return
        with self._guard():
            with self._lock:
                if self._retrying or not self._pending:
                    return
                self._retrying = True
                todo = list(self._pending)
                self._pending.clear()
            keep: list[_Pending] = []
            i = 0
            try:
                while i < len(todo):
                    p = todo[i]
                    i += 1
                    try:
                        event, reason = self._retry_one(p)
                    except BaseException as exc:  # the retry's failure, not its caller's
                        self.counters.inc("retries", "abandoned")
                        log.warning("store_retry", outcome="abandoned", reason=f"{type(exc).__name__}: {exc}",
                                    blocks=len(p.prefix), key=p.prefix.keys[-1].hex()[:12])
                        if isinstance(exc, _FATAL):
                            raise
                        continue
                    if event == "kept":
                        keep.append(p)
                        continue
                    self.counters.inc("retries", event)
                    log.info("store_retry", outcome=event, reason=reason, blocks=len(p.prefix),
                             key=p.prefix.keys[-1].hex()[:12])
            finally:
                with self._lock:
                    self._pending.extendleft(reversed(keep + todo[i:]))
                    self._retrying = False

    def _retry_one(self, p: _Pending) -> tuple[str, str | None]:
        """Retry one queued store: ('kept' | 'succeeded' | 'dropped' | 'superseded' |
        'abandoned', reason)."""
        try:
            still_valid = bool(p.valid())
        except BaseException as exc:  # the caller's check failing means the checkpoint is gone
            if isinstance(exc, _FATAL):
                raise
            return "dropped", f"valid() raised {type(exc).__name__}"
        if not still_valid:
            return "dropped", "invalid"
        try:
            r = self._store(p.prefix, p.segments, p.snapshot, p.tokens_from)
        except InvalidInputError as exc:  # e.g. its parent went: the rows held start too late
            return "abandoned", str(exc)
        if r.status == REFUSED:
            return "kept", None
        if r.status in (STORED, REFILLED):
            return "succeeded", None
        if r.status == DUPLICATE:
            return "superseded", None
        return "abandoned", r.reason or r.status

    def _enqueue(self, p: _Pending) -> None:
        """Queue a refused store; a queued store of the same checkpoint is superseded."""
        key = p.prefix.keys[-1]
        events: list[str] = []
        with self._lock:
            for old in list(self._pending):
                if old.prefix.keys[-1] == key:
                    self._pending.remove(old)
                    events.append("superseded")
            self._pending.append(p)
            while len(self._pending) > self.MAX_PENDING:
                self._pending.popleft()
                events.append("overflow")
        self.counters.inc("retries", "queued")
        for event in events:
            self.counters.inc("retries", event)

    def stats(self) -> dict[str, Any]:
        """Counters, capacity and node counts as one dict."""
        with self._guard(), self._lock:
            by_status = dict(
                self.catalog.query("SELECT status, coalesce(sum(size),0) FROM files GROUP BY status")
            )
            damaged = self.catalog.query(
                "SELECT coalesce(sum(f.size),0) FROM files f JOIN nodes n ON f.node=n.id "
                "WHERE n.state='damaged'"
            )[0][0]
            snap_nodes = sum(1 for n in self.index if n.has_snapshot)
            out = {
                "capacity_bytes": self.capacity,
                "charged_bytes": self._charged,
                "live_bytes": by_status.get("live", 0),
                "writing_bytes": by_status.get("writing", 0),
                "garbage_bytes": by_status.get("garbage", 0),
                "damaged_bytes": damaged,
                "snapshot_bytes_used": snap_nodes * self.layout.snapshot_bytes * self.layout.ranks,
                "nodes": len(self.index),
                "nodes_damaged": sum(1 for n in self.index if n.state == "damaged"),
                "pinned": len(self._pins),
                "fenced": len(self._fences),
                "pending_retries": len(self._pending),
                "counters": self.counters.snapshot(),
                "last_decision": self.counters.last_decision,
                "backing": tiering.stats(self),
                "disk": self.disk.stats(),
                "read_only": None if self.read_only is None else str(self.read_only),
                "nodes_unsettled": len(self.unsettled),
                "transfers": {**self.transfers.stats(), "copies": self.executor.stats.snapshot(),
                              "staging_pool": self.executor.pool.stats(), "calibration": self.calibration},
            }
        self.counters.set_bytes(
            capacity=self.capacity, charged=out["charged_bytes"], damaged=damaged,
            garbage=out["garbage_bytes"], snapshot_used=out["snapshot_bytes_used"],
        )
        return out

    def audit(self, *, checksums: bool = True):
        """Check every invariant against this engine's directory (and its memory)."""
        from prefixstore.engine.audit import audit_engine

        validate.flag("checksums", checksums)
        with self._guard(), self._lock:
            return audit_engine(self, checksums=checksums)

    def close(self) -> None:
        """Flush recency, close the catalog and release the directory lock.

        Queued asynchronous stores commit first. Then new calls are refused
        (``EngineClosedError``) and calls in flight on other threads are waited for,
        up to ``close_wait_s``; one still running after that fails with
        ``EngineClosedError`` if it needs what close released (an unpublished
        transaction of it is left to recovery at the next open, as after a crash).
        """
        if self._closed:
            return
        if self.transfers.commit.current or self.transfers.retry.current:
            # e.g. from a queued store's valid() callback: draining would wait for itself
            raise InvalidInputError("close() cannot run inside the engine's own commit or retry worker")
        self.transfers.drain()  # outside the lock: queued async stores commit first
        if self.compactor is not None:
            self.compactor.stop()  # outside the lock: the worker may be waiting for it
        deadline = time.monotonic() + self.close_wait_s
        self._quiesce(deadline)
        # Jobs queued since the drain are refused by the guard; let them release what they hold.
        self.transfers.drain(max(0.0, deadline - time.monotonic()))
        with self._lock:
            if self._closed:  # abandoned meanwhile (a simulated crash)
                return
            try:
                if self.read_only is None:
                    self._flush_recency()
            finally:
                self._shutdown()

    # ------------------------------------------------------------------ internal: setup

    def _check_root(self, create: bool) -> None:
        if os.path.exists(self.root) and not os.path.isdir(self.root):
            raise NotACacheError(f"{self.root} is not a directory")
        if os.path.isdir(self.root):
            entries = set(os.listdir(self.root))
            if entries and CATALOG_NAME not in entries:
                raise NotACacheError(f"{self.root} is not empty and holds no prefixstore catalog")
        elif not create:
            raise NotACacheError(f"{self.root} does not exist")
        os.makedirs(self.root, exist_ok=True)

    def _take_lock(self) -> None:
        self._dir_lock = dirlock.acquire(self.root, "is open in another engine")

    def _release_lock(self) -> None:
        if self._dir_lock is not None:
            self._dir_lock.release()
            self._dir_lock = None

    def _check_layout(self) -> None:
        stored = self.catalog.meta("layout")
        if stored is None:
            with self.catalog.txn("init") as c:
                self.catalog.set_meta(c, "layout", self.layout.to_json())
                self.catalog.set_meta(c, "capacity", str(self.capacity))
            return
        created = Layout.from_json(stored)
        if created != self.layout:
            raise LayoutMismatchError(
                f"{self.root} was created with another layout (created vs given: "
                f"{'; '.join(created.differences(self.layout))})"
            )
        if self.catalog.meta("capacity") != str(self.capacity) and self.catalog.read_only is None:
            with self.catalog.txn("capacity") as c:
                self.catalog.set_meta(c, "capacity", str(self.capacity))

    def _load(self, keep: bool = False) -> None:
        """Build the index (and charged bytes, clock, victim heap) from the catalog.

        ``keep``: reload a running engine (after a transaction that failed past its
        publish). The Node object of every row that remains is kept and updated in
        place, with its in-memory recency when newer, so operations in flight that
        hold it (a store refilling it, a restore that pinned it) stay on the index's
        own node; pins and fences are keyed by id and untouched. Lock held.
        """
        old = self.index.nodes if keep else {}
        self.index = Index()
        sizes = dict(
            self.catalog.query(
                "SELECT node, sum(size) FROM files WHERE status='live' AND node IS NOT NULL GROUP BY node"
            )
        )
        rows = self.catalog.query(
            "SELECT id, key, parent, start_block, end_block, digests, has_snapshot, state, "
            "generation, last_used, snap_used FROM nodes ORDER BY end_block, id"
        )
        clock = self._clock if keep else 0
        for r in rows:
            node = Node(
                id=r[0], key=bytes(r[1]), parent=r[2], start=r[3], end=r[4], digests=bytes(r[5]),
                has_snapshot=bool(r[6]), state=r[7], generation=r[8], last_used=r[9],
                snap_used=r[10], nbytes=sizes.get(r[0], 0),
            )
            prev = old.get(node.id)
            if prev is not None and prev.key == node.key:
                node.last_used = max(node.last_used, prev.last_used)
                node.snap_used = max(node.snap_used, prev.snap_used)
                for f in attrs.fields(Node):
                    setattr(prev, f.name, getattr(node, f.name))
                node = prev
            self.index.add(node)
            clock = max(clock, node.last_used, node.snap_used)
        self._clock = clock
        self._charged = self.catalog.charged()
        self.heap.rebuild(self.index)

    def _fit(self) -> None:
        """At open: evict by policy (journaled) until the charged bytes fit the capacity
        and the disk has the catalog's margin; take the disk reserve back if it fits. Raises
        CapacityError when the capacity cannot be reached."""
        with self._lock:
            over = max(self._charged - self.capacity, self.disk.shortfall(0, reserve=False))
            if over > 0:
                freed = self._free(over)
                self.recovery_report.evicted += freed
                log.info("open_evicted", bytes=freed, charged=self._charged, capacity=self.capacity)
            if self._charged > self.capacity:
                raise CapacityError(
                    f"{self.root}: {self._charged} bytes stay charged after evicting what open "
                    f"can, above capacity_bytes={self.capacity}; open with a larger capacity"
                )
            self.disk.restore()

    # ------------------------------------------------------------------ internal: guards

    def _guard(self) -> _Guard:
        """Every public call runs inside (see ``_Guard``)."""
        return self._guarded

    def _quiesce(self, deadline: float) -> None:
        """Refuse new public calls; wait until those in flight on other threads end
        (or ``deadline``, a ``time.monotonic()`` value, passes)."""
        mine = getattr(self._local, "depth", 0)  # close() called from inside a call
        with self._calls_cv:
            self._closing = True
            while self._calls > mine:
                left = deadline - time.monotonic()
                if left <= 0:
                    log.warning("close_timeout", in_flight=self._calls - mine)
                    return
                self._calls_cv.wait(left)

    def _abandon(self) -> None:
        """Model process death: drop the connection (uncommitted work rolls back)."""
        self._shutdown()

    def _shutdown(self) -> None:
        self._closed = True
        transfers = getattr(self, "transfers", None)
        if transfers is not None:
            transfers.stop(wait=False)
        pool = getattr(self, "_pool", None)
        if pool is not None:
            pool.shutdown(wait=False, cancel_futures=True)
        cat = getattr(self, "catalog", None)
        if cat is not None:
            cat.close()
        self._release_lock()

    def _tick(self) -> int:
        self._clock += 1
        return self._clock

    # ------------------------------------------------------------------ internal: journal

    def _journal_begin(self, c, kind: str, payload: dict[str, Any]) -> int:
        state = MACHINES[kind].initial
        cur = c.execute(
            "INSERT INTO journal(kind, state, payload) VALUES(?, ?, ?)", (kind, state, json.dumps(payload))
        )
        return int(cur.lastrowid)

    def _advance(self, c, tid: int, kind: str, state: str, event: str) -> str:
        """Move transaction ``tid`` along its table inside the open catalog txn ``c``."""
        nxt = MACHINES[kind].next(state, event)
        if MACHINES[kind].is_final(nxt):
            c.execute("DELETE FROM journal WHERE id=?", (tid,))
        else:
            c.execute("UPDATE journal SET state=? WHERE id=?", (nxt, tid))
        return nxt

    # ------------------------------------------------------------------ internal: store

    def _check_store_input(self, prefix, segments, snapshot, tokens_from, valid=None):
        """``store`` / ``store_async``'s arguments: per-rank (segments, snapshot or None)."""
        return validate.store_args(self, prefix, segments, snapshot, tokens_from, valid)

    def _plan(self, prefix: Prefix, held: frozenset[int] = frozenset()) -> _Plan | StoreResult:
        """Where the store of ``prefix`` goes, or why it does not. ``held``: nodes the
        caller fences itself (an async store's peek), not counted as busy. Lock held."""
        n = len(prefix)
        keys = prefix.keys
        p = self.index.deepest_block(keys, n)
        owner = self.index.owner(keys, p)
        if owner is not None and owner.end != p:
            # Inside an existing node's span: spans.on_store splits ready nodes first;
            # this is left for a damaged one (or one changed since).
            return StoreResult(SKIPPED, n, "inside_span")
        existing = owner if (owner is not None and p == n) else None
        parent = owner if existing is None else self.index.get(existing.parent) if existing.parent is not None else None
        if existing is not None:
            if existing.ready and (existing.has_snapshot or not self.layout.has_snapshot):
                return StoreResult(DUPLICATE, n, "duplicate")
            if self._pins[existing.id] or self._fenced(existing.id, held):
                return StoreResult(SKIPPED, n, "pinned" if self._pins[existing.id] else "fenced")
        start = parent.end if parent is not None else 0
        if any(k in self._inflight_blocks for k in keys[start:n]):
            return StoreResult(SKIPPED, n, "in_flight")
        return _Plan(parent, existing, start)

    def _store(
        self, prefix: Prefix, segs, snaps, tokens_from: int, staged=None, held: frozenset[int] = frozenset()
    ) -> StoreResult:
        """``staged``: shards already staged by ``store_async`` for the plan it saw (the
        caller releases them); used when the plan still matches, else staged again.
        ``held``: nodes ``store_async`` reserved at its peek, fenced by its job (one
        fence each, its own): the store refills or replaces them as ``store`` would."""
        L = self.layout
        n = len(prefix)
        from prefixstore.engine import spans  # split / republish / row refill (compact-replace)

        if (res := spans.on_store(self, prefix, segs, snaps, tokens_from, held)) is not None:
            return res
        with self._lock:
            plan = self._plan(prefix, held)
            deadline = time.monotonic() + self.inflight_wait_s
            while isinstance(plan, StoreResult) and plan.reason == "in_flight":
                # An overlapping store is in flight: wait for it to settle, then re-plan.
                left = deadline - time.monotonic()
                if left <= 0 or self._closed:
                    break
                self._settled.wait(left)
                plan = self._plan(prefix, held)
            if isinstance(plan, StoreResult):
                self._count_store(plan)
                return plan
            if self.admission is not None and plan.existing is None and not self.admission(self, prefix, plan):
                res = StoreResult(SKIPPED, n, "admission")
                self._count_store(res)
                return res
            start = plan.start
            if tokens_from > start * L.block_tokens:
                raise InvalidInputError(
                    f"the new node needs tokens from {start * L.block_tokens}, "
                    f"but segments start at tokens_from={tokens_from}"
                )
            down = self._ranks_down()
            if down:  # fail fast: no eviction or intent for a store that cannot be durable
                res = StoreResult(FAILED, n, f"rank(s) {down} unavailable")
                self.counters.inc("stores", FAILED)
                return res
            key = prefix.keys[-1]
            gen = self._next_generation(key, plan.existing.generation if plan.existing else 0)
            name = shard_name(key, gen)
            lo = start * L.block_tokens - tokens_from
            hi = n * L.block_tokens - tokens_from
            meta = self._shard_meta(key, gen, start, n, L.has_snapshot)
            # Zero-copy: each rank's tensors go straight into a buffer laid out as its file.
            datas = pipeline.stage_store(self, staged, meta, segs, snaps, lo, hi)
            owned = [] if datas is staged else datas  # released below; the caller's are its own
            try:  # a failed space step or intent commit must not strand the buffers
                needed = sum(d.size for d in datas)
                protect = {x.id for x in (plan.parent, plan.existing) if x is not None}
                if not self._make_space(needed, protect):
                    pipeline.release(owned)
                    res = StoreResult(REFUSED, n, "no_space", needed)
                    self._count_store(res)
                    return res
                payload = {
                    "key": key.hex(), "generation": gen, "name": name, "start": start, "end": n,
                    "parent": plan.parent.id if plan.parent else None,
                    "node": plan.existing.id if plan.existing else None,
                }
                with self.catalog.txn("store.intent") as c:
                    tid = self._journal_begin(c, "store", payload)
                    c.executemany(
                        "INSERT INTO files(rank, name, node, generation, size, checksum, status, txn) "
                        "VALUES(?, ?, NULL, ?, ?, ?, 'writing', ?)",
                        [(r, name, gen, d.size, d.checksum(), tid) for r, d in enumerate(datas)],
                    )
            except BaseException:
                pipeline.release(owned)
                raise
            self._charged += needed
            for k in prefix.keys[start:n]:
                self._inflight_blocks[k] = tid
            for x in protect:
                self._fences[x] += 1
        try:
            errors = self._write_all(name, datas)
            if errors:
                with self._lock:
                    self._rollback(tid, "store", "INTENT", "failed")
                self._check_prior(plan, {r for r, _ in errors})
                self.counters.inc("stores", FAILED)
                return StoreResult(FAILED, n, "; ".join(f"rank {r}: {e}" for r, e in errors), needed)
            # A refilled row pinned by a restore is never replaced under the pin
            # (invariant 6): wait for the pin to go, up to pin_wait_s, else roll back
            # (at once when pin() holds it: a request's pin is not waited for).
            deadline = time.monotonic() + self.pin_wait_s
            while True:
                with self._lock:
                    if plan.existing is None or not self._pins[plan.existing.id]:
                        digests = b"".join(prefix.digests[start:n])
                        was_damaged = plan.existing is not None and plan.existing.state == "damaged"
                        node = self._publish_store(tid, plan, key, digests, start, n, gen, needed)
                        status = REFILLED if plan.existing is not None else STORED
                        if was_damaged:
                            self.counters.inc("refills")
                        self.counters.inc("stores", status)
                        log.debug("stored", key=key.hex()[:12], blocks=n, node=node.id, bytes=needed)
                        return StoreResult(status, n, None, needed)
                    if time.monotonic() >= deadline or self._request_pins[plan.existing.id]:
                        self._rollback(tid, "store", "INTENT", "failed")
                        res = StoreResult(SKIPPED, n, "pinned", needed)
                        self._count_store(res)
                        return res
                time.sleep(0.002)
        except BaseException as exc:  # not a failed write (those roll back above): end the txn
            pipeline.fail_txn(self, tid, exc)
            raise
        finally:
            pipeline.release(owned)
            with self._lock:
                for k in prefix.keys[start:n]:
                    if self._inflight_blocks.get(k) == tid:
                        del self._inflight_blocks[k]
                for x in protect:
                    self._fences[x] -= 1
                    if not self._fences[x]:
                        del self._fences[x]
                self._settled.notify_all()

    def _fenced(self, nid: int, held: frozenset[int] = frozenset()) -> bool:
        """Whether a transaction other than the caller's fences node ``nid`` (the
        caller holds one fence on each node in ``held``; reservations do not count)."""
        return self._fences[nid] - self._reserved[nid] > (nid in held)

    def _count_store(self, res: StoreResult) -> None:
        if res.status in (SKIPPED, DUPLICATE, REFUSED):
            self.counters.inc("skips", res.reason or res.status)

    def _shard_meta(self, key: bytes, gen: int, start: int, end: int, snap: bool) -> dict[str, str]:
        return {"key": key.hex(), "generation": str(gen), "start": str(start), "end": str(end),
                "snapshot": "1" if snap else "0"}

    def _write_all(self, name: str, datas: list[bytes]) -> list[tuple[int, OSError]]:
        """Write ``name`` on every rank (in parallel); return the ranks that failed."""
        self._check_writable("write")
        if len(datas) == 1:
            try:
                pipeline.write_shard(self, 0, name, datas[0])
                return []
            except OSError as exc:
                self.counters.inc("faults", "write")
                return [(0, exc)]
        futures = [self._pool.submit(pipeline.write_shard, self, r, name, d) for r, d in enumerate(datas)]
        errors: list[tuple[int, OSError]] = []
        crash: BaseException | None = None
        for r, f in enumerate(futures):
            try:
                f.result()
            except OSError as exc:
                self.counters.inc("faults", "write")
                errors.append((r, exc))
            except BaseException as exc:  # a crash or a bug in a rank: re-raised below
                crash = crash or exc
        if crash is not None:
            raise crash
        return errors

    def _publish_store(self, tid, plan: _Plan, key, digests, start, end, gen, needed) -> Node:
        now = self._tick()
        with self.catalog.txn("store.publish") as c:
            old = []
            if plan.existing is not None:
                node = plan.existing
                old = c.execute(
                    "SELECT rank, name, size FROM files WHERE node=? AND status='live'", (node.id,)
                ).fetchall()
                c.execute(
                    "UPDATE files SET status='garbage', node=NULL, txn=? WHERE node=? AND status='live'",
                    (tid, node.id),
                )
                c.execute(
                    "UPDATE nodes SET state='ready', generation=?, has_snapshot=?, last_used=?, "
                    "snap_used=? WHERE id=?",
                    (gen, int(self.layout.has_snapshot), now, now, node.id),
                )
                nid = node.id
            else:
                cur = c.execute(
                    "INSERT INTO nodes(key, parent, start_block, end_block, digests, has_snapshot, "
                    "state, generation, last_used, snap_used) VALUES(?, ?, ?, ?, ?, ?, 'ready', ?, ?, ?)",
                    (key, plan.parent.id if plan.parent else None, start, end, digests,
                     int(self.layout.has_snapshot), gen, now, now),
                )
                nid = int(cur.lastrowid)
            c.execute(
                "UPDATE files SET status='live', node=?, txn=NULL WHERE txn=? AND status='writing'",
                (nid, tid),
            )
            state = self._advance(c, tid, "store", "INTENT", "durable")
            if not old:
                state = self._advance(c, tid, "store", state, "retired")
            self._flush_recency(c)
        if plan.existing is not None:
            node = plan.existing
            node.state, node.generation, node.has_snapshot = "ready", gen, self.layout.has_snapshot
            node.last_used = node.snap_used = now
            node.nbytes = needed
        else:
            node = Node(id=nid, key=key, parent=plan.parent.id if plan.parent else None, start=start,
                        end=end, digests=digests, has_snapshot=self.layout.has_snapshot, state="ready",
                        generation=gen, last_used=now, snap_used=now, nbytes=needed)
            self.index.add(node)
            if plan.parent is not None:
                self.heap.offer(plan.parent)
        self.heap.offer(node)
        if old:
            self._finish_retire(tid, "store", old)
        return node

    def _finish_retire(self, tid: int, kind: str, rows) -> None:
        """Unlink a published transaction's retired files, then end it."""
        self.catalog.barrier()
        left = self._unlink_rows(rows)
        with self.catalog.txn(f"{kind}.retired") as c:
            for r, name, _size in rows:
                if (r, name) in left:
                    c.execute("UPDATE files SET txn=NULL WHERE rank=? AND name=?", (r, name))
                else:
                    c.execute("DELETE FROM files WHERE rank=? AND name=?", (r, name))
            if kind == "evict":
                self._advance(c, tid, kind, "REMOVED", "reclaim_failed" if left else "reclaimed")
            else:
                self._advance(c, tid, kind, "PUBLISHED", "retire_failed" if left else "retired")
        self._charged -= sum(size for r, name, size in rows if (r, name) not in left)

    def _unlink_rows(self, rows) -> set[tuple[int, str]]:
        """Remove the files of ``rows`` on their ranks; return those that failed."""
        self._check_writable("unlink")
        failed: set[tuple[int, str]] = set()
        touched: set[int] = set()
        for r, name, _size in rows:
            try:
                self.ranks[r].remove(name)
                touched.add(r)
            except OSError:
                self.counters.inc("faults", "unlink")
                failed.add((r, name))
                self._garbage_hint = True
        for r in sorted(touched):
            try:
                self.ranks[r].sync_dir()
            except OSError:
                self.counters.inc("faults", "fsync_dir")
        return failed

    def _rollback(self, tid: int, kind: str, state: str, event: str) -> None:
        """Drive a transaction that had not published back to its previous record."""
        if state == "INTENT":
            with self.catalog.txn(f"{kind}.rollback") as c:
                c.execute("UPDATE files SET status='garbage' WHERE txn=?", (tid,))
                state = self._advance(c, tid, kind, state, event)
        rows = self.catalog.query("SELECT rank, name, size FROM files WHERE txn=?", (tid,))
        left = self._unlink_rows(rows)
        with self.catalog.txn(f"{kind}.cleaned") as c:
            for r, name, _ in rows:
                if (r, name) in left:
                    c.execute("UPDATE files SET txn=NULL WHERE rank=? AND name=?", (r, name))
                else:
                    c.execute("DELETE FROM files WHERE rank=? AND name=?", (r, name))
            self._advance(c, tid, kind, state, "cleanup_failed" if left else "cleaned")
        self._charged -= sum(size for r, name, size in rows if (r, name) not in left)

    def _check_prior(self, plan: _Plan, failed: set[int]) -> None:
        """After a store failed on ranks ``failed``, verify the prior record: the node
        it would have replaced and its parent (both still fenced by the caller).

        Every rank's shard is stat'ed (missing, short); on the failing ranks, whose
        disks the failure puts in doubt, it is re-read and checksummed (altered). A
        node found damaged is invalidated: descendants keep their links, its files
        stay charged until it is refilled or evicted. A rank that cannot answer (an
        I/O error, a rank process down) proves nothing and is skipped. Runs outside
        the engine lock.
        """
        for node in (plan.existing, plan.parent):
            if node is None:
                continue
            with self._lock:
                if node.state != "ready" or self.index.get(node.id) is not node:
                    continue
                gen = node.generation
                rows = {
                    r: (name, size, ck)
                    for r, name, size, ck in self.catalog.query(
                        "SELECT rank, name, size, checksum FROM files WHERE node=? AND status='live'",
                        (node.id,),
                    )
                }
            why = self._verify_shards(rows, failed)
            if why is None:
                continue
            with self._lock:
                if node.state == "ready" and node.generation == gen and self.index.get(node.id) is node:
                    self._invalidate(node, why)

    def _verify_shards(self, rows: dict[int, tuple[str, int, str]], deep: set[int]) -> str | None:
        """What is wrong with a node's shards (None: nothing found). Ranks in ``deep``
        are read and checksummed, the others stat'ed."""
        if set(rows) != set(range(self.layout.ranks)):
            return f"shards recorded on ranks {sorted(rows)}"

        def one(r: int) -> str | None:
            name, size, ck = rows[r]
            got = (verify.stat(self.ranks[r], name, size) if r not in deep
                   else verify.read(self.ranks[r], name, size, ck))
            if isinstance(got, verify.Transient):
                self.counters.inc("faults", "verify")
            return f"rank {r}: {got.why}" if isinstance(got, verify.Damage) else None

        found = [one(0)] if self.layout.ranks == 1 else list(self._pool.map(one, range(self.layout.ranks)))
        return next((w for w in found if w), None)

    def _ranks_down(self) -> list[int]:
        """Ranks whose executor says it cannot serve now (a rank process down)."""
        return tiering.ranks_down(self.ranks)

    def _next_generation(self, key: bytes, floor: int) -> int:
        """A generation above ``floor`` and above every file row of ``key``: garbage
        left by a failed cleanup keeps its name until reclaimed."""
        from prefixstore.engine import replace

        return replace._next_gen(self, key, floor)

    # ------------------------------------------------------------------ internal: space

    def _make_space(self, needed: int, protect: set[int]) -> bool:
        """Make room for ``needed`` more charged bytes; False when it cannot fit.

        Below the high watermark nothing is evicted. Above it, victims go until the
        charged bytes plus ``needed`` plus the retirement headroom reach the low
        watermark (best effort; success needs only ``needed`` to fit). A checkpoint
        that could not fit even if every byte not held by a pin, a fence or
        ``protect`` were freed is refused before anything is evicted. ``protect`` (the
        store's parent and refilled row) is fenced meanwhile, so nothing reached from
        the eviction (a retirement's effects, their hooks) can take it either.

        The disk is the other limit: victims also go until the file systems have room
        for the new shards plus the catalog's room (``gpu/diskroom.py``), whatever
        the capacity says; a store the disk cannot hold is refused.
        """
        cap = self.capacity
        reserve = self._retire_reserve(protect)
        short = self.disk.shortfall(needed)
        if not short and self._charged + needed + reserve <= cap * self.high_watermark:
            self.disk.restore()
            return True
        if needed > cap - self._held_bytes(protect):
            return False
        target = max(0.0, min(cap * self.low_watermark, cap) - needed - reserve)
        target = min(target, self._charged - short)
        for x in protect:
            self._fences[x] += 1
        try:
            self._free(self._charged - target, protect)
        finally:
            for x in protect:
                self._fences[x] -= 1
                if not self._fences[x]:
                    del self._fences[x]
        if self.disk.shortfall(needed):
            return False
        self.disk.restore()
        return self._charged + needed <= cap

    def _retire_reserve(self, protect: set[int]) -> int:
        """Headroom kept free so a snapshot retirement (which writes the new
        segment-only generation before the old one is freed) is not blocked by room.

        The rewrite of the largest retirement candidate, counting the protected parent
        of the store in progress (it becomes one), at most an eighth of capacity.
        """
        if not self.heap.retires:
            return 0
        biggest = self.heap.largest_retire(self.index.get)
        for nid in protect:
            node = self.index.get(nid)
            if node is not None and node.ready and node.has_snapshot:
                biggest = max(biggest, node.nbytes)
        snap = self.layout.ranks * self.layout.snapshot_bytes
        return min(pol.retire_rewrite_bytes(biggest, snap), self.capacity // 8)

    def _held_bytes(self, protect: set[int]) -> int:
        """Charged bytes no eviction can free now (a lower bound): every pinned, fenced
        or protected node, and their ancestors' segments (snapshots can retire)."""
        blocked = set(self._pins) | set(self._fences) | set(protect)
        snap = self.layout.ranks * self.layout.snapshot_bytes
        held, seen = 0, set()
        for nid in blocked:
            node = self.index.get(nid)
            while node is not None and node.id not in seen:
                seen.add(node.id)
                if node.id not in blocked and self.heap.retires and node.ready and node.has_snapshot:
                    held += pol.retire_rewrite_bytes(node.nbytes, snap)
                else:
                    held += node.nbytes
                node = self.index.get(node.parent) if node.parent is not None else None
        return held

    def _free(self, amount: float, protect: set[int] = frozenset()) -> int:
        """Free at least ``amount`` charged bytes (best effort); returns bytes freed.

        Loose garbage goes first (it frees bytes and loses nothing), then victims in
        policy order, one transaction each, until the actual charged bytes reach the
        goal; each victim is credited with what it really freed (a retirement: its
        old generation once, minus the new one). Candidates that are pinned, fenced or
        protected are set aside for this call; a retirement lacking room for its
        rewrite waits until later victims made the room.
        """
        start = self._charged
        goal = start - amount
        if self._charged > goal and self._garbage_hint:
            self._reclaim_loose()
        held: list[pol.Entry] = []
        waiting: list[pol.Entry] = []  # retirements lacking room, oldest first
        failed: list[Node] = []
        try:
            while self._charged > goal:
                if waiting and not self.heap.is_current(waiting[0], self.index.get):
                    waiting.pop(0)  # its node changed meanwhile (e.g. became a leaf and went)
                    continue
                if waiting and self._retire_fits(self.index.nodes[waiting[0][2]]):
                    entry = waiting.pop(0)
                else:
                    entry = self.heap.pop_valid(self.index.get)
                    if entry is None:
                        break
                nid, action = entry[2], entry[3]
                node = self.index.nodes[nid]
                if node in failed:
                    continue  # its retirement failed in this call (it is offered again below)
                if self._untouchable(node, action, protect):
                    held.append(entry)
                    continue
                if action == pol.RETIRE and not self._retire_fits(node):
                    waiting.append(entry)
                    continue
                before = self._charged
                if action == pol.EVICT:
                    self._evict_nodes([node])
                elif action == pol.SUBTREE:
                    self._evict_nodes(self._subtree(node))
                elif not self._retire_snapshot(node):
                    failed.append(node)
                    continue
                self.counters.evicted(action, before - self._charged)
        finally:
            for entry in held + waiting:
                self.heap.push(entry)
            for node in failed:
                if node.id in self.index.nodes:
                    self.heap.offer(node)
            self.heap.compact_if_stale(len(self.index), lambda: self.index)
        return start - self._charged

    def _reclaim_loose(self) -> None:
        """Unlink loose garbage (files no transaction owns any more, left by a failed
        unlink or found at open)."""
        self._garbage_hint = False
        rows = self.catalog.query(
            "SELECT rank, name, size FROM files WHERE status='garbage' AND txn IS NULL"
        )
        before = self._charged
        self._reclaim_rows(None, rows)
        if before > self._charged:
            self.counters.evicted("garbage", before - self._charged)

    def _untouchable(self, node: Node, action: str, protect: set[int] = frozenset()) -> bool:
        """Pinned, fenced or protected (for a subtree action: anywhere in it)."""
        if node.id in protect or self._pins[node.id] or self._fences[node.id]:
            return True
        if action == pol.SUBTREE:
            return any(self._pins[x.id] or self._fences[x.id] or x.id in protect for x in self._subtree(node))
        return False

    def _retire_fits(self, node: Node) -> bool:
        """Whether the new generation of a retirement of ``node`` fits under capacity."""
        snap = self.layout.ranks * self.layout.snapshot_bytes
        rewrite = pol.retire_rewrite_bytes(node.nbytes, snap)
        return self._charged + rewrite <= self.capacity and not self.disk.shortfall(rewrite)

    def _blocked(self, nid: int, action: str, protect: set[int] = frozenset()) -> bool:
        """Whether ``action`` on node ``nid`` may not run now."""
        node = self.index.nodes[nid]
        if self._untouchable(node, action, protect):
            return True
        return action == pol.RETIRE and not self._retire_fits(node)

    def _subtree(self, node: Node) -> list[Node]:
        """``node`` and its descendants, leaves first."""
        out, todo = [], [node]
        while todo:
            n = todo.pop()
            out.append(n)
            todo.extend(self.index.nodes[c] for c in n.children)
        out.reverse()
        return out

    def _evict_nodes(self, nodes: list[Node]) -> None:
        """One evict transaction removing ``nodes`` (leaves first).

        On a full disk with no reserve left, the nodes' files are unlinked before the
        commit, so the commit has room: the lock is held and the nodes are neither
        pinned nor fenced, so nothing reads them meanwhile; after a crash there,
        recovery finds them damaged (charged, evictable).
        """
        ids = [n.id for n in nodes]
        if self.disk.tight():
            marks = ",".join("?" * len(ids))
            self._unlink_rows(self.catalog.query(f"SELECT rank, name, size FROM files WHERE node IN ({marks})", ids))
        with self.catalog.txn("evict.remove") as c:
            tid = self._journal_begin(c, "evict", {"nodes": ids})
            rows = []
            for n in nodes:
                rows += c.execute(
                    "SELECT rank, name, size FROM files WHERE node=?", (n.id,)
                ).fetchall()
                c.execute("UPDATE files SET status='garbage', node=NULL, txn=? WHERE node=?", (tid, n.id))
                c.execute("DELETE FROM nodes WHERE id=?", (n.id,))
        try:  # the removal is published: an unexpected error must not strand the txn
            for n in nodes:
                self.index.remove(n.id)
                self._dirty_recency.discard(n.id)
            parent = self.index.get(nodes[-1].parent) if nodes[-1].parent is not None else None
            if parent is not None:
                self.heap.offer(parent)
            self._finish_retire(tid, "evict", rows)
        except BaseException as exc:
            pipeline.fail_txn(self, tid, exc)
            raise

    def _watch_counters(self) -> None:
        """Live gauges read at scrape time (``prefixstore_state{kind=...}``)."""
        self.counters.watch(
            capacity_bytes=lambda: self.capacity,
            charged_bytes=lambda: getattr(self, "_charged", 0),
            nodes=lambda: len(self.index),
            pinned=lambda: len(self._pins),
            fenced=lambda: len(self._fences),
            pending_retries=lambda: len(self._pending),
        )

    def _retire_snapshot(self, node: Node) -> bool:
        """Compact-replace ``node`` with a generation that has no snapshot; True if done."""
        from prefixstore.engine import replace

        return bool(replace.retire_snapshot(self, node))

    def _invalidate(self, node: Node, why: str) -> None:
        """Mark ``node`` damaged (one commit); descendants keep their links."""
        if node.state == "damaged":
            return
        if self.read_only is None:  # read-only: damaged in memory, found again by the next open
            with self.catalog.txn("invalidate") as c:
                c.execute("UPDATE nodes SET state='damaged' WHERE id=?", (node.id,))
        node.state = "damaged"
        self.heap.offer(node)
        self.counters.inc("faults", "damaged_node")
        log.warning("node_damaged", node=node.id, key=node.key.hex()[:12], why=why)

    # ------------------------------------------------------------------ internal: lookup/restore

    def _lookup(self, prefix: Prefix, gpu_blocks: int, total_tokens: int | None) -> Match:
        L = self.layout
        n = len(prefix)
        keys = prefix.keys
        base = dict(prefix_blocks=n, block_tokens=L.block_tokens, gpu_blocks=gpu_blocks, cache=self.identity)
        p = self.index.deepest_block(keys, n)
        owner = self.index.owner(keys, p)
        if owner is None:
            return Match("miss", **base)
        # Without snapshots a request that leaves a node inside its span can still use
        # the node's leading rows (a partial hit at block p); with snapshots it stops at
        # the deepest whole checkpoint (the recurrent state exists only at a node's end).
        partial = owner.end != p and not L.has_snapshot
        node = owner if owner.end == p or partial else self.index.get(owner.parent) if owner.parent is not None else None
        if node is None:
            return Match("miss", **base)
        reach = p if partial else node.end  # blocks the deepest candidate covers
        if reach <= gpu_blocks:
            return Match("gpu_resident", blocks=reach, node_id=node.id, **base)
        path = self.index.path(node)
        # Nodes below the GPU-resident part must be ready; the deepest usable endpoint
        # is above the first damaged node there.
        usable: list[Node] = []
        damaged_below = False
        for x in path:
            if x.end <= gpu_blocks:
                continue
            if not x.ready:
                damaged_below = True
                break
            usable.append(x)
        # Candidates, deepest first: (node, blocks covered, bytes to transfer, nodes to
        # read). The bytes are the segment rows above the GPU-resident part plus one
        # snapshot, all ranks; a partial candidate is charged its node's whole rows (its
        # shard is read and verified whole).
        cands: list[tuple[Node, int, int, int]] = []
        tokens = 0
        for i, x in enumerate(usable):
            tokens += (x.end - max(x.start, gpu_blocks)) * L.block_tokens
            if x.has_snapshot or not L.has_snapshot:
                cands.append((x, min(x.end, reach), L.ranks * L.payload_bytes(tokens, L.has_snapshot), i + 1))
        if not cands:
            return Match("damaged" if damaged_below else "miss", **base)
        cands.reverse()
        total = total_tokens if total_tokens is not None else n * L.block_tokens
        gpu_tokens = gpu_blocks * L.block_tokens
        decision = choose(self.cost, [(e * L.block_tokens, b, k) for _, e, b, k in cands], gpu_tokens, total)
        est = decision.deciding
        if est is not None:
            self.counters.decision(
                result=decision.result, transfer_s=est[1], prefill_s=est[2],
                key=keys[-1].hex()[:12], gpu_tokens=gpu_tokens, total_tokens=total,
                deepest_tokens=cands[0][1] * L.block_tokens,
                chosen_tokens=None if decision.chosen is None else est[0],
                estimates=[list(e) for e in decision.estimates],
            )
        if decision.chosen is None:
            return Match("rejected_cost", **base, transfer_s=est[1], prefill_s=est[2])
        chosen, blocks, nbytes, _ = cands[decision.chosen]
        chosen_path = tuple((x.id, x.generation) for x in usable if x.end <= chosen.end)
        if blocks < chosen.end:  # a partial hit: only the rows up to `blocks` are uploaded
            nbytes = L.ranks * L.payload_bytes((blocks - gpu_blocks) * L.block_tokens, False)
        return Match(
            "hit", blocks=blocks, node_id=chosen.id, node_key=chosen.key, path=chosen_path, nbytes=nbytes,
            transfer_s=est[1] if est else None, prefill_s=est[2] if est else None, **base,
        )

    def _path_current(self, match: Match) -> bool:
        """True when ``match``'s nodes are unchanged and still tile its span exactly: a
        parent chain ending at the node of ``match.node_key``."""
        if not match.path:
            return False
        prev = None
        for nid, gen in match.path:
            node = self.index.get(nid)
            if node is None or node.generation != gen or not node.ready:
                return False
            if prev is None:
                if not node.start <= match.gpu_blocks < node.end:
                    return False
            elif node.parent != prev.id or node.start != prev.end:
                return False
            prev = node
        if node.key != match.node_key:
            return False
        prev_end = node.end
        # the last node holds block `blocks` (at its end, or inside it for a partial hit)
        return prev_end - node.blocks < match.blocks <= prev_end

    def _restore(self, match: Match) -> Restored | None:
        L = self.layout
        with self._lock:
            if not self._path_current(match):
                self.counters.inc("lookups", "stale")
                return None
            nodes = [self.index.nodes[nid] for nid, _ in match.path]
            end = nodes[-1]
            if L.has_snapshot and not end.has_snapshot:
                return None
            rows = self._file_rows(nodes)
            for x in nodes:
                self._pins[x.id] += 1
        try:
            # Reads overlap uploads; each shard lands in its slice of the output (no cat).
            got = pipeline.restore_nodes(self, nodes, rows, match)
            if isinstance(got, pipeline.Damage):
                with self._lock:
                    # only the generation this restore read can be declared damaged
                    if got.node.generation == dict(match.path).get(got.node.id):
                        self._invalidate(got.node, got.why)
                self.counters.inc("lookups", "damaged_on_restore")
                return None
            if got is None:
                return None
            segments, snaps, files = got
        finally:
            with self._lock:
                for x in nodes:
                    self._pins[x.id] -= 1
                    if not self._pins[x.id]:
                        del self._pins[x.id]
        with self._lock:
            now = self._tick()
            for x in nodes:
                x.last_used = now
                self._dirty_recency.add(x.id)
                self.heap.offer(x)
            end.snap_used = now
            self.heap.offer(end)
        return Restored(match, segments, snaps, match.gpu_tokens, match.tokens, files)

    def _file_rows(self, nodes: list[Node]) -> dict[int, dict[int, tuple[str, int, str]]]:
        """``{node id: {rank: (name, size, checksum)}}`` of the live files of ``nodes``
        (current generations), from each node's cache or the catalog. Under the lock."""
        rows: dict[int, dict[int, tuple[str, int, str]]] = {}
        todo: list[Node] = []
        for x in nodes:
            f = x.files
            if f is not None and f[0] == x.generation:
                rows[x.id] = f[1]
            else:
                rows[x.id] = {}
                todo.append(x)
        for i in range(0, len(todo), 500):  # one query per 500 nodes (SQLite's variable limit)
            part = tuple(x.id for x in todo[i : i + 500])
            for nid, r, name, size, ck in self.catalog.query(
                "SELECT node, rank, name, size, checksum FROM files WHERE status='live' AND node IN "
                f"({','.join('?' * len(part))})", part
            ):
                rows[nid][r] = (name, size, ck)
        for x in todo:
            x.files = (x.generation, rows[x.id])
        return rows

    def _read_node(self, node: Node, rows: dict[int, tuple[str, int, str]], with_snap: bool):
        """Read and verify ``node``'s shards on every rank.

        Returns per-rank (segments, snapshot), a damage description (str) when a shard
        is missing or fails verification, or None on a transient I/O error.
        """
        L = self.layout
        if set(rows) != set(range(L.ranks)):
            return f"shards recorded on ranks {sorted(rows)}"
        meta = self._shard_meta(node.key, node.generation, node.start, node.end, node.has_snapshot)
        tokens = node.blocks * L.block_tokens

        def one(r: int):
            name, size, ck = rows[r]
            header = verify.Header(L, tokens, node.has_snapshot, {**meta, "rank": str(r)})
            got = verify.read(self.ranks[r], name, size, ck, header=header)
            if isinstance(got, verify.Damage):
                return f"rank {r}: {got.why}"
            if isinstance(got, verify.Transient):  # an I/O error or a rank process down: a miss
                self.counters.inc("faults", "rank_unavailable" if got.unavailable else "read")
                return None
            return got.segments, (got.snapshot if with_snap else {})

        out = [one(0)] if L.ranks == 1 else list(self._pool.map(one, range(L.ranks)))
        for o in out:
            if isinstance(o, str):
                return o
        if any(o is None for o in out):
            return None
        return out

    # ------------------------------------------------------------------ internal: recency

    def _flush_recency(self, c=None) -> None:
        if not self._dirty_recency:
            return
        rows = [
            (self.index.nodes[i].last_used, self.index.nodes[i].snap_used, i)
            for i in self._dirty_recency if i in self.index.nodes
        ]
        if c is None:
            with self.catalog.txn("recency") as cc:
                cc.executemany("UPDATE nodes SET last_used=?, snap_used=? WHERE id=?", rows)
        else:
            c.executemany("UPDATE nodes SET last_used=?, snap_used=? WHERE id=?", rows)
        self._dirty_recency.clear()

    def _reclaim_rows(self, tid: int | None, rows) -> None:
        if not rows:
            return
        self.catalog.barrier()
        left = self._unlink_rows(rows)
        with self.catalog.txn("reclaim") as c:
            for r, name, _ in rows:
                if (r, name) not in left:
                    c.execute("DELETE FROM files WHERE rank=? AND name=?", (r, name))
        self._charged -= sum(size for r, name, size in rows if (r, name) not in left)


def digest_count(digests: bytes) -> int:
    return len(digests) // DIGEST_SIZE
