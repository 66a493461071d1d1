"""Recovery on open: drive every unfinished transaction to an end state.

First, before changing anything, the catalog's rows are checked against each other
(``prefixstore.engine.structure``): a catalog that contradicts itself (a tampered
parent, key or digests, a file row naming a path or an unknown rank, a live file of
a missing node) is refused with CatalogCorruptError, so no such row is ever indexed,
served or used to unlink a file; ``prefixstore audit --repair`` fixes it.

Then, before anything is unlinked, the file rows are reconciled with the files
(``reconcile``): nothing is deleted on one row's word.

- A file named after a node's current shard (its key and generation) is that node's
  shard, whatever its row says: a row that calls it garbage or writing, gives it
  another node or generation, or hands it to a transaction is re-attached to the node
  as its live file. A file no row names is re-attached when its bytes verify as that
  node's shard on that rank, and moved to ``lost+found/`` otherwise (never unlinked).
- A node whose recorded generation names no file, while its live rows (one on every
  rank) are all one other generation's shards, takes that generation.
- A row whose size is negative takes the file's size; so does a live row of a ready
  node whose file reads with the row's checksum (checked in ``_verify_live``), so
  charged bytes stay the bytes on disk.

On a full disk with no catalog reserve left to release (``gpu/diskroom.py``), the
files that no committed record needs (garbage, the new files of transactions that
roll back) are unlinked first, so the commits below have room; their rows then find
the files gone, which is success.

Then every unfinished transaction is driven forward when it had published
(PUBLISHED, REMOVED), back otherwise (INTENT, ROLLING_BACK). Then reclaim garbage,
remove orphan shard files (a store whose intent commit was lost), quarantine foreign
files into ``lost+found/``, and invalidate ready nodes whose shards are missing or
short. Every step is idempotent, so a crash during recovery is recovered by the next
open.
"""

from __future__ import annotations

import contextlib
import os
import re
import stat
from collections.abc import Callable

import attrs

from prefixstore.base.errors import (
    BackingContradictionError,
    CatalogCorruptError,
    PrefixStoreError,
)
from prefixstore.base.layout import Layout
from prefixstore.engine import journal, structure, tiering
from prefixstore.engine.account import Account
from prefixstore.engine.audit import durable_shards, read_catalog, verify_bytes
from prefixstore.engine.catalog import Catalog
from prefixstore.engine.journal import Ledger
from prefixstore.engine.recency import Recency
from prefixstore.engine.tiering import Tiers
from prefixstore.gpu import shards, tiers, verify
from prefixstore.gpu.ranks import TMP_SUFFIX, rank_dir_name, shard_name
from prefixstore.gpu.tier import Capability, has
from prefixstore.statemachine.transactions import MACHINES

SHARD_RE = re.compile(r"^[0-9a-f]{32}-g[0-9]+\.st(\.tmp)?$")
# File-row problems recovery refuses (the rest are found by verification as damage).
REFUSED_FILE_PROBLEMS = structure.REFUSED_FILE_KINDS


@attrs.define
class RecoveryReport:
    """What recovery did."""

    rolled_back: list[int] = attrs.field(factory=list)
    rolled_forward: list[int] = attrs.field(factory=list)
    garbage_reclaimed: int = 0
    orphans_removed: list[str] = attrs.field(factory=list)
    quarantined: list[str] = attrs.field(factory=list)
    damaged: list[int] = attrs.field(factory=list)
    reattached: list[str] = attrs.field(factory=list)
    resized: list[str] = attrs.field(factory=list)
    regenerated: list[str] = attrs.field(factory=list)
    evicted: int = 0
    """Bytes open evicted (by policy) to fit the capacity and the disk's catalog room."""

    @property
    def changed(self) -> bool:
        return any(attrs.astuple(self))


@attrs.frozen(slots=True, eq=False)
class Recovering:
    """What recovery changes: the catalog (through the ledger, which ends each
    unfinished transaction by its table), the ranks' files, the charged bytes and the
    clock it resets."""

    root: str
    layout: Layout
    catalog: Catalog
    ledger: Ledger
    tiers: Tiers
    account: Account
    recency: Recency


