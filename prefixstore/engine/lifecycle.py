"""The engine's life: open (root check, directory lock, layout meta, backing, recovery,
load, fit) into the ``Parts`` an engine is made of, and close.

``start`` builds every component before anything on disk is touched (``prepare``),
then opens the cache into them (``open_cache``); what it acquires on the way (the
directory lock, the catalog, the rank pool, the transfer workers) is recorded in the
engine's ``Lifetime``, which a failed open, a close and an abandon release.
"""

from __future__ import annotations

import functools
import os
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import attrs

from prefixstore.base.errors import (
    CacheIOError,
    CapacityError,
    CatalogIOError,
    DiskFullError,
    InvalidInputError,
    LayoutMismatchError,
    NotACacheError,
    PrefixStoreError,
    ReadOnlyError,
)
from prefixstore.base.layout import Layout
from prefixstore.base.log import log
from prefixstore.engine import (
    cachedirs,
    calibration,
    compaction,
    degraded,
    dirlock,
    flows,
    identity,
    journal,
    loading,
    readonly,
    recovery,
    remote,
    space,
    stats,
    tiering,
    trust,
)
from prefixstore.engine.account import Account
from prefixstore.engine.catalog import (
    CATALOG_NAME,
    Catalog,
    catalog_path,
    drop_empty_log,
    log_files,
)
from prefixstore.engine.compaction import Compactor
from prefixstore.engine.config import EngineConfig
from prefixstore.engine.counters import Counters
from prefixstore.engine.flows import Flows
from prefixstore.engine.guard import CallGuard, Lifetime
from prefixstore.engine.holds import Holds
from prefixstore.engine.index import Index
from prefixstore.engine.journal import Ledger
from prefixstore.engine.readonly import Mode
from prefixstore.engine.recency import Recency
from prefixstore.engine.recovery import RecoveryReport
from prefixstore.engine.remote import RemoteLink
from prefixstore.engine.retry import RetryQueue
from prefixstore.engine.settings import Settings
from prefixstore.engine.tiering import Tiers
from prefixstore.engine.transfers import Transfers
from prefixstore.gpu import tiers
from prefixstore.gpu.diskroom import DiskRoom
from prefixstore.gpu.executor import make_executor
from prefixstore.gpu.fileio import FaultHook, OsFS
from prefixstore.gpu.ranks import LocalRank, rank_dir_name
from prefixstore.gpu.tier import Backing, Capability, Tier
from prefixstore.statemachine import policy as pol

LOCK_NAME = dirlock.LOCK_NAME


@attrs.frozen(slots=True, eq=False)
class Closing:
    """What ``close`` drains, stops and flushes, in order (see ``close``)."""

    guard: CallGuard
    life: Lifetime
    settings: Settings
    transfers: Transfers
    compactor: Compactor | None
    remotes: RemoteLink
    mode: Mode
    recency: Recency
    index: Index
    catalog: Catalog


@attrs.define(slots=True, eq=False)
class Parts:
    """Everything an open engine is made of: its components (each owning one concern
    and its locking), the flows built over them, and what the open found.
    ``Engine`` is made of these and is their only public face."""

    root: str
    layout: Layout
    config: EngineConfig
    identity: str
    """This engine's id, carried by its Matches (``validate.match``)."""
    settings: Settings
    life: Lifetime
    guard: CallGuard
    counters: Counters
    executor: Any
    holds: Holds
    account: Account
    recency: Recency
    index: Index
    retries: RetryQueue
    mode: Mode
    remotes: RemoteLink
    catalog: Catalog
    tiers: Tiers
    ledger: Ledger
    transfers: Transfers
    flows: Flows
    recovery_report: RecoveryReport
    calibration: dict[str, Any] | None
    compactor: Compactor | None
    closing: Closing


@attrs.define(slots=True, eq=False)
class Opening:
    """An engine being opened: the components made before anything on disk is
    touched, and those the open acquires as it goes (None until then)."""

    root: str
    layout: Layout
    config: EngineConfig
    identity: str
    settings: Settings
    life: Lifetime
    guard: CallGuard
    counters: Counters
    executor: Any
    holds: Holds
    recency: Recency
    index: Index
    retries: RetryQueue
    mode: Mode
    remotes: RemoteLink
    admit: Any
    capacity: int
    hook: FaultHook
    fs: Any
    account: Account | None = None
    catalog: Catalog | None = None
    tiers: Tiers | None = None
    ledger: Ledger | None = None
    transfers: Transfers | None = None
    flows: Flows | None = None
    recovery_report: RecoveryReport | None = None
    calibration: dict[str, Any] | None = None
    compactor: Compactor | None = None

    def parts(self) -> Parts:
        """The open engine's parts (every step of the open has run)."""
        assert self.account and self.catalog and self.tiers and self.ledger and self.transfers and self.flows
        assert self.recovery_report is not None
        closing = Closing(self.guard, self.life, self.settings, self.transfers, self.compactor, self.remotes,
                          self.mode, self.recency, self.index, self.catalog)
        return Parts(self.root, self.layout, self.config, self.identity, self.settings, self.life, self.guard,
                     self.counters, self.executor, self.holds, self.account, self.recency, self.index,
                     self.retries, self.mode, self.remotes, self.catalog, self.tiers, self.ledger,
                     self.transfers, self.flows, self.recovery_report, self.calibration, self.compactor, closing)


