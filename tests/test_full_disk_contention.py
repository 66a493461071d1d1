"""A disk the cache shares: another writer that keeps it full, a crash left on a full
disk, and a file system out of inodes while bytes remain.

Each test mounts its own tmpfs (``size=``, and ``nr_inodes=`` for the inode tests;
CI runs as root) and unmounts it in the fixture's teardown, also on failure. The
cache's capacity is far above the file system, so the disk is its only limit. The
engine must never give up intact checkpoints for room it cannot get: a store that
cannot fit even after evicting everything it may evict is refused with nothing
evicted, taking the catalog's reserve back is never a reason to evict, an open after
a crash evicts nothing for room (read-only when it cannot write), and running out of
inodes is named as such, never a raw ``[Errno 28]``.
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import signal
import subprocess
import sys
import textwrap

import pytest
from conftest import make_layout, mounted_tmpfs, store_tokens, tokens_for
from test_full_disk import (
    CAP,
    LAYOUT,
    assert_every_node_restores,
    conversation,
    fill,
    fill_cache,
    spent_and_full,
    store,
    tree,
)

import prefixstore
from prefixstore.base.errors import DiskFullError, ReadOnlyError
from prefixstore.base.keys import Prefix
from prefixstore.engine import structure
from prefixstore.engine.api import Engine
from prefixstore.engine.audit import audit_dir, read_catalog
from prefixstore.gpu.diskroom import INODE_MARGIN, RESERVE_NAME, Shortfall, free_bytes, free_inodes
from prefixstore.gpu.fileio import FaultHook
from prefixstore.statemachine.room import disk_refusal

BT = LAYOUT.block_tokens
TESTS = os.path.dirname(os.path.abspath(__file__))


@pytest.fixture
def fs8(tmp_path):
    """A tmpfs of 8 MiB (about 25 checkpoints of 4 blocks beside the catalog)."""
    mnt = tmp_path / "fs"
    mnt.mkdir()
    with mounted_tmpfs(mnt, "8m") as path:
        yield path


@pytest.fixture
def few_inodes(tmp_path):
    """A tmpfs of 16 MiB with room for 64 inodes: it runs out of files long before bytes."""
    mnt = tmp_path / "fs"
    mnt.mkdir()
    with mounted_tmpfs(mnt, "16m,nr_inodes=64") as path:  # the options after size= go to mount -o
        yield path


def evictions(eng: Engine) -> dict[str, float]:
    return {k: v for k, v in eng.counters.snapshot().items() if k.startswith(("evictions.", "evicted_bytes."))}


def endpoints(eng: Engine) -> int:
    """Nodes a lookup can end at (a retirement leaves an interior node without its snapshot)."""
    return sum(1 for n in eng.index if n.has_snapshot)


def key_of(seed: int, blocks: int) -> bytes:
    return Prefix.from_tokens(conversation(seed, blocks)[0], BT).keys[-1]


# -- bytes: refuse before evicting, never evict for the reserve ----------------------------------


def test_a_store_the_disk_cannot_hold_is_refused_before_anything_is_evicted(fs8):
    """The reserve is spent and another writer holds every free byte; the checkpoints
    of three conversations are pinned. A new 8-block checkpoint needs more room than
    evicting the one unpinned conversation could make: it is refused as no_space at
    once, and not a checkpoint or a file is lost. Once the pins go, eviction can make
    the room, and the same store succeeds."""
    root = os.path.join(fs8, "cache")
    stored: dict[tuple[int, int], bool] = {}
    with Engine.open(root, LAYOUT, CAP) as eng, contextlib.ExitStack() as pins:
        fill_cache(eng, 0, 4, stored)
        spent_and_full(fs8, root)
        for seed in range(3):
            assert pins.enter_context(eng.pinned(eng.lookup(Prefix.from_tokens(conversation(seed, 8)[0], BT))))
        before, files, nodes = evictions(eng), tree(os.path.join(root, "rank0")), len(eng.index)
        res = store(eng, 9, 8)
        assert (res.status, res.reason) == ("refused", "no_space"), res
        assert evictions(eng) == before, "a refused store evicted"
        assert len(eng.index) == nodes and tree(os.path.join(root, "rank0")) == files
        assert assert_every_node_restores(eng, stored) == len(stored)
        pins.close()
        res = store(eng, 9, 8)
        assert res.status == "stored", res
        assert evictions(eng) != before
        rep = eng.audit()
        assert rep.ok, rep.violations


def test_taking_the_reserve_back_is_no_reason_to_evict(fs8):
    """The cache fills its disk, a commit released the reserve and another writer took
    those bytes too. A store then evicts only what it and the catalog's margin need,
    and is stored; it does not evict the cache to take the 2 MiB reserve back (the
    reserve returns once the disk has room by itself)."""
    root = os.path.join(fs8, "cache")
    stored: dict[tuple[int, int], bool] = {}
    with Engine.open(root, LAYOUT, CAP) as eng:
        for seed in range(30):
            for blocks in (4, 8):
                if store(eng, seed, blocks).ok:
                    stored[(seed, blocks)] = True
        fillers = [fill(fs8)]
        assert eng.evict(64 << 10) > 0 and not eng.disk.held  # its commit released the reserve
        fillers.append(fill(fs8, "filler2"))  # and the other writer took those bytes too
        nodes, before = len(eng.index), eng.counters.snapshot().get("evicted_bytes.evict", 0)
        res = store(eng, 500, 4)
        assert res.status == "stored", res
        stored[(500, 4)] = True
        freed = eng.counters.snapshot().get("evicted_bytes.evict", 0) - before
        assert freed <= res.nbytes + eng.disk.margin + (256 << 10), (freed, res.nbytes)
        assert len(eng.index) >= nodes // 2, (len(eng.index), nodes)
        assert not eng.disk.held, "the reserve is taken back from free room only"
        assert assert_every_node_restores(eng, stored) == endpoints(eng)
        for path in fillers:
            os.unlink(path)
        assert store(eng, 501, 4).status == "stored"
        assert eng.disk.held  # room again: taken back
        rep = eng.audit()
        assert rep.ok, rep.violations


FILLER = textwrap.dedent("""
    import os, sys
    path = sys.argv[1]
    for line in sys.stdin:
        if line.strip() == "fill":  # every free byte, in ever smaller writes
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
            for size in (1 << 20, 64 << 10, 4 << 10):
                try:
                    while True:
                        os.write(fd, b"\\xa5" * size)
                except OSError:
                    pass
            os.close(fd)
        elif line.startswith("free "):  # give back that many bytes
            os.truncate(path, max(0, os.path.getsize(path) - int(line.split()[1])))
        print("done", flush=True)
