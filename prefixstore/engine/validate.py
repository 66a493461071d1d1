"""Argument checks of the public methods, each raising ``InvalidArgumentError`` naming
the argument (or an existing typed error: ShapeError, DtypeError, UnalignedError, RankError).

Every public entry point checks its arguments before it touches anything: the options
of ``Engine.open`` in ``config.py`` (``EngineConfig``, ``resolve_open``), the fields of
a Params object when it is built (``params.py``), and here what needs the engine (its
layout, its identity), one function per kind of argument.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from prefixstore.base.errors import (
    BlockSizeMismatchError,
    ForeignMatchError,
    InvalidArgumentError,
    ShapeError,
)
from prefixstore.base.keys import Prefix
from prefixstore.base.layout import Layout, RankTensors
from prefixstore.engine.checks import callable_or_none, flag, instance, integer
from prefixstore.engine.results import Match
from prefixstore.statemachine.compaction import CompactionPolicy

__all__ = ["compact_policy", "evict_args", "flag", "into", "lookup_args", "match", "prefix", "store_args"]

# ---------------------------------------------------------------------- Engine.open


def prefix(layout: Layout, value: Any, argument: str = "prefix") -> Prefix:
    """A Prefix whose block size (when it records one) is the layout's."""
    if not isinstance(value, Prefix):
        raise InvalidArgumentError(argument, f"must be a Prefix, got {type(value).__name__}")
    bt = layout.block_tokens
    if value.block_tokens is not None and value.block_tokens != bt:
        raise BlockSizeMismatchError(
            argument, f"built with block_tokens={value.block_tokens}, but this cache's layout has {bt}"
        )
    return value


def match(cache_id: str, root: str, value: Any, argument: str = "match") -> Match:
    """A Match returned by the ``lookup`` of the engine ``cache_id`` open at ``root`` (not
    another engine's, nor a copy made by hand: its ``cache`` is that engine's identity)."""
    if not isinstance(value, Match):
        raise InvalidArgumentError(argument, f"must be a Match from lookup(), got {type(value).__name__}")
    if value.cache != cache_id:
        raise ForeignMatchError(argument, f"comes from another engine or cache, not the one open at {root}")
    return value


def into(layout: Layout, device: torch.device, m: Match, value: Any) -> list[dict[str, torch.Tensor]] | None:
    """``restore(..., into=)``: per rank, the layout's segments with the rows the match
    restores, contiguous, on the executor's ``device``, each its own memory (None: none
    given). Checked before anything is read, so a refused ``into`` is left untouched."""
    if value is None:
        return None
    fast = _into_common(layout, device, m.tokens - m.gpu_tokens, value)
    if fast is not None:
        return fast
    per = _rank_tensors(layout, "into", value)
    _storable("into", per)
    rows = m.tokens - m.gpu_tokens
    seen: list[tuple[int, int]] = []
    for r, t in enumerate(per):
        layout.check_segments(r, t, rows)
        for name, x in t.items():
            if not x.is_contiguous():
                raise ShapeError(f"into: rank {r}: {name!r} is not contiguous")
            if x.device.type != device.type or (device.index is not None and x.device.index != device.index):
                raise InvalidArgumentError("into", f"rank {r}: {name!r} is on {x.device}, the executor's outputs on {device}")
            lo = x.data_ptr()
            span = (lo, lo + x.numel() * x.element_size())
            if any(a < span[1] and span[0] < b for a, b in seen):
                raise InvalidArgumentError("into", f"rank {r}: {name!r} overlaps another tensor of into")
            seen.append(span)
    return [dict(t) for t in per]


