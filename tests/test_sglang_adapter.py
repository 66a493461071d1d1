"""prefixstore as SGLang's HiCache storage backend, driven through SGLang's own factory,
config and calls (see tests/sglang_driver.py for the host-pool double and call order)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys

import prometheus_client
import pytest
import torch

pytest.importorskip(
    "sglang.srt.mem_cache.storage.backend_factory",
    reason="sglang is not installed (pip install --no-deps sglang==0.5.23; .ci/run does)",
)

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import sglang_driver as drv  # noqa: E402
from conftest import mounted_tmpfs  # noqa: E402
from sglang.srt.mem_cache.hicache_storage import HiCacheStorageExtraInfo  # noqa: E402

from prefixstore.adapters.sglang import PrefixStoreHiCache  # noqa: E402
from prefixstore.base.errors import IdentityMismatchError, InvalidInputError, LayoutMismatchError  # noqa: E402


def ranks(root, n, **kw):
    return [drv.Rank(str(root), r, n, **kw) for r in range(n)]


def close_all(rks):
    for rk in rks:
        rk.close()


def test_factory_builds_it_before_pools_are_registered(tmp_path):
    cfg = drv.config(str(tmp_path))
    backend = drv.StorageBackendFactory.create_backend("dynamic", cfg, None)
    try:
        assert isinstance(backend, PrefixStoreHiCache)
        assert cfg.extra_config["interface_v1"] == 1  # the controller then calls batch_get_v1 / batch_set_v1
        assert backend.pools == {}  # nothing opened until a pool is registered and used
        with pytest.raises(InvalidInputError, match="no registered host pool"):
            backend.batch_exists(drv.page_keys(0, 2))
        backend.register_mem_pool_host(drv.kv_pool())
        assert backend.batch_exists(drv.page_keys(0, 2)) == 0
    finally:
        backend.close()


def test_bad_config_is_a_typed_error_naming_the_key(tmp_path):
    with pytest.raises(InvalidInputError, match="capacity_bytes"):
        PrefixStoreHiCache(drv.config(str(tmp_path), capacity_bytes=-1))
    with pytest.raises(InvalidInputError, match="unknown keys"):
        PrefixStoreHiCache(drv.config(str(tmp_path), capcity_bytes=1))
    with pytest.raises(InvalidInputError, match="'mamba' must be a positive integer"):
        PrefixStoreHiCache(drv.config(str(tmp_path), pool_capacity_bytes={"mamba": "8G"}))
    with pytest.raises(InvalidInputError, match="dir"):
        PrefixStoreHiCache(drv.config(""))


@pytest.mark.parametrize("n", [1, 2, 4])
def test_attention_pages_read_back_bit_identical_and_hits_are_the_longest_prefix(tmp_path, n):
    rks = ranks(tmp_path, n)
    try:
        keys = drv.page_keys(1, 300)  # three batches: 128 + 128 + 44
        for rk in rks:
            assert drv.write_back(rk, [], keys) == 300
            assert rk.backend.engine_stats()["kv"]["nodes"] == 3  # one checkpoint per batch
            assert rk.backend.take_metrics()["backup_pgs"] == [128, 128, 44]  # what get_stats hands SGLang
        assert drv.agree([drv.query(rk, [], keys) for rk in rks]) == 300
        for rk in rks:
            got, rows, _ = drv.fetch(rk, [], keys, 300)
            assert got == 300
            for k, row in zip(keys, rows, strict=True):
                assert torch.equal(row, drv.page_data(rk.kv, k, rk.rank))
        # a request sharing 200 pages, then its own: the hit is exactly the shared run
        other = keys[:200] + drv.page_keys(2, 50, start=200)
        assert drv.agree([drv.query(rk, [], other) for rk in rks]) == 200
        # the same from the middle of a sequence: prefix_keys + keys is the chain
        assert drv.agree([drv.query(rk, keys[:100], keys[100:]) for rk in rks]) == 200
        got, rows, _ = drv.fetch(rks[-1], keys[:100], keys[100:], 200)
        assert got == 200 and torch.equal(rows[5], drv.page_data(rks[-1].kv, keys[105], rks[-1].rank))
        assert drv.agree([drv.query(rk, [], drv.page_keys(3, 10)) for rk in rks]) == 0
        for rk in rks:
            assert all(a.ok for a in rk.backend.audit().values())
        text = prometheus_client.generate_latest(rks[0].backend.registries()["kv"]).decode()
        assert 'prefixstore_lookups_total{outcome="hit"}' in text
    finally:
        close_all(rks)


@pytest.mark.parametrize("n", [1, 2, 4])
def test_hybrid_trailing_hits_are_exactly_the_stored_states(tmp_path, n):
    rks = ranks(tmp_path, n, hybrid=True)
    try:
        keys = drv.page_keys(4, 10)
        for rk in rks:
            assert drv.write_back(rk, [], keys[:6], state_at_end=True) == 6
            assert drv.write_back(rk, keys[:6], keys[6:], state_at_end=True) == 4
        answers = [drv.query(rk, [], keys) for rk in rks]
        assert all(a == (10, {6, 10}) for a in answers)
        assert drv.agree(answers) == 10
        for rk in rks:
            got, rows, state = drv.fetch(rk, [], keys, 10)
            assert got == 10 and torch.equal(state, drv.page_data(rk.mamba, keys[9], rk.rank))
            assert torch.equal(rows[9], drv.page_data(rk.kv, keys[9], rk.rank))
        # a request ending at page 8: the deepest state below is at 6
        answers = [drv.query(rk, [], keys[:8]) for rk in rks]
        assert all(a == (6, {6}) for a in answers)
        for rk in rks:
            got, _, state = drv.fetch(rk, [], keys, 6)
            assert got == 6 and torch.equal(state, drv.page_data(rk.mamba, keys[5], rk.rank))
    finally:
        close_all(rks)


@pytest.fixture
def mamba_mounts(tmp_path):
    """A real 16 MiB tmpfs (we are root) under each of two ranks' Mamba pool directories,
    unmounted also on failure."""
    with contextlib.ExitStack() as stack:
        mounts = []
        for r in range(2):
            mnt = tmp_path / f"tp{r}of2" / "mamba"
            mnt.mkdir(parents=True)
            stack.enter_context(mounted_tmpfs(mnt))
            mounts.append(mnt)
        yield mounts


def fill(path) -> None:
    """Fill the filesystem of ``path`` to the last byte (a real ENOSPC for the next write)."""
    with open(path, "wb", buffering=0) as f:
        try:
            while True:
                f.write(b"\0" * 4096)
        except OSError:
            pass


def test_a_rank_whose_store_failed_never_makes_ranks_restore_different_checkpoints(tmp_path, mamba_mounts):
    rks = ranks(tmp_path, 2, hybrid=True)
    try:
        keys = drv.page_keys(5, 8)
        fails = {(0, 6), (1, 8)}  # (rank, boundary): that rank's state store hits a full disk
        for a, b in [(0, 4), (4, 6), (6, 8)]:  # write-backs with a state at pages 4, 6 and 8
            for rk in rks:
                ballast = mamba_mounts[rk.rank] / "ballast"
                if (rk.rank, b) in fails:
                    fill(ballast)
                assert drv.write_back(rk, keys[:a], keys[a:b], state_at_end=True) == b - a  # KV is fine
                if (rk.rank, b) in fails:
                    ballast.unlink()
        answers = [drv.query(rk, [], keys) for rk in rks]
        assert answers == [(8, {4, 8}), (6, {4, 6})]
        # the per-rank longest hits (8 and 6) would make rank 0 load a state it never stored
        # at 6; the intersection of the restorable sets is the only length both hold
        length = drv.agree(answers)
        assert length == 4
        for rk in rks:
            got, rows, state = drv.fetch(rk, [], keys, length)
            assert got == 4 and torch.equal(state, drv.page_data(rk.mamba, keys[3], rk.rank))
            assert torch.equal(rows[3], drv.page_data(rk.kv, keys[3], rk.rank))
        for rk in rks:
            assert all(a.ok for a in rk.backend.audit().values())
    finally:
        close_all(rks)


def drv_prefix(keys):
    from prefixstore.adapters.sglang import page_digest
    from prefixstore.base.keys import Prefix

    return Prefix([page_digest(k) for k in keys])


def test_a_damaged_shard_answers_false_and_the_hit_shrinks(tmp_path):
    (rk,) = ranks(tmp_path, 1)
    try:
        keys = drv.page_keys(6, 300)
        assert drv.write_back(rk, [], keys) == 300
        kv_dir = tmp_path / "tp0of1" / "kv" / "rank0"
        key = drv_prefix(keys[:256]).keys[-1].hex()
        (shard,) = [p for p in kv_dir.iterdir() if p.name.startswith(key)]
        data = bytearray(shard.read_bytes())
        data[-3] ^= 0xFF  # bit rot inside the second batch's checkpoint
        shard.write_bytes(bytes(data))
        got, rows, _ = drv.fetch(rk, [], keys, 300)
        assert got == 128  # the second batch reads as a miss, never as other bytes
        assert all(torch.equal(r, drv.page_data(rk.kv, k, 0)) for r, k in zip(rows, keys, strict=False))
        assert drv.query(rk, [], keys) == (128, None)
        assert rk.backend.engine_stats()["kv"]["nodes_damaged"] == 1
    finally:
        rk.close()


@pytest.mark.parametrize("hybrid", [False, True])
def test_a_sigkill_inside_a_batch_keeps_every_acknowledged_page_and_none_of_that_batch(tmp_path, hybrid):
    here = os.path.dirname(os.path.abspath(__file__))
    repo = os.path.dirname(here)  # this checkout's prefixstore, not an installed one
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [repo, os.environ.get("PYTHONPATH")]))}
    argv = [sys.executable, os.path.join(here, "sglang_driver.py"), str(tmp_path)] + (["hybrid"] if hybrid else [])
    proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=repo, env=env)
    acked = 0
    try:
        for b in range(3):
            proc.stdin.write(f"{b}\n")
            proc.stdin.flush()
            assert proc.stdout.readline().split() == ["ACK", str(b), "1"]
            acked += 1
        proc.stdin.write("3 stall\n")  # the fourth batch stops inside its store
        proc.stdin.flush()
        word, shard = proc.stdout.readline().split()
        assert word == "STALL" and os.path.isfile(shard)  # its shard is in place, not yet published
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    assert acked == 3
    (rk,) = ranks(tmp_path, 1, hybrid=hybrid)
    try:
        keys = drv.page_keys(7, 64 * drv.CRASH_BATCH)
        pages = acked * drv.CRASH_BATCH
        hit, restorable = drv.query(rk, [], keys[: pages + drv.CRASH_BATCH])
        assert hit == pages  # every acknowledged page, and none of the batch the kill cut
        assert not os.path.exists(shard)  # recovery rolled the unpublished store back
        got, rows, _ = drv.fetch(rk, [], keys, pages)
        assert got == pages
        assert all(torch.equal(r, drv.page_data(rk.kv, k, 0)) for r, k in zip(rows, keys, strict=False))
        if hybrid:  # every acknowledged state, at its boundary, and none past the KV pages
            assert {(b + 1) * drv.CRASH_BATCH for b in range(acked)} <= restorable
            assert max(restorable) == pages
            for b in range(acked):
                end = (b + 1) * drv.CRASH_BATCH
                _, _, state = drv.fetch(rk, [], keys, end)
                assert torch.equal(state, drv.page_data(rk.mamba, keys[end - 1], 0))
        assert all(a.ok for a in rk.backend.audit().values())
        audits = [subprocess.Popen([sys.executable, "-m", "prefixstore.cli", "audit", str(tmp_path / "tp0of1" / pool)],
                                   stdout=subprocess.PIPE, stderr=subprocess.STDOUT, cwd=repo, env=env)
                  for pool in (("kv", "mamba") if hybrid else ("kv",))]  # side by side
        for audit in audits:
            out, _ = audit.communicate(timeout=120)
            assert audit.returncode == 0, out
    finally:
        rk.close()


def test_bad_calls_are_typed_errors_and_change_nothing(tmp_path):
    (rk,) = ranks(tmp_path, 1)
    try:
        keys = drv.page_keys(8, 4)
        assert drv.write_back(rk, [], keys) == 4
        with pytest.raises(InvalidInputError, match="host_indices"):
            rk.backend.batch_set_v1(drv.page_keys(9, 4), torch.arange(3), HiCacheStorageExtraInfo([]))
        with pytest.raises(InvalidInputError, match="keys"):
            rk.backend.batch_exists([""])
        assert drv.query(rk, [], keys) == (4, None)
        assert rk.backend.engine_stats()["kv"]["nodes"] == 1
    finally:
        rk.close()


REPLAY_SLICE = 1000
FULL = pytest.mark.skipif(
    not os.environ.get("PREFIXSTORE_FULL_REPLAY"),
    reason="the whole trace takes minutes: PREFIXSTORE_FULL_REPLAY=1 (or python tests/sglang_replay.py)")


def load_requests(limit):
    import sglang_replay

    try:
        return sglang_replay.load_trace(sglang_replay.trace_path())[:limit]
    except FileNotFoundError as exc:
        pytest.skip(str(exc))


@pytest.fixture
def shm_dir():
    """A temp dir on /dev/shm when there is one (as the engine replay's), removed also on failure."""
    import shutil

    from prefixstore.replay.engine_replay import default_root

    root = default_root()
    try:
        yield root
    finally:
        shutil.rmtree(root, ignore_errors=True)


@pytest.mark.slow
def test_mooncake_slice_through_the_adapter_matches_the_engine_replay(shm_dir):
    import sglang_replay

    requests = load_requests(REPLAY_SLICE)
    cfg = sglang_replay.ReplayConfig(capacity="10%")
    engine = sglang_replay.replay(requests, cfg).summary["hit_ratio_tokens"]
    assert engine > 0.05  # a slice with real reuse, not a vacuous match
    full_pages = sglang_replay.adapter_replay(requests, cfg, os.path.join(shm_dir, "a"))
    assert full_pages["wrong_bytes"] == 0 and full_pages["audit_ok"]
    assert abs(full_pages["hit_ratio_tokens"] - engine) <= 0.01 * engine
    # offered the partial last blocks too, the retention rule sees what the engine replay's
    # lookup sees: the same decisions, the same hits
    same_view = sglang_replay.adapter_replay(requests, cfg, os.path.join(shm_dir, "b"), partial_page=True)
    assert same_view["hit_ratio_tokens"] == engine


@FULL
@pytest.mark.parametrize("partial_page", [False, True])
def test_mooncake_whole_trace_through_the_adapter_matches_the_engine_replay(partial_page):
    import sglang_replay

    out = sglang_replay.compare(load_requests(None), "10%", partial_page=partial_page)
    assert out["adapter_wrong_bytes"] == 0 and out["adapter_audit_ok"]
    assert sglang_replay.within_1_percent(out), out


def test_a_query_in_batches_is_one_observation_for_the_retention_rule(tmp_path):
    keys = drv.page_keys(10, 200)
    states = []
    for name, batches in (("one", [keys]), ("two", [keys[:128], keys[128:]])):
        (rk,) = [drv.Rank(str(tmp_path / name), retention=True)]
        try:
            assert drv.write_back(rk, [], keys[:150]) == 150
            for s, batch in zip((0, 128), batches, strict=False):  # the base controller's split
                rk.backend.batch_exists(batch, HiCacheStorageExtraInfo(prefix_keys=keys[:s]))
            rk.backend.batch_get_v1(keys[:1], rk.slots(1), HiCacheStorageExtraInfo([]))  # ends the query
            adm = rk.backend.admission  # its clock counts the block touches it was told of
            states.append((adm.stats(), adm.rule.clock))
        finally:
            rk.close()
    assert states[0] == states[1]


def test_legacy_calls_without_prefix_context_round_trip(tmp_path):
    (rk,) = ranks(tmp_path, 1)
    try:
        keys = drv.page_keys(11, 3)
        pages = [drv.page_data(rk.kv, k, 0).flatten() for k in keys]
        assert rk.backend.batch_set(keys, pages)
        assert rk.backend.exists(keys[0]) and rk.backend.batch_exists(keys) == 3
        got = rk.backend.batch_get(keys, [rk.kv.get_dummy_flat_data_page() for _ in keys])
        assert all(torch.equal(g, p) for g, p in zip(got, pages, strict=True))
        assert rk.backend.get(drv.page_keys(12, 1)[0]) is None
    finally:
        rk.close()


def test_a_damaged_checkpoint_costs_its_own_pages_not_the_intact_ones_before_it(tmp_path):
    (rk,) = ranks(tmp_path, 1)
    try:
        keys = drv.page_keys(13, 300)
        assert drv.write_back(rk, [], keys[:100]) == 100  # a node of pages 0..100
        assert drv.write_back(rk, keys[:100], keys[100:]) == 200  # its child: 100..228, 228..300
        kv_dir = tmp_path / "tp0of1" / "kv" / "rank0"
        key = drv_prefix(keys[:228]).keys[-1].hex()
        (shard,) = [p for p in kv_dir.iterdir() if p.name.startswith(key)]
        data = bytearray(shard.read_bytes())
        data[-3] ^= 0xFF
        shard.write_bytes(bytes(data))
        # the first 128-page read covers the intact 0..100 and the damaged 100..228
        got, rows, _ = drv.fetch(rk, [], keys, 300)
        assert got == 100
        assert all(torch.equal(r, drv.page_data(rk.kv, k, 0)) for r, k in zip(rows, keys, strict=False))
        assert drv.query(rk, [], keys) == (100, None)
        assert rk.backend.engine_stats()["kv"]["nodes_damaged"] == 1
    finally:
        rk.close()


def test_the_extra_config_keys_sglang_adds_are_accepted(tmp_path):
    cfg = drv.config(str(tmp_path / "unused"))
    del cfg.extra_config["dir"]
    cfg.extra_config.update(  # --file-storage-path, and what the decode offload path leaves in
        file_storage_path=str(tmp_path / "fs"), prefetch_threshold=256, prefetch_timeout_base=1,
        prefetch_timeout_per_ki_token=0.25, hicache_storage_pass_prefix_keys=True, tp_lcm_size=None)
    backend = PrefixStoreHiCache(cfg)
    try:
        assert backend.root == str(tmp_path / "fs" / "tp0of1")  # no 'dir': SGLang's file_storage_path
    finally:
        backend.close()
    with pytest.raises(InvalidInputError, match=r"unknown keys \['file_storage_pth'\]"):
        PrefixStoreHiCache(drv.config(str(tmp_path), file_storage_pth="x"))


def file_backend(root):
    """SGLang's own ``file`` backend, as its factory builds it."""
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig

    cfg = HiCacheStorageConfig(
        tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1, is_mla_model=False,
        enable_storage_metrics=False, is_page_first_layout=True, model_name="tiny",
        extra_config={"file_storage_path": str(root)})
    return drv.StorageBackendFactory.create_backend("file", cfg, None)


def test_the_same_calls_hit_page_for_page_as_sglangs_file_backend(tmp_path):
    (rk,) = ranks(tmp_path / "ours", 1)
    theirs = file_backend(tmp_path / "theirs")
    try:
        a, b = drv.page_keys(14, 300), drv.page_keys(15, 5)
        data = {k: drv.page_data(rk.kv, k, 0).flatten() for k in a + b}

        def read(s, keys):
            got = s.batch_get(keys, [rk.kv.get_dummy_flat_data_page() for _ in keys])
            return [None if g is None else bool(torch.equal(g, data[k])) for g, k in zip(got, keys, strict=True)]

        def calls(s):  # evaluated in order
            return [
                s.batch_set(a[100:228], [data[k] for k in a[100:228]]),  # a run whose prefix is not stored
                s.batch_set(a[:100], [data[k] for k in a[:100]]),
                s.batch_set(a[228:], [data[k] for k in a[228:]]),
                s.batch_exists(a[50:]),  # across three runs stored apart
                s.batch_exists(a),
                s.batch_exists(a[150:160]),
                s.batch_exists(a[100:], HiCacheStorageExtraInfo(prefix_keys=a[:100])),
                s.batch_exists(a[290:] + b),
                s.exists(a[299]), s.exists(b[0]),
                s.batch_set(b[:3], [data[k] for k in b[:3]]),
                s.batch_exists(b),
                read(s, a[90:110]),  # across two runs stored apart
                read(s, b),  # the pages after the stored ones miss
            ]

        expected = [True, True, True, 250, 300, 10, 200, 10, True, False, True, 3, [True] * 20,
                    [True] * 3 + [None] * 2]
        assert calls(theirs) == expected
        assert calls(rk.backend) == expected
        assert rk.backend.engine_stats()["kv"]["nodes"] == 4  # one checkpoint per call, never one per page
    finally:
        rk.close()


def test_the_page_map_is_the_catalogs_after_a_rebuild_and_stays_bounded(tmp_path, monkeypatch):
    from prefixstore.adapters import sglang_chains

    monkeypatch.setattr(sglang_chains, "REBUILD_MIN", 64)
    (rk,) = ranks(tmp_path, 1)
    try:
        keys = drv.page_keys(16, 40)
        assert drv.write_back(rk, [], keys) == 40
        chains = rk.backend.pools["kv"].chains
        assert len(chains) == 40
        rk.backend.clear()  # every checkpoint evicted: the map is rebuilt empty, nothing reads as a hit
        assert len(chains) == 0 and rk.backend.batch_exists(keys) == 0
        for s in range(5):  # 200 pages learned in all: the map is rebuilt when it passes 64 entries
            seq = drv.page_keys(17 + s, 40)
            assert drv.write_back(rk, [], seq) == 40
            rk.backend.pools["kv"].engine.evict(rk.backend.pools["kv"].engine.capacity)
        assert len(chains) <= 2 * 64
        last = drv.page_keys(30, 10)
        assert drv.write_back(rk, [], last) == 10
        assert rk.backend.batch_exists(last[3:]) == 7  # found from its hash, mid-chain, no prefix keys
    finally:
        rk.close()


def test_a_directory_belongs_to_the_model_and_page_format_that_wrote_it(tmp_path):
    keys = drv.page_keys(7, 40)
    rk = drv.Rank(str(tmp_path))
    try:
        assert drv.write_back(rk, [], keys) == 40
    finally:
        rk.close()
    other = drv.Rank(str(tmp_path))
    other.backend.config.model_name = "another-model"
    try:
        with pytest.raises(IdentityMismatchError, match="model") as err:
            other.backend.batch_exists(keys)
        assert any("model" in d for d in err.value.differences)
    finally:
        other.close()
    smaller = drv.Rank(str(tmp_path), kv=drv.kv_pool(page=drv.PAGE // 2))
    try:
        with pytest.raises((IdentityMismatchError, LayoutMismatchError)):
            smaller.backend.batch_exists(keys)
    finally:
        smaller.close()
    same = drv.Rank(str(tmp_path))
    try:
        assert drv.agree([drv.query(same, [], keys)]) == 40
        got, rows, _ = drv.fetch(same, [], keys, 40)
        assert got == 40 and torch.equal(rows[3], drv.page_data(same.kv, keys[3], 0))
    finally:
        same.close()
