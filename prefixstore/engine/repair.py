"""Repair a cache directory: make the audit clean without losing an intact node.

Steps (each idempotent; a crash anywhere is repaired by running it again):

1. Catalog rows that contradict each other (``prefixstore.engine.structure``), in one
   catalog commit taken under the directory lock: a node whose parent link is wrong
   is relinked to the one node its blocks chain from, when exactly one does; a node
   that cannot be placed (wrong key or digests, a block claimed twice, no matching
   parent) is removed with everything below it (their shards cannot be proven to
   belong to any prefix), its files becoming garbage; file rows naming a path or an
   unknown rank are forgotten (never unlinked: their names are not trusted); a live
   file of a missing node, or not its node's current generation, becomes garbage
   (its node, if any, damaged). A row naming a node's current shard is left to
   recovery, which re-attaches it to that node. A catalog that names a volatile
   backing while shards it names are on disk with their recorded checksums records
   the default durable backing (its rows would otherwise be dropped as volatile).
2. Engine.open, with the layout and capacity the catalog records: recovery rolls
   unfinished transactions back or forward, reclaims garbage, removes orphan shards,
   moves foreign files to ``lost+found/`` and marks nodes with missing or short
   shards damaged.
3. Every ready node's shards are read and verified (checksum, header, layout); a
   node that fails is invalidated (marked damaged, descendants keep their links).
4. Garbage left by failed unlinks is reclaimed; if charged bytes exceed the
   capacity (a lowered capacity), the policy evicts the excess.

Then the engine's own audit is the result.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import sqlite3
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import attrs

from prefixstore.base.errors import (
    CatalogIOError,
    CatalogLostError,
    ForeignSchemaError,
    LockedError,
    NotACacheError,
    NotRegularFileError,
    PrefixStoreError,
    RankDirMissingError,
    RankUnavailableError,
    SimulatedCrash,
)
from prefixstore.base.keys import ROOT
from prefixstore.base.layout import Layout
from prefixstore.engine import dirlock, health, lifecycle, rebuild, schema
from prefixstore.engine import structure as S
from prefixstore.engine.api import Engine
from prefixstore.engine.audit import (
    AuditReport,
    durable_shards,
    engine_running,
    read_catalog,
    verify_bytes,
)
from prefixstore.engine.cachedirs import check_own_dirs, missing_rank_dirs
from prefixstore.engine.catalog import Catalog, catalog_path
from prefixstore.engine.driver import Journal
from prefixstore.engine.guard import CallGuard
from prefixstore.engine.health import Health
from prefixstore.engine.index import Index
from prefixstore.engine.restore import Reader
from prefixstore.gpu import tiers
from prefixstore.gpu.diskroom import DiskRoom
from prefixstore.gpu.ranks import LocalRank, rank_dir_name
from prefixstore.statemachine.transactions import MACHINES

if TYPE_CHECKING:
    from prefixstore.engine.recovery import RecoveryReport
    from prefixstore.gpu.fileio import FaultHook, FileSystem


@attrs.define
class CatalogFix:
    """What step 1 changes (pure plan over the rows)."""

    relink: dict[int, int | None] = attrs.field(factory=dict)
    drop_nodes: list[int] = attrs.field(factory=list)
    forget_files: list[tuple[int, str]] = attrs.field(factory=list)
    garbage_files: list[tuple[int, str]] = attrs.field(factory=list)
    damage_nodes: list[int] = attrs.field(factory=list)
    drop_journal: list[int] = attrs.field(factory=list)
    backing: str | None = None
    """The backing to record (the recorded one contradicts the files), or None."""
    backing_was: str | None = None
    """The volatile backing the catalog named instead."""

    @property
    def empty(self) -> bool:
        return not any(attrs.astuple(self))


@attrs.define
class RepairReport:
    """What repair changed."""

    catalog: CatalogFix = attrs.field(factory=CatalogFix)
    schema: schema.SchemaFix | None = None
    """Step 0: the schema objects dropped or restored."""
    rebuilt: rebuild.RebuildReport | None = None
    """The catalog rebuilt from the shards' headers (it was lost, or ``--rebuild``)."""
    recovery: RecoveryReport | None = None
    invalidated: list[tuple[int, str]] = attrs.field(factory=list)
    unreadable: list[str] = attrs.field(factory=list)
    reclaimed: int = 0
    evicted: int = 0

    @property
    def changed(self) -> bool:
        rec = self.recovery is not None and (
            self.recovery.rolled_back or self.recovery.rolled_forward or self.recovery.garbage_reclaimed
            or self.recovery.orphans_removed or self.recovery.quarantined or self.recovery.damaged
            or self.recovery.reattached or self.recovery.resized or self.recovery.regenerated
            or self.recovery.evicted
        )
        rebuilt = self.rebuilt is not None or (self.schema is not None and not self.schema.empty)
        return bool(not self.catalog.empty or rec or self.invalidated or self.reclaimed or self.evicted or rebuilt)

    def lines(self) -> list[str]:
        """Human-readable list of every change."""
        out = self.rebuilt.lines() if self.rebuilt is not None else []
        if self.schema is not None:
            out += self.schema.lines()
        c = self.catalog
        for nid, parent in sorted(c.relink.items()):
            out.append(f"relinked node {nid} to parent {'(root)' if parent is None else parent}")
        if c.drop_nodes:
            out.append(f"removed {len(c.drop_nodes)} nodes that cannot be placed in a prefix: {c.drop_nodes}")
        for r, name in c.forget_files:
            out.append(f"forgot file row rank{r}/{name!r} (not a shard of this layout)")
        for r, name in c.garbage_files:
            out.append(f"turned file rank{r}/{name} into garbage (no node owns it)")
        for nid in c.damage_nodes:
            out.append(f"marked node {nid} damaged (its file rows were wrong)")
        for tid in c.drop_journal:
            out.append(f"dropped unreadable journal row {tid} (its 'writing' files became garbage)")
        if c.backing is not None:
            out.append(f"recorded backing={c.backing} (the catalog said {c.backing_was}, but its shards are on disk)")
        rec = self.recovery
        if rec is not None:
            for f in rec.reattached:
                out.append(f"re-attached file {f} (its row contradicted the shard's name)")
            for f in rec.resized:
                out.append(f"took the size of file {f} from the file")
            for f in rec.regenerated:
                out.append(f"recorded the generation of its live shards for {f}")
            if rec.rolled_back:
                out.append(f"rolled back unfinished transactions {rec.rolled_back}")
            if rec.rolled_forward:
                out.append(f"rolled forward unfinished transactions {rec.rolled_forward}")
            if rec.garbage_reclaimed:
                out.append(f"reclaimed {rec.garbage_reclaimed} bytes of garbage")
            for o in rec.orphans_removed:
                out.append(f"removed orphan shard {o}")
            for q in rec.quarantined:
                out.append(f"moved foreign entry {q} to lost+found/")
            for nid in rec.damaged:
                out.append(f"marked node {nid} damaged (a shard missing or of the wrong size)")
            if rec.evicted:
                out.append(f"evicted {rec.evicted} bytes to fit the capacity and the disk's room for the catalog")
        for nid, why in self.invalidated:
            out.append(f"marked node {nid} damaged ({why})")
        for u in self.unreadable:
            out.append(f"could not read {u} (left as it is)")
        if self.reclaimed:
            out.append(f"reclaimed {self.reclaimed} bytes of garbage left by failed unlinks")
        if self.evicted:
            out.append(f"evicted {self.evicted} bytes to get back under capacity")
        return out

    def to_dict(self) -> dict[str, Any]:
        return {"changed": self.changed, "changes": self.lines()}


