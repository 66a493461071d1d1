"""The tier registry: a backing by its ``backing=`` name.

``TIERS`` maps a name to its ``BackingFactory`` (``gpu/tier.py``); ``register`` adds
one, ``lookup`` finds one (``UnknownTierError`` for a name not registered). Adding a
tier is one module implementing the protocol plus ``register(name, factory)``.
Registered here: ``disk`` (``disk.py``), ``memory`` (``memory.py``), ``composite``
(``composite.py``).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

from prefixstore.base.errors import InvalidInputError
from prefixstore.gpu.tier import BackingFactory
from prefixstore.gpu.tiers.composite import CompositeBacking
from prefixstore.gpu.tiers.disk import DiskBacking
from prefixstore.gpu.tiers.memory import MemoryBacking

META_KEY = "backing"  # the catalog meta row naming the backing a cache was last opened with


class UnknownTierError(InvalidInputError):
    """No tier is registered under the name asked for."""


TIERS: dict[str, BackingFactory] = {}


def register(name: str, factory: BackingFactory) -> None:
    """Make ``factory`` the backing called ``name``; InvalidInputError if the name is taken."""
    if not isinstance(name, str) or not name:
        raise InvalidInputError(f"a tier name must be a non-empty string, got {name!r}")
    if name in TIERS:
        raise InvalidInputError(f"a tier named {name!r} is already registered")
    TIERS[name] = factory


def unregister(name: str) -> None:
    """Remove the backing called ``name`` (missing is success)."""
    TIERS.pop(name, None)


def lookup(name: object) -> BackingFactory:
    """The factory registered as ``name``."""
    factory = TIERS.get(name) if isinstance(name, str) else None
    if factory is None:
        raise UnknownTierError(f"backing must be one of {tuple(TIERS)}, got {name!r}")
    return factory


class _Names(Sequence[str]):
    """The registered names, read live (so a tier registered later is accepted)."""

    def __getitem__(self, i):  # type: ignore[override]
        return tuple(TIERS)[i]

    def __len__(self) -> int:
        return len(TIERS)

    def __iter__(self) -> Iterator[str]:
        return iter(tuple(TIERS))

    def __contains__(self, name: object) -> bool:
        return name in TIERS

    def __repr__(self) -> str:
        return repr(tuple(TIERS))


NAMES: Sequence[str] = _Names()

register("disk", DiskBacking)
register("memory", MemoryBacking)
register("composite", CompositeBacking)
