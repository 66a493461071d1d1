"""The store transaction: plan, make space, record the intent, write every rank,
publish (a refill retires the row's old generation), or roll back."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, Protocol

import attrs

from prefixstore.base.errors import InvalidInputError
from prefixstore.base.keys import Prefix
from prefixstore.base.layout import Layout
from prefixstore.base.log import log
from prefixstore.engine import (
    abort,
    degraded,
    health,
    journal,
    publishing,
    replace,
    restore,
    space,
    spans,
    staging,
    tiering,
)
from prefixstore.engine.abort import Abort
from prefixstore.engine.account import Account
from prefixstore.engine.catalog import Catalog
from prefixstore.engine.counters import Counters
from prefixstore.engine.driver import Txn
from prefixstore.engine.guard import CallGuard
from prefixstore.engine.health import Health
from prefixstore.engine.holds import Holds
from prefixstore.engine.index import Index, Node
from prefixstore.engine.journal import Ledger
from prefixstore.engine.plan import Plan, count_skip
from prefixstore.engine.plan import plan as plan_store
from prefixstore.engine.publishing import Publishing
from prefixstore.engine.readonly import Mode
from prefixstore.engine.recency import Recency
from prefixstore.engine.restore import Reader
from prefixstore.engine.results import (
    DUPLICATE,
    FAILED,
    REFILLED,
    REFUSED,
    SKIPPED,
    STORED,
    StoreResult,
)
from prefixstore.engine.settings import Settings
from prefixstore.engine.space import Room
from prefixstore.engine.spans import Admit, Spans
from prefixstore.engine.staging import Prestaged, Staging, Writer
from prefixstore.engine.tiering import Tiers
from prefixstore.gpu import shards
from prefixstore.gpu.ranks import shard_name
from prefixstore.statemachine.rows import NODE

# The store's commits that share one sync of the catalog's log with the stores committed
# meanwhile (``Catalog.txn(grouped=True)``): durable once ``Catalog.sync`` returns.
GROUPED_COMMITS = ("store.intent", "store.publish")


@attrs.define(eq=False)
class InFlight:
    """A store past its intent commit: what its writes, publish and cleanup need."""

    plan: Plan
    tid: int
    key: bytes
    gen: int
    name: str
    end: int
    datas: list[Any]
    owned: list[Any]  # the staged buffers this store releases (the caller's are its own)
    protect: set[int]  # the parent and refilled row, fenced while the store is in flight
    needed: int
    txn: Txn | None = None  # the journaled transaction, once its intent committed
    seq: int = 0  # its last grouped commit (``Catalog.sync``: durable once synced through it)
    plan_keys: tuple[bytes, ...] = ()  # the keys of its blocks, marked in flight
    settled: bool = False  # its in-flight marks and fences are gone (``settle``)

    @property
    def keys_span(self) -> slice:
        return slice(self.plan.start, self.end)


class Offers(Protocol):
    """Where a published checkpoint goes next (the remote tier, ``remote.Sender``):
    ``prepare`` under the engine lock right after the publish, ``send`` after it."""

    def prepare(self, t: InFlight) -> Any: ...
    def send(self, offer: Any) -> None: ...


@attrs.frozen(slots=True, eq=False)
class Storing:
    """What a store uses: the lock (``settled``: to wait for an overlapping store), the
    index and holds it plans from and marks, the stores meeting existing spans
    (``spans``), the room it makes (``room``), the staging and writes of its shards,
    the ledger and catalog it journals in, the space account it charges, the recency
    it stamps, the checks of the rows a failed write puts in doubt (``reader``,
    ``health``), and where a published checkpoint is offered next (``offers``)."""

    guard: CallGuard
    layout: Layout
    settings: Settings
    index: Index
    holds: Holds
    catalog: Catalog
    ledger: Ledger
    account: Account
    recency: Recency
    counters: Counters
    mode: Mode
    tiers: Tiers
    spans: Spans
    room: Room
    staging: Staging
    writer: Writer
    reader: Reader
    health: Health
    abort: Abort
    offers: Offers
    admit: Admit | None
    publishing: Publishing = attrs.field(factory=Publishing)


def plan(st: Storing, prefix: Prefix, held: frozenset[int] = frozenset()) -> Plan | StoreResult:
    """Where the store of ``prefix`` goes, or why it does not (``plan.plan``). Lock held."""
    return plan_store(st.index, st.holds, st.layout.has_snapshot, prefix, held)


def store(
    st: Storing, prefix: Prefix, segs, snaps, tokens_from: int, staged=None, held: frozenset[int] = frozenset()
) -> StoreResult:
    """Store ``prefix``'s checkpoint (validated per-rank ``segs`` / ``snaps``).

    ``staged``: shards already staged by ``store_async`` for the plan it saw (the
    caller releases them); used when the plan still matches, else staged again.
    ``held``: nodes ``store_async`` reserved at its peek, fenced by its job (one
    fence each, its own): the store refills or replaces them as ``store`` would."""
    if (res := degraded.refused(st.tiers, len(prefix))) is not None:  # opened without a rank
        count_skip(st.counters, res)
        return res
    with st.guard.lock:  # the common store (no compact-replace) is told in one hold, its plan peeked
        common = spans.ordinary(st.spans, prefix, tokens_from, held)
        peek = plan(st, prefix, held) if common and staged is None else None
    if not common and (res := spans.on_store(st.spans, prefix, segs, snaps, tokens_from, held)) is not None:
        return res
    pre = prestage(st, prefix, peek, segs, snaps, tokens_from) if staged is None else None
    try:
        with st.guard.lock:
            t = begin(st, prefix, segs, snaps, tokens_from, staged, held, pre)
    except BaseException:
        staging.release(pre.datas if pre else [])
        raise
    if isinstance(t, StoreResult):
        staging.release(pre.datas if pre else [])
        if t.status == DUPLICATE:  # the row it found may be a grouped publish not synced yet
            st.catalog.sync(st.catalog.wal.written)
        return t
    try:
        return write_and_publish(st, prefix, t)
    except BaseException as exc:  # not a failed write (those roll back): end the txn
        abort.fail_txn(st.abort, t.txn, exc)
        raise
    finally:
        staging.release(t.owned)
        staging.release(pre.datas if pre else [])
        if not t.settled:  # settled by its publish, under the lock that applied it, else here
            with st.guard.lock:
                settle(st, t)


def settle(st: Storing, t: InFlight) -> None:
    """End the store's hold on its rows, once: its blocks no longer in flight, its
    parent and refilled row unfenced, the stores waiting on them woken. Lock held."""
    if not t.settled:
        t.settled = True
        st.holds.clear_inflight(t.plan_keys, t.tid)
        st.holds.unfence(t.protect)
        st.guard.settled.notify_all()


def settled_plan(st: Storing, prefix: Prefix, held: frozenset[int]) -> Plan | StoreResult:
    """The plan, after waiting up to ``inflight_wait_s`` for an overlapping store in
    flight to settle. Lock held."""
    p = plan(st, prefix, held)
    deadline = time.monotonic() + st.settings.inflight_wait_s
    while isinstance(p, StoreResult) and p.reason == "in_flight":
        left = deadline - time.monotonic()
        if left <= 0 or st.guard.closed:
            break
        st.guard.settled.wait(left)
        p = plan(st, prefix, held)
    return p


def refusal(st: Storing, prefix: Prefix, p: Plan | StoreResult, tokens_from: int) -> StoreResult | None:
    """Why the store cannot go ahead on plan ``p`` (counted), or None. Lock held."""
    n = len(prefix)
    if isinstance(p, StoreResult):
        count_skip(st.counters, p)
        return p
    if st.admit is not None and p.existing is None and not st.admit(prefix, p):
        res = StoreResult(SKIPPED, n, "admission")
        count_skip(st.counters, res)
        return res
    bt = st.layout.block_tokens
    if tokens_from > p.start * bt:
        raise InvalidInputError(
            f"the new node needs tokens from {p.start * bt}, but segments start at tokens_from={tokens_from}"
        )
    down = ranks_down(st)
    if down:  # fail fast: no eviction or intent for a store that cannot be durable
        st.counters.inc("stores", FAILED)
        return StoreResult(FAILED, n, f"rank(s) {down} unavailable")
    return None


def prestage(st: Storing, prefix: Prefix, p: Plan | StoreResult | None, segs, snaps,
             tokens_from: int) -> Prestaged | None:
    """Stage and checksum the shards of the store that plan ``p`` (peeked) foresees,
    before the lock hold that decides it, so the copies and checksums run outside the
    engine lock. The generation is guessed (the refilled row's next, else the first);
    ``begin`` takes these shards only if it decides the same header metadata and rows.
    None when there is no plan to stage for. Engine lock not held."""
    if not isinstance(p, Plan) or tokens_from > p.start * st.layout.block_tokens:
        return None  # no store, or one ``refusal`` rejects
    meta, lo, hi = header(st, prefix, p, (p.existing.generation if p.existing else 0) + 1, tokens_from)
    datas = staging.stage_store(st.staging, None, meta, segs, snaps, lo, hi)
    try:
        for d in datas:
            d.checksum()
    except BaseException:
        staging.release(datas)
        raise
    return Prestaged(meta, lo, hi, datas)


def header(st: Storing, prefix: Prefix, p: Plan, gen: int, tokens_from: int) -> tuple[dict[str, str], int, int]:
    """The shards' metadata of a store on plan ``p`` at generation ``gen``, and the rows
    ``[lo, hi)`` of its segments it writes."""
    L, n = st.layout, len(prefix)
    meta = {**shards.meta(prefix.keys[-1], gen, p.start, n, L.has_snapshot),
            **shards.span_provenance(L, prefix.keys, prefix.digests, p.start, n)}
    return meta, p.start * L.block_tokens - tokens_from, n * L.block_tokens - tokens_from


def begin(st: Storing, prefix: Prefix, segs, snaps, tokens_from: int, staged, held,
          pre: Prestaged | None = None) -> InFlight | StoreResult:
    """Plan, stage (or take ``pre``, staged for the same header), make space and commit
    the intent; the store in flight (its blocks marked, its parent and refilled row
    fenced), or why not. Lock held."""
    L = st.layout
    n = len(prefix)
    p = settled_plan(st, prefix, held)
    if (res := refusal(st, prefix, p, tokens_from)) is not None:
        return res
    key = prefix.keys[-1]
    gen = replace.next_generation(st.catalog, L.ranks, key, p.existing.generation if p.existing else 0)
    meta, lo, hi = header(st, prefix, p, gen, tokens_from)
    if pre is not None and pre.fits(meta, lo, hi):
        datas = pre.datas  # released by the caller, as ``staged`` is
    else:  # zero-copy: each rank's tensors go straight into a buffer laid out as its file
        datas = staging.stage_store(st.staging, staged, meta, segs, snaps, lo, hi)
    protect = {x.id for x in (p.parent, p.existing) if x is not None}
    caller_owned = datas is staged or (pre is not None and datas is pre.datas)
    t = InFlight(p, 0, key, gen, shard_name(key, gen), n, datas, [] if caller_owned else datas,
                 protect, sum(d.size for d in datas))
    try:  # a failed space step or intent commit must not strand the buffers
        if (why := space.room_for(st.room, t.needed, protect)) is not None:
            staging.release(t.owned)
            res = StoreResult(REFUSED, n, why, t.needed)
            count_skip(st.counters, res)
            return res
        t.txn = intent(st, t)
        t.tid, t.seq = t.txn.id, st.catalog.wal.written
    except BaseException:
        staging.release(t.owned)
        raise
    st.account.charged += t.needed
    t.plan_keys = prefix.keys[t.keys_span]
    st.holds.mark_inflight(t.plan_keys, t.tid)
    st.holds.fence(protect)
    return t


def intent(st: Storing, t: InFlight) -> Txn:
    """Commit the store's intent and its reserved (writing) file rows; the transaction."""
    p = t.plan
    payload = {
        "key": t.key.hex(), "generation": t.gen, "name": t.name, "start": p.start, "end": t.end,
        "parent": p.parent.id if p.parent else None,
        "node": p.existing.id if p.existing else None,
    }
    with st.catalog.txn(GROUPED_COMMITS[0], grouped=True) as c:
        sized = [(d.size, d.checksum()) for d in t.datas]
        txn = journal.begin(st.ledger, c, "store", payload,
                            rows=lambda tid: st.catalog.add_writing(c, tid, t.name, t.gen, sized))
    return txn


def write_and_publish(st: Storing, prefix: Prefix, t: InFlight) -> StoreResult:
    """Once the intent is durable, write every rank, then publish (or roll back a failed
    write, or a refill whose row a restore keeps pinned); acknowledged once the publish
    is durable. Both waits are group commits: one sync of the catalog's log for every
    store committed meanwhile (``Catalog.sync``)."""
    n = len(prefix)
    st.catalog.sync(t.seq)
    errors = staging.write_all(st.writer, t.name, t.datas)
    if errors:
        why = staging.failure_reason(st.tiers, errors, t.datas)  # before the rollback frees room
        with st.guard.lock:
            journal.rollback(st.ledger, t.txn, "failed")
        check_prior(st, t.plan, {r for r, _ in errors})
        st.counters.inc("stores", FAILED)
        return StoreResult(FAILED, n, why, t.needed)
    # A refilled row pinned by a restore is never replaced under the pin
    # (invariant 6): wait for the pin to go, up to pin_wait_s, else roll back
    # (at once when pin() holds it: a request's pin is not waited for).
    existing = t.plan.existing
    deadline = time.monotonic() + st.settings.pin_wait_s
    while True:
        if existing is None:  # no pin to wait for: queue the publish before taking the lock
            res, offer = published(st, prefix, t)
            break
        with st.guard.lock:
            if not st.holds.pins[existing.id]:
                res, offer = published(st, prefix, t)
                break
            if time.monotonic() >= deadline or st.holds.request_pins[existing.id]:
                journal.rollback(st.ledger, t.txn, "failed")
                res = StoreResult(SKIPPED, n, "pinned", t.needed)
                count_skip(st.counters, res)
                return res
        time.sleep(0.002)
    acknowledge(st, t.seq)
    st.offers.send(offer)
    return res


def acknowledge(st: Storing, seq: int) -> None:
    """Return once the publish (commit ``seq``) is durable: under ``synchronous=FULL`` a
    stored checkpoint is acknowledged only then. Engine lock not held."""
    st.catalog.sync(seq)


def published(st: Storing, prefix: Prefix, t: InFlight) -> tuple[StoreResult, Any]:
    """Publish the written store and count it; its result, and its offer (prepared under
    the lock right after the publish). ``t.seq``: the publish's commit."""
    p, n = t.plan, t.end
    digests = b"".join(prefix.digests[p.start:n])
    was_damaged = p.existing is not None and p.existing.state == "damaged"
    node, offer, t.seq = publish(st, t.txn, p, t.key, digests, p.start, n, t.gen, t.needed,
                                 then=lambda node: published_then(st, t, node))
    status = REFILLED if p.existing is not None else STORED
    if was_damaged:
        st.counters.inc("refills")
    st.counters.inc("stores", status)
    log.debug("stored", key=t.key.hex()[:12], blocks=n, node=node.id, bytes=t.needed)
    return StoreResult(status, n, None, t.needed), offer


def published_then(st: Storing, t: InFlight, node: Node) -> Any:
    """Right after the publish is applied (lock held): the offer of the checkpoint, and
    the store's rows settled (``settle``): the index now holds its node, so nothing
    needs its marks and fences, and no further hold of the lock is taken for them.
    The node's live file rows are the ones its intent reserved: cached on the node, so
    its first restore asks the catalog for none (``restore.file_rows``)."""
    node.files = (t.gen, {r: (t.name, d.size, d.checksum()) for r, d in enumerate(t.datas)})
    offer = st.offers.prepare(t)
    settle(st, t)
    return offer


def publish(st: Storing, txn: Txn, plan: Plan, key: bytes, digests: bytes, start: int, end: int,
            gen: int, needed: int, then: Callable[[Node], Any] = lambda node: None) -> tuple[Node, Any, int]:
    """Commit the store's publish in the commit it shares with the publishes queued
    meanwhile (``publishing.commit``), apply it to the index, retire a refill's old
    files, then ``then(node)``, all under the engine lock; the node, what ``then``
    returned, and the commit's sequence number (``Catalog.sync``)."""
    def write(c: Any) -> tuple[int, int, tuple[str, ...]]:
        now = st.recency.tick()
        has_snap = st.layout.has_snapshot
        old = []
        if plan.existing is not None:
            nid = plan.existing.id
            old = st.catalog.retire_live(c, txn.id, nid)
            st.catalog.refill_node(c, nid, gen, has_snap, now)
        else:
            nid = st.catalog.insert_node(c, key, plan.parent.id if plan.parent else None, start, end,
                                          digests, has_snap, gen, now)
        st.catalog.publish_file(c, txn.id, txn.payload["name"], nid)
        st.recency.flush(st.index, st.catalog, c)
        # nothing to retire: done in the same commit (one read and write of the row)
        then = () if old else (journal.skipped(txn, "retire_old"),)
        return nid, now, journal.fire(st.ledger, c, txn, "durable", *then)

    def apply(out: tuple[int, int, tuple[str, ...]]) -> tuple[Node, Any]:
        nid, now, outs = out
        node = apply_publish(st, plan, nid, key, digests, start, end, gen, needed, now)
        journal.run(st.ledger, txn, outs)
        return node, then(node)

    job = publishing.Job(write, apply)
    node, extra = publishing.commit(st.publishing, st.guard, st.catalog, GROUPED_COMMITS[1], job)
    return node, extra, job.seq


def apply_publish(st: Storing, plan: Plan, nid: int, key: bytes, digests: bytes, start: int, end: int,
                  gen: int, needed: int, now: int) -> Node:
    """The in-memory side of a committed publish: the node, the index, the victim heap."""
    has_snap = st.layout.has_snapshot
    if plan.existing is not None:
        node = plan.existing
        node.state, node.generation, node.has_snapshot = NODE.next(node.state, "published"), gen, has_snap
        node.last_used = node.snap_used = now
        node.nbytes = needed
    else:
        node = Node(id=nid, key=key, parent=plan.parent.id if plan.parent else None, start=start,
                    end=end, digests=digests, has_snapshot=has_snap, state=NODE.next("absent", "published"),
                    generation=gen, last_used=now, snap_used=now, nbytes=needed)
        st.index.add(node)
        if plan.parent is not None:
            st.recency.heap.offer(plan.parent)
    st.recency.heap.offer(node)
    return node


def check_prior(st: Storing, plan: Plan, failed: set[int]) -> None:
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
        with st.guard.lock:
            if node.state != "ready" or st.index.get(node.id) is not node:
                continue
            gen = node.generation
            rows = {r: (name, size, ck) for r, name, size, ck in st.catalog.live_files(node.id)}
        why = restore.verify_shards(st.reader, rows, failed)
        if why is None:
            continue
        with st.guard.lock:
            if node.state == "ready" and node.generation == gen and st.index.get(node.id) is node:
                health.invalidate(st.health, node, why)


def ranks_down(st: Storing) -> list[int]:
    """Ranks whose executor says it cannot serve now (a rank process down)."""
    return tiering.ranks_down(st.tiers.ranks)
