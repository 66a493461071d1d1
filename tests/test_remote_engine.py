"""The engine over a shared remote tier on real redis-server processes (loopback): what
one engine stores, another restores bit for bit; under every fault (server killed,
SIGSTOP, restarted empty, FLUSHALL mid-restore, a blob overwritten, maxmemory evicting,
a cluster node killed) a miss within the budget, never wrong bytes, never an exception
to the caller, the local tiers unaffected and the audit clean."""

from __future__ import annotations

import json
import os
import sqlite3
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from conftest import node_at, store_tokens, tokens_for
from redis_servers import RedisServer, redis_cluster_fixture, redis_server_fixture  # noqa: F401
from remote_backends import PATIENT, local_unaffected, prefix, restore_or_miss
from remote_engine_worker import LAYOUT, request, restored_exactly
from remote_helpers import timed, wait_until, within

from prefixstore.base import errors as E
from prefixstore.engine.api import Engine
from prefixstore.engine.config import EngineConfig
from prefixstore.gpu.remote import RemoteConfig
from prefixstore.statemachine.cost import CostModel

BUDGET = {"lookup_timeout": 0.3, "restore_timeout": 0.6, "write_timeout": 0.6, "reconnect_interval": 0.05}
"""Tight budgets, for the fault tests that bound a call by its budget."""
WORKER = Path(__file__).with_name("remote_engine_worker.py")


def open_engine(path, url: str, budget: dict = BUDGET, **options) -> Engine:
    return Engine.open(path, LAYOUT, 1 << 30, remote=url,
                       remote_options={**budget, "write_behind": False, **options})


def assert_clean(eng: Engine) -> None:
    rep = eng.audit()
    assert rep.ok, rep.violations
    assert any(n.startswith("remote tier redis") for n in rep.notes), rep.notes


# -- configuration ------------------------------------------------------------------------------


def test_options_are_checked_and_a_password_is_never_stored_or_logged(tmp_path, capfd):
    with pytest.raises(E.InvalidArgumentError) as err:
        Engine.open(tmp_path / "x", LAYOUT, 1 << 20, remote="http://h:1")
    assert err.value.argument == "remote" and not (tmp_path / "x").exists()
    with pytest.raises(E.InvalidArgumentError) as err:
        Engine.open(tmp_path / "x", LAYOUT, 1 << 20, remote="redis://h:1", remote_options={"lookup_timeout": 0})
    assert err.value.argument == "remote_options" and "lookup_timeout" in str(err.value)
    cfg = EngineConfig(remote="redis://u:s3cret-pw@127.0.0.1:1/0", remote_options={"namespace": "n1"})
    assert cfg.remote_options == RemoteConfig(namespace="n1") and "s3cret" not in repr(cfg)
    server = RedisServer(tmp_path / "redis", password="s3cret-pw").start()
    try:
        url = f"redis://default:s3cret-pw@127.0.0.1:{server.port}/0"
        tokens = tokens_for(1, 4)
        with open_engine(tmp_path / "a", url) as a:
            assert store_tokens(a, tokens).ok
            assert a.stats()["remote"]["writes"] == 1 and "s3cret" not in json.dumps(a.stats()["remote"])
            assert "s3cret" not in " ".join(a.audit().notes)
        with open_engine(tmp_path / "b", f"redis://default:wrong@127.0.0.1:{server.port}/0") as b:
            assert restore_or_miss(b, tokens) is None  # refused login: a miss, no exception
        dump = "\n".join(sqlite3.connect(tmp_path / "a" / "catalog.db").iterdump())
        assert "s3cret" not in dump and "127.0.0.1" not in dump
    finally:
        server.stop()
    out, errs = capfd.readouterr()
    assert "s3cret" not in out + errs


# -- sharing ------------------------------------------------------------------------------------


