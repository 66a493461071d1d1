"""Mooncake Store's return codes as typed outcomes: what a call's negative code means
(absent, unreachable, refused) and the errors this package raises for them.

The codes are Mooncake's ``ErrorCode`` values (``mooncake-store/include/types.h``), as
its Python client returns them: a non-negative number on success (bytes read, 0/1 for
existence), the negative code otherwise.
"""

from __future__ import annotations

import enum
import mmap
from typing import Any

from prefixstore.base.errors import PrefixStoreError

# Mooncake's ErrorCode values (mooncake-store/include/types.h) that this client tells apart.
OK = 0
INTERNAL_ERROR = -1
NO_AVAILABLE_HANDLE = -200
INVALID_PARAMS = -600
REPLICA_IS_NOT_READY = -703
OBJECT_NOT_FOUND = -704
OBJECT_HAS_LEASE = -706
OBJECT_HAS_REPLICATION_TASK = -708
TRANSFER_FAIL = -800
RPC_FAIL = -900
RPC_TIMEOUT = -901
CODE_NAMES = {
    INTERNAL_ERROR: "INTERNAL_ERROR", -10: "BUFFER_OVERFLOW", -101: "SEGMENT_NOT_FOUND",
    NO_AVAILABLE_HANDLE: "NO_AVAILABLE_HANDLE", -400: "INVALID_KEY", -500: "WRITE_FAIL",
    INVALID_PARAMS: "INVALID_PARAMS", -601: "ILLEGAL_CLIENT", -700: "INVALID_WRITE",
    -701: "INVALID_READ", -702: "INVALID_REPLICA", REPLICA_IS_NOT_READY: "REPLICA_IS_NOT_READY",
    OBJECT_NOT_FOUND: "OBJECT_NOT_FOUND", -705: "OBJECT_ALREADY_EXISTS",
    OBJECT_HAS_LEASE: "OBJECT_HAS_LEASE", -707: "LEASE_EXPIRED",
    OBJECT_HAS_REPLICATION_TASK: "OBJECT_HAS_REPLICATION_TASK", TRANSFER_FAIL: "TRANSFER_FAIL",
    -801: "CHECKSUM_MISMATCH", RPC_FAIL: "RPC_FAIL", RPC_TIMEOUT: "RPC_TIMEOUT",
}
ABSENT_CODES = frozenset({OBJECT_NOT_FOUND, REPLICA_IS_NOT_READY})
"""A read's "no such value": never written, removed, evicted, or still being written."""
UNREACHABLE_CODES = frozenset({RPC_FAIL, RPC_TIMEOUT})
"""The master did not answer (connection refused or lost, or its RPC timeout passed)."""


def code_name(code: int) -> str:
    """Mooncake's name of an error code (``code <n>`` if this client does not know it)."""
    return CODE_NAMES.get(code, f"code {code}")


class MooncakeError(PrefixStoreError):
    """A Mooncake Store call did not do what was asked; ``code`` is Mooncake's, if any."""

    def __init__(self, message: str, code: int | None = None) -> None:
        super().__init__(message)
        self.code = code


class MooncakeUnreachable(MooncakeError, ConnectionError):  # noqa: N818 - an outcome, like ConnectionError
    """The master (or, for one key, the process holding its bytes) did not answer."""


class MooncakeTimeout(MooncakeUnreachable, TimeoutError):  # noqa: N818
    """No answer within the call's budget (the call runs on, abandoned)."""


class MooncakeRefused(MooncakeError):  # noqa: N818
    """The master answered, refusing the call (out of memory, bad parameters, ...)."""


class MooncakeTooLarge(MooncakeRefused):  # noqa: N818
    """A value is larger than the caller said it can use; none of it was read."""


NETWORK_ERRORS: tuple[type[BaseException], ...] = (MooncakeUnreachable,)
ANSWERED_ERRORS: tuple[type[BaseException], ...] = (MooncakeRefused,)
TIMEOUT_ERRORS: tuple[type[BaseException], ...] = (MooncakeTimeout,)


class Removal(enum.Enum):
    """What a ``delete`` or ``delete_if`` did."""

    REMOVED = "removed"
    ABSENT = "absent"
    CHANGED = "changed"
    """``delete_if``: the key holds other bytes than expected (left alone)."""
    LEASED = "leased"
    """``delete``: a reader leased the key within the master's lease time (left alone)."""
    WRITING = "writing"
    """A write of the key is under way (left alone)."""


def read_value(buf: bytearray | mmap.mmap, code: int) -> bytes | None | MooncakeError:
    """One key's outcome of ``batch_get_into`` into ``buf``."""
    if code >= 0:
        if code > len(buf):
            return MooncakeRefused(f"Mooncake reported {code} bytes read into {len(buf)}")
        return bytes(memoryview(buf)[:code])
    if code in ABSENT_CODES:
        return None
    if code == INVALID_PARAMS:  # the one parameter that varies: the room given
        return MooncakeTooLarge(f"a value is larger than the {len(buf)} bytes asked for", code)
    if code in UNREACHABLE_CODES or code == TRANSFER_FAIL:
        return MooncakeUnreachable(f"get: {code_name(code)}", code)
    return MooncakeRefused(f"get: {code_name(code)}", code)


def within(value: Any, cap: int) -> Any:
    """``value`` if it fits in ``cap`` bytes (a key asked twice with less room)."""
    if isinstance(value, bytes) and len(value) > cap:
        return MooncakeTooLarge(f"a value is larger than the {cap} bytes asked for", INVALID_PARAMS)
    return value


def removal(code: int, what: str) -> Removal:
    """What a ``remove`` that ended with ``code`` did (raises for a failure)."""
    if code == OK:
        return Removal.REMOVED
    if code == OBJECT_NOT_FOUND:
        return Removal.ABSENT
    if code in (OBJECT_HAS_LEASE, OBJECT_HAS_REPLICATION_TASK):
        return Removal.LEASED
    if code == REPLICA_IS_NOT_READY:
        return Removal.WRITING
    raise error(code, what)


def error(code: int, what: str) -> MooncakeError:
    """The error of a call that ended with Mooncake's ``code``."""
    kind = MooncakeUnreachable if code in UNREACHABLE_CODES else MooncakeRefused
    return kind(f"{what} {code_name(code)}", code)
