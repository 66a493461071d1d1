"""prefixstore as LMCache 0.5.6's remote storage plugin, loaded by LMCache's own plugin
loader under a real LMCacheEngine on the CPU (tests/lmcache_driver.py)."""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import signal
import sys

import pytest
import torch

pytest.importorskip("lmcache.v1.storage_backend.connector.base_connector",
                    reason="lmcache is not installed (pip install --no-deps lmcache==0.5.6; .ci/run does)")

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import lmcache_driver as drv  # noqa: E402

from prefixstore.adapters.lmcache import PrefixStoreRemoteConnector  # noqa: E402
from prefixstore.adapters.vllm_options import UnknownConfigKeysError  # noqa: E402
from prefixstore.base.errors import InvalidInputError  # noqa: E402

N = 3 * drv.CHUNK + 5  # three full chunks and a partial one


def same(got: list[torch.Tensor], want: list[torch.Tensor], n: int) -> bool:
    return all(torch.equal(g.view(torch.int16), w[:, :n].view(torch.int16)) for g, w in zip(got, want, strict=True))


def test_one_engine_stores_and_a_fresh_one_retrieves_byte_for_byte(tmp_path):
    root = str(tmp_path / "c")
    tokens, rows = drv.prompt(1, N)
    first = drv.Engine(root)
    try:
        assert isinstance(first.plugin, PrefixStoreRemoteConnector)
        first.store(tokens, rows)
        assert first.wait_stored(tokens)
        names = sorted(first.plugin.list_sync())
        assert len(names) == 4 and all(n.startswith("tiny-llama@1@0@") for n in names)
    finally:
        first.close()
    fresh = drv.Engine(root)  # an empty local CPU tier: every chunk comes from the plugin
    try:
        hit, got = fresh.retrieve(tokens)
        assert hit == N and same(got, rows, N)
        counters = fresh.plugin.stats()["counters"]
        assert counters.get("lookups.hit", 0) >= 4
        assert fresh.plugin.engine.audit().ok
    finally:
        fresh.close()


def test_a_damaged_shard_is_a_miss(tmp_path):
    root = str(tmp_path / "c")
    tokens, rows = drv.prompt(2, N)
    first = drv.Engine(root)
    try:
        first.store(tokens, rows)
        assert first.wait_stored(tokens)
        key = list(first.engine.token_database.process_tokens(torch.tensor(tokens)))[1][2]
        digest_key = first.plugin.prefix_of(key).keys[0].hex()
    finally:
        first.close()
    rank = os.path.join(root, "worker0of1", "rank0")
    (shard,) = [os.path.join(rank, f) for f in os.listdir(rank) if f.startswith(digest_key)]
    with open(shard, "r+b") as f:  # one bit flipped at rest in the second chunk's bytes
        f.seek(os.path.getsize(shard) - 200)
        b = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([b[0] ^ 0x04]))
    fresh = drv.Engine(root)
    try:
        assert fresh.plugin.get_sync(key) is None  # a miss, never other bytes
        hit, got = fresh.retrieve(tokens)
        assert hit == drv.CHUNK and same(got, rows, drv.CHUNK)  # LMCache stops at the first missing chunk
        assert fresh.plugin.stats()["nodes_damaged"] == 1
        fresh.store(tokens, rows)  # LMCache puts the missing chunks again: the damaged one is refilled
        assert fresh.wait_stored(tokens)
        assert fresh.plugin.stats()["nodes_damaged"] == 0
        again = fresh.plugin.get_sync(key)
        assert again is not None and torch.equal(again.tensor.view(torch.int16),
                                                 torch.stack(rows, 1)[:, :, drv.CHUNK:2 * drv.CHUNK].reshape(
                                                     2, drv.LAYERS, drv.CHUNK, -1).view(torch.int16))
        again.ref_count_down()
    finally:
        fresh.close()


def test_a_sigkill_between_puts_loses_nothing_acknowledged(tmp_path):
    root = str(tmp_path / "c")
    ctx = multiprocessing.get_context("fork")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=drv.serve, args=(child, root))
    proc.start()
    acked = []
    try:
        assert parent.poll(120) and parent.recv() == ("ready",)
        for seed in range(10, 16):
            parent.send(seed)
            assert parent.poll(60)
            assert parent.recv() == ("ACK", seed, True)
            acked.append(seed)
        parent.send(16)  # in flight when the process dies
        os.kill(proc.pid, signal.SIGKILL)
        proc.join(30)
        assert proc.exitcode == -signal.SIGKILL
    finally:
        if proc.is_alive():
            proc.kill()
    fresh = drv.Engine(root)
    try:
        assert fresh.plugin.engine.audit().ok  # recovered: nothing half-published or unaccounted for
        for seed in acked:
            tokens, rows = drv.prompt(seed, N)
            hit, got = fresh.retrieve(tokens)
            assert hit == N and same(got, rows, N), seed
        tokens, rows = drv.prompt(16, N)
        hit, got = fresh.retrieve(tokens)  # whatever of the unacknowledged one survived is right
        assert same(got, rows, hit)
    finally:
        fresh.close()


def test_plugin_options_are_checked_with_typed_errors_naming_them(tmp_path):
    root = str(tmp_path / "c")
    eng = drv.Engine(root)
    try:
        backend = eng.plugin.local_cpu_backend
        loop = asyncio.new_event_loop()
        try:
            with pytest.raises(UnknownConfigKeysError, match="remote_storage_plugin.prefixstore.capcity_bytes"):
                PrefixStoreRemoteConnector(loop, backend, drv.config(str(tmp_path / "d"), capcity_bytes=1))
            with pytest.raises(InvalidInputError, match="capacity_bytes"):
                PrefixStoreRemoteConnector(loop, backend, drv.config(str(tmp_path / "d"), capacity_bytes=-5))
        finally:
            loop.close()
        assert not os.path.exists(tmp_path / "d")
    finally:
        eng.close()
