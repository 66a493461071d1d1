"""What a remote store backend provides: the byte store beneath the shared tier.

The tier (``tier.RemoteTier``) holds all the logic every backend shares: manifests and
immutable self-verifying blobs (``manifest``, ``keys``), the optional HMAC (``auth``),
per-call budgets and byte bounds (``guard``), the write-behind queue (``writeback``),
down / reconnect and the counters (``stats``). A backend is the few primitive operations
on bytes at string keys that the tier needs (``RemoteStore``), plus its URL parser and
the options it cannot honour (``Backend``); ``registry`` finds it by URL scheme.

Every ``RemoteStore`` call runs in one of the tier's call threads inside the call's
``guard`` budget (``guard.current()``: its monotonic deadline and the bytes it may
receive), and must end by that deadline: a backend on sockets lets ``guard`` bound them,
another waits no longer than ``deadline - now`` for its own client. A call raises one of
its ``faults`` for a network fault; the tier counts it and decides what it means.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol

import attrs

from prefixstore.gpu.remote.config import RemoteConfig


@attrs.frozen
class Refused:
    """A stored value the call did not read: longer than it can use, or not a string."""

    why: str


@attrs.frozen
class Faults:
    """What the exceptions of a backend's calls mean to the tier.

    ``lost``: the store answered but cannot serve (a cluster that lost slots): counted as
    an error, the tier marked down. ``answered``: the store refused this one call (out of
    memory, ...): counted, the tier stays up. ``network``: no usable answer (refused,
    reset, past the deadline): the tier marked down; ``timeout`` (a subset): counted as
    a timeout rather than an error."""

    lost: tuple[type[BaseException], ...] = ()
    answered: tuple[type[BaseException], ...] = ()
    network: tuple[type[BaseException], ...] = (OSError,)
    timeout: tuple[type[BaseException], ...] = (TimeoutError,)


class RemoteStore(Protocol):
    """One tier's connection to its store. ``purpose`` (``"lookup"``, ``"restore"``,
    ``"write"``) lets a backend keep a connection per kind of call; writes, touches and
    deletes are ``"write"`` calls."""

    faults: Faults
    partial_writes: bool
    """A failed write may concern one part of the store only (a cluster node's slots): it
    is counted without marking the tier down."""

    def prepare(self, purpose: str) -> bool:
        """Connect for ``purpose`` if not yet; whether the store answers."""

    def get_many(self, purpose: str, keys: list[str], limits: Sequence[int], seconds: float) -> list[Any]:
        """The value at each key: ``bytes``, None when absent, a ``Refused`` when longer
        than its ``limits`` entry, or the exception that key alone failed with (one part
        of the store did not answer; raise when the whole store did not). ``seconds``:
        the call's whole budget."""

    def set_many(self, items: list[tuple[str, bytes]], *, replace: bool) -> None:
        """Store every ``(key, value)``; raise if any write failed. ``replace``: a value
        already there is overwritten (manifests); without it one may be kept (blobs,
        whose key names their content)."""

    def touch(self, keys: list[str]) -> None:
        """Mark ``keys`` used, so that the store's eviction ages them with their manifest."""

    def delete_if(self, key: str, expected: bytes) -> int:
        """Delete ``key`` if it holds ``expected``: 1 if deleted, -1 if it holds other
        bytes (left alone), 0 otherwise (absent, or left for another try)."""

    def reply_bytes(self, limits: Sequence[int]) -> int:
        """The byte budget of a call reading values of at most ``limits`` bytes (and of
        any other call, with no limits)."""

    def close(self, timeout: float) -> None:
        """Disconnect, within ``timeout`` seconds."""


def accept_all(config: RemoteConfig) -> None:
    """A backend that honours every option of ``RemoteConfig``."""


@attrs.frozen
class Backend:
    """A remote store backend as the registry knows it.

    ``name``: how messages name it. ``schemes``: its URL schemes (lower case, before
    ``://``). ``url_type`` / ``parse``: its parsed URL (with ``redacted()``, the URL without
    secrets) and the parser (``InvalidArgumentError`` naming ``remote``, never quoting a
    secret). ``check``: refuse, with ``InvalidArgumentError`` naming the option, a
    ``RemoteConfig`` it cannot honour. ``open``: its ``RemoteStore`` for a parsed URL
    (``MissingExtraError`` naming the extra when its client is not installed; connects
    nothing yet).
    """

    name: str
    schemes: tuple[str, ...] = attrs.field(converter=tuple)
    url_type: type
    parse: Callable[[str], Any]
    open: Callable[[Any, RemoteConfig], RemoteStore]
    check: Callable[[RemoteConfig], None] = accept_all
