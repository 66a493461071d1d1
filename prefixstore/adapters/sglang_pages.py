"""Where an SGLang host pool's pages sit in memory, so that a restore writes them there.

A host pool's ``get_data_page(index, flat=False)`` is, for SGLang's MHA and MLA pools,
a strided view of the pool's buffer whose C-order elements are the flat page the
adapter stores (``get_data_page(index)`` is that view flattened). ``PageSlots`` checks
this once per pool (``in_place``); then a restore reads the shards straight into the
pages' memory (``destination``): one contiguous tensor over them when they lie end to
end in flat order, else the pieces of memory each page is in (``page_pieces``: for
SGLang's MHA pools, K and V in separate halves of the buffer, 2 x layers pieces per page
``layer_first``, 2 ``page_first``), as ``Pieces``. A page whose pieces cannot be proved
to be its flat bytes is written after the restore, one memcpy into its memory (``put``).

Pools whose pages are not views (a Mamba pool concatenates its state tensors into a
new tensor) are written through ``set_from_flat_data_page`` as before. Every copy here
is numpy's single-threaded memcpy, never torch's intra-op thread pool.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import numpy as np
import torch

from prefixstore.base.destination import Pieces

STAGING_MAX_BYTES = 256 << 20
"""The largest staging buffer a pool keeps between calls (larger restores allocate)."""

MAX_PAGE_PIECES = 4096
"""The most pieces of memory one page may be in to be restored in place (more: staged)."""

MIN_PIECE_BYTES = 8 << 10
"""The smallest average piece (after merging neighbours) a restore is read in place
into: each piece costs a buffer of a ``preadv`` and a hash update, and below this the
staged read and its memcpy per page were measured faster (``bench/sglang_in_place.py``
over a real ``layer_first`` pool: 1 and 2 KiB pieces about 2x slower in place, 4 KiB
slower, 8 KiB even, 64 KiB 25% faster)."""


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


def page_pieces(v: torch.Tensor, page_bytes: int, max_pieces: int | None = None) -> tuple[int, np.ndarray] | None:
    """The pieces of memory that are the C-order bytes of the page view ``v``: (bytes per
    piece, each piece's first byte from ``v``'s first byte, in C order). Its trailing
    dims that lie end to end make one piece (``inner``), its leading dims index the
    pieces. None unless the pieces are at most ``max_pieces`` (``MAX_PAGE_PIECES``),
    hold exactly ``page_bytes`` and share no byte."""
    if v.dim() == 0:
        return None
    max_pieces = MAX_PAGE_PIECES if max_pieces is None else max_pieces
    es, k, inner = v.element_size(), v.dim(), 1
    while k > 0 and (v.shape[k - 1] == 1 or v.stride(k - 1) == inner):
        inner *= v.shape[k - 1]
        k -= 1
    outer, strides = tuple(v.shape[:k]), v.stride()[:k]
    count = math.prod(outer)
    if inner == 0 or count > max_pieces or count * inner * es != page_bytes:
        return None
    rel = np.zeros(1, dtype=np.int64)
    for n, st in zip(outer, strides, strict=True):  # C order: the last leading dim varies fastest
        rel = np.add.outer(rel, np.arange(n, dtype=np.int64) * (st * es)).ravel()
    ordered = np.sort(rel)
    if len(ordered) > 1 and int(np.diff(ordered).min()) < inner * es:
        return None
    rel.setflags(write=False)
    return inner * es, rel


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
        self._patterns: dict[tuple, tuple[int, np.ndarray] | None] = {}

    def destination(self, indices: Sequence[int]) -> torch.Tensor | Pieces | None:
        """Where a restore writes the flat pages at ``indices``, in that order, in the
        pool's own memory: one contiguous uint8 tensor when they lie end to end, else
        ``Pieces`` (the pages' pieces, those that lie end to end merged); None when that
        cannot be proved (``page_pieces``: a page's view is not a strided CPU view of the
        pool's storage whose pieces hold exactly ``page_bytes``, or two pages share a
        byte) or when the pieces average under ``MIN_PIECE_BYTES``: then the restore is
        staged."""
        if not self.in_place or not indices:
            return None
        first = _view(self.host, indices[0])
        if first is None:
            return None
        storage = first.untyped_storage()
        base, size = storage.data_ptr(), storage.nbytes()
        firsts, piece, rel = [], 0, None
        for i in indices:
            v = first if not firsts else _view(self.host, i)
            if v is None or v.untyped_storage().data_ptr() != base:
                return None
            got = self._pieces_of(v)
            if got is None or (rel is not None and (got[0] != piece or got[1] is not rel)):
                return None
            piece, rel = got
            firsts.append(v.data_ptr() - base)
        assert rel is not None
        starts = np.add.outer(np.array(firsts, dtype=np.int64), rel).ravel()  # in flat order
        if int(starts.min()) < 0 or int(starts.max()) + piece > size:
            return None
        ordered = np.sort(starts)
        if len(ordered) > 1 and int(np.diff(ordered).min()) < piece:  # pages sharing bytes
            return None
        cut = np.flatnonzero(starts[1:] != starts[:-1] + piece) + 1  # where a piece does not follow the last
        if not len(cut):
            return torch.empty(0, dtype=torch.uint8).set_(storage, int(starts[0]), (len(starts) * piece,))
        if len(starts) * piece < MIN_PIECE_BYTES * (len(cut) + 1):  # pieces too small to pay for themselves
            return None
        bounds = np.concatenate([[0], cut, [len(starts)]])
        spans = np.stack([starts[bounds[:-1]], np.diff(bounds) * piece], axis=1)
        memory = torch.empty(0, dtype=torch.uint8).set_(storage, 0, (size,))
        return Pieces(memory, spans)

    def _pieces_of(self, v: torch.Tensor) -> tuple[int, np.ndarray] | None:
        """``page_pieces`` of a page view, cached per (shape, strides): the pool's pages
        share one pattern."""
        key = (tuple(v.shape), v.stride(), v.element_size())
        got = self._patterns.get(key)
        if got is None and key not in self._patterns:
            got = self._patterns[key] = page_pieces(v, self.page_bytes)
        return got

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
