"""Making room: the watermarks, the disk's margin, and the victim loop of the policy."""

from __future__ import annotations

from typing import TYPE_CHECKING

from prefixstore.engine import evict, holds, journal, replace
from prefixstore.engine.index import Node
from prefixstore.gpu.diskroom import Shortfall
from prefixstore.statemachine import policy as pol
from prefixstore.statemachine import room

if TYPE_CHECKING:
    from prefixstore.engine.api import Engine


DISK_ROUNDS = 2
"""Further rounds of eviction a store runs when the disk is still short after the
first (the catalog's log grew with the evictions' commits); each is checked first."""


def make_space(eng: Engine, needed: int, protect: set[int]) -> bool:
    """Make room for ``needed`` more charged bytes; False when it cannot fit (see ``room_for``)."""
    return room_for(eng, needed, protect) is None


def room_for(eng: Engine, needed: int, protect: set[int], files: int | None = None) -> str | None:
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
    cap = eng.capacity
    files = eng.layout.ranks if files is None else files
    reserve = retire_reserve(eng, protect)
    eng.disk.hold_catalog_room()
    short = eng.disk.shortfall(needed, files)
    if not short and eng._charged + needed + reserve <= cap * eng.high_watermark:
        eng.disk.restore()
        return None
    if needed > cap - held_bytes(eng, protect):
        return room.NO_SPACE
    if short and (why := disk_refusal(eng, short, protect)) is not None:
        return why
    target = max(0.0, min(cap * eng.low_watermark, cap) - needed - reserve)
    target = min(target, eng._charged - short.bytes)
    with holds.fenced(eng, protect):
        free(eng, eng._charged - target, protect, files=short.files)
        for _ in range(DISK_ROUNDS):  # what the evictions' own commits took meanwhile
            short = eng.disk.shortfall(needed, files)
            if not short or disk_refusal(eng, short, protect) is not None:
                break
            free(eng, short.bytes, protect, files=short.files)
    if short := eng.disk.shortfall(needed, files):
        return short.reason  # e.g. another writer took the room meanwhile
    eng.disk.hold_catalog_room()
    eng.disk.restore()
    return None if eng._charged + needed <= cap else room.NO_SPACE


def disk_refusal(eng: Engine, short: Shortfall, protect: set[int]) -> str | None:
    """Why eviction cannot make up the disk's ``short`` (nothing evicted to find out),
    or None."""
    held, held_nodes = held_room(eng, protect)
    files = (len(eng.index) - held_nodes) * eng.layout.ranks
    if short.files > files and eng._garbage_hint:
        files += len(eng.catalog.loose_garbage())
    return room.disk_refusal(short.bytes, short.files, eng._charged - held, files)


