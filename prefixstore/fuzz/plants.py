"""Planted bugs: deliberately broken engines the fuzzers must catch.

Each plant swaps in broken rank executors, or patches one function of a flow for the
duration of a run (``Plant.active``: every engine opened meanwhile is the planted one;
its ``engine_cls`` names it), or patches the rank server processes a run starts
(``server_patch``, applied in each of them); nothing in the engine knows about them. ``prefixstore fuzz --plant NAME`` runs a campaign against one, and
``tests/test_plants.py`` shows that each is found within a bounded budget.

``config`` pins the run settings a plant needs in order to show at all (a lost-commit
bug needs ``synchronous=NORMAL``; a snapshot-retirement bug needs snapshots and the
``prefixstore`` policy); everything else is drawn as in any campaign.
"""

from __future__ import annotations

import contextlib
import os
from collections import Counter
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from typing import Any

import attrs

from prefixstore.engine import (
    health,
    journal,
    pipeline,
    rebuild,
    recovery,
    remote,
    replace,
    restore,
    space,
    staging,
    store,
    transfers,
)
from prefixstore.engine.api import Engine
from prefixstore.engine.catalog import Catalog
from prefixstore.engine.pipeline import AsyncStores
from prefixstore.engine.replace import Replacing
from prefixstore.engine.restore import Reader
from prefixstore.engine.results import STORED, StoreResult
from prefixstore.engine.space import Room
from prefixstore.engine.store import Storing
from prefixstore.gpu import rank_server, shards, verify
from prefixstore.gpu.ranks import TMP_SUFFIX, LocalRank, rank_dir_name
from prefixstore.gpu.remote import Manifest, RemoteTier


@attrs.frozen
class Plant:
    """One deliberately broken engine."""

    name: str
    summary: str
    found_by: str
    engine_cls: type[Engine] | None = None
    make_ranks: Callable[..., list[Any]] | None = None
    patch: Callable[[], contextlib.AbstractContextManager[None]] | None = None
    config: dict[str, Any] = attrs.field(factory=dict)
    server_patch: Callable[[], None] | None = None
    """Applied (for good) in each rank server process of a run (``fuzz/rank_host.py``)."""

    def active(self) -> contextlib.AbstractContextManager[None]:
        """The patches this plant needs while its engine runs."""
        return self.patch() if self.patch is not None else contextlib.nullcontext()


def _ranks(cls: type[LocalRank]) -> Callable[..., list[Any]]:
    def make(layout, root: str, fs, hook) -> list[Any]:
        out = [cls(r, os.path.join(root, rank_dir_name(r)), fs, hook) for r in range(layout.ranks)]
        for rank in out:
            rank.last = layout.ranks - 1
        return out

    return make


@contextlib.contextmanager
def _patched(obj: Any, name: str, value: Any) -> Iterator[None]:
    old = getattr(obj, name)
    setattr(obj, name, value)
    try:
        yield
    finally:
        setattr(obj, name, old)


# -- publish before every rank is durable -------------------------------------------------


class _LazyLastRank(LocalRank):
    """The highest rank renames its shard into place unsynced; ``settle`` syncs it later."""

    def __init__(self, *a: Any, **k: Any) -> None:
        super().__init__(*a, **k)
        self.unsettled: list[str] = []
        self.last = 0

    def write_shard(self, name: str, data: bytes) -> None:
        if self.rank != self.last:
            return super().write_shard(name, data)
        final = self.path(name)
        self.fs.write_new(final + TMP_SUFFIX, data)
        self.fs.rename_new(final + TMP_SUFFIX, final)
        self.unsettled.append(final)

    def settle(self) -> None:
        todo, self.unsettled = self.unsettled, []
        with contextlib.suppress(OSError):
            for final in todo:
                self.fs.fsync(final)
            if todo:
                self.fs.fsync_dir(self.directory)


class _PublishEarly(Engine):
    """Its stores publish before the highest rank's shard is durable (``_publish_early``)."""


def _publish_early() -> contextlib.AbstractContextManager[None]:
    orig = store.publish

    def publish(st: Storing, *a: Any, **k: Any):
        node = orig(st, *a, **k)
        for r in st.tiers.ranks:
            if isinstance(r, _LazyLastRank):
                r.settle()  # durability arrives after the commit that published
        return node

    return _patched(store, "publish", publish)


# -- skip the directory fsync ----------------------------------------------------------------


