"""The tier registry: a backing by its ``backing=`` name, and what it declares.

``TIERS`` maps a name to its ``BackingFactory`` (``gpu/tier.py``); ``register`` adds
one with the capabilities its tiers all declare (``capabilities`` answers by name,
before any tier is built), ``lookup`` finds one (``UnknownTierError`` for a name not
registered). Adding a tier is one module implementing the protocol plus
``register(name, factory)``. Registered here: ``disk`` (``disk.py``, the default),
``memory`` (``memory.py``), ``composite`` (``composite.py``). Nothing outside this
package names one: the engine and the offline tools ask for capabilities.

The catalog records the backing a cache was last opened with (meta row ``backing``;
none: ``DEFAULT``) and whether it was volatile (``VOLATILE_KEY``), so an audit or a
repair in a process where that backing is not registered still knows whether the
rows describe files in the rank directories.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence

from prefixstore.base.errors import InvalidInputError
from prefixstore.gpu.tier import BackingFactory, Capability
from prefixstore.gpu.tiers.composite import CompositeBacking
from prefixstore.gpu.tiers.disk import DiskBacking
from prefixstore.gpu.tiers.memory import MemoryBacking

META_KEY = "backing"  # the catalog meta row naming the backing a cache was last opened with
VOLATILE_KEY = "backing_volatile"  # the meta row recording whether that backing was volatile ("1" / "0")
DEFAULT = "disk"
"""The ``backing=`` default, and the backing of a catalog that records none."""


class UnknownTierError(InvalidInputError):
    """No tier is registered under the name asked for."""


TIERS: dict[str, BackingFactory] = {}
_DECLARED: dict[str, Capability] = {}


def register(name: str, factory: BackingFactory, capabilities: Capability | None = None) -> None:
    """Make ``factory`` the backing called ``name``; InvalidInputError if the name is taken.

    ``capabilities``: what every tier it builds declares of ``VOLATILE``, ``RANK_DIRS``
    and ``READ_ONLY_OPEN`` (``gpu/tier.py``); by default ``VOLATILE`` for a volatile
    factory, else ``RANK_DIRS`` (its shards are files in the rank directories)."""
    if not isinstance(name, str) or not name:
        raise InvalidInputError(f"a tier name must be a non-empty string, got {name!r}")
    if name in TIERS:
        raise InvalidInputError(f"a tier named {name!r} is already registered")
    if capabilities is None:
        capabilities = Capability.VOLATILE if factory.volatile else Capability.RANK_DIRS
    elif (Capability.VOLATILE in capabilities) != bool(factory.volatile):
        raise InvalidInputError(f"tier {name!r}: VOLATILE must say what its factory's volatile says")
    TIERS[name] = factory
    _DECLARED[name] = capabilities


def unregister(name: str) -> None:
    """Remove the backing called ``name`` (missing is success)."""
    TIERS.pop(name, None)
    _DECLARED.pop(name, None)


def capabilities(name: object) -> Capability:
    """What the backing called ``name`` declared at its registration (``NONE`` for a
    name not registered)."""
    return _DECLARED.get(name, Capability.NONE) if isinstance(name, str) else Capability.NONE


def durable_names() -> list[str]:
    """The registered backings that are not volatile, in registration order."""
    return [n for n in TIERS if Capability.VOLATILE not in _DECLARED[n]]


def recorded(meta: Mapping[str, str]) -> str:
    """The backing a catalog's ``meta`` rows say the cache was last opened with."""
    return meta.get(META_KEY) or DEFAULT


def recorded_volatile(meta: Mapping[str, str]) -> bool:
    """Whether a catalog's ``meta`` rows describe a volatile cache: as recorded, else
    (a catalog from before the record) what the backing it names declares."""
    flag = meta.get(VOLATILE_KEY)
    if flag is not None:
        return flag == "1"
    return Capability.VOLATILE in capabilities(recorded(meta))


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

register(DEFAULT, DiskBacking, Capability.RANK_DIRS | Capability.READ_ONLY_OPEN)
register("memory", MemoryBacking, Capability.VOLATILE)
register("composite", CompositeBacking, Capability.RANK_DIRS)
