"""Where a warm restore's time goes: CPU seconds per checkpoint of each step of a
verified restore against a raw read of the same file, all from the page cache.

Steps, each over the same checkpoints (default 32 x 4 MiB, bf16, disk backing), in
interleaved rounds, CPU time of the whole process (every thread), so a busy machine
moves the figures less than it moves wall time:

- ``raw read``: ``open(...).read()`` of the shard file (the bench's baseline);
- ``read into the outputs``: ``preadv`` of the shard's rows into the restore's output
  tensors (one per checkpoint, as a server's host pool), no hash;
- ``xxh3_128 of the outputs``: the checksum alone, over bytes already in memory;
- ``verified placed read``: ``verify.read_placed`` (read + hash + header), the read a
  restore makes;
- ``lookup + restore(into=)`` and ``lookup + restore()``: the public API;
- ``... helpers forced`` and ``... alone``: ``restore(into=)`` with the engine's piece
  helpers (``gpu/pieces.py``) taken on every read (``when_faster=False``) or never,
  against the gate (the plain step): what the gate chooses between. Their gain, if any,
  shows in wall time (helpers add CPU), so wall time is reported beside CPU time.

A ratio is the raw read's time over the step's. Run: ``python bench/restore_profile.py``.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable

import torch
import xxhash

from prefixstore import Layout, Prefix, TensorSpec
from prefixstore.engine.api import Engine
from prefixstore.engine.restore import file_rows
from prefixstore.gpu import pieces, shards, verify


def profile(root: str, n: int, mib: int, rounds: int) -> tuple[dict[str, float], dict[str, float]]:
    """CPU and wall microseconds per checkpoint of each step (medians over ``rounds``)."""
    bt = 256
    tokens = mib * (1 << 20) // 1024
    layout = Layout(segments=[TensorSpec("kv", "bfloat16", (8, 64))], block_tokens=bt)
    g = torch.Generator().manual_seed(1)
    data = [torch.randn((tokens, 8, 64), generator=g).to(torch.bfloat16) for _ in range(n)]
    prefixes = [Prefix.from_ids([i * 10**6 + j for j in range(tokens // bt)]) for i in range(n)]
    with Engine.open(os.path.join(root, "c"), layout, 1 << 40) as eng:
        for p, d in zip(prefixes, data, strict=True):
            assert eng.store(p, {"kv": d}).ok
        into = [{"kv": torch.zeros_like(d)} for d in data]
        flats = [memoryview(t["kv"].view(torch.uint8).numpy().reshape(-1)) for t in into]
        nodes = [eng.index.nodes[eng.lookup(p).path[-1][0]] for p in prefixes]
        rows = [file_rows(eng.catalog, [x])[x.id][0] for x in nodes]
        rank = eng.tiers.ranks[0]
        paths = [os.path.join(rank.directory, name) for name, _, _ in rows]
        headers = [verify.Header(layout, x.blocks * bt, False,
                                 {**shards.meta(x.key, x.generation, x.start, x.end, False), "rank": "0"})
                   for x in nodes]

        def raw() -> None:
            for p in paths:
                with open(p, "rb") as f:
                    f.read()

        def read_only() -> None:
            for p, (_, size, _), out in zip(paths, rows, flats, strict=True):
                fd = os.open(p, os.O_RDONLY)
                try:
                    pieces.read_full(fd, size - len(out), out)
                finally:
                    os.close(fd)

        def hash_only() -> None:
            for out in flats:
                xxhash.xxh3_128(out).hexdigest()

        def placed() -> None:
            for (name, size, ck), h, out in zip(rows, headers, flats, strict=True):
                assert isinstance(verify.read_placed(rank, name, size, ck, h, {"seg.kv": (0, out)}), verify.Shard)

        def api_into() -> None:
            for p, t in zip(prefixes, into, strict=True):
                assert eng.restore(eng.lookup(p), into=t) is not None

        def api_new() -> None:
            for p in prefixes:
                assert eng.restore(eng.lookup(p)) is not None

        transfers = eng.flows.restoring.fetch.transfers
        gate = transfers.pieces

        def with_helpers(h: pieces.Helpers) -> Callable[[], None]:
            def run() -> None:
                transfers.pieces = h
                try:
                    api_into()
                finally:
                    transfers.pieces = gate
            return run

        steps: dict[str, Callable[[], None]] = {
            "raw read": raw, "read into the outputs": read_only, "xxh3_128 of the outputs": hash_only,
            "verified placed read": placed, "lookup + restore(into=)": api_into, "lookup + restore()": api_new,
            "lookup + restore(into=), helpers forced": with_helpers(pieces.Helpers(gate.pool, gate.count, False)),
            "lookup + restore(into=), alone": with_helpers(pieces.Helpers(gate.pool, 0, False))}
        cpu: dict[str, list[float]] = {k: [] for k in steps}
        wall: dict[str, list[float]] = {k: [] for k in steps}
        for r in range(rounds):
            order = list(steps.items())
            for name, fn in order if r % 2 == 0 else reversed(order):
                c, w = time.process_time(), time.perf_counter()
                fn()
                cpu[name].append(time.process_time() - c)
                wall[name].append(time.perf_counter() - w)
    per = {k: statistics.median(v) * 1e6 / n for k, v in cpu.items()}
    return per, {k: statistics.median(v) * 1e6 / n for k, v in wall.items()}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--checkpoints", type=int, default=32)
    ap.add_argument("--mib", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--dir", default=None, help="scratch directory on the disk to measure")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    root = tempfile.mkdtemp(prefix="prefixstore-restore-profile-", dir=args.dir)
    try:
        us, wall = profile(root, args.checkpoints, args.mib, args.rounds)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(f"{args.checkpoints} x {args.mib} MiB, {os.cpu_count()} CPUs, load {os.getloadavg()[0]:.1f}")
    print("| step | CPU per checkpoint | raw read / step | wall per checkpoint | raw read / step |\n"
          "| --- | ---: | ---: | ---: | ---: |")
    for k, v in us.items():
        w = wall[k]
        print(f"| {k} | {v:,.0f} us | {us['raw read'] / v:.2f} | {w:,.0f} us | {wall['raw read'] / w:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
