"""Rebuild a lost catalog from the shards' own headers (``prefixstore audit --repair``).

A shard's safetensors header names its checkpoint: key, generation, span, rank and
snapshot flag (what every read verifies), and, so that the catalog can be rebuilt
without it (``shards.provenance``), the node's block digests, the key it chains from,
and on a root node's shards the cache's layout. What the headers do not hold: the
capacity (taken from the caller, else from a readable old catalog, else the bytes of
the shards adopted, so that nothing is evicted), recency (nodes are ranked by their
files' modification times) and the meta rows the engine adds when it opens (backing,
calibration).

Steps, with the directory lock held and no engine running:

1. Read every rank directory's headers (``rankR/`` of the cache, or the directories
   named); the layout is the one most root nodes' shards name (else the old catalog's,
   when it still records one).
2. Read and verify each shard against its own header and the layout (tensor names,
   dtypes, shapes, span, rank; the digests chain from the parent key to the key); the
   shards of one (key, generation) must agree on every rank.
3. Place the checkpoints best-first from the root: a node is adopted when its parent
   was, when no adopted node claims one of its blocks, and when no other generation of
   its key was adopted; complete ones (a verified shard on every rank) first, then the
   shorter span, then one with a snapshot, then the newer generation. A node missing
   shards on some ranks is adopted damaged, and only as the ancestor of an adopted
   node (its descendants keep their links; a refill serves it again).
4. Everything not adopted (what does not verify, superseded generations, temporaries,
   foreign entries) moves to ``lost+found/``: nothing is unlinked. Each rank directory
   moved out of is fsynced before step 5: an entry still there (or back after a power
   loss) once the new catalog is committed would be an orphan to it, unlinked by the
   next open.
5. The old catalog files (``catalog.sqlite`` and whichever of its ``-wal``, ``-shm``
   and ``-journal`` are there) move to ``lost+found/catalog-N/``; that directory and
   ``lost+found/`` are fsynced. A new catalog is created, then the cache's root is
   fsynced (the old names' removal and the new catalog's entry durable at once, after
   their new home is), and the catalog is written in one commit. A crash before that
   commit leaves a directory the next repair rebuilds again; after it (a power loss
   included), one the engine opens as it is (``tests/test_crash_rebuild_remote.py``).
   SQLite fsyncs the root itself when it first syncs a new catalog's journal, but
   ignores a failure of that fsync and never syncs ``lost+found/``: the rebuild does
   not count on it.

Shard bytes are covered by their checksums only once a catalog records them: a bit flip
inside a tensor's data that happened while the catalog was lost cannot be told from
the stored bytes (the header, shapes and chain still are checked).
"""

from __future__ import annotations

import heapq
import os
import struct
from collections import Counter
from collections.abc import Sequence
from typing import Any

import attrs

from prefixstore.base.errors import (
    CatalogLostError,
    LayoutError,
    NotRegularFileError,
    RankDirMissingError,
    ShardError,
)
from prefixstore.base.keys import DIGEST_SIZE, ROOT, chain_all
from prefixstore.base.layout import Layout
from prefixstore.engine.audit import read_shard_bytes, verify_bytes
from prefixstore.engine.cachedirs import LOST_FOUND, check_own_dirs
from prefixstore.engine.catalog import LOG_SUFFIXES, Catalog, catalog_path
from prefixstore.engine.trust import RANK_DIR_RE
from prefixstore.gpu import shards
from prefixstore.gpu.diskroom import DiskRoom
from prefixstore.gpu.fileio import FaultHook, FileSystem, HookedFS, OsFS, open_regular
from prefixstore.gpu.ranks import LocalRank, rank_dir_name, shard_name

_JOURNAL_SUFFIX = "-journal"


@attrs.define
class Piece:
    """One rank's shard file as its header describes it."""

    rank: int
    name: str
    prov: shards.Provenance
    mtime: int
    size: int = 0
    checksum: str = ""


