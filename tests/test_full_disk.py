"""A full disk the engine can always leave, on a real small file system the test mounts.

Each test mounts its own tmpfs (``size=``; CI runs as root) and unmounts it in a
fixture finalizer, also on failure. The cache's capacity is larger than the file
system, so its own shards fill it; a filler file then takes the rest, as another
writer on the same disk would. Stores, evictions, reclaims and reopens must keep
working without a manual step, the audit stays clean, and every checkpoint the
catalog still holds restores bit for bit.
"""

from __future__ import annotations

import contextlib
import os

import pytest
import torch

from prefixstore.base.errors import (
    DiskFullError,
    InvalidArgumentError,
    ReadOnlyError,
    SimulatedCrash,
)
from prefixstore.base.keys import Prefix
from prefixstore.base.layout import Layout, TensorSpec
from prefixstore.engine import evict, lifecycle, replace, restore
from prefixstore.engine.api import Engine
from prefixstore.engine.audit import audit_dir
from prefixstore.engine.repair import repair
from prefixstore.gpu.diskroom import RESERVE_NAME, free_bytes
from prefixstore.gpu.fileio import FaultHook

BT = 4
LAYOUT = Layout(
    segments=[TensorSpec("k", "float32", (16, 64)), TensorSpec("v", "float32", (16, 64))],
    snapshots=[TensorSpec("state", "float32", (32, 64))],
    block_tokens=BT,
    ranks=2,
)  # 32 KiB per block and 8 KiB of snapshot per rank
CAP = 1 << 30  # far above the file system: the disk is the limit


def conversation(seed: int, blocks: int, longest: int = 8) -> tuple[list[int], list[dict]]:
    """The first ``blocks`` blocks of conversation ``seed``: tokens and per-rank rows."""
    g = torch.Generator().manual_seed(seed)
    n = blocks * BT
    toks = torch.randint(0, 50_000, (longest * BT,), generator=g).tolist()[:n]
    segs = [{s.name: torch.randn((longest * BT, *s.shape), generator=g)[:n] for s in LAYOUT.segments}
            for _ in range(LAYOUT.ranks)]
    return toks, segs


def store(eng: Engine, seed: int, blocks: int):
    toks, segs = conversation(seed, blocks)
    snap = [{"state": torch.full((32, 64), float(seed * 1000 + blocks * 10 + r))} for r in range(LAYOUT.ranks)]
    return eng.store(Prefix.from_tokens(toks, BT), segs, snap)


def assert_every_node_restores(eng: Engine, stored: dict[tuple[int, int], bool]) -> int:
    """Every stored checkpoint still in the catalog restores bit for bit; returns how many."""
    found = 0
    for seed, blocks in stored:
        toks, segs = conversation(seed, blocks)
        key = Prefix.from_tokens(toks, BT).keys[-1]
        if key not in eng.index.by_key:
            continue  # evicted by a committed evict
        if not eng.index.nodes[eng.index.by_key[key]].has_snapshot:
            continue  # its snapshot retired by a committed eviction: no longer an endpoint
        m = eng.lookup(Prefix.from_tokens(toks, BT))
        assert m.hit and m.blocks == blocks, (seed, blocks, m)
        got = eng.restore(m)
        assert got is not None, (seed, blocks)
        for r in range(LAYOUT.ranks):
            for name, t in got.segments[r].items():
                assert torch.equal(t, segs[r][name]), (seed, blocks, r, name)
            want = float(seed * 1000 + blocks * 10 + r)
            assert torch.equal(got.snapshot[r]["state"], torch.full((32, 64), want))
        found += 1
    return found


def fill(mnt: str, name: str = "filler") -> str:
    """Another writer takes every free byte of the file system."""
    path = os.path.join(mnt, name)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        for size in (1 << 20, 64 << 10, 4 << 10):
            with contextlib.suppress(OSError):
                while True:
                    os.write(fd, b"\xa5" * size)
    finally:
        os.close(fd)
    assert free_bytes(mnt) < 4096
    return path