def recover(rc: Recovering) -> RecoveryReport:
    """Recover the cache. A rank that cannot serve now (``tiering.unreachable``) is
    recorded as down (``Tiers.down``): the steps that need its files skip it, its
    unlinks fail as on a failed rank (garbage, charged until reclaimed), and the rest
    of its part waits for ``recover_rank``."""
    rep = RecoveryReport()
    check_structure(rc.catalog, rc.layout, rc.root)
    rc.tiers.down.why.update(tiering.unreachable(rc.tiers.ranks))
    skip = frozenset(rc.tiers.down.why)
    reconcile(rc, rep, skip)
    rc.account.charged = rc.catalog.charged()
    rc.recency.clock = 0
    if rc.account.disk.tight():
        _room_first(rc)
    for row in rc.catalog.journal():
        with rc.catalog.reading() as c:
            txn, step = rc.ledger.driver.recover(c, row)
        journal.end(rc.ledger, txn, step)
        (rep.rolled_forward if step.direction == "forward" else rep.rolled_back).append(txn.id)
    # 'writing' rows whose transaction is gone cannot exist; treat any as garbage.
    with rc.catalog.txn("recover.stray") as c:
        rc.catalog.garbage_stray_writing(c)
    before = rc.account.charged
    garbage = rc.catalog.garbage_files()
    journal.reclaim_rows(rc.ledger, None, garbage)
    rep.garbage_reclaimed = before - rc.account.charged
    _orphans(rc, rep, skip)
    _verify_live(rc, rep, skip)
    return rep


def recover_rank(rc: Recovering, rank: int) -> RecoveryReport:
    """The part of recovery a rank that was down at open missed, now that it serves:
    its listing reconciled with the rows (re-attach, quarantine, sizes), garbage
    reclaimed (its unlinks failed while it was down), its orphans removed, its live
    shards' sizes checked. Idempotent; the caller holds the engine lock."""
    rep = RecoveryReport()
    others = frozenset(range(len(rc.tiers.ranks))) - {rank}
    reconcile(rc, rep, others)
    before = rc.account.charged
    journal.reclaim_rows(rc.ledger, None, rc.catalog.garbage_files())
    rep.garbage_reclaimed = before - rc.account.charged
    _orphans(rc, rep, others)
    _verify_live(rc, rep, others)
    return rep


def _room_first(rc: Recovering) -> None:
    """Unlink, before any commit, the files recovery will unlink anyway: garbage, and
    the files of transactions it rolls back (never a live file)."""
    back = [tid for tid, kind, state, _ in rc.catalog.journal()
            if kind in MACHINES and state in MACHINES[kind].states and MACHINES[kind].direction(state) == "back"]
    rows = rc.catalog.garbage_files()
    for tid in back:
        rows += rc.catalog.unpublished_files_of_txn(tid)
    current = _current_names(rc.catalog.node_generations())
    rows = [r for r in rows if r[1] not in current]
    if rows:
        journal.unlink_rows(rc.ledger, rows)


def _current_names(nodes) -> set[str]:
    """The shard names of the nodes' current generations: never unlinked on a row's word."""
    return {shard_name(bytes(key), gen) for key, gen in nodes if isinstance(key, bytes) and isinstance(gen, int)}


def room_before_open(root: str, ranks: int) -> list[str]:
    """Before the catalog opens on a full disk with no reserve (opening it needs room
    for its log): unlink from the rank directories under ``root`` the files recovery
    unlinks first anyway (see ``_room_first``), found by reading the catalog without
    writing. Only regular files with a shard's name are touched. Returns them."""
    try:
        rows = read_catalog(root, live=False)
    except (OSError, PrefixStoreError):
        return []  # unreadable here: the open that follows reports it
    back = {tid for tid, kind, state, _ in rows.journal
            if kind in MACHINES and state in MACHINES[kind].states and MACHINES[kind].direction(state) == "back"}
    current = _current_names((r[structure.KEY], r[structure.GEN]) for r in rows.nodes.values())
    removed = []
    for rank, name, _node, _gen, _size, _ck, status, txn in rows.files:
        if not (status == "garbage" or (status == "writing" and txn in back)) or name in current:
            continue
        if not (isinstance(rank, int) and 0 <= rank < ranks and isinstance(name, str) and SHARD_RE.match(name)):
            continue
        for entry in (name, name + TMP_SUFFIX):
            path = os.path.join(root, rank_dir_name(rank), entry)
            with contextlib.suppress(OSError):
                if stat.S_ISREG(os.lstat(path).st_mode):
                    os.unlink(path)
                    removed.append(f"{rank_dir_name(rank)}/{entry}")
    return removed


