"""The tier protocol: what the engine asks of the object that holds one rank's shards.

A tier implements the ``RankIO`` operations (``gpu/ranks.py``: write, read, remove,
quarantine, sync, size, list) plus ``available`` and a declared ``capabilities`` value.
The engine uses an optional operation only when the tier declares its capability; it
never looks for a method by name:

=================  ============================================================
``ADOPTS_BUFFERS``  ``adopt_shard(name, buffer)``: keep a staged buffer as the stored
                    copy (the tier takes one reference; no byte is copied)
``RESIDENT_VIEWS``  ``view_shard(name) -> Buffer | None``: a retained buffer of a
                    shard held in RAM (None when not resident), used in place
``PROMOTES``        ``promote(name, buffer)``: keep a verified buffer read from the
                    tier's durable copy (the tier retains it if it keeps it)
``READS_INTO``      ``read_shard_into(name, out) -> file size``: read in place
``COPIES_ON_READ``  ``read_shard_into`` copies through a bounce buffer (counted)
``READS_FD``        ``read_shard_with(name, fn)``: ``fn(fd)`` on the shard opened for
                    reading (a regular file), so a read can place its bytes where
                    they go and hash them as they land (``gpu/verify.py``)
``VOLATILE``        the bytes die with the process: the catalog's rows for them are
                    dropped at the next open, and audits read them through the tier
``LOCAL_FILES``     ``directory`` is a local rank directory this process reads;
                    ``is_file(entry)`` says whether an entry is a regular file
``REPORTS_DURABILITY`` ``durable(name) -> bool | None``: whether the shard would
                    survive a power loss now (None: the tier cannot tell); a tier
                    that does not declare it is taken as durable
=================  ============================================================

A backing declares, when it is registered (``gpu/tiers/__init__.py``), what holds for
every tier it builds, so the engine and the offline tools can ask before any tier
exists (at open, in an audit or repair of a cache no engine holds):

=================  ============================================================
``VOLATILE``        as above: the catalog's rows of such a cache die with its engine
``RANK_DIRS``       its shards are files in the cache's own rank directories
                    (``rankR/``): open checks those directories, audits scan them,
                    the bandwidth probe reads a file beside them
``READ_ONLY_OPEN``  on a full disk the cache may open read-only over those files
                    (``engine/readonly.py``), its ranks plain rank directories
=================  ============================================================

``available`` is False while the tier cannot serve (a rank process down): a store then
fails at once instead of evicting for a write that cannot succeed.

A *backing* (``Backing``) is the set of tiers an engine runs on, one per rank, plus
its RAM tier if it has one; the registry (``gpu/tiers/__init__.py``) builds one by
name. A backing never runs catalog SQL and never imports the engine: the engine's side
(the catalog's meta row, dropping volatile rows, stats, audit) is ``engine/tiering.py``.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from typing import Any, Protocol, runtime_checkable

import attrs

from prefixstore.gpu.executor import Buffer, StagingPool


class Capability(enum.Flag):
    """The optional abilities a tier declares (see the module docstring)."""

    NONE = 0
    ADOPTS_BUFFERS = enum.auto()
    RESIDENT_VIEWS = enum.auto()
    PROMOTES = enum.auto()
    READS_INTO = enum.auto()
    COPIES_ON_READ = enum.auto()
    VOLATILE = enum.auto()
    LOCAL_FILES = enum.auto()
    REPORTS_DURABILITY = enum.auto()
    RANK_DIRS = enum.auto()
    READ_ONLY_OPEN = enum.auto()
    READS_FD = enum.auto()


class RankIO(Protocol):
    """File effects of one rank: the operations every tier has. Every method is
    idempotent where the docs say so; ``write_shard`` may be given a ``memoryview`` (a
    staging buffer) instead of bytes. A ``RankIO`` that declares no ``capabilities`` is
    used through these operations only."""

    rank: int
    directory: str

    def write_shard(self, name: str, data: bytes | memoryview) -> None: ...
    def read_shard(self, name: str) -> bytes: ...
    def remove(self, name: str) -> bool: ...
    def remove_temp(self, name: str) -> None: ...
    def quarantine(self, entry: str) -> str: ...
    def sync_dir(self) -> None: ...
    def size(self, name: str) -> int | None: ...
    def listdir(self) -> list[str]: ...


@runtime_checkable
class Tier(RankIO, Protocol):
    """One rank's shard store, as the engine uses it: the ``RankIO`` operations plus
    ``available`` and the declared ``capabilities``.

    The operations a capability names are called only when ``capabilities`` declares it;
    a tier that lacks an ability need not define its method.
    """

    @property
    def capabilities(self) -> Capability: ...
    @property
    def available(self) -> bool: ...


def has(tier: Tier, cap: Capability) -> bool:
    """Whether ``tier`` declares ``cap``."""
    return cap in tier.capabilities


@attrs.frozen
class TierOptions:
    """What a backing is built from: the engine's capacity (its byte budget), the
    ``ram_bytes`` option and the executor's staging pool (RAM tiers allocate from it)."""

    capacity: int
    ram_bytes: int | None
    pool: StagingPool


class RamStore(Protocol):
    """A backing's RAM tier as its audit and stats see it (``gpu/tiers/ram.py``)."""

    capacity: int
    used: int

    def items(self) -> list[tuple[tuple[int, str], Buffer]]: ...
    def stats(self) -> dict[str, int]: ...


class Backing(Protocol):
    """The tiers an engine runs on: built by name from the registry."""

    kind: str
    tier: RamStore | None  # the RAM tier, if the backing has one

    @property
    def volatile(self) -> bool: ...

    def bind(self, ranks: Sequence[Any], *, given: bool) -> list[Tier]:
        """The engine's tier per rank, built over the durable rank objects ``ranks``
        (``given``: the caller passed them as ``ranks=``)."""
        ...


class BackingFactory(Protocol):
    """A registry entry: ``volatile`` (rows of such a cache die with its process) and
    the constructor, which validates its options (InvalidInputError). What else the
    backing's tiers all declare is given with its registration (``tiers.register``)."""

    volatile: bool

    def __call__(self, options: TierOptions) -> Backing: ...
