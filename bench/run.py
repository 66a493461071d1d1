"""The engine against plain baselines, measured in one run on one machine.

Every figure is a ratio of two measurements taken in the same run, interleaved round
by round (baseline, engine, baseline, engine, ...; medians), so the machine's load
and disk speed cancel out as far as they can:

- **store**: ``Engine.store`` of checkpoints (``--ckpt-mib`` each, ``synchronous=FULL``)
  against raw sequential write + fsync of the same tensor bytes, one file each. The
  engine also renames, fsyncs the directory and commits the catalog twice per store.
- **restore**: ``lookup`` + ``restore`` of those checkpoints (read, checksum, decode)
  against raw reads of the raw files (both from the page cache); when ``restore``
  takes ``into=``, the same into tensors allocated once beforehand; and **cold**: both
  with the files dropped from the page cache first (``posix_fadvise(DONTNEED)`` on each
  file, its pages clean after the fsync).
- **small durable stores**: one-block (4 KiB) stores per second from 32 threads at
  once against 32 threads doing write + fsync + rename + directory fsync of 4 KiB files.
- **catalog**: single-row write transactions through the engine's catalog layer
  (``Catalog.txn``) against raw single-row SQLite WAL commits on a plain connection,
  with the same ``synchronous`` setting (FULL and NORMAL).
- **lookup**: ``Engine.lookup`` latency against tree size (1k to 1M nodes) and against a
  plain dict of prefixes (every stored prefix's chained key -> node, probed from the
  deepest block down). The trees are built in memory without files (an engine on an
  empty directory is given a synthetic index; a lookup reads only the index), so the
  1M-node case fits in seconds; queries are prefixes hashed beforehand. Each query is
  timed alone (median and p99 over all queries of all rounds, the collector off); the
  resident memory the tree added (RSS), per node, is reported beside it.
- **eviction**: ``Engine.evict`` of 64 victims at a time on a real catalog of
  ``--evict-nodes`` nodes (``bench_eviction.TransactionRun``; 1M unless told, 1k with
  ``--quick``), as the engine batches them and, interleaved on the same catalog, one
  victim per evict transaction: victims per evict transaction and per catalog commit,
  and milliseconds per victim.
- **request-path CPU**: the engine's own CPU per request (its thread's CPU beside the
  byte copy) over a plain copy of the same bytes into fresh outputs, interleaved round
  by round, on the RAM tier (``bench_isolation.request_overhead``, backing ``memory``).
- **replay**: wall time of ``prefixstore replay`` of the whole Mooncake trace on the
  real engine (tmpfs cache dir), against the trace's own duration and against the
  block-level simulator (``replay/sim.py``) on the same trace and capacity.

Writes ``bench/results/run.json`` and ``bench/results/run.md`` (``--out``).

    python bench/run.py            # everything (about ten minutes on 2 cores)
    python bench/run.py --quick    # a smoke run (seconds): small sizes, 200 trace requests
"""

from __future__ import annotations

import argparse
import gc
import inspect
import json
import os
import platform
import random
import shutil
import sqlite3
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from prefixstore import Layout, Prefix, TensorSpec
from prefixstore.engine import space
from prefixstore.engine.api import Engine
from prefixstore.engine.catalog import Catalog
from prefixstore.engine.index import Index, Node

HERE = Path(__file__).resolve().parent
HAS_INTO = "into" in inspect.signature(Engine.restore).parameters
TRACE = HERE.parent.parent / "shared" / "traces" / "mooncake_conversation_trace.jsonl"


def _median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else 0.0


def _rounds(n: int, base: Callable[[int], float], engine: Callable[[int], float]) -> tuple[float, float]:
    """Run ``base(i)`` and ``engine(i)`` alternately ``n`` times (which goes first
    alternates too); median seconds of each."""
    b, e = [], []
    for i in range(n):
        if i % 2:
            e.append(engine(i))
            b.append(base(i))
        else:
            b.append(base(i))
            e.append(engine(i))
    return _median(b), _median(e)


# ------------------------------------------------------------------------------ store / restore


def drop_cache(paths: list[str]) -> None:
    """Evict ``paths`` from the page cache (their pages are clean: written and fsynced)."""
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fdatasync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def _files_under(d: str) -> list[str]:
    return [os.path.join(dp, f) for dp, _, fs in os.walk(d) for f in fs]


