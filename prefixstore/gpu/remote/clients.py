"""redis-py clients for one remote URL, each bounded by a timeout and never retrying
on its own (the tier decides what a failure means)."""

from __future__ import annotations

from typing import Any

import redis
from redis.backoff import NoBackoff
from redis.cluster import ClusterNode, RedisCluster
from redis.exceptions import (
    ClusterError,
    RedisClusterException,
    RedisError,
    ResponseError,
)
from redis.exceptions import TimeoutError as RedisTimeoutError
from redis.retry import Retry

from prefixstore.gpu.remote.config import RemoteConfig
from prefixstore.gpu.remote.urls import RemoteURL

NETWORK_ERRORS = (RedisError, RedisClusterException, OSError)
# The cluster lost slots or nodes: treated as unreachable, though a node answered.
CLUSTER_ERRORS = (ClusterError,)
# Other errors the server answered with (out of memory, ...): it is reachable.
ANSWERED_ERRORS = (ResponseError,)
TIMEOUT_ERRORS = (RedisTimeoutError, TimeoutError)


def connect(url: RemoteURL, config: RemoteConfig, timeout: float) -> Any:
    """A client of ``url`` whose every socket wait (connecting included) is at most
    ``timeout`` seconds. A cluster client asks a startup node for the slot map now, so
    this may raise one of NETWORK_ERRORS."""
    common: dict[str, Any] = {
        "username": config.username or url.username,
        "password": config.password or url.password,
        "socket_timeout": timeout,
        "socket_connect_timeout": timeout,
        "retry": Retry(NoBackoff(), 0),
        "client_name": "prefixstore",
    }
    if url.tls:
        common.update(ssl=True, **config.tls)
    if not url.cluster:
        (host, port), = url.hosts
        return redis.Redis(host=host, port=port, db=url.db, **common)
    return RedisCluster(
        startup_nodes=[ClusterNode(h, p) for h, p in url.hosts],
        require_full_coverage=False,
        **common,
    )


def get_many(client: Any, keys: list[str]) -> list[Any]:
    """Values of ``keys`` in one round trip per server: bytes, None when absent, or the
    exception that one key's cluster node failed with (raised only if every node failed)."""
    if not keys:
        return []
    if not isinstance(client, RedisCluster):
        return client.mget(keys)
    by_node: dict[str, list[int]] = {}
    nodes = {}
    for i, k in enumerate(keys):
        node = client.get_node_from_key(k)
        nodes[node.name] = node
        by_node.setdefault(node.name, []).append(i)
    out: list[Any] = [None] * len(keys)
    failed = 0
    for name, idx in by_node.items():
        try:
            pipe = client.get_redis_connection(nodes[name]).pipeline(transaction=False)
            for i in idx:
                pipe.get(keys[i])
            values = pipe.execute(raise_on_error=False)
        except NETWORK_ERRORS as exc:
            failed += 1
            values = [exc] * len(idx)
            if failed == len(by_node):
                raise
        for i, v in zip(idx, values, strict=True):
            out[i] = v
    return out


def set_many(client: Any, items: list[tuple[str, bytes]], ttl_ms: int | None) -> None:
    """Store every ``(key, value)`` in one round trip; raise if any write failed."""
    pipe = client.pipeline(transaction=False)
    for k, v in items:
        pipe.set(k, v, px=ttl_ms)
    pipe.execute(raise_on_error=True)


def touch(client: Any, keys: list[str]) -> None:
    """Mark ``keys`` used (for Redis's LRU/LFU eviction), one pipeline."""
    pipe = client.pipeline(transaction=False)
    for k in keys:
        pipe.touch(k)
    pipe.execute(raise_on_error=False)


def delete(client: Any, key: str) -> None:
    """Delete ``key`` (absent: nothing to do)."""
    client.delete(key)


def ping(client: Any) -> bool:
    """Whether the server (or a random cluster node) answers."""
    if isinstance(client, RedisCluster):
        return bool(client.ping(target_nodes=RedisCluster.RANDOM))
    return bool(client.ping())
