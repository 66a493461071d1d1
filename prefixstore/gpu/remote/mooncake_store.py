"""The Mooncake Store backend: ``mooncake://host:port?metadata=...`` (``mooncake_urls``),
over the bounded client layer ``mooncake_client``.

One Mooncake client per tier (Mooncake's ``setup`` registers a process with the master,
and its teardown takes about a second with the GIL held: one per purpose would cost
three), connected when the tier warms up. Each call waits at most the time left in its
``guard`` budget; a call past it is abandoned to Mooncake's own RPC timeout.

What Mooncake changes for the tier:

- Blobs are written with ``put`` (a blob's key names its content: a key that exists
  keeps its bytes), manifests with ``upsert``: a rewritten checkpoint replaces its
  manifest. An altered blob therefore stays altered (a verify failure, a miss, each
  time it is read) until Mooncake evicts it or someone removes it.
- Reads are sized: each value gets the room its manifest (or the manifest cap) says, and
  one call asks room for at most ``MooncakeOptions.max_reply_bytes`` (1 GiB) in all: a key
  past that is refused unread (``oversized``, its miss), so a forged size costs no memory.
- ``touch`` renews the keys' read leases, which are Mooncake's eviction order.
- The clean-up of an evicted checkpoint's manifest is ``delete_if`` (a plain remove is
  refused right after a read: the read leased the key).
- No per-key expiry: the ``ttl`` option is refused, as are the Redis login and TLS
  options (``username``, ``password``, ``tls``). One master, no fan-out.
- Where the bytes live: memory lent to the store by ``segment=`` in an engine's URL
  (gone when that engine closes) or by ``mooncake_client`` storage processes; a master
  with no memory lent stores nothing (every write is dropped, counted).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from prefixstore.base.errors import InvalidArgumentError
from prefixstore.gpu.remote import guard
from prefixstore.gpu.remote.config import RemoteConfig
from prefixstore.gpu.remote.mooncake_client import (
    MooncakeClient,
    MooncakeOptions,
    MooncakeRefused,
    MooncakeTimeout,
    MooncakeTooLarge,
    MooncakeUnreachable,
    Removal,
)
from prefixstore.gpu.remote.mooncake_outcomes import RPC_FAIL
from prefixstore.gpu.remote.mooncake_urls import MooncakeURL, parse
from prefixstore.gpu.remote.protocol import Backend, Faults, Refused

FAULTS = Faults(answered=(MooncakeRefused,), network=(MooncakeUnreachable,), timeout=(MooncakeTimeout,))
REMOVALS = {Removal.REMOVED: 1, Removal.CHANGED: -1}
"""``delete_if``'s outcomes as the tier counts them (any other: nothing done)."""
T = TypeVar("T")
STALE_TRIES = 8
"""Tries of a call whose master connection failed at once (``_reconnecting``)."""


def check(config: RemoteConfig) -> None:
    """Refuse the options Mooncake Store cannot honour."""
    if config.ttl is not None:
        raise InvalidArgumentError("ttl", "Mooncake Store has no per-key expiry: leave ttl None "
                                          "(its eviction frees memory when the store is full)")
    for name in ("username", "password"):
        if getattr(config, name) is not None:
            raise InvalidArgumentError(name, "Mooncake Store takes no login")
    if config.tls:
        raise InvalidArgumentError("tls", "Mooncake Store takes no TLS options")


def _left() -> float:
    """The seconds left in the running call's budget."""
    budget = guard.current()
    left = 10.0 if budget is None else budget.deadline - time.monotonic()
    if left <= 0:
        raise MooncakeTimeout("past the call's budget")
    return left


def _reconnecting(client: MooncakeClient, call: Callable[[float], T]) -> T:
    """``call(seconds left)`` once ``client`` is connected (a call that comes before the
    tier's warm-up has connected waits for it, or connects, within its budget), tried
    again while it fails at once with ``RPC_FAIL`` (at most ``STALE_TRIES`` times, a
    millisecond more apart each time): Mooncake's connections to a master that has since
    restarted fail their next requests (two or three, each in about a millisecond), and
    the ones made again after them work (redis-py checks its pooled connections the same
    way before it uses one). Every try keeps to the budget."""
    client.connect(_left())
    for tries in range(1, STALE_TRIES):
        try:
            return call(_left())
        except MooncakeUnreachable as exc:
            if exc.code != RPC_FAIL or isinstance(exc, MooncakeTimeout):
                raise
        time.sleep(min(tries * 0.001, _left()))
    return call(_left())


class MooncakeStore:
    """The ``RemoteStore`` of one Mooncake Store URL."""

    faults = FAULTS
    partial_writes = False

    def __init__(self, url: MooncakeURL, config: RemoteConfig) -> None:
        check(config)
        self.client = MooncakeClient(url, MooncakeOptions(call_threads=config.call_threads))
        self.room = self.client.options.max_reply_bytes
        # Mooncake's setup takes a while (0.1 s, more on a loaded host): connect now, so that
        # the first lookup need not. Down, or slower than write_timeout: the calls find out.
        with contextlib.suppress(MooncakeUnreachable):
            self.client.connect(config.write_timeout)

    def prepare(self, purpose: str) -> bool:
        return _reconnecting(self.client, self.client.ping)

    def get_many(self, purpose: str, keys: list[str], limits: Sequence[int], seconds: float) -> list[Any]:
        caps, room = [], self.room
        for n in limits:  # the room a value may have, while the call has room left
            caps.append(max(1, n) if max(1, n) <= room else 0)
            room -= caps[-1]
        asked = [i for i, c in enumerate(caps) if c]
        out: list[Any] = [Refused(f"past the call's {self.room} bytes of room")] * len(keys)
        got = _reconnecting(self.client, lambda left: self.client.get_many(
            [keys[i] for i in asked], [caps[i] for i in asked], left)) if asked else []
        for i, v in zip(asked, got, strict=True):
            out[i] = Refused(str(v)) if isinstance(v, MooncakeTooLarge) else v
        return out

    def set_many(self, items: list[tuple[str, bytes]], *, replace: bool) -> None:
        _reconnecting(self.client, lambda left: self.client.set_many(items, left, replace=replace))

    def touch(self, keys: list[str]) -> None:
        _reconnecting(self.client, lambda left: self.client.touch(keys, left))

    def delete_if(self, key: str, expected: bytes) -> int:
        return REMOVALS.get(_reconnecting(self.client, lambda left: self.client.delete_if(key, expected, left)), 0)

    def reply_bytes(self, limits: Sequence[int]) -> int:
        return sum(limits)  # nominal: no socket of this backend charges the budget (the room above bounds reads)

    def close(self, timeout: float) -> None:
        self.client.close(max(0.001, timeout))


BACKEND = Backend(
    name="mooncake",
    schemes=("mooncake",),
    url_type=MooncakeURL,
    parse=parse,
    open=MooncakeStore,
    check=check,
)
