"""The seed scenario, replayed on the real engine with real (scaled) files.

What the seed reports (DESIGN.md section 7): DeepSeek V4.1 Flash on 4 tensor-parallel
ranks, one conversation growing to 855k tokens beside a ~170k-token classifier
transcript that is called again and again. Each checkpoint carries a large fixed-size
state snapshot and a small per-token compressed KV, so the long conversation's
interior snapshots are what fills the tier. Before the fix the classifier's
checkpoint was evicted and its ~2 s calls became ~16 s full prefills.

The replay, per conversation turn:

1. the conversation grows by one turn. It is GPU-resident between its own turns
   (its lookup is a ``gpu_resident`` bypass), except every ``preempt_every`` turns,
   when it was pushed off the GPU and is restored from the tier (through interior
   checkpoints whose snapshots may have been retired). Its new end is stored, with
   ``valid=`` true until the next turn moves its state on;
2. the classifier is called ``classifier_calls_per_turn`` times: its transcript plus a
   fresh 1024-token item is looked up, restored when the cost rule says so (or fully
   prefilled on a miss), and its transcript checkpoint is stored (a duplicate, skipped,
   when it was still there).

Every restore is verified against the bytes that were stored. Latencies are modeled
(nothing runs a model): a restore costs the cost model's transfer estimate plus the
prefill of the rest of the request; a miss costs the prefill of the whole request.

Scale. Everything is stated in modeled units (512-token blocks, bytes of the real
deployment); the files are scaled down twice. Tokens by ``token_scale`` (default 8:
an engine block of 64 tokens stands for a 512-token block, so the 855k-token
conversation is 106,875 engine tokens) and bytes by ``byte_scale`` (default 4096:
one file byte stands for 4 KiB). The modeled 512 bytes of compressed KV per token per
rank are 1 file byte per engine token, the modeled 512 MiB snapshot per rank is a
128 KiB tensor, the 16 GiB tier is 4 MiB of files. The cost model is scaled to match
(bandwidth by ``byte_scale``, the prefill curve's coefficients by ``token_scale``),
so its estimates are modeled seconds. The sizes follow the seed's description (a
large fixed snapshot, a small per-token compressed KV); they are illustrative, not
measured on DeepSeek V4.
"""

from __future__ import annotations

import os
import statistics
import tempfile
from typing import Any

import attrs
import torch

from prefixstore.base.errors import InvalidInputError
from prefixstore.base.keys import Prefix
from prefixstore.base.layout import Layout, TensorSpec
from prefixstore.engine.api import Engine
from prefixstore.statemachine.cost import CostModel
from prefixstore.statemachine.policy import policy_named

KIB, MIB, GIB = 1 << 10, 1 << 20, 1 << 30
_WINDOWS = 4096  # distinct snapshot contents per transcript (positions modulo this)


