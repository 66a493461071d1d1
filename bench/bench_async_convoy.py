"""Async stores under contention: ``store_async`` latency against ``store`` in one run.

32 threads store checkpoints of a few conversations that share a system prompt and
then diverge. Each store ends at a random block of a random conversation, so stores
extend stored rows, land inside them (a split), diverge inside them (a split and a
new child) or repeat them (duplicates), on the same rows at once. A phase runs that
workload on a fresh cache, either with ``store`` (each thread waits for its store) or
with ``store_async`` (each thread submits, then waits for ``result()``: its latency is
submit to commit, queueing on the commit worker included). Rounds alternate which
phase goes first, so drift on a loaded machine cancels; every phase ends with a clean
audit and bit-identical restores of each conversation's deepest checkpoint.

The figure to read is the p99 async-store latency over the p99 synchronous-store
latency, both pooled over the rounds of this run (target: within 3x). A store that
had to wait for a row reserved by a store queued behind it on the single commit
worker would take ``inflight_wait_s`` (30 s) instead.

Writes ``async_convoy.{json,md}`` into ``--out-dir`` (default ``bench/results``;
``--quick``, a smoke run of a few seconds, writes ``async_convoy_quick.*``).

    python bench/bench_async_convoy.py           # ~30-60 s on the 2-core machine
    python bench/bench_async_convoy.py --quick   # a smoke run
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import random
import shutil
import sys
import tempfile
import threading
import time
from collections import Counter
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from prefixstore import Layout, Prefix, TensorSpec  # noqa: E402
from prefixstore.engine.api import Engine  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
BLOCK = 16
HEADS, DIM = 4, 64  # k and v, bfloat16: 1 KiB per token per rank
TARGET = 3.0


def layout(ranks: int) -> Layout:
    return Layout(segments=[TensorSpec("k", "bfloat16", (HEADS, DIM)), TensorSpec("v", "bfloat16", (HEADS, DIM))],
                  block_tokens=BLOCK, ranks=ranks)


def conversations(n: int, shared: int, blocks: int, ranks: int) -> list[tuple[list[int], list[dict]]]:
    """``n`` conversations of ``blocks`` blocks, the first ``shared`` common to all:
    (block ids, per-rank rows). A block's rows depend only on its id."""
    out = []
    for c in range(n):
        ids = list(range(shared)) + [1_000_003 * (c + 1) + i for i in range(blocks - shared)]
        per_rank = []
        for r in range(ranks):
            parts = {"k": [], "v": []}
            for b in ids:
                g = torch.Generator().manual_seed(b * 31 + r)
                for name in parts:
                    parts[name].append(torch.randn((BLOCK, HEADS, DIM), generator=g).to(torch.bfloat16))
            per_rank.append({name: torch.cat(ts) for name, ts in parts.items()})
        out.append((ids, per_rank))
    return out


def workload(seed: int, threads: int, per_thread: int, convs: int, blocks: int) -> list[list[tuple[int, int]]]:
    """Per thread, its stores: (conversation, end block)."""
    rng = random.Random(seed)
    return [[(rng.randrange(convs), rng.randint(1, blocks)) for _ in range(per_thread)] for _ in range(threads)]


