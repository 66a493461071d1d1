"""Stores that meet existing rows' spans, done as compact-replace transactions.

``store.store`` calls ``on_store`` before its ordinary plan. Three cases:

- **split**: the checkpoint lands inside a ready node N's span ``(s, e]``, at ``m``.
  N is replaced by ``(s, m]`` (a new row, the new checkpoint, with the store's
  snapshot) and ``(m, e]`` (N's key, id, snapshot and children). Both rows' segment
  bytes are N's own (read and verified), so every restore through N returns the same
  bytes before and after. When the prefix diverges inside N's span (the store's
  parent would sit at ``m < len(prefix)``), N is split at ``m`` without a snapshot and
  the ordinary store then adds the new node under ``(s, m]``.
- **republish with a snapshot**: the checkpoint is a ready node's end, the node has no
  snapshot (retired, or a merge endpoint), and the store's segments do not reach back
  to the node's start (it was merged): the node is rewritten from its own verified
  rows plus the store's snapshot (status ``refilled``).
- **row refill**: damaged ancestors on the store's path whose whole span the store's
  segments cover are republished from those rows (no snapshot: the store has none at
  their position), so lookups reach past them again (counted in ``refills``).

Everything else returns None and the ordinary store runs (a damaged node with the
checkpoint inside its span is still skipped as ``inside_span``).
"""

from __future__ import annotations

import time
from collections.abc import Callable

import attrs

from prefixstore.base.errors import InvalidInputError
from prefixstore.base.keys import DIGEST_SIZE, Prefix
from prefixstore.base.layout import Layout, RankTensors
from prefixstore.base.log import log
from prefixstore.engine import replace
from prefixstore.engine.counters import Counters
from prefixstore.engine.guard import CallGuard
from prefixstore.engine.holds import Holds
from prefixstore.engine.index import Index, Node
from prefixstore.engine.plan import Plan, count_skip
from prefixstore.engine.recency import Recency
from prefixstore.engine.replace import Replacing
from prefixstore.engine.results import FAILED, REFILLED, REFUSED, SKIPPED, STORED, StoreResult
from prefixstore.engine.settings import Settings
from prefixstore.engine.space import Room

Admit = Callable[[Prefix, Plan], bool]
"""The admission hook bound to its engine: whether to store ``prefix`` on ``plan``."""


@attrs.frozen(slots=True, eq=False)
class Spans:
    """What a store meeting existing rows' spans uses: the lock (and ``settled``, to
    wait for a transaction on the row), the index and holds it plans from, the
    compact-replace it runs (making room by policy, ``room``), the admission hook."""

    guard: CallGuard
    layout: Layout
    index: Index
    holds: Holds
    settings: Settings
    counters: Counters
    recency: Recency
    replacing: Replacing
    room: Room
    admit: Admit | None


def on_store(
    sp: Spans,
    prefix: Prefix,
    segs: list[RankTensors],
    snaps: list[RankTensors] | None,
    tokens_from: int,
    held: frozenset[int] = frozenset(),
) -> StoreResult | None:
    """Handle a store that needs a compact-replace; None lets the ordinary store run.

    Raises InvalidInputError (before any row changes) when ``tokens_from`` is not an
    int or starts after the block where the store's new node would begin. ``held``:
    rows the caller fences itself (``store.store``), not busy for this store.
    """
    check_tokens_from(sp, prefix, tokens_from)
    _refill_rows(sp, prefix, segs, tokens_from, held)
    with sp.guard.lock:
        deadline = time.monotonic() + sp.settings.inflight_wait_s
        while True:
            routed = route(sp, prefix, tokens_from)
            if routed is None:
                return None
            action, owner, p = routed
            left = deadline - time.monotonic()
            if not sp.holds.fenced_by_other(owner.id, held) or left <= 0 or sp.guard.closed:
                break
            # Another transaction holds the row this store would replace: let it settle.
            sp.guard.settled.wait(min(left, 0.05))
        planned = action(sp, prefix, owner, p, snaps, held)
        if isinstance(planned, StoreResult):
            return planned
    job, ok_status = planned
    node = job.old[0]
    out = replace.run(sp.replacing, job, space="make", make_room=sp.room.make,
                      protect=frozenset({node.parent} - {None}), held=held,
                      pin_wait_s=sp.settings.pin_wait_s, wait_pinned=True)
    log.debug(job.use, node=node.id, ok=out.ok, reason=out.reason)
    if out.ok and ok_status is None:
        return None  # a split made the new checkpoint's parent: the ordinary store goes on
    return _result(sp, out, len(prefix), ok_status or STORED)


