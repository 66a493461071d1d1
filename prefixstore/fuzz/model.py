"""The fuzzers' reference model: a universe of prefixes, their exact bytes, and the
catalog as committed.

- ``Universe``: a few token sequences that share leading blocks (a small tree of
  conversations). Every tensor a fuzzer stores is a pure function of the tokens (and
  the rank), so a restore can be checked bit for bit without remembering what was
  stored: "exactly the stored bytes or a miss, never other bytes" (invariant 5).
- ``CatalogObserver``: a ``FaultHook`` that reads the node table after every catalog
  commit through its own read-only connection. It tells the model which nodes a
  commit removed (legitimate only for evicting / compacting transactions), and under
  ``synchronous=NORMAL`` it keeps an image of the catalog after every commit since the
  last durability point, so a simulated power loss can restore any of them.

The lost-commits model (``synchronous=NORMAL``): SQLite in WAL mode keeps a prefix of
its commits at power loss; only a commit with ``synchronous=FULL`` (the engine's
``catalog.barrier``, an evict's removal: ``catalog.SYNCED_COMMITS``) syncs the WAL and so
every commit before it. The observer treats the catalog as durable at each of those
commits (and at the images it restored), and
at a power loss the driver picks one image among the durable base and the commits
after it (the last ``keep`` of them). Checkpoints SQLite may run on its own are
ignored, which only ever loses more than a real power loss could.

Under ``synchronous=FULL`` every commit is durable when it returns except the grouped
ones (``volatile``: the store's intent and publish, ``store.GROUPED_COMMITS``, and an
evict's reclaim, ``journal.GROUPED_COMMITS``), which
become durable at the next sync of the log (op ``sync`` of the hook, the group commit)
or the next commit SQLite syncs itself; a power loss may take those, and only those.
"""

from __future__ import annotations

import hashlib
import os
import random
import sqlite3
from collections.abc import Callable
from contextlib import suppress

import attrs
import torch

from prefixstore.base.keys import Prefix
from prefixstore.base.layout import Layout, TensorSpec
from prefixstore.engine.catalog import CATALOG_NAME, SYNCED_COMMITS
from prefixstore.gpu.fileio import FaultHook

BLOCK_TOKENS = 4

# Commit labels (their first dotted part) that must never remove a node row.
NO_REMOVAL = frozenset(
    {"store", "recover", "invalidate", "reclaim", "recency", "barrier", "init", "capacity"}
)


def fuzz_layout(ranks: int, snapshot: bool = True) -> Layout:
    """The small layout every fuzzer uses: 4-token blocks, bf16 segments, fp32 state."""
    return Layout(
        segments=[TensorSpec("k", "bfloat16", (2, 3)), TensorSpec("v", "bfloat16", (2, 3))],
        snapshots=[TensorSpec("state", "float32", (2, 2))] if snapshot else [],
        block_tokens=BLOCK_TOKENS,
        ranks=ranks,
    )