def test_one_engine_stores_another_restores_bit_for_bit_and_keeps_a_copy(redis_server, tmp_path):
    family = tokens_for(7, 6)
    with open_engine(tmp_path / "a", redis_server.url, PATIENT, write_behind=True) as a:
        assert store_tokens(a, family[:8]).ok and store_tokens(a, family).ok
    # close() flushed the write-behind queue
    with open_engine(tmp_path / "b", redis_server.url, PATIENT) as b:
        assert store_tokens(b, family[:8]).ok  # b holds the first 2 blocks locally
        m = b.lookup(prefix(family))
        assert m.hit and m.source == "remote" and m.blocks == 6 and m.path == ()
        remote_path = m.remote.hit.path  # builds on b's 2 blocks: only blocks 2-6 come from Redis
        assert [(x.start, x.end) for x in remote_path] == [(2, 6)]
        r = b.restore(m)
        restored_exactly(b, family, r)
        assert node_at(b, family) is not None  # kept locally through the store path
        m2 = b.lookup(prefix(family))
        assert m2.source == "local" and m2.blocks == 6
        restored_exactly(b, family, b.restore(m2))
        s = b.stats()
        assert s["remote"]["hits"] == 1 and s["remote"]["bytes_in"] == sum(x.nbytes for x in remote_path)
        assert m.nbytes > s["remote"]["bytes_in"]  # the match counts the local part too
        assert s["counters"]["remote.restored"] == 1 and s["counters"]["remote.kept_local"] == 1
        assert s["counters"]["remote.joined_local"] == 1
        assert s["remote"]["writes"] == 1  # its own store; the local copy is not sent back
        assert_clean(b)
        text = b.counters.registry.get_sample_value
        assert text("prefixstore_remote_hits_total") == 1
        assert text("prefixstore_remote_restores_total", {"result": "restored"}) == 1


def test_a_remote_path_built_on_the_local_part_misses_when_that_part_goes(redis_server, tmp_path):
    family = tokens_for(8, 6)
    with open_engine(tmp_path / "a", redis_server.url, PATIENT) as a:
        assert store_tokens(a, family[:8]).ok and store_tokens(a, family).ok
    with open_engine(tmp_path / "b", redis_server.url, PATIENT) as b:
        assert store_tokens(b, family[:8]).ok
        m = b.lookup(prefix(family))
        assert m.source == "remote" and m.remote.hit.path[0].start == 2
        assert b.evict(prefix=prefix(family[:8])) > 0  # the local part goes before the restore
        assert b.restore(m) is None
        assert b.stats()["counters"]["remote.missed"] == 1
        m = b.lookup(prefix(family))  # now the whole path comes from Redis
        assert [x.start for x in m.remote.hit.path] == [0, 2]
        restored_exactly(b, family, b.restore(m))
        assert_clean(b)


def test_pinning_a_remote_path_built_on_the_local_part_holds_that_part(redis_server, tmp_path):
    family = tokens_for(9, 6)
    with open_engine(tmp_path / "a", redis_server.url, PATIENT) as a:
        assert store_tokens(a, family[:8]).ok and store_tokens(a, family).ok
        whole = a.lookup(prefix(family))
    with open_engine(tmp_path / "b", redis_server.url, PATIENT) as b:
        assert store_tokens(b, family[:8]).ok
        m = b.lookup(prefix(family))
        assert m.source == "remote" and m.remote.hit.path[0].start == 2
        with b.pinned(m) as ok:
            assert ok
            assert b.evict(prefix=prefix(family[:8])) == 0  # pinned: refused
            restored_exactly(b, family, b.restore(m))
        assert whole.source == "local"
    with open_engine(tmp_path / "c", redis_server.url, PATIENT) as c:
        m = c.lookup(prefix(family))  # nothing local: the whole path from Redis, nothing to pin
        assert m.source == "remote" and m.remote.hit.path[0].start == 0
        assert not c.pin(m)
        c.unpin(m)  # nothing pinned, nothing to release


def test_the_cost_rule_weighs_the_remote_with_its_measured_bandwidth(redis_server, tmp_path):
    tokens = tokens_for(3, 5)
    with open_engine(tmp_path / "a", redis_server.url, PATIENT) as a:
        assert store_tokens(a, tokens).ok
    # prefill nearly free: no transfer is worth it; prefill dear: the remote is
    cheap = CostModel(prefill_s_per_token=1e-12, prefill_s_per_token2=0.0)
    with Engine.open(tmp_path / "b", LAYOUT, 1 << 30, remote=redis_server.url, cost=cheap,
                     remote_options={**PATIENT, "write_behind": False}) as b:
        m = b.lookup(prefix(tokens))
        assert not m.hit and b.stats()["counters"]["remote.rejected_cost"] == 1
    dear = CostModel(prefill_s_per_token=1.0)
    with Engine.open(tmp_path / "c", LAYOUT, 1 << 30, remote=redis_server.url, cost=dear,
                     remote_options={**PATIENT, "write_behind": False}) as c:
        m = c.lookup(prefix(tokens))
        assert m.hit and m.source == "remote" and m.transfer_s is not None and m.transfer_s < m.prefill_s
        restored_exactly(c, tokens, c.restore(m))