def ordinary(sp: Spans, prefix: Prefix, tokens_from: int, held: frozenset[int] = frozenset()) -> bool:
    """Whether ``on_store`` would let the ordinary store run at once: no damaged
    ancestor to refill and no compact-replace to route to (the common store, decided
    in one hold of the lock). Raises InvalidInputError as ``on_store`` does. Lock held."""
    check_tokens_from(sp, prefix, tokens_from)
    return not _refill_candidates(sp, prefix, tokens_from, held) and route(sp, prefix, tokens_from) is None


def route(sp: Spans, prefix: Prefix, tokens_from: int) -> tuple[Callable, Node, int] | None:
    """The compact-replace a store of ``prefix`` takes: (its action, the ready row it
    replaces, the prefix's deepest stored block); None: the ordinary store. Lock held."""
    L = sp.layout
    n = len(prefix)
    p = sp.index.deepest_block(prefix.keys, n)
    owner = sp.index.owner(prefix.keys, p)
    if owner is None or not owner.ready:
        return None
    if owner.end != p:
        return _split, owner, p
    if p == n and L.has_snapshot and not owner.has_snapshot and tokens_from > owner.start * L.block_tokens:
        return _republish_snapshot, owner, p
    return None


def refill_from(sp: Spans, prefix: Prefix, tokens_from: int, start: int) -> int:
    """The first block of the rows a store of ``prefix`` (new node at ``start``)
    needs: ``start``, or the start of the highest damaged ancestor it refills. Lock held."""
    return min((x.start for x in _refill_candidates(sp, prefix, tokens_from, frozenset())), default=start)


def check_tokens_from(sp: Spans, prefix: Prefix, tokens_from: int) -> None:
    """Reject bad ``tokens_from`` before any compact-replace: bad input changes nothing.

    When the prefix goes past its deepest stored block ``p`` (a new node will start at
    ``p``, after a split if ``p`` is inside a row's span), the segments must reach back
    to it. (``p == n`` needs no new segments, or is checked by the ordinary store.)
    """
    if not isinstance(tokens_from, int) or isinstance(tokens_from, bool):
        raise InvalidInputError(f"tokens_from must be an int, not {type(tokens_from).__name__}")
    bt = sp.layout.block_tokens
    with sp.guard.lock:
        p = sp.index.deepest_block(prefix.keys, len(prefix))
    if p < len(prefix) and tokens_from > p * bt:
        raise InvalidInputError(
            f"the new node needs tokens from {p * bt}, but segments start at tokens_from={tokens_from}"
        )


def _busy(sp: Spans, node: Node, n: int, held: frozenset[int]) -> StoreResult | None:
    """A skip when ``pin()`` holds ``node`` (a request uses it) or another transaction
    fences it. A node only running restores pin is not busy: the replacement is
    prepared beside it and its swap waits for those pins to go (up to
    ``sp.settings.pin_wait_s``; a restore pins for milliseconds), so a row that concurrent
    requests keep restoring can still be split."""
    for why, busy in (("pinned", sp.holds.request_pins[node.id]), ("fenced", sp.holds.fenced_by_other(node.id, held))):
        if busy:
            res = StoreResult(SKIPPED, n, why)
            count_skip(sp.counters, res)
            return res
    return None


def _result(sp: Spans, out: replace.Outcome, n: int, ok_status: str) -> StoreResult:
    if out.ok:
        res = StoreResult(ok_status, n, None, out.nbytes)
        sp.counters.inc("stores", ok_status)
        return res
    status = {"refused": REFUSED, "failed": FAILED}.get(out.status, SKIPPED)
    res = StoreResult(status, n, out.reason, out.nbytes)
    if status == FAILED:
        sp.counters.inc("stores", FAILED)
    else:
        count_skip(sp.counters, res)
    return res