class _NoDirSyncRank(LocalRank):
    def write_shard(self, name: str, data: bytes) -> None:
        final = self.path(name)
        self.fs.write_new(final + TMP_SUFFIX, data)
        self.fs.fsync(final + TMP_SUFFIX)
        self.fs.rename_new(final + TMP_SUFFIX, final)  # no fsync_dir: the rename is not durable


# -- count a retiring backing twice --------------------------------------------------------


class _DoubleCountRetire(Engine):
    """Its compact-replaces subtract the retired generation twice (``_double_count``)."""


def _double_count() -> contextlib.AbstractContextManager[None]:
    orig = journal.unlink_owned

    def unlink_owned(led: journal.Ledger, txn, ok: str, failed: str, *, barrier: bool) -> None:
        before = led.account.charged
        orig(led, txn, ok, failed, barrier=barrier)
        if txn.kind == "compact" and ok == "retired":
            led.account.charged -= before - led.account.charged  # the retired generation, once more

    return _patched(journal, "unlink_owned", unlink_owned)


# -- skip a table output: retire_old ------------------------------------------------------


class _SkipRetire(Engine):
    """Its published transactions end without running ``retire_old``'s unlinks
    (``_skip_retire``): DONE is reached with the old generation still owned."""


def _skip_retire() -> contextlib.AbstractContextManager[None]:
    orig = journal.unlink_owned

    def unlink_owned(led: journal.Ledger, txn, ok: str, failed: str, *, barrier: bool) -> None:
        if ok != "retired":
            return orig(led, txn, ok, failed, barrier=barrier)
        with led.catalog.txn(f"{txn.kind}.{ok}") as c:
            outs = led.driver.fire(c, txn, ok)  # no unlink, no settled rows
        led.driver.run_outputs(txn, outs)
        return None

    return _patched(journal, "unlink_owned", unlink_owned)


# -- leave one victim's files behind in a batched evict ---------------------------------------


class _BatchDropsUnlink(Engine):
    """Its batched evicts settle every victim's file rows but leave the last one's
    files in place (``_batch_drops_unlink``)."""


def _batch_drops_unlink() -> contextlib.AbstractContextManager[None]:
    orig = journal.unlink_owned

    def unlink_owned(led: journal.Ledger, txn, ok: str, failed: str, *, barrier: bool) -> None:
        if txn.kind != "evict" or len(txn.payload.get("nodes", ())) < 2:
            return orig(led, txn, ok, failed, barrier=barrier)
        rows = led.catalog.files_of_txn(txn.id)
        led.catalog.barrier()
        dropped = {(r, name) for r, name, _ in rows[-len(led.tiers.ranks):]}
        left = journal.unlink_rows(led, [x for x in rows if (x[0], x[1]) not in dropped])
        with led.catalog.txn(f"{txn.kind}.{ok}") as c:
            led.catalog.settle_files(c, rows, left)  # the dropped files' rows go as if unlinked
            outs = led.driver.fire(c, txn, failed if left else ok)
        led.account.charged -= journal.unlinked_bytes(rows, left)
        led.driver.run_outputs(txn, outs)
        return None

    return _patched(journal, "unlink_owned", unlink_owned)


# -- evict a pinned node ---------------------------------------------------------------------


class _EvictPinned(Engine):
    """Its victim search ignores pins (``_evict_pinned``)."""


def _ignoring_pins(fn: Callable[..., bool]) -> Callable[..., bool]:
    def check(rm: Room, *a: Any) -> bool:
        pins, rm.holds.pins = rm.holds.pins, Counter()  # pins are not consulted
        try:
            return fn(rm, *a)
        finally:
            rm.holds.pins = pins

    return check


@contextlib.contextmanager
def _evict_pinned() -> Iterator[None]:
    with _patched(space, "untouchable", _ignoring_pins(space.untouchable)), \
            _patched(space, "blocked", _ignoring_pins(space.blocked)):
        yield


# -- rename over a live file --------------------------------------------------------------------


