"""Compaction on a long conversation: rows, files and the deepest restore, before/after.

One conversation of ``--checkpoints`` turns (one block each) is stored as a chain of
that many rows. Eviction is then assumed to have retired the interior snapshots (the
engine's own snapshot retirement is run on each interior row, untimed), which is what
makes the chain mergeable under the default policy. ``Engine.compact`` then runs until
it merges nothing more. The bench reports rows, shard files, the files the restore of
the deepest checkpoint reads (``Restored.files_read``) and that restore's time, before
and after, as counts and ratios (times are only compared with each other, on the same
machine, in the same run). Results go to ``bench/results/compaction.{json,md}``.

    python bench/bench_compaction.py [--checkpoints 2000] [--ranks 1] [--repeat 5]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time

import torch

from prefixstore import Layout, Prefix, TensorSpec
from prefixstore.engine import replace
from prefixstore.engine.api import Engine

HERE = os.path.dirname(os.path.abspath(__file__))


def layout(ranks: int, bt: int) -> Layout:
    return Layout(
        segments=[TensorSpec("k", "bfloat16", (8, 64)), TensorSpec("v", "bfloat16", (8, 64))],
        snapshots=[TensorSpec("ssm", "float32", (16, 64))],
        block_tokens=bt,
        ranks=ranks,
    )


def shard_files(root: str) -> int:
    return sum(len(os.listdir(os.path.join(root, d))) for d in os.listdir(root) if d.startswith("rank"))


def deepest_restore(eng: Engine, prefix: Prefix, repeat: int) -> tuple[int, float, list]:
    """(files read, median seconds, the tensors) of restoring the whole conversation."""
    times, files, got = [], 0, None
    for _ in range(repeat):
        m = eng.lookup(prefix)
        assert m.hit and m.blocks == len(prefix), m
        t0 = time.perf_counter()
        r = eng.restore(m)
        times.append(time.perf_counter() - t0)
        assert r is not None
        files, got = r.files_read, r.segments
    return files, statistics.median(times), got


def run(checkpoints: int, ranks: int, repeat: int, bt: int) -> dict:
    L = layout(ranks, bt)
    g = torch.Generator().manual_seed(5)
    tokens = torch.randint(0, 50_000, (checkpoints * bt,), generator=g).tolist()
    full = Prefix.from_tokens(tokens, bt)
    rows_kv = [{s.name: torch.randn((checkpoints * bt, *s.shape), generator=g).to(s.torch_dtype)
                for s in L.segments} for _ in range(ranks)]
    snap = [{s.name: torch.randn(s.shape, generator=g).to(s.torch_dtype) for s in L.snapshots}
            for _ in range(ranks)]
    cap = 4 * checkpoints * bt * L.token_bytes * ranks + (64 << 20)
    with tempfile.TemporaryDirectory() as d, Engine.open(d, L, cap, synchronous="NORMAL") as eng:
        t0 = time.perf_counter()
        for i in range(1, checkpoints + 1):
            lo = (i - 1) * bt
            segs = [{k: v[lo : i * bt] for k, v in r.items()} for r in rows_kv]
            res = eng.store(full[:i], segs, snap, tokens_from=lo)
            assert res.status == "stored", res
        store_s = time.perf_counter() - t0
        with eng.guard.lock:  # what eviction does to a long conversation's interior snapshots
            for node in list(eng.index):
                if node.children:
                    assert replace.retire_snapshot(eng.flows.replacing, node)
        before = {"rows": len(eng.index), "files": shard_files(d)}
        before["files_read"], before["restore_s"], want = deepest_restore(eng, full, repeat)
        t0 = time.perf_counter()
        passes, merges = 0, 0
        while True:
            rep = eng.compact()
            passes += 1
            merges += rep.merges
            if not rep.merges:
                break
        compact_s = time.perf_counter() - t0
        after = {"rows": len(eng.index), "files": shard_files(d)}
        after["files_read"], after["restore_s"], got = deepest_restore(eng, full, repeat)
        for a, b in zip(want, got, strict=True):
            for k in a:
                assert torch.equal(a[k], b[k]), "compaction changed restored bytes"
        audit = eng.audit()
        assert audit.ok, audit.to_dict()
    return {
        "checkpoints": checkpoints, "ranks": ranks, "block_tokens": bt,
        "before": before, "after": after, "merges": merges, "passes": passes,
        "ratios": {
            "rows": before["rows"] / after["rows"],
            "files": before["files"] / after["files"],
            "files_read": before["files_read"] / after["files_read"],
            "restore_time": before["restore_s"] / after["restore_s"],
            "compaction_over_store_time": compact_s / store_s,
        },
        "bytes_identical": True,
    }


def markdown(res: dict) -> str:
    b, a, r = res["before"], res["after"], res["ratios"]
    return "\n".join([
        f"# Compaction of one long conversation ({res['checkpoints']} checkpoints, "
        f"{res['ranks']} rank(s), {res['block_tokens']} tokens per block)",
        "",
        "| | before | after | before / after |",
        "| --- | ---: | ---: | ---: |",
        f"| catalog rows | {b['rows']} | {a['rows']} | {r['rows']:.1f}x |",
        f"| shard files | {b['files']} | {a['files']} | {r['files']:.1f}x |",
        f"| files read by the deepest restore | {b['files_read']} | {a['files_read']} | {r['files_read']:.1f}x |",
        f"| deepest restore time | 1 | {1 / r['restore_time']:.3f} | {r['restore_time']:.1f}x |",
        "",
        f"{res['merges']} merges in {res['passes']} passes; compaction took "
        f"{r['compaction_over_store_time']:.2f}x the time of storing the conversation. "
        "Restored bytes before and after are identical. Times are relative (same machine, same run).",
        "",
    ])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--checkpoints", type=int, default=2000)
    ap.add_argument("--ranks", type=int, default=1)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--block-tokens", type=int, default=16)
    ap.add_argument("--out", default=os.path.join(HERE, "results"))
    args = ap.parse_args()
    res = run(args.checkpoints, args.ranks, args.repeat, args.block_tokens)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "compaction.json"), "w") as f:
        json.dump(res, f, indent=2)
    md = markdown(res)
    with open(os.path.join(args.out, "compaction.md"), "w") as f:
        f.write(md)
    print(md)


if __name__ == "__main__":
    main()
