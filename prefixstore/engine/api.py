"""The engine's public API: ``Engine`` and its public methods.

Each method validates its arguments, enters the call guard and calls the module that
does the work: ``lifecycle`` (open, guard, close), ``store``, ``retry`` (the queue of
refused stores), ``lookup``, ``restore``, ``holds`` (pins), ``space`` and ``evict``,
``stats``; ``pipeline`` (async stores) and ``compaction``.

Concurrency: one re-entrant lock guards the index, the catalog connection and the
pin/fence tables. File writes and reads of a store or restore run outside the lock,
with the nodes involved fenced (in flight) or pinned, so lookups never wait on I/O.

Every mutation is a transaction whose states are defined in
``prefixstore.statemachine.transactions``; the engine's driver (``eng.ledger.driver``,
``engine/driver.py``, its output handlers in ``engine/journal.py``) commits each
state reached before the outputs of that transition run.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any, ClassVar

import attrs

from prefixstore.base.errors import DiskFullError, InvalidArgumentError, InvalidInputError
from prefixstore.base.keys import Prefix
from prefixstore.base.layout import Layout, RankTensors
from prefixstore.engine import (
    audit,
    checks,
    compaction,
    config,
    degraded,
    evict,
    lifecycle,
    lookup,
    params,
    pipeline,
    remote,
    restore,
    retry,
    space,
    stats,
    store,
    validate,
)
from prefixstore.engine.config import EngineConfig
from prefixstore.engine.driver import Driver
from prefixstore.engine.lifecycle import Parts
from prefixstore.engine.params import LookupParams, StoreParams
from prefixstore.engine.results import QUEUED, REFUSED, Match, Restored, StoreResult
from prefixstore.gpu.diskroom import RESERVE_BYTES, DiskRoom
from prefixstore.gpu.remote import RemoteTier
from prefixstore.gpu.tier import Backing, Tier
from prefixstore.statemachine import policy as pol
from prefixstore.statemachine.compaction import CompactionPolicy
from prefixstore.statemachine.cost import CostModel

LOCK_NAME = lifecycle.LOCK_NAME


class Engine(Parts):
    """A prefix-cache host tier over a SQLite WAL catalog and per-rank shard files."""

    __slots__ = ()
    MAX_PENDING: ClassVar[int] = 256
    """Refused stores kept for retry at most; the oldest is dropped (and counted) beyond."""
    disk_reserve_bytes: ClassVar[int] = RESERVE_BYTES
    """Size of the catalog's reserve file (``gpu/diskroom.py``); 0 holds none."""

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
        deciding whether to admit a store; a ``RetentionAdmission`` under the
        ``prefixstore`` policy also orders the eviction of leaves by its rule),
        ``inflight_wait_s`` (how long a store waits for an overlapping store in flight
        before it is skipped as 'in_flight'),
        ``compaction`` (True or a ``statemachine.compaction.CompactionPolicy``: run the
        background compaction worker; see ``engine/compaction.py``), ``backing``
        ('disk' default, 'memory', 'composite'; see ``gpu/backings.py``) with
        ``ram_bytes`` (the RAM tier's budget), ``executor`` ('cpu' default, 'cuda',
        'cuda:N' or an executor object; see ``gpu/executor.py``), ``bandwidth`` (None,
        bytes/s, 'measure' or 'remeasure': the cost rule's restore bandwidth; see
        ``gpu/calibrate.py``), ``read_only_fallback`` (True default: on a full disk
        where nothing can be freed without a commit, open read-only, with the reason in
        ``read_only``, instead of raising DiskFullError; see ``engine/readonly.py``),
        ``remote`` (the URL of a registered remote tier, ``gpu.remote.SCHEMES``: e.g.
        ``redis://host:port/0`` or ``mooncake://host:port?metadata=...``; the shared
        remote tier below the local ones; see ``engine/remote.py``) with
        ``remote_options`` (a ``gpu.remote.RemoteConfig`` or a dict of its fields),
        ``identity`` (a mapping of str to str naming the model the cache belongs to:
        recorded when the cache is created, compared on every open that gives one,
        ``IdentityMismatchError`` naming the fields that differ; see ``engine/identity.py``).
        ``config``: an ``EngineConfig`` holding these options (others given beside it
        override its fields); every option is checked once, with a typed error naming it.
        A rank whose tier cannot serve (a rank server not registered or not answering)
        does not stop the open: the engine opens degraded (``degraded``, see
        ``engine/degraded.py``).
        """
        root, cfg = config.resolve_open(path, layout, capacity_bytes, opts)
        return cls(root, layout, capacity_bytes, cfg)

    def __init__(self, root: str, layout: Layout, capacity_bytes: int, config: EngineConfig | None = None,
                 **opts: Any) -> None:
        """Use ``Engine.open`` (it checks the arguments); ``config`` or ``opts``: the options."""
        parts = lifecycle.start(root, layout, capacity_bytes, config or EngineConfig.from_options(**opts), self,
                                reserve_bytes=self.disk_reserve_bytes, max_pending=self.MAX_PENDING)
        super().__init__(**{f.name: getattr(parts, f.name) for f in attrs.fields(Parts)})

    # -- what the engine is made of, by the names its users read -----------------------------

    @property
    def capacity(self) -> int:
        """The bytes the cache may charge (``capacity_bytes``)."""
        return self.account.capacity

    @capacity.setter
    def capacity(self, value: int) -> None:
        self.account.capacity = value

    @property
    def model_identity(self) -> dict[str, str] | None:
        """The model the cache belongs to (the ``identity`` option, ``engine/identity.py``)."""
        return self.config.identity

    @property
    def policy_name(self) -> str:
        return self.settings.policy

    @property
    def cost(self) -> CostModel | None:
        """The restore cost rule (its bandwidth calibrated at open when ``bandwidth=`` asked)."""
        return self.settings.cost

    @property
    def admission(self) -> Callable[..., bool] | None:
        return self.settings.admission

    @property
    def compaction_policy(self) -> CompactionPolicy | None:
        return self.settings.compaction_policy

    @property
    def inflight_wait_s(self) -> float:
        return self.settings.inflight_wait_s

    @property
    def pin_wait_s(self) -> float:
        """How long a refill waits for a restore's pin before it rolls back."""
        return self.settings.pin_wait_s

    @pin_wait_s.setter
    def pin_wait_s(self, value: float) -> None:
        self.settings.pin_wait_s = value

    @property
    def close_wait_s(self) -> float:
        """How long ``close`` waits for public calls in flight on other threads."""
        return self.settings.close_wait_s

    @close_wait_s.setter
    def close_wait_s(self, value: float) -> None:
        self.settings.close_wait_s = value

    @property
    def remote_flush_s(self) -> float:
        """How long ``close`` waits for the remote tier's queued writes (at most)."""
        return self.settings.remote_flush_s

    @remote_flush_s.setter
    def remote_flush_s(self, value: float) -> None:
        self.settings.remote_flush_s = value

    @property
    def high_watermark(self) -> float:
        return self.account.high_watermark

    @property
    def low_watermark(self) -> float:
        return self.account.low_watermark

    @property
    def read_only(self) -> DiskFullError | None:
        """Why the engine was opened read-only (``engine/readonly.py``); None when writable."""
        return self.mode.read_only

    @property
    def unsettled(self) -> frozenset[int]:
        """Read-only: the nodes held out of service (an unfinished transaction touches them)."""
        return self.mode.unsettled

    @property
    def driver(self) -> Driver:
        """The journal's driver (``engine/driver.py``)."""
        return self.ledger.driver

    @property
    def ranks(self) -> list[Tier]:
        """The tier of each rank."""
        return self.tiers.ranks

    @property
    def backing(self) -> Backing:
        """The backing the engine runs on (``gpu/tiers/``)."""
        return self.tiers.backing

    @property
    def remote(self) -> RemoteTier | None:
        """The shared remote tier (``engine/remote.py``); None without one, or once closed."""
        return self.remotes.tier

    @property
    def heap(self) -> pol.VictimHeap:
        """The victim heap: the eviction policy's order of the nodes."""
        return self.recency.heap

    @property
    def disk(self) -> DiskRoom:
        """The disk's room: free-space checks and the catalog's reserve (``gpu/diskroom.py``)."""
        return self.account.disk

    def __repr__(self) -> str:
        return f"<Engine {self.root}: {len(self.index)} nodes, {self.account.charged} bytes charged>"

    # -- the public API ----------------------------------------------------------------------

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        if not self.guard.closed:
            self.close()

    def store(
        self,
        prefix: Prefix | StoreParams,
        segments: RankTensors | Sequence[RankTensors] | None = None,
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
        fits or ``valid()`` turns false (then it is dropped and counted). A
        ``StoreParams`` may be given alone instead of the arguments.
        """
        prefix, segments, snapshot, tokens_from, valid = params.store_arguments(
            "store", prefix, segments, snapshot, tokens_from, valid)
        segs, snaps = validate.store_args(self.layout, prefix, segments, snapshot, tokens_from, valid)
        self.mode.check_writable("store")
        with self.guard:
            self._poll_ranks()
            result = store.store(self.flows.storing, prefix, segs, snaps, tokens_from)
            if result.status == REFUSED and valid is not None:
                retry.enqueue(self.flows.retrying, retry.Pending(prefix, segs, snaps, tokens_from, valid))
                result = attrs.evolve(result, status=QUEUED)
            if result.ok:
                self.retry_pending()
            return result

    def store_async(
        self,
        prefix: Prefix | StoreParams,
        segments: RankTensors | Sequence[RankTensors] | None = None,
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
        A ``StoreParams`` may be given alone instead of the arguments.
        """
        prefix, segments, snapshot, tokens_from, valid = params.store_arguments(
            "store_async", prefix, segments, snapshot, tokens_from, valid)
        self.mode.check_writable("store_async")
        return pipeline.store_async(self.flows.async_stores, prefix, segments, snapshot, tokens_from, valid)

    def lookup(self, prefix: Prefix | LookupParams, *, gpu_blocks: int = 0, total_tokens: int | None = None) -> Match:
        """The deepest checkpoint of ``prefix`` worth restoring.

        ``gpu_blocks``: leading blocks already resident on the GPU (not restored).
        ``total_tokens``: the request's length (for the cost rule; default the prefix).
        Only nodes whose whole path below the GPU-resident part is ready qualify, and
        for layouts with snapshots only nodes that have their snapshot. A
        ``LookupParams`` may be given alone instead of the arguments.
        """
        if prefix.__class__ is not Prefix and isinstance(prefix, LookupParams):  # one test for a Prefix
            params.alone("lookup", prefix, gpu_blocks, total_tokens)
            prefix, gpu_blocks, total_tokens = prefix.prefix, prefix.gpu_blocks, prefix.total_tokens
        validate.lookup_args(self.layout, prefix, gpu_blocks, total_tokens)
        flows, guard = self.flows, self.guard
        down = flows.reviving.tiers.down  # the poll and the screen act only while a rank is down
        looked = self.counters.looked  # changed only under the engine lock (counters.py)
        with guard:
            if down.why:
                self._poll_ranks()
            with guard.lock:
                match = lookup.lookup(flows.looking, prefix, gpu_blocks, total_tokens)
                if down.why:
                    match = degraded.screen(flows.reviving, match)
                if flows.remote_reads.link.tier is None:
                    looked[match.outcome] += 1
                    return match
            match = remote.extend(flows.remote_reads, prefix, match, gpu_blocks, total_tokens)  # outside the lock
            with guard.lock:
                looked[match.outcome] += 1
        return match

    def restore(self, match: Match, *, into: Any = None) -> Restored | None:
        """Read, verify and return the tensors of ``match``; None on a miss.

        A shard that is missing, short, or fails its checksum or header check marks
        its node damaged and the restore reports a miss: other bytes are never
        returned. ``into``: the caller's tensors to fill (a mapping of the layout's
        segments, or one per rank; the rows the match restores, contiguous, on the
        executor's device; or a segment's ``Pieces``: spans of one tensor's memory the
        rows fill in order), returned as the segments; refused with a typed error
        before anything is read. After a miss their contents are unspecified.
        """
        validate.match(self.identity, self.root, match)
        outs = validate.into(self.layout, self.executor.device, match, into)
        if not match.hit:
            return None
        with self.guard:
            self._poll_ranks()
            if match.source == remote.SOURCE:
                if outs is not None:
                    raise InvalidArgumentError("into", "a match served by the remote tier cannot restore into tensors")
                return remote.restore(self.flows.remote_reads, match)
            return restore.restore(self.flows.restoring, match, outs)

    def pin(self, match: Match) -> bool:
        """Pin every local node a restore of ``match`` reads (never evicted or replaced
        until unpinned): its path, or the local part a remote path builds on. False when
        they changed meanwhile, or when the match reads nothing local."""
        validate.match(self.identity, self.root, match)
        local = remote.local_reads(match)
        with self.guard, self.guard.lock:
            if local is None or not lookup.path_current(self.index, local):
                return False
            self.holds.pin_request([nid for nid, _ in local.path])
            return True

    def unpin(self, match: Match) -> None:
        """Release a pin taken by ``pin``; unpinning what is not pinned is an error."""
        validate.match(self.identity, self.root, match)
        local = remote.local_reads(match)
        path = local.path if local is not None else ()
        with self.guard:
            with self.guard.lock:
                for nid, _ in path:
                    if self.holds.request_pins[nid] <= 0:
                        raise InvalidInputError(f"node {nid} is not pinned")
                self.holds.unpin_request([nid for nid, _ in path])
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
        nbytes, prefix = validate.evict_args(self.layout, nbytes, prefix)
        self.mode.check_writable("evict")
        with self.guard:
            with self.guard.lock:
                before = self.account.charged
                if prefix is not None:
                    evict_leaf(self.flows.room, prefix)
                elif nbytes is not None:
                    space.free(self.flows.room, min(self.account.charged, nbytes))
                freed = before - self.account.charged
            self.retry_pending()
            return freed

    @property
    def degraded(self) -> degraded.RanksDown | None:
        """The ranks this engine runs without and why (a ``RanksDown``), or None when
        every rank serves. While one is down, lookups that would read shards miss and
        stores are refused (``reason="ranks_down"``); see ``engine/degraded.py``."""
        return degraded.state(self.flows.reviving)

    def reconnect_ranks(self, timeout: float = 0.0) -> tuple[int, ...]:
        """Bring back the ranks this engine runs without: wait up to ``timeout`` s for
        each to serve again (a rank server registered), complete its deferred recovery,
        then retry queued stores. Returns the ranks still down. Lookups and stores also
        bring a rank back on their own, asking at most once a second."""
        wait = checks.real("timeout", timeout, lo=0.0, hi=86400.0)
        with self.guard:
            left = degraded.reconnect(self.flows.reviving, wait)
            if not left:
                self.retry_pending()
            return left

    def _poll_ranks(self) -> None:
        """Inside a call: bring back the down ranks that serve again (at most once a second)."""
        if degraded.poll(self.flows.reviving) and self.degraded is None:
            self.retry_pending()

    def reclaim(self) -> int:
        """Unlink garbage left by failed cleanups (then retry queued stores); returns
        bytes reclaimed."""
        self.mode.check_writable("reclaim")
        with self.guard:
            with self.guard.lock:
                before = self.account.charged
                space.reclaim_loose(self.flows.room)
                freed = before - self.account.charged
            self.retry_pending()
            return freed

    def compact(self, policy: Any = None):
        """Run one compaction pass now: merge single-child chains where ``policy`` (a
        ``CompactionPolicy``; default the engine's) says it pays. Reads and writes run
        outside the engine lock. Returns a ``compaction.CompactionReport``."""
        validate.compact_policy(policy)
        self.mode.check_writable("compact")
        return compaction.compact(self.flows.compacting, policy)

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
        retry.run(self.flows.retrying)

    def stats(self) -> dict[str, Any]:
        """Counters, capacity and node counts as one dict."""
        with self.guard, self.guard.lock:
            out = stats.collect(self.flows.stats, self.calibration)
        stats.publish(self.counters, self.account, out)
        return out

    def audit(self, *, checksums: bool = True):
        """Check every invariant against this engine's directory (and its memory)."""
        validate.flag("checksums", checksums)
        with self.guard, self.guard.lock:
            report = audit.audit_engine(self.flows.live, checksums=checksums)
            remote.note(self.remotes, report)
            return report

    def close(self) -> None:
        """Flush recency, close the catalog and release the directory lock.

        Queued asynchronous stores commit first. Then new calls are refused
        (``EngineClosedError``) and calls in flight on other threads are waited for,
        up to ``close_wait_s``; one still running after that fails with
        ``EngineClosedError`` if it needs what close released (an unpublished
        transaction of it is left to recovery at the next open, as after a crash).
        """
        lifecycle.close(self.closing)


def evict_leaf(rm: space.Room, prefix: Prefix) -> None:
    """``Engine.evict(prefix=...)``: evict the leaf at the end of ``prefix`` unless it is
    held, interior or absent. Lock held."""
    nid = rm.index.by_key.get(prefix.keys[-1]) if len(prefix) else None
    node = rm.index.get(nid) if nid is not None else None
    if node is None or space.blocked(rm, node.id, pol.EVICT) or not node.is_leaf:
        return
    before = rm.account.charged
    evict.evict_nodes(rm.evicting, [node])
    rm.counters.evicted(pol.EVICT, before - rm.account.charged)
