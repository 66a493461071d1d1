"""Device benchmark: raw link bandwidth against what the engine achieves, in one run.

On one GPU (made for an H200; well under 10 minutes) it prints and writes to ``--out``
(JSON, plus the same name with ``.md``):

1. raw pinned host-to-device and device-to-host bandwidth at each checkpoint size
   (one ``copy_(non_blocking=True)`` of a pinned buffer, timed with events);
2. the engine's restore and store bandwidth from the RAM tier (``backing='memory'``)
   for checkpoints of 16 MiB to 2 GiB per rank: restore = ``lookup`` + ``restore`` until
   the data is on the device; store = ``store_async`` until ``released`` (the device
   blocks may be reused; the durable commit follows in the background). Each result is
   checked bit-identical;
3. end-to-end restore from the disk tier (``backing='disk'``, page cache dropped with
   ``posix_fadvise``) against the raw read bandwidth of the same file into pinned memory;
4. the ratios (targets: restore >= 0.9 of raw H2D and store >= 0.9 of raw D2H for
   checkpoints of 256 MiB and more);
5. the slowdown of foreground RAM-tier restores beside background ``store_async``
   traffic (``bench_isolation.interference`` on the device; target < 2%);
6. the engine's own CPU work on the request path against a plain upload of the same
   bytes measured in the same rounds, per backing (``bench_isolation.request_overhead`` on the device, where the copies
   are DMA; target < 2%).

``--smoke`` runs the same code on the CPU with small sizes (CI runs it: see
tests/test_executor.py); its numbers mean nothing. Commit a device run's output under
``bench/results/`` with the date, e.g. ``bench/results/device_h200_2026-12-01.json``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import shutil
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from prefixstore import Layout, Prefix, TensorSpec  # noqa: E402
from prefixstore.engine.api import Engine  # noqa: E402
from prefixstore.gpu.executor import CpuExecutor, CudaExecutor  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_isolation  # noqa: E402

MiB = 1 << 20
HEADS, DIM = 8, 128  # k and v, bfloat16: 4 KiB per token per rank
TOKEN_BYTES = 2 * HEADS * DIM * 2
BLOCK = 256


def layout() -> Layout:
    return Layout(segments=[TensorSpec("k", "bfloat16", (HEADS, DIM)), TensorSpec("v", "bfloat16", (HEADS, DIM))],
                  block_tokens=BLOCK)


def sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def timed(fn, dev: torch.device, reps: int) -> float:
    """Best wall time of ``fn`` over ``reps`` runs, device work included."""
    best = math.inf
    for _ in range(reps):
        sync(dev)
        t0 = time.perf_counter()
        fn()
        sync(dev)
        best = min(best, time.perf_counter() - t0)
    return best


def raw_link(dev: torch.device, nbytes: int, reps: int) -> dict[str, float]:
    pin = dev.type == "cuda"
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin)
    host.fill_(7)
    devbuf = torch.empty(nbytes, dtype=torch.uint8, device=dev)
    h2d = timed(lambda: devbuf.copy_(host, non_blocking=True), dev, reps)
    d2h = timed(lambda: host.copy_(devbuf, non_blocking=True), dev, reps)
    return {"bytes": nbytes, "h2d_bytes_per_s": nbytes / h2d, "d2h_bytes_per_s": nbytes / d2h}


def checkpoint(dev: torch.device, nbytes: int, seed: int):
    tokens = nbytes // TOKEN_BYTES
    g = torch.Generator(device=dev).manual_seed(seed)
    k = torch.randn((tokens, HEADS, DIM), generator=g, device=dev).to(torch.bfloat16)
    v = torch.randn((tokens, HEADS, DIM), generator=g, device=dev).to(torch.bfloat16)
    ids = [seed * 1_000_003 + i for i in range(tokens // BLOCK)]
    return Prefix.from_ids(ids), {"k": k, "v": v}


def ram_tier(ex, dev: torch.device, nbytes: int, reps: int, workdir: str) -> dict:
    root = tempfile.mkdtemp(dir=workdir)
    try:
        with Engine.open(root, layout(), 3 * nbytes + 64 * MiB, backing="memory", executor=ex,
                         synchronous="NORMAL") as eng:
            prefix, segs = checkpoint(dev, nbytes, seed=nbytes // MiB)
            store_s = math.inf
            for i in range(reps + 1):  # the first run warms the pinned pool
                sync(dev)
                t0 = time.perf_counter()
                ticket = eng.store_async(prefix, segs)
                ticket.wait_released()
                dt = time.perf_counter() - t0
                assert ticket.result().status == "stored", ticket.result()
                if i:
                    store_s = min(store_s, dt)
                if i < reps:
                    eng.evict(prefix=prefix)  # its buffer returns to the pool
            m = eng.lookup(prefix)
            out = {}

            def restore():
                out["r"] = eng.restore(eng.lookup(prefix))

            restore()  # warm-up
            restore_s = timed(restore, dev, reps)
            r = out.pop("r")
            same = all(torch.equal(r.segments[0][k], segs[k]) for k in segs)
            rep = eng.audit(checksums=False)
            assert m.hit and rep.ok, (m, [v.detail for v in rep.violations])
            last = eng.stats()["transfers"]
        return {"bytes": nbytes, "restore_bytes_per_s": nbytes / restore_s, "store_bytes_per_s": nbytes / store_s,
                "restore_s": restore_s, "store_release_s": store_s, "bit_identical": bool(same),
                "host_copy_bytes": last["copies"]["host_copy_bytes"]}
    finally:
        shutil.rmtree(root, ignore_errors=True)


def drop_cache(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        if hasattr(os, "posix_fadvise"):
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def disk_tier(ex, dev: torch.device, nbytes: int, reps: int, workdir: str) -> dict:
    root = tempfile.mkdtemp(dir=workdir)
    try:
        with Engine.open(root, layout(), 2 * nbytes + 64 * MiB, backing="disk", executor=ex) as eng:
            prefix, segs = checkpoint(dev, nbytes, seed=7 + nbytes // MiB)
            assert eng.store(prefix, segs).status == "stored"
            name = eng.catalog.query("SELECT name FROM files")[0][0]
            path = os.path.join(eng.ranks[0].directory, name)
            size = os.path.getsize(path)
            buf = ex.pool.acquire(size)
            raw_s = restore_s = math.inf
            same = False
            for _ in range(reps):
                drop_cache(path)
                t0 = time.perf_counter()
                fd = os.open(path, os.O_RDONLY)
                try:
                    got, view = 0, buf.mv()
                    while view:
                        n = os.preadv(fd, [view], got)
                        if n <= 0:
                            break
                        got, view = got + n, view[n:]
                finally:
                    os.close(fd)
                raw_s = min(raw_s, time.perf_counter() - t0)
                drop_cache(path)
                sync(dev)
                t0 = time.perf_counter()
                r = eng.restore(eng.lookup(prefix))
                sync(dev)
                restore_s = min(restore_s, time.perf_counter() - t0)
                same = all(torch.equal(r.segments[0][k], segs[k]) for k in segs)
                del r
            buf.release()
        return {"bytes": nbytes, "file_bytes": size, "raw_read_bytes_per_s": size / raw_s,
                "restore_bytes_per_s": nbytes / restore_s, "ratio": (nbytes / restore_s) / (size / raw_s),
                "bit_identical": bool(same)}
    finally:
        shutil.rmtree(root, ignore_errors=True)


def gbs(x: float) -> str:
    return f"{x / 1e9:7.2f}"


def report(res: dict) -> str:
    lines = [f"# Device benchmark ({res['mode']}, {res['device']}, {res['date']})", "",
             f"torch {res['torch']}; pin mode {res['pin']}; host {res['host']}", "",
             "## Raw pinned link (GB/s)", "", "| size MiB | H2D | D2H |", "| ---: | ---: | ---: |"]
    for row in res["raw"]:
        lines.append(f"| {row['bytes'] // MiB} | {gbs(row['h2d_bytes_per_s'])} | {gbs(row['d2h_bytes_per_s'])} |")
    lines += ["", "## Engine: restore from the RAM tier and store until release (GB/s)", "",
              "| size MiB | restore | / raw H2D | store | / raw D2H | bit-identical |",
              "| ---: | ---: | ---: | ---: | ---: | :---: |"]
    for row in res["ram_tier"]:
        lines.append(f"| {row['bytes'] // MiB} | {gbs(row['restore_bytes_per_s'])} | {row['restore_ratio']:.3f} | "
                     f"{gbs(row['store_bytes_per_s'])} | {row['store_ratio']:.3f} | {row['bit_identical']} |")
    lines += ["", "## Engine: end-to-end restore from the disk tier (GB/s)", "",
              "| size MiB | raw read | restore | ratio | bit-identical |", "| ---: | ---: | ---: | ---: | :---: |"]
    for row in res["disk_tier"]:
        lines.append(f"| {row['bytes'] // MiB} | {gbs(row['raw_read_bytes_per_s'])} | "
                     f"{gbs(row['restore_bytes_per_s'])} | {row['ratio']:.3f} | {row['bit_identical']} |")
    lines += ["", "## Engine CPU work on the request path / a plain upload of the same bytes, same rounds", "",
              "| backing | tokens | MiB | nodes | modeled ms (calibrated) | plain upload ms | engine CPU ms "
              "| ratio (median) | max |",
              "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in res["overhead"]:
        lines.append(f"| {r['backing']} | {r['tokens']} | {r['bytes'] / MiB:.0f} | {r['nodes']} | "
                     f"{r['modeled_restore_s'] * 1e3:.2f} | {r['baseline_copy_s_median'] * 1e3:.3f} | "
                     f"{r['engine_cpu_s_median'] * 1e3:.3f} | {r['ratio_median']:.4f} | {r['ratio_max']:.4f} |")
    s = res["summary"]
    lines += ["", "## Summary", "",
              f"- restore from the RAM tier / raw H2D, checkpoints >= 256 MiB: min {s['restore_ratio_min']:.3f} "
              f"(target 0.9: {'met' if s['restore_target_met'] else 'NOT met'})",
              f"- store until release / raw D2H, checkpoints >= 256 MiB: min {s['store_ratio_min']:.3f} "
              f"(target 0.9: {'met' if s['store_target_met'] else 'NOT met'})",
              f"- disk-tier restore / raw disk read: min {s['disk_ratio_min']:.3f}",
              f"- foreground restores beside background stores (RAM tier): {s['interference_slowdown']:+.4f} "
              f"slower (target < 0.02: {'met' if s['interference_slowdown'] < 0.02 else 'NOT met'})",
              f"- engine CPU on the request path / a plain upload of the same bytes, worst median over backings and sizes: "
              f"{s['overhead_ratio_max']:.4f} (target < 0.02: {'met' if s['overhead_ratio_max'] < 0.02 else 'NOT met'})",
              f"- wall time {res['wall_s']:.1f} s"]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="JSON output path (a .md report is written beside it)")
    ap.add_argument("--smoke", action="store_true", help="CPU tensors, small sizes: checks the script runs")
    ap.add_argument("--sizes-mib", type=int, nargs="*", default=[16, 64, 256, 1024, 2048])
    ap.add_argument("--disk-sizes-mib", type=int, nargs="*", default=[256, 1024])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--pin", choices=["torch", "register"], default="torch")
    ap.add_argument("--workdir", default=None, help="directory for the caches (default: a temp dir)")
    args = ap.parse_args(argv)
    t_start = time.perf_counter()
    if args.smoke:
        dev, ex = torch.device("cpu"), CpuExecutor()
        sizes, disk_sizes, reps = [1, 4], [2], 2
    else:
        if not torch.cuda.is_available():
            print("no CUDA device: run with --smoke for the CPU smoke test", file=sys.stderr)
            return 2
        dev = torch.device("cuda", torch.cuda.current_device())
        ex = CudaExecutor(dev, keep_bytes=24 << 30, pin=args.pin)
        sizes, disk_sizes, reps = args.sizes_mib, args.disk_sizes_mib, args.reps
    workdir = tempfile.mkdtemp(prefix="prefixstore-bench-", dir=args.workdir)
    res: dict = {
        "mode": "smoke" if args.smoke else "device",
        "device": "cpu" if dev.type == "cpu" else torch.cuda.get_device_name(dev),
        "torch": torch.__version__, "pin": getattr(ex, "pin", "n/a"), "host": os.uname().nodename,
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "raw": [], "ram_tier": [], "disk_tier": [],
    }
    try:
        for mib in sizes:
            raw = raw_link(dev, mib * MiB, reps)
            res["raw"].append(raw)
            row = ram_tier(ex, dev, mib * MiB, reps, workdir)
            row["restore_ratio"] = row["restore_bytes_per_s"] / raw["h2d_bytes_per_s"]
            row["store_ratio"] = row["store_bytes_per_s"] / raw["d2h_bytes_per_s"]
            res["ram_tier"].append(row)
            print(f"RAM tier {mib:5d} MiB: restore {gbs(row['restore_bytes_per_s'])} GB/s "
                  f"({row['restore_ratio']:.3f} of raw H2D), store {gbs(row['store_bytes_per_s'])} GB/s "
                  f"({row['store_ratio']:.3f} of raw D2H)", flush=True)
        for mib in disk_sizes:
            row = disk_tier(ex, dev, mib * MiB, max(2, reps - 1), workdir)
            res["disk_tier"].append(row)
            print(f"disk tier {mib:5d} MiB: restore {gbs(row['restore_bytes_per_s'])} GB/s, raw read "
                  f"{gbs(row['raw_read_bytes_per_s'])} GB/s ({row['ratio']:.3f})", flush=True)
        fg, bg, rounds, per = (1024, 512, 1, 3) if args.smoke else (65536, 16384, 4, 8)
        res["interference"] = bench_isolation.interference(fg, bg, rounds, per, 1, workdir, executor=ex,
                                                           device=dev.type)
        print(f"interference: {res['interference']['slowdown']:+.4f}", flush=True)
        oh_sizes, oh_every, oh_reps = ([1024, 2048], 256, 2) if args.smoke else ([8192, 32768, 65536], 2048, 10)
        res["overhead"] = []
        for backing in ("memory", "disk", "composite"):
            res["overhead"] += bench_isolation.request_overhead(backing, oh_sizes, oh_reps, 1, workdir, executor=ex,
                                                                device=dev.type, every=oh_every)
        print("request-path overhead: " + ", ".join(f"{r['backing']} {r['tokens']} tok {r['ratio_median']:.4f}"
                                                    for r in res["overhead"]), flush=True)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    big = [r for r in res["ram_tier"] if r["bytes"] >= 256 * MiB] or res["ram_tier"]
    res["summary"] = {
        "restore_ratio_min": min(r["restore_ratio"] for r in big),
        "store_ratio_min": min(r["store_ratio"] for r in big),
        "disk_ratio_min": min(r["ratio"] for r in res["disk_tier"]),
        "restore_target_met": all(r["restore_ratio"] >= 0.9 for r in big),
        "store_target_met": all(r["store_ratio"] >= 0.9 for r in big),
        "all_bit_identical": all(r["bit_identical"] for r in res["ram_tier"] + res["disk_tier"]),
        "interference_slowdown": res["interference"]["slowdown"],
        "overhead_ratio_max": max(r["ratio_median"] for r in res["overhead"]),
    }
    res["wall_s"] = time.perf_counter() - t_start
    md = report(res)
    print()
    print(md)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(res, f, indent=2)
    with open(os.path.splitext(args.out)[0] + ".md", "w") as f:
        f.write(md)
    return 0 if res["summary"]["all_bit_identical"] else 1


if __name__ == "__main__":
    sys.exit(main())