""")
"""Another process that takes every free byte on ``fill`` and gives back N on ``free N``."""


def test_the_cache_keeps_its_checkpoints_beside_a_writer_that_keeps_filling_the_disk(fs8):
    """Another process takes every free byte of the 8 MiB disk, then gives 1 MiB back,
    25 times, with 5 stores in each phase: what the cache evicts, it takes at its next
    fill. Each store fits by evicting older checkpoints, or is refused naming the full
    disk; none raises. The cache never falls below 8 checkpoints, ends with at least
    12, and every one restores bit for bit (measured: 10 to 14, and all 290 stores
    acknowledged; the engine that evicted to take its reserve back and before knowing
    whether a store could fit had 0 checkpoints from the 9th cycle on and acknowledged
    134)."""
    root = os.path.join(fs8, "cache")
    stored: dict[tuple[int, int], bool] = {}
    reasons: set[str] = set()
    counts: list[int] = []
    work = ((seed, blocks) for seed in range(10_000) for blocks in (4, 8))

    def run(n: int) -> None:
        for _ in range(n):
            key = next(work)
            res = store(eng, *key)
            if res.ok:
                stored[key] = True
            else:
                reasons.add(res.reason)

    with Engine.open(root, LAYOUT, CAP) as eng:
        run(40)  # the disk, not the capacity, is the limit from here on
        filler = subprocess.Popen([sys.executable, "-c", FILLER, os.path.join(fs8, "filler")],
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        try:
            for _cycle in range(25):
                for command in ("fill", f"free {1 << 20}"):
                    filler.stdin.write(command + "\n")
                    filler.stdin.flush()
                    assert filler.stdout.readline() == "done\n"
                    run(5)
                    counts.append(len(eng.index))
        finally:
            filler.stdin.close()
            filler.wait(timeout=60)
        assert min(counts) >= 8 and counts[-1] >= 12, counts
        assert assert_every_node_restores(eng, stored) == endpoints(eng)
        assert len(stored) >= 280, (len(stored), reasons)
        assert not any("Errno" in r for r in reasons), reasons
        assert all("no_space" in r for r in reasons), reasons
        rep = eng.audit()
        assert rep.ok, rep.violations
    assert audit_dir(root).ok


RACING_FILLER = textwrap.dedent("""
    import os, sys, time
    path, stop = sys.argv[1], sys.argv[2]
    cycles = 0
    while not os.path.exists(stop):
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        for size in (1 << 20, 64 << 10, 4 << 10):
            try:
                while True:
                    os.write(fd, b"\\xa5" * size)
            except OSError:
                pass
        os.close(fd)
        time.sleep(0.2)
        os.unlink(path)
        cycles += 1
        time.sleep(0.02)
    print(cycles)