@attrs.define(eq=False)
class Candidate:
    """One (key, generation) whose shards agree: a node the catalog may record."""

    prov: shards.Provenance
    pieces: dict[int, Piece]
    complete: bool

    @property
    def order(self) -> tuple:
        p = self.prov
        return (not self.complete, p.end - p.start, not p.snapshot, -p.generation, p.key)

    @property
    def mtime(self) -> int:
        return max(x.mtime for x in self.pieces.values())


@attrs.define
class RebuildReport:
    """What the rebuild found and did."""

    why: str = ""
    layout: str = ""
    """The layout's JSON the catalog records."""
    capacity: int = 0
    nodes: int = 0
    damaged: int = 0
    files: int = 0
    quarantined: list[str] = attrs.field(factory=list)
    old_catalog: list[str] = attrs.field(factory=list)

    def lines(self) -> list[str]:
        out = [f"rebuilt the catalog from the shards' headers ({self.why}): {self.nodes} nodes "
               f"({self.damaged} damaged), {self.files} shard files, capacity {self.capacity} bytes"]
        out += [f"moved the old catalog's {m}" for m in self.old_catalog]
        out += [f"moved {q} to lost+found/" for q in self.quarantined]
        return out


class RebuildError(CatalogLostError):
    """The catalog cannot be rebuilt from what the directory holds; nothing was changed."""


def _head(path: str) -> bytes:
    """The first bytes of a shard file: its header length and header (no data read)."""
    fd = open_regular(path)
    try:
        first = os.pread(fd, 8, 0)
        if len(first) < 8:
            return first
        (n,) = struct.unpack("<Q", first)
        return first + os.pread(fd, min(n, shards.MAX_HEADER), 8)
    finally:
        os.close(fd)


def _chains(p: shards.Provenance) -> list[bytes] | None:
    """The block keys of the node a header describes (None unless they end at its key)."""
    d = p.digests
    if len(d) != DIGEST_SIZE * (p.end - p.start) or (p.start == 0) != (p.parent == ROOT):
        return None
    keys = chain_all(p.parent, [d[i : i + DIGEST_SIZE] for i in range(0, len(d), DIGEST_SIZE)])
    return keys if keys[-1] == p.key else None


def _header(rank: Any, entry: str) -> tuple[bytes, int] | str:
    """The first bytes of ``entry`` (its header, at least) and its modification time, or
    why it is no shard. A rank object that is not a local directory (a rank server) is
    read through ``read_shard``, the whole file; it reports no modification time (0)."""
    if not isinstance(rank, LocalRank):
        return rank.read_shard(entry), 0  # a rank server reads regular files only: NotRegularFileError
    st = os.lstat(rank.path(entry))
    if not rank.is_file(entry):
        return "not a regular file"
    return _head(rank.path(entry)), st.st_mtime_ns


def _scan(ranks: Sequence[Any], bad: list[tuple[Any, str, str]]) -> list[Piece]:
    """Every shard whose header names itself consistently; the rest into ``bad``."""
    out = []
    for rank in ranks:
        for entry in sorted(rank.listdir()):
            try:
                got = _header(rank, entry)
                if isinstance(got, str):
                    bad.append((rank, entry, got))
                    continue
                head, mtime = got
                prov = shards.read_provenance(head)
            except (ShardError, NotRegularFileError) as exc:
                bad.append((rank, entry, str(exc)))
                continue
            except FileNotFoundError:
                continue
            why = None
            if entry != shard_name(prov.key, prov.generation):
                why = f"its header names {shard_name(prov.key, prov.generation)}"
            elif prov.rank != rank.rank:
                why = f"its header names rank {prov.rank}"
            elif _chains(prov) is None:
                why = "its block digests do not chain to its key"
            if why:
                bad.append((rank, entry, why))
            else:
                out.append(Piece(rank.rank, entry, prov, mtime))
    return out


