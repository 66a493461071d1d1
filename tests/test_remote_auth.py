"""Authenticated content (an optional shared key): a checkpoint written without the key,
or with another, is a verify failure for an engine that holds it; the same key shares
bit for bit; a blob that verifies by size and checksum but names another checkpoint in
its header is a verify failure too, counted. Real redis-server processes on loopback."""

from __future__ import annotations

import pytest
from conftest import node_at, store_tokens, tokens_for
from redis_servers import redis_server_fixture  # noqa: F401
from remote_engine_worker import LAYOUT, restored_exactly
from remote_helpers import blobs_for, chain, store, tier

from prefixstore.base.errors import InvalidArgumentError
from prefixstore.base.keys import Prefix
from prefixstore.engine.api import Engine
from prefixstore.gpu import shards
from prefixstore.gpu.remote import RemoteConfig, manifest

KEY = "k3y-of-this-deployment-0123456789"
OTHER = "another-tenant's-key-9876543210"


@pytest.fixture(name="keys_in_env")
def keys_in_env_fixture(monkeypatch):
    monkeypatch.setenv("PS_TEST_KEY", KEY)
    monkeypatch.setenv("PS_TEST_OTHER", OTHER)


def test_the_key_comes_from_an_env_var_or_a_file_and_is_never_shown(redis_server, tmp_path, keys_in_env):
    path = tmp_path / "key"
    path.write_text(KEY + "\n")  # a trailing newline is not part of the key
    keys = chain(4)
    with tier(redis_server.url, write_behind=False, auth_key_env="PS_TEST_KEY") as writer, \
            tier(redis_server.url, write_behind=False, auth_key_file=str(path)) as reader:
        blobs = store(writer, keys, 0, 4, seed=1)
        assert reader.fetch_path(reader.deepest(keys).path) == [blobs]
        shown = [repr(writer), repr(writer.config), repr(reader.config), str(writer.stats()),
                 repr(writer._key)]
    assert all(KEY not in text for text in shown)
    for options, argument in [({"auth_key_env": "PS_TEST_UNSET"}, "auth_key_env"),
                              ({"auth_key_file": str(tmp_path / "absent")}, "auth_key_file")]:
        with pytest.raises(InvalidArgumentError) as e:
            tier(redis_server.url, **options)
        assert e.value.argument == argument
    path.write_text("short")
    with pytest.raises(InvalidArgumentError) as e:
        tier(redis_server.url, auth_key_file=str(path))
    assert e.value.argument == "auth_key_file" and "short" not in str(e.value)
    with pytest.raises(InvalidArgumentError) as e:
        RemoteConfig(auth_key_env="PS_TEST_KEY", auth_key_file=str(path))
    assert e.value.argument == "auth_key_env"


def test_a_checkpoint_without_the_key_or_with_another_is_a_verify_failure(redis_server, keys_in_env):
    """Three writers put three prefixes: without a key, with another key, with the key.
    A reader with the key misses the first two (counted) and restores the third bit for
    bit; a reader without a key misses the signed ones (counted)."""
    unsigned, foreign, signed = chain(4, seed=1), chain(4, seed=2), chain(4, seed=3)
    with tier(redis_server.url, write_behind=False) as plain, \
            tier(redis_server.url, write_behind=False, auth_key_env="PS_TEST_OTHER") as other, \
            tier(redis_server.url, write_behind=False, auth_key_env="PS_TEST_KEY") as keyed:
        store(plain, unsigned, 0, 4, seed=1)
        store(other, foreign, 0, 4, seed=2)
        blobs = store(keyed, signed, 0, 4, seed=3)
        with tier(redis_server.url, write_behind=False, auth_key_env="PS_TEST_KEY") as reader:
            assert reader.deepest(unsigned) is None and reader.deepest(foreign) is None
            assert reader.stats()["verify_failures"] == 2
            assert reader.fetch_path(reader.deepest(signed).path) == [blobs]
            assert reader.stats()["verify_failures"] == 2 and reader.stats()["hits"] == 1
        assert plain.deepest(signed) is None and plain.deepest(foreign) is None
        assert plain.stats()["verify_failures"] == 2


