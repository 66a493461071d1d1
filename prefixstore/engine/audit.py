"""The auditor: checks DESIGN.md section 4's invariants without changing a byte.

``audit_dir`` reads the catalog and every rank directory and reports, per invariant,
what it checked and what it found, the journal's unfinished transactions with what
recovery would do with each, what else recovery would change (garbage, orphans,
foreign files, nodes it would mark damaged), and the accounting. ``audit_engine``
adds the checks only a live engine can answer (its in-memory accounting and index
against the catalog, pins and fences).

How the catalog is read (``read_catalog``) so that nothing changes:

- an engine holds the directory (its ``LOCK`` is flock'ed): a ``mode=ro`` connection
  beside it, as any WAL reader (the engine keeps the ``-wal``/``-shm`` files; the
  reader only takes read marks in the shared-memory index, as every reader does);
- no engine and no write-ahead log: the catalog is opened ``immutable=1`` (SQLite
  creates no ``-wal``/``-shm`` file and takes no lock);
- no engine but a write-ahead log left by a crash: the catalog and its log are copied
  to a private temporary directory and read there (a read-only connection on the
  original would create or rewrite its ``-shm`` index).

Shards are read with ``O_NOATIME`` where the OS allows it. Invariants checked here:

1. every ready node has a regular live file on every rank, named after its key and
   generation, whose size, checksum and safetensors header match the catalog;
2. ancestry is whole (see ``prefixstore.engine.structure``);
3. accounting: charged == sum of owned file sizes; no unknown file in a rank
   directory; no garbage file larger than charged; charged <= capacity;
4. (with ``expected``) every acknowledged checkpoint is ready or damaged;
5. covered by 1: a shard that passes its checksum and its header check (own key,
   generation, span, rank; the layout's names, dtypes and shapes) can only restore
   to the bytes stored;
6. (live engine) every pinned or fenced node is still in the index;
7. the journal holds no unfinished transaction (a violation when ``quiescent``);
8. no ready node depends on an evicted segment (every ancestor has its backing).

Beside a running engine the catalog is one read transaction (a snapshot), and the
rank directories are scanned after it, while the engine keeps working. Its
unfinished journal rows are transactions in flight, not violations. What the scan
finds against the snapshot (an entry the snapshot does not know, a ready node's
shard missing, short or unreadable) is re-checked against a second catalog read
taken after the scan: an entry the second read knows, or that is gone by then, is
newer than the snapshot; a shard whose node was evicted, replaced or marked damaged
in between was retired by the engine. Only what survives the re-check is reported.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import shutil
import sqlite3
import stat
import tempfile
from collections.abc import Callable, Iterable, Sequence
from typing import Any
from urllib.parse import quote

import attrs

from prefixstore.base.errors import (
    LayoutError,
    NotACacheError,
    NotRegularFileError,
    RankUnavailableError,
    SchemaVersionError,
)
from prefixstore.base.layout import Layout
from prefixstore.engine import dirlock, schema, tiering, trust
from prefixstore.engine import structure as S
from prefixstore.engine.account import Account
from prefixstore.engine.cachedirs import own_dir_problems
from prefixstore.engine.catalog import (
    CATALOG_NAME,
    FORMAT_MARKER,
    SCHEMA_VERSION,
    Catalog,
    CatalogView,
    catalog_path,
)
from prefixstore.engine.holds import Holds
from prefixstore.engine.index import Index
from prefixstore.engine.readonly import Mode
from prefixstore.engine.schema import SchemaProblem
from prefixstore.engine.tiering import Tiers
from prefixstore.gpu import shards, tiers, verify
from prefixstore.gpu.diskroom import RESERVE_NAME
from prefixstore.gpu.fileio import open_regular, read_fd
from prefixstore.gpu.ranks import TMP_SUFFIX, rank_dir_name
from prefixstore.gpu.tier import Capability, has
from prefixstore.statemachine.transactions import MACHINES

LOCK_NAME = "LOCK"
TITLES = {
    1: "every ready node has a verified shard on every rank",
    2: "ancestry is whole and keys are chained hashes",
    3: "accounting is exact and no file is unknown",
    4: "nothing acknowledged is lost",
    5: "no wrong data (a verified shard restores to its own bytes)",
    6: "pinned and fenced nodes are never evicted or replaced",
    7: "the journal holds no unfinished transaction",
    8: "no ready node depends on an evicted segment",
}
_ROOT_ENTRIES = {CATALOG_NAME, f"{CATALOG_NAME}-wal", f"{CATALOG_NAME}-shm", f"{CATALOG_NAME}-journal",
                 LOCK_NAME, "lost+found", RESERVE_NAME, f"{RESERVE_NAME}.tmp"}


@attrs.define
class Violation:
    invariant: int
    detail: str
    subject: tuple | None = attrs.field(default=None, eq=False, repr=False)
    """What the finding rests on, for the re-check beside a running engine:
    ``("entry", rank, name)`` or ``("shard", node, generation, rank, name)``."""

    def to_dict(self) -> dict[str, Any]:
        return {"invariant": self.invariant, "detail": self.detail}


@attrs.define
class AuditReport:
    """The audit's findings; ``ok`` when no invariant is violated."""

    violations: list[Violation] = attrs.field(factory=list)
    accounting: dict[str, int] = attrs.field(factory=dict)
    journal: list[dict[str, Any]] = attrs.field(factory=list)
    nodes: int = 0
    files_checked: int = 0
    unknown_files: list[str] = attrs.field(factory=list)
    checked: dict[int, str] = attrs.field(factory=dict)
    """Per invariant: what was examined (or why it was not checked)."""
    ranks: list[dict[str, Any]] = attrs.field(factory=list)
    recovery: list[str] = attrs.field(factory=list)
    """What opening an engine on this directory would change, besides the journal."""
    damaged_nodes: list[int] = attrs.field(factory=list)
    notes: list[str] = attrs.field(factory=list)
    source: str = ""
    """How the catalog was read."""

    @property
    def ok(self) -> bool:
        return not self.violations

    @property
    def unreachable(self) -> dict[int, str]:
        """The ranks whose tier could not serve (a rank server unreachable), and why: not
        checked, so a report without violations has not shown the cache sound."""
        return {r["rank"]: r["unavailable"] for r in self.ranks if "unavailable" in r}

    def add(self, invariant: int, detail: str, subject: tuple | None = None) -> None:
        self.violations.append(Violation(invariant, detail, subject))

    def status(self, invariant: int) -> str:
        """'ok', 'violated' or 'not checked' for one invariant."""
        if any(v.invariant == invariant for v in self.violations):
            return "violated"
        return "not checked" if self.checked.get(invariant, "").startswith("not checked") else "ok"

    def by_invariant(self) -> dict[int, list[str]]:
        out: dict[int, list[str]] = {i: [] for i in TITLES}
        for v in self.violations:
            out.setdefault(v.invariant, []).append(v.detail)
        return out

    def to_dict(self) -> dict[str, Any]:
        found = self.by_invariant()
        return {
            "ok": self.ok,
            "violations": [v.to_dict() for v in self.violations],
            "invariants": [
                {"invariant": i, "title": TITLES.get(i, ""), "status": self.status(i),
                 "checked": self.checked.get(i, ""), "violations": len(found.get(i, []))}
                for i in sorted(set(TITLES) | set(found))
            ],
            "accounting": self.accounting,
            "journal": self.journal,
            "recovery": self.recovery,
            "ranks": self.ranks,
            "nodes": self.nodes,
            "damaged_nodes": self.damaged_nodes,
            "files_checked": self.files_checked,
            "unknown_files": self.unknown_files,
            "notes": self.notes,
            "source": self.source,
        }


