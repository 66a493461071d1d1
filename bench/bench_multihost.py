"""Multi-host benchmark: a 4-rank cache's store and restore throughput over veth links,
against a raw transfer of the same bytes over the same links. Reported as ratios.

Four "hosts" and a coordinator are Linux network namespaces on one private bridge
(``tests/netns_hosts.py``; needs root). Each host runs one rank server (with a token)
on its own directory. The coordinator stores ``--stores`` checkpoints of ``--tokens``
tokens (each rank's shard: tokens x 4 KiB) and restores each one; its throughput is
the bytes of every rank's shards over the wall time. The raw transfer sends the same
bytes per host from the coordinator over plain TCP sockets, the four hosts in
parallel (as the engine writes its ranks), each host's receiver acknowledging the
last byte, then reads them back the same way. The raw path does not write a disk; the
engine's store also makes each shard durable (write, fsync, rename, directory fsync)
and checksums it, so the store ratio includes that; a third run with the four ranks
local (no network) separates what the network path costs from what the engine does.

Writes ``multihost.json`` and ``.md`` into ``--out-dir`` (default ``bench/results``).
``--smoke`` runs a tiny size (a check that it runs).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "tests"))

from netns_hosts import NetnsHosts  # noqa: E402

from prefixstore import Layout, Prefix, TensorSpec  # noqa: E402
from prefixstore.engine.api import Engine  # noqa: E402
from prefixstore.gpu.distributed import RankGroup  # noqa: E402

HEADS, DIM, BLOCK, RANKS = 8, 128, 256, 4
TOKEN = b"bench-token-shared-by-all-ranks"
RAW_PEER = r"""
import socket, sys
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind((sys.argv[1], int(sys.argv[2]))); s.listen()
while True:
    c, _ = s.accept()
    head = c.recv(9, socket.MSG_WAITALL)
    op, n = head[:1], int.from_bytes(head[1:], "little")
    if op == b"W":
        left = n
        while left:
            got = c.recv(min(left, 1 << 20))
            if not got:
                break
            left -= len(got)
        c.sendall(b"k")
    else:
        c.sendall(bytes(n))
    c.close()
