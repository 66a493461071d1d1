"""The remote-tier contract: the same tests on every registered backend, each against its
real servers on loopback (Redis: one redis-server; Mooncake Store: a mooncake_master with
its HTTP metadata server and one storage node lending it memory, TCP transport). Two
engines share checkpoints bit for bit; a tampered blob is a counted miss, a lost one a
miss whose manifest is then forgotten; a killed or SIGSTOPped server costs each call at
most its budget plus ``remote_helpers.SLACK``, never wrong bytes, never an exception,
and the tier comes back after a restart; the shared key (HMAC) works. (Engine processes and
the replay's instances sharing the store: test_remote_engine.py for Redis,
test_remote_mooncake.py for Mooncake.)

One store per backend serves the whole module (``remote_backends``); each test works in
a namespace of its own.
"""

from __future__ import annotations

import pytest
from conftest import node_at, store_tokens, tokens_for
from remote_backends import (
    BACKENDS,
    BUDGET,
    PATIENT,
    Remote,
    assert_clean,
    blob_of,
    local_unaffected,
    namespace_for,
    prefix,
    restore_or_miss,
    serve,
    two_engines,
)
from remote_engine_worker import restored_exactly
from remote_helpers import blobs_for, chain, store, timed, wait_until, within

from prefixstore.gpu import shards

KEY = "k3y-of-this-deployment-0123456789"
OTHER = "another-tenant's-key-9876543210"


@pytest.fixture(name="served", scope="module", params=BACKENDS)
def served_fixture(request, tmp_path_factory):
    """The module's store of one backend (started once, closed after the module)."""
    s = serve(request.param, tmp_path_factory.mktemp(request.param))
    try:
        yield s
    finally:
        s.close()


@pytest.fixture(name="remote")
def remote_fixture(served, request) -> Remote:
    return Remote(served.fresh(), namespace_for(request))


# -- sharing ------------------------------------------------------------------------------------


def test_two_engines_share_checkpoints_bit_for_bit(remote, tmp_path):
    family = tokens_for(7, 6)
    with remote.open(tmp_path / "a", PATIENT, write_behind=True) as a:
        assert store_tokens(a, family[:8]).ok and store_tokens(a, family).ok
    # close() flushed the write-behind queue
    with remote.open(tmp_path / "b", PATIENT) as b:
        assert store_tokens(b, family[:8]).ok  # b holds the first 2 blocks locally
        m = b.lookup(prefix(family))
        assert m.hit and m.source == "remote" and m.blocks == 6
        remote_path = m.remote.hit.path  # builds on b's 2 blocks: only blocks 2-6 are fetched
        assert [(x.start, x.end) for x in remote_path] == [(2, 6)]
        restored_exactly(b, family, b.restore(m))
        assert node_at(b, family) is not None  # kept locally through the store path
        m2 = b.lookup(prefix(family))
        assert m2.source == "local" and m2.blocks == 6
        s = b.stats()
        assert s["remote"]["hits"] == 1 and s["remote"]["bytes_in"] == sum(x.nbytes for x in remote_path)
        assert s["counters"]["remote.restored"] == 1 and s["counters"]["remote.kept_local"] == 1
        assert s["remote"]["writes"] == 1 and s["remote"]["verify_failures"] == 0
        assert_clean(b, remote)
    with remote.open(tmp_path / "c", PATIENT) as c:  # nothing local: the whole path from the store
        m = c.lookup(prefix(family))
        assert [(x.start, x.end) for x in m.remote.hit.path] == [(0, 2), (2, 6)]
        restored_exactly(c, family, c.restore(m))


# -- damage -------------------------------------------------------------------------------------


def test_a_tampered_blob_is_a_counted_miss_and_a_lost_one_is_forgotten(remote, tmp_path):
    a, b, own = two_engines(remote, tmp_path, PATIENT)
    try:
        y, z = tokens_for(2, 4), tokens_for(3, 4)
        assert store_tokens(a, y).ok and store_tokens(a, z).ok
        ref = blob_of(a, y, 1)
        remote.served.write(ref.key, bytes(ref.size))  # same size, other bytes
        m = b.lookup(prefix(y))
        assert m.source == "remote" and b.restore(m) is None
        s = b.stats()
        assert s["remote"]["verify_failures"] == 1 and s["counters"]["remote.missed"] == 1
        assert node_at(b, y) is None  # nothing kept locally
        lost = blob_of(a, z, 0)
        remote.served.remove(lost.key)  # as the store evicts
        m = b.lookup(prefix(z))
        assert m.source == "remote" and b.restore(m) is None
        assert wait_until(lambda: b.stats()["remote"]["forgotten"] == 1)  # its manifest is deleted
        assert not b.lookup(prefix(z)).hit  # later lookups miss at once
        assert b.stats()["remote"]["verify_failures"] == 1
        local_unaffected(b, own)
        assert_clean(b, remote)
    finally:
        a.close()
        b.close()