# -- open -------------------------------------------------------------------------------------


def start(root: str, layout: Layout, capacity_bytes: int, o: EngineConfig, subject: Any, *,
          reserve_bytes: int, max_pending: int) -> Parts:
    """Open the cache at ``root``: the whole of ``Engine.__init__``. ``subject``: what
    the admission hook is given as its engine. A file system error of the open is
    raised as ``CacheIOError`` (an ``OSError`` with its errno)."""
    op = prepare(root, layout, capacity_bytes, o, subject, max_pending)
    try:
        open_cache(op, reserve_bytes)
    except PrefixStoreError:
        raise
    except OSError as exc:
        raise CacheIOError(exc.errno, f"cannot open the cache at {root}: {exc.strerror or exc}",
                           exc.filename) from exc
    return op.parts()


def prepare(root: str, layout: Layout, capacity_bytes: int, o: EngineConfig, subject: Any,
            max_pending: int) -> Opening:
    """The components an engine has before anything on disk is touched."""
    heap = pol.VictimHeap(o.policy, layout.has_snapshot)
    if pol.takes_retention(o.policy) and isinstance(o.admission, pol.Retention):
        heap.retention = o.admission  # its rule orders the leaves (the index load rebuilds the heap)
    life = Lifetime()
    remotes = RemoteLink()  # the shared remote tier (engine/remote.py), set once open succeeded
    life.remote = remotes
    return Opening(
        root=root, layout=layout, config=o, identity=uuid.uuid4().hex,
        settings=Settings(o.policy, o.cost, o.admission, o.inflight_wait_s),
        life=life, guard=CallGuard(life), counters=Counters(o.registry), executor=make_executor(o.executor),
        holds=Holds(), recency=Recency(heap), index=Index(), retries=RetryQueue(max_pending),
        mode=Mode(root), remotes=remotes, capacity=int(capacity_bytes), hook=o.hook or FaultHook(), fs=o.fs or OsFS(),
        admit=functools.partial(o.admission, subject) if o.admission is not None else None,
    )


def open_cache(op: Opening, reserve_bytes: int) -> None:
    o, root = op.config, op.root
    check_root(root, o.create)
    op.life.dir_lock = dirlock.acquire(root, "is open in another engine")
    op.account = Account(op.capacity, o.high_watermark, o.low_watermark,
                         DiskRoom(root, reserve_bytes, catalog=catalog_path(root)))
    stats.watch(op.counters, op.account, op.index, op.holds, op.retries)
    logs = log_files(root)
    try:
        open_catalog(op)
        try:
            open_effects(op)
        except BaseException:
            drop_effects(op)
            raise
    except BaseException as exc:
        if not fall_back(op, exc, logs):
            raise
    try:
        remote.open_tier(op.remotes, op.layout, op.counters, o)
    except BaseException:
        shutdown(op.life)  # the lock and catalog are released as by a failed open
        raise


def open_catalog(op: Opening) -> None:
    """Open the catalog (after refusing symlinked own directories, with nothing touched)."""
    o, root, layout, disk = op.config, op.root, op.layout, op.account.disk
    rank_dirs = o.ranks is None and Capability.RANK_DIRS in tiers.capabilities(o.backing)
    cachedirs.check_own_dirs(root, layout.ranks if rank_dirs else 0)
    if o.ranks is None and disk.full() and os.path.exists(os.path.join(root, CATALOG_NAME)):
        recovery.room_before_open(root, layout.ranks)
    op.catalog = Catalog(root, synchronous=o.synchronous, hook=op.hook, create=o.create,
                         before_write=disk.before_catalog_write)
    op.life.catalog = op.catalog


