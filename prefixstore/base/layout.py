"""What one checkpoint holds per rank: tensor names, dtypes and shapes.

A *segment* tensor has a token axis first: a node covering tokens ``(start, end]``
stores ``(end - start, *shape)``. A *snapshot* tensor has a fixed ``shape``: the
recurrent state at the node's end position. Shapes are per rank (what one
tensor-parallel rank holds).
"""

from __future__ import annotations

import functools
import json
import math
from collections.abc import Mapping, Sequence
from typing import Any

import attrs
import torch

from prefixstore.base.errors import (
    DtypeError,
    LayoutError,
    RankError,
    ShapeError,
    UnalignedError,
)

DTYPES: dict[str, torch.dtype] = {
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float32": torch.float32,
    "float64": torch.float64,
    "int8": torch.int8,
    "uint8": torch.uint8,
    "int16": torch.int16,
    "int32": torch.int32,
    "int64": torch.int64,
    "bool": torch.bool,
    "float8_e4m3fn": torch.float8_e4m3fn,
    "float8_e5m2": torch.float8_e5m2,
}
DTYPE_NAMES: dict[torch.dtype, str] = {v: k for k, v in DTYPES.items()}
_ITEMSIZE: dict[str, int] = {k: torch.empty((), dtype=v).element_size() for k, v in DTYPES.items()}

RankTensors = Mapping[str, torch.Tensor]


def dtype_name(dtype: torch.dtype | str) -> str:
    """The layout's name for a torch dtype (``torch.bfloat16`` -> ``"bfloat16"``)."""
    if isinstance(dtype, str):
        name = dtype.removeprefix("torch.")
        if name not in DTYPES:
            raise LayoutError(f"unknown dtype {dtype!r}; known: {sorted(DTYPES)}")
        return name
    if dtype not in DTYPE_NAMES:
        raise LayoutError(f"unsupported dtype {dtype}")
    return DTYPE_NAMES[dtype]


def _shape(value: Any) -> tuple[int, ...]:
    return tuple(int(v) for v in value)


@attrs.frozen
class TensorSpec:
    """One named tensor: its dtype and its per-rank shape (per token for segments)."""

    name: str
    dtype: str = attrs.field(converter=dtype_name)
    shape: tuple[int, ...] = attrs.field(converter=_shape)

    def __attrs_post_init__(self) -> None:
        if not self.name or not self.name.replace("_", "").replace(".", "").isalnum():
            raise LayoutError(f"tensor name {self.name!r} must be non-empty [A-Za-z0-9_.]")
        if any(d <= 0 for d in self.shape):
            raise LayoutError(f"tensor {self.name!r} has a non-positive dimension {self.shape}")

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    @property
    def itemsize(self) -> int:
        return _ITEMSIZE[self.dtype]  # a dict lookup: sizes are computed on the request path

    @property
    def nbytes(self) -> int:
        """Bytes of one row (segments) or of the whole tensor (snapshots)."""
        return math.prod(self.shape) * self.itemsize


