"""Moved to ``prefixstore.base.layout``; this re-export goes when every import names the new path."""

from prefixstore.base.layout import (
    DTYPE_NAMES,
    DTYPES,
    Layout,
    RankTensors,
    TensorSpec,
    dtype_name,
)

__all__ = [
    "DTYPES",
    "DTYPE_NAMES",
    "Layout",
    "RankTensors",
    "TensorSpec",
    "dtype_name",
]
