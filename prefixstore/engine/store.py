"""The store transaction: plan, make space, record the intent, write every rank,
publish (a refill retires the row's old generation), or roll back."""

from __future__ import annotations

import errno
import time
from typing import TYPE_CHECKING, Any

import attrs

from prefixstore.base.errors import InvalidInputError
from prefixstore.base.keys import Prefix
from prefixstore.base.log import log
from prefixstore.engine import (
    health,
    holds,
    journal,
    lifecycle,
    pipeline,
    recency,
    remote,
    replace,
    restore,
    space,
    spans,
    tiering,
)
from prefixstore.engine.driver import Txn
from prefixstore.engine.index import Node
from prefixstore.engine.results import (
    DUPLICATE,
    FAILED,
    REFILLED,
    REFUSED,
    SKIPPED,
    STORED,
    StoreResult,
)
from prefixstore.gpu import shards
from prefixstore.gpu.diskroom import enospc_reason
from prefixstore.gpu.ranks import shard_name
from prefixstore.statemachine.rows import NODE

if TYPE_CHECKING:
    from prefixstore.engine.api import Engine


@attrs.define
class Plan:
    """Where a new checkpoint goes: its parent and the row it refills, if any."""

    parent: Node | None
    existing: Node | None
    start: int


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

    @property
    def keys_span(self) -> slice:
        return slice(self.plan.start, self.end)


def plan(eng: Engine, prefix: Prefix, held: frozenset[int] = frozenset()) -> Plan | StoreResult:
    """Where the store of ``prefix`` goes, or why it does not. ``held``: nodes the
    caller fences itself (an async store's peek), not counted as busy. Lock held."""
    n = len(prefix)
    keys = prefix.keys
    p = eng.index.deepest_block(keys, n)
    owner = eng.index.owner(keys, p)
    if owner is not None and owner.end != p:
        # Inside an existing node's span: spans.on_store splits ready nodes first;
        # this is left for a damaged one (or one changed since).
        return StoreResult(SKIPPED, n, "inside_span")
    existing = owner if (owner is not None and p == n) else None
    parent = owner if existing is None else eng.index.get(existing.parent) if existing.parent is not None else None
    if existing is not None:
        if existing.ready and (existing.has_snapshot or not eng.layout.has_snapshot):
            return StoreResult(DUPLICATE, n, "duplicate")
        if eng._pins[existing.id] or holds.fenced_by_other(eng, existing.id, held):
            return StoreResult(SKIPPED, n, "pinned" if eng._pins[existing.id] else "fenced")
    start = parent.end if parent is not None else 0
    if any(k in eng._inflight_blocks for k in keys[start:n]):
        return StoreResult(SKIPPED, n, "in_flight")
    return Plan(parent, existing, start)


def store(
    eng: Engine, prefix: Prefix, segs, snaps, tokens_from: int, staged=None, held: frozenset[int] = frozenset()
) -> StoreResult:
    """Store ``prefix``'s checkpoint (validated per-rank ``segs`` / ``snaps``).

    ``staged``: shards already staged by ``store_async`` for the plan it saw (the
    caller releases them); used when the plan still matches, else staged again.
    ``held``: nodes ``store_async`` reserved at its peek, fenced by its job (one
    fence each, its own): the store refills or replaces them as ``store`` would."""
    if (res := spans.on_store(eng, prefix, segs, snaps, tokens_from, held)) is not None:
        return res
    with eng._lock:
        t = begin(eng, prefix, segs, snaps, tokens_from, staged, held)
    if isinstance(t, StoreResult):
        return t
    try:
        return write_and_publish(eng, prefix, t)
    except BaseException as exc:  # not a failed write (those roll back): end the txn
        pipeline.fail_txn(eng, t.txn, exc)
        raise
    finally:
        pipeline.release(t.owned)
        with eng._lock:
            holds.clear_inflight(eng, prefix.keys[t.keys_span], t.tid)
            holds.drop(eng._fences, t.protect)
            eng._settled.notify_all()


def settled_plan(eng: Engine, prefix: Prefix, held: frozenset[int]) -> Plan | StoreResult:
    """The plan, after waiting up to ``inflight_wait_s`` for an overlapping store in
    flight to settle. Lock held."""
    p = plan(eng, prefix, held)
    deadline = time.monotonic() + eng.inflight_wait_s
    while isinstance(p, StoreResult) and p.reason == "in_flight":
        left = deadline - time.monotonic()
        if left <= 0 or eng._closed:
            break
        eng._settled.wait(left)
        p = plan(eng, prefix, held)
    return p