""")
"""Another process that fills the disk, holds it 200 ms, frees it for 20 ms, until ``stop`` exists."""


def test_stores_racing_a_writer_that_fills_the_disk_never_raise(fs8, tmp_path):
    """Another process fills every free byte, holds it for 200 ms and frees it for 20 ms,
    on its own clock, while 300 stores run: its fills land between a store's space step and its
    commits. No store raises (a commit that found no byte to grow into raised
    CatalogIOError in 4 of 20 such runs before the catalog held its room in its own
    files), every failure names the full disk, and every checkpoint left restores
    bit for bit with a clean audit."""
    root = os.path.join(fs8, "cache")
    stop = str(tmp_path / "stop")
    stored: dict[tuple[int, int], bool] = {}
    reasons: set[str] = set()
    with Engine.open(root, LAYOUT, CAP) as eng:
        filler = subprocess.Popen([sys.executable, "-c", RACING_FILLER, os.path.join(fs8, "filler"), stop],
                                  stdout=subprocess.PIPE, text=True)
        try:
            for seed in range(150):
                for blocks in (4, 8):
                    res = store(eng, seed, blocks)
                    if res.ok:
                        stored[(seed, blocks)] = True
                    else:
                        reasons.add(res.reason)
        finally:
            open(stop, "w").close()
            cycles = int(filler.communicate(timeout=60)[0])
        assert cycles >= 2, cycles
        assert not any("Errno" in r for r in reasons), reasons
        assert all("no_space" in r for r in reasons), reasons
        assert assert_every_node_restores(eng, stored) == endpoints(eng) > 0
        rep = eng.audit()
        assert rep.ok, rep.violations
    assert audit_dir(root).ok


# -- a crash, then a full disk ---------------------------------------------------------------------


WORKLOAD = textwrap.dedent("""
    import sys, time
    sys.path.insert(0, sys.argv[2])
    from test_full_disk import CAP, LAYOUT, store
    from prefixstore.engine.api import Engine
    from prefixstore.gpu.fileio import FaultHook

    class StopInsideAWrite(FaultHook):
        armed = False

        def before(self, op, target, rank):
            if self.armed and op == "write" and rank == 0:  # rank 1 writes its shard
                print("inside", flush=True)  # the store's intent is committed: kill now
                time.sleep(600)

    hook = StopInsideAWrite()
    eng = Engine.open(sys.argv[1], LAYOUT, CAP, hook=hook)
    acked = 0
    for seed in range(100_000):
        for blocks in (1, 2):
            hook.armed = acked >= int(sys.argv[3])
            res = store(eng, seed, blocks)
            acked += res.status == "stored"
            print(seed, blocks, res.status, flush=True)
