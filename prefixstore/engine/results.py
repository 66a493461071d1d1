"""The paired request/result objects of the public API."""

from __future__ import annotations

from typing import Any

import attrs
import torch

STORED = "stored"
REFILLED = "refilled"
DUPLICATE = "duplicate"
QUEUED = "queued"
REFUSED = "refused"
FAILED = "failed"
SKIPPED = "skipped"


@attrs.frozen
class StoreResult:
    """What a store did. ``status`` is one of stored, refilled, duplicate, queued,
    refused, failed, skipped; ``reason`` explains skips, refusals and failures."""

    status: str
    blocks: int
    reason: str | None = None
    nbytes: int = 0

    @property
    def ok(self) -> bool:
        """True when the checkpoint is (now or already) durably stored."""
        return self.status in (STORED, REFILLED, DUPLICATE)


@attrs.define(slots=True, eq=False, repr=False)
class MatchFields:
    """The fields of a ``Match``, in a plain slotted class: its ``__init__`` stores each
    field directly, without the per-field ``object.__setattr__`` call of a frozen class.
    ``new_match`` builds one and turns it into a ``Match``; nothing else uses it."""

    outcome: str
    prefix_blocks: int
    block_tokens: int
    gpu_blocks: int = 0
    blocks: int = 0
    node_id: int | None = None
    path: tuple[tuple[int, int], ...] = ()
    nbytes: int = 0
    transfer_s: float | None = None
    prefill_s: float | None = None
    cache: str | None = None
    node_key: bytes | None = None
    source: str = "local"
    remote: Any = attrs.field(default=None, repr=False)


@attrs.frozen
class Match(MatchFields):
    """The result of a lookup: the deepest checkpoint worth restoring, if any.

    ``outcome`` is one of: hit, gpu_resident, miss, rejected_cost, damaged.
    ``path`` holds ``(node_id, generation)`` root-first for the nodes to read, and
    ``node_key`` the key of the last one. ``cache`` identifies the engine that made it
    (an engine refuses another's Match with ``ForeignMatchError``). ``source`` says
    which tier answers: 'local', or 'remote' (then ``remote`` holds what to fetch and
    ``path`` is empty: nothing local is read, pinned or held).
    """

    @property
    def hit(self) -> bool:
        return self.outcome == "hit"

    @property
    def tokens(self) -> int:
        """Tokens covered by the checkpoint (0 when there is none)."""
        return self.blocks * self.block_tokens

    @property
    def gpu_tokens(self) -> int:
        return self.gpu_blocks * self.block_tokens


_set_class = object.__setattr__


def new_match(*args: Any, **kwargs: Any) -> Match:
    """``Match(*args, **kwargs)`` at the cost of a plain slotted class (the request
    path): the fields are filled in a ``MatchFields``, which then becomes the
    (frozen) ``Match``; both share one slot layout."""
    m = MatchFields(*args, **kwargs)
    _set_class(m, "__class__", Match)
    return m  # type: ignore[return-value]


@attrs.frozen(eq=False)
class Restored:
    """Restored tensors, per rank: segments cover tokens ``[start_tokens, end_tokens)``
    (axis 0), the snapshot is the recurrent state at ``end_tokens``."""

    match: Match
    segments: list[dict[str, torch.Tensor]]
    snapshot: list[dict[str, torch.Tensor]]
    start_tokens: int
    end_tokens: int
    files_read: int = 0
