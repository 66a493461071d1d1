"""Where an SGLang host pool's pages sit in memory, so that a restore writes them there.

A host pool's ``get_data_page(index, flat=False)`` is, for SGLang's MHA and MLA pools,
a strided view of the pool's buffer whose C-order elements are the flat page the
adapter stores (``get_data_page(index)`` is that view flattened). ``PageSlots`` checks
this once per pool (``in_place``) and then gives, per page, a writable uint8 view of
its memory (``page``) and, for pages that lie end to end in flat order, one contiguous
tensor over all of them (``run``: a restore reads the shards straight into it).

Pools whose pages are not views (a Mamba pool concatenates its state tensors into a
new tensor) are written through ``set_from_flat_data_page`` as before. Every copy here
is numpy's single-threaded memcpy, never torch's intra-op thread pool.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import numpy as np
import torch

STAGING_MAX_BYTES = 256 << 20
"""The largest staging buffer a pool keeps between calls (larger restores allocate)."""


def _view(host: Any, index: int) -> torch.Tensor | None:
    """Page ``index`` as a view that can be reinterpreted as bytes, or None."""
    v = host.get_data_page(index, flat=False)
    if not isinstance(v, torch.Tensor) or v.device.type != "cpu" or v.dim() == 0 or v.stride(-1) != 1:
        return None
    return v


def views_pool_memory(host: Any, page_bytes: int) -> bool:
    """Whether ``host``'s pages are views of its own memory in flat-page order: two
    views of one page alive at once share their first byte (a page built anew per call,
    such as a concatenation, does not), span ``page_bytes`` and flatten to the flat page."""
    try:
        a, b = _view(host, 0), _view(host, 0)
        if a is None or b is None or a._base is None or a.data_ptr() != b.data_ptr():
            return False
        if a.untyped_storage().data_ptr() != b.untyped_storage().data_ptr():
            return False
        if a.numel() * a.element_size() != page_bytes:
            return False
        flat = host.get_data_page(0, flat=True)
        return bool(torch.equal(a.reshape(-1).view(torch.uint8), flat.reshape(-1).view(torch.uint8)))
    except Exception:  # noqa: BLE001 - any pool that cannot answer is written the generic way
        return False


class PageSlots:
    """The memory of one host pool's pages, and a staging buffer reused across calls."""

    def __init__(self, host: Any, page_bytes: int, host_outputs: bool) -> None:
        self.host, self.page_bytes = host, page_bytes
        self.in_place = host_outputs and views_pool_memory(host, page_bytes)
        """Pages are written where they sit (else through ``set_from_flat_data_page``)."""
        self._staging: torch.Tensor | None = None
        self._staging_lock = threading.Lock()

    def page(self, index: int) -> np.ndarray:
        """A writable byte view of page ``index``'s memory (C order: the flat page)."""
        v = _view(self.host, index)
        assert v is not None and self.in_place
        return v.view(torch.uint8).numpy()

    def run(self, indices: Sequence[int]) -> torch.Tensor | None:
        """One contiguous uint8 tensor over the pages at ``indices`` when they lie end to
        end in memory in that order (each page contiguous, each next one right after),
        else None."""
        if not self.in_place or not indices:
            return None
        first = _view(self.host, indices[0])
        if first is None or not first.is_contiguous():
            return None
        storage = first.untyped_storage()
        start = first.data_ptr()
        for k, index in enumerate(indices[1:], 1):
            v = _view(self.host, index)
            if (v is None or not v.is_contiguous() or v.data_ptr() != start + k * self.page_bytes
                    or v.untyped_storage().data_ptr() != storage.data_ptr()):
                return None
        offset = start - storage.data_ptr()
        n = len(indices) * self.page_bytes
        if offset + n > storage.nbytes():
            return None
        return torch.empty(0, dtype=torch.uint8).set_(storage, offset, (n,))

    def put(self, index: int, data: torch.Tensor, dtype: torch.dtype) -> None:
        """Page ``index`` := ``data`` (its flat bytes, a host tensor when ``in_place``)."""
        if self.in_place and data.device.type == "cpu":
            dst = self.page(index)
            np.copyto(dst, data.contiguous().view(torch.uint8).numpy().reshape(dst.shape))
        else:
            self.host.set_from_flat_data_page(index, data.contiguous().view(dtype))

    @contextmanager
    def staging(self, nbytes: int) -> Iterator[torch.Tensor | None]:
        """This pool's staging buffer, at least ``nbytes`` long, for the block; None when
        another call holds it, when ``nbytes`` is over ``STAGING_MAX_BYTES`` or when pages
        are not written in place (then the restore allocates its own)."""
        if not self.in_place or nbytes > STAGING_MAX_BYTES or not self._staging_lock.acquire(blocking=False):
            yield None
            return
        try:
            if self._staging is None or self._staging.numel() < nbytes:
                self._staging = None
                self._staging = torch.empty(nbytes, dtype=torch.uint8)
            yield self._staging[:nbytes]
        finally:
            self._staging_lock.release()
