"""The Mooncake trace through the SGLang adapter, beside `prefixstore replay` (not a test module).

Each request is what SGLang would send for it: its full 512-token pages (the trace's
``hash_ids`` as page hashes) queried with ``batch_exists``, the hit loaded with
``batch_get_v1`` (and checked byte for byte), the pages past the hit written back with
``batch_set_v1`` in batches of 128. Files are scaled as the engine replay scales them
(16 file bytes a token), at the engine replay's capacity, cost rule, retention and
checkpoint cadence (``checkpoint_pages`` = its ``checkpoint_every``).

    python tests/sglang_replay.py [--limit N] [--capacity 10%] [--partial-page]   # whole trace: minutes
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.dirname(HERE)]  # the driver, and this checkout's prefixstore

import sglang_driver as drv  # noqa: E402

from prefixstore.replay.engine_replay import ReplayConfig, capacity_of, default_root, replay  # noqa: E402
from prefixstore.replay.trace import load_trace  # noqa: E402

TRACE = os.path.join(HERE, "..", "..", "shared", "traces", "mooncake_conversation_trace.jsonl")


def trace_path() -> str:
    for p in (TRACE, "/work/shared/traces/mooncake_conversation_trace.jsonl"):
        if os.path.exists(p):
            return p
    raise FileNotFoundError("mooncake_conversation_trace.jsonl (../shared/traces beside the checkout)")


def adapter_replay(requests, cfg: ReplayConfig, root: str, *, partial_page: bool = False) -> dict:
    """Token hit ratio (and tallies) of ``requests`` served through the adapter.

    SGLang hashes full pages only. ``partial_page`` also offers the trace's id of a
    request's partial last block to ``batch_exists`` (it is never stored or loaded), as
    the engine replay's lookup sees it: the retention rule then counts the same sightings."""
    cap = capacity_of(cfg, requests)
    bt = cfg.block_tokens
    longest = max(len(r.hash_ids) for r in requests)
    kv = drv.HostPool(2 * longest * bt, bt, (cfg.token_bytes,), dtype=torch.uint8)
    cost = cfg.cost()
    rk = drv.Rank(root, kv=kv, capacity_bytes=cap["capacity_bytes_files"], synchronous=cfg.synchronous,
                  policy=cfg.policy, checkpoint_pages=cfg.checkpoint_every, retention=cfg.retention,
                  cost={f: getattr(cost, f) for f in (
                      "bandwidth_bytes_per_s", "restore_overhead_s", "restore_s_per_node",
                      "prefill_fixed_s", "prefill_s_per_token", "prefill_s_per_token2")})
    tokens = hit_tokens = wrong = 0
    try:
        for req in requests:
            full = min(req.input_length // bt, len(req.hash_ids))
            keys = [str(h) for h in req.hash_ids[:full]]
            asked = [str(h) for h in req.hash_ids] if partial_page else keys
            hit = min(drv.query(rk, [], asked)[0], full) if asked else 0
            got, rows, _ = drv.fetch(rk, [], keys, hit)
            wrong += sum(not torch.equal(r.flatten(), drv.page_data(kv, k, 0).flatten())
                         for r, k in zip(rows, keys, strict=False))
            if got < full:
                drv.write_back(rk, keys[:got], keys[got:])
            tokens += req.input_length
            hit_tokens += min(got * bt, req.input_length)
        stats = rk.backend.engine_stats()["kv"]
        audit_ok = all(a.ok for a in rk.backend.audit().values())
    finally:
        rk.close()
    return {"hit_ratio_tokens": hit_tokens / tokens, "wrong_bytes": wrong, "nodes": stats["nodes"],
            "audit_ok": audit_ok, "counters": stats["counters"]}


def compare(requests, capacity: str = "10%", *, partial_page: bool = False) -> dict:
    """Both replays at the same capacity: the engine's and the adapter's token hit ratios."""
    cfg = ReplayConfig(capacity=capacity)
    engine = replay(requests, cfg).summary
    root = default_root()
    try:
        through = adapter_replay(requests, cfg, root, partial_page=partial_page)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return {"requests": len(requests), "capacity": capacity, "partial_page": partial_page,
            "engine_hit_ratio_tokens": engine["hit_ratio_tokens"],
            "adapter_hit_ratio_tokens": through["hit_ratio_tokens"],
            "adapter_wrong_bytes": through["wrong_bytes"], "adapter_audit_ok": through["audit_ok"]}


def within_1_percent(out: dict) -> bool:
    """The adapter's token hit ratio is within 1% (relative) of the engine replay's."""
    eng, ada = out["engine_hit_ratio_tokens"], out["adapter_hit_ratio_tokens"]
    return abs(ada - eng) <= 0.01 * eng


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--limit", type=int, default=None, help="replay only the first N requests")
    ap.add_argument("--capacity", default="10%")
    ap.add_argument("--partial-page", action="store_true",
                    help="also offer each request's partial last block to batch_exists (the engine replay's view)")
    args = ap.parse_args()
    requests = load_trace(trace_path())[: args.limit]
    out = compare(requests, args.capacity, partial_page=args.partial_page)
    out["within_1_percent"] = within_1_percent(out)
    print(json.dumps(out, indent=2))
    sys.exit(0 if out["within_1_percent"] and not out["adapter_wrong_bytes"] and out["adapter_audit_ok"] else 1)


if __name__ == "__main__":
    main()