def _layout(pieces: Sequence[Piece], known: Layout | None) -> Layout:
    """The cache's layout: what most root nodes' shards name (the bytes are written in
    it), else ``known`` (a readable old catalog's)."""
    votes = Counter(p.prov.layout for p in pieces if p.prov.layout)
    for text, _ in votes.most_common():
        try:
            return shards.layout_from_code(text)
        except LayoutError:
            continue
    if known is not None:
        return known
    raise RebuildError("no root node's shard names the cache's layout (no shard left, or shards written "
                       "before they carried it): the catalog cannot be rebuilt; nothing was changed. To start "
                       "a new cache here, move catalog.sqlite and lost+found/ out of the directory")


def _verified(ranks: dict[int, Any], layout: Layout, pieces: Sequence[Piece],
              bad: list[tuple[Any, str, str]]) -> list[Piece]:
    """The pieces whose whole file verifies against its header and ``layout``."""
    out = []
    for piece in pieces:
        rank = ranks[piece.rank]
        p = piece.prov
        if piece.rank >= layout.ranks:
            bad.append((rank, piece.name, f"rank {piece.rank} is not one of the layout's {layout.ranks}"))
            continue
        if p.layout is not None and not _same_layout(p.layout, layout):
            bad.append((rank, piece.name, "its header names another layout"))
            continue
        try:
            data = read_shard_bytes(rank.path(piece.name)) if isinstance(rank, LocalRank) else \
                rank.read_shard(piece.name)
        except (OSError, NotRegularFileError) as exc:
            bad.append((rank, piece.name, f"unreadable: {exc}"))
            continue
        ck = shards.checksum(data)
        row = (None, p.key, None, p.start, p.end, p.digests, p.snapshot, "ready", p.generation)
        why = verify_bytes(layout, data, piece.rank, row, ck)
        if why is not None or (p.snapshot and not layout.has_snapshot):
            bad.append((rank, piece.name, why or "it holds a snapshot the layout has not"))
            continue
        piece.size, piece.checksum = len(data), ck
        out.append(piece)
    return out


def _same_layout(text: str, own: Layout) -> bool:
    try:
        return shards.layout_from_code(text) == own
    except LayoutError:
        return False


def _candidates(pieces: Sequence[Piece], ranks: int, bad: list[tuple[int, str, str]]) -> list[Candidate]:
    """Group the pieces by (key, generation); the claim most ranks agree on wins."""
    groups: dict[tuple[bytes, int], dict[tuple, dict[int, Piece]]] = {}
    for x in pieces:
        p = x.prov
        claim = (p.start, p.end, p.snapshot, p.parent, p.digests)
        groups.setdefault((p.key, p.generation), {}).setdefault(claim, {})[x.rank] = x
    out = []
    for claims in groups.values():
        ranked = sorted(claims.values(), key=len, reverse=True)
        keep = None if len(ranked) > 1 and len(ranked[0]) == len(ranked[1]) else ranked[0]
        for other in ranked:
            if other is not keep:
                bad += [(r, x.name, "its ranks' headers disagree about the checkpoint") for r, x in other.items()]
        if keep is not None:
            first = next(iter(keep.values()))
            out.append(Candidate(first.prov, keep, set(keep) == set(range(ranks))))
    return out


def place(cands: Sequence[Candidate]) -> list[Candidate]:
    """The candidates adopted (parents before children); see step 3 of the module docstring."""
    children: dict[bytes, list[Candidate]] = {}
    for c in cands:
        children.setdefault(c.prov.parent, []).append(c)
    heap = [(c.order, id(c), c) for c in children.get(ROOT, [])]
    heapq.heapify(heap)
    adopted: dict[bytes, Candidate] = {}
    claimed: set[bytes] = set()
    order: list[Candidate] = []
    while heap:
        _, _, c = heapq.heappop(heap)
        keys = _chains(c.prov)
        if c.prov.key in adopted or keys is None or claimed.intersection(keys):
            continue
        adopted[c.prov.key] = c
        claimed.update(keys)
        order.append(c)
        for child in children.get(c.prov.key, []):
            if child.prov.start == c.prov.end:
                heapq.heappush(heap, (child.order, id(child), child))
    # a damaged node stays only as an ancestor of an adopted node
    needed = {c.prov.parent for c in order}
    while True:
        drop = [c for c in order if not c.complete and c.prov.key not in needed]
        if not drop:
            return order
        order = [c for c in order if c not in drop]
        needed = {c.prov.parent for c in order}


