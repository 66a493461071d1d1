"""Executors: zero-copy shard staging, the staging pool, copy counting, asynchronous
stores (release before the durable commit, still crash-safe), pipelined restores,
background workers that survive their jobs, calibration, and the device script's
CPU smoke run. CUDA-only tests skip cleanly without a device."""

from __future__ import annotations

import importlib.util
import json
import os
import threading
import time
import tracemalloc
from collections import Counter

import pytest
import torch
from conftest import (
    FOLLOW_UP,
    Gate,
    assert_restores,
    crash_points,
    make_layout,
    node_at,
    seg_tensors,
    snap_tensors,
    store_tokens,
    tokens_for,
)
from safetensors.torch import load as st_load

from prefixstore.base import errors as E
from prefixstore.base.keys import Prefix
from prefixstore.base.layout import Layout, TensorSpec
from prefixstore.engine.api import Engine
from prefixstore.fuzz.faultfs import CountingHook, CrashAt, FaultFS
from prefixstore.gpu import shards
from prefixstore.gpu.executor import Copy, CpuExecutor, ForegroundGate, StagingPool, size_class
from prefixstore.gpu.fileio import FaultHook, OsFS
from prefixstore.gpu.ranks import LocalRank
from prefixstore.gpu.workers import Worker

CAP = 16 << 20
# In-process crash tests need no real fsync: the process "dies", the OS keeps its writes.
def fast() -> dict:
    return {"fs": FaultFS(), "synchronous": "NORMAL"}

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def staged_file(plan, tensors) -> bytes:
    ex = CpuExecutor()
    st = ex.stage(plan, tensors)
    try:
        return bytes(st.buffer.mv())
    finally:
        st.release()


# ------------------------------------------------------------------ shard format


@pytest.mark.parametrize("dtype", ["bfloat16", "float32", "int8", "float8_e4m3fn", "bool"])
def test_zero_copy_file_is_safetensors_and_round_trips(dtype):
    L = Layout(segments=[TensorSpec("k", dtype, (2, 3)), TensorSpec("v", "float16", (5,))],
               snapshots=[TensorSpec("s", "float64", (3,))], block_tokens=4)
    g = torch.Generator().manual_seed(3)
    segs = {"k": torch.randint(0, 2, (8, 2, 3), generator=g).to(getattr(torch, dtype)),
            "v": torch.randn(8, 5, generator=g).half()}
    snap = {"s": torch.randn(3, generator=g, dtype=torch.float64)}
    meta = {"key": "ab" * 16, "generation": "1", "start": "0", "end": "2", "snapshot": "1", "rank": "0"}
    plan = shards.plan_for_layout(L, 8, True, meta)
    data = staged_file(plan, {"seg.k": segs["k"], "seg.v": segs["v"], "snap.s": snap["s"]})
    assert len(data) == plan.size
    # readable by the safetensors library and by the engine's copying decoder
    loaded = st_load(data)
    assert torch.equal(loaded["seg.k"], segs["k"]) and torch.equal(loaded["snap.s"], snap["s"])
    s2, n2 = shards.decode(data, L, 8, True, meta)
    assert torch.equal(s2["v"], segs["v"])
    # and files written by the safetensors library parse zero-copy
    old = shards.encode(segs, snap, meta)
    buf = torch.frombuffer(bytearray(old), dtype=torch.uint8)
    s3, n3 = shards.parse(buf, L, 8, True, meta)
    assert torch.equal(s3["k"], segs["k"]) and torch.equal(n3["s"], snap["s"])
    assert s3["k"].data_ptr() >= buf.data_ptr() and s3["k"].data_ptr() < buf.data_ptr() + buf.numel()


def test_parse_rejects_what_safetensors_rejects():
    L = make_layout()
    meta = {"key": "cd" * 16, "generation": "2", "start": "0", "end": "1", "snapshot": "1", "rank": "0"}
    segs = seg_tensors(L, tokens_for(1, 1))[0]
    snap = snap_tensors(L, tokens_for(1, 1))[0]
    plan = shards.plan_for_layout(L, 4, True, meta)
    good = staged_file(plan, {**{f"seg.{k}": v for k, v in segs.items()}, **{f"snap.{k}": v for k, v in snap.items()}})

    def parse(data: bytes, **kw):
        return shards.parse(torch.frombuffer(bytearray(data), dtype=torch.uint8), L, 4, True, {**meta, **kw})

    parse(good)
    for bad in (good[:-1], good + b"\0", good[:5], b"\xff" * 8 + good[8:]):
        with pytest.raises(E.ShardError):
            parse(bad)
    with pytest.raises(E.ShardError):
        parse(good, generation="3")  # another generation's file
    n = int.from_bytes(good[:8], "little")
    head = good[8 : 8 + n].replace(b'"BF16"', b'"F16X"', 1)
    with pytest.raises(E.ShardError):
        parse(good[:8] + head + good[8 + n :])
    gap = good[8 : 8 + n].replace(b'"data_offsets":[0,', b'"data_offsets":[2,', 1)
    with pytest.raises(E.ShardError):
        parse(good[:8] + gap + good[8 + n :])


# ------------------------------------------------------------------ pool and gate


