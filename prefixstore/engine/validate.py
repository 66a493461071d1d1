"""Argument checks of the public API, each raising ``InvalidArgumentError`` naming the
argument (or an existing typed error: ShapeError, DtypeError, UnalignedError, RankError).

Every public entry point checks its arguments here, once, before it touches anything:
``open_args`` for ``Engine.open`` (``OPEN_CHECKS``: one check per option; an option of
``Engine.__init__`` without a row is accepted unchecked), and one function per kind of
argument for the methods.
"""

from __future__ import annotations

import inspect
import math
import numbers
import operator
import os
import re
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch

from prefixstore.engine.errors import (
    BlockSizeMismatchError,
    ForeignMatchError,
    InvalidArgumentError,
    ShapeError,
)
from prefixstore.engine.keys import Prefix
from prefixstore.engine.layout import Layout, RankTensors
from prefixstore.engine.results import Match
from prefixstore.gpu.backings import BACKINGS
from prefixstore.statemachine.compaction import CompactionPolicy
from prefixstore.statemachine.cost import CostModel
from prefixstore.statemachine.policy import POLICIES

if TYPE_CHECKING:
    from prefixstore.engine.api import Engine

# ---------------------------------------------------------------------- scalars


def integer(argument: str, value: Any, *, minimum: int = 0, none: bool = False) -> int | None:
    """``value`` as an int >= ``minimum`` (a bool, float or str is refused)."""
    if value is None and none:
        return None
    try:
        n = None if isinstance(value, bool) else operator.index(value)
    except TypeError:
        n = None
    if n is None:
        raise InvalidArgumentError(argument, f"must be an int, got {value!r}")
    if n < minimum:
        raise InvalidArgumentError(argument, f"must be >= {minimum}, got {n}")
    return n