def plan_catalog_fix(
    nodes: dict[int, tuple],
    files: Sequence[tuple],
    journal: Sequence[tuple],
    ranks: int,
    present: frozenset[tuple[int, str]] = frozenset(),
) -> CatalogFix:
    """Decide step 1 from the rows (pure); ``present``: the (rank, name) entries of the rank directories.

    A live row that is not its node's current shard is left to recovery when the
    current shard's file is present on that rank (recovery re-attaches that file and
    turns the row into garbage); otherwise it becomes garbage and its node damaged.

    A journal row recovery cannot read (unknown kind or state, corrupt payload) is
    dropped and its files released: a store publishes in one commit (its files turn
    'live'), so the files' own status tells what happened whatever the journal said:
    'writing' files become garbage (rolled back), retired ones are garbage already.
    """
    fix = CatalogFix()
    nodes = dict(nodes)
    dropped: set[int] = set()
    for _ in range(len(nodes) + 1):
        problems = S.node_problems(nodes)
        if not problems:
            break
        progressed = False
        for p in problems:
            if p.node is None or p.node not in nodes:
                continue
            parent = _relink_target(nodes, p.node, len(problems))
            if parent is not _NONE:
                row = list(nodes[p.node])
                row[S.PARENT] = parent
                nodes[p.node] = tuple(row)
                fix.relink[p.node] = parent
                progressed = True
                break
        if not progressed:
            for nid in S.subtree(nodes, [p.node for p in problems if p.node in nodes]):
                dropped.add(nid)
                fix.relink.pop(nid, None)
            nodes = {k: v for k, v in nodes.items() if k not in dropped}
    fix.drop_nodes = sorted(dropped)
    owner = {(f[0], f[1]): f[2] for f in files}
    for tid, kind, state, payload in journal:
        if kind not in MACHINES or state not in MACHINES[kind].states or not _is_json_object(payload):
            fix.drop_journal.append(tid)
    stale = S.stale_generations(nodes, files, ranks)
    current = {nid: name for name, nid in S.current_shards(nodes).items()}
    for p in S.file_problems(nodes, files, ranks):
        if p.kind == "misowned" or (p.kind == "live_name" and p.node in stale):
            continue  # recovery re-attaches it / records the generation its shards have
        if p.kind == "live_name" and p.file and (p.file[0], current.get(p.node)) in present:
            continue  # recovery re-attaches the current shard's file, this row becomes garbage
        if p.kind in ("bad_name", "bad_rank"):
            fix.forget_files.append(p.file)
        elif p.kind == "live_orphan" and owner.get(p.file) in dropped:
            continue  # becomes garbage with its node
        else:
            fix.garbage_files.append(p.file)
            if p.node is not None and p.node not in fix.damage_nodes:
                fix.damage_nodes.append(p.node)
    return fix


