"""Where a cache tensor's heads and columns go across tensor-parallel ranks.

A tensor of ``heads`` heads, each ``width`` columns wide, goes onto ``ranks`` ranks:

* ``heads >= ranks``: split by heads as tensor parallelism does, rank ``r`` holds heads
  ``[r * heads // ranks, (r + 1) * heads // ranks)``;
* ``heads < ranks`` (``ranks % heads == 0``): each head is what ``ranks // heads``
  consecutive ranks hold alike on the GPU (a replica, e.g. an MLA latent or a
  multi-query head). It is stored *once*: each of those ranks keeps one stripe of
  ``ceil(width / (ranks // heads))`` columns (the last stripe zero-padded), so the
  checkpoint's bytes do not grow with the rank count. The layout names such a tensor
  ``once.<name>`` (:func:`layout_name`).

Rows are token-first: ``(tokens, heads, width)`` for a whole tensor, ``(tokens,
heads_per_rank, columns_per_rank)`` per rank.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from prefixstore.base.errors import RankError

ONCE = "once."


def stripes(heads: int, ranks: int) -> int:
    """How many ranks share each head (1: split by heads)."""
    if heads >= ranks:
        if heads % ranks:
            raise RankError(f"{heads} heads do not split evenly across {ranks} ranks")
        return 1
    if ranks % heads:
        raise RankError(f"{heads} heads can be neither split evenly across {ranks} ranks nor striped")
    return ranks // heads


def rank_shape(heads: int, width: int, ranks: int) -> tuple[int, int]:
    """``(heads, columns)`` one rank holds."""
    g = stripes(heads, ranks)
    return (heads // ranks, width) if g == 1 else (1, -(-width // g))


def layout_name(name: str, heads: int, ranks: int) -> str:
    """``name``, or ``once.<name>`` when its heads are stored once across several ranks."""
    return ONCE + name if stripes(heads, ranks) > 1 else name


def split(rows: torch.Tensor, ranks: int) -> list[torch.Tensor]:
    """``(tokens, heads, width)`` -> per rank ``(tokens, h, c)`` (views; the caller copies)."""
    heads, width = int(rows.shape[1]), int(rows.shape[2])
    g = stripes(heads, ranks)
    if g == 1:
        per = heads // ranks
        return [rows[:, r * per : (r + 1) * per] for r in range(ranks)]
    c = -(-width // g)
    padded = F.pad(rows, (0, g * c - width)) if g * c != width else rows
    return [padded[:, r // g : r // g + 1, (r % g) * c : (r % g + 1) * c] for r in range(ranks)]


def join(parts: Sequence[torch.Tensor], heads: int, width: int) -> torch.Tensor:
    """Inverse of :func:`split`: per rank ``(tokens, h, c)`` -> ``(tokens, heads, width)``."""
    ranks = len(parts)
    g = stripes(heads, ranks)
    if g == 1:
        return torch.cat(list(parts), dim=1)
    whole = [torch.cat(list(parts[h * g : (h + 1) * g]), dim=2)[..., :width] for h in range(heads)]
    return torch.cat(whole, dim=1)