def phase(mode: str, root: str, L: Layout, convs: list, plan: list[list[tuple[int, int]]],
          inflight_wait_s: float = 30.0) -> dict[str, Any]:
    """Run ``plan`` on a fresh cache at ``root`` with ``store`` or ``store_async``."""
    lat: list[float] = []
    released: list[float] = []  # async: submit to ``released`` (the device tensors reusable)
    statuses: Counter[str] = Counter()
    errors: list[str] = []
    lock = threading.Lock()
    start = threading.Barrier(len(plan))
    with Engine.open(root, L, 1 << 30, inflight_wait_s=inflight_wait_s) as eng:

        def run(mine: list[tuple[int, int]]) -> None:
            start.wait()
            for c, end in mine:
                ids, rows = convs[c]
                prefix = Prefix.from_ids(ids[:end])
                segs = [{k: v[: end * BLOCK] for k, v in r.items()} for r in rows]
                try:
                    t0 = time.perf_counter()
                    if mode == "sync":
                        res = eng.store(prefix, segs)
                    else:
                        ticket = eng.store_async(prefix, segs)
                        ticket.wait_released()
                        rel = time.perf_counter() - t0
                        res = ticket.result()
                    dt = time.perf_counter() - t0
                except Exception as exc:  # reported, and fails the run
                    with lock:
                        errors.append(f"{type(exc).__name__}: {exc}")
                    continue
                with lock:
                    lat.append(dt)
                    if mode == "async":
                        released.append(rel)
                    statuses[res.status if res.ok or not res.reason else f"{res.status}:{res.reason}"] += 1

        ths = [threading.Thread(target=run, args=(mine,)) for mine in plan]
        t0 = time.perf_counter()
        for th in ths:
            th.start()
        for th in ths:
            th.join()
        wall = time.perf_counter() - t0
        rep = eng.audit()
        verified = verify(eng, L, convs)
        splits = eng.stats()["counters"].get("replaces.split", 0)
    return {"mode": mode, "latencies_s": lat, "released_s": released, "statuses": dict(statuses), "errors": errors, "wall_s": wall,
            "audit_ok": rep.ok, "restores_verified": verified, "splits": splits}


def verify(eng: Engine, L: Layout, convs: list) -> int:
    """Each conversation's deepest checkpoint restores bit-identically; the count."""
    n = 0
    for ids, rows in convs:
        m = eng.lookup(Prefix.from_ids(ids))
        if not m.hit:
            continue
        got = eng.restore(m)
        assert got is not None, "a hit that does not restore"
        for r in range(L.ranks):
            for name, t in got.segments[r].items():
                assert torch.equal(t, rows[r][name][m.blocks * BLOCK - t.shape[0]: m.blocks * BLOCK]), (r, name)
        n += 1
    return n


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else 0.0


