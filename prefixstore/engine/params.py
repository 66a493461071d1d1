"""Params objects of the public calls that take more than a few fields, checked when
built (each bad field raises ``InvalidArgumentError`` naming it); what needs the
engine (the layout's block size and tensor shapes) is checked by the call.

    eng.store(StoreParams(prefix, segments, snapshot, tokens_from=512))
    eng.lookup(LookupParams(prefix, gpu_blocks=2))

The calls take their plain arguments too; a Params object is given alone
(``store_arguments`` unpacks it, ``alone`` checks nothing else was given). Their
results are ``StoreResult`` and ``Match`` (``engine/results.py``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import attrs

from prefixstore.base.errors import InvalidArgumentError
from prefixstore.base.keys import Prefix
from prefixstore.base.layout import RankTensors
from prefixstore.engine.checks import callable_or_none, integer


def _prefix(_inst: Any, _attribute: attrs.Attribute, value: Any) -> None:
    if not isinstance(value, Prefix):
        raise InvalidArgumentError("prefix", f"must be a Prefix, got {type(value).__name__}")


def _storable_prefix(_inst: Any, _attribute: attrs.Attribute, value: Prefix) -> None:
    if len(value) == 0:
        raise InvalidArgumentError("prefix", "cannot store an empty prefix")


def _tensors(_inst: Any, attribute: attrs.Attribute, value: Any) -> None:
    if not isinstance(value, (Mapping, Sequence)) or isinstance(value, (str, bytes)):
        raise InvalidArgumentError(
            attribute.name, f"must be a mapping of tensors or one per rank, got {type(value).__name__}"
        )


def _count(_inst: Any, attribute: attrs.Attribute, value: Any) -> None:
    integer(attribute.name, value)


def _callable_or_none(_inst: Any, attribute: attrs.Attribute, value: Any) -> None:
    callable_or_none(attribute.name, value)


@attrs.frozen(eq=False)
class StoreParams:
    """One ``store`` / ``store_async`` call: the checkpoint at the end of ``prefix``.

    ``segments``: one mapping of tensors per rank (a bare mapping for one rank) covering
    tokens ``[tokens_from, len(prefix) * block_tokens)``; ``snapshot``: the recurrent
    state at the end (required iff the layout has snapshot tensors); ``valid``: whether
    the caller's checkpoint is still valid (a store refused for space is then queued).
    """

    prefix: Prefix = attrs.field(validator=[_prefix, _storable_prefix])
    segments: RankTensors | Sequence[RankTensors] = attrs.field(validator=_tensors)
    snapshot: RankTensors | Sequence[RankTensors] | None = None
    tokens_from: int = attrs.field(default=0, validator=_count)
    valid: Callable[[], bool] | None = attrs.field(default=None, validator=_callable_or_none)


@attrs.frozen
class LookupParams:
    """One ``lookup`` call: ``gpu_blocks`` leading blocks of ``prefix`` already on the
    GPU (not restored), ``total_tokens`` the request's length (for the cost rule;
    None: the prefix's). Checked in one pass when built (it is on the request path)."""

    prefix: Prefix
    gpu_blocks: int = 0
    total_tokens: int | None = None

    def __attrs_post_init__(self) -> None:
        if not isinstance(self.prefix, Prefix):
            raise InvalidArgumentError("prefix", f"must be a Prefix, got {type(self.prefix).__name__}")
        g = integer("gpu_blocks", self.gpu_blocks)
        if g > len(self.prefix):
            raise InvalidArgumentError("gpu_blocks", f"{g} is more than the prefix's {len(self.prefix)} blocks")
        if self.total_tokens is not None:
            integer("total_tokens", self.total_tokens)


def alone(call: str, given: Any, *others: Any) -> None:
    """A Params object is the call's only argument: ``others`` (the call's other
    arguments) must all be at their defaults."""
    if any(o not in (None, 0) for o in others):
        raise InvalidArgumentError("prefix", f"{call}: a {type(given).__name__} is given alone, without other arguments")


def store_arguments(call: str, prefix: Any, segments: Any, snapshot: Any, tokens_from: Any, valid: Any) -> tuple:
    """``store`` / ``store_async``'s arguments as given, or taken from a StoreParams
    given alone: ``(prefix, segments, snapshot, tokens_from, valid)``."""
    if not isinstance(prefix, StoreParams):
        return prefix, segments, snapshot, tokens_from, valid
    alone(call, prefix, segments, snapshot, tokens_from, valid)
    return attrs.astuple(prefix, recurse=False)