def _into_common(layout: Layout, device: torch.device, rows: int, value: Any) -> list[dict[str, torch.Tensor]] | None:
    """``into`` checked in one pass where it is the common case (a dict per rank, or one
    dict for one rank, of plain contiguous strided tensors of the layout's segments, on
    ``device``, in memory of their own); None when anything differs or fails: the full
    checks of ``into`` then name what (the request path pays the slow path only for an
    argument it refuses or an unusual one)."""
    per = [value] if value.__class__ is dict else value if value.__class__ is list else None
    if per is None or len(per) != layout.ranks:
        return None
    specs = layout.segments
    kind, index = device.type, device.index
    spans: list[tuple[int, int]] = []
    for t in per:
        if t.__class__ is not dict or len(t) != len(specs):
            return None
        for s in specs:
            x = t.get(s.name)
            if (x.__class__ is not torch.Tensor or x.layout != torch.strided or x.dtype != s.torch_dtype
                    or x.shape != (rows, *s.shape) or not x.is_contiguous()):
                return None
            d = x.device
            if d.type != kind or (index is not None and d.index != index):
                return None
            lo = x.data_ptr()
            hi = lo + x.numel() * x.element_size()
            for a, b in spans:
                if a < hi and lo < b:
                    return None
            spans.append((lo, hi))
    return [dict(t) for t in per]


def compact_policy(value: Any) -> None:
    instance("policy", value, CompactionPolicy)


def evict_args(layout: Layout, nbytes: Any, prefix_: Any) -> tuple[int | None, Prefix | None]:
    if nbytes is not None and prefix_ is not None:
        raise InvalidArgumentError("nbytes", "give nbytes or prefix, not both")
    return integer("nbytes", nbytes, none=True), None if prefix_ is None else prefix(layout, prefix_)


def lookup_args(layout: Layout, value: Any, gpu_blocks: Any, total_tokens: Any) -> None:
    if (value.__class__ is Prefix and gpu_blocks.__class__ is int and 0 <= gpu_blocks <= len(value.keys)
            and (total_tokens is None or (total_tokens.__class__ is int and total_tokens >= 0))
            and (value.block_tokens is None or value.block_tokens == layout.block_tokens)):
        return  # the common case, checked in one expression (the request path)
    p = prefix(layout, value)
    g = integer("gpu_blocks", gpu_blocks)
    if g > len(p):
        raise InvalidArgumentError("gpu_blocks", f"{g} is more than the prefix's {len(p)} blocks")
    integer("total_tokens", total_tokens, none=True)


def _rank_tensors(layout: Layout, argument: str, value: Any) -> list[RankTensors]:
    if not isinstance(value, (Mapping, Sequence)) or isinstance(value, (str, bytes)):
        raise InvalidArgumentError(argument, f"must be a mapping of tensors or one per rank, got {type(value).__name__}")
    per = layout.per_rank(value)
    for r, t in enumerate(per):
        if not isinstance(t, Mapping):
            raise InvalidArgumentError(argument, f"rank {r}: must be a mapping of name -> tensor, got {type(t).__name__}")
    return per


def _storable(argument: str, per_rank: list[RankTensors]) -> None:
    """Tensors with bytes to copy: strided, on a real device (not ``meta``)."""
    for r, tensors in enumerate(per_rank):
        for name, t in tensors.items():
            if t.device.type == "meta" or t.layout != torch.strided:
                raise InvalidArgumentError(
                    argument, f"rank {r}: {name!r} is a {t.layout} tensor on {t.device}; need a strided tensor with data"
                )


def store_args(layout: Layout, value: Any, segments: Any, snapshot: Any, tokens_from: Any, valid: Any):
    """``store`` / ``store_async``: returns the per-rank (segments, snapshot or None)."""
    L = layout
    p = prefix(layout, value)
    if len(p) == 0:
        raise InvalidArgumentError("prefix", "cannot store an empty prefix")
    tokens_from = integer("tokens_from", tokens_from)
    L.check_blocks(tokens_from)
    end_tokens = len(p) * L.block_tokens
    if tokens_from >= end_tokens:
        raise InvalidArgumentError("tokens_from", f"{tokens_from} is not before the prefix's end ({end_tokens})")
    callable_or_none("valid", valid)
    segs = _rank_tensors(L, "segments", segments)
    for r, t in enumerate(segs):
        L.check_segments(r, t, end_tokens - tokens_from)
    _storable("segments", segs)
    if not L.has_snapshot:
        if snapshot:
            raise ShapeError("this layout has no snapshot tensors")
        return segs, None
    if snapshot is None:
        raise ShapeError("this layout has snapshot tensors: store needs snapshot=")
    snaps = _rank_tensors(L, "snapshot", snapshot)
    for r, t in enumerate(snaps):
        L.check_snapshot(r, t)
    _storable("snapshot", snaps)
    return segs, snaps