def check_structure(catalog: Catalog, layout: Layout, root: str) -> None:
    """Raise CatalogCorruptError if the catalog's rows contradict each other (or the journal is unreadable)."""
    nodes = catalog.node_rows_by_id()
    files = catalog.file_rows()
    problems = structure.node_problems(nodes) + [
        p for p in structure.file_problems(nodes, files, layout.ranks) if p.kind in REFUSED_FILE_PROBLEMS
    ]
    details = [p.detail for p in problems]
    try:
        journal = catalog.journal()
    except CatalogCorruptError as exc:
        details.append(str(exc))
        journal = []
    for tid, kind, state, _payload in journal:
        if kind not in MACHINES or state not in MACHINES[kind].states:
            details.append(f"journal row {tid}: unknown transaction {kind}/{state}")
    if details:
        shown = "; ".join(details[:5])
        more = f" (and {len(details) - 5} more)" if len(details) > 5 else ""
        raise CatalogCorruptError(
            f"{root}: the catalog contradicts itself: {shown}{more}; nothing was changed. "
            f"Run `prefixstore audit --repair {root}` to fix it."
        )


def check_backing(catalog: Catalog, root: str, ranks: int) -> None:
    """Raise BackingContradictionError when the catalog names a volatile backing (its
    rows would be dropped at open) but shard files it names are on disk, each with its
    recorded size and checksum: a durable cache, not a volatile one."""
    meta = tiering.recorded(catalog)
    if not tiers.recorded_volatile(meta):
        return
    files = catalog.file_rows()
    dirs = [os.path.join(root, rank_dir_name(r)) for r in range(ranks)]
    found = durable_shards(dirs, files)
    if found:
        raise BackingContradictionError(
            f"{root}: the catalog says backing={tiers.recorded(meta)}, but {len(found)} shard files it names are "
            f"on disk with their recorded checksums ({', '.join(found[:3])}{' ...' if len(found) > 3 else ''}); "
            f"nothing was changed. Run `prefixstore audit --repair {root}` to record backing={tiers.DEFAULT}."
        )


def reconcile(rc: Recovering, rep: RecoveryReport, skip: frozenset[int] = frozenset()) -> None:
    """Make the file rows agree with the files a node's name claims (see the module
    docstring); the files of the ranks in ``skip`` (down) are not read."""
    cat = rc.catalog
    nodes = cat.node_rows_by_id()
    files = cat.file_rows()
    fixes: list[tuple[Callable[..., None], tuple]] = []  # (catalog method, its arguments after the cursor)
    for nid, gen in sorted(structure.stale_generations(nodes, files, rc.layout.ranks).items()):
        fixes.append((cat.set_node_generation, (nid, gen)))
        rep.regenerated.append(f"node {nid}: generation {nodes[nid][structure.GEN]} -> {gen}")
        row = list(nodes[nid])
        row[structure.GEN] = gen
        nodes[nid] = tuple(row)
    current = structure.current_shards(nodes)
    for f in files:
        rank, name, size = f[0], f[1], f[4]
        if not 0 <= rank < len(rc.tiers.ranks):
            continue
        owner = current.get(name)
        if owner is not None and structure.misowned(owner, nodes, f):
            fixes.append((cat.attach_file, (rank, name, owner, nodes[owner][structure.GEN])))
            rep.reattached.append(f"rank{rank}/{name} to node {owner}")
        if (not isinstance(size, int) or size < 0) and rank not in skip:
            actual = rc.tiers.ranks[rank].size(name) or 0
            fixes.append((cat.set_file_size, (rank, name, actual)))
            rep.resized.append(f"rank{rank}/{name}: {size!r} -> {actual}")
    known = {(f[0], f[1]) for f in files}
    reattached: set[tuple[int, int]] = set()  # (node, rank)
    for f in files:
        owner = current.get(f[1])
        if owner is not None and structure.misowned(owner, nodes, f):
            reattached.add((owner, f[0]))
    for rank in rc.tiers.ranks:
        if has(rank, Capability.VOLATILE) or rank.rank in skip:
            continue
        for entry in rank.listdir():
            owner = current.get(entry)
            if owner is None or (rank.rank, entry) in known:
                continue
            found = _shard_of(rc.layout, rank, entry, nodes[owner])
            if found is None:
                rank.quarantine(entry)
                rep.quarantined.append(f"rank{rank.rank}/{entry}")
                continue
            fixes.append((cat.insert_live_file, (rank.rank, entry, owner, nodes[owner][structure.GEN], *found)))
            rep.reattached.append(f"rank{rank.rank}/{entry} to node {owner} (it had no row)")
            reattached.add((owner, rank.rank))
    for rank, name, node, *_rest in files:
        # a live row the re-attached shard displaces names no current shard: garbage
        if (node, rank) in reattached and name not in current:
            fixes.append((cat.garbage_file, (rank, name)))
    if fixes:
        with cat.txn("recover.reconcile") as c:
            for fix, args in fixes:
                fix(c, *args)