""")


def run_until_killed(root: str, acks: int) -> dict[tuple[int, int], bool]:
    """A child process stores conversations of 1 and 2 blocks into ``root``; after
    ``acks`` acknowledged stores, the next one is SIGKILLed inside its shard writes
    (its intent committed). Returns the acknowledged ones."""
    here = os.path.dirname(os.path.dirname(prefixstore.__file__))  # the child runs this prefixstore
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (here, os.environ.get("PYTHONPATH")) if p)}
    child = subprocess.Popen([sys.executable, "-c", WORKLOAD, root, TESTS, str(acks)], stdout=subprocess.PIPE,
                             stderr=subprocess.DEVNULL, text=True, env=env)
    acked: dict[tuple[int, int], bool] = {}
    inside = False
    try:
        for line in child.stdout:
            if line.strip() == "inside":
                inside = True
                break
            seed, blocks, status = line.split()
            if status == "stored":
                acked[(int(seed), int(blocks))] = True
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait()
        child.stdout.close()
    assert inside and len(acked) == acks, (inside, len(acked))
    return acked


def published(root: str, acked: dict[tuple[int, int], bool]) -> dict[tuple[int, int], bool]:
    """The acknowledged checkpoints the catalog still holds (the child evicted others
    to fill the disk), read without writing a byte."""
    keys = {bytes(row[structure.KEY]) for row in read_catalog(root, live=False).nodes.values()
            if row[structure.STATE] == "ready"}
    return {k: True for k in acked if key_of(*k) in keys}


def assert_all_restore(eng: Engine, held: dict[tuple[int, int], bool]) -> None:
    """Every checkpoint of ``held`` is still there and restores bit for bit."""
    missing = [k for k in held if key_of(*k) not in eng.index.by_key]
    assert not missing, f"{len(missing)} of {len(held)} checkpoints are gone"
    assert assert_every_node_restores(eng, held) == len(held)


@pytest.mark.slow
def test_an_open_after_sigkill_on_a_full_disk_evicts_nothing_and_opens_read_only(small_fs):
    """A child process fills the 16 MiB disk with small checkpoints and is SIGKILLed
    inside a store; the reserve is spent and another writer takes every free byte. The
    open recovers what it must (the killed store rolls back) and evicts nothing for
    room: it opens read-only with the reason, every checkpoint the catalog held restores
    bit for bit (measured: all 138; the open that evicted by policy for the catalog's
    margin kept 125 of 141), and every mutation is refused. Once the disk has room, the
    cache opens writable, audits clean and stores."""
    root = os.path.join(small_fs, "cache")
    acked = run_until_killed(root, 150)
    rows = read_catalog(root, live=False)
    assert [kind for _tid, kind, _state, _payload in rows.journal] == ["store"]  # killed inside it
    held, nodes = published(root, acked), len(rows.nodes)
    filler = spent_and_full(small_fs, root)
    try:
        with Engine.open(root, LAYOUT, CAP) as eng:
            assert isinstance(eng.read_only, DiskFullError), eng.read_only
            assert "the disk is full" in str(eng.read_only)
            assert eng.recovery_report.evicted == 0 and not evictions(eng)
            assert len(eng.index) == nodes and len(held) > 100
            assert_all_restore(eng, held)
            with pytest.raises(ReadOnlyError, match="open read-only"):
                store(eng, 90_000, 1)
            with pytest.raises(ReadOnlyError):
                eng.evict(64 << 10)
            rolled_back = eng.recovery_report.rolled_back
    finally:
        os.unlink(filler)
    with Engine.open(root, LAYOUT, CAP) as eng:
        assert eng.read_only is None and not eng.catalog.journal()
        assert rolled_back or eng.recovery_report.rolled_back  # the killed store, by one open or the other
        assert len(eng.index) == nodes and eng.recovery_report.evicted == 0
        assert_all_restore(eng, held)
        assert store(eng, 90_000, 1).status == "stored"
        rep = eng.audit()
        assert rep.ok, rep.violations
    assert audit_dir(root).ok


# -- inodes -------------------------------------------------------------------------------------------


def eat_inodes(mnt: str) -> str:
    """Another writer takes every free inode (empty files); returns their directory."""
    d = os.path.join(mnt, "inodes")
    with contextlib.suppress(OSError):
        os.mkdir(d)
    if not os.path.isdir(d):  # not even one inode for the directory: free one file's worth
        raise AssertionError("no inode left for the other writer's directory")
    i = 0
    with contextlib.suppress(OSError):
        while True:
            os.close(os.open(os.path.join(d, str(i)), os.O_WRONLY | os.O_CREAT, 0o644))
            i += 1
    assert free_inodes(mnt) == 0 and free_bytes(mnt) > 4 << 20
    return d


def test_a_cache_out_of_inodes_evicts_for_them_and_keeps_storing(few_inodes):
    """On a file system with 64 inodes the cache's own shards use up the files long
    before the bytes. Every store then evicts older checkpoints for the inodes it
    needs and is stored (the engine that counted bytes only failed 33 of 60 with
    ``[Errno 28] No space left on device``), keeping the catalog's inode margin."""
    root = os.path.join(few_inodes, "cache")
    stored: dict[tuple[int, int], bool] = {}
    with Engine.open(root, LAYOUT, CAP) as eng:
        for seed in range(30):
            for blocks in (1, 2):
                res = store(eng, seed, blocks)
                assert res.status == "stored", (seed, blocks, res)
                stored[(seed, blocks)] = True
        assert evictions(eng), "the inodes, not the bytes or the capacity, made the cache evict"
        assert free_inodes(few_inodes) >= INODE_MARGIN
        assert free_bytes(few_inodes) > 4 << 20
        assert eng.disk.held
        assert assert_every_node_restores(eng, stored) == endpoints(eng) > 20
        rep = eng.audit()
        assert rep.ok, rep.violations