def refusal(eng: Engine, prefix: Prefix, p: Plan | StoreResult, tokens_from: int) -> StoreResult | None:
    """Why the store cannot go ahead on plan ``p`` (counted), or None. Lock held."""
    n = len(prefix)
    if isinstance(p, StoreResult):
        count_skip(eng, p)
        return p
    if eng.admission is not None and p.existing is None and not eng.admission(eng, prefix, p):
        res = StoreResult(SKIPPED, n, "admission")
        count_skip(eng, res)
        return res
    bt = eng.layout.block_tokens
    if tokens_from > p.start * bt:
        raise InvalidInputError(
            f"the new node needs tokens from {p.start * bt}, but segments start at tokens_from={tokens_from}"
        )
    down = ranks_down(eng)
    if down:  # fail fast: no eviction or intent for a store that cannot be durable
        eng.counters.inc("stores", FAILED)
        return StoreResult(FAILED, n, f"rank(s) {down} unavailable")
    return None


def begin(eng: Engine, prefix: Prefix, segs, snaps, tokens_from: int, staged, held) -> InFlight | StoreResult:
    """Plan, stage, make space and commit the intent; the store in flight (its blocks
    marked, its parent and refilled row fenced), or why not. Lock held."""
    L = eng.layout
    n = len(prefix)
    p = settled_plan(eng, prefix, held)
    if (res := refusal(eng, prefix, p, tokens_from)) is not None:
        return res
    key = prefix.keys[-1]
    gen = replace.next_generation(eng, key, p.existing.generation if p.existing else 0)
    meta = {**shards.meta(key, gen, p.start, n, L.has_snapshot),
            **shards.span_provenance(L, prefix.keys, prefix.digests, p.start, n)}
    lo, hi = p.start * L.block_tokens - tokens_from, n * L.block_tokens - tokens_from
    # Zero-copy: each rank's tensors go straight into a buffer laid out as its file.
    datas = pipeline.stage_store(eng, staged, meta, segs, snaps, lo, hi)
    protect = {x.id for x in (p.parent, p.existing) if x is not None}
    t = InFlight(p, 0, key, gen, shard_name(key, gen), n, datas, [] if datas is staged else datas,
                 protect, sum(d.size for d in datas))
    try:  # a failed space step or intent commit must not strand the buffers
        if (why := space.room_for(eng, t.needed, protect)) is not None:
            pipeline.release(t.owned)
            res = StoreResult(REFUSED, n, why, t.needed)
            count_skip(eng, res)
            return res
        t.txn = intent(eng, t)
        t.tid = t.txn.id
    except BaseException:
        pipeline.release(t.owned)
        raise
    eng._charged += t.needed
    holds.mark_inflight(eng, prefix.keys[t.keys_span], t.tid)
    holds.take(eng._fences, protect)
    return t


def intent(eng: Engine, t: InFlight) -> Txn:
    """Commit the store's intent and its reserved (writing) file rows; the transaction."""
    p = t.plan
    payload = {
        "key": t.key.hex(), "generation": t.gen, "name": t.name, "start": p.start, "end": t.end,
        "parent": p.parent.id if p.parent else None,
        "node": p.existing.id if p.existing else None,
    }
    with eng.catalog.txn("store.intent") as c:
        sized = [(d.size, d.checksum()) for d in t.datas]
        txn = journal.begin(eng, c, "store", payload,
                            rows=lambda tid: eng.catalog.add_writing(c, tid, t.name, t.gen, sized))
    return txn


def write_and_publish(eng: Engine, prefix: Prefix, t: InFlight) -> StoreResult:
    """Write every rank, then publish (or roll back a failed write, or a refill whose
    row a restore keeps pinned)."""
    n = len(prefix)
    errors = write_all(eng, t.name, t.datas)
    if errors:
        why = failure_reason(eng, errors, t.datas)  # before the rollback frees room
        with eng._lock:
            journal.rollback(eng, t.txn, "failed")
        check_prior(eng, t.plan, {r for r, _ in errors})
        eng.counters.inc("stores", FAILED)
        return StoreResult(FAILED, n, why, t.needed)
    # A refilled row pinned by a restore is never replaced under the pin
    # (invariant 6): wait for the pin to go, up to pin_wait_s, else roll back
    # (at once when pin() holds it: a request's pin is not waited for).
    existing = t.plan.existing
    deadline = time.monotonic() + eng.pin_wait_s
    while True:
        with eng._lock:
            if existing is None or not eng._pins[existing.id]:
                res = published(eng, prefix, t)
                offer = remote.prepare(eng, t)
                break
            if time.monotonic() >= deadline or eng._request_pins[existing.id]:
                journal.rollback(eng, t.txn, "failed")
                res = StoreResult(SKIPPED, n, "pinned", t.needed)
                count_skip(eng, res)
                return res
        time.sleep(0.002)
    remote.send(eng, offer)
    return res


def published(eng: Engine, prefix: Prefix, t: InFlight) -> StoreResult:
    """Publish the written store and count it. Lock held."""
    p, n = t.plan, t.end
    digests = b"".join(prefix.digests[p.start:n])
    was_damaged = p.existing is not None and p.existing.state == "damaged"
    node = publish(eng, t.txn, p, t.key, digests, p.start, n, t.gen, t.needed)
    status = REFILLED if p.existing is not None else STORED
    if was_damaged:
        eng.counters.inc("refills")
    eng.counters.inc("stores", status)
    log.debug("stored", key=t.key.hex()[:12], blocks=n, node=node.id, bytes=t.needed)
    return StoreResult(status, n, None, t.needed)