def _ranks(root: str, rank_dirs: Sequence[str] | None, hook: Any, fs: Any) -> list[LocalRank]:
    """The rank directories to read: those named, else every ``rankR/`` of ``root``
    (refused, nothing touched, when one of them or ``lost+found/`` is not a real directory)."""
    if rank_dirs:
        return [LocalRank(r, d, fs, hook) for r, d in enumerate(rank_dirs)]
    top = max((int(e[4:]) for e in os.listdir(root) if RANK_DIR_RE.match(e)), default=-1)
    check_own_dirs(root, top + 1)
    return [LocalRank(r, os.path.join(root, rank_dir_name(r)), fs, hook) for r in range(top + 1)
            if os.path.isdir(os.path.join(root, rank_dir_name(r)))]


def _check_ranks(root: str, ranks: Sequence[Any], layout: Layout, named: bool) -> None:
    """Refuse (nothing changed) unless every rank of ``layout`` has its directory:
    rebuilding without one would leave every node without its shards there."""
    if named and len(ranks) != layout.ranks:
        raise RankDirMissingError(f"{len(ranks)} rank directories named, the layout has {layout.ranks} ranks; "
                                  "nothing was changed")
    have = {r.rank for r in ranks}
    missing = [rank_dir_name(r) for r in range(layout.ranks) if r not in have]
    if missing:
        raise RankDirMissingError(
            f"{root}: rank directories missing: {', '.join(missing)} (the layout has {layout.ranks} ranks); "
            "if they are kept elsewhere, name every rank directory with --rank-dir PATH (once per rank, "
            "in order); nothing was changed"
        )


def _dirs(fs: FileSystem | None, hook: Any) -> HookedFS:
    """The file system that fsyncs the cache's own directories (effects reported to
    ``hook`` with no rank)."""
    return HookedFS(fs or OsFS(), hook or FaultHook(), None)


def _move_old_catalog(root: str, hook: Any = None, fs: FileSystem | None = None) -> list[str]:
    """Move the catalog's files into a new ``lost+found/catalog-N/`` (main file first),
    then fsync that directory and ``lost+found/`` (``write_catalog`` fsyncs ``root``).
    Each rename is reported to ``hook`` (op ``rename``, no rank), and each directory
    fsync (op ``fsync_dir``)."""
    path = catalog_path(root)
    present = [path + s for s in ("", *LOG_SUFFIXES, _JOURNAL_SUFFIX) if os.path.lexists(path + s)]
    if not present:
        return []
    lf = os.path.join(root, LOST_FOUND)
    os.makedirs(lf, exist_ok=True)
    n = 1
    while os.path.lexists(os.path.join(lf, f"catalog-{n}")):
        n += 1
    dest = os.path.join(lf, f"catalog-{n}")
    os.mkdir(dest)
    out = []
    for p in present:
        if hook is not None:
            hook.before("rename", p, None)
        os.rename(p, os.path.join(dest, os.path.basename(p)))
        if hook is not None:
            hook.after("rename", p, None)
        out.append(f"{os.path.basename(p)} to {LOST_FOUND}/catalog-{n}/")
    dirs = _dirs(fs, hook)
    for d in (dest, lf):
        dirs.fsync_dir(d)
    return out


