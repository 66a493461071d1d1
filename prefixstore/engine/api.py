"""The engine's public API: ``Engine`` and its public methods.

Each method validates its arguments, enters the call guard and calls the module that
does the work: ``lifecycle`` (open, guard, close), ``store``, ``retry`` (the queue of
refused stores), ``lookup``, ``restore``, ``holds`` (pins), ``space`` and ``evict``,
``stats``; ``pipeline`` (async stores) and ``compaction``.

Concurrency: one re-entrant lock guards the index, the catalog connection and the
pin/fence tables. File writes and reads of a store or restore run outside the lock,
with the nodes involved fenced (in flight) or pinned, so lookups never wait on I/O.

Every mutation is a transaction whose states are defined in
``prefixstore.statemachine.transactions``; the engine's driver (``eng.driver``,
``engine/driver.py``, its output handlers in ``engine/journal.py``) commits each
state reached before the outputs of that transition run.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import attrs

from prefixstore.base.errors import DiskFullError, InvalidInputError
from prefixstore.base.keys import Prefix
from prefixstore.base.layout import Layout, RankTensors
from prefixstore.engine import (
    audit,
    compaction,
    config,
    evict,
    holds,
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
from prefixstore.engine.params import LookupParams, StoreParams
from prefixstore.engine.results import QUEUED, REFUSED, Match, Restored, StoreResult
from prefixstore.gpu.diskroom import RESERVE_BYTES
from prefixstore.statemachine import policy as pol

LOCK_NAME = lifecycle.LOCK_NAME


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
    pin_wait_s = 2.0  # how long a refill waits for a restore's pin before it rolls back
    close_wait_s = 30.0  # how long close() waits for public calls in flight on other threads
    remote_flush_s = 10.0  # how long close() waits for the remote tier's queued writes (at most)

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
        """
        root, cfg = config.resolve_open(path, layout, capacity_bytes, opts)
        return cls(root, layout, capacity_bytes, cfg)

    def __init__(self, root: str, layout: Layout, capacity_bytes: int, config: EngineConfig | None = None,
                 **opts: Any) -> None:
        """Use ``Engine.open`` (it checks the arguments); ``config`` or ``opts``: the options."""
        lifecycle.start(self, root, layout, capacity_bytes, config or EngineConfig.from_options(**opts))

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        if not self._closed:
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
        segs, snaps = validate.store_args(self, prefix, segments, snapshot, tokens_from, valid)
        lifecycle.check_writable(self, "store")
        with lifecycle.guard(self):
            result = store.store(self, prefix, segs, snaps, tokens_from)
            if result.status == REFUSED and valid is not None:
                retry.enqueue(self, retry.Pending(prefix, segs, snaps, tokens_from, valid))
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
        lifecycle.check_writable(self, "store_async")
        return pipeline.store_async(self, prefix, segments, snapshot, tokens_from, valid)

    def lookup(self, prefix: Prefix | LookupParams, *, gpu_blocks: int = 0, total_tokens: int | None = None) -> Match:
        """The deepest checkpoint of ``prefix`` worth restoring.

        ``gpu_blocks``: leading blocks already resident on the GPU (not restored).
        ``total_tokens``: the request's length (for the cost rule; default the prefix).
        Only nodes whose whole path below the GPU-resident part is ready qualify, and
        for layouts with snapshots only nodes that have their snapshot. A
        ``LookupParams`` may be given alone instead of the arguments.
        """
        if isinstance(prefix, LookupParams):
            params.alone("lookup", prefix, gpu_blocks, total_tokens)
            prefix, gpu_blocks, total_tokens = prefix.prefix, prefix.gpu_blocks, prefix.total_tokens
        validate.lookup_args(self, prefix, gpu_blocks, total_tokens)
        with lifecycle.guard(self):
            with self._lock:
                match = lookup.lookup(self, prefix, gpu_blocks, total_tokens)
            match = remote.extend(self, prefix, match, gpu_blocks, total_tokens)  # outside the lock
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
        with lifecycle.guard(self):
            if match.source == remote.SOURCE:
                return remote.restore(self, match)
            return restore.restore(self, match)

    def pin(self, match: Match) -> bool:
        """Pin every local node a restore of ``match`` reads (never evicted or replaced
        until unpinned): its path, or the local part a remote path builds on. False when
        they changed meanwhile, or when the match reads nothing local."""
        validate.match(self, match)
        local = remote.local_reads(match)
        with lifecycle.guard(self), self._lock:
            if local is None or not lookup.path_current(self, local):
                return False
            holds.pin_request(self, [nid for nid, _ in local.path])
            return True

    def unpin(self, match: Match) -> None:
        """Release a pin taken by ``pin``; unpinning what is not pinned is an error."""
        validate.match(self, match)
        local = remote.local_reads(match)
        path = local.path if local is not None else ()
        with lifecycle.guard(self):
            with self._lock:
                for nid, _ in path:
                    if self._request_pins[nid] <= 0:
                        raise InvalidInputError(f"node {nid} is not pinned")
                holds.unpin_request(self, [nid for nid, _ in path])
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
        lifecycle.check_writable(self, "evict")
        with lifecycle.guard(self):
            with self._lock:
                before = self._charged
                if prefix is not None:
                    evict_leaf(self, prefix)
                elif nbytes is not None:
                    space.free(self, min(self._charged, nbytes))
                freed = before - self._charged
            self.retry_pending()
            return freed

    def reclaim(self) -> int:
        """Unlink garbage left by failed cleanups (then retry queued stores); returns
        bytes reclaimed."""
        lifecycle.check_writable(self, "reclaim")
        with lifecycle.guard(self):
            with self._lock:
                before = self._charged
                space.reclaim_loose(self)
                freed = before - self._charged
            self.retry_pending()
            return freed

    def compact(self, policy: Any = None):
        """Run one compaction pass now: merge single-child chains where ``policy`` (a
        ``CompactionPolicy``; default the engine's) says it pays. Reads and writes run
        outside the engine lock. Returns a ``compaction.CompactionReport``."""
        validate.compact_policy(policy)
        lifecycle.check_writable(self, "compact")
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
        retry.run(self)

    def stats(self) -> dict[str, Any]:
        """Counters, capacity and node counts as one dict."""
        with lifecycle.guard(self), self._lock:
            out = stats.collect(self)
        stats.publish(self, out)
        return out

    def audit(self, *, checksums: bool = True):
        """Check every invariant against this engine's directory (and its memory)."""
        validate.flag("checksums", checksums)
        with lifecycle.guard(self), self._lock:
            report = audit.audit_engine(self, checksums=checksums)
            remote.note(self, report)
            return report

    def close(self) -> None:
        """Flush recency, close the catalog and release the directory lock.

        Queued asynchronous stores commit first. Then new calls are refused
        (``EngineClosedError``) and calls in flight on other threads are waited for,
        up to ``close_wait_s``; one still running after that fails with
        ``EngineClosedError`` if it needs what close released (an unpublished
        transaction of it is left to recovery at the next open, as after a crash).
        """
        lifecycle.close(self)


def evict_leaf(eng: Engine, prefix: Prefix) -> None:
    """``Engine.evict(prefix=...)``: evict the leaf at the end of ``prefix`` unless it is
    held, interior or absent. Lock held."""
    nid = eng.index.by_key.get(prefix.keys[-1]) if len(prefix) else None
    node = eng.index.get(nid) if nid is not None else None
    if node is None or space.blocked(eng, node.id, pol.EVICT) or not node.is_leaf:
        return
    before = eng._charged
    evict.evict_nodes(eng, [node])
    eng.counters.evicted(pol.EVICT, before - eng._charged)