def open_effects(op: Opening) -> None:
    """Check the layout, bind the backing and ranks, recover, load, fit, start workers."""
    o, root, layout, cat = op.config, op.root, op.layout, op.catalog
    trust.check_new_cache(cat, root, o.ranks or ())
    check_layout(cat, root, layout, op.account.capacity)
    identity.check(cat, root, o.identity)
    recovery.check_backing(cat, root, layout.ranks)
    backing = tiering.open_backing(cat, root, op.account.capacity, op.executor.pool, o.backing, o.ram_bytes)
    given = list(o.ranks) if o.ranks is not None else local_ranks(op)
    ranks = backing.bind(given, given=o.ranks is not None)
    if len(ranks) != layout.ranks:
        raise InvalidInputError(f"{len(ranks)} rank executors for {layout.ranks} ranks")
    bind(op, backing, ranks, tiering.local_dirs(ranks))
    op.recovery_report = recovery.recover(op.flows.recovering)
    degraded.opened(op.flows.reviving)
    loading.load(op.index, cat, op.recency, op.account)
    fit(op)
    if read_only_fallback(o) and op.account.disk.full():
        # recovered, and still no room to write: read-only rather than evict for room
        raise disk_full(op, "the cache opens read-only rather than evict checkpoints for room")
    op.calibration = calibration.resolve(cat, op.executor, backing.kind, root, op.settings, o.bandwidth)
    op.compactor = compaction.start_worker(op.flows.compacting, o.compaction)


def local_ranks(op: Opening) -> list[LocalRank]:
    """A rank over each of the cache's own rank directories."""
    return [LocalRank(r, os.path.join(op.root, rank_dir_name(r)), op.fs, op.hook) for r in range(op.layout.ranks)]


def bind(op: Opening, backing: Backing, ranks: list[Tier], local_dirs: list[str | None]) -> None:
    """Bind the tiers and their pool, the transfer workers, the ledger (an output with
    no handler fails here, at open) and the flows over them."""
    layout = op.layout
    pool = ThreadPoolExecutor(max_workers=max(1, layout.ranks), thread_name_prefix="rank")
    op.life.pool = pool
    op.tiers = Tiers(backing, ranks, pool)
    op.account.disk.bind(local_dirs, layout.ranks)
    op.transfers = op.life.transfers = Transfers(layout.ranks)
    op.ledger = journal.open_ledger(op.catalog, op.tiers, op.account, op.counters, op.mode, layout.ranks)
    op.flows = flows.build(flows.Components(
        op.root, layout, op.identity, op.settings, op.guard, op.holds, op.account, op.recency, op.index,
        op.retries, op.mode, op.remotes, op.catalog, op.ledger, op.tiers, op.counters, op.executor,
        op.transfers, op.admit))


def drop_effects(op: Opening) -> None:
    """After a failed step of the open: stop the workers and the pool, close the catalog."""
    life = op.life
    transfers, life.transfers = life.transfers, None
    if transfers is not None:
        transfers.stop(wait=False)
    pool, life.pool = life.pool, None
    if pool is not None:
        pool.shutdown(wait=False)
    if op.catalog is not None:
        op.catalog.close()


def read_only_fallback(o: EngineConfig) -> bool:
    """Whether a full disk opens this cache read-only (its backing serves it so)."""
    return o.read_only_fallback and o.ranks is None and Capability.READ_ONLY_OPEN in tiers.capabilities(o.backing)


def fall_back(op: Opening, exc: BaseException, logs: frozenset[str]) -> bool:
    """After a failed open: True when the cache opened read-only instead (a full disk:
    out of bytes or of inodes); else the lock is released and the caller raises (a
    full disk: as DiskFullError)."""
    if isinstance(exc, DiskFullError):
        reason: DiskFullError | None = exc  # recovered, and no room: closing the catalog may have freed its log
    elif isinstance(exc, CatalogIOError) and op.account.disk.full():
        reason = disk_full(op, "nothing this cache can free without a catalog write")
    else:
        reason = None
    if reason is not None and read_only_fallback(op.config):
        try:
            open_read_only(op, reason, logs)
            return True
        except (CatalogIOError, ReadOnlyError, OSError):
            pass  # cannot even be read without writing: the disk-full error stands
        except BaseException:
            op.life.release_lock()
            raise
    op.life.release_lock()
    if reason is not None:
        raise reason from exc
    return False


def disk_full(op: Opening, why: str) -> DiskFullError:
    """The error naming the full disk under the catalog: what it has free (bytes,
    inodes), ``why`` the open gave up on writing, and what to free."""
    free, remedy = op.account.disk.lack()
    return DiskFullError(f"{op.root}: the disk is full ({free}, no reserve left; {why}): "
                         f"free {remedy} on that file system and open again")