def test_staging_pool_reuses_by_size_class_and_bounds_what_it_keeps():
    allocs = []

    def alloc(n):
        allocs.append(n)
        return torch.empty(n, dtype=torch.uint8)

    pool = StagingPool(alloc, keep_bytes=3 * size_class(100_000))
    a = pool.acquire(100_000)
    a.release()
    b = pool.acquire(99_000)  # same class: the same memory
    assert b.tensor.data_ptr() == a.tensor.data_ptr() and b.nbytes == 99_000
    assert pool.stats()["reuses"] == 1 and len(allocs) == 1
    c = pool.acquire(1 << 20)  # another class: a new buffer
    assert len(allocs) == 2
    held = [pool.acquire(100_000) for _ in range(5)]
    for h in [b, c, *held]:
        h.release()
    st = pool.stats()
    assert st["free_bytes"] <= pool.keep_bytes and st["dropped"] >= 1 and st["outstanding_bytes"] == 0


def test_buffer_returns_to_pool_after_its_last_reader_and_its_copies():
    pool = StagingPool(lambda n: torch.empty(n, dtype=torch.uint8), keep_bytes=1 << 30)
    buf = pool.acquire(5000)
    buf.retain()  # a reader
    buf.release()  # the owner
    assert pool.stats()["free_bytes"] == 0, "a reader still holds it"

    class Ev:
        def __init__(self):
            self.waited = False

        def query(self):
            return self.waited

        def synchronize(self):
            self.waited = True

    ev = Ev()
    buf.release(after=Copy([ev]))
    assert pool.stats()["free_bytes"] == size_class(5000)
    again = pool.acquire(5000)
    assert again is buf and ev.waited, "reuse waits for the copy still reading it"
    again.release()
    with pytest.raises(RuntimeError):
        again.release()


def test_background_staging_yields_to_a_running_restore():
    gate = ForegroundGate(max_wait_s=5.0)
    ex = CpuExecutor(gate=gate, chunk_bytes=1024)
    L = make_layout()
    plan = shards.plan_for_layout(L, 64, False, {"rank": "0"})
    tensors = {f"seg.{k}": v for k, v in seg_tensors(L, tokens_for(2, 16))[0].items()}
    entered, leave = threading.Event(), threading.Event()

    def restore():
        with gate.foreground():
            entered.set()
            leave.wait(5)

    t = threading.Thread(target=restore)
    t.start()
    entered.wait(5)
    threading.Timer(0.3, leave.set).start()
    t0 = time.perf_counter()
    st = ex.stage(plan, tensors, background=True)
    waited = time.perf_counter() - t0
    t.join()
    assert waited >= 0.25 and ex.stats["gate_waits"] >= 1
    st2 = ex.stage(plan, tensors)  # a foreground stage does not wait
    assert ex.stats["gate_waits"] == 1
    assert bytes(st.buffer.mv()) == bytes(st2.buffer.mv())


# ------------------------------------------------------------------ copy counting


def big_layout(ranks: int = 1) -> Layout:
    return Layout(segments=[TensorSpec("k", "bfloat16", (8, 64)), TensorSpec("v", "bfloat16", (8, 64))],
                  snapshots=[TensorSpec("s", "float32", (16, 16))], block_tokens=64, ranks=ranks)


def big_rows(L: Layout, tokens: int, seed: int):
    """Random segment rows and snapshots for ``big_layout`` (per rank)."""
    g = torch.Generator().manual_seed(seed)
    segs = [{s.name: torch.randn((tokens, *s.shape), generator=g).to(s.torch_dtype) for s in L.segments}
            for _ in range(L.ranks)]
    snaps = [{s.name: torch.randn(s.shape, generator=g).to(s.torch_dtype) for s in L.snapshots}
             for _ in range(L.ranks)]
    return segs, snaps


def cut(segs, n):
    return [{k: v[:n] for k, v in s.items()} for s in segs]


@pytest.mark.parametrize("backing", ["disk", "memory", "composite"])
def test_store_and_restore_make_no_host_copy(tmp_path, backing):
    L = big_layout(ranks=2)
    toks = tokens_for(5, 32, bt=64)  # 2048 tokens: 4 MiB of segments per rank
    segs, snaps = big_rows(L, 2048, 5)
    p = Prefix.from_tokens
    with Engine.open(str(tmp_path / "c"), L, 256 << 20, backing=backing, ram_bytes=256 << 20) as eng:
        assert eng.store(p(toks[:1024], 64), cut(segs, 1024), snaps).status == "stored"
        before = eng.stats()["transfers"]["copies"]
        assert eng.store(p(toks, 64), segs, snaps).status == "stored"
        after = eng.stats()["transfers"]["copies"]
        payload = L.ranks * L.payload_bytes(1024, True)
        assert after["d2h_bytes"] - before["d2h_bytes"] == payload  # each byte staged once
        assert after["host_copy_bytes"] == 0
        m = eng.lookup(Prefix.from_tokens(toks, 64))
        r = eng.restore(m)
        done = eng.stats()["transfers"]["copies"]
        assert done["h2d_bytes"] - after["h2d_bytes"] == m.nbytes  # each byte uploaded once
        assert done["host_copy_bytes"] == 0
        file_bytes = sum(s for (s,) in eng.catalog.query("SELECT size FROM files WHERE status='live'"))
        read = done["tier_read_bytes"] - after["tier_read_bytes"]
        assert read == (file_bytes if backing == "disk" else 0)  # RAM tiers serve in place
        assert r.files_read == 4
        assert all(torch.equal(r.segments[k][n], segs[k][n]) for k in range(2) for n in ("k", "v"))
        assert all(torch.equal(r.snapshot[k]["s"], snaps[k]["s"]) for k in range(2))


