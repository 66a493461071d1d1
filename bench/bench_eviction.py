"""Eviction cost per victim as the catalog grows from 1k to 1M nodes.

Two measurements, each reported as the median per-victim time and its ratio to the
1k-node case, all in one run on one machine:

Sizes are measured round-robin (a batch of victims from each in turn, 20 rounds) so a
change in the machine's load hits them all alike.

- **selection** (1k, 10k, 100k, 1M nodes): the engine's own ``space.free`` loop:
  victim selection from the policy heap (``pop_valid``, lazily invalidated), the pin /
  fence / room checks, the counters, and the in-memory bookkeeping of each victim
  (index removal and re-offering its parent for a leaf; dropping the snapshot and
  re-offering the node for a retirement). The index is built in memory without files
  (an engine on an empty directory is given a synthetic index of conversations, 8
  checkpoints deep, with snapshots), and the victims' transactions are replaced by
  their in-memory effects, so the 1M case builds in seconds. This is the part that
  would grow with the catalog if selection scanned it; a full-scan selection is timed
  beside it as the baseline.
- **transaction** (1k, 10k, 100k nodes): ``Engine.evict`` end to end on a real catalog
  (SQLite WAL, ``synchronous=FULL``): the evict transaction's commits, the unlink
  batch (the shard files are absent, which the engine treats as already removed) and
  the bookkeeping. Rows are inserted directly; recovery then finds every file missing
  and marks the nodes damaged, which the prefixstore policy evicts first, by recency.
  Dominated by the commits' fsyncs, so the ratio is noisy but must not trend.

Writes ``bench/results/eviction.json`` and ``bench/results/eviction.md``. Not part of
pytest (``python bench/bench_eviction.py [--quick]``).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import sqlite3
import statistics
import sys
import tempfile
import time

import torch

from prefixstore.base.keys import DIGEST_SIZE, ROOT, chain
from prefixstore.base.layout import Layout, TensorSpec
from prefixstore.engine import evict, replace, space
from prefixstore.engine.api import Engine
from prefixstore.engine.index import Node
from prefixstore.gpu.ranks import shard_name
from prefixstore.statemachine import policy as pol

HERE = os.path.dirname(os.path.abspath(__file__))
DEPTH = 8  # checkpoints per conversation
SEG = 4 * 24  # bytes of a one-block segment (layout below)


def layout() -> Layout:
    return Layout(
        segments=[TensorSpec("k", "bfloat16", (2, 3)), TensorSpec("v", "bfloat16", (2, 3))],
        snapshots=[TensorSpec("state", "float32", (32, 32))],
        block_tokens=4,
    )


def synthetic_nodes(n: int, seed: int) -> list[Node]:
    """``n`` nodes: conversations of DEPTH one-block checkpoints, random recency."""
    rng = random.Random(seed)
    snap = layout().snapshot_bytes
    nodes: list[Node] = []
    for c in range(n // DEPTH):
        parent, key, t0 = None, ROOT, rng.randrange(1 << 30)
        for d in range(DEPTH):
            digest = (c * DEPTH + d).to_bytes(DIGEST_SIZE, "little")
            key = chain(key, digest)
            nid = len(nodes) + 1
            used = t0 + d
            nodes.append(Node(id=nid, key=key, parent=parent, start=d, end=d + 1, digests=digest,
                              has_snapshot=True, state="ready", generation=1, last_used=used,
                              snap_used=used, nbytes=SEG + snap + 200))
            parent = nid
    return nodes


class SelectionRun:
    """An engine on an empty directory with a synthetic index of ``n`` nodes whose
    victims' transactions are replaced by their in-memory effects."""

    def __init__(self, n: int, seed: int) -> None:
        L = layout()
        self.n, self.snap = n, L.snapshot_bytes
        self.root = tempfile.TemporaryDirectory()
        eng = self.eng = Engine.open(self.root.name, L, 1 << 62)
        t0 = time.perf_counter()
        eng.index.clear()
        for node in synthetic_nodes(n, seed):
            eng.index.add(node)
        eng.recency.heap.rebuild(eng.index)
        eng.account.charged = sum(x.nbytes for x in eng.index)
        self.build_s = time.perf_counter() - t0
        self._saved = evict.evict_nodes, replace.retire_snapshot  # restored by close()
        ev, rp = eng.flows.evicting, eng.flows.replacing
        evict.evict_nodes = lambda e, nodes, *a: self._evict_nodes(nodes, *a) if e is ev else self._saved[0](e, nodes, *a)
        replace.retire_snapshot = lambda e, node: self._retire(node) if e is rp else self._saved[1](e, node)
        eng.account.garbage_hint = False
        self.samples: list[float] = []
        self.scan_baseline_us = self.scan_us(3 if n >= 1_000_000 else 10)

    def _evict_nodes(self, nodes: list[Node], offered=frozenset()) -> None:  # the in-memory part of evict_nodes
        eng = self.eng
        for x in nodes:
            eng.index.remove(x.id)
            eng.account.charged -= x.nbytes
        for pid in dict.fromkeys(x.parent for x in nodes if x.parent is not None and x.parent not in offered):
            parent = eng.index.get(pid)
            if parent is not None and parent.is_leaf:
                eng.recency.heap.offer(parent)

    def _retire(self, node: Node) -> bool:  # the in-memory part of a snapshot retirement
        node.has_snapshot = False
        node.nbytes -= self.snap
        node.generation += 1
        self.eng.account.charged -= self.snap
        self.eng.recency.heap.offer(node)
        return True

    def victims(self) -> int:
        c = self.eng.counters.snapshot()
        return int(c.get(f"evictions.{pol.EVICT}", 0) + c.get(f"evictions.{pol.RETIRE}", 0))

    def step(self, batch: int) -> None:
        """Take about ``batch`` victims (just under ``batch`` snapshots' worth of bytes)."""
        before = self.victims()
        with self.eng.guard.lock:
            t = time.perf_counter()
            space.free(self.eng.flows.room, batch * self.snap - 1)
            dt = time.perf_counter() - t
        self.samples.append(dt / max(1, self.victims() - before))

    def scan_us(self, picks: int) -> float:
        """Baseline: one victim chosen by scanning every node (what the heap avoids)."""
        eng, times = self.eng, []
        for _ in range(picks):
            t = time.perf_counter()
            best = None
            for node in eng.index:
                a = pol.action_for("prefixstore", node, True)
                if a is not None and (best is None or a[1] < best[0]):
                    best = (a[1], node.id)
            times.append(time.perf_counter() - t)
        return statistics.median(times) * 1e6

    def close(self) -> dict:
        c = self.eng.counters.snapshot()
        out = {"nodes": self.n, "victims": self.victims(), "build_s": round(self.build_s, 2),
               "retirements": int(c.get(f"evictions.{pol.RETIRE}", 0)),
               "per_victim_us": round(statistics.median(self.samples) * 1e6, 2),
               "scan_baseline_us": round(self.scan_baseline_us, 1)}
        self.eng.close()
        evict.evict_nodes, replace.retire_snapshot = self._saved
        self.root.cleanup()
        return out


