"""redis-py clients for one remote URL, each bounded by a timeout and never retrying
on its own (the tier decides what a failure means)."""

from __future__ import annotations

import concurrent.futures
from typing import Any

from prefixstore.base.errors import MissingExtraError
from prefixstore.gpu.remote.config import RemoteConfig
from prefixstore.gpu.remote.urls import RemoteURL

try:  # the `remote` extra; without it no client is ever built, so OSError is all a call meets
    import redis
    from redis.backoff import NoBackoff
    from redis.cluster import ClusterNode, RedisCluster
    from redis.exceptions import ClusterError, RedisClusterException, RedisError, ResponseError
    from redis.exceptions import TimeoutError as RedisTimeoutError
    from redis.retry import Retry
except ModuleNotFoundError as exc:
    if exc.name is None or exc.name.split(".")[0] != "redis":
        raise
    redis = None
    NETWORK_ERRORS: tuple[type[BaseException], ...] = (OSError,)
    CLUSTER_ERRORS: tuple[type[BaseException], ...] = ()
    ANSWERED_ERRORS: tuple[type[BaseException], ...] = ()
    TIMEOUT_ERRORS: tuple[type[BaseException], ...] = (TimeoutError,)
else:
    NETWORK_ERRORS = (RedisError, RedisClusterException, OSError)
    # The cluster lost slots or nodes: treated as unreachable, though a node answered.
    CLUSTER_ERRORS = (ClusterError,)
    # Other errors the server answered with (out of memory, ...): it is reachable.
    ANSWERED_ERRORS = (ResponseError,)
    TIMEOUT_ERRORS = (RedisTimeoutError, TimeoutError)

MISSING = "the Redis remote tier needs redis-py: pip install 'prefixstore[remote]'"


def require() -> None:
    """Raise MissingExtraError when redis-py is not installed."""
    if redis is None:
        raise MissingExtraError(MISSING)


def connect(url: RemoteURL, config: RemoteConfig, timeout: float) -> Any:
    """A client of ``url`` whose every socket wait (connecting included) is at most
    ``timeout`` seconds. A cluster client asks a startup node for the slot map now, so
    this may raise one of NETWORK_ERRORS."""
    require()
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


NODE_CALLS = concurrent.futures.ThreadPoolExecutor(16, "prefixstore-remote-node")
"""The threads asking cluster nodes in parallel (shared by every tier of the process)."""


def get_many(client: Any, keys: list[str], wait: float | None = None) -> list[Any]:
    """Values of ``keys`` in one round trip per server: bytes, None when absent, or the
    exception that one key's cluster node failed with (raised only if every node failed).
    A cluster's nodes are asked in parallel; one that has not answered within ``wait``
    seconds counts as failed with a ``TimeoutError``, so a hung node costs only its keys."""
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
    asks = {name: NODE_CALLS.submit(_node_get, client, nodes[name], [keys[i] for i in idx])
            for name, idx in by_node.items()}
    concurrent.futures.wait(asks.values(), timeout=wait)
    out: list[Any] = [None] * len(keys)
    errors: list[BaseException] = []
    for name, idx in by_node.items():
        values = _answer(asks[name], name, wait)
        if isinstance(values, BaseException):
            errors.append(values)
            values = [values] * len(idx)
        for i, v in zip(idx, values, strict=True):
            out[i] = v
    if len(errors) == len(by_node):
        raise errors[0]
    return out


def _node_get(client: Any, node: Any, keys: list[str]) -> list[Any]:
    pipe = client.get_redis_connection(node).pipeline(transaction=False)
    for k in keys:
        pipe.get(k)
    return pipe.execute(raise_on_error=False)


def _answer(ask: concurrent.futures.Future, name: str, wait: float | None) -> list[Any] | BaseException:
    """A node's values, or the network error (or timeout) it failed with."""
    if not ask.done():
        return TimeoutError(f"cluster node {name} did not answer within {wait} s")
    exc = ask.exception()
    if exc is None:
        return ask.result()
    if not isinstance(exc, NETWORK_ERRORS):
        raise exc
    return exc


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