def summary(phases: list[dict]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for mode in ("sync", "async"):
        lat = [x for p in phases if p["mode"] == mode for x in p["latencies_s"]]
        st: Counter[str] = Counter()
        for p in phases:
            if p["mode"] == mode:
                st.update(p["statuses"])
        out[mode] = {"stores": len(lat), "p50_s": pct(lat, 0.50), "p99_s": pct(lat, 0.99), "max_s": max(lat),
                     "over_1s": sum(x > 1 for x in lat), "statuses": dict(st),
                     "splits": sum(p["splits"] for p in phases if p["mode"] == mode)}
    released = [x for p in phases for x in p["released_s"]]
    out["async"].update({"released_p50_s": pct(released, 0.50), "released_p99_s": pct(released, 0.99)})
    ratio = out["async"]["p99_s"] / out["sync"]["p99_s"]
    p99 = {(p["round"], p["mode"]): pct(p["latencies_s"], 0.99) for p in phases}
    rounds = [p99[k, "async"] / p99[k, "sync"] for k in sorted({k for k, _ in p99})]
    out.update({"p99_ratio": ratio, "p99_ratio_per_round": rounds, "target": TARGET,
                "target_met": ratio <= TARGET,
                "all_audits_ok": all(p["audit_ok"] for p in phases),
                "errors": [e for p in phases for e in p["errors"]]})
    return out


def report(res: dict) -> str:
    s = res["summary"]
    cfg = res["config"]
    lines = [f"# Async-store convoy benchmark ({res['mode']}, {res['date']})", "",
             f"{res['host']}: {res['cpus']} CPUs, torch {res['torch']}; load average "
             f"{res['loadavg_start'][0]:.1f} at start, {res['loadavg_end'][0]:.1f} at end", "",
             f"{cfg['threads']} threads x {cfg['per_thread']} stores per phase, {cfg['conversations']} conversations "
             f"of {cfg['blocks']} blocks ({cfg['shared']} shared), {cfg['ranks']} rank(s), {BLOCK}-token blocks, "
             f"disk backing in `{cfg['workdir']}`, `inflight_wait_s={cfg['inflight_wait_s']:g}`; {cfg['rounds']} round(s), "
             "each a `store` phase and a `store_async` phase (alternating which goes first), each on a fresh cache.",
             "",
             "| | stores | p50 ms | p99 ms | max ms | over 1 s | splits | outcomes |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: | --- |"]
    for mode, label in (("sync", "`store`"), ("async", "`store_async` + `result()`")):
        m = s[mode]
        outcomes = ", ".join(f"{k} {v}" for k, v in sorted(m["statuses"].items()))
        lines.append(f"| {label} | {m['stores']} | {m['p50_s'] * 1e3:.1f} | {m['p99_s'] * 1e3:.1f} | "
                     f"{m['max_s'] * 1e3:.1f} | {m['over_1s']} | {m['splits']} | {outcomes} |")
    lines += ["", "## Verdict", "",
              f"- p99 async / p99 sync: {s['p99_ratio']:.2f} (target <= {TARGET:g}: "
              f"{'met' if s['target_met'] else 'NOT met'}); per round: "
              + ", ".join(f"{x:.2f}" for x in s["p99_ratio_per_round"]),
              f"- `store_async` until `released` (the device tensors reusable): p50 "
              f"{s['async']['released_p50_s'] * 1e3:.1f} ms, p99 {s['async']['released_p99_s'] * 1e3:.1f} ms",
              f"- audits: {'all clean' if s['all_audits_ok'] else 'FAILED'}; errors: {len(s['errors'])}; "
              "each phase's deepest checkpoints restored bit-identically"]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="a smoke run (seconds)")
    ap.add_argument("--out-dir", default=os.path.join(HERE, "results"))
    ap.add_argument("--threads", type=int, default=32)
    ap.add_argument("--ranks", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=None)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--workdir", default=None, help="where the caches go (default: the system temp dir)")
    ap.add_argument("--inflight-wait-s", type=float, default=30.0,
                    help="the engine's inflight_wait_s (default: the engine's default)")
    args = ap.parse_args(argv)
    cfg = {"threads": args.threads, "ranks": args.ranks, "conversations": 6, "shared": 4, "blocks": 24,
           "per_thread": 2 if args.quick else 6, "rounds": args.rounds or (1 if args.quick else 4), "seed": args.seed,
           "inflight_wait_s": args.inflight_wait_s, "workdir": args.workdir or tempfile.gettempdir()}
    L = layout(args.ranks)
    convs = conversations(cfg["conversations"], cfg["shared"], cfg["blocks"], args.ranks)
    res: dict[str, Any] = {"mode": "quick" if args.quick else "full", "host": os.uname().nodename,
                           "cpus": os.cpu_count(), "torch": torch.__version__, "config": cfg,
                           "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
                           "loadavg_start": os.getloadavg()}
    workdir = tempfile.mkdtemp(prefix="prefixstore-convoy-", dir=args.workdir)
    phases = []
    try:
        for k in range(cfg["rounds"]):
            plan = workload(args.seed + k, args.threads, cfg["per_thread"], cfg["conversations"], cfg["blocks"])
            for mode in (("sync", "async") if k % 2 == 0 else ("async", "sync")):
                p = phase(mode, os.path.join(workdir, f"{mode}{k}"), L, convs, plan, args.inflight_wait_s)
                phases.append({"round": k, **p})
                print(f"round {k} {mode}: p99 {pct(p['latencies_s'], 0.99) * 1e3:.1f} ms, "
                      f"wall {p['wall_s']:.1f} s, audit {'ok' if p['audit_ok'] else 'FAILED'}", flush=True)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    res["loadavg_end"] = os.getloadavg()
    res["summary"] = summary(phases)
    res["phases"] = [p | {k: sorted(round(x, 6) for x in p[k]) for k in ("latencies_s", "released_s")} for p in phases]
    md = report(res)
    print(md)
    os.makedirs(args.out_dir, exist_ok=True)
    stem = os.path.join(args.out_dir, "async_convoy" + ("_quick" if args.quick else ""))
    with open(stem + ".json", "w") as f:
        json.dump(res, f, indent=2)
    with open(stem + ".md", "w") as f:
        f.write(md)
    s = res["summary"]
    return 0 if s["all_audits_ok"] and not s["errors"] else 1


if __name__ == "__main__":
    sys.exit(main())
