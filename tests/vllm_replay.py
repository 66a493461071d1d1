"""The Mooncake trace through the vLLM connector, beside `prefixstore replay` (not a test module).

Each trace request becomes a vLLM ``Request`` whose prompt is ``input_length`` tokens:
block ``j`` of 512 tokens is made from the trace's ``hash_ids[j]`` (the id in its first
two tokens), so vLLM's own block hasher chains the blocks exactly as the trace's ids
do. vLLM's real scheduler (prefix caching off: every hit is the connector's) serves
the requests one after another (``max_tokens=1``), one worker steps them
(tests/vllm_driver.py), and the token hit ratio is the tokens loaded from the cache
over the trace's input tokens; every loaded block is checked byte for byte.

The connector runs at the engine replay's settings: the capacity (10% of the trace's
unique blocks), 16 file bytes a token (one layer, named ``kv`` as the engine replay's one
tensor, one KV head of 4: K and V in float16), its cost rule, its retention rule
(``retention``) and its checkpoint cadence (``checkpoint_blocks`` = ``checkpoint_every``).
vLLM hashes full blocks only, and never loads a request's last token: a prompt whose
length is a multiple of 512 can load one block less than the engine replay counts.

    python tests/vllm_replay.py [--limit N] [--capacity 10%]     # whole trace: minutes
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.dirname(HERE)]  # the driver, and this checkout's prefixstore

import vllm_driver as drv  # noqa: E402

from prefixstore.replay.engine_replay import ReplayConfig, capacity_of, replay  # noqa: E402
from prefixstore.replay.trace import load_trace  # noqa: E402

TRACE = os.path.join(HERE, "..", "..", "shared", "traces", "mooncake_conversation_trace.jsonl")
COST_FIELDS = ("bandwidth_bytes_per_s", "restore_overhead_s", "restore_s_per_node", "prefill_fixed_s",
               "prefill_s_per_token", "prefill_s_per_token2")


def trace_path() -> str:
    for p in (TRACE, "/work/shared/traces/mooncake_conversation_trace.jsonl"):
        if os.path.exists(p):
            return p
    raise FileNotFoundError("mooncake_conversation_trace.jsonl (../shared/traces beside the checkout)")


def trace_tokens(req, bt: int) -> list[int]:
    """``input_length`` tokens; block ``j`` is a function of ``hash_ids[j]`` alone."""
    out: list[int] = []
    for j in range((req.input_length + bt - 1) // bt):
        h = req.hash_ids[min(j, len(req.hash_ids) - 1)]
        out += [h // 998 % 998, h % 998] + [(h * 7 + k * 13) % 998 for k in range(bt - 2)]
    return out[: req.input_length]


def connector_replay(requests, cfg: ReplayConfig, root: str) -> dict:
    """Token hit ratio (and tallies) of ``requests`` served through the connector."""
    bt = cfg.block_tokens
    cap = capacity_of(cfg, requests)
    cost = cfg.cost()
    longest = max(r.input_length for r in requests)
    model = drv.Model(layers=("kv",), kv_heads=1, head=cfg.token_bytes // 4)
    extra = {"capacity_bytes": cap["capacity_bytes_files"], "synchronous": cfg.synchronous, "policy": cfg.policy,
             "retention": cfg.retention, "checkpoint_blocks": cfg.checkpoint_every,
             "cost": {f: getattr(cost, f) for f in COST_FIELDS}, "staging_dir": os.path.join(root, "staging")}
    inst = drv.Instance(drv.write_model(root, model), os.path.join(root, "cache"), model=model, block_size=bt,
                        prefix_caching=False, max_batched=longest + bt, max_model_len=longest + 2 * bt,
                        num_blocks=longest // bt + 4, extra=extra)
    tokens = hit = 0
    t0 = time.perf_counter()
    try:
        for i, req in enumerate(requests):
            rid = f"t{i}"
            inst.add(rid, trace_tokens(req, bt), 1)
            inst.run()
            tokens += req.input_length
            hit += min(inst.external_tokens.pop(rid, 0), req.input_length)
        assert inst.connector.flush(60)
        stats = inst.connector.stats()
        audit_ok = inst.connector.scheduler.engine.audit().ok
    finally:
        inst.close()
    return {"hit_ratio_tokens": hit / tokens, "wrong_blocks": inst.wrong, "checked_blocks": inst.checked,
            "audit_ok": audit_ok, "nodes": stats["engine"]["nodes"], "connector": stats["connector"],
            "wall_s": time.perf_counter() - t0}


def compare(requests, capacity: str = "10%") -> dict:
    """Both replays at the same capacity: the engine's and the connector's token hit ratios."""
    cfg = ReplayConfig(capacity=capacity)
    engine = replay(requests, cfg).summary
    shm = "/dev/shm" if os.access("/dev/shm", os.W_OK) else None  # tmpfs: fsync is free, as for the engine replay
    root = tempfile.mkdtemp(prefix="vllm-replay-", dir=shm)
    try:
        through = connector_replay(requests, cfg, root)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return {"requests": len(requests), "capacity": capacity,
            "engine_hit_ratio_tokens": engine["hit_ratio_tokens"],
            "connector_hit_ratio_tokens": through["hit_ratio_tokens"],
            "connector_wrong_blocks": through["wrong_blocks"], "connector_checked_blocks": through["checked_blocks"],
            "connector_audit_ok": through["audit_ok"], "connector_wall_s": round(through["wall_s"], 1)}


def within_1_percent(out: dict) -> bool:
    eng, got = out["engine_hit_ratio_tokens"], out["connector_hit_ratio_tokens"]
    return abs(got - eng) <= 0.01 * eng


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--limit", type=int, default=None, help="replay only the first N requests")
    ap.add_argument("--capacity", default="10%")
    args = ap.parse_args()
    out = compare(load_trace(trace_path())[: args.limit], args.capacity)
    out["within_1_percent"] = within_1_percent(out)
    print(json.dumps(out, indent=2))
    sys.exit(0 if out["within_1_percent"] and not out["connector_wrong_blocks"] and out["connector_audit_ok"] else 1)


if __name__ == "__main__":
    main()