@attrs.frozen
class SeedConfig:
    """The scenario's parameters, in modeled (unscaled) units unless said otherwise."""

    ranks: int = 4
    block_tokens: int = 512
    conversation_tokens: int = 855_000
    conversation_turns: int = 120
    classifier_tokens: int = 170_000
    classifier_item_tokens: int = 1024
    classifier_calls_per_turn: int = 1
    preempt_every: int = 20
    kv_bytes_per_token_rank: int = 512
    snapshot_bytes_rank: int = 512 * MIB
    capacity_bytes: int = 16 * GIB
    token_scale: int = 8
    byte_scale: int = 4096
    bandwidth_bytes_per_s: float = 1.4e9  # aggregate over the ranks (local NVMe tier)
    restore_overhead_s: float = 0.2
    prefill_s_per_token: float = 5e-5
    prefill_s_per_token2: float = 2.6e-10

    def __attrs_post_init__(self) -> None:
        if self.block_tokens % self.token_scale:
            raise InvalidInputError("block_tokens must be a multiple of token_scale")
        per_engine_token = self.kv_bytes_per_token_rank * self.token_scale
        if per_engine_token % self.byte_scale or self.snapshot_bytes_rank % self.byte_scale:
            raise InvalidInputError(
                "KV bytes per engine token and snapshot bytes must be multiples of byte_scale"
            )
        if self.conversation_turns < 1 or self.classifier_calls_per_turn < 1:
            raise InvalidInputError("need at least one turn and one classifier call per turn")
        if (
            self.classifier_tokens < self.block_tokens
            or self.conversation_tokens < self.conversation_turns * self.block_tokens
        ):
            raise InvalidInputError("transcripts too short for the block size and turn count")

    def layout(self) -> Layout:
        """The engine's layout: scaled tokens per block, scaled bytes per tensor."""
        width = self.kv_bytes_per_token_rank * self.token_scale // self.byte_scale
        return Layout(
            segments=[TensorSpec("kv", "uint8", (width,))],
            snapshots=[
                TensorSpec("state", "uint8", (self.snapshot_bytes_rank // self.byte_scale,))
            ],
            block_tokens=self.block_tokens // self.token_scale,
            ranks=self.ranks,
        )

    def cost(self) -> CostModel:
        """The cost model in engine tokens and file bytes (its estimates: modeled seconds)."""
        return CostModel(
            bandwidth_bytes_per_s=self.bandwidth_bytes_per_s / self.byte_scale,
            restore_overhead_s=self.restore_overhead_s,
            prefill_s_per_token=self.prefill_s_per_token * self.token_scale,
            prefill_s_per_token2=self.prefill_s_per_token2 * self.token_scale**2,
        )

    @property
    def capacity_file_bytes(self) -> int:
        return self.capacity_bytes // self.byte_scale


class _Transcript:
    """A token stream with deterministic per-token KV rows and per-position snapshots."""

    def __init__(self, cfg: SeedConfig, salt: int, blocks: int) -> None:
        self.cfg, self.salt, self.blocks = cfg, salt, blocks
        self.bt = cfg.block_tokens // cfg.token_scale  # engine tokens per block
        self.prefix = Prefix.from_ids(((salt << 40) | b for b in range(blocks)), self.bt)
        width = cfg.kv_bytes_per_token_rank * cfg.token_scale // cfg.byte_scale
        pos = torch.arange(blocks * self.bt, dtype=torch.int64)[:, None]
        col = torch.arange(width, dtype=torch.int64)[None, :]
        self.rows = [
            ((pos * 7 + col * 3 + salt * 13 + r * 5) % 251).to(torch.uint8)
            for r in range(cfg.ranks)
        ]
        # Snapshots are windows of one random buffer per rank, at an offset that depends
        # on the position: distinct content per checkpoint without a fresh tensor each.
        self.snap_size = cfg.snapshot_bytes_rank // cfg.byte_scale
        g = torch.Generator().manual_seed(salt)
        self.snap_base = [
            torch.randint(0, 256, (self.snap_size + _WINDOWS,), generator=g, dtype=torch.uint8)
            for _ in range(cfg.ranks)
        ]

    def segments(self, blocks: int) -> list[dict[str, torch.Tensor]]:
        n = blocks * self.bt
        return [{"kv": self.rows[r][:n]} for r in range(self.cfg.ranks)]

    def snapshot(self, blocks: int) -> list[dict[str, torch.Tensor]]:
        off = blocks % _WINDOWS
        return [{"state": b[off : off + self.snap_size]} for b in self.snap_base]

    def verify(self, restored) -> bool:
        """Whether a restore returned exactly the rows and snapshot that were stored."""
        lo, hi = restored.start_tokens, restored.end_tokens
        snap = self.snapshot(hi // self.bt)
        return all(
            torch.equal(restored.segments[r]["kv"], self.rows[r][lo:hi])
            and torch.equal(restored.snapshot[r]["state"], snap[r]["state"])
            for r in range(self.cfg.ranks)
        )


def _percentile(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    if len(values) == 1:
        return values[0]
    return statistics.quantiles(values, n=100, method="inclusive")[int(q) - 1]


def run_seed(
    root: str | None = None, policy: str = "prefixstore", cfg: SeedConfig | None = None
) -> dict[str, Any]:
    """Replay the seed scenario in ``root`` (a new or empty directory; default a temp
    dir) under ``policy``; returns the results as a flat dict.

    Runs torch single-threaded meanwhile (restored after): the tensors are small, and
    on a busy 2-core machine intra-op threads make each copy ~20x slower.
    """
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _run(root, policy, cfg or SeedConfig())
    finally:
        torch.set_num_threads(threads)


def _run(root: str | None, policy: str, cfg: SeedConfig) -> dict[str, Any]:
    policy_named(policy)  # InvalidInputError naming the registered ones
    if root is None:
        root = tempfile.mkdtemp(prefix="prefixstore-seed-")
    elif os.path.isdir(root) and os.listdir(root):
        raise InvalidInputError(f"{root} is not empty: the seed scenario starts from an empty tier")
    conv_blocks = cfg.conversation_tokens // cfg.block_tokens
    cls_blocks = cfg.classifier_tokens // cfg.block_tokens
    item_blocks = max(1, cfg.classifier_item_tokens // cfg.block_tokens)
    bt = cfg.block_tokens // cfg.token_scale  # engine tokens per block (the cost model's unit)
    conv = _Transcript(cfg, 1, conv_blocks)
    cls = _Transcript(cfg, 2, cls_blocks)
    model = cfg.cost()
    ends = [
        max(1, round(conv_blocks * (i + 1) / cfg.conversation_turns))
        for i in range(cfg.conversation_turns)
    ]
    cls_lat: list[float] = []
    cls_hit: list[bool] = []
    conv_lat: list[float] = []
    conv_restores = conv_restore_hits = 0
    wrong_bytes = 0
    call = 0
    current = {"turn": -1}
    with Engine.open(root, cfg.layout(), cfg.capacity_file_bytes, policy=policy, cost=model) as eng:
        for turn, end in enumerate(ends):
            prev = ends[turn - 1] if turn else 0
            # 1. the conversation's turn
            resident = prev if (turn % cfg.preempt_every) else 0
            total = end * bt
            m = eng.lookup(conv.prefix[:end], gpu_blocks=resident, total_tokens=total)
            have = resident * bt
            latency = 0.0
            if resident == 0 and turn:
                conv_restores += 1
                r = eng.restore(m) if m.hit else None
                if r is not None:
                    wrong_bytes += not conv.verify(r)
                    conv_restore_hits += 1
                    have, latency = r.end_tokens, m.transfer_s or 0.0
            conv_lat.append(latency + model.prefill_cost_between(have, total))
            current["turn"] = turn  # the previous turn's GPU checkpoint has moved on
            eng.store(
                conv.prefix[:end],
                conv.segments(end),
                conv.snapshot(end),
                valid=lambda t=turn: current["turn"] == t,
            )
            # 2. the classifier's calls
            for _ in range(cfg.classifier_calls_per_turn):
                item = Prefix.from_ids(
                    [
                        *((2 << 40) | b for b in range(cls_blocks)),
                        *((3 << 40) | (call << 8) | b for b in range(item_blocks)),
                    ],
                    bt,
                )
                total = (cls_blocks + item_blocks) * bt
                m = eng.lookup(item, total_tokens=total)
                r = eng.restore(m) if m.hit else None
                if r is not None and r.end_tokens == cls_blocks * bt:
                    wrong_bytes += not cls.verify(r)
                    cls_lat.append(
                        (m.transfer_s or 0.0) + model.prefill_cost_between(r.end_tokens, total)
                    )
                    cls_hit.append(True)
                else:
                    cls_lat.append(model.prefill_cost_between(0, total))
                    cls_hit.append(False)
                eng.store(cls.prefix, cls.segments(cls_blocks), cls.snapshot(cls_blocks))
                call += 1
        stats = eng.stats()
        audit_ok = eng.audit().ok
    after_first = cls_hit[1:]
    steady = cls_lat[1:]
    return {
        "scenario": "seed",
        "policy": policy,
        "directory": root,
        "token_scale": cfg.token_scale,
        "byte_scale": cfg.byte_scale,
        "conversation_tokens": conv_blocks * cfg.block_tokens,
        "conversation_turns": cfg.conversation_turns,
        "classifier_tokens": cls_blocks * cfg.block_tokens,
        "classifier_calls": len(cls_hit),
        "classifier_restores_after_first": sum(after_first),
        "classifier_restore_ratio": sum(after_first) / len(after_first) if after_first else 0.0,
        "classifier_latency_s_p50": _percentile(steady, 50),
        "classifier_latency_s_p99": _percentile(steady, 99),
        "classifier_first_call_s": cls_lat[0],
        "classifier_miss_s": model.prefill_cost_between(0, (cls_blocks + item_blocks) * bt),
        "conversation_restores": conv_restores,
        "conversation_restore_hits": conv_restore_hits,
        "conversation_latency_s_p50": _percentile(conv_lat, 50),
        "wrong_bytes": wrong_bytes,
        "audit_ok": audit_ok,
        "capacity_bytes_modeled": cfg.capacity_bytes,
        "charged_bytes_modeled": stats["charged_bytes"] * cfg.byte_scale,
        "snapshot_bytes_used_modeled": stats["snapshot_bytes_used"] * cfg.byte_scale,
        "nodes": stats["nodes"],
        "counters": stats["counters"],
    }