class Universe:
    """``count`` token sequences of ``max_blocks`` blocks sharing prefixes, and their bytes.

    Sequence 0 is random; sequence i > 0 copies the first ``share`` blocks of an earlier
    sequence and continues with fresh tokens, so stores build a tree with interior
    nodes (compactable ancestors) and siblings. Everything derives from ``seed``.
    """

    def __init__(self, layout: Layout, seed: int, count: int = 6, max_blocks: int = 8) -> None:
        self.layout = layout
        self.max_blocks = max_blocks
        bt = layout.block_tokens
        rng = random.Random(f"universe/{seed}")
        seqs: list[list[int]] = []
        for i in range(count):
            fresh = [rng.randrange(1, 50_000) for _ in range(max_blocks * bt)]
            if i == 0:
                seqs.append(fresh)
                continue
            share = rng.randrange(0, max_blocks - 1)
            base = seqs[rng.randrange(i)]
            seqs.append(base[: share * bt] + fresh[share * bt :])
        self.seqs = seqs
        self._prefix: dict[tuple[int, int], Prefix] = {}

    @property
    def count(self) -> int:
        return len(self.seqs)

    def tokens(self, seq: int, blocks: int) -> list[int]:
        return self.seqs[seq][: blocks * self.layout.block_tokens]

    def prefix(self, seq: int, blocks: int) -> Prefix:
        k = (seq, blocks)
        if k not in self._prefix:
            self._prefix[k] = Prefix.from_tokens(self.tokens(seq, blocks), self.layout.block_tokens)
        return self._prefix[k]

    def key(self, seq: int, blocks: int) -> bytes:
        return self.prefix(seq, blocks).keys[-1]

    def keys(self) -> dict[bytes, tuple[int, int]]:
        """Every checkpoint key of the universe -> its first (seq, blocks)."""
        out: dict[bytes, tuple[int, int]] = {}
        for s in range(self.count):
            for b in range(1, self.max_blocks + 1):
                out.setdefault(self.key(s, b), (s, b))
        return out

    # -- bytes ------------------------------------------------------------------------

    def segments(self, seq: int, lo_tokens: int, hi_tokens: int) -> list[dict[str, torch.Tensor]]:
        """Per-rank segment rows of tokens ``[lo, hi)``: a function of (token, position, rank)."""
        toks = torch.tensor(self.seqs[seq][lo_tokens:hi_tokens], dtype=torch.int64)
        pos = torch.arange(lo_tokens, hi_tokens, dtype=torch.int64)
        out = []
        for r in range(self.layout.ranks):
            d = {}
            for i, spec in enumerate(self.layout.segments):
                n = spec.shape[0] * spec.shape[1]
                base = (toks * 7919 + pos * 104_729 + r * 1_299_709 + i * 15_485_863) % 65_521
                grid = base[:, None] * 31 + torch.arange(n, dtype=torch.int64)[None, :] * 977
                val = (grid % 65_521).to(torch.float64) / 64.0 - 512.0
                d[spec.name] = val.reshape(len(toks), *spec.shape).to(spec.torch_dtype)
            out.append(d)
        return out

    def snapshot(self, seq: int, blocks: int) -> list[dict[str, torch.Tensor]] | None:
        """Per-rank recurrent state at the end of ``blocks`` (None without snapshots)."""
        if not self.layout.has_snapshot:
            return None
        raw = b"".join(t.to_bytes(4, "little") for t in self.tokens(seq, blocks))
        h = int.from_bytes(hashlib.blake2b(raw, digest_size=8).digest(), "little")
        out = []
        for r in range(self.layout.ranks):
            d = {}
            for spec in self.layout.snapshots:
                n = 1
                for s in spec.shape:
                    n *= s
                vals = torch.tensor([((h >> (i % 48)) % 10_007 + r * 3 + i) / 7.0 for i in range(n)])
                d[spec.name] = vals.reshape(spec.shape).to(spec.torch_dtype)
            out.append(d)
        return out

    def mismatch(self, seq: int, restored, gpu_tokens: int, end_tokens: int) -> str | None:
        """Why ``restored`` (a ``Restored``) differs from the universe's bytes, or None."""
        L = self.layout
        if restored.start_tokens != gpu_tokens or restored.end_tokens != end_tokens:
            return (f"restored tokens [{restored.start_tokens}, {restored.end_tokens}), "
                    f"expected [{gpu_tokens}, {end_tokens})")
        want = self.segments(seq, gpu_tokens, end_tokens)
        for r in range(L.ranks):
            got = restored.segments[r]
            if set(got) != set(want[r]):
                return f"rank {r}: segment tensors {sorted(got)}"
            for name, t in want[r].items():
                g = got[name]
                if g.dtype != t.dtype or g.shape != t.shape or not torch.equal(g, t):
                    return f"rank {r}: segment {name!r} bytes differ from what was stored"
        if L.has_snapshot:
            ws = self.snapshot(seq, end_tokens // L.block_tokens)
            assert ws is not None
            for r in range(L.ranks):
                got = restored.snapshot[r]
                for name, t in ws[r].items():
                    g = got.get(name)
                    if g is None or g.dtype != t.dtype or g.shape != t.shape or not torch.equal(g, t):
                        return f"rank {r}: snapshot {name!r} bytes differ from what was stored"
        return None


@attrs.frozen
class NodeRow:
    """One committed catalog row, as the observer last read it."""

    id: int
    key: bytes
    parent: int | None
    end: int
    state: str
    has_snapshot: bool
    generation: int


NodeTable = dict[bytes, NodeRow]


@attrs.define
class Image:
    """The catalog after one commit: its bytes (lost-commit mode only) and node table."""

    label: str
    data: bytes | None
    nodes: NodeTable


class CatalogObserver(FaultHook):
    """Reads the committed node table after every catalog commit (see module doc).

    ``on_removed(key, row, label, legit)`` is called for every node a commit removed;
    ``legit`` is False for commits that must never remove one (``NO_REMOVAL``).
    Violations are only recorded by the caller: a hook must not raise into the engine.
    """

    def __init__(
        self,
        root: str,
        *,
        lost_commits: bool,
        volatile: frozenset[str] = frozenset(),
        keep: int = 64,
        on_removed: Callable[[bytes, NodeRow, str, bool], None] | None = None,
    ) -> None:
        self.root = root
        self.path = os.path.join(root, CATALOG_NAME)
        self.lost_commits = lost_commits
        self.volatile = volatile
        self.keep = keep
        self.on_removed = on_removed
        self.conn: sqlite3.Connection | None = None
        self.nodes: NodeTable = {}
        self.images: list[Image] = []
        self.commits = 0

    # -- hook -------------------------------------------------------------------------

    @property
    def keeps_images(self) -> bool:
        """Whether a power loss may take commits (NORMAL, or FULL's grouped commits)."""
        return self.lost_commits or bool(self.volatile)

    def after(self, op: str, target: str, rank: int | None) -> None:
        if op == "sync" and self.images:
            self.images = self.images[-1:]  # the group commit: every commit so far is durable
        if op == "commit":
            self.commits += 1
            self.refresh(target)

    # -- reading ----------------------------------------------------------------------

    def _connect(self) -> sqlite3.Connection:
        if self.conn is None:
            self.conn = sqlite3.connect(
                f"file:{self.path}?mode=ro", uri=True, isolation_level=None, check_same_thread=False
            )
        return self.conn

    def read_nodes(self) -> NodeTable:
        rows = self._connect().execute(
            "SELECT id, key, parent, end_block, state, has_snapshot, generation FROM nodes"
        ).fetchall()
        return {
            bytes(r[1]): NodeRow(r[0], bytes(r[1]), r[2], r[3], r[4], bool(r[5]), r[6]) for r in rows
        }

    def refresh(self, label: str) -> None:
        """Re-read the node table after commit ``label``; report removals; keep an image."""
        new = self.read_nodes()
        legit = label.split(".")[0] not in NO_REMOVAL
        for key, row in self.nodes.items():
            cur = new.get(key)
            if (cur is None or cur.id != row.id) and self.on_removed is not None:
                self.on_removed(key, row, label, legit)
        self.nodes = new
        if self.keeps_images:
            image = Image(label, self._connect().serialize(), new)
            durable = label in SYNCED_COMMITS if self.lost_commits else label not in self.volatile
            if durable or not self.images:
                self.images = [image]  # durable: every earlier commit is synced
            else:
                self.images.append(image)
                if len(self.images) > self.keep:
                    del self.images[1]  # keep the durable base and the latest commits

    def start(self) -> None:
        """Begin a run: the catalog as it is now is durable."""
        self.nodes = self.read_nodes()
        self.images = []
        if self.keeps_images:
            self.images = [Image("start", self._connect().serialize(), self.nodes)]

    def by_id(self) -> dict[int, NodeRow]:
        return {row.id: row for row in self.nodes.values()}

    def files(self) -> list[tuple[int, str, int | None, str]]:
        """(rank, name, node, status) of every file row, sorted."""
        return sorted(self._connect().execute("SELECT rank, name, node, status FROM files").fetchall())

    def detach(self) -> None:
        """Close the read connection (the engine died, or the catalog is being replaced)."""
        if self.conn is not None:
            with suppress(sqlite3.Error):
                self.conn.close()
            self.conn = None

    # -- power loss ---------------------------------------------------------------------

    def lose_commits(self, pick: float) -> Image:
        """Replace the catalog by one of its possible post-power-loss states.

        ``pick`` in [0, 1) chooses among the durable base and the later images. Only in
        lost-commit mode; the engine must be dead. The chosen image becomes durable.
        """
        assert self.keeps_images and self.images
        image = self.images[min(len(self.images) - 1, int(pick * len(self.images)))]
        self.detach()
        for suffix in ("-wal", "-shm"):
            with suppress(FileNotFoundError):
                os.unlink(self.path + suffix)
        assert image.data is not None
        with open(self.path, "wb") as f:
            f.write(image.data)
        self.nodes = dict(image.nodes)
        self.images = [image]
        return image