@attrs.define
class CatalogRows:
    """One consistent read of every catalog table."""

    meta: dict[str, str]
    nodes: dict[int, tuple]
    files: list[tuple]
    journal: list[tuple[int, str, str, str]]
    integrity: str
    source: str
    schema: list[SchemaProblem] = attrs.field(factory=list)
    """How the catalog's schema differs from the engine's (``engine/schema.py``)."""
    unreadable: set[str] = attrs.field(factory=set)
    """The engine's tables read as empty: not there, or not as the engine made them."""


# ---------------------------------------------------------------------- reading


def engine_running(root: str) -> bool:
    """Whether an engine holds ``root`` open (see ``dirlock``); never blocks, creates nothing."""
    return dirlock.is_held(root)


def read_catalog(root: str, *, live: bool | None = None) -> CatalogRows:
    """Read the whole catalog without writing a byte (see the module docstring).

    ``live``: whether an engine holds the directory (probed when None). Raises
    NotACacheError or SchemaVersionError when the catalog cannot be read.
    """
    path = catalog_path(root)
    if not os.path.lexists(path):
        trust.refuse_unless_new(root, f"{CATALOG_NAME} is missing")
    if not os.path.isfile(path):
        raise NotACacheError(f"{root}: no {CATALOG_NAME}")
    running = engine_running(root) if live is None else live
    wal = path + "-wal"
    with contextlib.ExitStack() as stack:
        if running:
            uri, source = f"file:{quote(path)}?mode=ro", "read-only connection beside the running engine"
        elif not os.path.exists(wal) or os.path.getsize(wal) == 0:
            uri, source = f"file:{quote(path)}?immutable=1", "immutable (no engine, no write-ahead log)"
        else:
            tmp = stack.enter_context(tempfile.TemporaryDirectory(prefix="prefixstore-audit-"))
            copy = os.path.join(tmp, CATALOG_NAME)
            shutil.copyfile(path, copy)
            shutil.copyfile(wal, copy + "-wal")
            uri, source = f"file:{quote(copy)}", "private copy of the catalog and its write-ahead log"
        try:
            conn = sqlite3.connect(uri, uri=True, check_same_thread=False, timeout=30)
        except sqlite3.Error as exc:
            raise NotACacheError(f"{root}: cannot open {CATALOG_NAME}: {exc}") from exc
        try:
            return _read_rows(conn, root, source)
        except sqlite3.Error as exc:
            raise NotACacheError(f"{root}: {CATALOG_NAME} is not a readable prefixstore catalog: {exc}") from exc
        finally:
            conn.close()
    raise AssertionError("unreachable")  # pragma: no cover


def _read_rows(conn: sqlite3.Connection, root: str, source: str) -> CatalogRows:
    view = CatalogView(conn)
    version = view.user_version()
    if version > SCHEMA_VERSION:
        raise SchemaVersionError(
            f"{root}: catalog schema version {version} is newer than this prefixstore "
            f"(supports up to {SCHEMA_VERSION}); upgrade prefixstore"
        )
    with view.snapshot():  # one consistent snapshot of every table
        if not version and not view.schema_objects():
            size = os.path.getsize(catalog_path(root))
            trust.refuse_unless_new(root, f"{CATALOG_NAME} is empty (0 bytes)" if not size
                                    else f"{CATALOG_NAME} holds no schema")
        found = schema.problems(conn)
        shadowed = schema.unreadable_tables(conn, found)  # read as empty: not the engine's rows
        meta = {} if "meta" in shadowed else view.meta()
        if meta.get("format") != FORMAT_MARKER:
            raise NotACacheError(f"{root}: catalog has no prefixstore format marker")
        nodes = {} if "nodes" in shadowed else view.node_rows()
        files = [] if "files" in shadowed else view.file_rows()
        journal = [] if "journal" in shadowed else view.journal_rows()
        if "layout" not in meta and not (nodes or files or journal):
            trust.refuse_unless_new(root, trust.UNINITIALIZED)
        integrity = view.quick_check()
    return CatalogRows(meta, nodes, files, journal, integrity, source, found, shadowed)