def real(argument: str, value: Any, *, lo: float, hi: float = math.inf, lo_open: bool = False) -> float:
    """``value`` as a finite real number in ``[lo, hi]`` (``(lo, hi]`` when ``lo_open``)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise InvalidArgumentError(argument, f"must be a number, got {value!r}")
    x = float(value)
    if not math.isfinite(x) or x > hi or x < lo or (lo_open and x == lo):
        span = f"{'(' if lo_open else '['}{lo}, {hi}]"
        raise InvalidArgumentError(argument, f"must be a finite number in {span}, got {value!r}")
    return x


def choice(argument: str, value: Any, known: Sequence[str], *, fold: bool = False) -> str:
    """``value`` if it is one of ``known`` (case-insensitively when ``fold``)."""
    if isinstance(value, str) and (value.upper() if fold else value) in known:
        return value
    raise InvalidArgumentError(argument, f"must be one of {', '.join(known)}, got {value!r}")


def flag(argument: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise InvalidArgumentError(argument, f"must be True or False, got {value!r}")
    return value


def callable_or_none(argument: str, value: Any) -> None:
    if value is not None and not callable(value):
        raise InvalidArgumentError(argument, f"must be callable or None, got {value!r}")


def instance(argument: str, value: Any, kind: type, *, none: bool = True) -> None:
    if (value is None and none) or isinstance(value, kind):
        return
    raise InvalidArgumentError(argument, f"must be a {kind.__name__}{' or None' if none else ''}, got {value!r}")


# ---------------------------------------------------------------------- Engine.open


def _executor(value: Any) -> None:
    if isinstance(value, str) and not re.fullmatch(r"cpu|cuda(:\d+)?", value):
        raise InvalidArgumentError("executor", f"must be 'cpu', 'cuda', 'cuda:N' or an executor, got {value!r}")


def _bandwidth(value: Any) -> None:
    if value is None or value in ("measure", "remeasure"):
        return
    if isinstance(value, str):
        raise InvalidArgumentError("bandwidth", f"must be a number, 'measure' or 'remeasure', got {value!r}")
    real("bandwidth", value, lo=0.0, lo_open=True)


def _ranks(value: Any) -> None:
    if value is not None and (isinstance(value, (str, bytes, Mapping)) or not isinstance(value, Sequence)):
        raise InvalidArgumentError("ranks", f"must be a sequence of rank executors or None, got {value!r}")


def _compaction(value: Any) -> None:
    if value is not None and not isinstance(value, (bool, CompactionPolicy)):
        raise InvalidArgumentError("compaction", f"must be True, False, None or a CompactionPolicy, got {value!r}")


OPEN_CHECKS: dict[str, Callable[[Any], Any]] = {
    "capacity_bytes": lambda v: integer("capacity_bytes", v, minimum=1),
    "synchronous": lambda v: choice("synchronous", v, ("FULL", "NORMAL"), fold=True),
    "policy": lambda v: choice("policy", v, POLICIES),
    "cost": lambda v: instance("cost", v, CostModel),
    "high_watermark": lambda v: real("high_watermark", v, lo=0.0, hi=1.0, lo_open=True),
    "low_watermark": lambda v: real("low_watermark", v, lo=0.0, hi=1.0, lo_open=True),
    "create": lambda v: flag("create", v),
    "ranks": _ranks,
    "admission": lambda v: callable_or_none("admission", v),
    "inflight_wait_s": lambda v: real("inflight_wait_s", v, lo=0.0),
    "compaction": _compaction,
    "backing": lambda v: choice("backing", v, BACKINGS),
    "ram_bytes": lambda v: integer("ram_bytes", v, minimum=1, none=True),
    "executor": _executor,
    "bandwidth": _bandwidth,
    "read_only_fallback": lambda v: flag("read_only_fallback", v),
}


def open_args(cls: type, path: Any, layout: Any, capacity_bytes: Any, opts: Mapping[str, Any]) -> str:
    """Check ``Engine.open``'s arguments (options not in the table are only checked to
    be known to ``cls``); returns ``path`` as a str."""
    try:
        root = os.fspath(path)
    except TypeError:
        root = None
    if not isinstance(root, str) or not root:
        raise InvalidArgumentError("path", f"must be a non-empty str or os.PathLike, got {path!r}")
    instance("layout", layout, Layout, none=False)
    known = set(inspect.signature(cls.__init__).parameters) - {"self", "root", "layout", "capacity_bytes"}
    for name in opts:
        if name not in known:
            raise InvalidArgumentError(name, f"unknown option; known: {', '.join(sorted(known))}")
    OPEN_CHECKS["capacity_bytes"](capacity_bytes)
    for name, value in opts.items():
        if name in OPEN_CHECKS:
            OPEN_CHECKS[name](value)
    low, high = opts.get("low_watermark", 1.0), opts.get("high_watermark", 1.0)
    if low > high:
        raise InvalidArgumentError("low_watermark", f"must be <= high_watermark ({high}), got {low}")
    return root


# ---------------------------------------------------------------------- methods


def prefix(eng: Engine, value: Any, argument: str = "prefix") -> Prefix:
    """A Prefix whose block size (when it records one) is the layout's."""
    if not isinstance(value, Prefix):
        raise InvalidArgumentError(argument, f"must be a Prefix, got {type(value).__name__}")
    bt = eng.layout.block_tokens
    if value.block_tokens is not None and value.block_tokens != bt:
        raise BlockSizeMismatchError(
            argument, f"built with block_tokens={value.block_tokens}, but this cache's layout has {bt}"
        )
    return value


def match(eng: Engine, value: Any, argument: str = "match") -> Match:
    """A Match returned by this engine's ``lookup`` (not another engine's, nor a copy
    made by hand: its ``cache`` is this engine's identity)."""
    if not isinstance(value, Match):
        raise InvalidArgumentError(argument, f"must be a Match from lookup(), got {type(value).__name__}")
    if value.cache != eng.identity:
        raise ForeignMatchError(argument, f"comes from another engine or cache, not the one open at {eng.root}")
    return value


def compact_policy(value: Any) -> None:
    instance("policy", value, CompactionPolicy)


def evict_args(eng: Engine, nbytes: Any, prefix_: Any) -> tuple[int | None, Prefix | None]:
    if nbytes is not None and prefix_ is not None:
        raise InvalidArgumentError("nbytes", "give nbytes or prefix, not both")
    return integer("nbytes", nbytes, none=True), None if prefix_ is None else prefix(eng, prefix_)


def lookup_args(eng: Engine, value: Any, gpu_blocks: Any, total_tokens: Any) -> None:
    p = prefix(eng, value)
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


def store_args(eng: Engine, value: Any, segments: Any, snapshot: Any, tokens_from: Any, valid: Any):
    """``store`` / ``store_async``: returns the per-rank (segments, snapshot or None)."""
    L = eng.layout
    p = prefix(eng, value)
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
