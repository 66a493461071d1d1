"""Policies side by side on one trace and one capacity: the engine's replays of each
policy, the simulator's figure for the same policy (``sim_*``: the block-level model
of ``replay/sim.py``, for an honest engine-versus-model comparison), and the offline
optimum (``replay/optimal.py``, simulated, the same capacity in whole blocks) as the
ceiling. ``of_optimal`` is a run's block hit ratio over the optimum's.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from typing import Any

import attrs

from prefixstore.replay.engine_replay import (
    ReplayConfig,
    ReplayReport,
    Timeline,
    percentile,
    replay,
)
from prefixstore.replay.sim import SimResult, compile_trace, simulate
from prefixstore.replay.trace import Request
from prefixstore.statemachine.policy import registered


def sim_timeline(requests: Sequence[Request], res: SimResult, cfg: ReplayConfig) -> Timeline:
    """Per-request records of a simulated run, with the engine replay's latency model."""
    model = cfg.cost()
    bt = cfg.block_tokens
    hit_tokens = [min(h * bt, r.input_length) for h, r in zip(res.hits, requests, strict=True)]
    ttft = [
        (model.transfer_s(h * bt * cfg.token_bytes) if h else 0.0)
        + model.prefill_cost_between(t, r.input_length)
        for h, t, r in zip(res.hits, hit_tokens, requests, strict=True)
    ]
    return Timeline(
        [r.timestamp_ms for r in requests], [r.blocks for r in requests], list(res.hits),
        [r.input_length for r in requests], hit_tokens, ttft,
    )


def sim_summary(requests: Sequence[Request], res: SimResult, cfg: ReplayConfig) -> tuple[dict[str, Any], Timeline]:
    """A simulated run in the engine report's terms (hit ratios, prefill, TTFT)."""
    tl = sim_timeline(requests, res, cfg)
    return {
        "policy": res.policy,
        "engine": False,
        "requests": res.requests,
        "capacity_blocks": res.capacity_blocks,
        "blocks_total": res.blocks_total,
        "blocks_hit": res.blocks_hit,
        "hit_ratio_blocks": res.hit_ratio_blocks,
        "tokens_total": res.tokens_total,
        "tokens_hit": res.tokens_hit,
        "hit_ratio_tokens": res.hit_ratio_tokens,
        "prefill_s_total": res.prefill_s_total,
        "prefill_s_saved": res.prefill_s_saved,
        "ttft_s_p50": percentile(tl.ttft_s, 50),
        "ttft_s_p99": percentile(tl.ttft_s, 99),
        "stored": res.stored,
        "evicted": res.evicted,
    }, tl


@attrs.define
class Comparison:
    results: dict[str, dict[str, Any]]
    """Keyed by policy name (``optimal`` last)."""
    timelines: dict[str, Timeline]


def compare(
    requests: Sequence[Request],
    cfg: ReplayConfig,
    root: str | None = None,
    *,
    policies: Sequence[str] | None = None,
    progress: Callable[[dict[str, Any]], None] | None = None,
) -> Comparison:
    """Replay ``requests`` on the engine under each policy (default: every one
    registered now; each in its own new directory under ``root``, or a temp dir),
    then simulate the same policies and the offline optimum at the same capacity."""
    policies = registered() if policies is None else policies
    ct = compile_trace(requests)
    unique = ct.n_nodes
    prefill = cfg.cost().prefill_s
    results: dict[str, dict[str, Any]] = {}
    timelines: dict[str, Timeline] = {}
    reports: dict[str, ReplayReport] = {}
    for pol in policies:
        sub = None if root is None else os.path.join(root, pol)
        rep = replay(requests, attrs.evolve(cfg, policy=pol), sub, unique=unique, progress=progress)
        reports[pol] = rep
        results[pol] = rep.summary
        timelines[pol] = rep.timeline
    some = next(iter(reports.values())).summary if reports else None
    cap_blocks = some["capacity_blocks"] if some else 0
    cap_bytes = cap_blocks * cfg.block_bytes_modeled
    opt = simulate(ct, cap_bytes, "optimal", block_bytes=cfg.block_bytes_modeled, prefill_s=prefill)
    best, tl = sim_summary(requests, opt, cfg)
    for pol in policies:
        sim = simulate(ct, cap_bytes, pol, block_bytes=cfg.block_bytes_modeled, prefill_s=prefill)
        r = results[pol]
        r["sim_hit_ratio_blocks"] = sim.hit_ratio_blocks
        r["sim_hit_ratio_tokens"] = sim.hit_ratio_tokens
        r["sim_prefill_s_saved"] = sim.prefill_s_saved
        r["of_optimal"] = r["hit_ratio_blocks"] / opt.hit_ratio_blocks if opt.hit_ratio_blocks else 0.0
        r["sim_of_optimal"] = sim.hit_ratio_blocks / opt.hit_ratio_blocks if opt.hit_ratio_blocks else 0.0
    best["of_optimal"] = 1.0
    best["capacity_bytes_modeled"] = cap_bytes
    results["optimal"] = best
    timelines["optimal"] = tl
    return Comparison(results, timelines)
