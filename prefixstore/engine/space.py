"""Making room: the watermarks, the disk's margin, and the victim loop of the policy."""

from __future__ import annotations

import attrs

from prefixstore.base.layout import Layout
from prefixstore.engine import evict, journal, replace
from prefixstore.engine.account import Account
from prefixstore.engine.catalog import Catalog
from prefixstore.engine.counters import Counters
from prefixstore.engine.evict import Evicting
from prefixstore.engine.holds import Holds
from prefixstore.engine.index import Index, Node
from prefixstore.engine.journal import Ledger
from prefixstore.engine.recency import Recency
from prefixstore.engine.replace import Replacing
from prefixstore.engine.victims import Batch
from prefixstore.gpu.diskroom import Shortfall
from prefixstore.statemachine import policy as pol
from prefixstore.statemachine import room


@attrs.frozen(slots=True, eq=False)
class Room:
    """What making room uses: the space account and the disk's room, the index, the
    holds that keep nodes from eviction, the victim heap (``recency``), and the two
    ways a victim goes (an evict transaction, a snapshot retirement). Lock held."""

    account: Account
    layout: Layout
    index: Index
    holds: Holds
    recency: Recency
    catalog: Catalog
    ledger: Ledger
    counters: Counters
    evicting: Evicting
    replacing: Replacing

    def make(self, needed: int, protect: set[int], files: int) -> bool:
        """``make_space`` (a compact-replace's ``make_room``)."""
        return make_space(self, needed, protect, files)


DISK_ROUNDS = 2
"""Further rounds of eviction a store runs when the disk is still short after the
first (the catalog's log grew with the evictions' commits); each is checked first."""


def make_space(rm: Room, needed: int, protect: set[int], files: int) -> bool:
    """Make room for ``needed`` more charged bytes in ``files`` new shard files; False
    when they cannot fit (see ``room_for``)."""
    return room_for(rm, needed, protect, files) is None


def room_for(rm: Room, needed: int, protect: set[int], files: int | None = None) -> str | None:
    """Make room for ``needed`` more charged bytes in ``files`` new shard files (one
    per rank unless given); None when it fits, else the refusal reason (``no_space``,
    ``no_inodes``).

    Below the high watermark nothing is evicted. Above it, victims go until the
    charged bytes plus ``needed`` plus the retirement headroom reach the low
    watermark (best effort; success needs only ``needed`` to fit). A checkpoint
    that could not fit even if every byte not held by a pin, a fence or
    ``protect`` were freed is refused before anything is evicted. ``protect`` (the
    store's parent and refilled row) is fenced meanwhile, so nothing reached from
    the eviction (a retirement's effects, their hooks) can take it either.

    The disk is the other limit: victims also go until the file systems have the
    bytes and inodes for the new shards plus the catalog's margins
    (``gpu/diskroom.py``), whatever the capacity says. Whether eviction can make that
    room at all is decided first, from the free room measured and what eviction
    could free (``statemachine/room.py``): a store the disk cannot hold is refused
    with nothing evicted. Taking the catalog's reserve back is never a reason to evict.
    """
    cap = rm.account.capacity
    files = rm.layout.ranks if files is None else files
    reserve = retire_reserve(rm, protect)
    short = rm.account.disk.shortfall(needed, files, rm.account.disk.hold_catalog_room())
    if not short and rm.account.charged + needed + reserve <= cap * rm.account.high_watermark:
        rm.account.disk.restore()
        return None
    if needed > cap - held_bytes(rm, protect):
        return room.NO_SPACE
    if short and (why := disk_refusal(rm, short, protect)) is not None:
        return why
    target = max(0.0, min(cap * rm.account.low_watermark, cap) - needed - reserve)
    target = min(target, rm.account.charged - short.bytes)
    with rm.holds.fenced(protect):
        free(rm, rm.account.charged - target, protect, files=short.files)
        # what the evictions' own commits took meanwhile; the last measure is the verdict
        # (e.g. another writer took the room meanwhile)
        short = rm.account.disk.shortfall(needed, files)
        for _ in range(DISK_ROUNDS):
            if not short or disk_refusal(rm, short, protect) is not None:
                break
            free(rm, short.bytes, protect, files=short.files)
            short = rm.account.disk.shortfall(needed, files)
    if short:
        return short.reason
    rm.account.disk.hold_catalog_room()
    rm.account.disk.restore()
    return None if rm.account.charged + needed <= cap else room.NO_SPACE