def read_shard_bytes(path: str) -> bytes:
    """Read a regular file (``open_regular``: no symlink followed, no FIFO waited on)
    without updating its access time where the OS allows it."""
    try:
        fd = open_regular(path, getattr(os, "O_NOATIME", 0))
    except PermissionError:
        fd = open_regular(path)  # O_NOATIME needs ownership
    except OSError as exc:
        if exc.errno != errno.EINVAL or isinstance(exc, NotRegularFileError):
            raise
        fd = open_regular(path)
    try:
        return read_fd(fd)
    finally:
        os.close(fd)


# ---------------------------------------------------------------------- auditing


def audit_dir(
    root: str,
    *,
    rank_dirs: Sequence[str] | None = None,
    checksums: bool = True,
    expected: Iterable[bytes] = (),
    quiescent: bool | None = None,
    live: bool | None = None,
) -> AuditReport:
    """Audit the cache at ``root``. Raises NotACacheError / SchemaVersionError if unreadable.

    ``expected``: keys of acknowledged checkpoints (invariant 4). ``quiescent``:
    an unfinished transaction is a violation (default: unless an engine holds the
    directory). ``live``: whether an engine holds it (probed when None); beside one,
    findings against the catalog snapshot are re-checked (see the module docstring).
    """
    running = engine_running(root) if live is None else live
    rows = read_catalog(root, live=running)
    return audit_rows(rows, root, rank_dirs=rank_dirs, checksums=checksums,
                      expected=set(expected), quiescent=not running if quiescent is None else quiescent,
                      recheck=(lambda: read_catalog(root, live=True)) if running else None)


@attrs.frozen(slots=True, eq=False)
class LiveView:
    """What the audit of a running engine reads beside its directory: the catalog and
    the in-memory index, the space account, the holds, the tiers (a volatile tier is
    read through itself), whether the engine writes (``mode``)."""

    root: str
    catalog: Catalog
    index: Index
    account: Account
    holds: Holds
    tiers: Tiers
    mode: Mode


def _audit_index(lv: LiveView, rep: AuditReport) -> None:
    """The in-memory index is the catalog: the same nodes, each with the same parent,
    span, state, generation and snapshot flag, and any live-file rows it caches for its
    generation equal to the catalog's."""
    rows = lv.catalog.node_fields()
    if set(rows) != set(lv.index.nodes):
        rep.add(2, f"index holds {len(lv.index.nodes)} nodes, catalog {len(rows)}")
    live: dict[int, dict[int, tuple[str, int, str]]] = {}
    for nid, r, name, size, ck in lv.catalog.node_live_files():
        live.setdefault(nid, {})[r] = (name, size, ck)
    for nid, x in lv.index.nodes.items():
        row = rows.get(nid)
        if row is None:
            continue
        mine = (x.parent, x.start, x.end, x.state, x.generation, int(x.has_snapshot))
        if mine != tuple(row):
            rep.add(2, f"node {nid}: index (parent, start, end, state, generation, snapshot) {mine}, "
                       f"catalog {tuple(row)}")
        if x.files is not None and x.files[0] == x.generation and x.files[1] != live.get(nid, {}):
            rep.add(2, f"node {nid}: cached file rows differ from the catalog's live files")


def audit_engine(lv: LiveView, *, checksums: bool = True) -> AuditReport:
    """Audit a live engine's directory plus its in-memory state (caller holds its lock)."""
    acct = lv.account
    rep = audit_dir(
        lv.root,
        rank_dirs=tiering.audit_dirs(lv.tiers.ranks),
        checksums=checksums,
        quiescent=not lv.holds.fences,
        live=lv.mode.read_only is None,  # a read-only engine never writes: read as at rest, creating nothing
    )
    catalog_charged = rep.accounting.get("charged", 0)
    if acct.charged != catalog_charged:
        rep.add(3, f"engine counts {acct.charged} charged bytes, catalog rows sum to {catalog_charged}")
    # the catalog's sum against its recorded capacity is checked by audit_dir; only a
    # different fact (the engine's own count or capacity) is a violation of its own
    if acct.charged > acct.capacity and (acct.charged, acct.capacity) != (catalog_charged,
                                                                          rep.accounting.get("capacity")):
        rep.add(3, f"engine charges {acct.charged} bytes, above its capacity {acct.capacity}")
    _audit_index(lv, rep)
    held = {n for n, c in lv.holds.pins.items() if c} | {n for n, c in lv.holds.fences.items() if c}
    gone = sorted(n for n in held if n not in lv.index.nodes)
    for n in gone:
        rep.add(6, f"node {n} is pinned or fenced but no longer in the index")
    rep.checked[6] = f"{len(held)} pinned or fenced nodes, all still indexed" if not gone else f"{len(held)} held"
    _ram_tier(lv, rep, checksums)  # the RAM tier's own accounting (invariant 3)
    for r, why in sorted(lv.tiers.down.why.items()):
        rep.notes.append(f"the engine runs without rank {r} (degraded): its part of recovery waits until it "
                         f"is back ({why})")
    return rep


def _ram_tier(lv: LiveView, rep: AuditReport, checksums: bool) -> None:
    """Invariant 3 for the RAM tier: exact, bounded, and only catalog files."""
    kind, tier = lv.tiers.backing.kind, lv.tiers.backing.tier
    if tier is None:
        return
    rows = {
        (r, name): (size, ck, status)
        for r, name, size, ck, status in lv.catalog.query("SELECT rank, name, size, checksum, status FROM files")
    }
    total = 0
    for (r, name), buf in tier.items():
        total += buf.nbytes
        row = rows.get((r, name))
        if row is None:
            rep.add(3, f"RAM tier holds rank{r}/{name}, unknown to the catalog")
            continue
        size, ck, status = row
        if buf.nbytes != size:
            rep.add(3, f"RAM tier holds rank{r}/{name} as {buf.nbytes} bytes, catalog says {size}")
        elif checksums and status == "live" and ck and verify.problem(buf.mv(), None, ck) is not None:
            rep.add(1, f"RAM tier copy of rank{r}/{name} fails its checksum")
    if total != tier.used:
        rep.add(3, f"RAM tier counts {tier.used} used bytes, its shards sum to {total}")
    if tier.used > tier.capacity:
        rep.add(3, f"RAM tier uses {tier.used} bytes, above its capacity {tier.capacity}")
    rep.accounting[f"ram_{kind}_used"] = tier.used
    rep.accounting[f"ram_{kind}_capacity"] = tier.capacity