def fill_cache(eng: Engine, first: int, count: int, stored: dict) -> None:
    """Conversations of 4 then 8 blocks (a chain: an interior checkpoint and a leaf)."""
    for seed in range(first, first + count):
        for blocks in (4, 8):
            res = store(eng, seed, blocks)
            assert res.status == "stored", (seed, blocks, res)
            stored[(seed, blocks)] = True


def test_cache_fills_its_file_system_and_keeps_working(small_fs):
    root = os.path.join(small_fs, "cache")
    stored: dict[tuple[int, int], bool] = {}
    with Engine.open(root, LAYOUT, CAP) as eng:
        fill_cache(eng, 0, 40, stored)  # about 40 MiB of shards into 16 MiB
        evictions = {k: v for k, v in eng.counters.snapshot().items() if k.startswith("evictions.")}
        assert evictions, "the disk, not the capacity, made the cache evict"
        assert os.path.isfile(os.path.join(root, RESERVE_NAME))
        assert eng.audit().ok
        assert_every_node_restores(eng, stored)
        for blocks in (4, 8):  # the most recent conversation is kept
            assert (39, blocks) in stored and eng.lookup(Prefix.from_tokens(conversation(39, blocks)[0], BT)).hit

        # Another writer takes the rest of the disk: every call still works.
        filler = fill(small_fs)
        res = store(eng, 100, 4)
        assert res.status in ("stored", "failed", "refused"), res
        if res.status == "stored":
            stored[(100, 4)] = True
        assert eng.evict(256 << 10) > 0
        eng.reclaim()
        assert eng.stats()["disk"]["reserve_releases"] >= 1  # the full disk took the reserve
        rep = eng.audit()
        assert rep.ok, rep.violations
    # reopen on the full disk, twice (a clean close, then a reopen of that)
    for _ in range(2):
        with Engine.open(root, LAYOUT, CAP) as eng:
            rep = eng.audit()
            assert rep.ok, rep.violations
            assert assert_every_node_restores(eng, stored) > 0
    os.unlink(filler)
    with Engine.open(root, LAYOUT, CAP) as eng:
        fill_cache(eng, 200, 5, stored)
        assert assert_every_node_restores(eng, stored) >= 10
        rep = eng.audit()
        assert rep.ok, rep.violations
    assert audit_dir(root).ok


class _CrashBeforeWrite(FaultHook):
    """Process death before a rank (``rank``, or any) writes a shard whose name contains ``match``."""

    def __init__(self, match: str, rank: int | None = None) -> None:
        self.match, self.rank = match, rank

    def before(self, op, target, rank):
        if op == "write" and self.rank in (None, rank) and self.match in target:
            raise SimulatedCrash(f"crash before writing {target}")


