"""Compact-replace: a chain of rows replaced by another chain covering the same span.

One COMPACT transaction (``statemachine.transactions.COMPACT``), in five steps::

    plan    (lock)     check the old rows (not pinned, not fenced, current), fence them,
                       choose the new generations
    read    (no lock)  the old rows' shards the new rows need, verified
    intent  (lock)     commit: journal row + the new files' rows ('writing', charged)
    write   (no lock)  every new row's shard, durable on every rank (tmp, fsync,
                       rename, directory fsync)
    swap    (lock)     wait for pins to drop, re-check the old rows, then ONE commit:
                       old files -> garbage, new rows in place, ancestry re-linked
                       (PUBLISHED); then the old generation is unlinked (DONE)

A crash before the swap commit leaves exactly the old rows (recovery rolls the new
files back); after it, exactly the new ones (recovery unlinks the old files). Any
failure before the swap (a rank failing its write, a damaged old shard, the old rows
changing or staying pinned) rolls back and leaves the old rows serving.

Node ids follow keys: a new row whose key is an old row's key keeps that row's id
(its row is updated in place, its generation bumped); new keys get new ids; old rows
whose key disappears are deleted. A row with children outside the replaced chain
must keep its key, so descendants' ``parent`` stays valid at every instant (the FK
is enforced) and no descendant row is rewritten. Generations always grow, so a Match
taken before the swap is stale after it (``restore`` returns None; look up again).

Uses: ``retire_snapshot`` (here), merge (``engine.compaction``), split, republish and
row refill (``engine.spans``).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import attrs
import torch

from prefixstore.base.errors import SimulatedCrash
from prefixstore.base.keys import DIGEST_SIZE, ROOT
from prefixstore.base.layout import Layout
from prefixstore.base.log import log
from prefixstore.engine import abort, health, journal, restore, staging
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
from prefixstore.engine.recency import Recency
from prefixstore.engine.restore import Reader
from prefixstore.engine.staging import Writer
from prefixstore.gpu import shards
from prefixstore.gpu.ranks import shard_name
from prefixstore.statemachine.rows import NODE

if TYPE_CHECKING:
    from collections import Counter

KIND = "compact"
MakeRoom = Callable[[int, set[int], int], bool]
"""``make_room(needed, protect, files)``: evict by policy to fit ``needed`` more bytes
in ``files`` new shard files (``space.make_space``); False when they cannot fit."""


@attrs.frozen(slots=True, eq=False)
class Replacing:
    """What a compact-replace uses: the lock and the holds it fences the old rows
    with, the catalog and ledger it journals in, the index and recency it swaps, the
    space account it charges, the shards it reads (``restore.Reader``) and writes
    (``staging.Writer``), health for a damaged old row."""

    guard: CallGuard
    layout: Layout
    catalog: Catalog
    ledger: Ledger
    index: Index
    holds: Holds
    recency: Recency
    account: Account
    counters: Counters
    health: Health
    reader: Reader
    writer: Writer
    abort: Abort
RankPart = tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]  # (segments, snapshot)
Assemble = Callable[[dict[int, list[RankPart]]], list[list[RankPart]]]


@attrs.define(eq=False)
class NewRow:
    """One replacement row. ``keep`` is the id of the old row with the same key."""

    key: bytes
    start: int
    end: int
    digests: bytes
    has_snapshot: bool
    last_used: int
    snap_used: int
    keep: int | None = None
    gen: int = 0
    name: str = ""
    blobs: list[bytes] = attrs.field(factory=list)


@attrs.define(eq=False)
class Job:
    """Old rows (root-first chain) -> new rows (root-first chain over the same span).

    ``reads`` names the old rows whose shards are read (id -> with snapshot);
    ``assemble`` turns them into each new row's per-rank (segments, snapshot).
    ``state`` is the state every old row must be in ('ready', or 'damaged' for a
    refill, whose bytes come from elsewhere). ``gens`` / ``snaps``: each old row's
    generation and has_snapshot when the job was built (under the lock that observed
    them); a row that changed since is stale and the job aborts, old rows serving.
    """

    use: str
    old: list[Node]
    new: list[NewRow]
    reads: dict[int, bool]
    assemble: Assemble
    state: str = "ready"
    parent: int | None = None
    parent_key: bytes = ROOT
    """The key the first new row chains from (set under the lock when the job starts)."""
    gens: dict[int, int] = attrs.field(factory=dict)
    snaps: dict[int, bool] = attrs.field(factory=dict)

    def __attrs_post_init__(self) -> None:
        old, new = self.old, self.new
        assert old and new, "a compact-replace needs old and new rows"
        for a, b in zip(old, old[1:], strict=False):
            assert b.parent == a.id and b.start == a.end, f"old rows {a.id}, {b.id} are not a chain"
        for a, b in zip(new, new[1:], strict=False):
            assert b.start == a.end, "new rows are not contiguous"
        assert (new[0].start, new[-1].end) == (old[0].start, old[-1].end), "new rows cover another span"
        assert b"".join(r.digests for r in new) == b"".join(n.digests for n in old), "blocks differ"
        for r in new:
            assert len(r.digests) == DIGEST_SIZE * (r.end - r.start) and r.end > r.start
        by_key = {n.key: n.id for n in old}
        for r in new:
            if r.keep is None and r.key in by_key:
                r.keep = by_key[r.key]
            assert r.keep is None or by_key.get(r.key) == r.keep, "keep must name the old row with that key"
        self.parent = old[0].parent
        for n in old:
            self.gens.setdefault(n.id, n.generation)
            self.snaps.setdefault(n.id, n.has_snapshot)

    @property
    def old_ids(self) -> set[int]:
        return {n.id for n in self.old}

    @property
    def dropped(self) -> list[Node]:
        """Old rows whose key disappears (deleted by the swap), deepest first."""
        kept = {r.keep for r in self.new}
        return [n for n in reversed(self.old) if n.id not in kept]


@attrs.frozen
class Outcome:
    """How a compact-replace ended: ``ok`` when swapped; else why not."""

    ok: bool
    reason: str | None = None
    nbytes: int = 0
    status: str = "done"  # done | refused (no space) | failed (I/O) | skipped


# ------------------------------------------------------------------ uses


def retire_snapshot(rp: Replacing, node: Node) -> bool:
    """Rewrite ``node`` without its snapshot (eviction of a compactable ancestor).

    Runs under the engine lock, I/O included (eviction runs inside a store's space
    check). True when it was replaced.
    """
    row = NewRow(node.key, node.start, node.end, node.digests, False, node.last_used, node.snap_used)
    job = Job("retire_snapshot", [node], [row], {node.id: False},
              lambda got: [[(segs, {}) for segs, _ in got[node.id]]])
    out = run(rp, job, locked=True, space="capacity")
    if out.ok:
        log.debug("snapshot_retired", node=node.id)
    return out.ok


def concat_parts(parts: list[list[RankPart]], ranks: int) -> list[dict[str, torch.Tensor]]:
    """Per rank, each segment tensor of ``parts`` (root first) concatenated on tokens."""
    out = []
    for r in range(ranks):
        names = parts[0][r][0].keys()
        out.append({k: torch.cat([p[r][0][k] for p in parts]) if len(parts) > 1 else parts[0][r][0][k]
                    for k in names})
    return out


# ------------------------------------------------------------------ the transaction


def run(
    rp: Replacing,
    job: Job,
    *,
    locked: bool = False,
    space: str = "watermark",
    make_room: MakeRoom | None = None,
    protect: frozenset[int] = frozenset(),
    pin_wait_s: float = 2.0,
    held: frozenset[int] = frozenset(),
    wait_pinned: bool = False,
) -> Outcome:
    """Run ``job`` as one COMPACT transaction.

    ``locked``: the caller holds the engine lock and everything runs under it (eviction);
    otherwise the caller must not hold it, and reads and writes run outside it.
    ``space``: 'make' (evict by policy to fit, as a store does: ``make_room``), 'capacity' (fit under
    capacity), 'watermark' (fit under the high watermark: background work never
    causes eviction). A row pinned at the swap is waited for up to ``pin_wait_s``.
    ``wait_pinned`` (a store's split or refill, on the request's thread): a row a
    running restore pins at the start does not abort the job either (it is prepared
    beside the row and swapped once the pin goes), but a row ``pin()`` holds (a request
    using it) is never waited for: the job is skipped at once.
    ``held``: old rows the caller fences itself (one fence each: an async store
    refilling them), not counted as another transaction's.
    """
    assert locked or not rp.guard.held(), "run(locked=False) needs the engine lock released"
    # a store's job (wait_pinned) is refused only by pin()'s pins, not a restore's
    with rp.guard.lock:
        prepared = _prepare(rp, job, rp.holds.request_pins if wait_pinned else rp.holds.pins, held)
    if isinstance(prepared, Outcome):
        return prepared
    rows, attempt = prepared
    try:
        return _write_and_swap(rp, job, rows, attempt, locked=locked, room=_room(rp, space, make_room),
                               protect=protect, pin_wait_s=pin_wait_s, held=held, wait_pinned=wait_pinned)
    except BaseException as exc:
        if attempt.txn is not None:
            # End the transaction as recovery would (a simulated crash is left to it):
            # forward once the swap committed (its old files must not stay charged to
            # it), back before.
            abort.fail_txn(rp.abort, attempt.txn, exc)
        if not attempt.published and not isinstance(exc, SimulatedCrash):
            rp.counters.inc("replaces", f"{job.use}_aborted")
        raise
    finally:
        with rp.guard.lock:
            _unfence(rp, job, attempt.fenced, attempt.fenced)


@attrs.define(eq=False)
class _Attempt:
    """One run's progress: its fences not yet released, its transaction, whether the
    swap committed."""

    fenced: set[int]
    txn: Txn | None = None
    published: bool = False


def _prepare(
    rp: Replacing, job: Job, pins: Counter[int], held: frozenset[int]
) -> tuple[dict[int, dict[int, tuple[str, int, str]]], _Attempt] | Outcome:
    """Check the old rows, read their live file rows, name the new rows' shards and
    fence the old rows; an Outcome when the job is skipped. Lock held."""
    why = _check(rp, job, fences=0, pins=pins, held=held)
    if why:
        return _abort(rp, job, why, "skipped")
    rows = {nid: rp.catalog.live_file_rows(nid) for nid in job.reads}
    parent = rp.index.get(job.parent) if job.parent is not None else None
    job.parent_key = parent.key if parent is not None else ROOT
    for r in job.new:
        r.gen = next_generation(rp.catalog, rp.layout.ranks, r.key, job.gens.get(r.keep, 0) if r.keep is not None else 0)
        r.name = shard_name(r.key, r.gen)
    rp.holds.fence([n.id for n in job.old])
    return rows, _Attempt(set(job.old_ids))


def _write_and_swap(
    rp: Replacing, job: Job, rows, attempt: _Attempt, *, locked: bool, room: MakeRoom, protect: frozenset[int],
    pin_wait_s: float, held: frozenset[int], wait_pinned: bool,
) -> Outcome:
    """Read and encode the new rows, journal the intent, write every rank, then swap."""
    got = _read(rp, job, rows)
    if isinstance(got, Outcome):
        return got
    _encode(rp, job, job.assemble(got))
    needed = sum(len(b) for r in job.new for b in r.blobs)
    with rp.guard.lock:
        if not room(needed, protect | job.old_ids, len(job.new) * rp.layout.ranks):
            return _abort(rp, job, "no_space", "refused")
        attempt.txn = txn = _intent(rp, job)
        rp.account.charged += needed
    for r in job.new:
        errors = staging.write_all(rp.writer, r.name, r.blobs)
        if errors:
            with rp.guard.lock:
                journal.rollback(rp.ledger, txn, "failed")
            msg = "; ".join(f"rank {rk}: {e}" for rk, e in errors)
            return _abort(rp, job, msg, "failed")
    deadline = time.monotonic() + (0 if locked else pin_wait_s)
    while True:
        with rp.guard.lock:
            # a store does not wait for a row pin() holds (a request using it)
            why = _check(rp, job, fences=1, pins=rp.holds.request_pins if wait_pinned else None, held=held)
            pinned = any(rp.holds.pins[n.id] for n in job.old)
            if why or (pinned and time.monotonic() >= deadline):
                journal.rollback(rp.ledger, txn, "stale")
                return _abort(rp, job, why or "pinned", "skipped")
            if not pinned:
                return _publish(rp, job, attempt, needed)
        time.sleep(0.002)


def _publish(rp: Replacing, job: Job, attempt: _Attempt, needed: int) -> Outcome:
    """Swap the rows, release the fences and retire the old files. Lock held."""
    outs = _swap(rp, job, attempt.txn)
    attempt.published = True
    # a deleted row's fence goes with its index entry; the kept rows'
    # fences end with the transaction, in this same lock section
    _unfence(rp, job, attempt.fenced, {n.id for n in job.dropped})
    journal.run(rp.ledger, attempt.txn, outs)
    _unfence(rp, job, attempt.fenced, attempt.fenced)
    rp.counters.inc("replaces", job.use)
    if job.state == "damaged":
        rp.counters.inc("refills")
    return Outcome(True, None, needed)


def _unfence(rp: Replacing, job: Job, fenced: set[int], ids: set[int]) -> None:
    """Release this run's fence on each of ``ids`` still in ``fenced`` (once each);
    offer the old rows still indexed to the heap. Caller holds the lock."""
    ids = ids & fenced
    if not ids:
        return
    fenced.difference_update(ids)
    rp.holds.unfence(ids)
    for n in job.old:
        if n.id in ids and rp.index.get(n.id) is n:
            rp.recency.heap.offer(n)
    rp.guard.settled.notify_all()  # stores waiting for these rows re-plan


def _abort(rp: Replacing, job: Job, why: str, status: str) -> Outcome:
    rp.counters.inc("replaces", f"{job.use}_aborted")
    log.info("compact_aborted", use=job.use, old=[n.id for n in job.old], why=why)
    return Outcome(False, why, 0, status)


def _check(
    rp: Replacing, job: Job, fences: int, pins: Counter[int] | None, held: frozenset[int] = frozenset()
) -> str | None:
    """Why the old rows cannot be replaced now (None: they can): ``pins`` is the pin
    count that refuses them (None: none does), ``fences`` the run's own count, plus
    one on each row in ``held``. A queued async store's reservation refuses only a job
    that deletes the row (its key disappears). Caller holds the lock."""
    dropped = {n.id for n in job.dropped}
    for n in job.old:
        if rp.index.get(n.id) is not n:
            return "stale"
        if pins is not None and pins[n.id]:
            return "pinned"
        in_flight = rp.holds.fences[n.id] - (0 if n.id in dropped else rp.holds.reserved[n.id])
        if in_flight != fences + (n.id in held):
            return "fenced"
        if n.state != job.state:
            return "damaged" if n.state == "damaged" else "stale"
        if job.gens.get(n.id) != n.generation or job.snaps.get(n.id) != n.has_snapshot:
            return "stale"  # changed since the job was built
    if job.old[0].parent != job.parent:
        return "stale"
    ids = job.old_ids
    for n in job.dropped:
        if n.children - ids:
            return "stale"  # a row that disappears gained a child outside the chain
    return None


def next_generation(catalog: Catalog, ranks: int, key: bytes, floor: int) -> int:
    """A generation above ``floor`` and above every file row of ``key`` on any of
    ``ranks`` (even garbage: a failed cleanup leaves its name taken until reclaimed)."""
    return max(floor, catalog.max_generation(key.hex(), ranks)) + 1




def _read(rp: Replacing, job: Job, rows) -> dict[int, list[RankPart]] | Outcome:
    """Verified tensors of the old rows in ``job.reads``; an Outcome when one fails."""
    got: dict[int, list[RankPart]] = {}
    for n in job.old:
        if n.id not in job.reads:
            continue
        res = restore.read_node(rp.reader, n, rows[n.id], job.reads[n.id])
        if isinstance(res, str):
            with rp.guard.lock:
                health.invalidate(rp.health, n, res)
            return _abort(rp, job, f"damaged: {res}", "skipped")
        if res is None:
            return _abort(rp, job, "read_error", "failed")
        got[n.id] = res
    return got


def _encode(rp: Replacing, job: Job, data: list[list[RankPart]]) -> None:
    assert len(data) == len(job.new)
    pkey = job.parent_key
    for r, parts in zip(job.new, data, strict=True):
        assert len(parts) == rp.layout.ranks
        meta = {**shards.meta(r.key, r.gen, r.start, r.end, r.has_snapshot),
                **shards.provenance(rp.layout, pkey, r.digests)}
        pkey = r.key
        r.blobs = []
        for rank, (segs, snap) in enumerate(parts):
            assert bool(snap) == (r.has_snapshot and rp.layout.has_snapshot), "snapshot mismatch"
            rp.layout.check_segments(rank, segs, (r.end - r.start) * rp.layout.block_tokens)
            if snap:
                rp.layout.check_snapshot(rank, snap)
            r.blobs.append(shards.encode(segs, snap, {**meta, "rank": str(rank)}))


def _room(rp: Replacing, space: str, make_room: MakeRoom | None) -> MakeRoom:
    """How the run fits its new rows (see ``run``'s ``space``)."""
    if space == "make":
        assert make_room is not None, "space='make' needs make_room"
        return make_room
    acct = rp.account
    if space == "capacity":
        return lambda needed, protect, files: acct.fits(needed, acct.capacity)
    return lambda needed, protect, files: acct.fits(needed, acct.capacity * acct.high_watermark)


def _intent(rp: Replacing, job: Job) -> Txn:
    payload = {
        "use": job.use,
        "old": [n.id for n in job.old],
        "parent": job.parent,
        "new": [{"key": r.key.hex(), "start": r.start, "end": r.end, "generation": r.gen,
                 "name": r.name, "keep": r.keep} for r in job.new],
    }
    files = [(rk, r.name, r.gen, len(b), shards.checksum(b)) for r in job.new for rk, b in enumerate(r.blobs)]
    with rp.catalog.txn("compact.intent") as c:
        return journal.begin(rp.ledger, c, KIND, payload, rows=lambda tid: rp.catalog.insert_writing_files(c, tid, files))


def _swap(rp: Replacing, job: Job, txn: Txn) -> tuple[str, ...]:
    """The single commit that replaces the rows, then the in-memory index; the
    outputs of the publish (run after it). Lock held."""
    cat = rp.catalog
    tid = txn.id
    ids: list[int] = []
    with cat.txn("compact.publish") as c:
        cat.retire_node_files(c, [n.id for n in job.old], tid)
        parent = job.parent
        for r in job.new:
            fields = (parent, r.start, r.end, r.digests, int(r.has_snapshot), r.gen, r.last_used, r.snap_used)
            if r.keep is not None:
                cat.rewrite_node(c, r.keep, fields)
                nid = r.keep
            else:
                nid = cat.insert_node_fields(c, r.key, fields)
            cat.publish_file(c, tid, r.name, nid)
            ids.append(nid)
            parent = nid
        for n in job.dropped:
            cat.delete_node(c, n.id)
        outs = journal.fire(rp.ledger, c, txn, "durable")
    _apply_index(rp, job, ids)
    return outs


def _apply_index(rp: Replacing, job: Job, ids: list[int]) -> None:
    """Mirror the swap in the index: nodes, by_key, blocks, children; offer to the heap."""
    idx = rp.index
    old_ids = job.old_ids
    external = {n.id: n.children - old_ids for n in job.old}
    parent = idx.get(job.parent) if job.parent is not None else None
    for n in job.dropped:
        del idx.nodes[n.id]
        if idx.by_key.get(n.key) == n.id:
            del idx.by_key[n.key]
        rp.recency.forget(n.id)
    if parent is not None:
        parent.children.discard(job.old[0].id)
    prev, pkey = parent, (parent.key if parent is not None else ROOT)
    for r, nid in zip(job.new, ids, strict=True):
        nbytes = sum(len(b) for b in r.blobs)
        fields = dict(parent=prev.id if prev is not None else None, start=r.start, end=r.end,
                      digests=r.digests, has_snapshot=r.has_snapshot, state=NODE.next("absent", "published"),
                      generation=r.gen,
                      last_used=r.last_used, snap_used=r.snap_used, nbytes=nbytes)
        node = idx.nodes.get(nid) if r.keep is not None else None
        if node is None:
            node = Node(id=nid, key=r.key, **fields)
            idx.nodes[nid] = node
            idx.by_key[r.key] = nid
        else:
            for k, v in fields.items():
                setattr(node, k, v)
        node.children = set(external.get(nid, ())) if r.keep is not None else set()
        if prev is not None:
            prev.children.add(nid)
        for k in node.block_keys(pkey):
            idx.blocks[k] = nid
        rp.recency.heap.offer(node)
        prev, pkey = node, node.key
    if parent is not None:
        rp.recency.heap.offer(parent)