def audit_rows(
    rows: CatalogRows,
    root: str,
    *,
    rank_dirs: Sequence[str] | None = None,
    checksums: bool = True,
    expected: set[bytes] | None = None,
    quiescent: bool = True,
    recheck: Callable[[], CatalogRows] | None = None,
) -> AuditReport:
    """Audit catalog ``rows`` against the rank directories (the core of ``audit_dir``).

    ``recheck``: a running engine holds the directory; it reads the catalog again
    after the scan, and findings the engine's own work explains are dropped.
    """
    rep = AuditReport(source=rows.source)
    try:
        layout = Layout.from_json(rows.meta.get("layout", ""))
    except LayoutError as exc:
        raise NotACacheError(f"{root}: catalog layout unreadable: {exc}") from exc
    capacity = int(rows.meta.get("capacity", "0") or 0)
    dirs = _audited_dirs(rep, root, layout, rank_dirs)
    nodes = rows.nodes
    files = _catalog_rows(rep, rows, layout)
    _journal(rep, rows, files, quiescent, in_flight=recheck is not None)
    if _volatile(rep, rows, files, dirs):
        return rep
    disk = _scan_dirs(rep, root, dirs, layout, files, nodes)
    _accounting(rep, files, nodes, disk, capacity)
    backed = {f[2] for f in files if f[6] == "live"}  # invariant 8 reads the rows as they are
    regen = S.stale_generations(nodes, files, layout.ranks)
    if regen:
        rep.recovery.append(f"record for {len(regen)} nodes the generation their live shards have: "
                            + ", ".join(f"node {n} -> {g}" for n, g in sorted(regen.items())[:5]))
    nodes_after = {n: (*r[: S.GEN], regen[n], *r[S.GEN + 1 :]) if n in regen else r for n, r in nodes.items()}
    files = _as_recovered(rep, layout, nodes, files, dirs, disk, checksums)
    _ready_nodes(rep, layout, nodes_after, files, dirs, disk, checksums, backed)
    if recheck is not None:
        _drop_in_flight_findings(rep, recheck, dirs)
    _recovery_lines(rep)
    _acknowledged(rep, nodes, expected)
    rep.checked.setdefault(6, "not checked (needs the running engine's pins and fences)")
    return rep


def _audited_dirs(rep: AuditReport, root: str, layout: Layout, rank_dirs: Sequence[str] | None) -> list:
    """The rank directories to scan (those named, else the cache's own); a problem of
    the cache's own directories is a violation the engine refuses to open with."""
    if rank_dirs:  # named by the caller: a symlink to one is followed, once
        dirs = [os.path.realpath(d) if isinstance(d, str) else d for d in rank_dirs]
    else:
        dirs = [os.path.join(root, rank_dir_name(r)) for r in range(layout.ranks)]
    if len(dirs) != layout.ranks:
        raise NotACacheError(f"{len(dirs)} rank directories given, the layout has {layout.ranks} ranks")
    for problem in own_dir_problems(root, 0 if rank_dirs else layout.ranks):
        rep.add(3, f"{problem}: not read; an engine refuses to open the cache (name rank directories "
                   "kept elsewhere with --rank-dir)")
        rep.recovery.append(f"refuse to open: {problem}")
    return dirs


def _catalog_rows(rep: AuditReport, rows: CatalogRows, layout: Layout) -> list[tuple]:
    """Check the catalog's rows against each other (invariant 2 and the file rows' own
    consistency); the file rows as recovery re-attaches them."""
    nodes, files = rows.nodes, rows.files
    _schema(rep, rows.schema, rows.unreadable)
    rep.nodes = len(nodes)
    rep.damaged_nodes = sorted(n for n, r in nodes.items() if r[S.STATE] != "ready")
    if rows.integrity != "ok":
        rep.add(2, f"catalog integrity check: {rows.integrity}")
    problems = S.node_problems(nodes) + S.file_problems(nodes, files, layout.ranks)
    for p in problems:
        rep.add(p.invariant, p.detail)
    blocks = sum(r[S.END] - r[S.START] for r in nodes.values())
    rep.checked[2] = f"{len(nodes)} nodes, {blocks} chained blocks"
    if any(p.file is None or p.kind in S.REFUSED_FILE_KINDS for p in problems):
        rep.recovery.append("refuse to open: the catalog contradicts itself (`prefixstore audit --repair` fixes it)")
    moved = sorted(f"rank{p.file[0]}/{p.file[1]}" for p in problems if p.kind == "misowned" and p.file)
    if moved:
        rep.recovery.append(f"re-attach {len(moved)} file rows to the node whose current shard each names: "
                            f"{', '.join(moved[:5])}" + (" ..." if len(moved) > 5 else ""))
        files = S.reattached(nodes, files)
    return files


def _schema(rep: AuditReport, found: Sequence[SchemaProblem], unreadable: set[str]) -> None:
    """Each way the catalog's schema differs from the engine's (invariant 2: the catalog
    itself); an engine refuses to open it. ``unreadable``: engine tables read as empty."""
    for p in found:
        rep.add(2, f"catalog schema: {p.detail}")
    if unreadable:
        rep.notes.append(f"tables {sorted(unreadable)} are not the engine's: read as empty")
    if found:
        fix = "`prefixstore audit --repair` drops what is foreign"
        if unreadable:
            fix = (f"the rows of {', '.join(sorted(unreadable))} are not there to keep, so `--repair` cannot "
                   "restore them; `--repair --rebuild` rebuilds the catalog from the shards' headers")
        rep.recovery.append(f"refuse to open: the catalog's schema is not the engine's ({fix})")


