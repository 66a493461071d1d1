"""Where an SGLang host pool's pages sit in memory, so that a restore writes them there.

A host pool's ``get_data_page(index, flat=False)`` is, for SGLang's MHA and MLA pools,
a strided view of the pool's buffer whose C-order elements are the flat page the
adapter stores (``get_data_page(index)`` is that view flattened). ``PageSlots`` checks
this once per pool (``in_place``); then pages that lie end to end in flat order get
one contiguous tensor over all of them (``run``: a restore reads the shards straight
into it), and any other page one memcpy into its memory (``put``).

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


def copy_into(dst: torch.Tensor, src: torch.Tensor) -> None:
    """``dst`` := the bytes of ``src`` (as many): numpy's memcpy for host tensors with
    ``dst`` contiguous, torch's copy otherwise (a device tensor)."""
    if dst.device.type == src.device.type == "cpu" and dst.is_contiguous():
        np.copyto(dst.view(-1).view(torch.uint8).numpy(), src.contiguous().view(-1).view(torch.uint8).numpy())
    else:
        dst.copy_(src.reshape(dst.shape))


class PageSlots:
    """The memory of one host pool's pages, and a staging buffer reused across calls."""

    def __init__(self, host: Any, page_bytes: int, host_outputs: bool) -> None:
        self.host, self.page_bytes = host, page_bytes
        self.in_place = host_outputs and views_pool_memory(host, page_bytes)
        """Pages are written where they sit (else through ``set_from_flat_data_page``)."""
        self._staging: torch.Tensor | None = None
        self._staging_lock = threading.Lock()

    def run(self, indices: Sequence[int]) -> torch.Tensor | None:
        """One contiguous uint8 tensor over the pages at ``indices`` when they lie end to
        end in memory in that order (each page contiguous, each next one right after,
        all inside the first page's storage), else None."""
        if not self.in_place or not indices:
            return None
        view, pb = self.host.get_data_page, self.page_bytes
        first = view(indices[0], flat=False)
        if not first.is_contiguous():
            return None
        start = first.data_ptr()
        for k in range(1, len(indices)):
            v = view(indices[k], flat=False)
            if v.data_ptr() != start + k * pb or not v.is_contiguous():
                return None
        storage = first.untyped_storage()
        offset, n = start - storage.data_ptr(), len(indices) * pb
        if offset + n > storage.nbytes():
            return None
        return torch.empty(0, dtype=torch.uint8).set_(storage, offset, (n,))

    def put(self, index: int, data: torch.Tensor, dtype: torch.dtype) -> None:
        """Page ``index`` := ``data`` (its flat bytes): one numpy memcpy into the page's
        memory when it is written in place, else ``set_from_flat_data_page``."""
        v = _view(self.host, index) if self.in_place and data.device.type == "cpu" else None
        if v is None:
            self.host.set_from_flat_data_page(index, data.contiguous().view(dtype))
            return
        dst = v.view(torch.uint8).numpy()
        np.copyto(dst, data.contiguous().view(torch.uint8).numpy().reshape(dst.shape))

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
