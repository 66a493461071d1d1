"""The remote tier on a real 3-master Redis Cluster, with a node killed mid-run."""

from __future__ import annotations

import time

from redis_servers import redis_cluster_fixture  # noqa: F401
from remote_helpers import blobs_for, chain, store, tier, timed, within

from prefixstore.gpu.remote import RemoteTier

SETUP_WRITE_S = 10.0  # the stores before a fault: a loaded machine must not fail them
REQUESTS = 24


def _store_all(t: RemoteTier) -> None:
    for seed in range(REQUESTS):
        keys = chain(6, seed=seed)
        store(t, keys, 0, 3, seed=2 * seed)
        store(t, keys, 3, 6, seed=2 * seed + 1)


def _read_all(t: RemoteTier) -> int:
    """Full hits among the requests (every byte read checked, every call within its own
    budget)."""
    full = 0
    for seed in range(REQUESTS):
        hit, took = timed(t.deepest, chain(6, seed=seed))
        within(took, t.config.lookup_timeout)
        got, took = timed(t.fetch_path, hit.path) if hit else ([], 0.0)
        within(took, t.config.restore_timeout)
        if hit:
            want = [blobs_for(2 * seed + (m.start > 0)) for m in hit.path]
            assert got == want[: len(got)]
            full += len(got) == 2
    return full


def test_cluster_round_trip_across_slots(redis_cluster):
    with tier(redis_cluster.url) as t:
        _store_all(t)
        assert t.flush(20)
        assert _read_all(t) == REQUESTS
        s = t.stats()
    assert s["writes"] == 2 * REQUESTS and s["errors"] == 0 and s["verify_failures"] == 0
    holders = [n.client().dbsize() for n in redis_cluster.nodes]
    assert all(n > 0 for n in holders) and sum(holders) == REQUESTS * 2 * 3


def test_cluster_node_killed_mid_run(redis_cluster):
    with tier(redis_cluster.url, write_timeout=SETUP_WRITE_S, write_behind=False, lookup_timeout=1.0,
              restore_timeout=1.0) as t:
        _store_all(t)
        assert _read_all(t) == REQUESTS
        redis_cluster.nodes[1].stop()
        full = _read_all(t)  # no exception, no wrong bytes, each call within its budget
        assert full < REQUESTS
        deadline = time.monotonic() + 20  # the other nodes keep serving their slots
        while full == 0 and time.monotonic() < deadline:
            time.sleep(0.2)
            full = _read_all(t)
        assert 0 < full < REQUESTS
        s = t.stats()
    assert s["errors"] + s["timeouts"] >= 1 and s["verify_failures"] == 0


def test_writes_failing_on_a_dead_node_leave_the_other_nodes_serving(redis_cluster):
    """After a node dies, each write that needs it fails (counted), but does not take
    the tier down: a lookup right after it still gets the live nodes' checkpoints."""
    with tier(redis_cluster.url, write_timeout=SETUP_WRITE_S, write_behind=False, lookup_timeout=1.0,
              restore_timeout=1.0) as t:
        _store_all(t)
        redis_cluster.nodes[1].stop()
        deadline = time.monotonic() + 20  # until the client has seen the node go
        while _read_all(t) == 0 and time.monotonic() < deadline:
            time.sleep(0.2)
        failed_writes = 0
        for seed in range(100, 110):
            keys = chain(6, seed=seed)
            blobs = blobs_for(seed)
            ok = t.put(keys[2], t.manifest_for(keys[2], blobs, start=0, end=3, generation=1, snapshot=False),
                       blobs)
            failed_writes += not ok
            assert t.up, "a write that failed on one node took the whole tier down"
            assert _read_all(t) > 0  # the live nodes answer at once
        assert failed_writes >= 1
        assert t.stats()["dropped"] == failed_writes


def test_cluster_node_stopped_mid_run(redis_cluster):
    """SIGSTOP on one node: calls that need it end within their budget as misses."""
    with tier(redis_cluster.url, write_timeout=SETUP_WRITE_S, write_behind=False, lookup_timeout=0.5,
              restore_timeout=0.5) as t:
        _store_all(t)
        redis_cluster.nodes[2].pause()
        try:
            full = _read_all(t)  # no exception, no wrong bytes, each call within its budget
            assert full < REQUESTS
            s = t.stats()
            assert s["timeouts"] >= 1 and s["verify_failures"] == 0
        finally:
            redis_cluster.nodes[2].resume()


def test_a_hung_node_costs_only_its_own_keys(redis_cluster):
    """SIGSTOP on one node: the nodes are asked in parallel, so the checkpoints whose keys
    all live on the other nodes are still hits (a lookup still asks the hung node for the
    chain's other keys and waits for it up to its budget), and the tier stays up; the
    hung node's keys are misses, counted as timeouts."""
    with tier(redis_cluster.url, write_timeout=SETUP_WRITE_S, write_behind=False, lookup_timeout=0.5,
              restore_timeout=0.5) as t:
        _store_all(t)
        held = {k.decode() for k in redis_cluster.nodes[2].client().keys("*")}
        on_live = [seed for seed in range(REQUESTS) if not _keys(t, seed) & held]
        assert on_live, "no request lies wholly on the other nodes: choose other seeds"
        redis_cluster.nodes[2].pause()
        try:
            for seed in on_live:
                hit, took = timed(t.deepest, chain(6, seed=seed))
                within(took, 0.5)
                assert hit is not None and hit.blocks == 6, seed
                got, took = timed(t.fetch_path, hit.path)
                within(took, 0.5)
                assert got == [blobs_for(2 * seed), blobs_for(2 * seed + 1)]
                assert t.up
            full = _read_all(t)
            assert len(on_live) <= full < REQUESTS
            assert t.stats()["timeouts"] >= 1 and t.up
        finally:
            redis_cluster.nodes[2].resume()


def _keys(t: RemoteTier, seed: int) -> set[str]:
    """The keys of request ``seed``: its manifests and their blobs."""
    hit = t.deepest(chain(6, seed=seed))
    return {t.keys.manifest(m.prefix_key) for m in hit.path} | {ref.key for m in hit.path for ref in m.blobs}
