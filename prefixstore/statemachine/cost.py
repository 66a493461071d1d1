"""The restore cost rule: restore only when the transfer beats recomputing.

Pure: estimates from the tier (``restore_overhead_s`` per restore, ``restore_s_per_node``
per node read, i.e. per shard file on each rank, ranks in parallel, and the aggregate
``bandwidth_bytes_per_s`` over every rank) and a calibrated, superlinear prefill curve
``prefill_s(t) = fixed + a*t + b*t**2`` (attention makes long prefills superlinear).

Every candidate carries one snapshot and the segment rows from the GPU-resident end
to its own end, so with a byte-proportional transfer and a convex prefill curve a
deeper match that loses would also make every shallower one lose. What makes a
shallower match the one worth restoring is the per-node term: a slow tier's per-file
latency on the deep end of a path of many small checkpoints. ``choose`` tries the
candidates deepest first and takes the first whose transfer beats the prefill it
saves; every estimate it made is returned with the decision.
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs


@attrs.frozen
class CostModel:
    """Transfer and prefill time estimates for restore decisions."""

    bandwidth_bytes_per_s: float = 20e9
    restore_overhead_s: float = 0.0
    restore_s_per_node: float = 0.0
    prefill_fixed_s: float = 0.0
    prefill_s_per_token: float = 5e-5
    prefill_s_per_token2: float = 1e-10

    def __attrs_post_init__(self) -> None:
        if self.bandwidth_bytes_per_s <= 0:
            raise ValueError("bandwidth must be positive")
        if min(self.prefill_s_per_token, self.prefill_s_per_token2, self.prefill_fixed_s) < 0:
            raise ValueError("prefill coefficients must be non-negative")
        if min(self.restore_overhead_s, self.restore_s_per_node) < 0:
            raise ValueError("restore overheads must be non-negative")

    def prefill_s(self, tokens: int) -> float:
        """Modeled seconds to prefill ``tokens`` tokens from nothing."""
        if tokens <= 0:
            return 0.0
        return self.prefill_fixed_s + self.prefill_s_per_token * tokens + self.prefill_s_per_token2 * tokens * tokens

    def saved_s(self, gpu_tokens: int, end_tokens: int, total_tokens: int) -> float:
        """Prefill seconds saved by holding ``end_tokens`` instead of ``gpu_tokens``
        before prefilling to ``total_tokens``."""
        total = max(total_tokens, end_tokens)
        return self.prefill_cost_between(gpu_tokens, total) - self.prefill_cost_between(end_tokens, total)

    def prefill_cost_between(self, have: int, total: int) -> float:
        """Seconds to prefill tokens (have, total] given a cache of ``have`` tokens."""
        if total <= have:
            return 0.0
        # Incremental cost of a chunk: linear part plus quadratic attention over the context.
        return (
            self.prefill_fixed_s
            + self.prefill_s_per_token * (total - have)
            + self.prefill_s_per_token2 * (total * total - have * have)
        )

    def transfer_s(self, nbytes: int, nodes: int = 1) -> float:
        """Modeled seconds to restore ``nbytes`` (all ranks) read from ``nodes`` nodes."""
        return self.restore_overhead_s + nodes * self.restore_s_per_node + nbytes / self.bandwidth_bytes_per_s

    @classmethod
    def calibrate(cls, samples: Sequence[tuple[int, float]], **kw) -> CostModel:
        """Fit ``a*t + b*t^2`` (least squares, non-negative) to (tokens, seconds) samples."""
        import numpy as np

        t = np.array([s[0] for s in samples], dtype=float)
        y = np.array([s[1] for s in samples], dtype=float)
        A = np.stack([t, t * t], axis=1)
        coef, *_ = np.linalg.lstsq(A, y, rcond=None)
        a, b = (max(float(c), 0.0) for c in coef)
        return cls(prefill_s_per_token=a, prefill_s_per_token2=b, **kw)


@attrs.frozen
class Decision:
    """One restore decision: the candidate chosen (or None) and every estimate made."""

    chosen: int | None  # index into the candidates, deepest first
    estimates: tuple[tuple[int, float, float], ...]  # (end_tokens, transfer_s, saved_s)

    @property
    def result(self) -> str:
        """'deepest', 'shallower' or 'rejected' (no model: 'deepest' when any)."""
        if self.chosen is None:
            return "rejected"
        return "deepest" if self.chosen == 0 else "shallower"

    @property
    def deciding(self) -> tuple[int, float, float] | None:
        """The estimate behind the decision: the chosen one, or the deepest rejected."""
        if not self.estimates:
            return None
        return self.estimates[0 if self.chosen is None else self.chosen]


def choose(
    model: CostModel | None,
    candidates: Sequence[tuple[int, int] | tuple[int, int, int]],
    gpu_tokens: int,
    total_tokens: int,
) -> Decision:
    """Pick the deepest candidate ``(end_tokens, bytes_to_transfer[, nodes_to_read])``
    worth restoring.

    Candidates come deepest first. With no model the deepest always wins.
    """
    if model is None:
        return Decision(0 if candidates else None, ())
    est = []
    for i, cand in enumerate(candidates):
        end_tokens, nbytes = cand[0], cand[1]
        transfer = model.transfer_s(nbytes, cand[2] if len(cand) > 2 else 1)
        saved = model.saved_s(gpu_tokens, end_tokens, total_tokens)
        est.append((end_tokens, transfer, saved))
        if transfer < saved:
            return Decision(i, tuple(est))
    return Decision(None, tuple(est))