class TransactionRun:
    """``Engine.evict`` on a real catalog of ``n`` nodes (rows inserted directly)."""

    def __init__(self, n: int, seed: int) -> None:
        L = layout()
        self.n = n
        self.root = tempfile.TemporaryDirectory()
        root = self.root.name
        Engine.open(root, L, 1 << 62).close()
        nodes = synthetic_nodes(n, seed)
        conn = sqlite3.connect(os.path.join(root, "catalog.sqlite"))
        with conn:
            conn.executemany(
                "INSERT INTO nodes(id, key, parent, start_block, end_block, digests, has_snapshot, "
                "state, generation, last_used, snap_used) VALUES(?, ?, ?, ?, ?, ?, 1, 'ready', 1, ?, ?)",
                [(x.id, x.key, x.parent, x.start, x.end, x.digests, x.last_used, x.snap_used) for x in nodes],
            )
            conn.executemany(
                "INSERT INTO files(rank, name, node, generation, size, checksum, status, txn) "
                "VALUES(0, ?, ?, 1, ?, 'x', 'live', NULL)",
                [(shard_name(x.key, 1), x.id, x.nbytes) for x in nodes],
            )
        conn.close()
        t0 = time.perf_counter()
        self.eng = Engine.open(root, L, 1 << 62)
        self.open_s = time.perf_counter() - t0
        self.size = nodes[0].nbytes
        self.samples: list[float] = []
        self.eng.evict(1)  # the first eviction after open also looks for loose garbage

    def step(self, batch: int) -> None:
        self.batch = batch
        t = time.perf_counter()
        self.eng.evict(batch * self.size - 1)
        self.samples.append((time.perf_counter() - t) / batch)

    def close(self) -> dict:
        out = {"nodes": self.n, "victims": self.batch * len(self.samples),
               "open_s": round(self.open_s, 2),
               "per_victim_us": round(statistics.median(self.samples) * 1e6, 1)}
        self.eng.close()
        self.root.cleanup()
        return out


