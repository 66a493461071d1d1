"""The auditor: checks DESIGN.md section 4's invariants without changing a byte.

``audit_dir`` opens the catalog read-only (a running engine is not disturbed) and
reads every rank directory. ``audit_engine`` adds the checks only a live engine can
answer (its in-memory accounting and index against the catalog, pins and fences).

Invariants checked here (numbers as in DESIGN.md):

1. every ready node has a live shard on every rank whose size, checksum and header
   match the catalog;
2. ancestry is whole: parents exist, ``child.start == parent.end``, keys equal the
   chained hash of their blocks, no block claimed twice;
3. accounting: charged == sum of owned file sizes; every live file's size on disk is
   its recorded size; no unknown file in a rank directory; charged <= capacity;
4. (with ``expected``) every acknowledged checkpoint is ready or damaged;
7. the journal holds no unfinished transaction (reported, and a violation when
   ``quiescent``);
8. no ready node depends on an evicted segment (every ancestor has its backing).
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

import attrs

from prefixstore.engine.catalog import open_readonly
from prefixstore.engine.errors import LayoutError, ShardError
from prefixstore.engine.keys import DIGEST_SIZE, ROOT, chain_all
from prefixstore.engine.layout import Layout
from prefixstore.gpu import shards
from prefixstore.gpu.ranks import rank_dir_name
from prefixstore.statemachine.transactions import recovery_direction

if TYPE_CHECKING:
    from prefixstore.engine.core import Engine


@attrs.define
class Violation:
    invariant: int
    detail: str

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

    @property
    def ok(self) -> bool:
        return not self.violations

    def add(self, invariant: int, detail: str) -> None:
        self.violations.append(Violation(invariant, detail))

    def to_dict(self) -> dict[str, Any]:
        return {
            "ok": self.ok,
            "violations": [v.to_dict() for v in self.violations],
            "accounting": self.accounting,
            "journal": self.journal,
            "nodes": self.nodes,
            "files_checked": self.files_checked,
            "unknown_files": self.unknown_files,
        }


def audit_dir(
    root: str,
    *,
    rank_dirs: Sequence[str] | None = None,
    checksums: bool = True,
    expected: Iterable[bytes] = (),
    quiescent: bool = True,
) -> AuditReport:
    """Audit the cache at ``root``. Raises NotACacheError / SchemaVersionError if unreadable."""
    conn = open_readonly(root)
    try:
        conn.execute("BEGIN")  # one consistent snapshot of the catalog
        return _audit(conn, root, rank_dirs, checksums, set(expected), quiescent)
    finally:
        conn.close()


def audit_engine(eng: Engine, *, checksums: bool = True) -> AuditReport:
    """Audit a live engine's directory plus its in-memory state (caller holds its lock)."""
    rep = audit_dir(
        eng.root,
        rank_dirs=[getattr(r, "directory", "") for r in eng.ranks],
        checksums=checksums,
        quiescent=not eng._fences,
    )
    catalog_charged = rep.accounting.get("charged", 0)
    if eng._charged != catalog_charged:
        rep.add(3, f"engine counts {eng._charged} charged bytes, catalog rows sum to {catalog_charged}")
    if eng._charged > eng.capacity:
        rep.add(3, f"charged {eng._charged} exceeds capacity {eng.capacity}")
    ids = {r[0] for r in eng.catalog.query("SELECT id FROM nodes")}
    if ids != set(eng.index.nodes):
        rep.add(2, f"index holds {len(eng.index.nodes)} nodes, catalog {len(ids)}")
    return rep