def open_read_only(op: Opening, reason: DiskFullError, logs: frozenset[str]) -> None:
    """Open this (locked) cache read-only: no recovery, no write (``engine/readonly.py``).
    ``logs``: the catalog's log files before the failed open (those it created are removed)."""
    o, root, layout = op.config, op.root, op.layout
    drop_empty_log(root, logs)
    cat = op.catalog = op.life.catalog = Catalog.open_read_only(root, reason, op.hook)
    try:
        check_layout(cat, root, layout, op.account.capacity)
        identity.check(cat, root, o.identity)
        recovery.check_structure(cat, layout, root)
        if tiers.recorded(tiering.recorded(cat)) != o.backing:
            raise reason
        backing = tiering.open_backing(cat, root, op.account.capacity, op.executor.pool, o.backing, None)
        ranks = backing.bind(local_ranks(op), given=False)
        bind(op, backing, ranks, [r.directory for r in ranks])
        if op.recovery_report is None:  # kept when recovery ran before
            op.recovery_report = recovery.RecoveryReport()
        loading.load(op.index, cat, op.recency, op.account)
        op.mode.unsettled = readonly.hold_out(cat, op.index)
        bandwidth = None if isinstance(o.bandwidth, str) else o.bandwidth
        op.calibration = calibration.resolve(cat, op.executor, backing.kind, root, op.settings, bandwidth)
        op.compactor = None
    except BaseException:
        drop_effects(op)
        raise
    op.mode.read_only = reason
    log.warning("opened_read_only", root=root, reason=str(reason), unsettled=len(op.mode.unsettled))


def check_root(root: str, create: bool) -> None:
    if os.path.exists(root) and not os.path.isdir(root):
        raise NotACacheError(f"{root} is not a directory")
    if os.path.isdir(root):
        if not os.path.lexists(os.path.join(root, CATALOG_NAME)):
            trust.refuse_unless_new(root, f"{CATALOG_NAME} is missing")
    elif not create:
        raise NotACacheError(f"{root} does not exist")
    os.makedirs(root, exist_ok=True)


def check_layout(cat: Catalog, root: str, layout: Layout, capacity: int) -> None:
    stored = cat.meta("layout")
    if stored is None:
        with cat.txn("init") as c:
            cat.set_meta(c, "layout", layout.to_json())
            cat.set_meta(c, "capacity", str(capacity))
        return
    created = Layout.from_json(stored)
    if created != layout:
        raise LayoutMismatchError(
            f"{root} was created with another layout (created vs given: "
            f"{'; '.join(created.differences(layout))})"
        )
    if cat.meta("capacity") != str(capacity) and cat.read_only is None:
        with cat.txn("capacity") as c:
            cat.set_meta(c, "capacity", str(capacity))


def fit(op: Opening) -> None:
    """At open: evict by policy (journaled) until the charged bytes fit the capacity;
    hold the catalog's room in its files and take the disk reserve back if they fit. The
    disk's room is no reason to evict here (a full disk opens read-only instead, see
    ``open_effects``). Raises CapacityError when the capacity cannot be reached."""
    acct, rep = op.account, op.recovery_report
    with op.guard.lock:
        over = acct.charged - acct.capacity
        if over > 0:
            freed = space.free(op.flows.room, over)
            rep.evicted += freed
            log.info("open_evicted", bytes=freed, charged=acct.charged, capacity=acct.capacity)
        if acct.charged > acct.capacity:
            raise CapacityError(
                f"{op.root}: {acct.charged} bytes stay charged after evicting what open "
                f"can, above capacity_bytes={acct.capacity}; open with a larger capacity"
            )
        acct.disk.hold_catalog_room()
        acct.disk.restore()


# -- close -------------------------------------------------------------------------------------


def close(cl: Closing) -> None:
    """The body of ``Engine.close`` (see there)."""
    if cl.guard.closed:
        return
    if cl.transfers.commit.current or cl.transfers.retry.current:
        # e.g. from a queued store's valid() callback: draining would wait for itself
        raise InvalidInputError("close() cannot run inside the engine's own commit or retry worker")
    cl.transfers.drain()  # outside the lock: queued async stores commit first
    if cl.compactor is not None:
        cl.compactor.stop()  # outside the lock: the worker may be waiting for it
    deadline = time.monotonic() + cl.settings.close_wait_s
    quiesce(cl.guard, deadline)
    # Jobs queued since the drain are refused by the guard; let them release what they hold.
    cl.transfers.drain(max(0.0, deadline - time.monotonic()))
    cl.remotes.close(min(cl.settings.remote_flush_s, max(0.0, deadline - time.monotonic())))
    with cl.guard.lock:
        if cl.guard.closed:  # abandoned meanwhile (a simulated crash)
            return
        try:
            if cl.mode.read_only is None:
                cl.recency.flush(cl.index, cl.catalog)
        finally:
            shutdown(cl.life)


def quiesce(guard: CallGuard, deadline: float) -> None:
    """Refuse new public calls; wait until those in flight on other threads end
    (or ``deadline``, a ``time.monotonic()`` value, passes)."""
    guard.quiesce(deadline)


def abandon(life: Lifetime) -> None:
    """Model process death: drop the connection (uncommitted work rolls back)."""
    shutdown(life)


def shutdown(life: Lifetime) -> None:
    """Release what the engine holds (see ``Lifetime.shutdown``)."""
    life.shutdown()