@pytest.mark.parametrize("via", ["open", "repair"])
@pytest.mark.parametrize("reserve", ["held", "deleted"])
def test_open_on_a_full_disk_finishes_an_unfinished_compaction_rollback(small_fs, reserve, via):
    """A snapshot retirement (a compact-replace) dies after rank 0 wrote its new shard;
    the disk then fills up. The next open (or ``audit --repair``) rolls the compaction
    back and evicts nothing for room, and the cache serves: writable when the reserve
    it released left room, read-only when nothing is left."""
    root = os.path.join(small_fs, "cache")
    stored: dict[tuple[int, int], bool] = {}
    with Engine.open(root, LAYOUT, CAP) as eng:
        fill_cache(eng, 0, 6, stored)
    interior = Prefix.from_tokens(conversation(3, 4)[0], BT).keys[-1]
    eng = Engine.open(root, LAYOUT, CAP, hook=_CrashBeforeWrite(interior.hex(), rank=1))
    node = eng.index.nodes[eng.index.by_key[interior]]
    with pytest.raises(SimulatedCrash), eng.guard.lock:
        replace.retire_snapshot(eng.flows.replacing, node)  # what eviction runs on a compactable ancestor
    lifecycle.abandon(eng.life)  # process death: the connection and the lock go, nothing more is committed
    if reserve == "deleted":
        with contextlib.suppress(FileNotFoundError):  # nothing left to release
            os.unlink(os.path.join(root, RESERVE_NAME))
    filler = fill(small_fs)
    try:
        if via == "repair":
            fixed, final = repair(root)
            assert final.ok, final.violations
            assert any("rolled back" in line for line in fixed.lines()), fixed.lines()
        with Engine.open(root, LAYOUT, CAP) as eng:
            if via == "open":
                assert eng.recovery_report.rolled_back, eng.recovery_report
            assert not eng.catalog.journal()
            rep = eng.audit()
            assert rep.ok, rep.violations
            assert assert_every_node_restores(eng, stored) == len(stored)  # nothing evicted for room
            if reserve == "held":  # the reserve released at open left room: writable
                assert eng.read_only is None
                assert eng.evict(64 << 10) > 0
            else:  # recovered, and still no room: read-only rather than evict
                assert isinstance(eng.read_only, DiskFullError), eng.read_only
                assert "rather than evict" in str(eng.read_only)
                with pytest.raises(ReadOnlyError):
                    eng.evict(64 << 10)
        with Engine.open(root, LAYOUT, CAP) as eng:  # and again, still full
            assert eng.audit().ok
    finally:
        os.unlink(filler)
    with Engine.open(root, LAYOUT, CAP) as eng:
        fill_cache(eng, 50, 3, stored)
        assert assert_every_node_restores(eng, stored) >= 6
        assert os.path.isfile(os.path.join(root, RESERVE_NAME))  # taken back once there is room
        assert eng.audit().ok


def test_open_on_a_disk_another_writer_holds_entirely_names_the_disk(small_fs):
    """Nothing the cache may free without a commit (no reserve, no garbage) and not a
    byte free: open with ``read_only_fallback=False`` refuses with DiskFullError and changes nothing; once the other
    writer lets go, the cache opens and serves."""
    root = os.path.join(small_fs, "cache")
    stored: dict[tuple[int, int], bool] = {}
    with Engine.open(root, LAYOUT, CAP) as eng:
        fill_cache(eng, 0, 4, stored)
    with contextlib.suppress(FileNotFoundError):
        os.unlink(os.path.join(root, RESERVE_NAME))
    rank0 = sorted(os.listdir(os.path.join(root, "rank0")))
    filler = fill(small_fs)
    try:
        with pytest.raises(DiskFullError, match="the disk is full"):
            Engine.open(root, LAYOUT, CAP, read_only_fallback=False)
        assert sorted(os.listdir(os.path.join(root, "rank0"))) == rank0
    finally:
        os.unlink(filler)
    with Engine.open(root, LAYOUT, CAP) as eng:
        assert assert_every_node_restores(eng, stored) == len(stored)
        assert eng.audit().ok


def test_eviction_frees_bytes_on_a_full_disk_whose_reserve_is_spent(small_fs):
    """The reserve went to an earlier commit and another writer took those bytes too:
    an eviction still frees room (its files go before its commit), and the cache goes on."""
    root = os.path.join(small_fs, "cache")
    stored: dict[tuple[int, int], bool] = {}
    with Engine.open(root, LAYOUT, CAP) as eng:
        fill_cache(eng, 0, 8, stored)
        filler = fill(small_fs)
        assert eng.evict(64 << 10) > 0  # its commit released the reserve
        assert not os.path.exists(os.path.join(root, RESERVE_NAME))
        fill(small_fs)  # the other writer takes what the reserve and the eviction freed
        assert eng.evict(64 << 10) > 0
        os.unlink(filler)
        rep = eng.audit()
        assert rep.ok, rep.violations
        assert assert_every_node_restores(eng, stored) > 0
        fill_cache(eng, 20, 2, stored)
    with Engine.open(root, LAYOUT, CAP) as eng:
        assert eng.audit().ok
        assert assert_every_node_restores(eng, stored) > 0


class _CrashAtCommit(FaultHook):
    def __init__(self, label: str) -> None:
        self.label, self.armed = label, False

    def before(self, op, target, rank):
        if self.armed and op == "commit" and target == self.label:
            raise SimulatedCrash(f"crash before commit {target}")