def disk_refusal(rm: Room, short: Shortfall, protect: set[int]) -> str | None:
    """Why eviction cannot make up the disk's ``short`` (nothing evicted to find out),
    or None."""
    held, held_nodes = held_room(rm, protect)
    files = (len(rm.index) - held_nodes) * rm.layout.ranks
    if short.files > files and rm.account.garbage_hint:
        files += len(rm.catalog.loose_garbage())
    return room.disk_refusal(short.bytes, short.files, rm.account.charged - held, files)


def retire_reserve(rm: Room, protect: set[int]) -> int:
    """Headroom kept free so a snapshot retirement (which writes the new
    segment-only generation before the old one is freed) is not blocked by room.

    The rewrite of the largest retirement candidate, counting the protected parent
    of the store in progress (it becomes one), at most an eighth of capacity.
    """
    if not rm.recency.heap.retires:
        return 0
    biggest = rm.recency.heap.largest_retire(rm.index.get)
    for nid in protect:
        node = rm.index.get(nid)
        if node is not None and node.ready and node.has_snapshot:
            biggest = max(biggest, node.nbytes)
    snap = rm.layout.ranks * rm.layout.snapshot_bytes
    return min(pol.retire_rewrite_bytes(biggest, snap), rm.account.capacity // 8)


def held_bytes(rm: Room, protect: set[int]) -> int:
    """Charged bytes no eviction can free now (a lower bound): every pinned, fenced
    or protected node, and their ancestors' segments (snapshots can retire)."""
    return held_room(rm, protect)[0]


def held_room(rm: Room, protect: set[int]) -> tuple[int, int]:
    """``held_bytes``, and how many nodes hold them (their files cannot go)."""
    blocked_ids = set(rm.holds.pins) | set(rm.holds.fences) | set(protect)
    snap = rm.layout.ranks * rm.layout.snapshot_bytes
    held, seen = 0, set()
    for nid in blocked_ids:
        node = rm.index.get(nid)
        while node is not None and node.id not in seen:
            seen.add(node.id)
            if node.id not in blocked_ids and rm.recency.heap.retires and node.ready and node.has_snapshot:
                held += pol.retire_rewrite_bytes(node.nbytes, snap)
            else:
                held += node.nbytes
            node = rm.index.get(node.parent) if node.parent is not None else None
    return held, len(seen)


EVICT_BATCH = 256
"""The most nodes one evict transaction of a space-making pass removes."""


@attrs.define(slots=True, eq=False)
class Pass:
    """One call of ``free``: the candidates it set aside (pinned, fenced, protected),
    the retirements waiting for room (oldest first), the nodes it skips (a retirement
    that failed, a victim found held when its batch was evicted: offered again at the
    end), the victims batched for one evict transaction, and the shard files freed."""

    protect: set[int]
    batch: Batch
    held: list[pol.Entry] = attrs.field(factory=list)
    waiting: list[pol.Entry] = attrs.field(factory=list)
    skipped: list[Node] = attrs.field(factory=list)
    gone: int = 0


def free(rm: Room, amount: float, protect: set[int] = frozenset(), files: int = 0) -> int:
    """Free at least ``amount`` charged bytes and ``files`` shard files (best effort);
    returns bytes freed.

    Loose garbage goes first (it frees bytes and loses nothing), then victims in
    policy order until the actual charged bytes reach the goal. Evictions are
    batched (``victims.Batch``): the leaves chosen, and the parents they leave as
    leaves, go in one evict transaction of up to ``EVICT_BATCH`` nodes, run when the
    batch would reach the goal, is full, or a retirement comes next (its own
    transaction, whose room counts what the batch frees). Each victim is credited
    with what it really freed (a retirement: its old generation once, minus the new
    one; no file); the goal is checked again on the actual charged bytes after each
    batch. Candidates that are pinned, fenced or protected are set aside for this
    call; a retirement lacking room for its rewrite waits until later victims made
    the room.
    """
    start = rm.account.charged
    goal = start - amount
    p = Pass(set(protect), Batch(rm.index, EVICT_BATCH))
    if (rm.account.charged > goal or files) and rm.account.garbage_hint:
        p.gone += reclaim_loose(rm)
    try:
        while True:
            short = rm.account.charged - p.batch.nbytes > goal or p.gone + len(p.batch) * rm.layout.ranks < files
            if short and step(rm, p):
                continue
            if not p.batch:
                break
            evict_batch(rm, p)
    finally:
        put_back(rm, p)
    return start - rm.account.charged


def step(rm: Room, p: Pass) -> bool:
    """Take the next candidate: batch it, set it aside, or run its retirement; False
    when there is none."""
    entry = next_victim(rm, p)
    if entry is None:
        return False
    if entry is False:
        return True
    node, action = rm.index.nodes[entry[2]], entry[3]
    if node in p.skipped:
        return True  # its retirement failed in this call (it is offered again at the end)
    if untouchable(rm, node, action, p.protect, p.batch):
        p.held.append(entry)
    elif action == pol.RETIRE:
        if retire_fits(rm, node, p.batch):
            evict_batch(rm, p)  # a retirement is its own transaction: what the batch frees comes first
        if not retire_fits(rm, node):
            p.waiting.append(entry)
        elif not retire(rm, node):
            p.skipped.append(node)
    else:
        add_victim(rm, p, action, [node] if action == pol.EVICT else subtree(rm, node, p.batch))
    return True


def add_victim(rm: Room, p: Pass, action: str, nodes: list[Node]) -> None:
    """Batch ``nodes`` (leaves first) as one victim of ``action``, evicting the batch
    whenever it is full: a subtree larger than the room left goes in parts, each in
    its own evict transaction after the parts holding its descendants, so none takes
    more than ``EVICT_BATCH`` nodes (a crash between two leaves the tree whole, the
    subtree cut down from its leaves)."""
    while nodes:
        room = max(1, p.batch.room)
        part, nodes = nodes[:room], nodes[room:]
        for leaf in p.batch.add(action, part, last=not nodes):
            rm.recency.heap.offer(leaf)
        if p.batch.full:
            evict_batch(rm, p)


def next_victim(rm: Room, p: Pass) -> pol.Entry | None | bool:
    """The next candidate: a waiting retirement that now fits, else the policy's next;
    None when there is none, False when nothing was taken (a stale waiting entry was
    dropped, or the batch was evicted to make a waiting retirement's room)."""
    waiting = p.waiting
    if waiting and not rm.recency.heap.is_current(waiting[0], p.batch.lookup):
        waiting.pop(0)  # its node changed meanwhile (e.g. became a leaf and went)
        return False
    if waiting and p.batch and retire_fits(rm, rm.index.nodes[waiting[0][2]], p.batch):
        evict_batch(rm, p)
        return False
    if waiting and retire_fits(rm, rm.index.nodes[waiting[0][2]]):
        return waiting.pop(0)
    return rm.recency.heap.pop_valid(p.batch.lookup)


def retire(rm: Room, node: Node) -> bool:
    """Retire ``node``'s snapshot and count what it freed; False when it failed."""
    before = rm.account.charged
    if not replace.retire_snapshot(rm.replacing, node):
        return False
    rm.counters.evicted(pol.RETIRE, before - rm.account.charged)
    return True


def evict_batch(rm: Room, p: Pass) -> None:
    """Evict the batched victims in one evict transaction, each one read again first
    (still unheld, its children going before it), and credit each with what it freed."""
    victims, offered = p.batch.take()
    kept, gone, dropped = [], set(), []
    for action, nodes, last in victims:
        ids = {n.id for n in nodes}
        if any(untouchable(rm, n, pol.EVICT, p.protect) for n in nodes) \
                or any(c not in gone and c not in ids for n in nodes for c in n.children):
            dropped += nodes
        else:
            kept.append((action, nodes, last))
            gone |= ids
    p.skipped += dropped
    nodes = [n for _, ns, _ in kept for n in ns]
    if not nodes:
        return
    before = rm.account.charged
    try:
        evict.evict_nodes(rm.evicting, nodes, offered - gone)
    except BaseException:
        p.skipped += nodes
        raise
    left = before - rm.account.charged
    for action, ns, last in kept:
        freed = min(left, sum(n.nbytes for n in ns))
        if last:
            rm.counters.evicted(action, freed)
        else:  # a part of a victim: its bytes now, the victim with its last part
            rm.counters.inc("evicted_bytes", action, max(0, freed))
        left -= freed
    p.gone += len(nodes) * rm.layout.ranks


def put_back(rm: Room, p: Pass) -> None:
    """End a pass: the entries set aside go back to the heap; the nodes skipped, and
    any still batched (an error ended the pass), are offered again with their parents."""
    heap = rm.recency.heap
    for entry in p.held + p.waiting:
        heap.push(entry)
    for node in p.skipped + [n for _, ns, _ in p.batch.take()[0] for n in ns]:
        for nid in (node.id, node.parent):
            if nid is not None and (again := rm.index.get(nid)) is not None:
                heap.offer(again)
    heap.compact_if_stale(len(rm.index), lambda: rm.index)


def reclaim_loose(rm: Room) -> int:
    """Unlink loose garbage (files no transaction owns any more, left by a failed
    unlink or found at open); returns how many files it had."""
    rm.account.garbage_hint = False
    rows = rm.catalog.loose_garbage()
    before = rm.account.charged
    journal.reclaim_rows(rm.ledger, None, rows)
    if before > rm.account.charged:
        rm.counters.evicted("garbage", before - rm.account.charged)
    return len(rows)


def untouchable(rm: Room, node: Node, action: str, protect: set[int] = frozenset(),
                batch: Batch | None = None) -> bool:
    """Pinned, fenced or protected (for a subtree action: anywhere in it, but for what
    ``batch`` already chose)."""
    if node.id in protect or rm.holds.pins[node.id] or rm.holds.fences[node.id]:
        return True
    if action == pol.SUBTREE:
        return any(rm.holds.pins[x.id] or rm.holds.fences[x.id] or x.id in protect
                   for x in subtree(rm, node, batch))
    return False


def retire_fits(rm: Room, node: Node, batch: Batch | None = None) -> bool:
    """Whether the new generation of a retirement of ``node`` fits under capacity and
    on the disk (once ``batch`` is evicted: its bytes and files freed)."""
    snap = rm.layout.ranks * rm.layout.snapshot_bytes
    rewrite = pol.retire_rewrite_bytes(node.nbytes, snap)
    credit, files = (batch.nbytes, len(batch) * rm.layout.ranks) if batch is not None else (0, 0)
    if rm.account.charged - credit + rewrite > rm.account.capacity:
        return False
    short = rm.account.disk.shortfall(rewrite, rm.layout.ranks)
    return short.bytes <= credit and short.files <= files


def blocked(rm: Room, nid: int, action: str, protect: set[int] = frozenset()) -> bool:
    """Whether ``action`` on node ``nid`` may not run now."""
    node = rm.index.nodes[nid]
    if untouchable(rm, node, action, protect):
        return True
    return action == pol.RETIRE and not retire_fits(rm, node)


def subtree(rm: Room, node: Node, batch: Batch | None = None) -> list[Node]:
    """``node`` and its descendants (but for those ``batch`` already chose), leaves first."""
    out, todo = [], [node]
    while todo:
        n = todo.pop()
        out.append(n)
        todo.extend(batch.children(n) if batch is not None else (rm.index.nodes[c] for c in n.children))
    out.reverse()
    return out
