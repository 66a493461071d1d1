"""redis-py clients for one Redis URL (beneath the Redis backend, ``redis_store``), each
bounded by a timeout and never retrying on its own (the tier decides what a failure means).

Reads are bounded twice. The server is asked never to send a value longer than the
call can use (a manifest's documented maximum, a blob's size from its manifest): one
``EVALSHA`` of ``BOUNDED_GET`` on a server (``STRLEN`` before ``GET``, per key), one
pipeline of ``GETRANGE key 0 limit`` per node on a cluster (and on a server that runs no
scripts: before Redis 7, or an ACL without them); a longer value, or one that
is not a string, is that key's ``Refused``, not a failure of the call. And the
connections' sockets (``guard``) stop any reply past the call's byte budget and deadline,
whatever the server sends.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import hashlib
from collections.abc import Sequence
from typing import Any

from prefixstore.base.errors import MissingExtraError
from prefixstore.gpu.remote import guard
from prefixstore.gpu.remote.config import RemoteConfig
from prefixstore.gpu.remote.protocol import Refused
from prefixstore.gpu.remote.urls import RemoteURL

try:  # the `remote` extra; without it no client is ever built, so OSError is all a call meets
    import redis
    from redis.backoff import NoBackoff
    from redis.cluster import ClusterNode, RedisCluster
    from redis.exceptions import (
        ClusterError,
        InvalidResponse,
        NoScriptError,
        RedisClusterException,
        RedisError,
        ResponseError,
    )
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

    class GuardedConnection(redis.Connection):
        """A TCP connection whose socket is bounded by the current call's budget."""

        def _connect(self) -> guard.GuardedSocket:
            return guard.GuardedSocket(super()._connect())

    class GuardedSSLConnection(redis.SSLConnection):
        """A TLS connection whose socket is bounded by the current call's budget."""

        def _connect(self) -> guard.GuardedSocket:
            return guard.GuardedSocket(super()._connect())

MISSING = "the Redis remote tier needs redis-py: pip install 'prefixstore[remote]'"

VALUE_OVERHEAD = 64
"""Bytes of RESP framing one value may add to a reply (``$<length>\\r\\n``, ``\\r\\n``)."""
CALL_ALLOWANCE = 1 << 20
"""Bytes any call may receive besides its values: the connection's handshake, a
cluster's slot map, an error line."""

BOUNDED_GET = """#!lua flags=no-writes
local out = {}
for i, key in ipairs(KEYS) do
  local n = redis.pcall('STRLEN', key)
  if type(n) ~= 'number' then
    out[i] = -1
  elseif n > tonumber(ARGV[i]) then
    out[i] = n
  elseif n == 0 then
    out[i] = false
  else
    out[i] = redis.call('GET', key)
  end
end
return out
"""
"""Per key: its value when at most ``ARGV[i]`` bytes, nil when absent (or empty), its
length when longer, -1 when it is not a string. Flagged read-only (Redis 7), so that a
server over its ``maxmemory`` still runs it."""
BOUNDED_GET_SHA = hashlib.sha1(BOUNDED_GET.encode()).hexdigest()

COMPARE_DELETE = """
local v = redis.call('GET', KEYS[1])
if v == ARGV[1] then
  return redis.call('DEL', KEYS[1])
elseif v then
  return -1
end
return 0
"""
"""Delete ``KEYS[1]`` only while it still holds ``ARGV[1]`` (1: deleted, 0: absent, -1:
it holds other bytes)."""


def require() -> None:
    """Raise MissingExtraError when redis-py is not installed."""
    if redis is None:
        raise MissingExtraError(MISSING)


def reply_bytes(limits: Sequence[int]) -> int:
    """The byte budget of a call reading values of at most ``limits`` bytes."""
    return sum(limits) + VALUE_OVERHEAD * len(limits) + CALL_ALLOWANCE


def connect(url: RemoteURL, config: RemoteConfig, timeout: float) -> Any:
    """A client of ``url`` whose every socket wait (connecting included) is at most
    ``timeout`` seconds and whose sockets obey the current call's budget. A cluster
    client asks a startup node for the slot map now, so this may raise one of
    NETWORK_ERRORS."""
    require()
    common: dict[str, Any] = {
        "username": config.username or url.username,
        "password": config.password or url.password,
        "socket_timeout": timeout,
        "socket_connect_timeout": timeout,
        "retry": Retry(NoBackoff(), 0),
        "client_name": "prefixstore",
        "connection_class": GuardedSSLConnection if url.tls else GuardedConnection,
    }
    if url.tls:
        common.update(config.tls)
    if not url.cluster:
        (host, port), = url.hosts
        return redis.Redis(connection_pool=redis.ConnectionPool(host=host, port=port, db=url.db, **common))
    (host, port), *more = url.hosts
    # Built "from a URL" (without credentials) so that every node's pool makes guarded connections.
    return RedisCluster(
        url=f"redis://{f'[{host}]' if ':' in host else host}:{port}",
        startup_nodes=[ClusterNode(h, p) for h, p in more],
        require_full_coverage=False,
        **common,
    )


