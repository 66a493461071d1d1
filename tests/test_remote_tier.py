"""The Redis remote tier against a real redis-server: round trips, isolation, processes."""

from __future__ import annotations

import multiprocessing
from pathlib import Path

import pytest
from conftest import make_layout
from prometheus_client import CollectorRegistry, generate_latest
from redis_servers import redis_server_fixture  # noqa: F401
from remote_helpers import LAYOUT, blobs_for, chain, store, tier

from prefixstore.base.errors import InvalidArgumentError
from prefixstore.gpu import shards
from prefixstore.gpu.remote import RemoteCollector, RemoteConfig, RemoteTier


def test_round_trip_bit_for_bit(redis_server):
    keys = chain(12)
    with tier(redis_server.url) as t:
        first = store(t, keys, 0, 4, seed=1)
        second = store(t, keys, 4, 8, seed=2, snapshot=True)
        assert t.flush(5)
        hit = t.deepest(keys)
        assert hit is not None and hit.blocks == 8 and hit.index == 7
        assert [(m.start, m.end) for m in hit.path] == [(0, 4), (4, 8)]
        assert hit.manifest.snapshot and hit.manifest.generation == 1
        assert t.fetch_path(hit.path) == [first, second]
        assert [t.fetch(hit.manifest, r) for r in range(2)] == second
        known = t.manifest_for(keys[7], second, start=4, end=8, generation=1, snapshot=True,
                               checksums=[shards.checksum(b) for b in second])
        assert known == hit.manifest
        s = t.stats()
    assert s["writes"] == 2 and s["hits"] == 1 and s["misses"] == 0
    assert s["bytes_in"] == 2 * sum(map(len, second)) + sum(map(len, first))
    assert s["bytes_out"] > sum(map(len, first + second)) and s["verify_failures"] == 0
    assert s["queue_depth"] == 0 and s["up"] == 1
    assert s["lookup_seconds"] > 0 and s["fetch_seconds"] > 0


def test_lookup_and_restore_are_one_command_each(redis_server):
    """One bounded read script each (its STRLEN of every key, and GET only of the values
    short enough to use, are counted by the server as the script's own calls)."""
    keys = chain(32)
    r = redis_server.client()
    with tier(redis_server.url, write_behind=False) as t:
        for start in range(0, 32, 4):
            store(t, keys, start, start + 4, seed=start)
        r.config_resetstat()
        hit = t.deepest(keys)
        assert hit.blocks == 32 and len(hit.path) == 8
        assert len(t.fetch_path(hit.path)) == 8
        stats = r.info("commandstats")
    data_calls = {k: v["calls"] for k, v in stats.items() if k not in ("cmdstat_info", "cmdstat_ping", "cmdstat_config|resetstat")}
    assert data_calls == {"cmdstat_evalsha": 2, "cmdstat_strlen": 32 + 16, "cmdstat_get": 8 + 16}


def test_deepest_needs_a_covered_path_from_what_is_held(redis_server):
    keys = chain(12)
    with tier(redis_server.url, write_behind=False) as t:
        store(t, keys, 4, 8, seed=2)  # no checkpoint of blocks [0, 4)
        assert t.deepest(keys) is None
        hit = t.deepest(keys, have=4)  # blocks [0, 4) held locally
        assert hit is not None and hit.blocks == 8 and len(hit.path) == 1
        store(t, keys, 0, 4, seed=1)
        store(t, keys, 8, 10, seed=3, snapshot=True)
        assert t.deepest(keys).blocks == 10
        assert t.deepest(keys[:9]).blocks == 8
        store(t, keys, 10, 12, seed=4)
        assert t.deepest(keys).blocks == 12
        assert t.deepest(keys, need_snapshot=True).blocks == 10
        assert t.stats()["misses"] == 1


def test_a_path_builds_on_what_the_caller_reaches_and_names_the_copy_below(redis_server):
    keys = chain(12)
    with tier(redis_server.url, write_behind=False) as t:
        for seed, (start, end) in enumerate([(0, 4), (4, 8), (8, 12)]):
            store(t, keys, start, end, seed=seed)
        full = t.deepest(keys)
        assert [(m.start, m.end) for m in full.path] == [(0, 4), (4, 8), (8, 12)] and full.below == ()
        hit = t.deepest(keys, reach=6)  # blocks [0, 6) readable locally: build on [4, 8)
        assert [(m.start, m.end) for m in hit.path] == [(4, 8), (8, 12)]
        assert [(m.start, m.end) for m in hit.below] == [(0, 4)]  # the remote's own copy of [0, 4)
        hit = t.deepest(keys, have=4, reach=8)
        assert [(m.start, m.end) for m in hit.path] == [(8, 12)] and [m.end for m in hit.below] == [8]
        held = t.deepest(keys[:8], reach=8)  # nothing past what is reachable: the remote's own path
        assert [(m.start, m.end) for m in held.path] == [(0, 4), (4, 8)] and held.below == ()
        assert t.deepest(keys, have=9, reach=5) is not None  # reach below have counts as have
        assert t.stats()["lookups"] == 5


def test_a_reused_buffer_does_not_change_what_is_queued(redis_server):
    keys = chain(4)
    with tier(redis_server.url) as t:
        blobs = blobs_for(6)
        staged = [bytearray(b) for b in blobs]
        m = t.manifest_for(keys[3], blobs, start=0, end=4, generation=1, snapshot=False)
        assert t.put(keys[3], m, [memoryview(b) for b in staged])
        for b in staged:
            b[:] = bytes(len(b))  # the caller reuses its staging buffers at once
        assert t.flush(5)
        assert t.fetch_path(t.deepest(keys).path) == [blobs]