_NONE = object()


def _is_json_object(text: str) -> bool:
    try:
        return isinstance(json.loads(text), dict)
    except (TypeError, ValueError):
        return False


def _relink_target(nodes: dict[int, tuple], nid: int, before: int) -> Any:
    """The one parent (id, or None for the root) that makes ``nid`` consistent, else _NONE."""
    row = nodes[nid]
    below = set(S.subtree(nodes, [nid]))
    cands: list[int | None] = [None] if row[S.START] == 0 else []
    cands += [k for k, r in nodes.items() if r[S.END] == row[S.START] and k not in below]
    fits = []
    for c in cands:
        if c == row[S.PARENT]:
            continue
        pkey = ROOT if c is None else bytes(nodes[c][S.KEY])
        chain = S.node_chain(row, pkey)
        if chain is None or chain[-1] != bytes(row[S.KEY]):
            continue
        trial = dict(nodes)
        r2 = list(row)
        r2[S.PARENT] = c
        trial[nid] = tuple(r2)
        if len(S.node_problems(trial)) < before and all(p.node != nid for p in S.node_problems(trial)):
            fits.append(c)
    return fits[0] if len(fits) == 1 else _NONE


def apply_catalog_fix(root: str, fix: CatalogFix, hook: FaultHook | None = None) -> None:
    """Commit ``fix`` in one catalog transaction (the caller holds the directory lock)."""
    cat = Catalog(root, hook=hook, create=False, before_write=DiskRoom(root).before_catalog_write)
    try:
        with cat.txn("repair.catalog") as c:
            for nid, parent in fix.relink.items():
                cat.set_parent(c, nid, parent)
            for r, name in fix.forget_files:
                cat.forget_file(c, r, name)
            for r, name in fix.garbage_files:
                cat.garbage_file(c, r, name)
            if fix.drop_nodes:
                cat.drop_nodes(c, fix.drop_nodes)
            for nid in fix.damage_nodes:
                cat.damage_node(c, nid)
            for tid in fix.drop_journal:
                cat.release_txn_files(c, tid)
                Journal().delete(c, tid)
            if fix.backing is not None:
                cat.set_meta(c, tiers.META_KEY, fix.backing)
                cat.set_meta(c, tiers.VOLATILE_KEY, "0")
    finally:
        cat.close()


