"""The remote tier under faults of a real redis-server: a miss and a reconnect, never an
exception, never wrong bytes, never a call past its own budget (plus the SLACK of
remote_helpers)."""

from __future__ import annotations

import time

from redis_servers import RedisServer, redis_server_fixture  # noqa: F401
from remote_helpers import blobs_for, chain, store, tier, timed, wait_until, within


def test_server_killed_then_restarted_empty(redis_server):
    keys = chain(8)
    with tier(redis_server.url, write_behind=False) as t:
        blobs = store(t, keys, 0, 8, seed=1)
        hit = t.deepest(keys)
        redis_server.stop()
        assert t.deepest(keys) is None
        assert t.fetch(hit.manifest, 0) is None and t.fetch_path(hit.path) == []
        assert not t.put(keys[7], hit.manifest, blobs)
        s = t.stats()
        assert s["errors"] >= 1 and s["up"] == 0 and s["misses"] == 1 and s["dropped"] == 1
        redis_server.restart()
        assert wait_until(lambda: t.up)
        assert t.stats()["reconnects"] == 1
        assert t.deepest(keys) is None  # restarted empty: a miss, not stale bytes
        store(t, keys, 0, 8, seed=1)
        assert t.fetch_path(t.deepest(keys).path) == [blobs]


def test_sigstop_hang_returns_within_the_budget(redis_server):
    keys = chain(8)
    with tier(redis_server.url, lookup_timeout=0.3, restore_timeout=0.5, write_behind=False) as t:
        store(t, keys, 0, 8, seed=1)
        hit = t.deepest(keys)
        redis_server.pause()
        try:
            out, took = timed(t.deepest, keys)
            assert out is None
            within(took, 0.3)
            assert t.stats()["timeouts"] == 1 and not t.up
            out, took = timed(t.fetch_path, hit.path)  # down: answered at once
            assert out == [] and t.stats()["skipped"] >= 1
            within(took, 0.0)
        finally:
            redis_server.resume()
        assert wait_until(lambda: t.up)
        assert t.fetch_path(hit.path) == [blobs_for(1)]


def test_sigstop_during_restore_and_close_are_bounded(redis_server):
    keys = chain(8)
    t = tier(redis_server.url, restore_timeout=0.5, write_timeout=0.5, write_attempts=2)
    try:
        store(t, keys, 0, 8, seed=1)
        assert t.flush(10)
        hit = t.deepest(keys)
        redis_server.pause()
        out, took = timed(t.fetch, hit.manifest, 1)
        assert out is None and t.stats()["timeouts"] == 1
        within(took, 0.5)
        store(t, keys, 0, 4, seed=2)  # queued: the caller does not wait
        done, took = timed(t.close, 0.5)
        within(took, 0.5)
        assert done is False or t.stats()["dropped"] == 1
    finally:
        redis_server.resume()
        t.close()


def test_flushall_between_manifest_and_blob_read(redis_server):
    keys = chain(8)
    with tier(redis_server.url, write_behind=False) as t:
        store(t, keys, 0, 4, seed=1)
        store(t, keys, 4, 8, seed=2)
        hit = t.deepest(keys)
        redis_server.client().flushall()
        assert t.fetch_path(hit.path) == []
        assert t.fetch(hit.manifest, 0) is None
        s = t.stats()
        assert s["fetch_misses"] == 5 and s["verify_failures"] == 0 and s["up"] == 1


def test_altered_truncated_or_foreign_bytes_are_misses(redis_server):
    keys = chain(8)
    r = redis_server.client()
    with tier(redis_server.url, write_behind=False) as t:
        first = store(t, keys, 0, 4, seed=1)
        store(t, keys, 4, 8, seed=2)
        hit = t.deepest(keys)
        m0, m1 = hit.path
        good = r.get(m1.blobs[1].key)
        r.set(m1.blobs[1].key, bytes([good[0] ^ 1]) + good[1:])  # same size, other bytes
        assert t.fetch(m1, 1) is None
        assert t.fetch_path(hit.path) == [first]  # the longest verified prefix
        r.set(m1.blobs[1].key, good[:-1])  # truncated
        assert t.fetch(m1, 1) is None
        r.set(m1.blobs[1].key, good)
        assert t.fetch(m1, 1) == good
        assert t.stats()["verify_failures"] == 3

        manifest = r.get(t.keys.manifest(keys[7]))
        r.set(t.keys.manifest(keys[7]), manifest.replace(b'"generation":1', b'"generation":2'))
        assert t.deepest(keys).blocks == 4  # an altered manifest is refused
        r.set(t.keys.manifest(keys[7]), manifest[:-3])
        assert t.deepest(keys).blocks == 4
        r.set(t.keys.manifest(keys[7]), t.keys.manifest(keys[3]).encode())  # not JSON
        assert t.deepest(keys).blocks == 4
        r.set(t.keys.manifest(keys[7]), r.get(t.keys.manifest(keys[3])))  # another key's
        assert t.deepest(keys).blocks == 4
        r.delete(t.keys.manifest(keys[3]))
        assert t.deepest(keys) is None
        assert t.stats()["verify_failures"] == 3 + 4 + 1