def _retire_in_place(rp: Replacing, node) -> bool:
    """Snapshot retirement that rewrites the live generation under its own name."""
    rows = {
        r: (name, size, ck)
        for r, name, size, ck in rp.catalog.query(
            "SELECT rank, name, size, checksum FROM files WHERE node=? AND status='live'", (node.id,)
        )
    }
    got = restore.read_node(rp.reader, node, rows, with_snap=False)
    if isinstance(got, str):
        health.invalidate(rp.health, node, got)
        return False
    if got is None:
        return False
    meta = shards.meta(node.key, node.generation, node.start, node.end, False)
    datas = [shards.encode(segs, {}, {**meta, "rank": str(r)}) for r, (segs, _) in enumerate(got)]
    rp.holds.fence([node.id])
    try:
        for r, data in enumerate(datas):
            rank = rp.writer.tiers.ranks[r]
            final = rank.path(rows[r][0])
            try:
                rank.fs.write_new(final + TMP_SUFFIX, data)
                rank.fs.fsync(final + TMP_SUFFIX)
                rank.fs.unlink(final)  # the live file makes way for its replacement
                rank.fs.rename_new(final + TMP_SUFFIX, final)
                rank.fs.fsync_dir(rank.directory)
            except OSError:
                with contextlib.suppress(OSError):
                    rank.remove_temp(rows[r][0])
                return False
        with rp.catalog.txn("replace.publish") as c:
            for r, data in enumerate(datas):
                c.execute("UPDATE files SET size=?, checksum=? WHERE rank=? AND name=?",
                          (len(data), shards.checksum(data), r, rows[r][0]))
            c.execute("UPDATE nodes SET has_snapshot=0 WHERE id=?", (node.id,))
        freed = sum(s for _, s, _ in rows.values()) - sum(len(d) for d in datas)
        rp.account.charged -= freed
        node.has_snapshot = False
        node.nbytes -= freed
        return True
    finally:
        rp.holds.unfence([node.id])
        rp.recency.heap.offer(node)


class _RenameOverLive(Engine):
    """Its snapshot retirements rewrite the live file in place (``_rename_over_live``)."""


def _rename_over_live() -> contextlib.AbstractContextManager[None]:
    def retire_snapshot(rp: Replacing, node) -> bool:
        return _retire_in_place(rp, node)

    return _patched(replace, "retire_snapshot", retire_snapshot)


# -- skip the checksum check on restore ---------------------------------------------------------


class _TrustingRestore(Engine):
    """Its shard reads trust the file's own checksum (``_trusting_restore``)."""


def _trusting_restore() -> contextlib.AbstractContextManager[None]:
    orig = restore.read_node

    def read_node(rd: Reader, node, rows, with_snap: bool):
        trusted = {}
        for r, (name, size, ck) in rows.items():
            try:
                with open(os.path.join(rd.tiers.ranks[r].directory, name), "rb") as f:
                    ck = shards.checksum(f.read())  # the file vouches for itself
            except OSError:
                pass
            trusted[r] = (name, size, ck)
        return orig(rd, node, trusted, with_snap)

    return _patched(restore, "read_node", read_node)


# -- skip the checksum on the restore path ------------------------------------------------------


class _TrustingReads(Engine):
    """Its restores' shard reads trust the file's own checksum (``_trusting_reads``)."""


def _self_vouched(rank, row: tuple[str, int, str]) -> tuple[str, int, str]:
    """``row`` with the checksum of the file as it is now (the file vouches for itself)."""
    name, size, ck = row
    try:
        with open(os.path.join(rank.directory, name), "rb") as f:
            ck = shards.checksum(f.read())
    except (OSError, AttributeError):  # no file, or a tier without a directory
        pass
    return name, size, ck


@contextlib.contextmanager
def _trusting_reads() -> Iterator[None]:
    """The restore pipeline's two reads (``_fetch_placed``: straight into the outputs;
    ``_fetch``: through staging) given the file's own checksum."""
    placed, staged = getattr(transfers, "_fetch_placed"), getattr(transfers, "_fetch")  # noqa: B009

    def fetch_placed(f, x, r, row, place, snap):
        return placed(f, x, r, _self_vouched(f.tiers.ranks[r], row), place, snap)

    def fetch(f, x, r, row, from_ram):
        return staged(f, x, r, row if from_ram else _self_vouched(f.tiers.ranks[r], row), from_ram)

    with _patched(transfers, "_fetch_placed", fetch_placed), _patched(transfers, "_fetch", fetch):
        yield


# -- acknowledge an async store before its commit ------------------------------------------------


class _EarlyAck(Engine):
    """Its async stores say "stored" once the copies are queued (``_ack_before_publish``)."""