def repair(
    root: str,
    *,
    rank_dirs: Sequence[str] | None = None,
    hook: FaultHook | None = None,
    fs: FileSystem | None = None,
    rebuild_catalog: bool = False,
    capacity: int | None = None,
    ranks: Sequence[Any] | None = None,
) -> tuple[RepairReport, AuditReport]:
    """Repair the cache at ``root`` (no engine may hold it); return what changed and the audit.

    ``ranks``: the ranks as ``RankIO`` objects instead of directories (rank servers,
    ``gpu/distributed.RemoteRank``, each connected): every listing, read, unlink,
    quarantine and directory fsync the repair decides is asked of them, none is done
    here, a catalog rebuilt from the shards' headers included. A rank that cannot serve
    refuses the repair (RankUnavailableError, before anything is written).

    A catalog that is missing, empty or never initialized beside the cache's files
    (``engine/trust.py``) is rebuilt from the shards' own headers (``engine/rebuild.py``);
    so is any catalog with ``rebuild_catalog`` (the old one is moved to ``lost+found/``).
    ``capacity``: the capacity to record (default: the catalog's; for a rebuilt catalog
    without one, the bytes of the shards it adopted).

    Raises LockedError while an engine holds the directory, NotACacheError /
    SchemaVersionError when it cannot be read, UnsafeDirectoryError when a cache's own
    directory is a symlink, RankDirMissingError when a rank directory holding shards is
    not there (kept elsewhere: pass ``rank_dirs``), ForeignSchemaError when a schema
    object the engine did not create cannot be dropped without losing rows (an engine
    table replaced: ``rebuild_catalog`` rebuilds it); nothing is changed then.
    """
    if engine_running(root):
        raise LockedError(f"{root} is open in an engine; stop it before repairing")
    rep = RepairReport()
    lost = _lost(root)
    if ranks is not None:
        _check_remote(ranks)
    if lost is not None or rebuild_catalog:
        layout, recorded = _rebuild(root, rep, lost or "asked for with --rebuild", rank_dirs, capacity, hook, fs,
                                    ranks)
    else:
        layout, recorded = _fix_catalog(root, rep, rank_dirs, hook, ranks)
    if ranks is None and rank_dirs:
        ranks = [LocalRank(r, d, fs, hook) for r, d in enumerate(rank_dirs)]
    opts: dict[str, Any] = {"create": False, "ranks": ranks, "read_only_fallback": False}  # repair writes
    if hook is not None:
        opts["hook"] = hook
    if fs is not None:
        opts["fs"] = fs
    eng = Engine.open(root, layout, recorded if capacity is None else capacity, **opts)
    try:
        if eng.degraded is not None:  # a rank stopped serving since the check above
            raise RankUnavailableError(errno.EHOSTDOWN, f"{root}: cannot repair without ranks "
                                       f"{list(eng.degraded.ranks)}: {dict(eng.degraded.why)}")
        rep.recovery = eng.recovery_report
        f = eng.flows
        _invalidate_bad_shards(eng.guard, eng.index, eng.catalog, f.reader, f.health, rep)
        rep.reclaimed = eng.reclaim()
        with eng.guard.lock:
            over = eng.account.charged - eng.account.capacity
        if over > 0:
            rep.evicted = eng.evict(over)
        final = eng.audit()
    except SimulatedCrash:
        lifecycle.abandon(eng.life)  # model process death: nothing more is committed
        raise
    finally:
        eng.close()
    return rep, final