class _TakeInodesBeforeWrite(FaultHook):
    """Another writer takes every free inode just before a shard write (after the space step)."""

    def __init__(self, mnt: str) -> None:
        self.mnt, self.armed = mnt, False

    def before(self, op, target, rank):
        if self.armed and op == "write":
            self.armed = False
            eat_inodes(self.mnt)


def test_a_store_with_no_inode_to_be_had_is_refused_naming_inodes(few_inodes):
    """Another writer takes every free inode; the cache's checkpoints are pinned. A store
    is refused as no_inodes with nothing evicted (the engine that counted bytes only
    wrote, failed and answered ``[Errno 28] No space left on device``). Inodes taken
    between the space step and the write: the failed store names the inodes too, and
    nothing is lost."""
    root = os.path.join(few_inodes, "cache")
    stored: dict[tuple[int, int], bool] = {}
    hook = _TakeInodesBeforeWrite(few_inodes)
    with Engine.open(root, LAYOUT, CAP, hook=hook) as eng, contextlib.ExitStack() as pins:
        fill_cache_small(eng, 0, 4, stored)
        for seed in range(4):
            assert pins.enter_context(eng.pinned(eng.lookup(Prefix.from_tokens(conversation(seed, 2)[0], BT))))
        inodes = eat_inodes(few_inodes)
        before = evictions(eng)
        res = store(eng, 50, 1)
        assert (res.status, res.reason) == ("refused", "no_inodes"), res
        assert evictions(eng) == before
        pins.close()
        shutil.rmtree(inodes)
        hook.armed = True
        res = store(eng, 51, 1)
        assert res.status == "failed" and "no_inodes" in res.reason and "Errno" not in res.reason, res
        assert assert_every_node_restores(eng, stored) == len(stored)
        shutil.rmtree(os.path.join(few_inodes, "inodes"))
        assert store(eng, 51, 1).status == "stored"
        rep = eng.audit()
        assert rep.ok, rep.violations


def fill_cache_small(eng: Engine, first: int, count: int, stored: dict) -> None:
    """Conversations of 1 then 2 blocks (two files a checkpoint, few bytes)."""
    for seed in range(first, first + count):
        for blocks in (1, 2):
            res = store(eng, seed, blocks)
            assert res.status == "stored", (seed, blocks, res)
            stored[(seed, blocks)] = True


class _InodesAtWrites(FaultHook):
    """Records the free inodes of ``mnt`` before every shard write."""

    def __init__(self, mnt: str) -> None:
        self.mnt, self.free = mnt, []

    def before(self, op, target, rank):
        if op == "write" and rank is not None:
            self.free.append(free_inodes(self.mnt))


def test_a_split_counts_the_inodes_of_every_new_row(tmp_path):
    """On 4 ranks a store landing inside a row splits it into two rows: 8 new shard files
    while the old row's 4 remain until the swap. With inodes left for one row's files
    plus the margin, the split evicts for the second row's (the engine that counted one
    row's files wrote into the catalog's margin, down to 1 free inode, and had to give
    up the disk reserve); every write leaves the margin, the reserve stays held."""
    mnt = tmp_path / "fs"
    mnt.mkdir()
    with mounted_tmpfs(mnt, "16m,nr_inodes=96") as path:
        root = os.path.join(path, "cache")
        hook = _InodesAtWrites(path)
        layout = make_layout(ranks=4, bt=BT)
        conv = tokens_for(40, 12, bt=BT)
        with Engine.open(root, layout, CAP, hook=hook) as eng:
            for b in (3, 6, 9, 12):
                assert store_tokens(eng, conv[: b * BT]).ok
            others = [tokens_for(100 + s, 2, bt=BT) for s in range(3)]
            for t in others:
                assert store_tokens(eng, t).ok
            d = os.path.join(path, "inodes")
            os.mkdir(d)
            while free_inodes(path) > INODE_MARGIN + layout.ranks + 1:  # another writer's files
                os.close(os.open(os.path.join(d, str(len(os.listdir(d)))), os.O_WRONLY | os.O_CREAT, 0o644))
            hook.free.clear()
            res = store_tokens(eng, conv[: 5 * BT])
            assert res.status == "stored", res
            assert eng.counters.snapshot().get("replaces.split") == 1
            assert hook.free and min(hook.free) > INODE_MARGIN, hook.free
            assert eng.disk.held, "the split gave up the disk reserve for inodes eviction could free"
            assert evictions(eng)
            rep = eng.audit()
            assert rep.ok, rep.violations