def _ack_before_publish() -> contextlib.AbstractContextManager[None]:
    orig = pipeline.store_async

    def store_async(a_: AsyncStores, prefix, *a: Any, **k: Any) -> pipeline.StoreTicket:
        ticket = orig(a_, prefix, *a, **k)
        if ticket.done():
            return ticket
        early: Future = Future()  # the commit worker stores the bytes later (or fails, or dies)
        early.set_result(StoreResult(STORED, len(prefix)))
        return pipeline.StoreTicket(ticket.released, early)

    return _patched(pipeline, "store_async", store_async)


class _TrustingRemote(Engine):
    """Its remote restores trust the blobs they fetch (``_trusting_remote``)."""


# -- a rank server that acknowledges a write before it is durable ------------------------------


class _UnsyncedServerRank(LocalRank):
    """Renames the shard into place and syncs the directory, but never fsyncs its bytes."""

    def write_shard(self, name: str, data: bytes) -> None:
        final = self.path(name)
        self.fs.write_new(final + TMP_SUFFIX, data)
        self.fs.rename_new(final + TMP_SUFFIX, final)
        self.fs.fsync_dir(self.directory)


def _serve_unsynced() -> None:
    rank_server.LocalRank = _UnsyncedServerRank  # type: ignore[misc]


# -- the remote tier trusts what it fetched ----------------------------------------------------


def _trusting_blob(tier: RemoteTier, ref, value: Any) -> bytes | None:
    """A fetched blob taken as it came: no size, checksum or MAC check."""
    return value if isinstance(value, bytes) and value else None


def _trusting_decode(L, tier: RemoteTier, path: tuple[Manifest, ...], blobs: list[list[bytes]]):
    """Each blob's shard decoded against its own checksum, not the manifest's."""
    out = []
    for m, datas in zip(path, blobs, strict=True):
        meta = shards.meta(m.prefix_key, m.generation, m.start, m.end, m.snapshot)
        row = []
        for r, (ref, data) in enumerate(zip(m.blobs, datas, strict=True)):
            header = verify.Header(L, (m.end - m.start) * L.block_tokens, m.snapshot, {**meta, "rank": str(r)})
            got = verify.check(data, len(data), shards.checksum(data), header, ref.key)  # the blob vouches for itself
            if isinstance(got, verify.Damage):
                return None
            row.append(got)
        out.append(row)
    return out


@contextlib.contextmanager
def _trusting_remote() -> Iterator[None]:
    with _patched(RemoteTier, "_verified", _trusting_blob), _patched(remote, "decode_path", _trusting_decode):
        yield


# -- acknowledge a store before its group commit is durable ------------------------------------


class _AckBeforeGroupSync(Engine):
    """Its stores return once their publish is written to the catalog's log, before the
    sync that makes their group durable (``_ack_before_group_sync``)."""


def _ack_before_group_sync() -> contextlib.AbstractContextManager[None]:
    return _patched(store, "acknowledge", lambda st, seq: None)


# -- take shards staged for a guessed generation ----------------------------------------------


class _StalePrestaged(Engine):
    """Its stores take the shards staged before the lock hold whatever generation that
    hold decides (``_stale_prestaged``): the file's header names the guessed one."""


def _stale_prestaged() -> contextlib.AbstractContextManager[None]:
    return _patched(staging.Prestaged, "fits", lambda self, meta, lo, hi: True)


# -- a removal taken as synced under NORMAL ---------------------------------------------------


class _RemovalTakenAsSynced(Engine):
    """Under ``synchronous=NORMAL`` its evict removals commit at NORMAL, yet the catalog
    takes each as synced (``_removal_taken_as_synced``), so the reclaim's barrier is skipped."""


@contextlib.contextmanager
def _removal_taken_as_synced() -> Iterator[None]:
    txn = Catalog.txn

    @contextlib.contextmanager
    def unsynced_removal(self: Catalog, label: str, *, grouped: bool = False, durable: bool = False):
        removal = label == "evict.remove"
        with txn(self, label, grouped=grouped, durable=durable and not removal) as c:
            yield c
        if removal:
            self.unsynced = False

    with _patched(Catalog, "txn", unsynced_removal):
        yield


# -- an evict unlinks before its removal is durable -------------------------------------------


class _EvictRemovalUnsynced(Engine):
    """Its evict transactions write their removal commit grouped, like their reclaim, and
    unlink the victims' files without waiting for the log sync (``_evict_removal_unsynced``)."""