def test_a_blob_whose_checksum_matches_is_still_refused_by_its_mac(redis_server, keys_in_env, monkeypatch):
    """Were the unkeyed blob checksum forgeable (here: one every blob has), other bytes of
    the right size at a blob's key would pass it; the blob's MAC refuses them."""
    monkeypatch.setattr(shards, "checksum", lambda data: "0" * 32)
    keys = chain(4)
    r = redis_server.client()
    with tier(redis_server.url, write_behind=False, auth_key_env="PS_TEST_KEY") as keyed, \
            tier(redis_server.url, write_behind=False, namespace="plain") as plain:
        good = store(keyed, keys, 0, 4, seed=1)
        store(plain, keys, 0, 4, seed=1)
        hit, plain_hit = keyed.deepest(keys), plain.deepest(keys)
        forged = blobs_for(99)[0][: len(good[0])]
        r.set(hit.manifest.blobs[0].key, forged)
        r.set(plain_hit.manifest.blobs[0].key, forged)
        assert plain.fetch(plain_hit.manifest, 0) == forged  # the checksum alone is fooled
        assert keyed.fetch(hit.manifest, 0) is None and keyed.fetch_path(hit.path) == []
        assert keyed.stats()["verify_failures"] == 2


def _open(path, url: str, **options) -> Engine:
    return Engine.open(path, LAYOUT, 1 << 30, remote=url, remote_options={
        "lookup_timeout": 0.5, "restore_timeout": 1.0, "write_behind": False, **options})


def test_engines_with_the_key_share_and_one_without_it_misses(redis_server, tmp_path, keys_in_env):
    tokens = tokens_for(4, 5)
    with _open(tmp_path / "a", redis_server.url, auth_key_env="PS_TEST_KEY") as a:
        assert store_tokens(a, tokens).ok
    with _open(tmp_path / "b", redis_server.url, auth_key_env="PS_TEST_KEY") as b:
        m = b.lookup(Prefix.from_tokens(tokens, LAYOUT.block_tokens))
        assert m.source == "remote"
        restored_exactly(b, tokens, b.restore(m))
    with _open(tmp_path / "c", redis_server.url) as c:
        assert not c.lookup(Prefix.from_tokens(tokens, LAYOUT.block_tokens)).hit
        assert c.stats()["remote"]["verify_failures"] == 1


def test_a_blob_naming_another_checkpoint_is_a_counted_verify_failure(redis_server, tmp_path):
    """Without a key, anyone who can write to Redis can reseal a manifest (its checksum is
    unkeyed): checkpoint P's manifest is rewritten to name Q's blobs, copied under P's
    keys, so that every size and checksum matches. The restore refuses them (their shard
    headers name Q) and counts a verify failure; nothing is kept locally."""
    p_tokens, q_tokens = tokens_for(5, 5), tokens_for(6, 5)
    with _open(tmp_path / "a", redis_server.url) as a:
        assert store_tokens(a, p_tokens).ok and store_tokens(a, q_tokens).ok
    p, q = (Prefix.from_tokens(t, LAYOUT.block_tokens) for t in (p_tokens, q_tokens))
    r = redis_server.client()
    with _open(tmp_path / "b", redis_server.url) as b:
        t = b.remote
        q_hit = t.deepest(q.keys)
        q_blobs = t.fetch_path(q_hit.path)[0]
        forged = manifest.build(t.keys, p.keys[-1], q_blobs, start=0, end=5, generation=1, snapshot=True)
        for ref, data in zip(forged.blobs, q_blobs, strict=True):
            r.set(ref.key, data)
        r.set(t.keys.manifest(p.keys[-1]), manifest.encode(t.keys, forged))
        failures = t.stats()["verify_failures"]
        m = b.lookup(p)
        assert m.source == "remote" and b.restore(m) is None
        assert t.stats()["verify_failures"] == failures + 1
        assert b.stats()["counters"]["remote.missed"] == 1 and node_at(b, p_tokens) is None


def test_an_unreadable_key_refuses_the_open_before_the_cache_directory_is_made(tmp_path):
    """The key is checked with the other options: a missing key file or an unset variable
    refuses ``Engine.open`` before it creates the cache directory or reaches the server
    (no server listens on this URL)."""
    for options, argument in [({"auth_key_file": str(tmp_path / "absent")}, "auth_key_file"),
                              ({"auth_key_env": "PS_TEST_UNSET_KEY"}, "auth_key_env")]:
        path = tmp_path / f"cache-{argument}"
        with pytest.raises(InvalidArgumentError) as e:
            Engine.open(path, LAYOUT, 1 << 20, remote="redis://127.0.0.1:9", remote_options=options)
        assert e.value.argument == argument
        assert not path.exists()