def _recorded(rows, root: str) -> tuple[Layout, int]:
    """The layout and capacity the catalog records (NotACacheError without them)."""
    try:
        return Layout.from_json(rows.meta.get("layout", "")), int(rows.meta["capacity"])
    except (KeyError, ValueError) as exc:
        raise NotACacheError(f"{root}: catalog records no usable layout or capacity: {exc}") from exc


def _lost(root: str) -> str | None:
    """Why the catalog holds no cache while the directory does (None when it holds one,
    or is readable enough for the other steps to say what is wrong)."""
    try:
        read_catalog(root, live=False)
    except CatalogLostError as exc:
        return exc.state or str(exc)
    except PrefixStoreError:
        return None
    return None


def _check_remote(ranks: Sequence[Any]) -> None:
    """Before anything is written, for a repair through rank objects: refuse a rank
    that does not list its files (RankUnavailableError)."""
    for rk in ranks:
        rk.listdir()


def _fix_catalog(root: str, rep: RepairReport, rank_dirs: Sequence[str] | None,
                 hook: FaultHook | None, ranks: Sequence[Any] | None = None) -> tuple[Layout, int]:
    """Steps 0 and 1 (the schema, then contradictory rows) under the directory lock;
    the layout and capacity the catalog records. ``ranks``: rank objects read in place
    of the directories."""
    rows = read_catalog(root, live=False)
    layout, capacity = _recorded(rows, root)
    volatile = tiers.recorded_volatile(rows.meta)  # its rows describe RAM, not the directories
    if ranks is None:
        check_rank_dirs(root, layout.ranks, rank_dirs, () if volatile else rows.files)  # before any byte is written
    else:
        check_own_dirs(root, 0)
    held = dirlock.acquire(root, "is open in an engine; stop it before repairing")
    try:
        # again, now that no engine can start (read as without one: a read-only
        # connection would need room for a new -shm index on a full disk)
        rows = read_catalog(root, live=False)
        if rows.schema:
            rep.schema = fix_schema(root)
            rows = read_catalog(root, live=False)
        dirs: list[Any] = (list(ranks) if ranks is not None else list(rank_dirs) if rank_dirs
                           else [os.path.join(root, rank_dir_name(r)) for r in range(layout.ranks)])
        rep.catalog = plan_catalog_fix(rows.nodes, rows.files, rows.journal, layout.ranks, _entries(dirs))
        if tiers.recorded_volatile(rows.meta) and durable_shards(dirs, rows.files):
            rep.catalog.backing, rep.catalog.backing_was = tiers.DEFAULT, tiers.recorded(rows.meta)
        if not rep.catalog.empty:
            apply_catalog_fix(root, rep.catalog, hook)
    finally:
        held.release()
    return layout, capacity


def fix_schema(root: str) -> schema.SchemaFix:
    """Step 0: drop the schema objects the engine did not create and restore its own
    (``schema.plan_fix``); ForeignSchemaError, nothing changed, when that would lose rows."""
    conn = sqlite3.connect(catalog_path(root), isolation_level=None, timeout=30)
    try:
        conn.execute("PRAGMA trusted_schema=OFF")
        fix = schema.plan_fix(conn)
        if fix.unfixable:
            raise ForeignSchemaError(
                f"{root}: the catalog's schema cannot be restored without losing rows: "
                f"{'; '.join(fix.unfixable)}; nothing was changed. `prefixstore audit --repair "
                f"--rebuild {root}` rebuilds the catalog from the shards' own headers (the old catalog "
                "is kept in lost+found/)"
            )
        if not fix.empty:
            DiskRoom(root).before_catalog_write()
            try:
                schema.apply_fix(conn, fix)
            except schema.SchemaFixError as exc:
                raise ForeignSchemaError(f"{root}: the catalog's schema cannot be restored without losing "
                                         f"rows ({exc}); nothing was changed. `prefixstore audit --repair "
                                         f"--rebuild {root}` rebuilds it from the shards' headers") from exc
        return fix
    except sqlite3.Error as exc:
        raise CatalogIOError(f"{root}: cannot check the catalog's schema: {exc}") from exc
    finally:
        conn.close()