def test_engine_processes_share_one_redis(redis_server, tmp_path):
    workers, requests = 3, 15

    (tmp_path / "barrier").mkdir()
    procs = [subprocess.Popen([sys.executable, str(WORKER), str(tmp_path / "barrier"), str(tmp_path / f"e{i}"),
                               redis_server.url, str(i), str(workers), str(requests)], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": os.getcwd()})
             for i in range(workers)]
    try:
        outs = [p.communicate(timeout=120) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for p, (_, err) in zip(procs, outs, strict=True):
        assert p.returncode == 0, err[-3000:]
    got = [json.loads(o.strip().splitlines()[-1]) for o, _ in outs]
    for i, c in enumerate(got):
        mine = len(range(i, requests, workers))
        assert c == {"local": mine, "remote": requests - mine, "miss": 0}, (i, c)


# -- faults -------------------------------------------------------------------------------------


def two_engines(server_url: str, tmp_path):
    """A writer and a reader, the reader holding one request of its own locally."""
    a = open_engine(tmp_path / "a", server_url)
    b = open_engine(tmp_path / "b", server_url)
    own = tokens_for(99, 4)
    assert store_tokens(b, own).ok
    return a, b, own


def test_server_killed_then_restarted_empty(redis_server, tmp_path):
    a, b, own = two_engines(redis_server.url, tmp_path)
    try:
        x = tokens_for(1, 5)
        assert store_tokens(a, x).ok
        redis_server.stop()
        assert restore_or_miss(b, x) is None
        assert not b.stats()["remote"]["up"]
        local_unaffected(b, own)
        assert store_tokens(b, tokens_for(2, 3)).ok  # stores go on; the remote copy is dropped
        assert_clean(b)
        redis_server.restart()
        assert wait_until(lambda: b.stats()["remote"]["up"] and a.stats()["remote"]["up"])
        assert restore_or_miss(b, x) is None  # restarted empty: a miss, not stale bytes
        y = tokens_for(3, 4)
        assert store_tokens(a, y).ok
        assert restore_or_miss(b, y).match.source == "remote"
        assert_clean(b)
    finally:
        a.close()
        b.close()


def test_sigstop_hang_lookup_and_restore_within_budget(redis_server, tmp_path):
    a, b, own = two_engines(redis_server.url, tmp_path)
    try:
        x, z = tokens_for(1, 5), tokens_for(4, 3)
        assert store_tokens(a, x).ok and store_tokens(a, z).ok
        m = b.lookup(prefix(x))
        assert m.source == "remote"
        redis_server.pause()
        try:
            r, took = timed(b.restore, m)  # hangs in the server: the budget answers
            assert r is None
            within(took, BUDGET["restore_timeout"])
            assert restore_or_miss(b, z) is None
            local_unaffected(b, own)
            assert b.stats()["remote"]["timeouts"] >= 1
            assert_clean(b)
        finally:
            redis_server.resume()
        assert wait_until(lambda: b.stats()["remote"]["up"])
        assert restore_or_miss(b, z).match.source == "remote"
    finally:
        a.close()
        b.close()


def test_a_write_through_put_waits_on_the_network_outside_the_engine_lock(redis_server, tmp_path):
    """A store's write-through put hangs on a SIGSTOPped server (up to its write_timeout):
    meanwhile the engine lock is free and a local checkpoint restores; once the server
    resumes, the store returns stored and the audit is clean."""
    eng = open_engine(tmp_path / "a", redis_server.url, write_timeout=3.0)
    own, y = tokens_for(98, 4), tokens_for(2, 4)
    out: list = []
    try:
        assert store_tokens(eng, own).ok
        entered, put = threading.Event(), eng.remote.put

        def put_seen(*args, **kwargs):
            entered.set()
            return put(*args, **kwargs)

        eng.remote.put = put_seen
        redis_server.pause()
        try:
            storer = threading.Thread(target=lambda: out.append(store_tokens(eng, y)))
            storer.start()
            assert entered.wait(10.0)
            free = eng.guard.lock.acquire(timeout=1.0)
            if free:
                eng.guard.lock.release()
            assert free, "the put holds the engine lock"
            assert storer.is_alive()  # still waiting on the server
            local_unaffected(eng, own)
        finally:
            redis_server.resume()
        storer.join(10.0)
        assert not storer.is_alive() and out[0].ok, out
        assert_clean(eng)
    finally:
        eng.close()


def test_flushall_mid_restore_and_an_overwritten_blob_are_misses(redis_server, tmp_path):
    a, b, own = two_engines(redis_server.url, tmp_path)
    try:
        x, y = tokens_for(1, 5), tokens_for(2, 4)
        assert store_tokens(a, x).ok
        m = b.lookup(prefix(x))
        assert m.source == "remote"
        redis_server.client().flushall()
        assert b.restore(m) is None
        assert b.stats()["counters"]["remote.missed"] == 1
        assert store_tokens(a, y).ok
        client = redis_server.client()
        blob = next(k for k in client.keys(f"*{prefix(y).keys[-1].hex()}*:b:1:*"))
        client.set(blob, bytes(len(client.get(blob))))  # same size, other bytes
        m = b.lookup(prefix(y))
        assert m.source == "remote" and b.restore(m) is None
        assert b.stats()["remote"]["verify_failures"] == 1 and node_at(b, y) is None
        z = tokens_for(3, 4)  # a blob gone (as Redis evicts): its manifest is deleted too
        assert store_tokens(a, z).ok
        client.delete(next(k for k in client.keys(f"*{prefix(z).keys[-1].hex()}*:b:0:*")))
        m = b.lookup(prefix(z))
        assert m.source == "remote" and b.restore(m) is None
        assert wait_until(lambda: b.stats()["remote"]["forgotten"] == 1)  # z (x's was flushed already)
        assert not b.lookup(prefix(z)).hit  # later lookups miss at once
        local_unaffected(b, own)
        assert_clean(b)
    finally:
        a.close()
        b.close()


def test_a_reader_s_clean_up_never_deletes_another_engine_s_new_checkpoint(redis_server, tmp_path):
    """Engine A finds a checkpoint (manifests [0, 2) and [2, 5)) whose last blob Redis has
    lost; between A's read of that manifest and A's clean-up of it, engine B writes a new,
    whole checkpoint of the same prefix at the same key ([0, 5)). A deletes only the
    manifest it read: B's stays, and a third engine restores B's checkpoint bit for bit."""
    family = tokens_for(10, 5)
    client = redis_server.client()
    with open_engine(tmp_path / "w", redis_server.url, PATIENT) as w:
        assert store_tokens(w, family[:8]).ok and store_tokens(w, family).ok
    a, b = open_engine(tmp_path / "a", redis_server.url, PATIENT), open_engine(tmp_path / "b", redis_server.url, PATIENT)
    try:
        m = a.lookup(prefix(family))
        assert [(x.start, x.end) for x in m.remote.hit.path] == [(0, 2), (2, 5)]
        read = m.remote.hit.path[-1]
        key = a.remote.keys.manifest(read.prefix_key)
        client.delete(read.blobs[0].key)  # as Redis evicts
        before, forget = client.get(key), a.remote._forget

        def b_writes_first(manifest):  # A has read the manifest and found the blob gone
            assert store_tokens(b, family).ok
            assert client.get(key) != before  # B's manifest is there now
            forget(manifest)

        a.remote._forget = b_writes_first
        assert a.restore(m) is None
        assert wait_until(lambda: a.stats()["remote"]["forgotten"] + a.stats()["remote"].get("superseded", 0) == 1)
        with open_engine(tmp_path / "c", redis_server.url, PATIENT) as c:
            m = c.lookup(prefix(family))
            assert m.source == "remote" and [(x.start, x.end) for x in m.remote.hit.path] == [(0, 5)]
            restored_exactly(c, family, c.restore(m))
        s = a.stats()["remote"]
        assert s["forgotten"] == 0 and s["superseded"] == 1
    finally:
        a.close()
        b.close()


def test_a_remote_miss_falls_back_to_the_local_shallower_hit(redis_server, tmp_path):
    a, b, own = two_engines(redis_server.url, tmp_path)
    try:
        family = tokens_for(5, 6)
        assert store_tokens(a, family).ok and store_tokens(b, family[:8]).ok
        m = b.lookup(prefix(family))
        assert m.source == "remote" and m.blocks == 6
        redis_server.client().flushall()
        r = b.restore(m)
        assert r.match.source == "local" and r.match.blocks == 2 and r.end_tokens == 8
        restored_exactly(b, family, r)
        assert_clean(b)
    finally:
        a.close()
        b.close()


def test_maxmemory_evicting_constantly_never_gives_wrong_bytes(tmp_path):
    server = RedisServer(tmp_path / "redis", "--maxmemory-policy", "allkeys-lru").start()
    a = b = None
    try:
        a, b, own = two_engines(server.url, tmp_path)
        client = server.client()  # room for about 50 of the 80 checkpoints beside the engines'
        # connections (their buffers, ~150 KiB, count too): Redis evicts constantly
        assert wait_until(lambda: client.info("clients")["connected_clients"] >= 7)
        client.config_set("maxmemory", client.info("memory")["used_memory"] + 600_000)
        requests = [tokens_for(200 + i, 40) for i in range(80)]  # ~8 KiB per checkpoint
        for t in requests:
            assert store_tokens(a, t).ok
        assert client.info("stats")["evicted_keys"] > 0
        got = [restore_or_miss(b, t) for t in reversed(requests)]  # the newest first: LRU kept those
        hits = sum(r is not None for r in got)
        assert 0 < hits < len(requests), hits
        local_unaffected(b, own)
        assert_clean(b)
    finally:
        for e in (a, b):
            if e is not None:
                e.close()
        server.stop()


def test_cluster_node_killed_mid_run(redis_cluster, tmp_path):
    a, b, own = two_engines(redis_cluster.url, tmp_path)
    try:
        reqs = [request(i) for i in range(12)]
        for t in reqs:
            assert store_tokens(a, t).ok
        first = [restore_or_miss(b, t) for t in reqs[:6]]
        assert all(r is not None and r.match.source == "remote" for r in first)
        redis_cluster.nodes[1].stop()
        rest = [restore_or_miss(b, t) for t in reqs[6:]]
        assert any(r is None for r in rest)  # that node's keys are gone: misses
        for t in reqs[:6]:  # the copies kept locally still serve
            m = b.lookup(prefix(t))
            assert m.source == "local"
            restored_exactly(b, t, b.restore(m))
        local_unaffected(b, own)
        assert_clean(b)
    finally:
        a.close()
        b.close()


# -- replay -------------------------------------------------------------------------------------

TRACE = Path(__file__).resolve().parent.parent.parent / "shared" / "traces" / "mooncake_conversation_trace.jsonl"


@pytest.mark.slow
def test_replay_instances_share_a_remote(redis_server, tmp_path):
    if not TRACE.exists():
        pytest.fail(f"the Mooncake trace is missing: {TRACE}")
    def replay(*extra: str) -> dict:
        out = subprocess.run(
            [sys.executable, "-m", "prefixstore.cli", "replay", str(TRACE), "--limit", "200", "--instances", "3",
             "--capacity", "2.5%", "--json", "--quiet", *extra],
            capture_output=True, text=True, timeout=300, env={**os.environ, "PYTHONPATH": os.getcwd()})
        assert out.returncode == 0, out.stderr[-3000:]
        return json.loads(out.stdout)

    alone = replay()
    shared = replay("--remote", redis_server.url)
    assert alone["instances"] == shared["instances"] == 3 and alone["remote"] is None
    assert alone["restores_remote"] == 0 < shared["restores_remote"]
    assert shared["hit_ratio_tokens"] > alone["hit_ratio_tokens"]
    assert shared["wrong_bytes"] == 0 and shared["audit_ok"] and shared["remote"]["writes"] > 0


def test_a_path_held_locally_keeps_its_blobs_fresh_in_redis(redis_server, tmp_path):
    a, b, own = two_engines(redis_server.url, tmp_path)
    try:
        family = tokens_for(6, 5)
        assert store_tokens(a, family[:8]).ok and store_tokens(b, family[:8]).ok
        client = redis_server.client()
        blobs = client.keys(f"*{prefix(family[:8]).keys[-1].hex()}*:b:*")
        assert len(blobs) == 2
        time.sleep(2.2)  # Redis's LRU clock counts seconds
        assert all(client.object("idletime", k) >= 2 for k in blobs)
        m = b.lookup(prefix(family))  # local 2 blocks, the remote's deepest 2: not fetched, touched
        assert m.source == "local" and m.blocks == 2
        assert wait_until(lambda: all(client.object("idletime", k) < 2 for k in blobs), 3.0)
    finally:
        a.close()
        b.close()