def rebuild(root: str, why: str, *, rank_dirs: Sequence[str] | None = None, layout: Layout | None = None,
            capacity: int | None = None, hook: Any = None, fs: Any = None,
            ranks: Sequence[Any] | None = None) -> RebuildReport:
    """Rebuild the catalog of ``root`` from its shards (the caller holds the directory
    lock); ``why``: what was wrong with the old one. ``layout`` / ``capacity``: what a
    readable old catalog recorded, or the caller's. ``ranks``: the ranks as connected
    rank objects (rank servers: every listing, read and quarantine asked of them)
    instead of directories. Raises RebuildError (nothing changed) when no layout can be
    found."""
    named = bool(rank_dirs) or ranks is not None
    ranks = list(ranks) if ranks is not None else _ranks(root, rank_dirs, hook, fs)
    bad: list[tuple[Any, str, str]] = []
    pieces = _scan(ranks, bad)
    L = _layout(pieces, layout)
    _check_ranks(root, ranks, L, named)
    by_rank = {r.rank: r for r in ranks}
    pieces = _verified(by_rank, L, pieces, bad)
    misfits: list[tuple[int, str, str]] = []
    cands = _candidates(pieces, L.ranks, misfits)
    adopted = place(cands)
    keep = {(r, x.name) for c in adopted for r, x in c.pieces.items()}
    rejected = [(by_rank[x.rank], x.name, "superseded, or not placed in any prefix") for c in cands
                for x in c.pieces.values() if (x.rank, x.name) not in keep]
    rep = RebuildReport(why=why)
    quarantine_rejected(rep, bad + [(by_rank[r], n, w) for r, n, w in misfits] + rejected, L.ranks)
    total = sum(x.size for c in adopted for x in c.pieces.values())
    rep.capacity = int(capacity) if capacity is not None else max(total, 1)
    rep.old_catalog = _move_old_catalog(root, hook, fs)
    write_catalog(root, L, rep.capacity, adopted, hook, fs)
    rep.layout, rep.nodes, rep.files = L.to_json(), len(adopted), len(keep)
    rep.damaged = sum(1 for c in adopted if not c.complete)
    return rep


def quarantine_rejected(rep: RebuildReport, moves: Sequence[tuple[Any, str, str]], ranks: int) -> None:
    """Move each (rank, entry, reason) of ``moves`` into ``lost+found/`` and make the moves
    durable (a fsync of each rank directory moved out of), before the new catalog is
    written: once it is, an entry left in a rank directory (or brought back by a power
    loss) is an orphan to it, which the next open unlinks."""
    moved: dict[int, Any] = {}
    for rank, entry, reason in moves:
        if rank.rank < ranks:  # a directory beyond the layout's ranks is not the cache's: left alone
            rank.quarantine(entry)
            rep.quarantined.append(f"rank{rank.rank}/{entry} ({reason})")
            moved[rank.rank] = rank
    for rank in moved.values():
        rank.sync_dir()


def write_catalog(root: str, layout: Layout, capacity: int, adopted: Sequence[Candidate], hook: Any,
                  fs: FileSystem | None = None) -> None:
    """A new catalog holding ``adopted`` (parents first), in one commit; ``root`` is
    fsynced between the catalog's creation and that commit, so a power loss after the
    commit neither takes the catalog's entry nor brings back an old catalog's names."""
    cat = Catalog(root, hook=hook, before_write=DiskRoom(root).before_catalog_write)
    try:
        _dirs(fs, hook).fsync_dir(root)
        used = {id(c): i + 1 for i, c in enumerate(sorted(adopted, key=lambda c: (c.mtime, c.prov.key)))}
        with cat.txn("repair.rebuild") as c:
            cat.set_meta(c, "layout", layout.to_json())
            cat.set_meta(c, "capacity", str(capacity))
            ids: dict[bytes, int] = {}
            for cand in adopted:
                p = cand.prov
                nid = cat.insert_node(c, p.key, ids.get(p.parent), p.start, p.end, p.digests, p.snapshot,
                                      p.generation, used[id(cand)])
                ids[p.key] = nid
                if not cand.complete:
                    cat.mark_damaged(c, nid)
                for r, x in sorted(cand.pieces.items()):
                    cat.insert_live_file(c, r, x.name, nid, p.generation, x.size, x.checksum)
    finally:
        cat.close()

