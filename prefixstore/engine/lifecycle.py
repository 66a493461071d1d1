"""The engine's life: open (root check, directory lock, layout meta, backing, recovery,
load, fit), the call guard every public call runs inside, and close."""

from __future__ import annotations

import os
import threading
import time
import uuid
from collections import Counter, deque
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

from prefixstore.base.errors import (
    CacheIOError,
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
from prefixstore.base.layout import Layout
from prefixstore.base.log import log
from prefixstore.engine import (
    cachedirs,
    calibration,
    compaction,
    dirlock,
    identity,
    journal,
    loading,
    pipeline,
    readonly,
    recency,
    recovery,
    remote,
    space,
    stats,
    tiering,
    trust,
)
from prefixstore.engine.catalog import (
    CATALOG_NAME,
    Catalog,
    catalog_path,
    drop_empty_log,
    log_files,
)
from prefixstore.engine.config import EngineConfig
from prefixstore.engine.counters import Counters
from prefixstore.engine.index import Index
from prefixstore.gpu import tiers
from prefixstore.gpu.diskroom import DiskRoom
from prefixstore.gpu.executor import make_executor
from prefixstore.gpu.fileio import FaultHook, OsFS
from prefixstore.gpu.ranks import LocalRank, rank_dir_name
from prefixstore.statemachine import policy as pol

if TYPE_CHECKING:
    from prefixstore.engine.api import Engine

LOCK_NAME = dirlock.LOCK_NAME


class CallGuard:
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
                    abandon(eng)
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


def guard(eng: Engine) -> CallGuard:
    """Every public call runs inside (see ``CallGuard``)."""
    return eng._guarded


# -- open -------------------------------------------------------------------------------------


def start(eng: Engine, root: str, layout: Layout, capacity_bytes: int, o: EngineConfig) -> None:
    """Open the cache at ``root``: the whole of ``Engine.__init__``. A file system error
    of the open is raised as ``CacheIOError`` (an ``OSError`` with its errno)."""
    try:
        open_cache(eng, root, layout, capacity_bytes, o)
    except PrefixStoreError:
        raise
    except OSError as exc:
        raise CacheIOError(exc.errno, f"cannot open the cache at {root}: {exc.strerror or exc}",
                           exc.filename) from exc


def open_cache(eng: Engine, root: str, layout: Layout, capacity_bytes: int, o: EngineConfig) -> None:
    init_state(eng, root, layout, capacity_bytes, o)
    check_root(eng, o.create)
    take_lock(eng)
    eng.disk = DiskRoom(root, eng.disk_reserve_bytes, catalog=catalog_path(root))
    logs = log_files(root)
    try:
        open_catalog(eng, o)
        try:
            open_effects(eng, o)
        except BaseException:
            drop_pool(eng)
            eng.catalog.close()
            raise
    except BaseException as exc:
        if not fall_back(eng, exc, o, logs):
            raise
    try:
        remote.open_tier(eng, o)
    except BaseException:
        shutdown(eng)  # the lock and catalog are released as by a failed open
        raise


def init_state(eng: Engine, root: str, layout: Layout, capacity_bytes: int, o: EngineConfig) -> None:
    """The engine's attributes before anything on disk is touched."""
    eng.root = root
    eng.layout = layout
    eng.capacity = int(capacity_bytes)
    eng.high_watermark, eng.low_watermark = o.high_watermark, o.low_watermark
    eng.cost = o.cost
    eng.policy_name = o.policy
    eng.admission = o.admission
    eng.inflight_wait_s = o.inflight_wait_s
    eng.hook = o.hook or FaultHook()
    eng.fs = o.fs or OsFS()
    eng.counters = Counters(o.registry)
    eng.executor = make_executor(o.executor)
    eng._lock = threading.RLock()
    eng._settled = threading.Condition(eng._lock)  # notified when a store finishes
    eng._closed = False
    eng._guarded = CallGuard(eng)
    eng._closing = False  # close() started: new public calls are refused
    eng._calls = 0  # public calls in flight, all threads (close waits for them)
    eng._calls_cv = threading.Condition(threading.Lock())
    eng._local = threading.local()  # .depth: this thread's nested public calls
    eng._dir_lock = None
    eng.remote = None  # the shared remote tier (engine/remote.py), set once open succeeded
    eng.identity = uuid.uuid4().hex  # carried by this engine's Matches (validate.match)
    eng.model_identity = o.identity  # the model the cache belongs to (engine/identity.py)
    eng._pins = Counter()  # every pin: pin()'s and running restores'
    eng._request_pins = Counter()  # the pins taken by pin() (a request holds them)
    eng._fences = Counter()
    # The part of _fences that queued async stores hold as reservations of the rows
    # they build on: no eviction or merge removes such a row, but no transaction is in
    # flight on it, so no store or compact-replace that keeps the row waits for it.
    eng._reserved = Counter()
    eng._inflight_blocks = {}
    eng._pending = deque()
    eng._retrying = False
    eng._dirty_recency = set()
    eng.compaction_policy = None  # set by compaction.start_worker; compact() default
    eng.compactor = None  # the background compaction worker, when enabled
    eng.index = Index()
    eng.heap = pol.VictimHeap(o.policy, layout.has_snapshot)
    if pol.takes_retention(o.policy) and isinstance(o.admission, pol.Retention):
        eng.heap.retention = o.admission  # its rule orders the leaves (the index load rebuilds the heap)
    eng.driver = journal.build(eng)  # an output with no handler fails here, at open
    stats.watch(eng)


def open_catalog(eng: Engine, o: EngineConfig) -> None:
    """Open the catalog (after refusing symlinked own directories, with nothing touched)."""
    root, layout = eng.root, eng.layout
    cachedirs.check_own_dirs(root, layout.ranks if o.ranks is None and o.backing != "memory" else 0)
    if o.ranks is None and eng.disk.full() and os.path.exists(os.path.join(root, CATALOG_NAME)):
        recovery.room_before_open(root, layout.ranks)
    eng.catalog = Catalog(root, synchronous=o.synchronous, hook=eng.hook, create=o.create,
                          before_write=eng.disk.before_catalog_write)


def open_effects(eng: Engine, o: EngineConfig) -> None:
    """Check the layout, bind the backing and ranks, recover, load, fit, start workers."""
    layout = eng.layout
    trust.check_new_cache(eng.catalog, eng.root, o.ranks or ())
    check_layout(eng)
    identity.check(eng)
    recovery.check_backing(eng)
    eng.backing = tiering.open_backing(eng, o.backing, o.ram_bytes)
    eng.ranks = list(o.ranks) if o.ranks is not None else [
        LocalRank(r, os.path.join(eng.root, rank_dir_name(r)), eng.fs, eng.hook) for r in range(layout.ranks)
    ]
    eng.ranks = eng.backing.bind(eng.ranks, given=o.ranks is not None)
    if len(eng.ranks) != layout.ranks:
        raise InvalidInputError(f"{len(eng.ranks)} rank executors for {layout.ranks} ranks")
    eng._pool = ThreadPoolExecutor(max_workers=max(1, layout.ranks), thread_name_prefix="rank")
    eng.disk.bind(tiering.local_dirs(eng.ranks), layout.ranks)
    eng.recovery_report = recovery.recover(eng)
    loading.load(eng)
    fit(eng)
    if o.read_only_fallback and o.ranks is None and o.backing == "disk" and eng.disk.full():
        # recovered, and still no room to write: read-only rather than evict for room
        raise disk_full(eng, "the cache opens read-only rather than evict checkpoints for room")
    eng.calibration = calibration.resolve(eng, o.bandwidth)
    eng.transfers = pipeline.Transfers(layout.ranks)
    eng.compactor = compaction.start_worker(eng, o.compaction)


def drop_pool(eng: Engine) -> None:
    pool = getattr(eng, "_pool", None)
    if pool is not None:
        pool.shutdown(wait=False)


def fall_back(eng: Engine, exc: BaseException, o: EngineConfig, logs: frozenset[str]) -> bool:
    """After a failed open: True when the cache opened read-only instead (a full disk:
    out of bytes or of inodes); else the lock is released and the caller raises (a
    full disk: as DiskFullError)."""
    if isinstance(exc, DiskFullError):
        reason: DiskFullError | None = exc  # recovered, and no room: closing the catalog may have freed its log
    elif isinstance(exc, CatalogIOError) and eng.disk.full():
        reason = disk_full(eng, "nothing this cache can free without a catalog write")
    else:
        reason = None
    if reason is not None and o.read_only_fallback and o.ranks is None and o.backing == "disk":
        try:
            open_read_only(eng, reason, o.bandwidth, logs)
            return True
        except (CatalogIOError, ReadOnlyError, OSError):
            pass  # cannot even be read without writing: the disk-full error stands
        except BaseException:
            release_lock(eng)
            raise
    release_lock(eng)
    if reason is not None:
        raise reason from exc
    return False


def disk_full(eng: Engine, why: str) -> DiskFullError:
    """The error naming the full disk under the catalog: what it has free (bytes,
    inodes), ``why`` the open gave up on writing, and what to free."""
    free, remedy = eng.disk.lack()
    return DiskFullError(f"{eng.root}: the disk is full ({free}, no reserve left; {why}): "
                         f"free {remedy} on that file system and open again")


def open_read_only(eng: Engine, reason: DiskFullError, bandwidth: Any, logs: frozenset[str]) -> None:
    """Open this (locked) cache read-only: no recovery, no write (``engine/readonly.py``).
    ``logs``: the catalog's log files before the failed open (those it created are removed)."""
    drop_empty_log(eng.root, logs)
    eng.catalog = Catalog.open_read_only(eng.root, reason, eng.hook)
    try:
        check_layout(eng)
        identity.check(eng)
        recovery.check_structure(eng)
        if (eng.catalog.meta(tiers.META_KEY) or "disk") != "disk":
            raise reason
        eng.backing = tiering.open_backing(eng, "disk", None)
        eng.ranks = eng.backing.bind([LocalRank(r, os.path.join(eng.root, rank_dir_name(r)), eng.fs, eng.hook)
                                      for r in range(eng.layout.ranks)], given=False)
        eng._pool = ThreadPoolExecutor(max_workers=max(1, eng.layout.ranks), thread_name_prefix="rank")
        eng.disk.bind([r.directory for r in eng.ranks], eng.layout.ranks)
        if getattr(eng, "recovery_report", None) is None:  # kept when recovery ran before
            eng.recovery_report = recovery.RecoveryReport()
        loading.load(eng)
        eng.unsettled = readonly.hold_out(eng.catalog, eng.index)
        eng.calibration = calibration.resolve(eng, None if isinstance(bandwidth, str) else bandwidth)
        eng.transfers = pipeline.Transfers(eng.layout.ranks)
        eng.compactor = None
    except BaseException:
        drop_pool(eng)
        eng.catalog.close()
        raise
    eng.read_only = reason
    log.warning("opened_read_only", root=eng.root, reason=str(reason), unsettled=len(eng.unsettled))


def check_writable(eng: Engine, call: str) -> None:
    """Raise ReadOnlyError naming the reason when the engine was opened read-only."""
    if eng.read_only is not None:
        raise ReadOnlyError(f"{call}: {eng.root} is open read-only: {eng.read_only}", eng.read_only)


def check_root(eng: Engine, create: bool) -> None:
    root = eng.root
    if os.path.exists(root) and not os.path.isdir(root):
        raise NotACacheError(f"{root} is not a directory")
    if os.path.isdir(root):
        if not os.path.lexists(os.path.join(root, CATALOG_NAME)):
            trust.refuse_unless_new(root, f"{CATALOG_NAME} is missing")
    elif not create:
        raise NotACacheError(f"{root} does not exist")
    os.makedirs(root, exist_ok=True)


def take_lock(eng: Engine) -> None:
    eng._dir_lock = dirlock.acquire(eng.root, "is open in another engine")


def release_lock(eng: Engine) -> None:
    if eng._dir_lock is not None:
        eng._dir_lock.release()
        eng._dir_lock = None


def check_layout(eng: Engine) -> None:
    cat = eng.catalog
    stored = cat.meta("layout")
    if stored is None:
        with cat.txn("init") as c:
            cat.set_meta(c, "layout", eng.layout.to_json())
            cat.set_meta(c, "capacity", str(eng.capacity))
        return
    created = Layout.from_json(stored)
    if created != eng.layout:
        raise LayoutMismatchError(
            f"{eng.root} was created with another layout (created vs given: "
            f"{'; '.join(created.differences(eng.layout))})"
        )
    if cat.meta("capacity") != str(eng.capacity) and cat.read_only is None:
        with cat.txn("capacity") as c:
            cat.set_meta(c, "capacity", str(eng.capacity))


def fit(eng: Engine) -> None:
    """At open: evict by policy (journaled) until the charged bytes fit the capacity;
    hold the catalog's room in its files and take the disk reserve back if they fit. The disk's room is no reason to evict here
    (a full disk opens read-only instead, see ``open_effects``). Raises CapacityError
    when the capacity cannot be reached."""
    with eng._lock:
        over = eng._charged - eng.capacity
        if over > 0:
            freed = space.free(eng, over)
            eng.recovery_report.evicted += freed
            log.info("open_evicted", bytes=freed, charged=eng._charged, capacity=eng.capacity)
        if eng._charged > eng.capacity:
            raise CapacityError(
                f"{eng.root}: {eng._charged} bytes stay charged after evicting what open "
                f"can, above capacity_bytes={eng.capacity}; open with a larger capacity"
            )
        eng.disk.hold_catalog_room()
        eng.disk.restore()


# -- close -------------------------------------------------------------------------------------


def close(eng: Engine) -> None:
    """The body of ``Engine.close`` (see there)."""
    if eng._closed:
        return
    if eng.transfers.commit.current or eng.transfers.retry.current:
        # e.g. from a queued store's valid() callback: draining would wait for itself
        raise InvalidInputError("close() cannot run inside the engine's own commit or retry worker")
    eng.transfers.drain()  # outside the lock: queued async stores commit first
    if eng.compactor is not None:
        eng.compactor.stop()  # outside the lock: the worker may be waiting for it
    deadline = time.monotonic() + eng.close_wait_s
    quiesce(eng, deadline)
    # Jobs queued since the drain are refused by the guard; let them release what they hold.
    eng.transfers.drain(max(0.0, deadline - time.monotonic()))
    remote.close_tier(eng, min(eng.remote_flush_s, max(0.0, deadline - time.monotonic())))
    with eng._lock:
        if eng._closed:  # abandoned meanwhile (a simulated crash)
            return
        try:
            if eng.read_only is None:
                recency.flush(eng)
        finally:
            shutdown(eng)


def quiesce(eng: Engine, deadline: float) -> None:
    """Refuse new public calls; wait until those in flight on other threads end
    (or ``deadline``, a ``time.monotonic()`` value, passes)."""
    mine = getattr(eng._local, "depth", 0)  # close() called from inside a call
    with eng._calls_cv:
        eng._closing = True
        while eng._calls > mine:
            left = deadline - time.monotonic()
            if left <= 0:
                log.warning("close_timeout", in_flight=eng._calls - mine)
                return
            eng._calls_cv.wait(left)


def is_closed(eng: Engine) -> bool:
    """Whether ``eng`` was closed or abandoned (its calls are refused)."""
    return eng._closed


def abandon(eng: Engine) -> None:
    """Model process death: drop the connection (uncommitted work rolls back)."""
    shutdown(eng)


def shutdown(eng: Engine) -> None:
    eng._closed = True
    remote.close_tier(eng, 0.0)
    transfers = getattr(eng, "transfers", None)
    if transfers is not None:
        transfers.stop(wait=False)
    pool = getattr(eng, "_pool", None)
    if pool is not None:
        pool.shutdown(wait=False, cancel_futures=True)
    cat = getattr(eng, "catalog", None)
    if cat is not None:
        cat.close()
    release_lock(eng)