@contextlib.contextmanager
def _evict_removal_unsynced() -> Iterator[None]:
    txn, unlink_owned = Catalog.txn, journal.unlink_owned

    def grouped_removal(self: Catalog, label: str, *, grouped: bool = False, durable: bool = False):
        removal = label == "evict.remove"
        return txn(self, label, grouped=grouped or removal, durable=durable and not removal)

    def no_wait(led, t, ok: str, failed: str, *, barrier: bool) -> None:
        unlink_owned(led, t, ok, failed, barrier=barrier and t.kind != "evict")

    with _patched(Catalog, "txn", grouped_removal), _patched(journal, "unlink_owned", no_wait):
        yield


# -- a catalog rebuild that commits before it quarantines ------------------------------------


@contextlib.contextmanager
def _quarantine_after_commit() -> Iterator[None]:
    """A catalog rebuild that writes its new catalog first and quarantines what it
    rejected after: process death in between leaves rejected shards beside a catalog
    that does not name them (orphans to the next open)."""
    held: list[tuple] = []
    quarantine, write = rebuild.quarantine_rejected, rebuild.write_catalog

    def write_first(*a: Any, **k: Any) -> None:
        write(*a, **k)
        while held:
            quarantine(*held.pop(0))

    with _patched(rebuild, "quarantine_rejected", lambda *a: held.append(a)), \
            _patched(rebuild, "write_catalog", write_first):
        yield


class _NoDirSync:
    """Directory fsyncs that do nothing."""

    def fsync_dir(self, path: str) -> None:
        pass


def _root_unsynced() -> contextlib.AbstractContextManager[None]:
    """A catalog rebuild that never fsyncs the cache's root or ``lost+found/``: a power
    loss after it returned brings the old catalog's names back and takes the new one's."""
    return _patched(rebuild, "_dirs", lambda fs, hook: _NoDirSync())


# -- the registry ------------------------------------------------------------------------------

_SNAP_RETIRE = {"snapshot": True, "policy": "prefixstore"}

