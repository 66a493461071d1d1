"""Compiled traces, simulation results and the modeled prefill curve: what the simulator
(``replay/sim.py``) and the offline optimum (``replay/optimal.py``) share."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from prefixstore.base.errors import InvalidInputError
from prefixstore.replay.trace import BLOCK_TOKENS, Request

PrefillFn = Callable[[int], float]

DEFAULT_BLOCK_BYTES = 512 * 64 * 1024
"""Nominal bytes per 512-token block (64 KiB/token). Hit ratios depend only on
``capacity_bytes // block_bytes``."""

PREFILL_A = 5e-5
PREFILL_B = 1e-10


def default_prefill_s(tokens: int) -> float:
    """Modeled seconds to prefill ``tokens`` tokens from nothing: ``a*t + b*t**2``."""
    if tokens <= 0:
        return 0.0
    return PREFILL_A * tokens + PREFILL_B * tokens * tokens


# ----------------------------------------------------------------------------------
# Compiled traces


@dataclass(frozen=True, slots=True)
class CompiledTrace:
    """A trace as dense tree nodes: ``paths[r]`` are request ``r``'s node ids, root first."""

    paths: tuple[tuple[int, ...], ...]
    parent: tuple[int, ...]  # per node; -1 for a root
    depth: tuple[int, ...]  # per node; 0 for a root
    input_lengths: tuple[int, ...]
    block_tokens: int = BLOCK_TOKENS

    @property
    def n_nodes(self) -> int:
        return len(self.parent)

    @property
    def n_requests(self) -> int:
        return len(self.paths)

    @property
    def n_refs(self) -> int:
        return sum(len(p) for p in self.paths)

    def children(self) -> list[list[int]]:
        """Children of every node (all nodes of the trace, cached or not)."""
        kids: list[list[int]] = [[] for _ in range(self.n_nodes)]
        for node, p in enumerate(self.parent):
            if p >= 0:
                kids[p].append(node)
        return kids

    def unique_bytes(self, block_bytes: int) -> int:
        return self.n_nodes * block_bytes


def compile_trace(
    requests: Sequence[Request] | Sequence[Sequence[int]],
    input_lengths: Sequence[int] | None = None,
    *,
    block_tokens: int = BLOCK_TOKENS,
) -> CompiledTrace:
    """Intern each chain position ``(parent node, id)`` as a dense node id.

    ``requests`` are :class:`Request` records, or bare id chains (then ``input_lengths``
    defaults to full blocks).
    """
    if block_tokens <= 0:
        raise InvalidInputError(f"block_tokens must be positive, got {block_tokens}")
    nodes: dict[tuple[int, int], int] = {}
    parent: list[int] = []
    depth: list[int] = []
    paths: list[tuple[int, ...]] = []
    lengths: list[int] = []
    for i, r in enumerate(requests):
        ids = r.hash_ids if isinstance(r, Request) else tuple(r)
        if not ids:
            raise InvalidInputError(f"request {i} has no blocks")
        if isinstance(r, Request):
            n_tokens = r.input_length
        elif input_lengths is not None:
            n_tokens = input_lengths[i]
        else:
            n_tokens = len(ids) * block_tokens
        path: list[int] = []
        prev = -1
        for h in ids:
            key = (prev, h)
            node = nodes.get(key)
            if node is None:
                node = nodes[key] = len(parent)
                parent.append(prev)
                depth.append(len(path))
            path.append(node)
            prev = node
        paths.append(tuple(path))
        lengths.append(n_tokens)
    return CompiledTrace(tuple(paths), tuple(parent), tuple(depth), tuple(lengths), block_tokens)


def as_compiled(
    trace: CompiledTrace | Sequence[Request] | Sequence[Sequence[int]],
) -> CompiledTrace:
    return trace if isinstance(trace, CompiledTrace) else compile_trace(trace)


# ----------------------------------------------------------------------------------
# Results


@dataclass(frozen=True, slots=True)
class SimResult:
    """What one policy achieved on one trace at one capacity."""

    policy: str
    capacity_bytes: int
    block_bytes: int
    requests: int
    blocks_total: int
    blocks_hit: int
    tokens_total: int
    tokens_hit: int
    prefill_s_total: float
    prefill_s_saved: float
    stored: int = 0
    evicted: int = 0
    skipped_admission: int = 0
    skipped_no_room: int = 0
    hits: tuple[int, ...] = field(default=(), repr=False)  # block hits per request

    @property
    def capacity_blocks(self) -> int:
        return self.capacity_bytes // self.block_bytes

    @property
    def hit_ratio_blocks(self) -> float:
        return self.blocks_hit / self.blocks_total if self.blocks_total else 0.0

    @property
    def hit_ratio_tokens(self) -> float:
        return self.tokens_hit / self.tokens_total if self.tokens_total else 0.0

    def row(self) -> dict[str, float | int | str]:
        """A flat summary (for tables and JSON)."""
        return {
            "policy": self.policy,
            "capacity_blocks": self.capacity_blocks,
            "hit_ratio_blocks": round(self.hit_ratio_blocks, 6),
            "hit_ratio_tokens": round(self.hit_ratio_tokens, 6),
            "prefill_s_saved": round(self.prefill_s_saved, 3),
            "prefill_s_total": round(self.prefill_s_total, 3),
            "stored": self.stored,
            "evicted": self.evicted,
            "skipped_admission": self.skipped_admission,
            "skipped_no_room": self.skipped_no_room,
        }


def summarize(
    trace: CompiledTrace,
    hits: Sequence[int],
    *,
    policy: str,
    capacity_bytes: int,
    block_bytes: int,
    prefill_s: PrefillFn = default_prefill_s,
    **counters: int,
) -> SimResult:
    """Token and prefill accounting for per-request block hits."""
    bt = trace.block_tokens
    tokens_total = tokens_hit = 0
    pf_total = pf_saved = 0.0
    for h, n in zip(hits, trace.input_lengths, strict=True):
        th = min(h * bt, n)
        tokens_total += n
        tokens_hit += th
        pf_total += prefill_s(n)
        if th > 0:
            pf_saved += prefill_s(th)
    return SimResult(
        policy=policy,
        capacity_bytes=capacity_bytes,
        block_bytes=block_bytes,
        requests=trace.n_requests,
        blocks_total=trace.n_refs,
        blocks_hit=sum(hits),
        tokens_total=tokens_total,
        tokens_hit=tokens_hit,
        prefill_s_total=pf_total,
        prefill_s_saved=pf_saved,
        hits=tuple(hits),
        **counters,
    )


def capacity_in_blocks(capacity_bytes: int, block_bytes: int) -> int:
    if isinstance(block_bytes, bool) or not isinstance(block_bytes, int) or block_bytes <= 0:
        raise InvalidInputError(f"block_bytes must be a positive integer, got {block_bytes!r}")
    if (
        isinstance(capacity_bytes, bool)
        or not isinstance(capacity_bytes, int)
        or capacity_bytes < 0
    ):
        raise InvalidInputError(
            f"capacity_bytes must be a non-negative integer, got {capacity_bytes!r}"
        )
    return capacity_bytes // block_bytes