@pytest.mark.parametrize("reserve", ["held", "spent"])
def test_open_with_no_inode_left_opens_read_only_naming_inodes(few_inodes, reserve):
    """A cleanly closed cache; another writer takes every free inode (bytes remain).
    The open cannot create the catalog's log: it opens read-only with a DiskFullError
    naming the inodes (the engine that counted bytes only raised CatalogIOError), every
    checkpoint restores bit for bit and nothing is written; with
    ``read_only_fallback=False`` it raises that error. Once inodes are free, the
    cache opens writable."""
    root = os.path.join(few_inodes, "cache")
    stored: dict[tuple[int, int], bool] = {}
    with Engine.open(root, LAYOUT, CAP) as eng:
        fill_cache_small(eng, 0, 5, stored)
    if reserve == "spent":
        os.unlink(os.path.join(root, RESERVE_NAME))
    inodes = eat_inodes(few_inodes)
    try:
        with pytest.raises(DiskFullError, match="no free inodes"):
            Engine.open(root, LAYOUT, CAP, read_only_fallback=False)
        before = {k: v for k, v in tree(root).items() if k != RESERVE_NAME}
        with Engine.open(root, LAYOUT, CAP) as eng:
            assert isinstance(eng.read_only, DiskFullError), eng.read_only
            assert "no free inodes" in str(eng.read_only) and "inodes (files)" in str(eng.read_only)
            assert assert_every_node_restores(eng, stored) == len(stored)
            with pytest.raises(ReadOnlyError, match="inodes"):
                store(eng, 60, 1)
        assert {k: v for k, v in tree(root).items() if k != RESERVE_NAME} == before
    finally:
        shutil.rmtree(inodes)
    with Engine.open(root, LAYOUT, CAP) as eng:
        assert eng.read_only is None
        assert assert_every_node_restores(eng, stored) == len(stored)
        fill_cache_small(eng, 10, 2, stored)
        rep = eng.audit()
        assert rep.ok, rep.violations


def test_a_failed_write_names_a_full_disk_without_a_raw_errno(fs8):
    """ENOSPC from a shard write (room taken after the space step) reads as no_space
    with what the file system has free, not as ``[Errno 28]``."""
    root = os.path.join(fs8, "cache")

    class TakeBytes(FaultHook):
        armed = False

        def before(self, op, target, rank):
            if self.armed and op == "write":
                self.armed = False
                fill(fs8, "late")

    hook = TakeBytes()
    with Engine.open(root, LAYOUT, CAP, hook=hook) as eng:
        stored: dict[tuple[int, int], bool] = {}
        fill_cache(eng, 0, 2, stored)
        hook.armed = True
        res = store(eng, 7, 8)
        assert res.status == "failed" and "no_space: its file system is full" in res.reason, res
        assert "Errno" not in res.reason
        assert os.strerror(errno.ENOSPC) not in res.reason
        assert assert_every_node_restores(eng, stored) == len(stored)
        os.unlink(os.path.join(fs8, "late"))
        assert store(eng, 7, 8).status == "stored"
        rep = eng.audit()
        assert rep.ok, rep.violations


def test_the_refusal_is_decided_from_the_room_and_what_eviction_could_free():
    """The pure decision behind a store's disk refusal: inodes first, then bytes."""
    assert disk_refusal(0, 0, 0, 0) is None
    assert disk_refusal(100, 0, 100, 0) is None  # evicting everything would just do
    assert disk_refusal(101, 0, 100, 50) == "no_space"
    assert disk_refusal(10, 3, 100, 2) == "no_inodes"
    assert disk_refusal(1000, 3, 100, 2) == "no_inodes"  # the files are named first
    assert Shortfall(0, 2).reason == "no_inodes" and Shortfall(5, 0).reason == "no_space"
    assert not Shortfall() and Shortfall(1, 0) and Shortfall(0, 1)