@attrs.frozen
class Layout:
    """What a checkpoint holds on each rank, its block size and the number of ranks."""

    segments: tuple[TensorSpec, ...] = attrs.field(converter=tuple)
    block_tokens: int
    snapshots: tuple[TensorSpec, ...] = attrs.field(converter=tuple, default=())
    ranks: int = 1

    def __attrs_post_init__(self) -> None:
        if self.block_tokens <= 0:
            raise LayoutError(f"block_tokens must be positive, got {self.block_tokens}")
        if self.ranks <= 0:
            raise LayoutError(f"ranks must be positive, got {self.ranks}")
        if not self.segments:
            raise LayoutError("a layout needs at least one segment tensor")
        names = [s.name for s in (*self.segments, *self.snapshots)]
        if len(set(names)) != len(names):
            raise LayoutError(f"tensor names must be unique, got {names}")

    # -- sizes ------------------------------------------------------------------

    # Cached: read on the request path (lookup sizes every candidate); a Layout is frozen.
    @functools.cached_property
    def has_snapshot(self) -> bool:
        return bool(self.snapshots)

    @functools.cached_property
    def token_bytes(self) -> int:
        """Segment bytes per token on one rank."""
        return sum(s.nbytes for s in self.segments)

    @functools.cached_property
    def snapshot_bytes(self) -> int:
        """Snapshot bytes on one rank."""
        return sum(s.nbytes for s in self.snapshots)

    def payload_bytes(self, tokens: int, with_snapshot: bool) -> int:
        """Tensor bytes of one rank's shard for a span of ``tokens`` tokens."""
        return tokens * self.token_bytes + (self.snapshot_bytes if with_snapshot else 0)

    # -- validation ---------------------------------------------------------------

    def check_blocks(self, tokens: int) -> int:
        """Number of blocks in ``tokens``, raising UnalignedError if not a multiple."""
        if tokens < 0 or tokens % self.block_tokens:
            raise UnalignedError(
                f"{tokens} tokens is not a multiple of block_tokens={self.block_tokens}"
            )
        return tokens // self.block_tokens

    def per_rank(self, tensors: RankTensors | Sequence[RankTensors] | None) -> list[RankTensors]:
        """Normalise ``tensors`` to one mapping per rank (a bare mapping means one rank)."""
        if tensors is None:
            return [{} for _ in range(self.ranks)]
        if isinstance(tensors, Mapping):
            tensors = [tensors]
        tensors = list(tensors)
        if len(tensors) != self.ranks:
            raise RankError(f"got tensors for {len(tensors)} ranks, layout has {self.ranks}")
        return tensors

    def check_segments(self, rank: int, tensors: RankTensors, tokens: int) -> None:
        """Raise unless ``tensors`` holds exactly the layout's segments with ``tokens`` rows."""
        self._check(rank, tensors, self.segments, lambda s: (tokens, *s.shape), "segment")

    def check_snapshot(self, rank: int, tensors: RankTensors) -> None:
        """Raise unless ``tensors`` holds exactly the layout's snapshot tensors."""
        self._check(rank, tensors, self.snapshots, lambda s: s.shape, "snapshot")

    def _check(self, rank, tensors, specs, shape_of, what) -> None:
        want = {s.name for s in specs}
        got = set(tensors)
        if got != want:
            raise ShapeError(
                f"rank {rank}: {what} tensors {sorted(got)} do not match layout {sorted(want)}"
            )
        for spec in specs:
            t = tensors[spec.name]
            if not isinstance(t, torch.Tensor):
                raise ShapeError(f"rank {rank}: {what} {spec.name!r} is not a tensor")
            if t.dtype != spec.torch_dtype:
                raise DtypeError(
                    f"rank {rank}: {what} {spec.name!r} has dtype {t.dtype}, layout says {spec.dtype}"
                )
            if tuple(t.shape) != tuple(shape_of(spec)):
                raise ShapeError(
                    f"rank {rank}: {what} {spec.name!r} has shape {tuple(t.shape)}, "
                    f"expected {tuple(shape_of(spec))}"
                )

    # -- persistence ----------------------------------------------------------------

    def to_json(self) -> str:
        return json.dumps(attrs.asdict(self), sort_keys=True)

    def differences(self, other: Layout) -> list[str]:
        """What differs from ``other``, one short phrase per field: ``ranks 2 vs 4``,
        ``segment k dtype bfloat16 vs float16``, ``snapshot state missing``..."""
        out = [f"{f} {getattr(self, f)} vs {getattr(other, f)}"
               for f in ("ranks", "block_tokens") if getattr(self, f) != getattr(other, f)]
        for kind, mine, theirs in (("segment", self.segments, other.segments),
                                   ("snapshot", self.snapshots, other.snapshots)):
            a, b = {s.name: s for s in mine}, {s.name: s for s in theirs}
            for name in [*a, *(n for n in b if n not in a)]:
                if name not in b:
                    out.append(f"{kind} {name} only in the first")
                elif name not in a:
                    out.append(f"{kind} {name} only in the second")
                else:
                    out += [f"{kind} {name} {f} {getattr(a[name], f)} vs {getattr(b[name], f)}"
                            for f in ("dtype", "shape") if getattr(a[name], f) != getattr(b[name], f)]
            if not out and [s.name for s in mine] != [s.name for s in theirs]:
                out.append(f"{kind} order {[s.name for s in mine]} vs {[s.name for s in theirs]}")
        return out

    @classmethod
    def from_json(cls, text: str) -> Layout:
        try:
            d = json.loads(text)
            return cls(
                segments=[TensorSpec(**s) for s in d["segments"]],
                snapshots=[TensorSpec(**s) for s in d.get("snapshots", [])],
                block_tokens=int(d["block_tokens"]),
                ranks=int(d.get("ranks", 1)),
            )
        except (KeyError, TypeError, ValueError, json.JSONDecodeError) as exc:
            raise LayoutError(f"cannot parse layout: {exc}") from exc
