"""Recovery on open: drive every unfinished transaction to an end state.

First, before changing anything, the catalog's rows are checked against each other
(``prefixstore.engine.structure``): a catalog that contradicts itself (a tampered
parent, key or digests, a file row naming a path or an unknown rank, a live file of
a missing node) is refused with CatalogCorruptError, so no such row is ever indexed,
served or used to unlink a file; ``prefixstore audit --repair`` fixes it.

On a full disk with no catalog reserve left to release (``gpu/diskroom.py``), the
files that no committed record needs (garbage, the new files of transactions that
roll back) are unlinked first, so the commits below have room; their rows then find
the files gone, which is success.

Then every unfinished transaction is driven forward when it had published
(PUBLISHED, REMOVED), back otherwise (INTENT, ROLLING_BACK). Then reclaim garbage, remove orphan shard files (a store whose intent
commit was lost), quarantine foreign files into ``lost+found/``, and invalidate
ready nodes whose shards are missing or short. Every step is idempotent, so a crash
during recovery is recovered by the next open.
"""

from __future__ import annotations

import contextlib
import os
import re
import stat
from typing import TYPE_CHECKING

import attrs

from prefixstore.engine import structure
from prefixstore.engine.audit import read_catalog
from prefixstore.engine.errors import CatalogCorruptError, PrefixStoreError
from prefixstore.gpu.ranks import TMP_SUFFIX, rank_dir_name, shard_name
from prefixstore.statemachine.transactions import MACHINES, recovery_direction

if TYPE_CHECKING:
    from prefixstore.engine.core import Engine

SHARD_RE = re.compile(r"^[0-9a-f]{32}-g[0-9]+\.st(\.tmp)?$")
# File-row problems recovery refuses (the rest are found by verification as damage).
REFUSED_FILE_PROBLEMS = frozenset({"bad_name", "bad_rank", "live_orphan"})


@attrs.define
class RecoveryReport:
    """What recovery did."""

    rolled_back: list[int] = attrs.field(factory=list)
    rolled_forward: list[int] = attrs.field(factory=list)
    garbage_reclaimed: int = 0
    orphans_removed: list[str] = attrs.field(factory=list)
    quarantined: list[str] = attrs.field(factory=list)
    damaged: list[int] = attrs.field(factory=list)
    evicted: int = 0
    """Bytes open evicted (by policy) to fit the capacity and the disk's catalog room."""

    @property
    def changed(self) -> bool:
        return any(attrs.astuple(self))


def recover(eng: Engine) -> RecoveryReport:
    rep = RecoveryReport()
    check_structure(eng)
    eng._charged = eng.catalog.charged()
    eng._clock = 0
    if eng.disk.tight():
        _room_first(eng)
    for tid, kind, state, _payload in eng.catalog.journal():
        if kind not in MACHINES or state not in MACHINES[kind].states:
            raise CatalogCorruptError(f"journal row {tid}: unknown transaction {kind}/{state}")
        rows = eng.catalog.query("SELECT rank, name, size FROM files WHERE txn=?", (tid,))
        if recovery_direction(kind, state) == "forward":
            eng._finish_retire(tid, kind, rows)
            rep.rolled_forward.append(tid)
        else:
            eng._rollback(tid, kind, state, "recover")
            rep.rolled_back.append(tid)
    # 'writing' rows whose transaction is gone cannot exist; treat any as garbage.
    with eng.catalog.txn("recover.stray") as c:
        c.execute("UPDATE files SET status='garbage', txn=NULL WHERE status='writing'")
    before = eng._charged
    garbage = eng.catalog.query("SELECT rank, name, size FROM files WHERE status='garbage'")
    eng._reclaim_rows(None, garbage)
    rep.garbage_reclaimed = before - eng._charged
    _orphans(eng, rep)
    _verify_live(eng, rep)
    return rep


def _room_first(eng: Engine) -> None:
    """Unlink, before any commit, the files recovery will unlink anyway: garbage, and
    the files of transactions it rolls back (never a live file)."""
    back = [tid for tid, kind, state, _ in eng.catalog.journal()
            if kind in MACHINES and state in MACHINES[kind].states and recovery_direction(kind, state) == "back"]
    rows = eng.catalog.query("SELECT rank, name, size FROM files WHERE status='garbage'")
    for tid in back:
        rows += eng.catalog.query(
            "SELECT rank, name, size FROM files WHERE txn=? AND status!='live'", (tid,))
    current = _current_names(eng.catalog.query("SELECT key, generation FROM nodes"))
    rows = [r for r in rows if r[1] not in current]
    if rows:
        eng._unlink_rows(rows)


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
            if kind in MACHINES and state in MACHINES[kind].states and recovery_direction(kind, state) == "back"}
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


def check_structure(eng: Engine) -> None:
    """Raise CatalogCorruptError if the catalog's rows contradict each other (or the journal is unreadable)."""
    nodes = {r[0]: tuple(r) for r in eng.catalog.query(f"SELECT {structure.NODE_COLUMNS} FROM nodes")}
    files = eng.catalog.query(f"SELECT {structure.FILE_COLUMNS} FROM files")
    problems = structure.node_problems(nodes) + [
        p for p in structure.file_problems(nodes, files, eng.layout.ranks) if p.kind in REFUSED_FILE_PROBLEMS
    ]
    details = [p.detail for p in problems]
    try:
        journal = eng.catalog.journal()
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
            f"{eng.root}: the catalog contradicts itself: {shown}{more}; nothing was changed. "
            f"Run `prefixstore audit --repair {eng.root}` to fix it."
        )


def _orphans(eng: Engine, rep: RecoveryReport) -> None:
    known: dict[int, set[str]] = {}
    for r, name in eng.catalog.query("SELECT rank, name FROM files"):
        known.setdefault(r, set()).add(name)
    for rank in eng.ranks:
        mine = known.get(rank.rank, set())
        removed = False
        for entry in rank.listdir():
            if entry in mine:
                continue
            is_file = getattr(rank, "is_file", None)
            if is_file is not None and not is_file(entry):
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


def _verify_live(eng: Engine, rep: RecoveryReport) -> None:
    ranks = eng.layout.ranks
    per_node: dict[int, list[tuple[int, str, int]]] = {}
    for node, r, name, size in eng.catalog.query(
        "SELECT node, rank, name, size FROM files WHERE status='live'"
    ):
        per_node.setdefault(node, []).append((r, name, size))
    bad = []
    for (nid,) in eng.catalog.query("SELECT id FROM nodes WHERE state='ready'"):
        files = per_node.get(nid, [])
        ok = len(files) == ranks and {r for r, _, _ in files} == set(range(ranks))
        if ok:
            for r, name, size in files:
                if eng.ranks[r].size(name) != size:
                    ok = False
                    break
        if not ok:
            bad.append(nid)
    if bad:
        with eng.catalog.txn("recover.invalidate") as c:
            c.executemany("UPDATE nodes SET state='damaged' WHERE id=?", [(i,) for i in bad])
        rep.damaged.extend(bad)
