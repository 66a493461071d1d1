"""Typed errors. Every error the engine raises on purpose derives from PrefixStoreError."""

from __future__ import annotations

import errno


class PrefixStoreError(Exception):
    """Base class of every error prefixstore raises on purpose."""


class InvalidInputError(PrefixStoreError, ValueError):
    """The caller passed something the engine cannot accept; nothing was changed."""


class LayoutError(InvalidInputError):
    """A Layout is malformed (unknown dtype, empty shape, bad block size...)."""


class ShapeError(InvalidInputError):
    """A tensor's shape does not match the layout."""


class DtypeError(InvalidInputError):
    """A tensor's dtype does not match the layout."""


class UnalignedError(InvalidInputError):
    """A length or position is not a multiple of the layout's block size."""


class RankError(InvalidInputError):
    """Tensors were given for the wrong number of ranks, or an unknown rank was named."""


class MissingExtraError(PrefixStoreError, ImportError):
    """A feature needs an optional package that is not installed; the message names the extra."""


class NotACacheError(PrefixStoreError):
    """The directory exists but does not hold a prefixstore cache."""


class SchemaVersionError(PrefixStoreError):
    """The catalog was written by a newer (or unknown) schema version."""


class LayoutMismatchError(PrefixStoreError):
    """The cache was created with a different layout than the one given to open()."""


class CatalogCorruptError(PrefixStoreError):
    """The catalog contradicts itself (a tampered or damaged row)."""


class CatalogIOError(PrefixStoreError):
    """The catalog could not be read or written (I/O error, full disk). After a failed
    write the engine refuses further mutations until it is reopened (recovery)."""


class CacheIOError(PrefixStoreError, OSError):
    """A file system call failed while the cache was being opened (``errno`` says
    which: EIO, ENOSPC, EACCES...); the next open recovers whatever it left."""


class EngineClosedError(PrefixStoreError):
    """The engine was closed (or abandoned after a simulated crash)."""


class IllegalTransitionError(PrefixStoreError):
    """A transaction's state machine was fed an event its current state cannot handle."""


class RowTransitionError(IllegalTransitionError):
    """A catalog row was fed an event of its row table (``statemachine/rows.py``) that
    its state cannot take: ``table``, ``row``, ``state`` and ``event`` say which. The
    write is refused with its whole commit."""

    def __init__(self, table: str, row: str, state: object, event: str, detail: str = "") -> None:
        self.table, self.row, self.state, self.event = table, row, state, event
        super().__init__(f"{table} row {row}: can't handle event {event!r} in state {state!r}"
                         + (f" ({detail})" if detail else ""))


class ShardError(PrefixStoreError):
    """A shard file failed verification (missing, short, checksum or header mismatch)."""


class PinnedError(PrefixStoreError):
    """The operation would touch a pinned or fenced node."""


class NotFoundError(PrefixStoreError, KeyError):
    """No node with that key is in the catalog."""


class LockedError(PrefixStoreError):
    """Another engine (process or object) holds this cache directory open."""


class RankUnavailableError(PrefixStoreError, OSError):
    """A rank process died, timed out or is not connected: the effect asked of it did
    not happen, or its outcome is unknown (an OSError, so stores roll back)."""


class RankAuthError(RankUnavailableError):
    """The peer of a rank connection did not prove the shared token (errno EACCES):
    nothing was sent to it and nothing it asked for was done."""

    def __init__(self, why: str) -> None:
        super().__init__(errno.EACCES, why)


class SimulatedCrash(BaseException):  # noqa: N818 - a crash, not an error
    """Raised by fault hooks to model process death; never caught by the engine.

    It derives from BaseException so no ``except Exception`` swallows it. The engine
    that sees it abandons itself (releases its catalog connection and lock without
    committing anything more); reopen the directory to recover.
    """


class NotRegularFileError(ShardError, OSError):
    """A shard path is a symlink, FIFO, device or directory, or lies in one: never read, always damage."""


class UnsafeDirectoryError(NotACacheError):
    """A cache's own directory (rankR/, lost+found/) is a symlink or not a directory; nothing was touched."""


class RankDirMissingError(NotACacheError):
    """A rank directory holding cataloged shards is missing (kept elsewhere?): name it explicitly."""


class BackingContradictionError(CatalogCorruptError):
    """The catalog's recorded backing contradicts the files (e.g. ``memory`` while its shards are on disk)."""


class InvalidArgumentError(InvalidInputError):
    """A public call's argument has the wrong type or value; ``argument`` names it."""

    def __init__(self, argument: str, message: str) -> None:
        super().__init__(f"{argument}: {message}")
        self.argument = argument


class BlockSizeMismatchError(InvalidArgumentError):
    """A Prefix was built with another block size than the cache's layout."""


class ForeignMatchError(InvalidArgumentError):
    """A Match given to an engine came from another engine (or another cache directory)."""


class CapacityError(PrefixStoreError):
    """Open cannot bring the cache within the capacity it was given (nothing evictable left)."""


class DiskFullError(CatalogIOError):
    """The catalog cannot be opened or written: its disk is full and nothing is left to free first."""


class ReadOnlyError(PrefixStoreError):
    """The engine was opened read-only (``reason`` says why) and refuses every mutation; nothing was changed."""

    def __init__(self, message: str, reason: PrefixStoreError | None = None) -> None:
        super().__init__(message)
        self.reason = reason


class CatalogLostError(NotACacheError):
    """The catalog is missing, empty or never initialized while the directory holds a cache's files: refused, nothing touched."""

    def __init__(self, message: str, state: str = "") -> None:
        super().__init__(message)
        self.state = state


class ForeignSchemaError(CatalogCorruptError):
    """The catalog holds a trigger, view, index or table the engine did not create, or an altered one: refused."""


class IdentityMismatchError(PrefixStoreError):
    """The cache belongs to another model than the ``identity`` given to open();
    ``differences`` names each field that differs. Nothing was changed."""

    def __init__(self, message: str, differences: list[str] | None = None) -> None:
        super().__init__(message)
        self.differences = list(differences or ())