# -- faults -------------------------------------------------------------------------------------


def test_a_killed_server_is_a_bounded_miss_and_the_tier_comes_back(remote, tmp_path):
    a, b, own = two_engines(remote, tmp_path)
    try:
        x = tokens_for(1, 5)
        assert store_tokens(a, x).ok
        remote.served.kill()
        assert restore_or_miss(b, x) is None
        assert not b.stats()["remote"]["up"]
        assert restore_or_miss(b, x) is None and b.stats()["remote"]["skipped"] >= 1  # down: at once
        local_unaffected(b, own)
        assert store_tokens(b, tokens_for(2, 3)).ok  # stores go on; the remote copy is dropped
        assert_clean(b, remote)
        remote.served.restart()
        assert wait_until(lambda: b.stats()["remote"]["up"])
        assert b.stats()["remote"]["reconnects"] == 1
        assert restore_or_miss(b, x) is None  # restarted empty: a miss, not stale bytes
        y = tokens_for(3, 4)
        assert store_tokens(a, y).ok
        assert restore_or_miss(b, y).match.source == "remote"
        assert_clean(b, remote)
    finally:
        a.close()
        b.close()


def test_a_stopped_server_costs_each_call_its_budget(remote, tmp_path):
    a, b, own = two_engines(remote, tmp_path)
    try:
        x, z = tokens_for(1, 5), tokens_for(4, 3)
        assert store_tokens(a, x).ok and store_tokens(a, z).ok
        m = b.lookup(prefix(x))
        assert m.source == "remote"
        remote.served.pause()
        try:
            r, took = timed(b.restore, m)  # hangs in the server: the budget answers
            assert r is None
            within(took, BUDGET["restore_timeout"])
            assert restore_or_miss(b, z) is None
            local_unaffected(b, own)
            assert b.stats()["remote"]["timeouts"] >= 1
            assert_clean(b, remote)
        finally:
            remote.served.resume()
        assert wait_until(lambda: b.stats()["remote"]["up"])
        assert restore_or_miss(b, z).match.source == "remote"
    finally:
        a.close()
        b.close()


# -- the shared key -----------------------------------------------------------------------------


@pytest.fixture(name="keys_in_env")
def keys_in_env_fixture(monkeypatch):
    monkeypatch.setenv("PS_TEST_KEY", KEY)
    monkeypatch.setenv("PS_TEST_OTHER", OTHER)


def test_engines_with_the_shared_key_share_and_others_miss(remote, tmp_path, keys_in_env):
    tokens = tokens_for(4, 5)
    with remote.open(tmp_path / "a", PATIENT, auth_key_env="PS_TEST_KEY") as a:
        assert store_tokens(a, tokens).ok
    with remote.open(tmp_path / "b", PATIENT, auth_key_env="PS_TEST_KEY") as b:
        m = b.lookup(prefix(tokens))
        assert m.source == "remote"
        restored_exactly(b, tokens, b.restore(m))
    for name, options in (("c", {}), ("d", {"auth_key_env": "PS_TEST_OTHER"})):
        with remote.open(tmp_path / name, PATIENT, **options) as other:  # no key, another key
            assert not other.lookup(prefix(tokens)).hit
            assert other.stats()["remote"]["verify_failures"] == 1


def test_a_blob_whose_checksum_matches_is_still_refused_by_its_mac(remote, keys_in_env, monkeypatch):
    """Were the unkeyed blob checksum forgeable (here: one every blob has), other bytes of
    the right size at a blob's key would pass it; the blob's MAC refuses them."""
    monkeypatch.setattr(shards, "checksum", lambda data: "0" * 32)
    keys = chain(4)
    with remote.tier(write_behind=False, auth_key_env="PS_TEST_KEY") as keyed:
        good = store(keyed, keys, 0, 4, seed=1)
        hit = keyed.deepest(keys)
        forged = blobs_for(99)[0][: len(good[0])]
        remote.served.write(hit.manifest.blobs[0].key, forged)
        assert keyed.fetch(hit.manifest, 0) is None and keyed.fetch_path(hit.path) == []
        assert keyed.stats()["verify_failures"] == 2
        assert keyed.fetch(hit.manifest, 1) == good[1]  # the other rank's blob is intact


def test_closing_while_the_server_is_stopped_is_bounded(remote):
    keys = chain(8)
    t = remote.tier(restore_timeout=0.5, write_timeout=0.5, write_attempts=2)
    try:
        store(t, keys, 0, 8, seed=1)
        assert t.flush(10)
        hit = t.deepest(keys)
        remote.served.pause()
        out, took = timed(t.fetch, hit.manifest, 1)
        assert out is None and t.stats()["timeouts"] == 1
        within(took, 0.5)
        store(t, keys, 0, 4, seed=2)  # queued: the caller does not wait
        done, took = timed(t.close, 0.5)
        within(took, 0.5)
        assert done is False or t.stats()["dropped"] == 1
    finally:
        remote.served.resume()
        t.close()