def test_constant_eviction_never_gives_wrong_bytes(tmp_path):
    """maxmemory a few hundred KiB past what Redis itself uses (a literal ``1mb`` is below
    a Redis 7.0 server's own footprint with three clients connected, ~1 MiB, so it
    refuses every write): it evicts on almost every write."""
    server = RedisServer(tmp_path / "redis", "--maxmemory-policy", "allkeys-lru").start()
    try:
        with tier(server.url, write_behind=False) as t:
            warm = chain(1, seed=999)  # every client the tier holds connects before the limit is set
            t.put(warm[0], t.manifest_for(warm[0], blobs_for(999, size=16), start=0, end=1,
                                          generation=1, snapshot=False), blobs_for(999, size=16))
            t.fetch_path(t.deepest(warm).path)
            r = server.client()
            r.config_set("maxmemory", r.info("memory")["used_memory"] + 384 * 1024)
            hits = 0
            for seed in range(40):
                keys = chain(4, seed=seed)
                for start, end, s in ((0, 2, 2 * seed), (2, 4, 2 * seed + 1)):
                    blobs = blobs_for(s, size=4096)
                    m = t.manifest_for(keys[end - 1], blobs, start=start, end=end,
                                       generation=1, snapshot=False)
                    t.put(keys[end - 1], m, blobs)
                for old in range(0, seed + 1, 3):
                    hit = t.deepest(chain(4, seed=old))
                    if hit is None:
                        continue
                    got = t.fetch_path(hit.path)
                    want = [blobs_for(2 * old + (m.start > 0), size=4096) for m in hit.path]
                    assert got == want[: len(got)]
                    hits += len(got) == len(want)
            evicted = server.client().info("stats")["evicted_keys"]
            s = t.stats()
        assert evicted > 0 and s["misses"] > 0 and hits > 0
        assert s["verify_failures"] == 0 and s["timeouts"] == 0
    finally:
        server.stop()


def test_write_behind_queue_is_bounded_and_counted(redis_server):
    keys = chain(8)
    t = tier(redis_server.url, queue_items=2, write_timeout=0.3, write_attempts=1)
    try:
        redis_server.pause()
        accepted = [t.put(keys[7], m, b) for m, b in [_checkpoint(t, keys, s) for s in range(6)]]
        assert accepted.count(False) >= 3 and t.stats()["queue_depth"] <= 3
    finally:
        redis_server.resume()
    assert t.close(10)
    s = t.stats()
    assert s["writes"] + s["dropped"] == 6 and s["dropped"] >= 3 and s["queue_depth"] == 0


def test_write_behind_waits_out_an_outage(redis_server):
    """Queued checkpoints wait for the reconnect (each attempt bounded by write_timeout)
    instead of spending their attempts while the server is known to be down."""
    keys = chain(4)
    t = tier(redis_server.url)  # default attempts and backoff
    try:
        assert wait_until(lambda: t.stats()["up"] == 1 and t.deepest(keys) is None)
        redis_server.stop()
        assert t.deepest(keys) is None and not t.up
        blobs = store(t, keys, 0, 4, seed=3)
        time.sleep(1.0)
        redis_server.restart()
        assert t.flush(20)
        s = t.stats()
        assert s["writes"] == 1 and s["dropped"] == 0, s
        assert wait_until(lambda: t.up)
        assert t.fetch_path(t.deepest(keys).path) == [blobs]
    finally:
        t.close()


def _checkpoint(t, keys, seed):
    blobs = blobs_for(seed)
    return t.manifest_for(keys[7], blobs, start=0, end=8, generation=seed, snapshot=False), blobs
