"""No remote reply is read past what the call can use: a hostile server's 4 GB length
costs a bounded read and the connection, a trickled reply ends at the budget with its
connection closed, and one oversized or foreign value at a key is that key's miss, never
a failure of the tier."""

from __future__ import annotations

import contextlib
import time
from pathlib import Path

import redis
from redis_servers import HostileRedis, redis_cluster_fixture, redis_server_fixture  # noqa: F401
from remote_helpers import chain, store, tier, timed, wait_until, within

HUGE = b"$4000000000\r\n"  # a bulk string of 4 GB, as the header of any reply


def _reset_peak_rss() -> None:
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := the current RSS


def _peak_rss() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmHWM in /proc/self/status")


def test_a_4gb_reply_costs_the_call_s_byte_budget_not_4gb():
    """The server floods 256 MiB after the header (as fast as the client reads): the
    lookup reads about its byte budget (a manifest's maximum per key, plus the call's
    allowance), then fails and drops the connection; the process's peak RSS grows by a
    few MiB, not by what the server sends."""
    with HostileRedis(HUGE, flood=256 << 20) as server, tier(server.url, lookup_timeout=0.5) as t:
        keys = chain(8)
        _reset_peak_rss()
        before = _peak_rss()
        out, took = timed(t.deepest, keys)
        assert out is None
        within(took, 0.5)
        assert wait_until(lambda: server.closed.is_set() or server.sent >= server.flood)
        grown = _peak_rss() - before
        assert grown < 64 << 20, f"peak RSS grew by {grown >> 20} MiB"
        assert server.closed.is_set() and server.sent < 16 << 20, server.sent  # its socket buffers, at most
        s = t.stats()
        assert s["oversized"] == 1 and s["errors"] == 1 and s["misses"] == 1


def test_a_trickled_reply_ends_at_the_budget_and_its_connection_is_closed():
    """The server sends one byte of a 4 GB reply every 20 ms: the lookup is a miss within
    its budget, and its connection is closed then too (its thread stops reading)."""
    with HostileRedis(HUGE, interval=0.02) as server, tier(server.url, lookup_timeout=0.5) as t:
        start = time.monotonic()
        out, took = timed(t.deepest, chain(8))
        assert out is None
        within(took, 0.5)
        assert server.closed.wait(2.0), "the reader kept the connection open past its budget"
        within(server.closed_at - start, 0.5)
        s = t.stats()
        assert s["timeouts"] == 1 and s["misses"] == 1


def test_a_128mib_value_at_one_key_is_that_key_s_miss(redis_server):
    """A 128 MiB value at one manifest key (made in Redis: SETRANGE) is refused unread
    by size: its lookup returns within the budget with the rest of its own chain, 8
    healthy prefixes stay remote hits right after, and the tier stays up. The same for
    a 128 MiB blob and for a value of another type (a list) at a manifest key."""
    r = redis_server.client()
    with tier(redis_server.url, write_behind=False, lookup_timeout=0.5, restore_timeout=1.0) as t:
        healthy = [chain(4, seed=s) for s in range(1, 9)]
        stored = [store(t, keys, 0, 4, seed=s) for s, keys in enumerate(healthy, 1)]
        bad = chain(4, seed=20)
        store(t, bad, 0, 2, seed=20)
        r.setrange(t.keys.manifest(bad[3]), (128 << 20) - 1, b"x")

        hit, took = timed(t.deepest, bad)
        within(took, 0.5)
        assert hit is not None and hit.blocks == 2  # the chain's intact checkpoint below it
        got = [t.fetch_path(h.path) if (h := t.deepest(keys)) else None for keys in healthy]
        assert got == [[b] for b in stored], "healthy prefixes missed after one oversized value"
        s = t.stats()
        assert s["hits"] == 9 and s["up"] == 1 and s["timeouts"] == s["errors"] == 0
        assert s["oversized"] == 1 and s["verify_failures"] == 0

        first = t.deepest(healthy[0])
        r.setrange(first.manifest.blobs[1].key, (128 << 20) - 1, b"x")  # a 128 MiB blob
        fetched, took = timed(t.fetch_path, first.path)
        within(took, 1.0)
        assert fetched == [] and t.stats()["oversized"] == 2
        r.delete(t.keys.manifest(healthy[1][3]))
        r.rpush(t.keys.manifest(healthy[1][3]), b"not a string")
        assert t.deepest(healthy[1]) is None and t.stats()["oversized"] == 3
        assert [t.fetch_path(t.deepest(k).path) for k in healthy[2:]] == [[b] for b in stored[2:]]
        assert t.up and t.stats()["timeouts"] == t.stats()["errors"] == 0


def test_a_cluster_refuses_an_oversized_value_per_key(redis_cluster):
    """On a cluster (GETRANGE per key, on each key's node) the same: an oversized
    manifest is its own key's miss, the others hit."""
    with tier(redis_cluster.url, write_behind=False, write_timeout=10.0, lookup_timeout=1.0) as t:
        healthy = [chain(4, seed=s) for s in range(1, 5)]
        stored = [store(t, keys, 0, 4, seed=s) for s, keys in enumerate(healthy, 1)]
        bad = chain(4, seed=20)
        store(t, bad, 0, 2, seed=20)
        key = t.keys.manifest(bad[3])
        for node in redis_cluster.nodes:  # the node holding the key's slot takes the write
            with contextlib.suppress(redis.ResponseError):  # MOVED: another node's slot
                node.client().setrange(key, (32 << 20) - 1, b"x")
                break
        hit, took = timed(t.deepest, bad)
        within(took, 1.0)
        assert hit is not None and hit.blocks == 2 and t.stats()["oversized"] == 1
        assert [t.fetch_path(t.deepest(k).path) for k in healthy] == [[b] for b in stored]
        assert t.up and t.stats()["errors"] == t.stats()["timeouts"] == 0



def test_replies_redis_py_cannot_read_are_misses_not_exceptions():
    """A handshake answered with another type (HELLO answered by a bulk string, which
    redis-py cannot read as a map) and a data reply of garbage: misses, counted, never
    an exception into the caller."""
    with HostileRedis(HUGE, hello=b"$3\r\nabc\r\n") as server, tier(server.url, lookup_timeout=0.5) as t:
        out, took = timed(t.deepest, chain(4))
        assert out is None and t.stats()["errors"] >= 1
        within(took, 0.5)
    with HostileRedis(b"!not resp\r\n") as server, tier(server.url, lookup_timeout=0.5) as t:
        out, took = timed(t.deepest, chain(4))
        assert out is None and t.stats()["errors"] == 1
        within(took, 0.5)