PLANTS: dict[str, Plant] = {
    p.name: p
    for p in (
        Plant(
            "publish-early",
            "the highest rank's shard is made durable only after the store published",
            "a crash after the publish commit plus power loss: a committed node comes back damaged",
            engine_cls=_PublishEarly,
            make_ranks=_ranks(_LazyLastRank),
            patch=_publish_early,
        ),
        Plant(
            "skip-dir-fsync",
            "shards are renamed into place without fsyncing the rank directory",
            "power loss undoes the rename: an acknowledged node comes back damaged",
            make_ranks=_ranks(_NoDirSyncRank),
        ),
        Plant(
            "double-count-retire",
            "the retired generation of a compact-replace is subtracted from the charged bytes twice",
            "audit: the engine's charged bytes disagree with the catalog (invariant 3)",
            engine_cls=_DoubleCountRetire,
            patch=_double_count,
            config=_SNAP_RETIRE,
        ),
        Plant(
            "skip-retire-output",
            "a published refill or compact-replace ends (DONE) without its retire_old output's unlinks",
            "the driver's invariant check at DONE (it still owns rows); without it, the audit: "
            "garbage rows owned by a transaction that has ended (invariant 3)",
            engine_cls=_SkipRetire,
            patch=_skip_retire,
            config=_SNAP_RETIRE,
        ),
        Plant(
            "batch-drops-unlink",
            "a batched evict settles every victim's file rows but leaves one victim's files on disk",
            "the audit: a shard file unknown to the catalog (invariant 3)",
            engine_cls=_BatchDropsUnlink,
            patch=_batch_drops_unlink,
        ),
        Plant(
            "evict-pinned",
            "the victim search ignores pins",
            "a pinned node is evicted: the audit's and the model's pin checks (invariant 6)",
            engine_cls=_EvictPinned,
            patch=_evict_pinned,
        ),
        Plant(
            "rename-over-live",
            "snapshot retirement rewrites the live file in place (unlink, rename over its name)",
            "a fault or crash mid-rewrite: a ready node's shard no longer matches the catalog",
            engine_cls=_RenameOverLive,
            patch=_rename_over_live,
            config=_SNAP_RETIRE,
        ),
        Plant(
            "skip-orphan-cleanup",
            "recovery does not remove shard files the catalog does not know",
            "lost commits (synchronous=NORMAL power loss) leave files unknown to the catalog",
            patch=lambda: _patched(recovery, "_orphans", lambda *args: None),
            config={"synchronous": "NORMAL"},
        ),
        Plant(
            "skip-restore-checksum",
            "restore trusts the shard's bytes without checking the catalog checksum",
            "bit rot at rest is served: the model's byte comparison (invariant 5)",
            engine_cls=_TrustingRestore,
            patch=_trusting_restore,
        ),
        Plant(
            "skip-read-checksum",
            "a restore's shard reads (straight into the outputs, or staged) trust the file's own checksum",
            "bit rot at rest is served: the model's byte comparison (invariant 5)",
            engine_cls=_TrustingReads,
            patch=_trusting_reads,
        ),
        Plant(
            "async-ack-before-publish",
            "an async store's ticket resolves as stored once its copies are queued, before the commit",
            "a crash or fault in the commit worker: an acknowledged store is not in the catalog",
            engine_cls=_EarlyAck,
            patch=_ack_before_publish,
        ),
        Plant(
            "rank-server-ack-before-fsync",
            "a rank server acknowledges a shard write once it is renamed into place, before its bytes are fsynced",
            "the rank's host loses power after the publish: an acknowledged node's shard on that rank "
            "is empty (the audit through the rank server, invariant 1)",
            server_patch=_serve_unsynced,
            config={"rank_servers": 1},
        ),
        Plant(
            "remote-trusts-blob",
            "the remote tier's restore takes a fetched blob without checking it against its manifest "
            "(size, checksum, MAC)",
            "a blob altered in redis is restored: the model's byte comparison (invariant 5)",
            engine_cls=_TrustingRemote,
            patch=_trusting_remote,
            config={"remote": "redis"},
        ),
        Plant(
            "ack-before-group-sync",
            "a store is acknowledged once its publish is written, before its group's log sync",
            "power loss takes the publish back: an acknowledged store is not in the catalog",
            engine_cls=_AckBeforeGroupSync,
            patch=_ack_before_group_sync,
            config={"synchronous": "FULL"},
        ),
        Plant(
            "stale-prestaged",
            "a store writes the shards staged for its guessed generation when the catalog gave another",
            "a key stored again while an older generation's rows remain: the shard's header names "
            "another generation, so the acknowledged node restores as damaged",
            engine_cls=_StalePrestaged,
            patch=_stale_prestaged,
        ),
        Plant(
            "removal-taken-as-synced",
            "under synchronous=NORMAL an evict's removal commits unsynced, yet the catalog takes "
            "it as synced and skips the barrier before its unlinks",
            "tests/test_crash_evict.py: a power loss after an unlink takes the removal back; the "
            "victims return damaged",
            engine_cls=_RemovalTakenAsSynced,
            patch=_removal_taken_as_synced,
            config={"synchronous": "NORMAL"},
        ),
        Plant(
            "evict-removal-unsynced",
            "an evict's removal commit is grouped like its reclaim, and its files are unlinked "
            "before the log sync that makes the removal durable",
            "tests/test_crash_evict.py: a power loss after an unlink takes the removal back; the "
            "victims return damaged (neither wholly there nor wholly gone)",
            engine_cls=_EvictRemovalUnsynced,
            patch=_evict_removal_unsynced,
            config={"synchronous": "FULL"},
        ),
        Plant(
            "rebuild-quarantine-after-commit",
            "a catalog rebuild quarantines the shards it rejected after it commits the new catalog",
            "killed between the two, the next open takes the rejected shards for orphans and unlinks "
            "them (tests/test_crash_rebuild_remote.py)",
            patch=_quarantine_after_commit,
        ),
        Plant(
            "rebuild-root-unsynced",
            "a catalog rebuild fsyncs neither the cache's root after it moved the old catalog "
            "aside and created the new one, nor lost+found/",
            "a power loss after the rebuild returned brings the old catalog back in place of the "
            "rebuilt one (tests/test_crash_rebuild_remote.py)",
            patch=_root_unsynced,
        ),
        Plant(
            "skip-barrier",
            "retired files are unlinked before the commit that retired them is durable",
            "lost commits bring back a row whose files are gone: a committed node is damaged",
            patch=lambda: _patched(Catalog, "barrier", lambda self: None),
            config={"synchronous": "NORMAL"},
        ),
    )
}


def get(name: str) -> Plant:
    """The plant called ``name`` (KeyError lists the known ones)."""
    try:
        return PLANTS[name]
    except KeyError:
        raise KeyError(f"unknown plant {name!r}; known: {', '.join(sorted(PLANTS))}") from None