NODE_CALLS = concurrent.futures.ThreadPoolExecutor(16, "prefixstore-remote-node")
"""The threads asking cluster nodes in parallel (shared by every tier of the process)."""


def get_many(client: Any, keys: list[str], limits: Sequence[int], wait: float | None = None) -> list[Any]:
    """Values of ``keys`` in one round trip per server: bytes, None when absent, a
    ``Refused`` when longer than its ``limits`` entry (or not a string), or the exception
    that one key's cluster node failed with (raised only if every node failed). A
    cluster's nodes are asked in parallel; one that has not answered within ``wait``
    seconds counts as failed with a ``TimeoutError``, so a hung node costs only its keys."""
    if not keys:
        return []
    if not isinstance(client, RedisCluster):
        return _bounded_get(client, keys, limits)
    by_node: dict[str, list[int]] = {}
    nodes = {}
    for i, k in enumerate(keys):
        node = client.get_node_from_key(k)
        nodes[node.name] = node
        by_node.setdefault(node.name, []).append(i)
    budget = guard.current()
    asks = {name: NODE_CALLS.submit(_within, budget, _node_get, client, nodes[name],
                                    [keys[i] for i in idx], [limits[i] for i in idx])
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


def _within(budget: guard.CallBudget | None, fn: Any, *args: Any) -> Any:
    if budget is None:
        return fn(*args)
    with guard.bounded(budget):
        return fn(*args)


def _bounded_get(client: Any, keys: list[str], limits: Sequence[int]) -> list[Any]:
    args = [str(n) for n in limits]
    try:
        try:
            got = client.evalsha(BOUNDED_GET_SHA, len(keys), *keys, *args)
        except NoScriptError:  # a server that has not seen the script (restarted, flushed)
            got = client.eval(BOUNDED_GET, len(keys), *keys, *args)
    except ResponseError:  # no scripts here (before Redis 7, or not allowed): a GETRANGE each
        return _ranges(client, keys, limits)
    if not isinstance(got, list) or len(got) != len(keys):
        raise InvalidResponse(f"the bounded read answered {type(got).__name__}, not {len(keys)} values")
    return [_value(v, n) for v, n in zip(got, limits, strict=True)]


def _node_get(client: Any, node: Any, keys: list[str], limits: list[int]) -> list[Any]:
    return _ranges(client.get_redis_connection(node), keys, limits)


def _ranges(client: Any, keys: list[str], limits: Sequence[int]) -> list[Any]:
    """One pipeline of ``GETRANGE key 0 limit`` (a server's client, or one cluster node's)."""
    pipe = client.pipeline(transaction=False)
    for k, n in zip(keys, limits, strict=True):
        pipe.getrange(k, 0, n)  # at most n + 1 bytes: one more than usable tells "longer"
    return [_value(v, n) for v, n in zip(pipe.execute(raise_on_error=False), limits, strict=True)]


def _value(v: Any, limit: int) -> bytes | Refused | None:
    """One key's answer: ``BOUNDED_GET``'s (bytes, None, a length, -1) or ``GETRANGE``'s
    (bytes, empty when absent, an error reply for another type)."""
    if v is None or v == b"":
        return None
    if isinstance(v, bytes):
        return v if len(v) <= limit else Refused(f"longer than {limit} bytes")
    if isinstance(v, int) and v >= 0:
        return Refused(f"{v} bytes, longer than {limit}")
    if isinstance(v, BaseException) and "WRONGTYPE" not in str(v):
        return v  # the node refused the read (moved slot, ...): counted as that node's failure
    return Refused("not a string")


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


def delete_if(client: Any, key: str, expected: bytes) -> int:
    """Delete ``key`` if it still holds ``expected`` (one atomic script, on the key's node
    of a cluster): 1 if deleted, 0 if absent, -1 if it holds other bytes."""
    return int(client.eval(COMPARE_DELETE, 1, key, expected))


def prepare(client: Any) -> bool:
    """Whether the server (or a random cluster node) answers; a server also learns the
    bounded read script now, so that no lookup's budget pays for it."""
    if isinstance(client, RedisCluster):
        return bool(client.ping(target_nodes=RedisCluster.RANDOM))
    ok = bool(client.ping())
    with contextlib.suppress(ResponseError):  # scripts not allowed (ACL): lookups count their refusals
        client.script_load(BOUNDED_GET)
    return ok


def ping(client: Any) -> bool:
    """Whether the server (or a random cluster node) answers."""
    if isinstance(client, RedisCluster):
        return bool(client.ping(target_nodes=RedisCluster.RANDOM))
    return bool(client.ping())