def _volatile(rep: AuditReport, rows: CatalogRows, files: list[tuple], dirs: list) -> bool:
    """Check the catalog of a cache last opened with a volatile backing; True when only
    the catalog can be audited (a volatile cache seen from outside its engine)."""
    if not tiers.recorded_volatile(rows.meta):
        return False
    name = tiers.recorded(rows.meta)
    on_disk = durable_shards(dirs, files)
    if on_disk:
        rep.add(3, f"the catalog says backing={name}, but {len(on_disk)} shard files it names are on disk "
                   f"with their recorded checksums: {', '.join(on_disk[:5])}" + (" ..." if len(on_disk) > 5 else ""))
        rep.recovery.append(f"refuse to open: backing={name} contradicts the shard files on disk "
                            f"(`prefixstore audit --repair` records backing={tiers.DEFAULT})")
        return False
    if not all(isinstance(d, str) for d in dirs):
        return False
    # Its shards live (or lived) in that engine's RAM, never in the rank directories;
    # its next open drops every row.
    why = f"not checked (backing={name}: the shards are in the engine's RAM)"
    for inv in (1, 3, 5, 8):
        rep.checked[inv] = why
    rep.notes.append(f"backing={name}: only the catalog was checked")
    if rows.nodes or files:
        rep.recovery.append(f"drop every row ({len(rows.nodes)} nodes, {len(files)} files): the cache is volatile")
    return True


def _acknowledged(rep: AuditReport, nodes: dict, expected: set[bytes] | None) -> None:
    """Invariant 4: every acknowledged checkpoint's key is still a node."""
    if not expected:
        rep.checked[4] = "not checked (no list of acknowledged checkpoints given)"
        return
    present = {bytes(r[S.KEY]) for r in nodes.values()}
    lost = expected - present
    for k in sorted(lost):
        rep.add(4, f"acknowledged checkpoint {k.hex()[:16]} is gone")
    rep.checked[4] = f"{len(expected)} acknowledged checkpoints, {len(expected) - len(lost)} present"


def _journal(rep: AuditReport, rows: CatalogRows, files, quiescent: bool, in_flight: bool = False) -> None:
    """Each unfinished transaction with what recovery would do with it; a violation
    when ``quiescent``; ``in_flight``: a running engine is working on them."""
    by_txn: dict[int, list[tuple]] = {}
    for f in files:
        if f[7] is not None:
            by_txn.setdefault(f[7], []).append(f)
    for tid, kind, state, payload in rows.journal:
        owned = by_txn.get(tid, [])
        nbytes = sum(f[4] for f in owned)
        names = sorted({f"rank{f[0]}/{f[1]}" for f in owned})
        entry: dict[str, Any] = {"txn": tid, "kind": kind, "state": state, "files": names, "bytes": nbytes}
        try:
            info = json.loads(payload)
        except ValueError:
            info = None
        if kind not in MACHINES or state not in MACHINES[kind].states or not isinstance(info, dict):
            entry["recovery"] = "refuse to open (unknown transaction or corrupt payload)"
            entry["action"] = entry["recovery"]
            rep.add(7, f"journal row {tid} ({kind}/{state}) cannot be recovered: unknown or corrupt")
            rep.journal.append(entry)
            continue
        forward = MACHINES[kind].direction(state) == "forward"
        entry["recovery"] = "roll forward" if forward else "roll back"
        entry["event"] = "" if MACHINES[kind].is_final(state) else MACHINES[kind].recovery_event(state)
        key = str(info.get("key", ""))[:12]
        what = f"{kind} of {key}" if key else kind
        if forward and kind == "evict":
            action = f"finish the evict of nodes {info.get('nodes')}: unlink {len(owned)} files ({nbytes} bytes)"
        elif forward:
            action = f"keep the published {what}; unlink {len(owned)} retired files ({nbytes} bytes)"
        elif state == "INTENT":
            action = f"undo {what}: unlink {len(owned)} new files ({nbytes} bytes); the previous record stays"
        else:
            action = f"finish rolling back {what}: unlink {len(owned)} files ({nbytes} bytes)"
        entry["action"] = action
        if in_flight:
            entry["in_flight"] = True
        rep.journal.append(entry)
        if quiescent:
            rep.add(7, f"journal holds unfinished {kind} transaction {tid} in state {state}")
    rep.checked[7] = f"{len(rows.journal)} unfinished transactions" + (
        "" if quiescent else " in flight (a running engine holds the directory)" if in_flight
        else " (engine at work)")


@attrs.define
class _Disk:
    """What the rank directories hold: (rank, name) -> (size, is regular file)."""

    entries: dict[tuple[int, str], tuple[int, bool]] = attrs.field(factory=dict)
    on_disk: int = 0
    rowless: dict[tuple[int, str], tuple[int, int]] = attrs.field(factory=dict)
    """Regular files no row names that are a node's current shard: (rank, name) -> (size, node)."""
    down: set[int] = attrs.field(factory=set)
    """Ranks read through a tier that cannot serve now (a rank server unreachable): not checked."""