def test_crash_between_the_early_unlink_and_the_evict_commit(small_fs):
    """Process death after a full-disk eviction unlinked its victims' files, before its
    commit: the next open marks those nodes damaged (never served), the others restore."""
    root = os.path.join(small_fs, "cache")
    stored: dict[tuple[int, int], bool] = {}
    hook = _CrashAtCommit("evict.remove")
    eng = Engine.open(root, LAYOUT, CAP, hook=hook)
    fill_cache(eng, 0, 8, stored)
    with contextlib.suppress(FileNotFoundError):
        os.unlink(os.path.join(root, RESERVE_NAME))  # spent
    filler = fill(small_fs)
    hook.armed = True
    with pytest.raises(SimulatedCrash):
        eng.evict(64 << 10)
    assert eng.guard.closed
    os.unlink(filler)
    with Engine.open(root, LAYOUT, CAP) as eng:
        assert eng.recovery_report.damaged  # the victims: rows kept, files gone
        rep = eng.audit()
        assert rep.ok, rep.violations
        assert assert_every_node_restores_or_damaged(eng, stored) > 0


class _CrashInBatch(FaultHook):
    """Crashes before unlink number ``unlinks`` (0-based) or, with None, before the
    commit ``label``; counts only while ``armed``."""

    def __init__(self, unlinks: int | None, label: str = "evict.remove") -> None:
        self.unlinks, self.label, self.armed, self.seen = unlinks, label, False, 0

    def before(self, op, target, rank):
        if not self.armed:
            return
        if op == "unlink":
            if self.seen == self.unlinks:
                raise SimulatedCrash(f"crash before unlink {self.seen} ({target})")
            self.seen += 1
        elif op == "commit" and self.unlinks is None and target == self.label:
            raise SimulatedCrash(f"crash before commit {target}")


@pytest.mark.parametrize("unlinks", [1, 2, None], ids=["inside-a-victim", "between-victims", "before-commit"])
def test_crash_inside_a_batched_early_unlink_loses_no_survivor(small_fs, unlinks):
    """A full disk, no reserve: one pass batches three victims (a leaf, the parent it
    leaves a leaf, the next leaf; two ranks) and unlinks their files before its one
    commit. Process death between those unlinks (half a victim's files gone, or one
    victim's) or before the commit: the next open finds the victims ready (files
    intact) or damaged (never served), every other checkpoint ready and bit-exact, no
    file unknown to the catalog, the journal empty; the damaged go at the next eviction."""
    root = os.path.join(small_fs, "cache")
    stored: dict[tuple[int, int], bool] = {}
    hook = _CrashInBatch(unlinks)
    eng = Engine.open(root, LAYOUT, CAP, hook=hook, policy="leaf-lru")
    fill_cache(eng, 0, 4, stored)
    victims = [(0, 8), (0, 4), (1, 8)]  # victim at a time: a leaf, its parent, the next leaf
    keys = {v: Prefix.from_tokens(conversation(*v)[0], BT).keys[-1] for v in stored}
    want = sum(eng.index.nodes[eng.index.by_key[keys[v]]].nbytes for v in victims)
    filler = spent_and_full(small_fs, root)
    hook.armed = True
    with pytest.raises(SimulatedCrash):
        eng.evict(want)
    assert eng.guard.closed
    os.unlink(filler)
    with Engine.open(root, LAYOUT, CAP, policy="leaf-lru") as eng:
        rep = eng.audit()
        assert rep.ok and not rep.unknown_files, rep.to_dict()
        assert not eng.catalog.journal()
        for v in stored:
            node = eng.index.get(eng.index.by_key.get(keys[v], -1))
            if v not in victims:
                assert node is not None and node.ready, v  # no survivor lost
        damaged = [v for v in victims if not eng.index.nodes[eng.index.by_key[keys[v]]].ready]
        assert len(damaged) == (3 if unlinks is None else 1), damaged
        assert assert_every_node_restores(eng, {v: True for v in stored if v not in victims}) == len(stored) - 3
        assert_every_node_restores_or_damaged(eng, stored)  # the victims still ready are intact
        assert eng.evict(want) >= want  # the damaged go first
        assert all(eng.index.nodes[eng.index.by_key[keys[v]]].ready for v in stored if keys[v] in eng.index.by_key)
        assert eng.audit().ok


