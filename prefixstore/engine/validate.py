"""Argument checks of the public methods, each raising ``InvalidArgumentError`` naming
the argument (or an existing typed error: ShapeError, DtypeError, UnalignedError, RankError).

Every public entry point checks its arguments before it touches anything: the options
of ``Engine.open`` in ``config.py`` (``EngineConfig``, ``resolve_open``), the fields of
a Params object when it is built (``params.py``), and here what needs the engine (its
layout, its identity), one function per kind of argument.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch

from prefixstore.base.destination import Pieces
from prefixstore.base.errors import (
    BlockSizeMismatchError,
    DtypeError,
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


def into(layout: Layout, device: torch.device, m: Match, value: Any) -> list[dict[str, Any]] | None:
    """``restore(..., into=)``: per rank, the layout's segments with the rows the match
    restores, each a contiguous tensor or ``Pieces`` (spans of a contiguous tensor of the
    segment's dtype holding exactly its rows' elements), on the executor's ``device``, no
    two sharing a byte (None: none given). Checked before anything is read, so a refused ``into`` is
    left untouched."""
    if value is None:
        return None
    fast = _into_common(layout, device, m.tokens - m.gpu_tokens, value)
    if fast is not None:
        return fast
    per = _rank_tensors(layout, "into", value)
    rows = m.tokens - m.gpu_tokens
    specs = {s.name: s for s in layout.segments}
    spans: list[tuple[np.ndarray, str]] = []  # byte ranges [lo, hi) of each destination
    for r, t in enumerate(per):
        if set(t) != set(specs):
            raise ShapeError(f"rank {r}: segment tensors {sorted(t)} do not match layout {sorted(specs)}")
        # each Pieces entry stands in as a tensor of no memory with its segment's shape: checked below
        layout.check_segments(r, {n: _shaped(specs[n], rows) if isinstance(x, Pieces) else x
                                  for n, x in t.items()}, rows)
        for name, x in t.items():
            label = f"rank {r}: {name!r}"
            if isinstance(x, Pieces):
                spans.append(_pieces(x, specs[name], rows, label, device))
            else:
                _destination(x, label, device)
                lo = x.data_ptr()
                spans.append((np.array([[lo, lo + x.numel() * x.element_size()]], dtype=np.int64), label))
    _disjoint(spans)
    return [dict(t) for t in per]


def _shaped(spec: Any, rows: int) -> torch.Tensor:
    """A stand-in with the segment's shape and dtype, for a ``Pieces`` entry (checked by
    ``_pieces``): no memory."""
    return torch.empty((rows, *spec.shape), dtype=spec.torch_dtype, device="meta")


def _destination(x: torch.Tensor, label: str, device: torch.device) -> None:
    """One tensor a restore writes: strided with data, contiguous, on ``device``."""
    if x.device.type == "meta" or x.layout != torch.strided:
        raise InvalidArgumentError("into", f"{label} is a {x.layout} tensor on {x.device}; need a strided tensor with data")
    if not x.is_contiguous():
        raise ShapeError(f"into: {label} is not contiguous")
    if x.device.type != device.type or (device.index is not None and x.device.index != device.index):
        raise InvalidArgumentError("into", f"{label} is on {x.device}, the executor's outputs on {device}")


def _pieces(x: Pieces, spec: Any, rows: int, label: str, device: torch.device) -> tuple[np.ndarray, str]:
    """The byte ranges ``[lo, hi)`` of ``x``'s spans, checked: its memory a destination of
    the segment's dtype, the spans inside it and holding exactly ``rows`` rows."""
    mem = x.memory
    if not isinstance(mem, torch.Tensor):
        raise InvalidArgumentError("into", f"{label}: Pieces memory is a {type(mem).__name__}, not a tensor")
    _destination(mem, f"{label} (Pieces memory)", device)
    if mem.dtype != spec.torch_dtype:
        raise DtypeError(f"into: {label}: Pieces memory has dtype {mem.dtype}, layout says {spec.dtype}")
    off, n = x.spans[:, 0], x.spans[:, 1]
    if len(off) and (int(off.min()) < 0 or int(n.min()) < 0 or int((off + n).max()) > mem.numel()):
        raise ShapeError(f"into: {label}: a span lies outside its Pieces memory of {mem.numel()} elements")
    want, got = rows * math.prod(spec.shape), int(n.sum())
    if got != want:
        raise ShapeError(f"into: {label}: its {len(n)} spans hold {got} elements, "
                         f"{rows} rows of {tuple(spec.shape)} are {want}")
    es = mem.element_size()
    lo = mem.data_ptr() + off * es
    return np.stack([lo, lo + n * es], axis=1), label


def _disjoint(spans: list[tuple[np.ndarray, str]]) -> None:
    """No two destinations share a byte: sorted by start, each range begins after every
    earlier one ended (empty ranges aside)."""
    if not spans:
        return
    ranges = np.concatenate([a for a, _ in spans])
    owner = np.concatenate([np.full(len(a), k) for k, (a, _) in enumerate(spans)])
    keep = ranges[:, 1] > ranges[:, 0]
    ranges, owner = ranges[keep], owner[keep]
    order = np.argsort(ranges[:, 0], kind="stable")
    lo, hi, owner = ranges[order, 0], ranges[order, 1], owner[order]
    ends = np.maximum.accumulate(hi)
    bad = np.nonzero(lo[1:] < ends[:-1])[0]
    if len(bad):
        j = int(bad[0]) + 1
        prev = int(np.nonzero(hi[:j] == ends[j - 1])[0][0])
        a, b = spans[int(owner[j])][1], spans[int(owner[prev])][1]
        raise InvalidArgumentError("into", f"{a} overlaps {b}" if a != b else f"{a}: two of its spans overlap")


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
