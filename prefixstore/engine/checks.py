"""Scalar argument checks shared by the engine's config, its Params objects and the
per-call checks of ``validate.py``; each raises ``InvalidArgumentError`` naming the
argument."""

from __future__ import annotations

import math
import numbers
import operator
from collections.abc import Sequence
from typing import Any

from prefixstore.base.errors import InvalidArgumentError


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
