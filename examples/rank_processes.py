"""Tensor-parallel ranks as separate processes: a coordinator and N rank servers.

The coordinator owns the catalog and the journal; each rank process owns one rank's
directory and applies that rank's file effects, over torch.distributed (gloo).

One host, everything from one command (the rank processes are started here):

    python examples/rank_processes.py /tmp/pfx --ranks 4 --spawn

Several hosts: start the coordinator, then one rank server per rank on its host:

    python examples/rank_processes.py /data/pfx --ranks 4 --init-method tcp://0.0.0.0:29500
    prefixstore rank-server --rank R --dir /data/pfx-rankR --init-method tcp://COORD_HOST:29500

The coordinator stores and restores a few multi-block checkpoints across all ranks,
audits, and shuts the rank processes down.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

import torch

from prefixstore import Layout, Prefix, TensorSpec
from prefixstore.engine.api import Engine
from prefixstore.gpu.distributed import RankGroup


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("dir", help="the coordinator's cache directory (catalog and journal)")
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--init-method", default="tcp://127.0.0.1:0",
                    help="where rank processes reach the coordinator (port 0: pick a free one)")
    ap.add_argument("--spawn", action="store_true", help="start the rank processes on this host")
    ap.add_argument("--gloo-host", default=None, help="address the gloo devices listen on")
    args = ap.parse_args()

    layout = Layout(segments=[TensorSpec("k", "bfloat16", (2, 16)), TensorSpec("v", "bfloat16", (2, 16))],
                    block_tokens=16, ranks=args.ranks)
    host = args.init_method.removeprefix("tcp://").rsplit(":", 1)
    gloo = args.gloo_host or ("127.0.0.1" if args.spawn else None)
    group = RankGroup(host[0], int(host[1]), gloo_host=gloo, op_timeout=30, connect_timeout=120)
    print(f"coordinator: rank processes connect to {group.init_method}", flush=True)
    procs = []
    if args.spawn:
        for r in range(args.ranks):
            cmd = [sys.executable, "-m", "prefixstore.gpu.distributed", "--rank", str(r),
                   "--dir", os.path.join(args.dir + "-ranks", f"rank{r}"), "--init-method", group.init_method]
            if gloo:
                cmd += ["--gloo-host", gloo]
            procs.append(subprocess.Popen(cmd))
    try:
        ranks = group.connect(range(args.ranks), timeout=120)
        for rr in ranks:
            print(f"  rank {rr.rank}: pid {rr.pid} on {rr.node}, directory {rr.directory}", flush=True)
        with Engine.open(args.dir, layout, 1 << 30, ranks=ranks) as eng:
            g = torch.Generator().manual_seed(0)
            ids = torch.randint(0, 50_000, (256,), generator=g).tolist()
            kv = [{s.name: torch.randn(256, *s.shape, generator=g).to(torch.bfloat16) for s in layout.segments}
                  for _ in range(args.ranks)]
            t0 = time.perf_counter()
            for blocks in (4, 8, 16):
                n = blocks * 16
                res = eng.store(Prefix.from_tokens(ids[:n], 16), [{k: v[:n] for k, v in d.items()} for d in kv])
                print(f"  store {blocks:2d} blocks: {res.status}", flush=True)
            m = eng.lookup(Prefix.from_tokens(ids, 16))
            got = eng.restore(m)
            same = got is not None and all(
                torch.equal(got.segments[r][k], kv[r][k][: m.tokens]) for r in range(args.ranks) for k in kv[r]
            )
            print(f"  restore {m.blocks} blocks from {got.files_read if got else 0} shard files: "
                  f"{'bit-identical' if same else 'MISMATCH'} ({time.perf_counter() - t0:.2f} s)")
            rep = eng.audit()
            print(f"  audit: {'clean' if rep.ok else rep.violations}")
            return 0 if same and rep.ok else 1
    finally:
        group.close()
        for p in procs:
            p.wait(30)


if __name__ == "__main__":
    sys.exit(main())