def _peak_python_alloc(fn) -> int:
    tracemalloc.start()
    try:
        tracemalloc.reset_peak()
        fn()
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def test_no_shard_sized_python_object_is_built(tmp_path):
    """tracemalloc sees every bytes object: the zero-copy paths build none of shard
    size, while the copying path they replace does (the check can fail)."""
    L = big_layout()
    toks = tokens_for(6, 32, bt=64)
    segs, snap = big_rows(L, 2048, 6)
    shard = L.payload_bytes(2048, True)
    assert shard > 4 << 20
    with Engine.open(str(tmp_path / "c"), L, 256 << 20) as eng:
        prefix = Prefix.from_tokens(toks, 64)
        eng.store(Prefix.from_tokens(toks[:64], 64), {k: v[:64] for k, v in segs[0].items()},
                  {k: v for k, v in snap[0].items()})  # warm up lazily built state
        assert _peak_python_alloc(lambda: eng.store(prefix, segs, snap)) < shard // 8
        m = eng.lookup(prefix)
        assert _peak_python_alloc(lambda: eng.restore(m)) < shard // 8
        name = eng.catalog.query("SELECT name FROM files WHERE status='live' ORDER BY size DESC")[0][0]
        path = os.path.join(eng.ranks[0].directory, name)
    meta = {"key": "00" * 16}
    assert _peak_python_alloc(lambda: shards.encode(segs[0], snap[0], meta)) >= shard
    assert _peak_python_alloc(lambda: OsFS().read(path)) >= os.path.getsize(path) > shard // 2


def test_a_file_system_without_read_into_is_counted_as_a_host_copy(tmp_path):
    L = make_layout()
    toks = tokens_for(7, 4)
    with Engine.open(str(tmp_path / "c"), L, CAP, fs=FaultFS()) as eng:
        store_tokens(eng, toks)
        assert_restores(eng, toks)
        copies = eng.stats()["transfers"]["copies"]
        size = eng.catalog.query("SELECT size FROM files")[0][0]
        assert copies["host_copy_bytes"] == size and copies["host_copies"] == 1


def test_sync_stores_reuse_staging_buffers(tmp_path):
    L = make_layout()
    with Engine.open(str(tmp_path / "c"), L, CAP) as eng:
        for i in range(6):
            assert store_tokens(eng, tokens_for(100 + i, 3)).status == "stored"
        pool = eng.stats()["transfers"]["staging_pool"]
        assert pool["allocs"] == 1 and pool["reuses"] == 5 and pool["outstanding_bytes"] == 0


# ------------------------------------------------------------------ restore pipeline


