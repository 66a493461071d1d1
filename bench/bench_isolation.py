"""Isolation benchmark: the engine's own CPU work on the request path, and what
background store traffic costs a foreground restore. Reported as ratios to baselines
measured in the same run.

1. **Request-path overhead**, per backing (disk, memory, composite): for requests of
   several sizes, rounds that interleave (alternating which goes first) one engine
   request with one plain copy of the same bytes; every figure is the median over
   rounds of the round's ratio.

   - *Numerator, the engine's own CPU*: the CPU time of the calling thread
     (``time.thread_time``: user and system time of this thread only, so other
     processes and the engine's idle worker threads do not inflate it) over
     ``lookup`` (with the restore cost rule deciding) + ``pin`` + ``restore`` +
     ``unpin``, minus the thread CPU the restore spent inside the executor's copy
     calls (``eng.transfers.last_restore['move_cpu_s']``: on the CPU executor the
     memcpys themselves, the page faults of first touching a fresh output, and the
     slicing of each copy's views). So the byte copy is *not* counted; what is: the
     lookup and cost decision, pins, the RAM tier's buffer references and header
     checks, allocating the outputs, bookkeeping (recency, counters), locks, and the
     cache misses this code takes after the copy evicted its data (file reads run on
     reader threads, so on file-backed tiers their CPU is not in the numerator either).
   - *Denominator, the transfer baseline*: the time of a plain copy of the same bytes
     through the same executor, measured in the same round: allocate the
     request's output tensors (``executor.empty``, one per segment and rank, as a
     restore does) and copy the request's bytes into them from a host buffer of the
     executor's staging pool (``upload_batch``, one copy per segment and rank; on
     CUDA synchronised), i.e. what the cost rule's ``transfer_s`` models, taken
     beside the request instead of from the bandwidth calibrated once at open (that
     16 MiB probe moved 6x between runs on a shared machine). For the memory backing
     this is the RAM tier's transfer; for file-backed tiers it leaves the file read
     out, a stricter denominator. Its time is the thread CPU of the copy on the CPU
     executor (the copy is this thread's memcpy: the numerator's clock; its wall time,
     reported beside it, is larger only by preemption on a shared machine, which would
     flatter the ratio) and the wall time on CUDA (the copy is DMA).
     ``modeled_restore_s`` (the calibrated estimate) is still reported, not used.
   - Also reported: ``ratio_by_difference`` (CPU executor), (request CPU - baseline
     copy CPU) / baseline, which does not trust the engine's own ``move_cpu_s`` (it
     also counts the engine's copy being slower or faster than the plain one); the same
     numerator with the CPU executor's copies elided (caches as under DMA); the
     numerator against an H200's pinned link (55 GB/s, FACTS.md); a wall-clock
     variant. Target: under 2%.
2. **Interference** on the RAM tier (``backing='memory'``): the wall time of foreground
   restores alone, against the same restores while another thread stores new
   checkpoints with ``store_async`` as fast as it can (staging, checksums, catalog
   commits, evictions). Each round runs both phases (alternating which goes first, to
   cancel drift); the slowdown is the median over rounds of busy/alone medians.
   Target: under 2% slower.

Writes ``isolation_<date>.json`` and ``.md`` into ``--out-dir`` (default
``bench/results``). ``--smoke`` runs tiny sizes quickly (a check that it runs).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from prefixstore import Layout, Prefix, TensorSpec  # noqa: E402
from prefixstore.engine.api import Engine  # noqa: E402
from prefixstore.statemachine.cost import CostModel  # noqa: E402

MiB = 1 << 20
HEADS, DIM, BLOCK = 8, 128, 256  # k and v, bfloat16: 4 KiB per token per rank
TOKEN_BYTES = 2 * HEADS * DIM * 2
H200_LINK = 55.0e9  # pinned host-to-device bytes/s on the H200 (FACTS.md)


def layout(ranks: int) -> Layout:
    return Layout(segments=[TensorSpec("k", "bfloat16", (HEADS, DIM)), TensorSpec("v", "bfloat16", (HEADS, DIM))],
                  block_tokens=BLOCK, ranks=ranks)


def rows(tokens: int, ranks: int, seed: int, device: str = "cpu") -> list[dict[str, torch.Tensor]]:
    g = torch.Generator(device=device).manual_seed(seed)
    return [{n: torch.randn((tokens, HEADS, DIM), generator=g, device=device).to(torch.bfloat16)
             for n in ("k", "v")} for _ in range(ranks)]


def conversation(eng: Engine, seed: int, tokens: int, every: int, ranks: int, device: str = "cpu") -> list[int]:
    """Store a conversation's checkpoints every ``every`` tokens; returns its block ids."""
    ids = [seed * 1_000_003 + i for i in range(tokens // BLOCK)]
    segs = rows(tokens, ranks, seed, device)
    for end in range(every, tokens + 1, every):
        res = eng.store(Prefix.from_ids(ids[: end // BLOCK]), [{k: v[:end] for k, v in s.items()} for s in segs])
        assert res.ok, res
    return ids


def request_overhead(backing: str, sizes: list[int], reps: int, ranks: int, workdir: str,
                     executor=None, device: str = "cpu", every: int = 2048) -> list[dict]:
    """Per size: the engine's own CPU per request over a plain copy of the same bytes,
    interleaved round by round (see the module docstring for what each side counts)."""
    root = tempfile.mkdtemp(dir=workdir)
    out = []
    try:
        top = max(sizes)
        cap = 4 * ranks * top * TOKEN_BYTES + 64 * MiB
        with Engine.open(root, layout(ranks), cap, backing=backing, ram_bytes=cap, cost=CostModel(),
                         bandwidth="measure", synchronous="NORMAL", executor=executor) as eng:
            ids = conversation(eng, 1, top, every=every, ranks=ranks, device=device)  # a turn per `every` tokens
            for tokens in sizes:
                prefix = Prefix.from_ids(ids[: tokens // BLOCK])
                with Baseline(eng, tokens, rows(tokens, ranks, 1, "cpu")) as base:
                    out.append({"backing": backing, **_overhead(eng, prefix, tokens, reps, base, device)})
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return out


def _overhead(eng: Engine, prefix: Prefix, tokens: int, reps: int, base: Baseline, device: str) -> dict:
    """One size's rounds and figures (``request_overhead``)."""
    _request(eng, prefix, tokens)  # warms the caches and the allocator
    base.time()
    rounds = []  # (own CPU, own wall, request CPU, baseline wall, baseline CPU)
    for k in range(reps):
        if k % 2 == 0:  # alternate which goes first: each follows the other's copy as often
            b = base.time()
            own, wall, total, m = _request(eng, prefix, tokens)
        else:
            own, wall, total, m = _request(eng, prefix, tokens)
            b = base.time()
        rounds.append((own, wall, total, *b))
    rounds = [(*r, r[4] if device == "cpu" else r[3]) for r in rounds]  # + the baseline's time (index 5)
    ratios = [r[0] / r[5] for r in rounds]
    base_s = statistics.median(r[5] for r in rounds)
    cpu_s = statistics.median(r[0] for r in rounds)
    elided = _elided_cpu(eng, prefix, tokens, reps) if device == "cpu" else None
    return {
        "tokens": tokens, "bytes": m.nbytes, "nodes": len(m.path), "rounds": reps,
        "baseline_copy_s_median": base_s, "baseline_copy_wall_s_median": statistics.median(r[3] for r in rounds),
        "baseline_copy_s_spread": [min(r[5] for r in rounds), max(r[5] for r in rounds)],
        "engine_cpu_s_median": cpu_s, "engine_cpu_s_spread": [min(r[0] for r in rounds), max(r[0] for r in rounds)],
        "request_cpu_s_median": statistics.median(r[2] for r in rounds),
        "ratio_median": statistics.median(ratios), "ratio_max": max(ratios),
        "ratio_by_difference": (statistics.median((r[2] - r[4]) / r[5] for r in rounds)
                                if device == "cpu" else None),
        "wall_ratio_median": statistics.median(r[1] / r[3] for r in rounds),
        "engine_cpu_s_elided": elided, "ratio_elided": None if elided is None else elided / base_s,
        "ratio_at_h200_link": cpu_s / (m.nbytes / H200_LINK),
        "modeled_restore_s": m.transfer_s, "bandwidth_bytes_per_s": eng.cost.bandwidth_bytes_per_s,
        "calibration": eng.calibration.get("source"),
    }


class Baseline:
    """The transfer baseline of a request of ``tokens`` tokens: a plain copy of its bytes
    through the engine's executor into freshly allocated outputs (one tensor per segment
    and rank, as a restore allocates), from a host buffer of the executor's staging pool
    (pinned on CUDA) that holds the same rows. A context manager: the buffer goes back
    to the pool on exit."""

    def __init__(self, eng: Engine, tokens: int, segs: list[dict[str, torch.Tensor]]) -> None:
        self.ex, self.segments, self.tokens = eng.executor, eng.layout.segments, tokens
        self.ranks = len(segs)
        sizes = [tokens * s.nbytes for s in self.segments]
        self.src = self.ex.pool.acquire(self.ranks * sum(sizes))
        view, off = self.src.view(), 0
        for seg in segs:
            for s, n in zip(self.segments, sizes, strict=True):
                view[off : off + n].copy_(seg[s.name][:tokens].reshape(-1).view(torch.uint8))
                off += n

    def __enter__(self) -> Baseline:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.src.release()

    def time(self) -> tuple[float, float]:
        """Wall and thread CPU seconds of one plain copy: allocate, copy, wait."""
        ex, segments, tokens = self.ex, self.segments, self.tokens
        c0, t0 = time.thread_time(), time.perf_counter()
        outs = [{s.name: ex.empty((tokens, *s.shape), s.torch_dtype) for s in segments} for _ in range(self.ranks)]
        src, ops, off = ex.source(self.src), [], 0
        for o in outs:
            for s in segments:
                n = tokens * s.nbytes
                ops.append((ex.flat(o[s.name]), 0, src, off, n))
                off += n
        ex.begin_uploads()
        ex.upload_batch(ops)
        done = ex.record()
        ex.finish_uploads()
        done.wait()
        c1, t1 = time.thread_time(), time.perf_counter()
        del ops, outs
        return t1 - t0, c1 - c0


def _request(eng: Engine, prefix: Prefix, tokens: int) -> tuple[float, float, float, Any]:
    """One request (lookup, pin, restore, unpin): the CPU and wall seconds the engine
    spent on its own (the time it spent moving bytes taken out), the request's whole
    thread CPU, and its match."""
    c0, t0 = time.thread_time(), time.perf_counter()
    m = eng.lookup(prefix, total_tokens=tokens)
    assert m.hit, m
    eng.pin(m)
    r = eng.restore(m)
    eng.unpin(m)
    c1, t1 = time.thread_time(), time.perf_counter()
    assert r is not None
    last = eng.transfers.last_restore
    del r
    return (c1 - c0) - last["move_cpu_s"], (t1 - t0) - last["move_s"], c1 - c0, m


def _elided_cpu(eng: Engine, prefix: Prefix, tokens: int, reps: int) -> float:
    """Median CPU seconds of the same request with the CPU executor's upload copies
    elided (the bytes are not moved; the engine does everything else), ``reps``
    requests back to back (no baseline copy between them) after one that warms.

    On this CPU-only machine an upload is a memcpy on the request thread, which evicts
    the caches the engine's own code runs from (every later step pays misses); a GPU's
    copy engine moves the bytes by DMA and leaves them alone. This is the engine's
    bookkeeping with its caches as a GPU host would keep them. Reported beside the
    measured figure, never instead of it."""
    ex = eng.executor
    real = ex.upload_bytes
    ex.upload_bytes = lambda *a: None
    try:
        _request(eng, prefix, tokens)
        return statistics.median(_request(eng, prefix, tokens)[0] for _ in range(reps))
    finally:
        ex.upload_bytes = real


def interference(tokens: int, bg_tokens: int, rounds: int, per_phase: int, ranks: int, workdir: str,
                 executor=None, device: str = "cpu") -> dict:
    """Foreground restore times alone vs beside background store_async traffic (RAM tier)."""
    root = tempfile.mkdtemp(dir=workdir)
    try:
        cap = ranks * (4 * tokens + 8 * bg_tokens) * TOKEN_BYTES + 64 * MiB
        with Engine.open(root, layout(ranks), cap, backing="memory", synchronous="NORMAL",
                         executor=executor) as eng:
            ids = conversation(eng, 2, tokens, every=tokens, ranks=ranks, device=device)
            prefix = Prefix.from_ids(ids)
            bg_rows = rows(bg_tokens, ranks, 3, device)
            stop = threading.Event()
            stored = [0]

            def background() -> None:
                n = 0
                while n == 0 or not stop.is_set():  # at least one store, however late it starts
                    n += 1
                    p = Prefix.from_ids([10**12 + n * 1_000_003 + i for i in range(bg_tokens // BLOCK)])
                    t = eng.store_async(p, bg_rows)
                    t.wait_released()
                    if t.result().ok:
                        stored[0] += 1

            def phase() -> list[float]:
                times = []
                for _ in range(per_phase):
                    if device == "cuda":
                        torch.cuda.synchronize()
                    t0 = time.perf_counter()
                    r = eng.restore(eng.lookup(prefix))
                    if device == "cuda":
                        torch.cuda.synchronize()
                    times.append(time.perf_counter() - t0)
                    assert r is not None
                    del r
                return times

            phase()  # warm-up
            alone, busy, paired = [], [], []
            for k in range(rounds):
                # Alternate which phase goes first, so drift within a round cancels too.
                order = ("alone", "busy") if k % 2 == 0 else ("busy", "alone")
                got = {}
                for which in order:
                    if which == "alone":
                        got[which] = phase()
                        continue
                    stop.clear()
                    th = threading.Thread(target=background)
                    th.start()
                    time.sleep(0.05)
                    got[which] = phase()
                    stop.set()
                    th.join()
                alone += got["alone"]
                busy += got["busy"]
                paired.append(statistics.median(got["busy"]) / statistics.median(got["alone"]) - 1)
            gate = eng.stats()["transfers"]["copies"]
            assert eng.audit(checksums=False).ok
        a, b = statistics.median(alone), statistics.median(busy)
        return {"restore_tokens": tokens, "restore_bytes": ranks * tokens * TOKEN_BYTES,
                "background_store_bytes": ranks * bg_tokens * TOKEN_BYTES, "background_stores": stored[0],
                "restores_per_phase": per_phase, "rounds": rounds,
                "alone_median_s": a, "with_background_median_s": b, "slowdown_pooled": b / a - 1,
                "slowdown_per_round": paired, "slowdown": statistics.median(paired),
                "gate_waits": gate["gate_waits"], "gate_wait_s": gate["gate_wait_s"]}
    finally:
        shutil.rmtree(root, ignore_errors=True)


def report(res: dict) -> str:
    lines = [f"# Isolation benchmark ({res['mode']}, {res['date']})", "",
             f"{res['host']}: {res['cpus']} CPUs, torch {res['torch']}, device {res['device']}; load average "
             f"{res['loadavg_start'][0]:.1f} at start, {res['loadavg_end'][0]:.1f} at end", "",
             "## Engine CPU work on the request path / a plain copy of the same bytes, same rounds "
             "(target < 0.02)", "",
             "| backing | tokens | MiB | nodes | plain copy ms | engine CPU ms | ratio (median) | max "
             "| by difference | wall-clock ratio | ratio at 55 GB/s | CPU ms, copies elided | ratio, copies elided "
             "| modeled ms (calibrated, not used) |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in res["overhead"]:
        diff = r.get("ratio_by_difference")
        lines.append(f"| {r['backing']} | {r['tokens']} | {r['bytes'] / MiB:.0f} | {r['nodes']} | "
                     f"{r['baseline_copy_s_median'] * 1e3:.3f} | "
                     f"{r['engine_cpu_s_median'] * 1e3:.3f} | {r['ratio_median']:.4f} | {r['ratio_max']:.4f} | "
                     + ("- | " if diff is None else f"{diff:.4f} | ")
                     + f"{r['wall_ratio_median']:.4f} | {r['ratio_at_h200_link']:.4f} | "
                     + ("- | - |" if r.get("ratio_elided") is None else
                        f"{r['engine_cpu_s_elided'] * 1e3:.3f} | {r['ratio_elided']:.4f} |")
                     + f" {r['modeled_restore_s'] * 1e3:.2f} |")
    i = res["interference"]
    lines += ["", "## Background stores vs foreground restores, RAM tier (target < 0.02)", "",
              f"- restore of {i['restore_bytes'] / MiB:.0f} MiB: median {i['alone_median_s'] * 1e3:.2f} ms alone, "
              f"{i['with_background_median_s'] * 1e3:.2f} ms beside background stores "
              f"({i['background_stores']} stores of {i['background_store_bytes'] / MiB:.0f} MiB)",
              f"- slowdown: {i['slowdown']:+.4f}, the median over {i['rounds']} rounds of each round's busy/alone "
              f"medians (rounds alternate which phase goes first; pooled medians: {i['slowdown_pooled']:+.4f}; "
              f"per round: {', '.join(f'{x:+.3f}' for x in i['slowdown_per_round'])})",
              f"- gate waits: {i['gate_waits']}, {i['gate_wait_s']:.3f} s", "",
              "## Verdict", ""]
    s = res["summary"]
    lines += [f"- request-path overhead, worst median ratio: {s['overhead_ratio_max']:.4f} "
              f"({'met' if s['overhead_target_met'] else 'NOT met'})"]
    if s.get("elided_ratio_max") is not None:
        lines += [f"- the same with the upload copies elided (caches as under DMA): worst "
                  f"{s['elided_ratio_max']:.4f} ({'met' if s['elided_ratio_max'] < 0.02 else 'NOT met'}; "
                  "the verdict above is the measured one)"]
    lines += [
              f"- interference slowdown: {s['slowdown']:+.4f} ({'met' if s['interference_target_met'] else 'NOT met'})"]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--out-dir", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    ap.add_argument("--ranks", type=int, default=1)
    ap.add_argument("--workdir", default=None)
    args = ap.parse_args(argv)
    if args.smoke:
        sizes, every, reps, fg, bg, rounds, per = [BLOCK * 4, BLOCK * 8], BLOCK, 2, BLOCK * 4, BLOCK * 2, 1, 3
    else:
        sizes, every, reps, fg, bg, rounds, per = [8192, 32768, 65536], 2048, 15, 16384, 4096, 12, 10
    workdir = tempfile.mkdtemp(prefix="prefixstore-iso-", dir=args.workdir)
    res: dict = {"mode": "smoke" if args.smoke else "full", "host": os.uname().nodename,
                 "cpus": os.cpu_count(), "torch": torch.__version__, "device": "cpu",
                 "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"), "overhead": [],
                 "loadavg_start": os.getloadavg()}
    try:
        for backing in ("disk", "memory", "composite"):
            res["overhead"] += request_overhead(backing, sizes, reps, args.ranks, workdir, every=every)
            print(f"{backing}: " + ", ".join(f"{r['tokens']} tok {r['ratio_median']:.4f}"
                                              for r in res["overhead"] if r["backing"] == backing), flush=True)
        res["interference"] = interference(fg, bg, rounds, per, args.ranks, workdir)
        print(f"interference slowdown {res['interference']['slowdown']:+.4f}", flush=True)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    res["loadavg_end"] = os.getloadavg()
    worst = max(r["ratio_median"] for r in res["overhead"])
    elided = [r["ratio_elided"] for r in res["overhead"] if r.get("ratio_elided") is not None]
    res["summary"] = {"overhead_ratio_max": worst, "overhead_target_met": worst < 0.02,
                      "elided_ratio_max": max(elided) if elided else None,
                      "slowdown": res["interference"]["slowdown"],
                      "interference_target_met": res["interference"]["slowdown"] < 0.02}
    md = report(res)
    print(md)
    os.makedirs(args.out_dir, exist_ok=True)
    stem = os.path.join(args.out_dir, f"isolation_{res['date'][:10]}" + ("_smoke" if args.smoke else ""))
    with open(stem + ".json", "w") as f:
        json.dump(res, f, indent=2)
    with open(stem + ".md", "w") as f:
        f.write(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