"""


def layout() -> Layout:
    return Layout(segments=[TensorSpec("k", "bfloat16", (HEADS, DIM)), TensorSpec("v", "bfloat16", (HEADS, DIM))],
                  block_tokens=BLOCK, ranks=RANKS)


def segments(tokens: int, seed: int) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [{n: torch.randn((tokens, HEADS, DIM), generator=g).to(torch.bfloat16) for n in ("k", "v")}
            for _ in range(RANKS)]


def timed(eng: Engine, tokens: int, data: list) -> tuple[float, float]:
    """Store every checkpoint of ``data``, then restore each (checked); the two wall times."""
    prefixes = [Prefix.from_ids([s * 1_000_003 + i for i in range(tokens // BLOCK)]) for s in range(len(data))]
    t0 = time.perf_counter()
    for p, d in zip(prefixes, data, strict=True):
        assert eng.store(p, d).ok
    store_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    for p, d in zip(prefixes, data, strict=True):
        got = eng.restore(eng.lookup(p))
        assert got is not None and torch.equal(got.segments[1]["k"], d[1]["k"])
    return store_s, time.perf_counter() - t0


def local_run(base: str, tokens: int, stores: int) -> dict:
    """The same stores and restores with every rank a local directory (no network)."""
    data = [segments(tokens, s) for s in range(stores)]
    shard_bytes = sum(t.numel() * t.element_size() for d in data for s in d for t in s.values())
    with Engine.open(os.path.join(base, "local"), layout(), 8 * shard_bytes) as eng:
        store_s, restore_s = timed(eng, tokens, data)
    return {"bytes": shard_bytes, "store_s": store_s, "restore_s": restore_s}


def engine_run(hosts: NetnsHosts, tokens: int, stores: int) -> dict:
    token_file = os.path.join(hosts.base, "token")
    with open(token_file, "wb") as f:
        f.write(TOKEN)
    data = [segments(tokens, s) for s in range(stores)]
    shard_bytes = sum(t.numel() * t.element_size() for d in data for s in d for t in s.values())
    with hosts.coordinator():
        group = RankGroup(hosts.coord_ip, 0, gloo_host=hosts.coord_ip, token=TOKEN, op_timeout=60,
                          connect_timeout=60)
        try:
            for r in range(RANKS):
                hosts.start_rank(r, group.init_method, token_file=token_file)
            remotes = group.connect(range(RANKS), timeout=120)
            with Engine.open(os.path.join(hosts.base, "cache"), layout(), 8 * shard_bytes, ranks=remotes) as eng:
                store_s, restore_s = timed(eng, tokens, data)
        finally:
            group.close()
    return {"bytes": shard_bytes, "store_s": store_s, "restore_s": restore_s}


def raw_run(hosts: NetnsHosts, per_host: int, stores: int) -> dict:
    port = 23456
    for r in range(RANKS):
        hosts.spawn(hosts.host_ns[r], [sys.executable, "-c", RAW_PEER, hosts.host_ip[r], str(port)], f"raw{r}.log")
    chunk = bytes(per_host // stores)

    def one(r: int, op: bytes, out: list) -> None:
        with socket.create_connection((hosts.host_ip[r], port), timeout=60) as c:
            c.sendall(op + len(chunk).to_bytes(8, "little"))
            if op == b"W":
                c.sendall(chunk)
                assert c.recv(1) == b"k"
            else:
                left = len(chunk)
                while left:
                    left -= len(c.recv(min(left, 1 << 20)))
        out.append(r)

    def phase(op: bytes) -> float:
        t0 = time.perf_counter()
        for _ in range(stores):
            done: list = []
            threads = [threading.Thread(target=one, args=(r, op, done)) for r in range(RANKS)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            assert len(done) == RANKS
        return time.perf_counter() - t0

    with hosts.coordinator():
        deadline = time.monotonic() + 30
        while True:
            try:
                socket.create_connection((hosts.host_ip[RANKS - 1], port), timeout=1).close()
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.1)
        return {"bytes": per_host * RANKS, "write_s": phase(b"W"), "read_s": phase(b"R")}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=4096, help="tokens per checkpoint (default 4096: 16 MiB a rank)")
    ap.add_argument("--stores", type=int, default=4)
    ap.add_argument("--out-dir", default=os.path.join(HERE, "results"))
    ap.add_argument("--smoke", action="store_true")
    args = ap.parse_args()
    if args.smoke:
        args.tokens, args.stores = 512, 2
    base = tempfile.mkdtemp(prefix="bench-multihost-")
    hosts = NetnsHosts(RANKS, base)
    try:
        eng = engine_run(hosts, args.tokens, args.stores)
        raw = raw_run(hosts, eng["bytes"] // RANKS, args.stores)
        local = local_run(base, args.tokens, args.stores)
    finally:
        hosts.close()
        subprocess.run(["rm", "-rf", base], check=False)
    mb = 1e6
    res = {
        "tokens": args.tokens, "stores": args.stores, "ranks": RANKS, "bytes": eng["bytes"],
        "engine_store_MBps": eng["bytes"] / eng["store_s"] / mb,
        "engine_restore_MBps": eng["bytes"] / eng["restore_s"] / mb,
        "raw_write_MBps": raw["bytes"] / raw["write_s"] / mb,
        "raw_read_MBps": raw["bytes"] / raw["read_s"] / mb,
    }
    res["local_store_MBps"] = local["bytes"] / local["store_s"] / mb
    res["local_restore_MBps"] = local["bytes"] / local["restore_s"] / mb
    res["store_ratio"] = res["engine_store_MBps"] / res["raw_write_MBps"]
    res["restore_ratio"] = res["engine_restore_MBps"] / res["raw_read_MBps"]
    res["store_vs_local"] = res["engine_store_MBps"] / res["local_store_MBps"]
    res["restore_vs_local"] = res["engine_restore_MBps"] / res["local_restore_MBps"]
    print(json.dumps(res, indent=1))
    if not args.smoke:
        os.makedirs(args.out_dir, exist_ok=True)
        with open(os.path.join(args.out_dir, "multihost.json"), "w") as f:
            json.dump(res, f, indent=1)
        with open(os.path.join(args.out_dir, "multihost.md"), "w") as f:
            f.write("# Multi-host: 4 ranks over veth links (one run)\n\n"
                    f"{args.stores} checkpoints of {args.tokens} tokens, {res['bytes'] / mb:.0f} MB of shards "
                    "in all.\n\n| | engine MB/s | raw TCP MB/s | ratio |\n|---|---|---|---|\n"
                    f"| store / write | {res['engine_store_MBps']:.0f} | {res['raw_write_MBps']:.0f} | "
                    f"{res['store_ratio']:.2f} |\n"
                    f"| restore / read | {res['engine_restore_MBps']:.0f} | {res['raw_read_MBps']:.0f} | "
                    f"{res['restore_ratio']:.2f} |\n\n"
                    "The same stores and restores with the four ranks local (no network): "
                    f"store {res['local_store_MBps']:.0f} MB/s, restore {res['local_restore_MBps']:.0f} MB/s; "
                    f"over the network {res['store_vs_local']:.2f} and {res['restore_vs_local']:.2f} of that.\n")


if __name__ == "__main__":
    main()