def test_write_through_returns_once_stored(redis_server):
    keys = chain(4)
    with tier(redis_server.url, write_behind=False) as t:
        blobs = store(t, keys, 0, 4, seed=5)
        hit = t.deepest(keys)  # no flush: the put already landed
        assert hit and t.fetch_path(hit.path) == [blobs]


def test_namespaces_and_layouts_never_read_each_other(redis_server):
    keys = chain(4)
    other_layout = make_layout(ranks=2, dtype="float16")
    a = tier(redis_server.url, namespace="a", write_behind=False)
    b = tier(redis_server.url, namespace="b", write_behind=False)
    c = tier(redis_server.url, layout=other_layout, namespace="a", write_behind=False)
    try:
        blobs_a = store(a, keys, 0, 4, seed=1)
        assert b.deepest(keys) is None and c.deepest(keys) is None
        blobs_c = store(c, keys, 0, 4, seed=2)
        assert blobs_c != blobs_a
        assert a.fetch_path(a.deepest(keys).path) == [blobs_a]
        assert c.fetch_path(c.deepest(keys).path) == [blobs_c]
        assert b.deepest(keys) is None
        names = [k.decode() for k in redis_server.client().keys("*")]
        assert len(names) == 6
        assert {n.startswith(a.keys.base) or n.startswith(c.keys.base) for n in names} == {True}
        assert a.keys.base != c.keys.base
    finally:
        for t in (a, b, c):
            t.close()


def test_a_manifest_read_at_another_key_space_is_refused(redis_server):
    keys = chain(4)
    other = make_layout(ranks=2, dtype="float16")
    with tier(redis_server.url, write_behind=False) as a, \
            tier(redis_server.url, layout=other, write_behind=False) as c:
        store(a, keys, 0, 4, seed=1)
        r = redis_server.client()
        r.set(c.keys.manifest(keys[3]), r.get(a.keys.manifest(keys[3])))  # copied across
        assert c.deepest(keys) is None
        assert c.stats()["verify_failures"] == 1


def _store_in_child(url: str) -> None:
    t = tier(url)
    keys = chain(8, seed=3)
    store(t, keys, 0, 3, seed=10)
    store(t, keys, 3, 8, seed=11)
    assert t.close(10)


def _fetch_in_child(url: str, out: str) -> None:
    t = tier(url)
    hit = t.deepest(chain(8, seed=3))
    assert hit is not None and hit.blocks == 8, hit
    Path(out).write_bytes(b"".join(b for m in t.fetch_path(hit.path) for b in m))
    t.close()


def test_processes_share_one_server(redis_server, tmp_path):
    """One process stores, another (another engine's tier) fetches bit for bit."""
    fork = multiprocessing.get_context("fork")
    out = tmp_path / "fetched"
    for target, args in ((_store_in_child, (redis_server.url,)),
                         (_fetch_in_child, (redis_server.url, str(out)))):
        p = fork.Process(target=target, args=args)
        p.start()
        p.join(60)
        assert p.exitcode == 0
    assert out.read_bytes() == b"".join(blobs_for(10) + blobs_for(11))


def test_prometheus_names(redis_server):
    keys = chain(4)
    with tier(redis_server.url, write_behind=False) as t:
        store(t, keys, 0, 4, seed=1)
        t.deepest(keys)
        reg = CollectorRegistry()
        reg.register(RemoteCollector(t.stats))
        text = generate_latest(reg).decode()
    assert "prefixstore_remote_hits_total 1.0" in text
    assert "prefixstore_remote_writes_total 1.0" in text
    assert "prefixstore_remote_queue_depth 0.0" in text
    assert "prefixstore_remote_up 1.0" in text


@pytest.mark.parametrize(("option", "value"), [
    ("lookup_timeout", 0), ("restore_timeout", -1.0), ("queue_items", 0), ("namespace", "a:b"),
    ("namespace", ""), ("write_behind", "yes"), ("ttl", float("inf")), ("tls", {"cert": "x"}),
])
def test_bad_options_are_refused_by_name(option, value):
    with pytest.raises(InvalidArgumentError) as e:
        RemoteConfig(**{option: value})
    assert e.value.argument == option


def test_bad_put_is_refused(redis_server):
    keys = chain(4)
    with tier(redis_server.url) as t:
        with pytest.raises(InvalidArgumentError):
            t.manifest_for(keys[3], blobs_for(1, ranks=3), start=0, end=4, generation=1,
                           snapshot=False)
        blobs = blobs_for(1)
        m = t.manifest_for(keys[3], blobs, start=0, end=4, generation=1, snapshot=False)
        with pytest.raises(InvalidArgumentError):
            t.put(keys[2], m, blobs)
    with pytest.raises(InvalidArgumentError) as e:
        RemoteTier(redis_server.url, LAYOUT.to_json(), 0)
    assert e.value.argument == "ranks"
    with pytest.raises(InvalidArgumentError) as e:
        RemoteTier(redis_server.url, LAYOUT.to_json(), 2, {"namespace": "x"})
    assert e.value.argument == "config"
    plain = RemoteTier(redis_server.url, LAYOUT.to_json(), 2)
    plain.close()
    assert plain.keys.base == t.keys.base