def _split(
    sp: Spans, prefix: Prefix, node: Node, at: int, snaps, held: frozenset[int]
) -> StoreResult | tuple[replace.Job, str | None]:
    """The job splitting ``node`` at block ``at``, and the store status on success
    (None: the ordinary store continues). Lock held."""
    L = sp.layout
    n = len(prefix)
    if (busy := _busy(sp, node, n, held)) is not None:
        return busy
    parent = sp.index.get(node.parent) if node.parent is not None else None
    if sp.admit is not None:
        plan = Plan(parent, None, node.start) if at == n else Plan(node, None, at)
        if not sp.admit(prefix, plan):
            res = StoreResult(SKIPPED, n, "admission")
            count_skip(sp.counters, res)
            return res
    with_snap = at == n and L.has_snapshot
    k = at - node.start
    cut = k * L.block_tokens
    now = sp.recency.tick()
    lower = replace.NewRow(prefix.keys[at - 1], node.start, at, node.digests[: k * DIGEST_SIZE], with_snap, now, now)
    upper = replace.NewRow(node.key, at, node.end, node.digests[k * DIGEST_SIZE :], node.has_snapshot,
                   node.last_used, node.snap_used, keep=node.id)

    def assemble(got):
        parts = got[node.id]
        lo = [({name: t[:cut] for name, t in segs.items()}, snaps[r] if with_snap else {})
              for r, (segs, _) in enumerate(parts)]
        hi = [({name: t[cut:] for name, t in segs.items()}, sn) for segs, sn in parts]
        return [lo, hi]

    job = replace.Job("split", [node], [lower, upper], {node.id: node.has_snapshot}, assemble)
    return job, (STORED if at == n else None)


def _republish_snapshot(
    sp: Spans, prefix: Prefix, node: Node, _at: int, snaps, held: frozenset[int]
) -> StoreResult | tuple[replace.Job, str]:
    """The job rewriting ``node`` from its own rows plus the store's snapshot. Lock held."""
    n = len(prefix)
    if (busy := _busy(sp, node, n, held)) is not None:
        return busy
    now = sp.recency.tick()
    row = replace.NewRow(node.key, node.start, node.end, node.digests, True, now, now, keep=node.id)
    job = replace.Job("republish", [node], [row], {node.id: False},
              lambda got: [[(segs, snaps[r]) for r, (segs, _) in enumerate(got[node.id])]])
    return job, REFILLED


def _refill_candidates(sp: Spans, prefix: Prefix, tokens_from: int, held: frozenset[int]) -> list[Node]:
    """Damaged ancestors on ``prefix``'s path whose span the store's rows cover and no
    other transaction holds, deepest first. Lock held."""
    bt = sp.layout.block_tokens
    n = len(prefix)
    keys = prefix.keys
    # Walk up the store's path over the rows its segments cover (O(those rows)).
    p = sp.index.deepest_block(keys, n)
    x = sp.index.owner(keys, p)
    if x is not None and x.end != p:
        x = sp.index.get(x.parent) if x.parent is not None else None
    todo = []
    while x is not None and x.start * bt >= tokens_from:
        if x.state == "damaged" and x.end < n and not sp.holds.pins[x.id] and not sp.holds.fenced_by_other(x.id, held):
            todo.append(x)
        x = sp.index.get(x.parent) if x.parent is not None else None
    return todo


def _refill_rows(
    sp: Spans, prefix: Prefix, segs: list[RankTensors], tokens_from: int, held: frozenset[int]
) -> None:
    """Republish damaged ancestors on ``prefix``'s path from the store's rows."""
    L = sp.layout
    with sp.guard.lock:
        todo = _refill_candidates(sp, prefix, tokens_from, held)
        # Jobs are built here, under the lock that observed the rows (their generations).
        jobs = [_refill_job(x, segs, tokens_from, L.block_tokens, L.ranks) for x in sorted(todo, key=lambda x: x.end)]
    for job in jobs:
        x = job.old[0]
        out = replace.run(sp.replacing, job, space="make", make_room=sp.room.make,
                          protect=frozenset({x.parent} - {None}), held=held,
                          pin_wait_s=sp.settings.pin_wait_s, wait_pinned=True)
        log.info("row_refill", node=x.id, ok=out.ok, reason=out.reason)


def _refill_job(x: Node, segs: list[RankTensors], tokens_from: int, bt: int, ranks: int) -> replace.Job:
    """The job republishing damaged row ``x`` from the store's segment rows. Lock held."""
    lo, hi = x.start * bt - tokens_from, x.end * bt - tokens_from
    row = replace.NewRow(x.key, x.start, x.end, x.digests, False, x.last_used, x.snap_used, keep=x.id)

    def assemble(got):
        return [[({k: v[lo:hi] for k, v in segs[r].items()}, {}) for r in range(ranks)]]

    return replace.Job("republish", [x], [row], {}, assemble, state="damaged")
