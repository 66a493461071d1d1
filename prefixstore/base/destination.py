"""Where a restore writes a segment whose rows are not one tensor: ``Pieces``."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import attrs
import numpy as np
import torch

from prefixstore.base.errors import InvalidArgumentError


def _spans(value: Any) -> np.ndarray:
    """``value`` as a read-only ``(n, 2)`` int64 array of (offset, count) (a copy: later
    changes to the caller's sequence do not reach a checked ``Pieces``)."""
    if isinstance(value, torch.Tensor):
        value = value.detach().cpu().numpy()
    try:
        a = np.array(value, copy=True)
    except (TypeError, ValueError) as exc:
        raise InvalidArgumentError("into", f"Pieces spans must be (offset, count) integer pairs: {exc}") from None
    if a.size == 0:
        a = a.reshape(0, 2).astype(np.int64)
    if a.dtype.kind not in "iu" or a.ndim != 2 or a.shape[1] != 2:
        raise InvalidArgumentError("into", f"Pieces spans must be (offset, count) integer pairs, "
                                           f"got {a.dtype} of shape {a.shape}")
    if a.dtype.kind == "u" and a.size and int(a.max()) > np.iinfo(np.int64).max:
        raise InvalidArgumentError("into", "Pieces spans: an offset or count beyond int64")
    a = a.astype(np.int64)
    a.setflags(write=False)
    return a


@attrs.frozen(eq=False)
class Pieces:
    """A segment's destination in ``Engine.restore(into=...)`` given as pieces of one
    tensor's memory instead of a tensor of its own: the segment's rows (``rows x
    *shape`` in C order, the bytes its shard stores) fill ``spans`` one after the other,
    each span ``(offset, count)`` being ``count`` elements of ``memory`` (flattened) from
    element ``offset`` on.

    ``memory`` is a contiguous strided tensor of the segment's dtype on the executor's
    device (a view of a larger buffer is fine); the spans hold exactly the rows'
    elements, lie inside ``memory``, and overlap neither each other nor any other
    destination of the call: ``Engine.restore`` refuses anything else with a typed error
    before a byte is read. For memory that cannot be one tensor, such as SGLang's MHA
    host pool, whose page is K and V in separate halves of its buffer (2 x layers pieces
    in the ``layer_first`` layout): the shards are read straight into the spans."""

    memory: torch.Tensor
    spans: np.ndarray = attrs.field(converter=_spans)

    @classmethod
    def of(cls, views: Sequence[torch.Tensor]) -> Pieces:
        """The pieces that are ``views`` (contiguous tensors of one dtype, in one
        storage), in that order."""
        if not views:
            raise InvalidArgumentError("into", "Pieces.of needs at least one view")
        first = views[0]
        if not all(isinstance(v, torch.Tensor) for v in views):
            raise InvalidArgumentError("into", "Pieces.of takes tensors")
        storage = first.untyped_storage()
        es = first.element_size()
        memory = torch.empty(0, dtype=first.dtype, device=first.device).set_(
            storage, 0, (storage.nbytes() // es,))
        spans = []
        for k, v in enumerate(views):
            if v.dtype != first.dtype or v.untyped_storage().data_ptr() != storage.data_ptr() or not v.is_contiguous():
                raise InvalidArgumentError("into", f"Pieces.of: view {k} is not a contiguous {first.dtype} view "
                                                   "of the first view's storage")
            off = v.data_ptr() - storage.data_ptr()
            if off % es:
                raise InvalidArgumentError("into", f"Pieces.of: view {k} is not aligned to its elements")
            spans.append((off // es, v.numel()))
        return cls(memory, spans)

    @property
    def count(self) -> int:
        """The elements the spans hold."""
        return int(self.spans[:, 1].sum())