def _audit(conn, root, rank_dirs, checksums, expected, quiescent) -> AuditReport:
    rep = AuditReport()
    meta = dict(conn.execute("SELECT key, value FROM meta").fetchall())
    try:
        layout = Layout.from_json(meta.get("layout", ""))
    except LayoutError as exc:
        rep.add(2, f"catalog layout unreadable: {exc}")
        return rep
    capacity = int(meta.get("capacity", "0") or 0)
    dirs = list(rank_dirs) if rank_dirs else [os.path.join(root, rank_dir_name(r)) for r in range(layout.ranks)]
    nodes = {
        r[0]: r
        for r in conn.execute(
            "SELECT id, key, parent, start_block, end_block, digests, has_snapshot, state, generation "
            "FROM nodes"
        )
    }
    rep.nodes = len(nodes)
    files = conn.execute("SELECT rank, name, node, generation, size, checksum, status, txn FROM files").fetchall()
    journal = conn.execute("SELECT id, kind, state FROM journal").fetchall()
    for tid, kind, state in journal:
        rep.journal.append({"txn": tid, "kind": kind, "state": state,
                            "recovery": "roll forward" if recovery_direction(kind, state) == "forward" else "roll back"})
        if quiescent:
            rep.add(7, f"journal holds unfinished {kind} transaction {tid} in state {state}")
    open_txns = {tid for tid, _, _ in journal}

    _check_ancestry(rep, nodes, layout)
    live_by_node: dict[int, dict[int, tuple]] = {}
    charged = 0
    acct = {"live": 0, "damaged": 0, "garbage": 0, "writing": 0}
    for rank, name, node, gen, size, ck, status, txn in files:
        charged += size
        if status == "live":
            if node not in nodes:
                rep.add(3, f"live file rank{rank}/{name} belongs to missing node {node}")
                continue
            live_by_node.setdefault(node, {})[rank] = (name, gen, size, ck)
            acct["damaged" if nodes[node][7] == "damaged" else "live"] += size
        else:
            acct[status] += size
            if status == "writing" and txn not in open_txns:
                rep.add(3, f"file rank{rank}/{name} is 'writing' with no open transaction")
    rep.accounting = {"charged": charged, "capacity": capacity, **acct, "on_disk": 0}
    if capacity and charged > capacity:
        rep.add(3, f"charged {charged} exceeds capacity {capacity}")

    known = {(rank, name) for rank, name, *_ in files}
    in_flight = {(rank, name) for rank, name, _n, _g, _s, _c, status, _t in files if status == "writing"}
    on_disk = 0
    sizes: dict[tuple[int, str], int] = {}
    for r, d in enumerate(dirs):
        try:
            entries = sorted(os.listdir(d))
        except FileNotFoundError:
            entries = []
        for e in entries:
            p = os.path.join(d, e)
            try:
                sz = os.stat(p).st_size
            except OSError:
                continue
            on_disk += sz
            if (r, e) in known:
                sizes[(r, e)] = sz
            elif e.endswith(".tmp") and (r, e[:-4]) in in_flight:
                continue
            else:
                rep.unknown_files.append(f"rank{r}/{e}")
                rep.add(3, f"file rank{r}/{e} is unknown to the catalog")
    rep.accounting["on_disk"] = on_disk

    for r, name, _node, _gen, size, _ck, status, _ in files:
        if status == "garbage" and sizes.get((r, name), 0) > size:
            rep.add(3, f"garbage file rank{r}/{name} is larger on disk than charged")

    for nid, row in nodes.items():
        _, key, _parent, start, end, _digests, has_snap, state, gen = row
        live = live_by_node.get(nid, {})
        if state != "ready":
            continue
        if set(live) != set(range(layout.ranks)):
            rep.add(1, f"ready node {nid} has shards on ranks {sorted(live)}, needs {layout.ranks}")
            continue
        for r, (name, fgen, size, ck) in sorted(live.items()):
            rep.files_checked += 1
            if fgen != gen:
                rep.add(1, f"node {nid} rank {r}: live file generation {fgen} != row generation {gen}")
            if sizes.get((r, name)) is None:
                rep.add(1, f"node {nid} rank {r}: shard {name} missing")
                continue
            if sizes[(r, name)] != size:
                rep.add(1, f"node {nid} rank {r}: shard {name} is {sizes[(r, name)]} bytes, catalog says {size}")
                continue
            if checksums:
                _check_shard(rep, layout, dirs[r], r, nid, row, name, ck)

    # Invariant 8: no ready node depends on an evicted segment.
    for nid, row in nodes.items():
        if row[7] != "ready":
            continue
        p = row[2]
        while p is not None and p in nodes:
            if not live_by_node.get(p) and nodes[p][7] == "ready":
                rep.add(8, f"ready node {nid} depends on node {p}, which has no backing")
                break
            p = nodes[p][2]

    if expected:
        present = {bytes(r[1]) for r in nodes.values()}
        for k in expected - present:
            rep.add(4, f"acknowledged checkpoint {k.hex()[:16]} is gone")
    return rep


def _check_ancestry(rep: AuditReport, nodes: dict[int, tuple], layout: Layout) -> None:
    keys: dict[int, bytes] = {}
    claimed: dict[bytes, int] = {}

    def key_of(nid: int, seen: set[int]) -> bytes | None:
        if nid in keys:
            return keys[nid]
        row = nodes[nid]
        parent = row[2]
        if nid in seen:
            rep.add(2, f"node {nid} is in a parent cycle")
            return None
        if parent is None:
            pkey = ROOT
            if row[3] != 0:
                rep.add(2, f"root child {nid} starts at block {row[3]}, not 0")
        elif parent not in nodes:
            rep.add(2, f"node {nid} has missing parent {parent}")
            return None
        else:
            pkey = key_of(parent, seen | {nid})
            if pkey is None:
                return None
            if row[3] != nodes[parent][4]:
                rep.add(2, f"node {nid} starts at {row[3]} but parent {parent} ends at {nodes[parent][4]}")
        digests = bytes(row[5])
        if len(digests) != DIGEST_SIZE * (row[4] - row[3]):
            rep.add(2, f"node {nid} holds {len(digests) // DIGEST_SIZE} digests for {row[4] - row[3]} blocks")
            return None
        chain = chain_all(pkey, [digests[i : i + DIGEST_SIZE] for i in range(0, len(digests), DIGEST_SIZE)])
        if chain[-1] != bytes(row[1]):
            rep.add(2, f"node {nid}'s key is not the chained hash of its blocks")
        for k in chain:
            if k in claimed:
                rep.add(2, f"block {k.hex()[:12]} claimed by nodes {claimed[k]} and {nid}")
            claimed[k] = nid
        keys[nid] = bytes(row[1])
        return keys[nid]

    for nid in sorted(nodes, key=lambda i: nodes[i][4]):
        key_of(nid, set())


def _check_shard(rep, layout, d, r, nid, row, name, ck) -> None:
    _, key, _, start, end, _, has_snap, _, gen = row
    try:
        with open(os.path.join(d, name), "rb") as f:
            data = f.read()
    except OSError as exc:
        rep.add(1, f"node {nid} rank {r}: cannot read {name}: {exc}")
        return
    if shards.checksum(data) != ck:
        rep.add(1, f"node {nid} rank {r}: checksum mismatch in {name}")
        return
    meta = {"key": bytes(key).hex(), "generation": str(gen), "start": str(start), "end": str(end),
            "snapshot": "1" if has_snap else "0", "rank": str(r)}
    try:
        shards.decode(data, layout, (end - start) * layout.block_tokens, bool(has_snap), meta)
    except ShardError as exc:
        rep.add(1, f"node {nid} rank {r}: {exc}")