def interleaved(runs: list, rounds: int, batch: int) -> list[dict]:
    """Round-robin steps over every size, so load changes hit them all alike."""
    for _ in range(rounds):
        for r in runs:
            r.step(batch)
    return [r.close() for r in runs]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="smaller sizes (a smoke run)")
    ap.add_argument("--out", default=os.path.join(HERE, "results"))
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    sel_sizes = [1_000, 10_000, 100_000] if args.quick else [1_000, 10_000, 100_000, 1_000_000]
    txn_sizes = [1_000, 10_000] if args.quick else [1_000, 10_000, 100_000]
    warm = SelectionRun(1_000, seed=0)  # imports, allocator: discarded
    interleaved([warm], 4, 50)
    print("building the selection indexes ...", flush=True)
    selection = interleaved([SelectionRun(n, seed=n) for n in sel_sizes], rounds=20, batch=50)
    for r in selection:
        print(f"selection  {r['nodes']:>9,} nodes: {r['per_victim_us']:8.2f} us/victim", flush=True)
    print("building the catalogs ...", flush=True)
    transaction = interleaved([TransactionRun(n, seed=n) for n in txn_sizes], rounds=20, batch=10)
    for r in transaction:
        print(f"transaction {r['nodes']:>8,} nodes: {r['per_victim_us']:8.1f} us/victim", flush=True)
    for rows in (selection, transaction):
        base = rows[0]["per_victim_us"]
        for r in rows:
            r["ratio_vs_1k"] = round(r["per_victim_us"] / base, 2)
    out = {
        "bench": "eviction",
        "machine": f"{platform.machine()}, {os.cpu_count()} cpus, Python {sys.version.split()[0]}",
        "selection": selection,
        "transaction": transaction,
        "notes": "per-victim medians; ratios against the 1k-node case of the same run",
    }
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "eviction.json"), "w") as f:
        json.dump(out, f, indent=2)
    lines = [
        "# Eviction cost per victim vs catalog size",
        "",
        f"`python bench/bench_eviction.py`{' --quick' if args.quick else ''} on {out['machine']}. "
        "Medians per victim; ratio against 1k nodes in the same run.",
        "",
        "| nodes | selection + bookkeeping (us/victim) | ratio | full-scan selection, baseline (us) "
        "| evict transaction (us/victim) | ratio |",
        "| ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    txn = {r["nodes"]: r for r in transaction}
    for r in selection:
        t = txn.get(r["nodes"])
        tcol = f"{t['per_victim_us']:.0f} | {t['ratio_vs_1k']:.2f}" if t else "(not run) | "
        lines.append(f"| {r['nodes']:,} | {r['per_victim_us']:.1f} | {r['ratio_vs_1k']:.2f} | "
                     f"{r['scan_baseline_us']:,.0f} | {tcol} |")
    lines += [
        "",
        "Selection: `space.free` with each victim's transaction replaced by its in-memory",
        "effects (index built without files); it grows with the heap's depth (log n), not",
        "with n, which the full-scan baseline (one victim chosen by scanning every node) does.",
        "Transaction: `Engine.evict` on a real SQLite catalog (commits with fsync; shard files",
        "absent), dominated by the commits. See the module docstring.",
    ]
    with open(os.path.join(args.out, "eviction.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
