"""The Redis backend (a server, or a Redis Cluster): ``redis://``, ``rediss://``,
``redis+cluster://``, ``rediss+cluster://`` (``urls``), over the bounded redis-py layer
``clients``.

A client per purpose (lookup, restore, write), each with that purpose's timeout on every
socket wait, connected on first use; their sockets obey the running call's ``guard``
budget. Values are written with the ``ttl`` option's expiry, if any; Redis's own
eviction (``maxmemory``) decides what stays.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Sequence
from typing import Any

from prefixstore.gpu.remote import clients
from prefixstore.gpu.remote.config import RemoteConfig
from prefixstore.gpu.remote.protocol import Backend, Faults
from prefixstore.gpu.remote.urls import RemoteURL, parse


class RedisStore:
    """The ``RemoteStore`` of one Redis URL."""

    def __init__(self, url: RemoteURL, config: RemoteConfig) -> None:
        clients.require()
        self.url = url
        self.config = config
        self.faults = Faults(lost=clients.CLUSTER_ERRORS, answered=clients.ANSWERED_ERRORS,
                             network=clients.NETWORK_ERRORS, timeout=clients.TIMEOUT_ERRORS)
        self.partial_writes = url.cluster
        self._ttl_ms = None if config.ttl is None else max(1, int(config.ttl * 1000))
        self._lock = threading.Lock()
        self._clients: dict[str, Any] = {}

    def _client(self, purpose: str) -> Any:
        with self._lock:
            c = self._clients.get(purpose)
        if c is None:
            c = clients.connect(self.url, self.config, self._timeout(purpose))
            with self._lock:
                c = self._clients.setdefault(purpose, c)
        return c

    def _timeout(self, purpose: str) -> float:
        return {"lookup": self.config.lookup_timeout, "restore": self.config.restore_timeout,
                "write": self.config.write_timeout}[purpose]

    def prepare(self, purpose: str) -> bool:
        return clients.prepare(self._client(purpose))

    def get_many(self, purpose: str, keys: list[str], limits: Sequence[int], seconds: float) -> list[Any]:
        # a cluster node that has not answered by nine tenths of the budget fails alone
        return clients.get_many(self._client(purpose), keys, limits=limits, wait=seconds * 0.9)

    def set_many(self, items: list[tuple[str, bytes]], *, replace: bool) -> None:
        clients.set_many(self._client("write"), items, self._ttl_ms)  # SET: a blob's bytes are its key's

    def touch(self, keys: list[str]) -> None:
        clients.touch(self._client("write"), keys)

    def delete_if(self, key: str, expected: bytes) -> int:
        return clients.delete_if(self._client("write"), key, expected)

    def reply_bytes(self, limits: Sequence[int]) -> int:
        return clients.reply_bytes(limits)

    def close(self, timeout: float) -> None:
        with self._lock:
            for c in self._clients.values():
                with contextlib.suppress(*clients.NETWORK_ERRORS):
                    c.close()
            self._clients.clear()


BACKEND = Backend(
    name="redis",
    schemes=("redis", "rediss", "redis+cluster", "rediss+cluster"),
    url_type=RemoteURL,
    parse=parse,
    open=RedisStore,
)
