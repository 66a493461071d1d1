"""The engine against plain baselines, measured in one run on one machine.

Every figure is a ratio of two measurements taken in the same run, interleaved round
by round (baseline, engine, baseline, engine, ...; medians), so the machine's load
and disk speed cancel out as far as they can:

- **store**: ``Engine.store`` of checkpoints (``--ckpt-mib`` each, ``synchronous=FULL``)
  against raw sequential write + fsync of the same tensor bytes, one file each. The
  engine also renames, fsyncs the directory and commits the catalog twice per store.
- **restore**: ``lookup`` + ``restore`` of those checkpoints (read, checksum, decode)
  against raw reads of the raw files (both from the page cache).
- **catalog**: single-row write transactions through the engine's catalog layer
  (``Catalog.txn``) against raw single-row SQLite WAL commits on a plain connection,
  with the same ``synchronous`` setting (FULL and NORMAL).
- **lookup**: ``Engine.lookup`` latency against tree size (1k to 1M nodes) and against a
  plain dict of prefixes (every stored prefix's chained key -> node, probed from the
  deepest block down). The trees are built in memory without files (an engine on an
  empty directory is given a synthetic index; a lookup reads only the index), so the
  1M-node case fits in seconds; queries are prefixes hashed beforehand.
- **replay**: wall time of ``prefixstore replay`` of the whole Mooncake trace on the
  real engine (tmpfs cache dir), against the trace's own duration and against the
  block-level simulator (``replay/sim.py``) on the same trace and capacity.

Writes ``bench/results/run.json`` and ``bench/results/run.md`` (``--out``).

    python bench/run.py            # everything (a few minutes on 2 cores)
    python bench/run.py --quick    # a smoke run (seconds): small sizes, 200 trace requests
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import shutil
import sqlite3
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from prefixstore import Layout, Prefix, TensorSpec
from prefixstore.engine.api import Engine
from prefixstore.engine.catalog import Catalog
from prefixstore.engine.index import Index, Node

HERE = Path(__file__).resolve().parent
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


def bench_io(root: str, n_ckpt: int, ckpt_mib: int, rounds: int) -> dict[str, Any]:
    width = 1024  # bytes per token: (8, 64) bfloat16
    bt = 256
    tokens = ckpt_mib * (1 << 20) // width
    tokens -= tokens % bt
    layout = Layout(segments=[TensorSpec("kv", "bfloat16", (8, 64))], block_tokens=bt)
    g = torch.Generator().manual_seed(1)
    data = [torch.randn((tokens, 8, 64), generator=g).to(torch.bfloat16) for _ in range(n_ckpt)]
    raw_bytes = [d.view(torch.uint8).numpy().tobytes() for d in data]
    nbytes = sum(len(b) for b in raw_bytes)
    raw_dir = os.path.join(root, "raw")
    store_t: list[tuple[float, float]] = []
    read_t: list[tuple[float, float]] = []
    for r in range(rounds):
        rd = os.path.join(raw_dir, str(r))
        os.makedirs(rd)
        ed = os.path.join(root, f"engine{r}")
        prefixes = [Prefix.from_ids([r * 10**6 + i * 1000 + j for j in range(tokens // bt)]) for i in range(n_ckpt)]
        # store: raw, then engine
        t = time.perf_counter()
        for i, b in enumerate(raw_bytes):
            fd = os.open(os.path.join(rd, f"{i}.bin"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            try:
                os.write(fd, b)
                os.fsync(fd)
            finally:
                os.close(fd)
        raw_s = time.perf_counter() - t
        with Engine.open(ed, layout, 1 << 40) as eng:
            t = time.perf_counter()
            for p, d in zip(prefixes, data, strict=True):
                res = eng.store(p, {"kv": d})
                assert res.status == "stored", res
            eng_s = time.perf_counter() - t
            store_t.append((raw_s, eng_s))
            # restore: raw reads, then engine lookup + restore
            t = time.perf_counter()
            for i in range(n_ckpt):
                with open(os.path.join(rd, f"{i}.bin"), "rb") as f:
                    got = f.read()
                assert len(got) == len(raw_bytes[i])
            raw_r = time.perf_counter() - t
            t = time.perf_counter()
            for p in prefixes:
                out = eng.restore(eng.lookup(p))
                assert out is not None and out.end_tokens == tokens
            eng_r = time.perf_counter() - t
            read_t.append((raw_r, eng_r))
        shutil.rmtree(ed, ignore_errors=True)
        shutil.rmtree(rd, ignore_errors=True)
    raw_s, eng_s = _median([a for a, _ in store_t]), _median([b for _, b in store_t])
    raw_r, eng_r = _median([a for a, _ in read_t]), _median([b for _, b in read_t])
    mb = nbytes / 1e6
    return {
        "checkpoints": n_ckpt, "checkpoint_bytes": nbytes // n_ckpt, "rounds": rounds,
        "store_mb_s": mb / eng_s, "raw_write_fsync_mb_s": mb / raw_s, "store_ratio": raw_s / eng_s,
        "restore_mb_s": mb / eng_r, "raw_read_mb_s": mb / raw_r, "restore_ratio": raw_r / eng_r,
    }


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


def _lookup_at(root: str, n: int, queries: int, rounds: int) -> dict[str, Any]:
    layout = Layout(segments=[TensorSpec("kv", "uint8", (16,))], block_tokens=512)
    rng = random.Random(5)
    t = time.perf_counter()
    idx, convs = _synthetic(n, 2, 16)
    build_s = time.perf_counter() - t
    baseline = {x.key: x for x in idx}
    qs = []
    for _ in range(queries):
        chain = rng.choice(convs)
        depth = rng.randint(1, len(chain))
        qs.append(Prefix.from_ids(chain[:depth] + [rng.randrange(10**15, 10**16) for _ in range(8)]))

    def plain(i: int) -> float:
        t = time.perf_counter()
        for q in qs:
            keys = q.keys
            for j in range(len(keys) - 1, -1, -1):
                if keys[j] in baseline:
                    break
        return time.perf_counter() - t

    d = tempfile.mkdtemp(dir=root)
    try:
        with Engine.open(d, layout, 1 << 30) as eng:
            # a synthetic tree: lookups read only the index
            eng.index.nodes, eng.index.by_key, eng.index.blocks = idx.nodes, idx.by_key, idx.blocks

            def engine(i: int) -> float:
                t = time.perf_counter()
                for q in qs:
                    eng.lookup(q)
                return time.perf_counter() - t

            hits = sum(eng.lookup(q).hit for q in qs[:200])
            b, e = _rounds(rounds, plain, engine)
    finally:
        shutil.rmtree(d, ignore_errors=True)
    return {
        "nodes": len(idx), "build_s": build_s, "queries": queries, "hits_of_first_200": hits,
        "engine_us": e / queries * 1e6, "dict_us": b / queries * 1e6, "ratio": e / b,
    }


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


def markdown(r: dict[str, Any]) -> str:
    io, cat, lk, rp = r["io"], r["catalog"], r["lookup"], r.get("replay")
    ck = io["checkpoint_bytes"] / (1 << 20)
    lines = [
        f"# prefixstore bench ({'quick' if r['quick'] else 'full'} run)",
        "",
        f"{r['machine']}; load average {r['loadavg']}; data on `{r['data_dir_fs']}`. "
        "Ratios compare two measurements of the same run (medians of interleaved rounds).",
        "",
        "| what | engine | baseline | engine / baseline |",
        "| --- | ---: | ---: | ---: |",
        f"| store, {io['checkpoints']} x {ck:.0f} MiB checkpoints (FULL) vs raw write+fsync | "
        f"{io['store_mb_s']:,.0f} MB/s | {io['raw_write_fsync_mb_s']:,.0f} MB/s | {io['store_ratio']:.2f} |",
        f"| restore (lookup + read + verify) vs raw read | {io['restore_mb_s']:,.0f} MB/s | "
        f"{io['raw_read_mb_s']:,.0f} MB/s | {io['restore_ratio']:.2f} |",
    ]
    for sync in ("FULL", "NORMAL"):
        c = cat[sync]
        lines.append(
            f"| catalog single-row transactions ({sync}) vs raw SQLite WAL commits | "
            f"{c['catalog_txn_s']:,.0f} /s | {c['raw_commits_s']:,.0f} /s | {c['ratio']:.2f} |"
        )
    for x in lk:
        lines.append(
            f"| lookup, {x['nodes']:,} nodes vs dict of prefixes | {x['engine_us']:.1f} us | "
            f"{x['dict_us']:.1f} us | {x['ratio']:.1f} (slower) |"
        )
    if rp:
        lines.append(
            f"| replay, {rp['requests']:,} Mooncake requests at {rp['capacity']} vs the trace's "
            f"{rp['trace_duration_s'] / 60:.0f} min | {rp['wall_s']:.1f} s ({rp['requests_per_s']:,.0f} req/s) | "
            f"{rp['trace_duration_s']:,.0f} s | {rp['faster_than_real_time']:.0f}x faster than real time |"
        )
        lines.append(
            f"| replay on the engine vs the block-level simulator | {rp['wall_s']:.1f} s | "
            f"{rp['sim_wall_s']:.1f} s | {rp['engine_over_sim']:.0f} (slower) |"
        )
    lines += [
        "",
        "Throughput ratios above 1 favour the engine; lookup and replay ratios are times "
        "(above 1: the engine is slower). The lookup trees are built in memory without files "
        f"(conversations of 16 two-block nodes); replay hit ratio {rp['hit_ratio_blocks']:.4f} on the "
        f"engine, {rp['sim_hit_ratio_blocks']:.4f} simulated; audit {'clean' if rp['audit_ok'] else 'FAILED'}."
        if rp else "",
    ]
    return "\n".join(lines).rstrip() + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="a smoke run: small sizes, 200 trace requests")
    ap.add_argument("--out", default=str(HERE / "results"), help="where run.json and run.md go")
    ap.add_argument("--dir", default=None, help="scratch directory on the disk to measure (default: a temp dir)")
    ap.add_argument("--trace", default=str(TRACE), help="Mooncake trace for the replay")
    ap.add_argument("--capacity", default="10%", help="replay capacity (default 10%%)")
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
        print("catalog ...", file=sys.stderr, flush=True)
        res["catalog"] = bench_catalog(root, 50 if quick else 500, 2 if quick else 9)
        print("lookup ...", file=sys.stderr, flush=True)
        sizes = [1_000] if quick else [1_000, 10_000, 100_000, 1_000_000]
        res["lookup"] = bench_lookup(root, sizes, 300 if quick else 5000, 2 if quick else 5)
        print("replay ...", file=sys.stderr, flush=True)
        res["replay"] = bench_replay(Path(args.trace), 200 if quick else None, args.capacity)
        res["wall_s"] = time.perf_counter() - t0
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