def _scan_dirs(rep: AuditReport, root: str, dirs: list[str], layout: Layout, files, nodes) -> _Disk:
    disk = _Disk()
    known = {(f[0], f[1]) for f in files}
    current = S.current_shards(nodes)
    # A file in flight owns its temporary; so does garbage (a failed cleanup may have
    # left a short temporary of a failed write; reclaiming removes both).
    in_flight = {(f[0], f[1]) for f in files if f[6] in ("writing", "garbage")}
    for r, d in enumerate(dirs):
        # A rank "directory" may be a view: a volatile tier itself (a running engine's, see
        # ``tiering.audit_dirs``) or a rank served by a rank server on another host, an
        # object with listdir(), size(name) and read_shard(name); one that is unavailable
        # is reported, not checked.
        view = None if isinstance(d, str) else d
        info: dict[str, Any] = {"rank": r, "dir": d if view is None else getattr(view, "location", f"ram:rank{r}"),
                                "files": 0, "bytes": 0, "unknown": []}
        entries = _rank_entries(rep, r, d, view, files, info, disk)
        for e in entries:
            if view is not None:
                size, regular = view.size(e) or 0, True
            else:
                try:
                    st = os.lstat(os.path.join(d, e))
                except OSError:
                    continue
                regular = stat.S_ISREG(st.st_mode)
                size = st.st_size if regular else 0
            disk.on_disk += size
            info["files"] += 1
            info["bytes"] += size
            if (r, e) in known:
                disk.entries[(r, e)] = (size, regular)
                continue
            if e.endswith(TMP_SUFFIX) and (r, e[: -len(TMP_SUFFIX)]) in in_flight and regular:
                continue
            where = f"rank{r}/{e}"
            info["unknown"].append(e)
            rep.unknown_files.append(where)
            base = e[: -len(TMP_SUFFIX)] if e.endswith(TMP_SUFFIX) else e
            if base == e and e in current and regular:
                disk.rowless[(r, e)] = (size, current[e])
                disk.entries[(r, e)] = (size, regular)
                rep.add(1, f"file {where} is node {current[e]}'s current shard, but the catalog has no row for it")
                rep.recovery.append(f"re-attach {where} to node {current[e]} if it verifies as that shard "
                                    "(else move it to lost+found/)")
            elif S.SHARD_RE.match(base) and regular:
                rep.add(3, f"file {where} is unknown to the catalog (an orphan shard)", ("orphan", r, e))
            else:
                rep.add(3, f"entry {where} is unknown to the catalog (foreign)", ("foreign", r, e))
        rep.ranks.append(info)
    if os.path.isdir(root):
        rank_names = {rank_dir_name(r) for r in range(layout.ranks)}
        extra = sorted(set(os.listdir(root)) - _ROOT_ENTRIES - rank_names)
        if extra:
            rep.notes.append(f"top-level entries that are not the cache's: {', '.join(extra[:10])}")
    return disk


def _rank_entries(rep: AuditReport, r: int, d: Any, view: Any, files, info: dict[str, Any], disk: _Disk) -> list[str]:
    """The entries of rank ``r``'s directory ``d`` (or of its tier, ``view``); a missing
    directory or an unavailable rank is noted in ``info`` and lists nothing."""
    try:
        if view is None and os.path.islink(d):
            raise FileNotFoundError(d)  # a cache's own directory that is a symlink: never read
        return sorted(os.listdir(d) if view is None else view.listdir())
    except RankUnavailableError as exc:
        info["unavailable"] = str(exc)
        disk.down.add(r)
        rep.notes.append(f"rank {r} is unavailable, its files were not checked: {exc}")
    except FileNotFoundError:
        info["missing"] = True
        live = sum(1 for f in files if f[0] == r and f[6] == "live")
        if live and not os.path.islink(d):
            rep.notes.append(
                f"rank directory {d} is missing, yet the catalog records {live} shards on rank {r}: "
                "if the ranks are kept elsewhere, name them with --rank-dir (once per rank); "
                "--repair refuses until then")
        elif any(f[0] == r for f in files):
            rep.notes.append(f"rank directory {d} is missing")
    except OSError as exc:
        raise NotACacheError(f"cannot list rank directory {d}: {exc}") from exc
    return []

def _accounting(rep: AuditReport, files, nodes, disk: _Disk, capacity: int) -> None:
    acct = {"live": 0, "damaged": 0, "garbage": 0, "writing": 0}
    charged = 0
    open_txns = {j["txn"] for j in rep.journal}
    stray = 0
    for rank, name, node, _gen, size, _ck, status, txn in files:
        if not isinstance(size, int) or size < 0:
            rep.add(3, f"file row rank{rank}/{name} records size {size!r}")
            continue
        charged += size
        if status == "live":
            damaged = node in nodes and nodes[node][S.STATE] != "ready"
            acct["damaged" if damaged else "live"] += size
        else:
            acct[status] = acct.get(status, 0) + size
            if status == "writing" and txn not in open_txns:
                stray += 1
                rep.add(3, f"file rank{rank}/{name} is 'writing' with no open transaction")
            elif status == "garbage" and txn is not None and txn not in open_txns:
                rep.add(3, f"garbage file rank{rank}/{name} is owned by transaction {txn}, which has ended")
            on = disk.entries.get((rank, name))
            if status == "garbage" and on is not None and on[0] > size:
                rep.add(3, f"garbage file rank{rank}/{name} is {on[0]} bytes on disk, {size} charged")
    unknown = len(rep.unknown_files)
    rep.accounting = {"charged": charged, "capacity": capacity, **acct, "on_disk": disk.on_disk,
                      "unknown_files": unknown}
    if capacity and charged > capacity:
        rep.add(3, f"charged {charged} exceeds capacity {capacity}")
    rep.checked[3] = (f"charged {charged} = live {acct['live']} + damaged {acct['damaged']} + garbage "
                      f"{acct['garbage']} + writing {acct['writing']}; capacity {capacity}; "
                      f"{disk.on_disk} bytes on disk; {unknown} unknown entries")
    garbage = [f for f in files if f[6] == "garbage"]
    if stray:
        rep.recovery.append(f"turn {stray} 'writing' rows with no transaction into garbage")
    if garbage:
        rep.recovery.append(f"unlink {len(garbage)} garbage files ({sum(f[4] for f in garbage)} bytes)")