def _shard_of(layout: Layout, rank, entry: str, row: tuple) -> tuple[int, str] | None:
    """(size, checksum) of ``entry`` when it is a regular file whose bytes verify as node
    ``row``'s shard on ``rank`` (header: key, generation, span, rank; the layout), else None."""
    try:
        if has(rank, Capability.LOCAL_FILES) and not rank.is_file(entry):
            return None
        data = rank.read_shard(entry)
    except OSError:
        return None
    ck = shards.checksum(data)
    return (len(data), ck) if verify_bytes(layout, data, rank.rank, row, ck) is None else None


def _orphans(rc: Recovering, rep: RecoveryReport, skip: frozenset[int]) -> None:
    known: dict[int, set[str]] = {}
    for r, name in rc.catalog.file_names():
        known.setdefault(r, set()).add(name)
    for rank in rc.tiers.ranks:
        if rank.rank in skip:
            continue
        mine = known.get(rank.rank, set())
        removed = False
        for entry in rank.listdir():
            if entry in mine:
                continue
            if has(rank, Capability.LOCAL_FILES) and not rank.is_file(entry):
                # a directory, link or device named like anything: never unlink, move it aside
                rank.quarantine(entry)
                rep.quarantined.append(f"rank{rank.rank}/{entry}")
            elif SHARD_RE.match(entry):
                base = entry.removesuffix(".tmp")
                if base in mine:
                    # a leftover temporary of a known file: remove just the temporary
                    rank.remove_temp(base)
                else:
                    rank.remove(base)
                rep.orphans_removed.append(f"rank{rank.rank}/{entry}")
                removed = True
            else:
                rank.quarantine(entry)
                rep.quarantined.append(f"rank{rank.rank}/{entry}")
        if removed:
            rank.sync_dir()


def _verify_live(rc: Recovering, rep: RecoveryReport, skip: frozenset[int]) -> None:
    ranks = rc.layout.ranks
    per_node: dict[int, list[tuple[int, str, int, str]]] = {}
    for node, r, name, size, ck in rc.catalog.all_live_files():
        per_node.setdefault(node, []).append((r, name, size, ck))
    bad, resized = [], []
    for nid in rc.catalog.ready_node_ids():
        files = per_node.get(nid, [])
        ok = len(files) == ranks and {f[0] for f in files} == set(range(ranks))
        if ok:
            for r, name, size, ck in files:
                if r in skip:
                    continue  # a down rank's shards are checked once it is back
                actual = rc.tiers.ranks[r].size(name)
                if actual == size:
                    continue
                if actual is not None and _matches(rc.tiers.ranks[r], name, actual, ck):
                    resized.append((actual, r, name))  # the row's size is wrong, not the file
                    rep.resized.append(f"rank{r}/{name}: {size!r} -> {actual} (the file matches its checksum)")
                    continue
                ok = False
                break
        if not ok:
            bad.append(nid)
    if bad or resized:
        with rc.catalog.txn("recover.invalidate") as c:
            rc.catalog.mark_nodes_damaged(c, bad)
            rc.catalog.set_file_sizes(c, resized)
        rep.damaged.extend(bad)


def _matches(rank, name: str, size: int, ck: str | None) -> bool:
    """Whether ``name`` on ``rank`` reads as ``size`` bytes with checksum ``ck``."""
    return ck is not None and isinstance(verify.read(rank, name, size, ck), verify.Shard)