def _raw_store(rd: str, raw_bytes: list[bytes]) -> float:
    t = time.perf_counter()
    for i, b in enumerate(raw_bytes):
        fd = os.open(os.path.join(rd, f"{i}.bin"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            os.write(fd, b)
            os.fsync(fd)
        finally:
            os.close(fd)
    return time.perf_counter() - t


def _raw_read(rd: str, sizes: list[int]) -> float:
    t = time.perf_counter()
    for i, n in enumerate(sizes):
        with open(os.path.join(rd, f"{i}.bin"), "rb") as f:
            got = f.read()
        assert len(got) == n
    return time.perf_counter() - t


def _raw_read_distinct(rd: str, bufs: list[memoryview]) -> float:
    """The raw read of ``_raw_read`` into one buffer per file (as ``into=`` gives the
    engine one tensor per checkpoint), not a buffer the allocator hands back each time."""
    t = time.perf_counter()
    for i, out in enumerate(bufs):
        with open(os.path.join(rd, f"{i}.bin"), "rb", buffering=0) as f:
            got = f.readinto(out)
        assert got == len(out)
    return time.perf_counter() - t


def _engine_restore(eng: Engine, prefixes: list[Prefix], tokens: int, into: list | None = None) -> float:
    t = time.perf_counter()
    for i, p in enumerate(prefixes):
        m = eng.lookup(p)
        out = eng.restore(m) if into is None else eng.restore(m, into=into[i])
        assert out is not None and out.end_tokens == tokens
    return time.perf_counter() - t


def bench_io(root: str, n_ckpt: int, ckpt_mib: int, rounds: int) -> dict[str, Any]:
    """Store, warm restore and cold restore against raw file I/O on the same bytes;
    each round alternates which of the pair goes first."""
    width = 1024  # bytes per token: (8, 64) bfloat16
    bt = 256
    tokens = ckpt_mib * (1 << 20) // width
    tokens -= tokens % bt
    layout = Layout(segments=[TensorSpec("kv", "bfloat16", (8, 64))], block_tokens=bt)
    g = torch.Generator().manual_seed(1)
    data = [torch.randn((tokens, 8, 64), generator=g).to(torch.bfloat16) for _ in range(n_ckpt)]
    raw_bytes = [d.view(torch.uint8).numpy().tobytes() for d in data]
    sizes = [len(b) for b in raw_bytes]
    nbytes = sum(sizes)
    into = [{"kv": torch.empty_like(d)} for d in data]
    distinct = [memoryview(torch.empty(n, dtype=torch.uint8).numpy()) for n in sizes]
    t: dict[str, list[float]] = {k: [] for k in ("raw_w", "eng_w", "raw_r", "eng_r", "eng_into",
                                                 "raw_r_distinct", "eng_into_distinct", "raw_cold", "eng_cold")}
    for r in range(rounds):
        rd = os.path.join(root, "raw", str(r))
        os.makedirs(rd)
        ed = os.path.join(root, f"engine{r}")
        prefixes = [Prefix.from_ids([r * 10**6 + i * 1000 + j for j in range(tokens // bt)]) for i in range(n_ckpt)]
        with Engine.open(ed, layout, 1 << 40) as eng:

            def eng_store(eng=eng, prefixes=prefixes) -> float:
                t0 = time.perf_counter()
                for p, d in zip(prefixes, data, strict=True):
                    res = eng.store(p, {"kv": d})
                    assert res.status == "stored", res
                return time.perf_counter() - t0

            pairs = [(("raw_w", lambda rd=rd: _raw_store(rd, raw_bytes)), ("eng_w", eng_store))]
            pairs.append((("raw_r", lambda rd=rd: _raw_read(rd, sizes)),
                          ("eng_r", lambda eng=eng, p=prefixes: _engine_restore(eng, p, tokens))))
            if HAS_INTO:
                pairs.append((("raw_r", lambda rd=rd: _raw_read(rd, sizes)),
                              ("eng_into", lambda eng=eng, p=prefixes: _engine_restore(eng, p, tokens, into))))
                pairs.append((("raw_r_distinct", lambda rd=rd: _raw_read_distinct(rd, distinct)),
                              ("eng_into_distinct", lambda eng=eng, p=prefixes: _engine_restore(eng, p, tokens, into))))

            def cold_raw(rd=rd) -> float:
                drop_cache(_files_under(rd))
                return _raw_read(rd, sizes)

            def cold_eng(eng=eng, ed=ed, p=prefixes) -> float:
                drop_cache([f for f in _files_under(ed) if f.endswith(".st")])
                return _engine_restore(eng, p, tokens)

            pairs.append((("raw_cold", cold_raw), ("eng_cold", cold_eng)))
            for a, b in pairs:
                for name, fn in ((a, b) if r % 2 == 0 else (b, a)):
                    t[name].append(fn())
        shutil.rmtree(ed, ignore_errors=True)
        shutil.rmtree(rd, ignore_errors=True)
    m = {k: _median(v) for k, v in t.items()}
    mb = nbytes / 1e6
    return {
        "checkpoints": n_ckpt, "checkpoint_bytes": nbytes // n_ckpt, "rounds": rounds,
        "store_mb_s": mb / m["eng_w"], "raw_write_fsync_mb_s": mb / m["raw_w"], "store_ratio": m["raw_w"] / m["eng_w"],
        "restore_mb_s": mb / m["eng_r"], "raw_read_mb_s": mb / m["raw_r"], "restore_ratio": m["raw_r"] / m["eng_r"],
        "restore_into_mb_s": mb / m["eng_into"] if HAS_INTO else None,
        "restore_into_ratio": m["raw_r"] / m["eng_into"] if HAS_INTO else None,
        "restore_into_distinct_mb_s": mb / m["eng_into_distinct"] if HAS_INTO else None,
        "raw_read_distinct_mb_s": mb / m["raw_r_distinct"] if HAS_INTO else None,
        "restore_into_distinct_ratio": m["raw_r_distinct"] / m["eng_into_distinct"] if HAS_INTO else None,
        "cold_restore_mb_s": mb / m["eng_cold"], "raw_cold_read_mb_s": mb / m["raw_cold"],
        "cold_restore_ratio": m["raw_cold"] / m["eng_cold"],
    }


# ------------------------------------------------------------------------------ small durable stores


def bench_small(root: str, callers: int, per_caller: int, rounds: int, token_bytes: int = 1024,
                block_tokens: int = 4) -> dict[str, Any]:
    """Durable stores per second of one-block checkpoints (``token_bytes * block_tokens``
    bytes) from ``callers`` threads at once, against the same number of threads doing
    the raw durable small-file operation: write + fsync + rename + directory fsync."""
    layout = Layout(segments=[TensorSpec("kv", "uint8", (token_bytes,))], block_tokens=block_tokens)
    payload = torch.arange(block_tokens * token_bytes, dtype=torch.int64).remainder(251).to(torch.uint8)
    payload = payload.view(block_tokens, token_bytes)
    blob = payload.numpy().tobytes()

    def threads(work: Callable[[int], None]) -> float:
        ts = [threading.Thread(target=work, args=(c,)) for c in range(callers)]
        t0 = time.perf_counter()
        for x in ts:
            x.start()
        for x in ts:
            x.join()
        return time.perf_counter() - t0

    def raw(i: int) -> float:
        d = tempfile.mkdtemp(dir=root)

        def work(c: int) -> None:
            for j in range(per_caller):
                final = os.path.join(d, f"{c}-{j}.bin")
                fd = os.open(final + ".tmp", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
                try:
                    os.write(fd, blob)
                    os.fsync(fd)
                finally:
                    os.close(fd)
                os.rename(final + ".tmp", final)
                dfd = os.open(d, os.O_RDONLY | os.O_DIRECTORY)
                try:
                    os.fsync(dfd)
                finally:
                    os.close(dfd)

        try:
            return threads(work)
        finally:
            shutil.rmtree(d, ignore_errors=True)

    def engine(i: int) -> float:
        d = tempfile.mkdtemp(dir=root)
        try:
            with Engine.open(d, layout, 1 << 40) as eng:

                def work(c: int) -> None:
                    for j in range(per_caller):
                        res = eng.store(Prefix.from_ids([i * 10**9 + c * 10**6 + j]), {"kv": payload})
                        assert res.status == "stored", res

                return threads(work)
        finally:
            shutil.rmtree(d, ignore_errors=True)

    b, e = _rounds(rounds, raw, engine)
    n = callers * per_caller
    return {"callers": callers, "stores": n, "bytes": len(blob), "rounds": rounds,
            "raw_ops_s": n / b, "engine_stores_s": n / e, "ratio": b / e}


# ------------------------------------------------------------------------------ catalog


def bench_catalog(root: str, n: int, rounds: int) -> dict[str, Any]:
    out: dict[str, Any] = {"commits": n, "rounds": rounds}
    for sync in ("FULL", "NORMAL"):
        def raw(i: int, sync=sync) -> float:
            d = tempfile.mkdtemp(dir=root)
            conn = sqlite3.connect(os.path.join(d, "raw.sqlite"), isolation_level=None)
            conn.execute("PRAGMA journal_mode=WAL")
            conn.execute(f"PRAGMA synchronous={sync}")
            conn.execute("CREATE TABLE t(k TEXT PRIMARY KEY, v INTEGER)")
            conn.execute("INSERT INTO t VALUES('x', 0)")
            t = time.perf_counter()
            for j in range(n):
                conn.execute("BEGIN IMMEDIATE")
                conn.execute("UPDATE t SET v=? WHERE k='x'", (j,))
                conn.execute("COMMIT")
            dt = time.perf_counter() - t
            conn.close()
            shutil.rmtree(d, ignore_errors=True)
            return dt

        def engine(i: int, sync=sync) -> float:
            d = tempfile.mkdtemp(dir=root)
            cat = Catalog(d, synchronous=sync)
            with cat.txn("init") as c:
                cat.set_meta(c, "bench", "0")
            t = time.perf_counter()
            for j in range(n):
                with cat.txn("bench") as c:
                    c.execute("UPDATE meta SET value=? WHERE key='bench'", (str(j),))
            dt = time.perf_counter() - t
            cat.close()
            shutil.rmtree(d, ignore_errors=True)
            return dt

        b, e = _rounds(rounds, raw, engine)
        out[sync] = {"raw_commits_s": n / b, "catalog_txn_s": n / e, "ratio": b / e}
    return out


# ------------------------------------------------------------------------------ lookup


def _synthetic(n_nodes: int, blocks_per_node: int, nodes_per_conv: int) -> tuple[Index, list[list[int]]]:
    """An index of ``n_nodes``: conversations of ``nodes_per_conv`` chained nodes of
    ``blocks_per_node`` blocks each, all under one shared first node."""
    idx = Index()
    root_prefix = Prefix.from_ids([10**12])
    node_id = 1
    idx.add(Node(id=node_id, key=root_prefix.keys[-1], parent=None, start=0, end=1,
                 digests=b"".join(root_prefix.digests), has_snapshot=False, state="ready",
                 generation=1, last_used=0, snap_used=0, nbytes=1))
    convs: list[list[int]] = []
    conv = 0
    while len(idx) < n_nodes:
        chain = [10**12] + [conv * 10**4 + j for j in range(blocks_per_node * nodes_per_conv)]
        p = Prefix.from_ids(chain)
        parent = 1
        for k in range(nodes_per_conv):
            if len(idx) >= n_nodes:
                break
            start, end = 1 + k * blocks_per_node, 1 + (k + 1) * blocks_per_node
            node_id += 1
            idx.add(Node(id=node_id, key=p.keys[end - 1], parent=parent, start=start, end=end,
                         digests=b"".join(p.digests[start:end]), has_snapshot=False, state="ready",
                         generation=1, last_used=0, snap_used=0, nbytes=1))
            parent = node_id
        convs.append(chain)
        conv += 1
    return idx, convs


def bench_lookup(root: str, sizes: list[int], queries: int, rounds: int) -> list[dict[str, Any]]:
    return [_lookup_at(root, n, queries, rounds) for n in sizes]


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _percentile(xs: list[float], q: float) -> float:
    ys = sorted(xs)
    return ys[min(len(ys) - 1, int(q * len(ys)))] if ys else 0.0


def _lookup_at(root: str, n: int, queries: int, rounds: int) -> dict[str, Any]:
    """Per-query latencies of ``Engine.lookup`` on an ``n``-node tree and of the dict
    baseline (median and p99 over every query of every round; rounds interleaved),
    and the resident memory the tree added per node."""
    layout = Layout(segments=[TensorSpec("kv", "uint8", (16,))], block_tokens=512)
    rng = random.Random(5)
    gc.collect()
    rss0 = _rss()
    t = time.perf_counter()
    idx, convs = _synthetic(n, 2, 16)
    build_s = time.perf_counter() - t
    gc.collect()
    rss_per_node = (_rss() - rss0) / len(idx)
    baseline = {x.key: x for x in idx}
    qs = []
    for _ in range(queries):
        chain = rng.choice(convs)
        depth = rng.randint(1, len(chain))
        qs.append(Prefix.from_ids(chain[:depth] + [rng.randrange(10**15, 10**16) for _ in range(8)]))
    clock = time.perf_counter_ns
    lat_dict: list[float] = []
    lat_eng: list[float] = []

    def plain(i: int) -> float:
        out = lat_dict
        for q in qs:
            t0 = clock()
            keys = q.keys
            for j in range(len(keys) - 1, -1, -1):
                if keys[j] in baseline:
                    break
            out.append(clock() - t0)
        return 0.0

    d = tempfile.mkdtemp(dir=root)
    try:
        with Engine.open(d, layout, 1 << 30) as eng:
            # a synthetic tree: lookups read only the index
            eng.index.nodes, eng.index.by_key, eng.index.blocks = idx.nodes, idx.by_key, idx.blocks

            def engine(i: int) -> float:
                out, look = lat_eng, eng.lookup
                for q in qs:
                    t0 = clock()
                    look(q)
                    out.append(clock() - t0)
                return 0.0

            hits = sum(eng.lookup(q).hit for q in qs[:200])
            gc.disable()  # a collection of the million-node tree inside one query is not the lookup's cost
            try:
                _rounds(rounds, plain, engine)
            finally:
                gc.enable()
    finally:
        shutil.rmtree(d, ignore_errors=True)
    e50, b50 = statistics.median(lat_eng) / 1e3, statistics.median(lat_dict) / 1e3
    return {
        "nodes": len(idx), "build_s": build_s, "queries": queries, "hits_of_first_200": hits,
        "engine_us": e50, "engine_p99_us": _percentile(lat_eng, 0.99) / 1e3,
        "dict_us": b50, "dict_p99_us": _percentile(lat_dict, 0.99) / 1e3, "ratio": e50 / b50,
        "rss_bytes_per_node": rss_per_node,
    }


# ------------------------------------------------------------------------------ eviction


class _CommitCounter:
    """A catalog fault hook that counts commits (and keeps their labels) and passes
    everything on."""

    def __init__(self, inner: Any) -> None:
        self.inner, self.commits, self.labels = inner, 0, []

    def before(self, op: str, target: str, rank: int | None) -> None:
        self.inner.before(op, target, rank)

    def after(self, op: str, target: str, rank: int | None) -> None:
        if op == "commit":
            self.commits += 1
            self.labels.append(target)
        self.inner.after(op, target, rank)


def bench_evict(n: int, batch: int, steps: int) -> dict[str, Any]:
    """``Engine.evict`` of ``batch`` victims at a time on a real catalog of ``n`` nodes
    (``bench_eviction.TransactionRun``: rows inserted directly, FULL), batched as the
    engine does (``space.EVICT_BATCH`` nodes per evict transaction) and, interleaved
    step by step on the same catalog, one victim per evict transaction (the baseline):
    victims per evict transaction, per catalog commit, and milliseconds per victim."""
    import bench_eviction

    run = bench_eviction.TransactionRun(n, seed=3)
    limit = space.EVICT_BATCH
    modes = {"batched": limit, "one_at_a_time": 1}
    got = {m: {"victims": 0, "commits": 0, "removals": 0, "per_victim_s": []} for m in modes}
    try:
        eng = run.eng
        counter = _CommitCounter(eng.catalog.hook)
        eng.catalog.hook = counter
        for _ in range(steps):
            for mode, size in modes.items():
                space.EVICT_BATCH = size
                g, v0, c0, r0 = got[mode], _victims(eng), counter.commits, counter.labels.count("evict.remove")
                t = time.perf_counter()
                eng.evict(batch * run.size - 1)
                dt = time.perf_counter() - t
                v = _victims(eng) - v0
                g["victims"] += v
                g["commits"] += counter.commits - c0
                g["removals"] += counter.labels.count("evict.remove") - r0
                g["per_victim_s"].append(dt / max(1, v))
    finally:
        space.EVICT_BATCH = limit
        run.eng.close()
        run.root.cleanup()
    out: dict[str, Any] = {"nodes": n, "batch": batch, "evict_batch": limit}
    for mode, g in got.items():
        out[mode] = {"victims": g["victims"], "commits": g["commits"],
                     "victims_per_commit": g["victims"] / max(1, g["commits"]),
                     "victims_per_transaction": g["victims"] / max(1, g["removals"]),
                     "ms_per_victim": statistics.median(g["per_victim_s"]) * 1e3}
    out.update({k: out["batched"][k] for k in ("victims_per_commit", "victims_per_transaction", "ms_per_victim")})
    return out


def _victims(eng: Any) -> int:
    return int(sum(v for k, v in eng.counters.snapshot().items() if k.startswith("evictions.")))


# ------------------------------------------------------------------------------ request-path CPU


def bench_request_cpu(root: str, sizes: list[int], reps: int) -> list[dict[str, Any]]:
    """The engine's own CPU per request over a plain copy of the same bytes measured in
    the same rounds, RAM tier (``bench_isolation.request_overhead`` on ``backing='memory'``)."""
    import bench_isolation

    return [{k: r[k] for k in ("tokens", "bytes", "rounds", "engine_cpu_s_median", "baseline_copy_s_median",
                               "ratio_median", "ratio_by_difference", "ratio_elided", "modeled_restore_s")}
            for r in bench_isolation.request_overhead("memory", sizes, reps, 1, root)]


# ------------------------------------------------------------------------------ replay


def bench_replay(trace: Path, limit: int | None, capacity: str) -> dict[str, Any]:
    from prefixstore.replay.engine_replay import ReplayConfig, replay
    from prefixstore.replay.sim import compile_trace, simulate
    from prefixstore.replay.trace import load_trace

    requests = load_trace(trace, limit)
    cfg = ReplayConfig(policy="prefixstore", capacity=capacity)
    t = time.perf_counter()
    rep = replay(requests, cfg).summary
    wall = time.perf_counter() - t
    t = time.perf_counter()
    ct = compile_trace(requests)
    sim = simulate(ct, rep["capacity_blocks"] * cfg.block_bytes_modeled, "prefixstore",
                   block_bytes=cfg.block_bytes_modeled)
    sim_s = time.perf_counter() - t
    duration_s = (requests[-1].timestamp_ms - requests[0].timestamp_ms) / 1000.0
    return {
        "requests": len(requests), "capacity": capacity, "wall_s": wall, "requests_per_s": len(requests) / wall,
        "trace_duration_s": duration_s, "faster_than_real_time": duration_s / wall if wall else 0.0,
        "sim_wall_s": sim_s, "engine_over_sim": wall / sim_s if sim_s else 0.0,
        "hit_ratio_blocks": rep["hit_ratio_blocks"], "sim_hit_ratio_blocks": sim.hit_ratio_blocks,
        "audit_ok": rep["audit_ok"], "wrong_bytes": rep["wrong_bytes"], "nodes": rep["nodes"],
        "stores": rep["stores"],
    }


# ------------------------------------------------------------------------------ report


def _row(what: str, value: str, base: str, ratio: float | None, target: str, met: bool | None) -> str:
    r = "n/a" if ratio is None else f"{ratio:.3f}" if ratio < 0.1 else f"{ratio:.2f}"
    mark = "" if met is None else (" (met)" if met else " (**missed**)")
    return f"| {what} | {value} | {base} | {r} | {target}{mark} |"


def rows(r: dict[str, Any]) -> list[str]:
    """The performance table: one row per figure, each a ratio to a baseline of this run."""
    io, sm, lk, ev, cpu, rp = (r["io"], r.get("small"), r["lookup"], r.get("evict"), r.get("request_cpu"),
                               r.get("replay"))
    ck = io["checkpoint_bytes"] / (1 << 20)
    big = lk[-1]
    out = [
        "| what | prefixstore | baseline | ratio | target |",
        "| --- | ---: | ---: | ---: | --- |",
        _row(f"restore, page cache warm ({io['checkpoints']} x {ck:.0f} MiB; lookup + read + verify) / raw read",
             f"{io['restore_mb_s']:,.0f} MB/s", f"{io['raw_read_mb_s']:,.0f} MB/s", io["restore_ratio"], ">= 0.8",
             io["restore_ratio"] >= 0.8),
    ]
    if io.get("restore_into_ratio") is not None:
        out.append(_row("restore into the caller's tensors (`into=`), warm / raw read",
                        f"{io['restore_into_mb_s']:,.0f} MB/s", f"{io['raw_read_mb_s']:,.0f} MB/s",
                        io["restore_into_ratio"], ">= 0.8", io["restore_into_ratio"] >= 0.8))
    if io.get("restore_into_distinct_ratio") is not None:  # the same restores against a like-for-like read
        out.append(_row("restore into the caller's tensors (`into=`), warm / raw read into one buffer per file "
                        "(not a target: a second baseline)", f"{io['restore_into_distinct_mb_s']:,.0f} MB/s",
                        f"{io['raw_read_distinct_mb_s']:,.0f} MB/s", io["restore_into_distinct_ratio"], "", None))
    out += [
        _row("restore, page cache cold / raw cold read", f"{io['cold_restore_mb_s']:,.0f} MB/s",
             f"{io['raw_cold_read_mb_s']:,.0f} MB/s", io["cold_restore_ratio"], ">= 0.9", io["cold_restore_ratio"] >= 0.9),
        _row("store (FULL) / raw write + fsync", f"{io['store_mb_s']:,.0f} MB/s", f"{io['raw_write_fsync_mb_s']:,.0f} MB/s",
             io["store_ratio"], ">= 0.9", io["store_ratio"] >= 0.9),
    ]
    if sm:
        out.append(_row(f"small durable stores ({sm['bytes']} B), {sm['callers']} concurrent callers / raw write + "
                        "fsync + rename + dir fsync", f"{sm['engine_stores_s']:,.0f} /s", f"{sm['raw_ops_s']:,.0f} /s",
                        sm["ratio"], ">= 0.5", sm["ratio"] >= 0.5))
    for x in lk:
        last = x is big and x["nodes"] >= 1_000_000
        out.append(_row(f"lookup at {x['nodes']:,} nodes, median / dict baseline (times)", f"{x['engine_us']:.1f} us",
                        f"{x['dict_us']:.1f} us", x["ratio"], "<= 2" if last else "", x["ratio"] <= 2 if last else None))
        out.append(_row(f"lookup at {x['nodes']:,} nodes, p99", f"{x['engine_p99_us']:.1f} us",
                        f"{x['dict_p99_us']:.1f} us", x["engine_p99_us"] / x["dict_p99_us"],
                        "<= 20 us" if last else "", x["engine_p99_us"] <= 20 if last else None))
    if ev:
        one = ev.get("one_at_a_time")
        out.append(_row(f"eviction at {ev['nodes']:,} nodes, {ev['batch']} victims a pass: victims per evict "
                        "transaction (one removal commit) / one victim per transaction",
                        f"{ev['victims_per_transaction']:.1f}", f"{one['victims_per_transaction']:.1f}" if one else "",
                        ev["victims_per_transaction"] / one["victims_per_transaction"] if one else None, ">= 64",
                        ev["victims_per_transaction"] >= 64))
        out.append(_row(f"eviction at {ev['nodes']:,} nodes, {ev['batch']} victims a pass: victims per catalog "
                        "commit, every commit (a transaction's removal and its reclaim)",
                        f"{ev['victims_per_commit']:.2f}", f"{one['victims_per_commit']:.2f}" if one else "",
                        ev["victims_per_commit"] / one["victims_per_commit"] if one else None, "", None))
        out.append(_row(f"eviction at {ev['nodes']:,} nodes: ms per victim / one victim per transaction",
                        f"{ev['ms_per_victim']:.3f} ms", f"{one['ms_per_victim']:.3f} ms" if one else "",
                        ev["ms_per_victim"] / one["ms_per_victim"] if one else None, "<= 0.2 ms",
                        ev["ms_per_victim"] <= 0.2))
    out.append(_row(f"resident memory per node at {big['nodes']:,} nodes (the index)",
                    f"{big['rss_bytes_per_node']:,.0f} B", "", None, "<= 1 KiB", big["rss_bytes_per_node"] <= 1024))
    for c in cpu or []:
        out.append(_row(f"engine CPU on the request path / plain copy of the same bytes, RAM tier, "
                        f"{c['tokens']:,} tokens", f"{c['engine_cpu_s_median'] * 1e3:.3f} ms",
                        f"{c['baseline_copy_s_median'] * 1e3:.3f} ms",
                        c["ratio_median"], "<= 0.02", c["ratio_median"] <= 0.02))
    if rp:
        out.append(_row(f"replay of {rp['requests']:,} Mooncake requests at {rp['capacity']}: engine / block-level "
                        "simulator (times)", f"{rp['wall_s']:.1f} s", f"{rp['sim_wall_s']:.2f} s", rp["engine_over_sim"],
                        "<= 10", rp["engine_over_sim"] <= 10))
    return out


def markdown(r: dict[str, Any]) -> str:
    cat, rp = r["catalog"], r.get("replay")
    lines = [
        f"# prefixstore bench ({'quick' if r['quick'] else 'full'} run)",
        "",
        f"{r['machine']}; load average {r['loadavg']} at the start, {r.get('loadavg_end', '?')} at the end; "
        f"data on `{r['data_dir_fs']}`. Ratios compare two measurements of the same run (medians of "
        "interleaved rounds; latencies over every query).",
        "",
        *rows(r),
        "",
        "| catalog | engine | baseline | engine / baseline |",
        "| --- | ---: | ---: | ---: |",
    ]
    for sync in ("FULL", "NORMAL"):
        c = cat[sync]
        lines.append(
            f"| catalog single-row transactions ({sync}) vs raw SQLite WAL commits | "
            f"{c['catalog_txn_s']:,.0f} /s | {c['raw_commits_s']:,.0f} /s | {c['ratio']:.2f} |"
        )
    if rp:
        lines += [
            "",
            f"Replay: {rp['requests']:,} requests in {rp['wall_s']:.1f} s ({rp['requests_per_s']:,.0f} req/s, "
            f"{rp['faster_than_real_time']:.0f}x faster than the trace's {rp['trace_duration_s'] / 60:.0f} min); "
            f"hit ratio {rp['hit_ratio_blocks']:.4f} on the engine, {rp['sim_hit_ratio_blocks']:.4f} simulated; "
            f"audit {'clean' if rp['audit_ok'] else 'FAILED'}.",
        ]
    return "\n".join(lines).rstrip() + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="a smoke run: small sizes, 200 trace requests")
    ap.add_argument("--out", default=str(HERE / "results"), help="where run.json and run.md go")
    ap.add_argument("--dir", default=None, help="scratch directory on the disk to measure (default: a temp dir)")
    ap.add_argument("--trace", default=str(TRACE), help="Mooncake trace for the replay")
    ap.add_argument("--capacity", default="10%", help="replay capacity (default 10%%)")
    ap.add_argument("--evict-nodes", type=int, default=1_000_000, help="catalog size of the eviction row")
    args = ap.parse_args(argv)
    quick = args.quick
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    root = tempfile.mkdtemp(prefix="prefixstore-bench-", dir=args.dir)
    t0 = time.perf_counter()
    try:
        res: dict[str, Any] = {
            "quick": quick,
            "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, Python {platform.python_version()}, "
                       f"torch {torch.__version__}",
            "loadavg": " ".join(f"{x:.1f}" for x in os.getloadavg()),
            "data_dir_fs": root,
        }
        print("store / restore ...", file=sys.stderr, flush=True)
        res["io"] = bench_io(root, 4 if quick else 32, 1 if quick else 4, 2 if quick else 5)
        print("small durable stores ...", file=sys.stderr, flush=True)
        res["small"] = bench_small(root, 32, 2 if quick else 8, 2 if quick else 3)
        print("catalog ...", file=sys.stderr, flush=True)
        res["catalog"] = bench_catalog(root, 50 if quick else 500, 2 if quick else 9)
        print("lookup ...", file=sys.stderr, flush=True)
        sizes = [1_000] if quick else [1_000, 10_000, 100_000, 1_000_000]
        res["lookup"] = bench_lookup(root, sizes, 300 if quick else 5000, 2 if quick else 5)
        print("eviction ...", file=sys.stderr, flush=True)
        res["evict"] = bench_evict(1_000 if quick else args.evict_nodes, 64, 2 if quick else 5)
        print("request-path CPU ...", file=sys.stderr, flush=True)
        res["request_cpu"] = bench_request_cpu(root, [2048] if quick else [2048, 16384], 3 if quick else 20)
        print("replay ...", file=sys.stderr, flush=True)
        res["replay"] = bench_replay(Path(args.trace), 200 if quick else None, args.capacity)
        res["wall_s"] = time.perf_counter() - t0
        res["loadavg_end"] = " ".join(f"{x:.1f}" for x in os.getloadavg())
    finally:
        torch.set_num_threads(threads)
        shutil.rmtree(root, ignore_errors=True)
    os.makedirs(args.out, exist_ok=True)
    name = "run_quick" if quick else "run"
    with open(os.path.join(args.out, f"{name}.json"), "w") as f:
        json.dump(res, f, indent=2, sort_keys=True)
    md = markdown(res)
    with open(os.path.join(args.out, f"{name}.md"), "w") as f:
        f.write(md)
    print(md)
    return 0 if res["replay"]["audit_ok"] and not res["replay"]["wrong_bytes"] else 1


if __name__ == "__main__":
    sys.exit(main())