def assert_every_node_restores_or_damaged(eng: Engine, stored) -> int:
    """As ``assert_every_node_restores``, leaving out checkpoints on a damaged node's path."""
    damaged = {n.key for n in eng.index if not n.ready}
    clear = {}
    for seed, blocks in stored:
        keys = Prefix.from_tokens(conversation(seed, blocks)[0], BT).keys
        if not damaged.intersection(keys):
            clear[(seed, blocks)] = True
    return assert_every_node_restores(eng, clear)


def tree(root: str) -> dict[str, bytes]:
    """Every file under ``root`` with its bytes (the catalog, its log, the shards, LOCK)."""
    out = {}
    for d, _dirs, files in os.walk(root):
        for f in files:
            path = os.path.join(d, f)
            with open(path, "rb") as fh:
                out[os.path.relpath(path, root)] = fh.read()
    return out


def flip_byte(path: str) -> bytes:
    """Flip one byte of ``path`` in place (no block allocated); returns its new bytes."""
    with open(path, "r+b") as fh:
        data = bytearray(fh.read())
        data[len(data) // 2] ^= 0xFF
        fh.seek(0)
        fh.write(data)
    return bytes(data)


def spent_and_full(small_fs: str, root: str) -> str:
    """The reserve gone, and another writer holding every free byte: returns the filler."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(os.path.join(root, RESERVE_NAME))
    return fill(small_fs)


def assert_refuses_every_mutation(eng: Engine, seed: int) -> None:
    toks, segs = conversation(seed, 4)
    prefix = Prefix.from_tokens(toks, BT)
    snap = [{"state": torch.zeros((32, 64))} for _ in range(LAYOUT.ranks)]
    calls = {
        "store": lambda: eng.store(prefix, segs, snap),
        "store_async": lambda: eng.store_async(prefix, segs, snap),
        "evict": lambda: eng.evict(64 << 10),
        "evict(prefix)": lambda: eng.evict(prefix=prefix),
        "reclaim": eng.reclaim,
        "compact": eng.compact,
    }
    for name, call in calls.items():
        with pytest.raises(ReadOnlyError, match="open read-only: .*the disk is full") as err:
            call()
        assert err.value.reason is eng.read_only, name


def test_open_on_a_full_disk_with_nothing_to_free_opens_read_only(small_fs):
    """No reserve, no garbage, not a byte free: open succeeds read-only with the reason,
    restores every checkpoint bit for bit, refuses every mutation with ReadOnlyError and
    writes nothing (catalog bytes and directory listing unchanged, no -wal/-shm, no
    reserve). Once the disk has room, a normal open recovers, audits clean and stores."""
    root = os.path.join(small_fs, "cache")
    stored: dict[tuple[int, int], bool] = {}
    with Engine.open(root, LAYOUT, CAP) as eng:
        fill_cache(eng, 0, 4, stored)
    filler = spent_and_full(small_fs, root)
    try:
        before = tree(root)
        with Engine.open(root, LAYOUT, CAP) as eng:
            assert isinstance(eng.read_only, DiskFullError)
            assert "the disk is full" in eng.stats()["read_only"]
            assert assert_every_node_restores(eng, stored) == len(stored)
            m = eng.lookup(Prefix.from_tokens(conversation(1, 8)[0], BT))
            with eng.pinned(m) as ok:  # pins are in memory: allowed
                assert ok and eng.stats()["pinned"] == 2
            assert_refuses_every_mutation(eng, 7)
            assert assert_every_node_restores(eng, stored) == len(stored)
            rep = eng.audit()
            assert rep.ok, rep.violations
            leaf = eng.index.nodes[eng.index.by_key[Prefix.from_tokens(conversation(0, 8)[0], BT).keys[-1]]]
            with eng.guard.lock, pytest.raises(ReadOnlyError):
                evict.evict_nodes(eng.flows.evicting, [leaf])  # an eviction's early unlink on a full disk: refused too
            name = restore.file_rows(eng.catalog, [leaf])[leaf.id][1][0]
            before[f"rank1/{name}"] = flip_byte(os.path.join(root, "rank1", name))
            m = eng.lookup(Prefix.from_tokens(conversation(0, 8)[0], BT))
            assert m.hit and eng.restore(m) is None  # verified: a miss, never other bytes
            assert not leaf.ready and eng.lookup(Prefix.from_tokens(conversation(0, 8)[0], BT)).blocks == 4
        after = tree(root)
        assert after.keys() == before.keys(), sorted(set(after) ^ set(before))
        assert after == before  # not a byte written: catalog, shards, no reserve taken
    finally:
        os.unlink(filler)
    with Engine.open(root, LAYOUT, CAP) as eng:
        assert eng.read_only is None and eng.stats()["read_only"] is None
        m = eng.lookup(Prefix.from_tokens(conversation(0, 8)[0], BT))
        assert m.hit and eng.restore(m) is None  # the flipped shard, found again and recorded
        fill_cache(eng, 20, 2, stored)
        assert assert_every_node_restores_or_damaged(eng, stored) == len(stored) - 1
        assert os.path.isfile(os.path.join(root, RESERVE_NAME))
        rep = eng.audit()
        assert rep.ok, rep.violations
    assert audit_dir(root).ok


def test_read_only_open_holds_out_what_an_unfinished_transaction_touches(small_fs):
    """A compact-replace of an interior node died after its intent commit; the disk is then
    full with nothing to free. The read-only engine cannot recover it, so that node (and
    the checkpoint below it) is a miss, every other checkpoint restores bit for bit, and
    the journal is left as it was; the open that follows once there is room rolls it back."""
    root = os.path.join(small_fs, "cache")
    stored: dict[tuple[int, int], bool] = {}
    with Engine.open(root, LAYOUT, CAP) as eng:
        fill_cache(eng, 0, 6, stored)
    interior = Prefix.from_tokens(conversation(3, 4)[0], BT).keys[-1]
    eng = Engine.open(root, LAYOUT, CAP, hook=_CrashBeforeWrite(interior.hex()))
    node = eng.index.nodes[eng.index.by_key[interior]]
    with pytest.raises(SimulatedCrash), eng.guard.lock:
        replace.retire_snapshot(eng.flows.replacing, node)
    lifecycle.abandon(eng.life)
    filler = spent_and_full(small_fs, root)
    held = {(3, 4), (3, 8)}
    try:
        before = tree(root)
        with Engine.open(root, LAYOUT, CAP) as eng:
            assert eng.read_only is not None
            assert eng.catalog.journal(), "the unfinished compaction is left to a later open"
            assert eng.unsettled == {eng.index.by_key[interior]}
            assert eng.stats()["nodes_unsettled"] == 1
            for seed, blocks in held:
                m = eng.lookup(Prefix.from_tokens(conversation(seed, blocks)[0], BT))
                assert not m.hit, (seed, blocks, m)
            rest = {k: v for k, v in stored.items() if k not in held}
            assert assert_every_node_restores(eng, rest) == len(rest)
            assert_refuses_every_mutation(eng, 9)
        assert tree(root) == before
    finally:
        os.unlink(filler)
    with Engine.open(root, LAYOUT, CAP) as eng:
        assert eng.read_only is None and eng.recovery_report.rolled_back
        assert not eng.catalog.journal()
        assert assert_every_node_restores(eng, stored) == len(stored)
        assert eng.audit().ok


def test_read_only_fallback_is_validated(tmp_path):
    with pytest.raises(InvalidArgumentError, match="read_only_fallback"):
        Engine.open(str(tmp_path / "c"), LAYOUT, CAP, read_only_fallback="yes")
    assert not (tmp_path / "c").exists()
    for value in (True, False):
        with Engine.open(str(tmp_path / "c"), LAYOUT, CAP, read_only_fallback=value) as eng:
            assert eng.read_only is None
