"""Store, look up and restore a few multi-block checkpoints on the CPU.

Creates (or reuses) a cache in DIR with a small two-rank hybrid layout (KV segments
plus a recurrent snapshot), stores checkpoints of two conversations, looks up a
prefix that diverges mid-way, restores it, verifies the bytes, reopens the cache
and audits it. Prints what it did at each step.

Without DIR the cache goes to a new temporary directory, named on the first line and
removed at the end unless --keep is given. A DIR you name is always kept.
"""

from __future__ import annotations

import argparse
import sys

import torch

from prefixstore.base.keys import Prefix
from prefixstore.base.layout import Layout, TensorSpec
from prefixstore.engine.api import Engine
from prefixstore.engine.workdir import work_dir

NAME = "demo"
HELP = "store, look up and restore a few checkpoints on the CPU"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("dir", nargs="?", default=None, help="cache directory (default: a new temp dir)")
    p.add_argument("--ranks", type=int, default=2, help="tensor-parallel ranks (default 2)")
    p.add_argument("--block-tokens", type=int, default=16, help="tokens per block (default 16)")
    p.add_argument("--keep", action="store_true",
                   help="keep the temporary cache directory (without DIR) instead of removing it")


def demo_layout(ranks: int, block_tokens: int) -> Layout:
    return Layout(
        segments=[TensorSpec("k", "bfloat16", (2, 8)), TensorSpec("v", "bfloat16", (2, 8))],
        snapshots=[TensorSpec("state", "float32", (4, 8))],
        block_tokens=block_tokens,
        ranks=ranks,
    )


def run(args: argparse.Namespace) -> int:
    layout = demo_layout(args.ranks, args.block_tokens)
    with work_dir("demo", args.dir, args.keep, stream=sys.stdout) as root:
        return _demo(root, layout)


def _demo(root: str, layout: Layout) -> int:
    bt = layout.block_tokens
    g = torch.Generator().manual_seed(0)
    convs = {
        "alice": torch.randint(0, 32000, (8 * bt,), generator=g).tolist(),
        "bob": torch.randint(0, 32000, (8 * bt,), generator=g).tolist(),
    }
    # bob shares alice's first 3 blocks (a common system prompt), then diverges
    convs["bob"][: 3 * bt] = convs["alice"][: 3 * bt]

    def kv(tokens: list[int]) -> list[dict[str, torch.Tensor]]:
        t = torch.tensor(tokens, dtype=torch.float32)
        return [
            {n: (t[:, None, None] * (r + 1) + i).expand(-1, 2, 8).to(torch.bfloat16)
             for i, n in enumerate(("k", "v"))}
            for r in range(layout.ranks)
        ]

    def state(tokens: list[int]) -> list[dict[str, torch.Tensor]]:
        return [{"state": torch.full((4, 8), float(sum(tokens) % 9973 + r))} for r in range(layout.ranks)]

    print(f"cache: {root}  ({layout.ranks} ranks, {bt} tokens per block)")
    with Engine.open(root, layout, capacity_bytes=64 << 20) as eng:
        for name, toks in convs.items():
            for blocks in (3, 5, 8):
                res = eng.store(Prefix.from_tokens(toks[: blocks * bt], bt), kv(toks[: blocks * bt]),
                                state(toks[: blocks * bt]))
                print(f"store  {name:5} {blocks} blocks: {res.status:9} {res.nbytes:7} bytes")
        probe = convs["alice"][: 5 * bt] + convs["bob"][5 * bt : 7 * bt]
        m = eng.lookup(Prefix.from_tokens(probe, bt))
        print(f"lookup alice[:5]+bob[5:7]: {m.outcome}, deepest match {m.blocks} blocks ({m.tokens} tokens)")
        r = eng.restore(m)
        assert r is not None
        want = kv(probe[: m.tokens])
        same = all(torch.equal(r.segments[k][n], want[k][n]) for k in range(layout.ranks) for n in ("k", "v"))
        print(f"restore: {r.end_tokens - r.start_tokens} tokens from {r.files_read} shard files, "
              f"bit-identical: {same}")
        m2 = eng.lookup(Prefix.from_tokens(convs["bob"], bt), gpu_blocks=3)
        r2 = eng.restore(m2)
        print(f"lookup bob with 3 blocks on the GPU: {m2.outcome}, restored tokens "
              f"[{r2.start_tokens}, {r2.end_tokens})")
        st = eng.stats()
        print(f"stats: {st['nodes']} nodes, {st['charged_bytes']} of {st['capacity_bytes']} bytes charged")
    with Engine.open(root, layout, capacity_bytes=64 << 20) as eng:
        m = eng.lookup(Prefix.from_tokens(convs["alice"], bt))
        print(f"after reopen: alice lookup {m.outcome} at {m.blocks} blocks")
        rep = eng.audit()
        print(f"audit: {'clean' if rep.ok else rep.to_dict()['violations']}")
        return 0 if (same and rep.ok) else 1
