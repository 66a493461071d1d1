"""Checks of what SGLang (or anyone) hands the HiCache backend, before anything is stored.

Each check raises ``InvalidInputError`` naming the argument (``keys``, ``values[1]``,
``host_indices``, ``target_locations[0]``, ``extra_info.prefix_keys``, ...); a call
that passes them all is well formed, so a failure after them is the engine's answer
(a miss or a refusal), never a half-done call.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from prefixstore.base.errors import InvalidInputError


def page_keys(keys: Any, name: str = "keys") -> list[str]:
    """``keys`` as a list of page hashes: a list or tuple of non-empty strings, none twice."""
    if isinstance(keys, (str, bytes)) or not isinstance(keys, (list, tuple)):
        raise InvalidInputError(f"{name}: need a list of page hash strings, got {type(keys).__name__}")
    for i, k in enumerate(keys):
        if not isinstance(k, str) or not k:
            raise InvalidInputError(f"{name}[{i}]: page hashes must be non-empty strings, got {k!r:.60}")
    if len(set(keys)) != len(keys):
        raise InvalidInputError(f"{name}: a page hash appears twice in one chain")
    return list(keys)


def page_key(key: Any, name: str = "key") -> str:
    """One page hash."""
    if not isinstance(key, str) or not key:
        raise InvalidInputError(f"{name}: a page hash must be a non-empty string, got {key!r:.60}")
    return key


def prefix_keys(extra_info: Any, keys: Sequence[str]) -> list[str] | None:
    """``extra_info.prefix_keys`` (None when SGLang passes no prefix context)."""
    if extra_info is None:
        return None
    if not hasattr(extra_info, "prefix_keys"):
        raise InvalidInputError(
            f"extra_info: need a HiCacheStorageExtraInfo or None, got {type(extra_info).__name__}")
    before = extra_info.prefix_keys
    if before is None:
        return None
    before = page_keys(before, "extra_info.prefix_keys")
    if not set(before).isdisjoint(keys):
        raise InvalidInputError("extra_info.prefix_keys: a page hash appears in both prefix_keys and keys")
    return before


def host_indices(indices: Any, n_pages: int, page_size: int, capacity: int | None, pool: str) -> list[int]:
    """The first host slot of each of ``n_pages`` pages: ``n_pages * page_size`` integer
    indices, each page's whole run of slots inside the host pool."""
    name = "host_indices"
    if not isinstance(indices, torch.Tensor):
        raise InvalidInputError(f"{name}: need an integer tensor, got {type(indices).__name__}")
    if indices.is_floating_point() or indices.is_complex() or indices.dtype == torch.bool:
        raise InvalidInputError(f"{name}: need an integer tensor, got dtype {indices.dtype}")
    if indices.numel() != n_pages * page_size:
        raise InvalidInputError(
            f"{name}: pool {pool!r} needs {n_pages * page_size} indices for {n_pages} pages "
            f"of {page_size} slots, got {indices.numel()}")
    flat = indices.reshape(-1).to(torch.int64)
    if capacity is not None and flat.numel():
        lo, hi = int(flat.min()), int(flat.max())
        starts = flat[::page_size]
        if lo < 0 or hi >= capacity or int(starts.max()) + page_size > capacity:
            raise InvalidInputError(
                f"{name}: pool {pool!r} has slots 0..{capacity - 1}, got indices {lo}..{hi}")
    return [int(flat[i * page_size]) for i in range(n_pages)]


def page_value(value: Any, dtype: torch.dtype, numel: int, name: str) -> torch.Tensor:
    """One page's data (or a target for it): a tensor of the pool's dtype holding exactly one page."""
    if not isinstance(value, torch.Tensor):
        raise InvalidInputError(f"{name}: need a tensor of one page, got {type(value).__name__}")
    if value.dtype != dtype:
        raise InvalidInputError(f"{name}: the pool's pages are {dtype}, got {value.dtype}")
    if value.numel() != numel:
        raise InvalidInputError(f"{name}: one page is {numel} elements, got {value.numel()}")
    return value


def page_values(values: Any, n: int, dtype: torch.dtype, numel: int, name: str,
                optional: bool = False) -> list[torch.Tensor | None]:
    """One page tensor per key (``optional``: a None entry, or None for the whole list, is allowed)."""
    if values is None and optional:
        return [None] * n
    if isinstance(values, torch.Tensor) or not isinstance(values, (list, tuple)):
        raise InvalidInputError(f"{name}: need a list of one page tensor per key, got {type(values).__name__}")
    if len(values) != n:
        raise InvalidInputError(f"{name}: need one page per key ({n}), got {len(values)}")
    return [None if (v is None and optional) else page_value(v, dtype, numel, f"{name}[{i}]")
            for i, v in enumerate(values)]


def transfers(value: Any, name: str) -> list[Any]:
    """A list of ``PoolTransfer``-like objects (name, keys, host_indices, hit_policy)."""
    if value is None:
        return []
    if not isinstance(value, (list, tuple)):
        raise InvalidInputError(f"{name}: need a list of PoolTransfer, got {type(value).__name__}")
    for i, t in enumerate(value):
        if not all(hasattr(t, a) for a in ("name", "keys", "host_indices", "hit_policy")):
            raise InvalidInputError(f"{name}[{i}]: need a PoolTransfer, got {type(t).__name__}")
    return list(value)


def host_pool(host: Any, name: str) -> Any:
    """A host pool: what the backend calls on it."""
    missing = [a for a in ("get_data_page", "get_dummy_flat_data_page", "set_from_flat_data_page")
               if not callable(getattr(host, a, None))]
    if missing:
        raise InvalidInputError(f"{name}: need a host pool ({', '.join(missing)} missing), got {type(host).__name__}")
    return host