def _rebuild(root: str, rep: RepairReport, why: str, rank_dirs: Sequence[str] | None, capacity: int | None,
             hook: FaultHook | None, fs: FileSystem | None, ranks: Sequence[Any] | None) -> tuple[Layout, int]:
    """Rebuild the catalog from the shards' headers under the directory lock (what a
    readable old catalog records is kept: its layout and capacity)."""
    held = dirlock.acquire(root, "is open in an engine; stop it before repairing")
    try:
        layout = old_capacity = None
        with contextlib.suppress(PrefixStoreError, OSError):
            layout, old_capacity = _recorded(read_catalog(root, live=False), root)
        rep.rebuilt = rebuild.rebuild(root, why, rank_dirs=rank_dirs, layout=layout,
                                      capacity=capacity if capacity is not None else old_capacity,
                                      hook=hook, fs=fs, ranks=ranks)
    finally:
        held.release()
    return Layout.from_json(rep.rebuilt.layout), rep.rebuilt.capacity


def check_rank_dirs(root: str, ranks: int, rank_dirs: Sequence[str] | None, files: Sequence[tuple]) -> None:
    """Refuse (nothing changed) when the cache's own directories are unsafe, or when a
    rank directory is missing while the catalog records shards on its rank: repairing
    then would mark every such node damaged although its shards may be intact elsewhere."""
    check_own_dirs(root, 0 if rank_dirs else ranks)
    dirs = list(rank_dirs) if rank_dirs else [os.path.join(root, rank_dir_name(r)) for r in range(ranks)]
    missing = missing_rank_dirs(dirs, files)
    if missing:
        shown = ", ".join(f"{d} ({n} shards of rank {r})" for r, d, n in missing)
        raise RankDirMissingError(
            f"{root}: rank directories missing: {shown}; if the ranks are kept elsewhere, "
            "name every rank directory with --rank-dir PATH (once per rank, in order); nothing was changed"
        )


def _entries(dirs: Sequence[Any]) -> frozenset[tuple[int, str]]:
    """(rank, name) of every entry in the rank directories, or of rank objects (their
    ``listdir``); a missing directory holds none."""
    out = set()
    for r, d in enumerate(dirs):
        try:
            out.update((r, e) for e in (os.listdir(d) if isinstance(d, str) else d.listdir()))
        except OSError:
            continue
    return frozenset(out)


def _invalidate_bad_shards(guard: CallGuard, index: Index, catalog: Catalog, rd: Reader, h: Health,
                           rep: RepairReport) -> None:
    """Step 3: read and verify every ready node's shards; invalidate a node that fails."""
    with guard.lock:
        nodes = [n for n in index if n.ready]
        files: dict[int, list[tuple[int, str, str]]] = {}
        for nid, r, name, _size, ck in catalog.all_live_files():
            files.setdefault(nid, []).append((r, name, ck))
    for node in sorted(nodes, key=lambda n: n.id):
        row = (node.id, node.key, node.parent, node.start, node.end, node.digests, node.has_snapshot,
               node.state, node.generation)
        why = None
        for r, name, ck in sorted(files.get(node.id, [])):
            try:
                data = rd.tiers.ranks[r].read_shard(name)
            except FileNotFoundError:
                why = f"rank {r}: shard missing"
            except NotRegularFileError as exc:
                why = f"rank {r}: shard {exc.strerror}"
            except OSError as exc:
                rep.unreadable.append(f"node {node.id} rank {r} ({name}): {exc}")
                break
            else:
                why = verify_bytes(rd.layout, data, r, row, ck)
                if why is not None:
                    why = f"rank {r}: {why}"
            if why is not None:
                break
        if why is not None:
            with guard.lock:
                health.invalidate(h, node, why)
            rep.invalidated.append((node.id, why))