def failure_reason(eng: Engine, errors: list[tuple[int, OSError]], datas: list[Any]) -> str:
    """Why the writes of ``datas`` failed, per rank: a file system found full is named
    as such (out of bytes or of inodes, ``gpu/diskroom.py``), any other error as it
    was raised."""
    parts = []
    for r, e in errors:
        where = getattr(eng.ranks[r], "directory", None)
        full = enospc_reason(where, datas[r].size) if e.errno == errno.ENOSPC and where else None
        parts.append(f"rank {r}: {full or e}")
    return "; ".join(parts)


def count_skip(eng: Engine, res: StoreResult) -> None:
    """Count a store that did not go ahead (skipped, duplicate, refused)."""
    if res.status in (SKIPPED, DUPLICATE, REFUSED):
        eng.counters.inc("skips", res.reason or res.status)


def write_all(eng: Engine, name: str, datas: list[Any]) -> list[tuple[int, OSError]]:
    """Write ``name`` on every rank (in parallel); return the ranks that failed."""
    lifecycle.check_writable(eng, "write")
    if len(datas) == 1:
        try:
            pipeline.write_shard(eng, 0, name, datas[0])
            return []
        except OSError as exc:
            eng.counters.inc("faults", "write")
            return [(0, exc)]
    futures = [eng._pool.submit(pipeline.write_shard, eng, r, name, d) for r, d in enumerate(datas)]
    errors: list[tuple[int, OSError]] = []
    crash: BaseException | None = None
    for r, f in enumerate(futures):
        try:
            f.result()
        except OSError as exc:
            eng.counters.inc("faults", "write")
            errors.append((r, exc))
        except BaseException as exc:  # a crash or a bug in a rank: re-raised below
            crash = crash or exc
    if crash is not None:
        raise crash
    return errors


def publish(eng: Engine, txn: Txn, plan: Plan, key: bytes, digests: bytes, start: int, end: int,
            gen: int, needed: int) -> Node:
    """Commit the store's publish, apply it to the index, then retire a refill's old files."""
    now = recency.tick(eng)
    has_snap = eng.layout.has_snapshot
    tid = txn.id
    with eng.catalog.txn("store.publish") as c:
        old = []
        if plan.existing is not None:
            nid = plan.existing.id
            old = eng.catalog.retire_live(c, tid, nid)
            eng.catalog.refill_node(c, nid, gen, has_snap, now)
        else:
            nid = eng.catalog.insert_node(c, key, plan.parent.id if plan.parent else None, start, end,
                                          digests, has_snap, gen, now)
        eng.catalog.publish_file(c, tid, txn.payload["name"], nid)
        recency.flush(eng, c)
        outs = journal.fire(eng, c, txn, "durable")
        if not old:  # nothing to retire: done in the same commit
            outs = journal.skip(eng, c, txn, "retire_old")
    node = apply_publish(eng, plan, nid, key, digests, start, end, gen, needed, now)
    journal.run(eng, txn, outs)
    return node


def apply_publish(eng: Engine, plan: Plan, nid: int, key: bytes, digests: bytes, start: int, end: int,
                  gen: int, needed: int, now: int) -> Node:
    """The in-memory side of a committed publish: the node, the index, the victim heap."""
    has_snap = eng.layout.has_snapshot
    if plan.existing is not None:
        node = plan.existing
        node.state, node.generation, node.has_snapshot = NODE.next(node.state, "published"), gen, has_snap
        node.last_used = node.snap_used = now
        node.nbytes = needed
    else:
        node = Node(id=nid, key=key, parent=plan.parent.id if plan.parent else None, start=start,
                    end=end, digests=digests, has_snapshot=has_snap, state=NODE.next("absent", "published"),
                    generation=gen, last_used=now, snap_used=now, nbytes=needed)
        eng.index.add(node)
        if plan.parent is not None:
            eng.heap.offer(plan.parent)
    eng.heap.offer(node)
    return node


def check_prior(eng: Engine, plan: Plan, failed: set[int]) -> None:
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
        with eng._lock:
            if node.state != "ready" or eng.index.get(node.id) is not node:
                continue
            gen = node.generation
            rows = {r: (name, size, ck) for r, name, size, ck in eng.catalog.live_files(node.id)}
        why = restore.verify_shards(eng, rows, failed)
        if why is None:
            continue
        with eng._lock:
            if node.state == "ready" and node.generation == gen and eng.index.get(node.id) is node:
                health.invalidate(eng, node, why)


def ranks_down(eng: Engine) -> list[int]:
    """Ranks whose executor says it cannot serve now (a rank process down)."""
    return tiering.ranks_down(eng.ranks)