def _as_recovered(rep: AuditReport, layout: Layout, nodes, files, dirs, disk: _Disk, checksums: bool) -> list[tuple]:
    """The file rows as recovery will leave them: a negative size taken from the file, and
    (reading shards, unless ``checksums`` is off) a wrong size of a file that matches its
    checksum, a row-less current shard that verifies re-attached to its node."""
    out = []
    resized = []
    for f in files:
        on = disk.entries.get((f[0], f[1]), (0, False))
        if not isinstance(f[4], int) or f[4] < 0:
            resized.append(f"rank{f[0]}/{f[1]}")
            f = (*f[:4], on[0], *f[5:])
        elif (checksums and f[6] == "live" and on[1] and on[0] != f[4] and f[2] in nodes
              and nodes[f[2]][S.STATE] == "ready"):
            try:
                data = read_shard_bytes(os.path.join(dirs[f[0]], f[1])) if isinstance(dirs[f[0]], str) else b""
            except OSError:
                data = b""
            if data and len(data) == on[0] and shards.checksum(data) == f[5]:
                rep.add(3, f"file row rank{f[0]}/{f[1]} records size {f[4]}; the file is {on[0]} bytes and "
                           "matches its recorded checksum")
                resized.append(f"rank{f[0]}/{f[1]}")
                f = (*f[:4], on[0], *f[5:])
        out.append(f)
    if resized:
        rep.recovery.append(f"take the size of {len(resized)} file rows from their files: {', '.join(resized[:5])}")
    for (r, name), (_size, nid) in sorted(disk.rowless.items()):
        if not checksums or not isinstance(dirs[r], str):
            continue
        try:
            data = read_shard_bytes(os.path.join(dirs[r], name))
        except OSError:
            continue
        ck = shards.checksum(data)
        if verify_bytes(layout, data, r, nodes[nid], ck) is None:
            out.append((r, name, nid, nodes[nid][S.GEN], len(data), ck, "live", None))
    return out


def durable_shards(dirs: Sequence, files) -> list[str]:
    """``rankR/name`` of the file rows whose file is on disk in ``dirs`` (a directory, or
    a rank object read through its ``listdir``, ``size`` and ``read_shard``; a volatile
    tier, such as the RAM tier, holds none) with the size and checksum the row records
    (the evidence that a cache marked volatile is not)."""
    out = []
    present: list[set[str]] = []
    for d in dirs:
        try:
            present.append(set(os.listdir(d)) if isinstance(d, str) else
                           set() if has(d, Capability.VOLATILE) else set(d.listdir()))
        except OSError:
            present.append(set())
    for rank, name, _node, _gen, size, ck, _status, _txn in files:
        if not (isinstance(rank, int) and 0 <= rank < len(dirs) and name in present[rank]
                and isinstance(name, str) and S.SHARD_RE.match(name)):
            continue
        if not isinstance(dirs[rank], str):
            with contextlib.suppress(OSError):
                view = dirs[rank]
                if ck and view.size(name) == size and shards.checksum(view.read_shard(name)) == ck:
                    out.append(f"rank{rank}/{name}")
            continue
        path = os.path.join(dirs[rank], name)
        try:
            st = os.lstat(path)
            if not stat.S_ISREG(st.st_mode) or st.st_size != size or not ck:
                continue
            if shards.checksum(read_shard_bytes(path)) == ck:
                out.append(f"rank{rank}/{name}")
        except OSError:
            continue
    return out


def _ready_nodes(
    rep: AuditReport, layout: Layout, nodes, files, dirs, disk: _Disk, checksums: bool, backed: set
) -> None:
    live_by_node: dict[int, dict[int, tuple]] = {}
    for rank, name, node, gen, size, ck, status, _txn in files:
        if status == "live" and node in nodes:
            live_by_node.setdefault(node, {})[rank] = (name, gen, size, ck)
    for nid, row in sorted(nodes.items()):
        if row[S.STATE] != "ready":
            continue
        live = live_by_node.get(nid, {})
        if set(live) != set(range(layout.ranks)):
            rep.add(1, f"ready node {nid} has shards on ranks {sorted(live)}, needs 0..{layout.ranks - 1}",
                    ("missing", nid, row[S.GEN], None, None))
            continue
        for r, (name, _gen, size, ck) in sorted(live.items()):
            if r in disk.down:
                continue
            rep.files_checked += 1
            on = disk.entries.get((r, name))
            missing = ("missing", nid, row[S.GEN], r, name)
            if on is None:
                rep.add(1, f"node {nid} rank {r}: shard {name} missing", missing)
                break
            if not on[1]:
                rep.add(1, f"node {nid} rank {r}: shard {name} is not a regular file", missing)
                break
            if on[0] != size:
                rep.add(1, f"node {nid} rank {r}: shard {name} is {on[0]} bytes, catalog says {size}", missing)
                break
            if checksums:
                why = (verify_shard(layout, os.path.join(dirs[r], name), r, row, ck) if isinstance(dirs[r], str)
                       else _view_problem(layout, dirs[r], name, size, r, row, ck))
                if why is not None:
                    rep.add(1, f"node {nid} rank {r}: {why}", ("unreadable", nid, row[S.GEN], r, name))
                    break
    ready = sum(1 for r in nodes.values() if r[S.STATE] == "ready")
    how = "size, checksum and header" if checksums else "presence and size only (--quick)"
    rep.checked[1] = f"{ready} ready nodes, {rep.files_checked} shards checked ({how})" + (
        f"; ranks {sorted(disk.down)} unavailable, not checked" if disk.down else "")
    rep.checked[5] = ("each verified shard decoded against the layout with its own key, generation, span "
                      "and rank" if checksums else "not checked (--quick reads no shard)")

    # Invariant 8: no ready node depends on an evicted segment.
    bad8 = 0
    for nid, row in nodes.items():
        if row[S.STATE] != "ready":
            continue
        p, hops = row[S.PARENT], 0
        while p is not None and p in nodes and hops <= len(nodes):
            if p not in backed:
                rep.add(8, f"ready node {nid} depends on node {p}, which has no backing")
                bad8 += 1
                break
            p, hops = nodes[p][S.PARENT], hops + 1
    rep.checked[8] = f"ancestors of {ready} ready nodes have backing" if not bad8 else f"{ready} ready nodes"