class HandshakeRank(LocalRank):
    """Reads that prove the overlap: the first shard's read waits until the second
    shard's read has started, and the second's waits until the first was uploaded.
    A restore that reads the next shard only after uploading the current one
    deadlocks here (each wait times out and is recorded)."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.order: list[str] = []
        self.second_started, self.first_uploaded = threading.Event(), threading.Event()
        self.waits: dict[str, bool] = {}

    def read_shard_into(self, name, out):
        if self.order and name == self.order[0]:
            self.waits["first waited for the second read"] = self.second_started.wait(5)
        elif len(self.order) > 1 and name == self.order[1]:
            self.second_started.set()
            self.waits["second waited for the first upload"] = self.first_uploaded.wait(5)
        return super().read_shard_into(name, out)


def test_restore_reads_the_next_shard_while_uploading_the_current_one(tmp_path):
    L = make_layout()
    toks = tokens_for(8, 8)
    root = str(tmp_path / "c")
    with Engine.open(root, L, CAP) as eng:
        for b in (2, 4, 6, 8):
            store_tokens(eng, toks[: b * 4])
    rank = HandshakeRank(0, os.path.join(root, "rank0"))
    with Engine.open(root, L, CAP, ranks=[rank]) as eng:
        m = eng.lookup(Prefix.from_tokens(toks, 4))
        rank.order = [f"{eng.index.nodes[nid].key.hex()}-g{gen}.st" for nid, gen in m.path]
        orig = eng.executor.upload_bytes

        def upload_bytes(*a):
            rank.first_uploaded.set()
            orig(*a)

        eng.executor.upload_bytes = upload_bytes
        assert_restores(eng, toks, blocks=8)
    assert rank.waits == {"first waited for the second read": True, "second waited for the first upload": True}


def test_restore_of_a_damaged_shard_is_a_miss_and_returns_its_buffers(tmp_path):
    L = make_layout()
    toks = tokens_for(9, 8)
    with Engine.open(str(tmp_path / "c"), L, CAP) as eng:
        for b in (2, 4, 6, 8):
            store_tokens(eng, toks[: b * 4])
        node = node_at(eng, toks[:16])
        path = os.path.join(eng.ranks[0].directory, f"{node.key.hex()}-g{node.generation}.st")
        with open(path, "r+b") as f:
            f.seek(-3, os.SEEK_END)
            f.write(b"\xff\xfe\xfd")
        assert eng.restore(eng.lookup(Prefix.from_tokens(toks, 4))) is None
        assert not eng.index.nodes[node.id].ready
        assert eng.stats()["transfers"]["staging_pool"]["outstanding_bytes"] == 0
        assert eng.audit().ok


# ------------------------------------------------------------------ asynchronous store


class BlockAt(FaultHook):
    """Blocks (or crashes) before the commit labelled ``label``."""

    def __init__(self, label: str, crash: bool = False) -> None:
        self.label, self.crash = label, crash
        self.reached, self.go = threading.Event(), threading.Event()

    def before(self, op, target, rank):
        if op == "commit" and target == self.label:
            self.reached.set()
            self.go.wait(10)
            if self.crash:
                raise E.SimulatedCrash(f"crash before {target}")


@pytest.mark.parametrize("backing", ["disk", "memory", "composite"])
def test_release_comes_before_the_durable_commit(tmp_path, backing):
    L = make_layout(ranks=2)
    hook = BlockAt("store.publish")
    toks = tokens_for(10, 6)
    with Engine.open(str(tmp_path / "c"), L, CAP, hook=hook, backing=backing) as eng:
        segs = seg_tensors(L, toks)
        t = eng.store_async(Prefix.from_tokens(toks, 4), segs, snap_tensors(L, toks))
        assert t.wait_released(5)
        for s in segs:  # the caller reuses its device blocks at once
            for v in s.values():
                v.zero_()
        assert hook.reached.wait(5)
        assert t.released.is_set() and not t.done()
        hook.go.set()
        assert t.result(10).status == "stored"
        assert_restores(eng, toks, blocks=6)  # the staged bytes, not the zeroed tensors
        assert eng.audit().ok


@pytest.mark.parametrize("backing", ["disk", "memory", "composite"])
def test_crash_after_release_before_commit_leaves_the_store_absent(tmp_path, backing):
    L = make_layout(ranks=2)
    root = str(tmp_path / "c")
    a, b = tokens_for(11, 4), tokens_for(12, 6)
    hook = BlockAt("store.publish", crash=True)
    eng = Engine.open(root, L, CAP, hook=hook, backing=backing)
    hook.go.set()
    hook.label = "none yet"
    assert store_tokens(eng, a).status == "stored"
    hook.label = "store.publish"
    t = eng.store_async(Prefix.from_tokens(b, 4), seg_tensors(L, b), snap_tensors(L, b))
    assert t.wait_released(5)
    with pytest.raises(E.SimulatedCrash):
        t.result(10)
    assert eng.guard.closed  # the engine died with its worker's crash
    with Engine.open(root, L, CAP, backing=backing) as eng:
        rep = eng.audit()
        assert rep.ok, rep.to_dict()
        assert eng.lookup(Prefix.from_tokens(b, 4)).outcome == "miss"
        if backing == "memory":
            assert len(eng.index) == 0  # volatile rows are dropped by the restart
        else:
            assert_restores(eng, a, blocks=4)
        assert not eng.catalog.journal()


def test_async_stores_queued_behind_a_crash_fail_typed_and_give_back_what_they_held(tmp_path):
    """The engine dies while async stores wait in the commit queue: their tickets raise
    EngineClosedError (not a bare CancelledError) and their staging buffers, fences
    and in-flight slots go back, as if their jobs had run and failed."""
    class CrashAtFirstWrite(FaultHook):  # outside the engine lock, unlike a commit
        def __init__(self) -> None:
            self.reached, self.go, self.armed = threading.Event(), threading.Event(), False

        def before(self, op, target, rank):
            if self.armed and op == "write" and not self.reached.is_set():
                self.reached.set()
                self.go.wait(10)
                raise E.SimulatedCrash(f"crash before writing {target}")

    L = make_layout()
    hook = CrashAtFirstWrite()
    eng = Engine.open(str(tmp_path / "c"), L, CAP, hook=hook)
    base = tokens_for(30, 2)
    assert store_tokens(eng, base).ok  # the async stores below fence it as their parent
    hook.armed = True

    def go_async(seed):
        toks = base + tokens_for(seed, 2)
        return eng.store_async(Prefix.from_tokens(toks, 4), seg_tensors(L, toks), snap_tensors(L, toks))

    t1 = go_async(31)
    assert hook.reached.wait(5)  # the commit worker is inside the first store
    queued = [go_async(seed) for seed in (32, 33)]
    assert eng.holds.fences and eng.executor.pool.stats()["outstanding_bytes"] > 0
    hook.go.set()
    with pytest.raises(E.SimulatedCrash):
        t1.result(10)
    for t in queued:
        with pytest.raises(E.EngineClosedError):
            t.result(10)
    assert eng.guard.closed and not eng.holds.fences and not eng.holds.reserved
    assert eng.executor.pool.stats()["outstanding_bytes"] == 0
    assert eng.transfers.slots._value == 8  # Transfers(max_inflight_stores=8): every slot back


def _async_scenario(root, ranks, backing, hook):
    """An async store under ``hook``, then a follow-up store (crash points after the
    async store's result). Returns (layout, a, b, the result or None, points until it)."""
    L = make_layout(ranks=ranks)
    b = tokens_for(21, 6)
    a = b[:8]
    gate = Gate()
    eng = Engine.open(root, L, CAP, hook=gate, backing=backing, **fast())
    assert store_tokens(eng, a).status == "stored"
    gate.arm(hook)
    result = None
    try:
        t = eng.store_async(Prefix.from_tokens(b[:16], 4), [{k: v[8:] for k, v in s.items()} for s in seg_tensors(L, b[:16])],
                            snap_tensors(L, b[:16]), tokens_from=8)
        result = t.result(10)
        gate.acked_at = gate.points
        eng.transfers.drain(10)  # the retry it schedules: no effect runs beside the follow-up
        store_tokens(eng, FOLLOW_UP)
    except E.SimulatedCrash:
        pass
    gate.disarm()
    if not eng.guard.closed:
        eng.close()
    return L, a, b, result, gate.acked_at


@pytest.mark.parametrize(("ranks", "backing"), [(1, "disk"), (2, "disk"), (2, "composite"), (2, "memory")])
def test_crash_at_every_effect_of_an_async_store(tmp_path, ranks, backing):
    counter = CountingHook()
    *_, acked_at = _async_scenario(str(tmp_path / "count"), ranks, backing, counter)
    assert acked_at >= 4 and counter.count > acked_at
    cases = Counter()
    for i in crash_points(counter.count, acked_at):
        root = str(tmp_path / f"c{i}")
        hook = CrashAt(i)
        L, a, b, result, _ = _async_scenario(root, ranks, backing, hook)
        assert hook.fired is not None
        assert (result is not None) == (i >= acked_at), (i, acked_at, result)
        with Engine.open(root, L, CAP, backing=backing, **fast()) as eng:
            rep = eng.audit()
            assert rep.ok, (i, hook.fired, rep.to_dict())
            assert not eng.catalog.journal()
            if backing == "memory":
                assert len(eng.index) == 0  # volatile rows are dropped by the restart
                cases["acknowledged" if result is not None else "not acknowledged"] += 1
                continue
            assert_restores(eng, a, blocks=2)
            m = eng.lookup(Prefix.from_tokens(b[:16], 4))
            if result is not None and result.ok:
                assert m.blocks == 4, (i, hook.fired, m)  # acknowledged: it survives the crash
                assert_restores(eng, b[:16], blocks=4)
                cases["acknowledged"] += 1
            elif m.hit and m.blocks == 4:  # published before the crash: whole and right
                assert_restores(eng, b[:16], blocks=4)
                cases["published"] += 1
            else:
                cases["absent"] += 1
    # Each case's check ran: crashes after the result, and before it (published or not).
    if backing == "memory":
        assert cases["acknowledged"] == 3 and cases["not acknowledged"], cases
    else:
        assert cases["acknowledged"] == 3 and cases["published"] and cases["absent"], cases


def test_async_stores_commit_in_order_and_restage_when_the_plan_moved(tmp_path):
    L = make_layout()
    toks = tokens_for(30, 8)
    root = str(tmp_path / "c")
    Engine.open(root, L, CAP).close()  # the cache exists before its rank objects
    rank = WaitRank(0, os.path.join(root, "rank0"))
    with Engine.open(root, L, CAP, ranks=[rank]) as eng:
        p = Prefix.from_tokens
        rank.hold = True
        t1 = eng.store_async(p(toks[:16], 4), seg_tensors(L, toks[:16]), snap_tensors(L, toks[:16]))
        assert rank.reached.wait(5)  # the first store is writing: the second peeks no parent
        t2 = eng.store_async(p(toks, 4), seg_tensors(L, toks), snap_tensors(L, toks))
        assert t2.released.is_set() and not t1.done() and not t2.done()
        rank.hold = False
        rank.go.set()
        assert t1.result(10).status == "stored" and t2.result(10).status == "stored"
        n1 = eng.index.nodes[eng.index.by_key[p(toks[:16], 4).keys[-1]]]
        n2 = eng.index.nodes[eng.index.by_key[p(toks, 4).keys[-1]]]
        assert n2.parent == n1.id and n2.start == 4  # the child was planned against its parent
        assert eng.stats()["transfers"]["restaged"] == 1
        assert_restores(eng, toks, blocks=8)
        assert_restores(eng, toks[:16], blocks=4)
        assert eng.audit().ok


def _busy_commit_worker(eng, rank, L):
    """Queue an unrelated async store whose write waits for ``rank.go``: the commit
    worker is busy until then, and later async stores wait in its queue."""
    other = tokens_for(36, 2)
    rank.hold = True
    t = eng.store_async(Prefix.from_tokens(other, 4), seg_tensors(L, other), snap_tensors(L, other))
    assert rank.reached.wait(5)
    rank.hold = False  # only that write waits
    return t


def test_a_queued_split_never_waits_for_an_extension_queued_behind_it(tmp_path):
    """Two async stores on one conversation, queued in this order: one landing inside a
    stored row (a split), one extending that row (which reserves it as its parent at
    submit). The split runs first and must not wait for the reservation of the store
    queued behind it: both commit at once, the split as a split."""
    L = make_layout()
    toks = tokens_for(35, 12)
    root = str(tmp_path / "c")
    Engine.open(root, L, CAP).close()  # the cache exists before its rank objects
    rank = WaitRank(0, os.path.join(root, "rank0"))
    with Engine.open(root, L, CAP, ranks=[rank], inflight_wait_s=5.0) as eng:
        p = Prefix.from_tokens
        assert store_tokens(eng, toks[:32]).status == "stored"  # one row (0, 8]
        t0 = _busy_commit_worker(eng, rank, L)  # the next two queue behind it, in this order
        split = eng.store_async(p(toks[:16], 4), seg_tensors(L, toks[:16]), snap_tensors(L, toks[:16]))
        extend = eng.store_async(p(toks, 4), seg_tensors(L, toks), snap_tensors(L, toks))
        assert not split.done() and not extend.done()
        rank.go.set()
        t = time.monotonic()
        assert t0.result(5).status == "stored"
        assert split.result(2).status == "stored"  # before: 5 s (inflight_wait_s), then "fenced"
        assert extend.result(2).status == "stored"
        assert time.monotonic() - t < 2
        assert eng.stats()["counters"].get("replaces.split") == 1
        for blocks, prefix in ((4, toks[:16]), (8, toks[:32]), (12, toks)):
            assert_restores(eng, prefix, blocks=blocks)
        assert eng.audit().ok and not eng.holds.fences and not eng.holds.reserved


def test_a_store_on_another_thread_never_waits_for_a_queued_async_store(tmp_path):
    """A queued async store's reservation of its parent is no transaction in flight:
    a synchronous split of that row goes ahead at once, and the queued store then
    lands under the row's upper half."""
    L = make_layout()
    toks = tokens_for(37, 12)
    root = str(tmp_path / "c")
    Engine.open(root, L, CAP).close()
    rank = WaitRank(0, os.path.join(root, "rank0"))
    with Engine.open(root, L, CAP, ranks=[rank], inflight_wait_s=5.0) as eng:
        p = Prefix.from_tokens
        assert store_tokens(eng, toks[:32]).status == "stored"
        t0 = _busy_commit_worker(eng, rank, L)
        extend = eng.store_async(p(toks, 4), seg_tensors(L, toks), snap_tensors(L, toks))
        t = time.monotonic()
        assert store_tokens(eng, toks[:16]).status == "stored"  # before: 5 s, then "fenced"
        assert time.monotonic() - t < 2
        assert not extend.done()
        rank.go.set()
        assert t0.result(5).status == "stored" and extend.result(5).status == "stored"
        upper = eng.index.nodes[eng.index.by_key[p(toks[:32], 4).keys[-1]]]
        child = eng.index.nodes[eng.index.by_key[p(toks, 4).keys[-1]]]
        assert (upper.start, upper.end, child.parent) == (4, 8, upper.id)
        for blocks, prefix in ((4, toks[:16]), (8, toks[:32]), (12, toks)):
            assert_restores(eng, prefix, blocks=blocks)
        assert eng.audit().ok and not eng.holds.fences and not eng.holds.reserved


def test_a_queued_async_store_keeps_its_parent_from_eviction(tmp_path):
    """The reservation still protects: a store that could only fit by evicting the
    parent of a queued async store is refused, and the queued store lands under it."""
    L = make_layout()
    a, big = tokens_for(38, 4), tokens_for(39, 4)
    root = str(tmp_path / "c")
    Engine.open(root, L, CAP).close()
    rank = WaitRank(0, os.path.join(root, "rank0"))
    with Engine.open(root, L, 1800, ranks=[rank]) as eng:  # N + the busy store + one 2-block node fit
        p = Prefix.from_tokens
        assert store_tokens(eng, a[:8]).status == "stored"  # N (0, 2], 568 bytes
        t0 = _busy_commit_worker(eng, rank, L)  # 568 more, charged at its intent
        extend = eng.store_async(p(a, 4), seg_tensors(L, a), snap_tensors(L, a))
        res = store_tokens(eng, big)  # 768 bytes: fits only without N, which is reserved
        assert (res.status, res.reason) == ("refused", "no_space")
        rank.go.set()
        assert t0.result(5).status == "stored" and extend.result(5).status == "stored"
        assert_restores(eng, a, blocks=4)
        assert eng.audit().ok and not eng.holds.fences and not eng.holds.reserved


def test_async_store_refused_for_space_is_retried_from_its_host_copy(tmp_path):
    L = make_layout()
    root = str(tmp_path / "c")
    a, b = tokens_for(33, 3), tokens_for(34, 3)
    with Engine.open(root, L, CAP) as eng:
        size = store_tokens(eng, a).nbytes
    with Engine.open(root, L, size * 3 // 2) as eng:  # room for one of the two
        m = eng.lookup(Prefix.from_tokens(a, 4))
        assert eng.pin(m)
        segs, snap = seg_tensors(L, b), snap_tensors(L, b)
        t = eng.store_async(Prefix.from_tokens(b, 4), segs, snap, valid=lambda: True)
        assert t.result(10).status == "queued"
        for v in [*segs[0].values(), *snap[0].values()]:
            v.zero_()  # the device blocks are gone; the queued retry must not need them
        eng.unpin(m)  # frees room: the retry runs and evicts a
        assert eng.stats()["counters"].get("retries.succeeded") == 1
        assert_restores(eng, b, blocks=3)
        assert eng.lookup(Prefix.from_tokens(a, 4)).outcome == "miss"
        assert eng.audit().ok


def test_async_duplicate_resolves_at_once_and_close_drains_pending_stores(tmp_path):
    L = make_layout()
    root = str(tmp_path / "c")
    with Engine.open(root, L, CAP) as eng:
        toks = tokens_for(31, 3)
        store_tokens(eng, toks)
        t = eng.store_async(Prefix.from_tokens(toks, 4), seg_tensors(L, toks), snap_tensors(L, toks))
        assert t.done() and t.result().status == "duplicate"
        tickets = [eng.store_async(Prefix.from_tokens(x, 4), seg_tensors(L, x), snap_tensors(L, x))
                   for x in (tokens_for(40 + i, 2) for i in range(10))]
    assert all(t.result(0).status == "stored" for t in tickets)
    with Engine.open(root, L, CAP) as eng:
        assert len(eng.index) == 11 and eng.audit().ok
    with pytest.raises(E.EngineClosedError):
        eng.store_async(Prefix.from_tokens(toks, 4), seg_tensors(L, toks), snap_tensors(L, toks))


def test_async_store_bad_input_raises_in_the_caller(tmp_path):
    L = make_layout()
    with Engine.open(str(tmp_path / "c"), L, CAP) as eng:
        toks = tokens_for(32, 2)
        with pytest.raises(E.ShapeError):
            eng.store_async(Prefix.from_tokens(toks, 4), seg_tensors(L, toks))  # no snapshot
        assert eng.stats()["transfers"]["staging_pool"]["outstanding_bytes"] == 0


# ------------------------------------------------------------------ workers


def test_worker_survives_failed_jobs_and_restarts_when_its_thread_dies():
    w = Worker("test")
    try:
        assert w.submit(lambda: 1).result(5) == 1
        bad = w.submit(lambda: 1 / 0)
        with pytest.raises(ZeroDivisionError):
            bad.result(5)
        assert w.submit(lambda: 2).result(5) == 2
        assert w.stats()["restarts"] == 0

        def die():
            raise SystemExit("thread killed")

        with pytest.raises(SystemExit):
            w.submit(die).result(5)
        assert w.submit(lambda: 3).result(5) == 3  # a replacement thread ran it
        st = w.stats()
        assert st["restarts"] == 1 and st["failures"] == 2 and st["completed"] == 3
    finally:
        w.stop()
    with pytest.raises(RuntimeError):
        w.submit(lambda: 4)


class Boom(BaseException):
    """An error that kills the thread it is raised in."""


class FlakyRank(LocalRank):
    def __init__(self, *a, fail, **kw):
        super().__init__(*a, **kw)
        self.fail = fail

    def write_shard(self, name, data):
        if self.fail:
            raise self.fail.pop(0)
        super().write_shard(name, data)


class WaitRank(LocalRank):
    """Its writes wait for ``go`` (outside the engine lock) once ``hold`` is set."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.hold, self.reached, self.go = False, threading.Event(), threading.Event()

    def write_shard(self, name, data):
        if self.hold:
            self.reached.set()
            self.go.wait(10)
        super().write_shard(name, data)


def test_a_failed_effect_fails_its_transaction_never_the_commit_worker(tmp_path):
    L = make_layout()
    root = str(tmp_path / "c")
    Engine.open(root, L, CAP).close()  # the cache exists before its rank objects
    rank = FlakyRank(0, os.path.join(root, "rank0"), fail=[RuntimeError("driver bug"), Boom()])
    with Engine.open(root, L, CAP, ranks=[rank]) as eng:
        a, b, c = tokens_for(50, 2), tokens_for(51, 2), tokens_for(52, 2)
        t = eng.store_async(Prefix.from_tokens(a, 4), seg_tensors(L, a), snap_tensors(L, a))
        res = t.result(10)
        assert res.status == "failed" and "driver bug" in res.reason
        t = eng.store_async(Prefix.from_tokens(b, 4), seg_tensors(L, b), snap_tensors(L, b))
        with pytest.raises(Boom):
            t.result(10)
        assert eng.audit().ok and not eng.catalog.journal()  # both transactions ended
        t = eng.store_async(Prefix.from_tokens(c, 4), seg_tensors(L, c), snap_tensors(L, c))
        assert t.result(10).status == "stored"
        workers = eng.stats()["transfers"]["workers"]["commit"]
        assert workers["restarts"] == 1
        assert eng.stats()["counters"].get("faults.txn_error") == 1
        assert eng.account.charged == eng.catalog.charged()
        assert_restores(eng, c)


# ------------------------------------------------------------------ calibration


def test_bandwidth_measured_once_cached_in_the_catalog_and_fed_to_the_cost_rule(tmp_path, monkeypatch):
    from prefixstore.gpu import calibrate
    from prefixstore.statemachine.cost import CostModel

    L = make_layout()
    root = str(tmp_path / "c")
    with Engine.open(root, L, CAP, cost=CostModel(), bandwidth="measure") as eng:
        cal = eng.calibration
        assert cal["source"] == "measured" and cal["bytes_per_s"] > 0 and cal["read_bytes_per_s"] > 0
        assert eng.cost.bandwidth_bytes_per_s == cal["bytes_per_s"]
        assert not os.path.exists(os.path.join(root, calibrate.PROBE_NAME))
        assert eng.audit().ok

    def no_probe(*a, **k):
        raise AssertionError("probed again")

    monkeypatch.setattr(calibrate, "probe", no_probe)
    with Engine.open(root, L, CAP, cost=CostModel(), bandwidth="measure") as eng:
        assert eng.calibration["source"] == "cached"
        assert eng.cost.bandwidth_bytes_per_s == cal["bytes_per_s"]
    with Engine.open(root, L, CAP, cost=CostModel(), bandwidth=1e9) as eng:
        assert eng.calibration["source"] == "configured" and eng.cost.bandwidth_bytes_per_s == 1e9
    with Engine.open(root, L, CAP, cost=CostModel()) as eng:
        assert eng.calibration is None and eng.cost.bandwidth_bytes_per_s == CostModel().bandwidth_bytes_per_s
    for bad in (-1, 0, "fast", True):
        with pytest.raises(E.InvalidInputError):
            Engine.open(root, L, CAP, bandwidth=bad)
    # a memory backing measures only the upload (there is no file to read)
    monkeypatch.undo()
    with Engine.open(str(tmp_path / "m"), L, CAP, backing="memory", bandwidth="measure") as eng:
        assert eng.calibration["read_bytes_per_s"] is None


# ------------------------------------------------------------------ device script


def _bench_module(name: str):
    spec = importlib.util.spec_from_file_location(f"bench_{name}", os.path.join(ROOT, "bench", f"{name}.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_device_script_smoke_runs_on_cpu(tmp_path, capsys):
    out = tmp_path / "device.json"
    assert _bench_module("device_h200").main(["--smoke", "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    assert res["mode"] == "smoke" and res["device"] == "cpu"
    for key in ("raw", "ram_tier", "disk_tier"):
        assert res[key], key
    for row in res["ram_tier"]:
        assert row["restore_bytes_per_s"] > 0 and row["store_bytes_per_s"] > 0
        assert row["restore_ratio"] > 0 and row["store_ratio"] > 0
        assert row["bit_identical"] and row["host_copy_bytes"] == 0
    assert res["summary"]["all_bit_identical"]
    assert (tmp_path / "device.md").exists()
    assert "restore from the RAM tier" in capsys.readouterr().out


def test_isolation_bench_smoke_runs(tmp_path):
    assert _bench_module("bench_isolation").main(["--smoke", "--out-dir", str(tmp_path)]) == 0
    (path,) = tmp_path.glob("isolation_*_smoke.json")
    res = json.loads(path.read_text())
    assert {r["backing"] for r in res["overhead"]} == {"disk", "memory", "composite"}
    assert all(r["ratio_median"] > 0 and r["calibration"] in ("measured", "cached") for r in res["overhead"])
    assert res["interference"]["background_stores"] > 0


def test_request_overhead_divides_by_a_copy_timed_in_the_same_run(tmp_path, monkeypatch):
    """The request-path ratio's denominator is a plain copy of the request's bytes timed
    in the same rounds, not the bandwidth calibrated at open: a calibration claiming an
    absurd bandwidth (the modeled time near zero) leaves the ratio where it was."""
    from prefixstore.gpu import calibrate

    monkeypatch.setattr(calibrate, "probe", lambda *a, **k: {"bytes_per_s": 1e18, "h2d_bytes_per_s": 1e18,
                                                             "read_bytes_per_s": None, "probe_bytes": 1})
    bi = _bench_module("bench_isolation")
    (r,) = bi.request_overhead("memory", [bi.BLOCK * 4], 3, 1, str(tmp_path), every=bi.BLOCK)
    assert r["calibration"] == "measured" and r["modeled_restore_s"] < 1e-9  # the absurd calibration, reported
    assert r["rounds"] == 3 and r["bytes"] == 4 * bi.BLOCK * bi.TOKEN_BYTES
    assert r["bytes"] / 1e12 < r["baseline_copy_s_median"] <= r["baseline_copy_wall_s_median"] * 1.5
    assert r["engine_cpu_s_median"] > 0 and 0 < r["ratio_median"] < 100, r


def test_async_convoy_bench_quick_runs(tmp_path):
    argv = ["--quick", "--threads", "8", "--inflight-wait-s", "10", "--out-dir", str(tmp_path)]
    assert _bench_module("bench_async_convoy").main(argv) == 0
    res = json.loads((tmp_path / "async_convoy_quick.json").read_text())
    s = res["summary"]
    assert s["all_audits_ok"] and not s["errors"]
    assert s["sync"]["stores"] == s["async"]["stores"] == 8 * 2
    assert s["async"]["max_s"] < 10  # no store waited out inflight_wait_s
    assert s["p99_ratio"] > 0 and all(p["restores_verified"] > 0 for p in res["phases"])
    assert (tmp_path / "async_convoy_quick.md").exists()


# ------------------------------------------------------------------ CUDA


@cuda
def test_cuda_executor_stages_and_uploads():
    from prefixstore.gpu.executor import CudaExecutor

    ex = CudaExecutor()
    L = big_layout()
    plan = shards.plan_for_layout(L, 256, True, {"rank": "0"})
    segs, snaps = big_rows(L, 256, 1)
    src = {f"seg.{k}": v.cuda() for k, v in segs[0].items()}
    src["snap.s"] = snaps[0]["s"].cuda()
    st = ex.stage(plan, src)
    assert st.buffer.tensor.is_pinned()
    st.copy.wait()
    cpu = {k: v.cpu() for k, v in src.items()}
    loaded = st_load(bytes(st.buffer.mv()))
    assert all(torch.equal(loaded[k], cpu[k]) for k in cpu)
    views = st.tensors()
    dst = ex.empty(tuple(views["seg.k"].shape), views["seg.k"].dtype)
    ex.begin_uploads()
    ex.upload(dst, views["seg.k"])
    done = ex.record()
    ex.finish_uploads()
    st.buffer.release(after=done)
    torch.cuda.current_stream().synchronize()
    assert torch.equal(dst, src["seg.k"])
    assert ex.stats["host_copy_bytes"] == 0


@cuda
@pytest.mark.parametrize("backing", ["memory", "composite", "disk"])
def test_cuda_engine_round_trip(tmp_path, backing):
    L = big_layout()
    toks = tokens_for(3, 8, bt=64)
    host_segs, host_snap = big_rows(L, 512, 3)
    segs = [{k: v.cuda() for k, v in s.items()} for s in host_segs]
    snap = [{k: v.cuda() for k, v in s.items()} for s in host_snap]
    with Engine.open(str(tmp_path / "c"), L, 256 << 20, backing=backing, executor="cuda") as eng:
        t = eng.store_async(Prefix.from_tokens(toks, 64), segs, snap)
        assert t.wait_released(10)
        assert t.result(10).status == "stored"
        r = eng.restore(eng.lookup(Prefix.from_tokens(toks, 64)))
        assert r.segments[0]["k"].is_cuda and torch.equal(r.segments[0]["k"], segs[0]["k"])
        assert torch.equal(r.snapshot[0]["s"], snap[0]["s"])
        assert eng.stats()["transfers"]["copies"]["host_copy_bytes"] == 0
        assert eng.audit().ok


def test_close_from_inside_an_engine_worker_is_refused_not_a_hang(tmp_path):
    """A job on the commit worker (as a queued store's valid() callback could be)
    calling close() would wait for itself: it gets a typed error at once."""
    with Engine.open(str(tmp_path / "c"), make_layout(), CAP) as eng:
        fut = eng.transfers.commit.submit(eng.close)
        with pytest.raises(E.InvalidInputError, match="worker"):
            fut.result(10)
        assert not eng.guard.closed
        toks = tokens_for(40, 2)
        assert store_tokens(eng, toks).ok
    assert eng.guard.closed