def retire_reserve(eng: Engine, protect: set[int]) -> int:
    """Headroom kept free so a snapshot retirement (which writes the new
    segment-only generation before the old one is freed) is not blocked by room.

    The rewrite of the largest retirement candidate, counting the protected parent
    of the store in progress (it becomes one), at most an eighth of capacity.
    """
    if not eng.heap.retires:
        return 0
    biggest = eng.heap.largest_retire(eng.index.get)
    for nid in protect:
        node = eng.index.get(nid)
        if node is not None and node.ready and node.has_snapshot:
            biggest = max(biggest, node.nbytes)
    snap = eng.layout.ranks * eng.layout.snapshot_bytes
    return min(pol.retire_rewrite_bytes(biggest, snap), eng.capacity // 8)


def held_bytes(eng: Engine, protect: set[int]) -> int:
    """Charged bytes no eviction can free now (a lower bound): every pinned, fenced
    or protected node, and their ancestors' segments (snapshots can retire)."""
    return held_room(eng, protect)[0]


def held_room(eng: Engine, protect: set[int]) -> tuple[int, int]:
    """``held_bytes``, and how many nodes hold them (their files cannot go)."""
    blocked_ids = set(eng._pins) | set(eng._fences) | set(protect)
    snap = eng.layout.ranks * eng.layout.snapshot_bytes
    held, seen = 0, set()
    for nid in blocked_ids:
        node = eng.index.get(nid)
        while node is not None and node.id not in seen:
            seen.add(node.id)
            if node.id not in blocked_ids and eng.heap.retires and node.ready and node.has_snapshot:
                held += pol.retire_rewrite_bytes(node.nbytes, snap)
            else:
                held += node.nbytes
            node = eng.index.get(node.parent) if node.parent is not None else None
    return held, len(seen)


def free(eng: Engine, amount: float, protect: set[int] = frozenset(), files: int = 0) -> int:
    """Free at least ``amount`` charged bytes and ``files`` shard files (best effort);
    returns bytes freed.

    Loose garbage goes first (it frees bytes and loses nothing), then victims in
    policy order, one transaction each, until the actual charged bytes reach the
    goal; each victim is credited with what it really freed (a retirement: its
    old generation once, minus the new one; no file). Candidates that are pinned,
    fenced or protected are set aside for this call; a retirement lacking room for
    its rewrite waits until later victims made the room.
    """
    start = eng._charged
    goal = start - amount
    gone = 0  # files freed
    if (eng._charged > goal or files) and eng._garbage_hint:
        gone += reclaim_loose(eng)
    held: list[pol.Entry] = []
    waiting: list[pol.Entry] = []  # retirements lacking room, oldest first
    failed: list[Node] = []
    try:
        while eng._charged > goal or gone < files:
            entry = next_victim(eng, waiting)
            if entry is None:
                break
            if entry is False:
                continue
            node, action = eng.index.nodes[entry[2]], entry[3]
            if node in failed:
                continue  # its retirement failed in this call (it is offered again below)
            if untouchable(eng, node, action, protect):
                held.append(entry)
            elif action == pol.RETIRE and not retire_fits(eng, node):
                waiting.append(entry)
            elif (taken := take_victim(eng, node, action)) is None:
                failed.append(node)
            else:
                gone += taken
    finally:
        for entry in held + waiting:
            eng.heap.push(entry)
        for node in failed:
            if node.id in eng.index.nodes:
                eng.heap.offer(node)
        eng.heap.compact_if_stale(len(eng.index), lambda: eng.index)
    return start - eng._charged


def next_victim(eng: Engine, waiting: list[pol.Entry]) -> pol.Entry | None | bool:
    """The next candidate: a waiting retirement that now fits, else the policy's next;
    None when there is none, False when a stale waiting entry was dropped."""
    if waiting and not eng.heap.is_current(waiting[0], eng.index.get):
        waiting.pop(0)  # its node changed meanwhile (e.g. became a leaf and went)
        return False
    if waiting and retire_fits(eng, eng.index.nodes[waiting[0][2]]):
        return waiting.pop(0)
    return eng.heap.pop_valid(eng.index.get)


def take_victim(eng: Engine, node: Node, action: str) -> int | None:
    """Run ``action`` on ``node`` and count what it freed; the shard files it removed,
    or None when a retirement failed."""
    before = eng._charged
    if action == pol.EVICT:
        evict.evict_nodes(eng, [node])
        gone = 1
    elif action == pol.SUBTREE:
        nodes = subtree(eng, node)
        evict.evict_nodes(eng, nodes)
        gone = len(nodes)
    elif not replace.retire_snapshot(eng, node):
        return None
    else:
        gone = 0  # a retirement replaces each file with a new one
    eng.counters.evicted(action, before - eng._charged)
    return gone * eng.layout.ranks


def reclaim_loose(eng: Engine) -> int:
    """Unlink loose garbage (files no transaction owns any more, left by a failed
    unlink or found at open); returns how many files it had."""
    eng._garbage_hint = False
    rows = eng.catalog.loose_garbage()
    before = eng._charged
    journal.reclaim_rows(eng, None, rows)
    if before > eng._charged:
        eng.counters.evicted("garbage", before - eng._charged)
    return len(rows)


def untouchable(eng: Engine, node: Node, action: str, protect: set[int] = frozenset()) -> bool:
    """Pinned, fenced or protected (for a subtree action: anywhere in it)."""
    if node.id in protect or eng._pins[node.id] or eng._fences[node.id]:
        return True
    if action == pol.SUBTREE:
        return any(eng._pins[x.id] or eng._fences[x.id] or x.id in protect for x in subtree(eng, node))
    return False


def retire_fits(eng: Engine, node: Node) -> bool:
    """Whether the new generation of a retirement of ``node`` fits under capacity."""
    snap = eng.layout.ranks * eng.layout.snapshot_bytes
    rewrite = pol.retire_rewrite_bytes(node.nbytes, snap)
    return eng._charged + rewrite <= eng.capacity and not eng.disk.shortfall(rewrite, eng.layout.ranks)


def blocked(eng: Engine, nid: int, action: str, protect: set[int] = frozenset()) -> bool:
    """Whether ``action`` on node ``nid`` may not run now."""
    node = eng.index.nodes[nid]
    if untouchable(eng, node, action, protect):
        return True
    return action == pol.RETIRE and not retire_fits(eng, node)


def subtree(eng: Engine, node: Node) -> list[Node]:
    """``node`` and its descendants, leaves first."""
    out, todo = [], [node]
    while todo:
        n = todo.pop()
        out.append(n)
        todo.extend(eng.index.nodes[c] for c in n.children)
    out.reverse()
    return out