def _recovery_lines(rep: AuditReport) -> None:
    """What recovery would do about the disk findings (orphans, foreign entries, nodes
    whose shards fail), in that order after the catalog's own lines."""
    by: dict[str, list[tuple]] = {}
    for v in rep.violations:
        if v.subject is not None:
            by.setdefault(v.subject[0], []).append(v.subject)
    orphans = [f"rank{r}/{e}" for _, r, e in by.get("orphan", [])]
    foreign = [f"rank{r}/{e}" for _, r, e in by.get("foreign", [])]
    missing = sorted({s[1] for s in by.get("missing", [])})
    unreadable = sorted({s[1] for s in by.get("unreadable", [])})
    if orphans:
        rep.recovery.append(f"remove {len(orphans)} orphan shard files: {', '.join(orphans[:5])}"
                            + (" ..." if len(orphans) > 5 else ""))
    if foreign:
        rep.recovery.append(f"move {len(foreign)} foreign entries to lost+found/: {', '.join(foreign[:5])}"
                            + (" ..." if len(foreign) > 5 else ""))
    if missing:
        rep.recovery.append(f"mark {len(missing)} nodes damaged (a shard missing or of the wrong size): "
                            f"{missing[:10]}")
    if unreadable:
        rep.recovery.append(f"leave {len(unreadable)} nodes with bad shard contents for the first restore "
                            f"to mark damaged (`--repair` marks them now): {unreadable[:10]}")


def _drop_in_flight_findings(rep: AuditReport, reread: Callable[[], CatalogRows], dirs) -> None:
    """Beside a running engine: drop each disk finding that a catalog read taken after
    the scan explains (see the module docstring); note how many were dropped."""
    suspects = [v for v in rep.violations if v.subject is not None]
    if not suspects:
        return
    try:
        fresh = reread()
    except (NotACacheError, SchemaVersionError, OSError):
        return  # nothing to re-check against: every finding stands
    known = {(f[0], f[1]) for f in fresh.files}
    live = {(f[0], f[1]): f[2] for f in fresh.files if f[6] == "live"}

    def explained(s: tuple) -> bool:
        if s[0] in ("orphan", "foreign"):
            _, r, e = s
            base = e[: -len(TMP_SUFFIX)] if e.endswith(TMP_SUFFIX) else e
            return (r, e) in known or (r, base) in known or not _exists(dirs[r], e)
        _, nid, gen, r, name = s
        node = fresh.nodes.get(nid)
        if node is None or node[S.STATE] != "ready" or node[S.GEN] != gen:
            return True  # evicted, replaced or marked damaged since the snapshot
        return r is not None and live.get((r, name)) != nid

    dropped = [v for v in suspects if explained(v.subject)]
    if dropped:
        gone = {id(v) for v in dropped}
        rep.violations = [v for v in rep.violations if id(v) not in gone]
        newer = {(v.subject[1], v.subject[2]) for v in dropped if v.subject[0] in ("orphan", "foreign")}
        rep.unknown_files = [u for u in rep.unknown_files
                             if (int(u.split("/", 1)[0][4:]), u.split("/", 1)[1]) not in newer]
        for info in rep.ranks:
            info["unknown"] = [e for e in info["unknown"] if (info["rank"], e) not in newer]
        if rep.accounting:
            rep.accounting["unknown_files"] = len(rep.unknown_files)
        rep.notes.append(f"{len(dropped)} finding(s) against the catalog snapshot were explained by "
                         "the running engine's work (re-checked against a later catalog read)")


def _exists(d: Any, name: str) -> bool:
    if not isinstance(d, str):
        return name in d.listdir()
    try:
        os.lstat(os.path.join(d, name))
    except FileNotFoundError:
        return False
    return True


def verify_shard(layout: Layout, path: str, rank: int, row: Sequence, ck: str | None) -> str | None:
    """Why the shard at ``path`` fails verification for node ``row`` (None when it passes)."""
    try:
        data = read_shard_bytes(path)
    except OSError as exc:
        return f"cannot read {os.path.basename(path)}: {exc}"
    return verify_bytes(layout, data, rank, row, ck)


def verify_bytes(layout: Layout, data: bytes, rank: int, row: Sequence, ck: str | None) -> str | None:
    """Checksum and header check of one shard's bytes (None when they pass)."""
    return verify.problem(data, None, ck, _header(layout, rank, row))


def _header(layout: Layout, rank: int, row: Sequence) -> verify.Header:
    """What the header of node ``row``'s shard on ``rank`` must say."""
    start, end, has_snap = row[S.START], row[S.END], bool(row[S.HAS_SNAP])
    meta = {"key": bytes(row[S.KEY]).hex(), "generation": str(row[S.GEN]), "start": str(start),
            "end": str(end), "snapshot": "1" if has_snap else "0", "rank": str(rank)}
    return verify.Header(layout, (end - start) * layout.block_tokens, has_snap, meta)


def _view_problem(layout: Layout, view: Any, name: str, size: int, rank: int, row: Sequence,
                  ck: str | None) -> str | None:
    """Why a shard read through its tier fails: a durable tier (a rank server's
    directory on another host) is checked as a local file is, a volatile one by the
    tier read path."""
    if Capability.VOLATILE in getattr(view, "capabilities", Capability.NONE):
        return _tier_problem(view, name, size, ck, _header(layout, rank, row))
    try:
        data = view.read_shard(name)
    except OSError as exc:
        return f"cannot read {name}: {exc}"
    return verify_bytes(layout, data, rank, row, ck)


def _tier_problem(tier: Any, name: str, size: int, ck: str, header: verify.Header) -> str | None:
    """Why the shard ``name`` read from a (volatile) tier fails verification, or None."""
    got = verify.read(tier, name, size, ck, header=header)
    return None if isinstance(got, verify.Shard) else got.why
