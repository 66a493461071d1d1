"""KV restores through the SGLang adapter into SGLang's real ``MHATokenToKVPoolHost``, A/B.

Each run is a process of its own over one source tree (``--tree``: the prefixstore it
imports, and its ``tests/`` helpers): it builds a real MHA host pool on the CPU
(``tests/sglang_mha.host_pool``'s arguments: SGLang's own classes, ``pin_memory=False``,
the torchvision stand-in), stores ``--pages`` pages with ``batch_set_v1`` through the
backend SGLang's ``StorageBackendFactory`` makes, then times ``--restores`` calls of
``batch_get_v1`` into other slots (page cache warm; the bytes checked after the first
and the last, untimed). ``--ab OLD_TREE`` runs OLD_TREE and this tree in turn,
``--rounds`` times, and prints the medians of each run's median restore and the load
average::

    git archive main | tar -x -C /tmp/mha-old
    python bench/sglang_in_place.py --ab /tmp/mha-old --layout layer_first

Nothing is written under ``bench/results``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


def child(tree: str, layout: str, layers: int, heads: int, dim: int, page: int, pages: int,
          restores: int, scattered: bool) -> dict:
    sys.path[:0] = [tree, os.path.join(tree, "tests")]
    import sglang_real

    sglang_real.stand_in_for_torchvision()
    import sglang_driver as drv
    import torch
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorageExtraInfo
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool
    from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost

    torch.set_num_threads(1)
    kv = MHATokenToKVPool(size=2 * pages * page, page_size=page, dtype=torch.bfloat16, head_num=heads,
                          head_dim=dim, layer_num=layers, device="cpu", enable_memory_saver=False)
    info = kv.get_device_pool_infos()[0].buffer_info
    host = MHATokenToKVPoolHost(info, 2.0, 0, page, layout, pin_memory=False, device_capacity_tokens=kv.size,
                                start_layer=kv.start_layer, end_layer=kv.end_layer,
                                write_back_staging=kv.hicache_write_back_staging)
    host.kv_buffer.view(torch.uint8).copy_(torch.randint(0, 256, host.kv_buffer.view(torch.uint8).shape,
                                                         dtype=torch.uint8))
    keys = drv.page_keys(1, pages)
    src = [i * page for i in range(pages)]
    dst = [(pages + i) * page for i in range(pages)]
    if scattered:
        dst = dst[::-1]
    idx = lambda slots: torch.tensor([s + t for s in slots for t in range(page)], dtype=torch.int64)  # noqa: E731
    with tempfile.TemporaryDirectory(dir=os.environ.get("BENCH_DIR")) as root:
        backend = drv.StorageBackendFactory.create_backend(
            "dynamic", drv.config(root, capacity_bytes=1 << 40), host, engine_options={})
        backend.register_mem_pool_host(host)
        backend.on_host_pools_registered()
        info_ = HiCacheStorageExtraInfo(prefix_keys=[])
        try:
            assert all(backend.batch_set_v1(keys, idx(src), info_))
            want = [host.get_data_page(s, flat=True).view(torch.uint8).clone() for s in src]
            times = []
            for k in range(restores + 1):  # the first untimed: first-call costs out
                t = time.perf_counter()
                ok = backend.batch_get_v1(keys, idx(dst), info_)
                dt = time.perf_counter() - t
                assert all(ok), ok
                if k in (0, restores):
                    assert all(torch.equal(host.get_data_page(d, flat=True).view(torch.uint8), w) for d, w in zip(dst, want, strict=True))
                if k:
                    times.append(dt)
            slots = backend.pool(drv.PoolName.KV).slots if hasattr(backend, "pool") else None
            staged = bool(slots is not None and getattr(slots, "_staging", None) is not None)
        finally:
            backend.close()
    nbytes = pages * host.get_dummy_flat_data_page().numel() * 2
    return {"median_s": statistics.median(times), "gb_s": nbytes / 1e9 / statistics.median(times),
            "bytes": nbytes, "staged": staged}


def run(tree: str, args: argparse.Namespace) -> dict:
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", tree, "--layout", args.layout,
           "--layers", str(args.layers), "--heads", str(args.heads), "--dim", str(args.dim), "--page", str(args.page),
           "--pages", str(args.pages), "--restores", str(args.restores)] + (["--scattered"] if args.scattered else [])
    env = {**os.environ, "PYTHONPATH": tree}
    env.pop("PROMETHEUS_MULTIPROC_DIR", None)
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)
    if out.returncode:
        raise SystemExit(out.stderr[-3000:])
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--child", metavar="TREE")
    ap.add_argument("--ab", metavar="OLD_TREE")
    ap.add_argument("--layout", default="layer_first")
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--page", type=int, default=64)
    ap.add_argument("--pages", type=int, default=16)
    ap.add_argument("--restores", type=int, default=10)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--scattered", action="store_true", help="destination slots in reverse order")
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(args.child, args.layout, args.layers, args.heads, args.dim, args.page, args.pages,
                               args.restores, args.scattered)))
        return
    trees = {"old": args.ab, "new": str(HERE.parent)} if args.ab else {"new": str(HERE.parent)}
    got: dict[str, list[dict]] = {k: [] for k in trees}
    loads = []
    for r in range(args.rounds):
        for name in (list(trees) if r % 2 == 0 else list(trees)[::-1]):
            loads.append(os.getloadavg()[0])
            got[name].append(run(trees[name], args))
            print(f"round {r} {name}: {got[name][-1]}", file=sys.stderr, flush=True)
    for name, rows in got.items():
        med = statistics.median(x["median_s"] for x in rows)
        print(f"{name}: median restore {med * 1e3:.1f} ms ({rows[0]['bytes'] / 1e9 / med:.2f} GB/s), "
              f"runs {[round(x['median_s'] * 1e3, 1) for x in rows]} ms, staged {rows[0]['staged']}")
    print(f"load average (1 min) at each run: median {statistics.median(loads):.2f}, "
          f"range {min(loads):.2f}-{max(loads):.2f}")


if __name__ == "__main__":
    main()
