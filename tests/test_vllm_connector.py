"""prefixstore as a vLLM 0.33 KV connector, loaded by module path through vLLM's own
factory and driven by vLLM's real scheduler; the worker halves are stepped as vLLM's
model runner steps them, over CPU KV caches vLLM planned and allocated
(tests/vllm_driver.py)."""

from __future__ import annotations

import json
import multiprocessing
import os
import signal
import sys

import pytest
import torch

pytest.importorskip("vllm.distributed.kv_transfer.kv_connector.v1.base",
                    reason="vllm is not installed (pip install --no-deps vllm==0.33.0; .ci/run does)")

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import vllm_driver as drv  # noqa: E402
from conftest import mounted_tmpfs  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole  # noqa: E402
from vllm.v1.kv_cache_interface import (  # noqa: E402
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    MambaSpec,
    SlidingWindowSpec,
)

from prefixstore.adapters.vllm import PrefixStoreConnector, UnknownConfigKeysError  # noqa: E402
from prefixstore.base.errors import (  # noqa: E402
    IdentityMismatchError,
    InvalidInputError,
    LayoutError,
    LockedError,
)
from prefixstore.base.keys import Prefix  # noqa: E402

BS = drv.BS


@pytest.fixture
def model(tmp_path):
    return drv.write_model(str(tmp_path))


def staging(tmp_path) -> dict:
    return {"staging_dir": str(tmp_path / "staging")}


def shard_files(cache: str) -> list[str]:
    out = []
    for r in sorted(os.listdir(cache)):
        if r.startswith("rank"):
            out += [os.path.join(cache, r, f) for f in os.listdir(os.path.join(cache, r))]
    return out


def staged(inst: drv.Instance) -> list[str]:
    return os.listdir(inst.connector.scheduler.staging.root)


def engine(inst: drv.Instance):
    return inst.connector.scheduler.engine


def serve(inst: drv.Instance, req_id: str, tokens: list[int], max_tokens: int = 2) -> int:
    """Serve one request to the end; the tokens it got from the cache."""
    inst.add(req_id, tokens, max_tokens)
    inst.run()
    assert inst.connector.flush(30)
    return inst.external_tokens.get(req_id, 0)


# ---------------------------------------------------------------------- construction


def test_vllm_factory_builds_both_halves_from_the_module_path(tmp_path, model):
    inst = drv.Instance(model, str(tmp_path / "c"), extra=staging(tmp_path))
    try:
        assert isinstance(inst.connector, PrefixStoreConnector) and inst.connector.role == KVConnectorRole.SCHEDULER
        worker = inst.workers[0].connector
        assert isinstance(worker, PrefixStoreConnector) and worker.role == KVConnectorRole.WORKER
        assert worker.scheduler is None and inst.connector.worker is None
        assert [s.name for s in inst.connector.layout.segments] == list(drv.layer_names())
        assert inst.connector.layout.segments[0].shape == (drv.KV_HEADS, 2 * drv.HEAD)
        with pytest.raises(InvalidInputError, match="worker-side call"):
            inst.connector.wait_for_save()
        with pytest.raises(LockedError):  # one instance per cache directory at a time
            drv.Instance(model, str(tmp_path / "c"), extra=staging(tmp_path))
    finally:
        inst.close()


def test_unknown_or_bad_extra_config_keys_are_typed_errors_naming_them(tmp_path, model):
    kcc = drv.kv_cache_config(drv.make_config(model, str(tmp_path / "c")), 64)
    for extra, err, pattern in (
        ({"capcity_bytes": 1, "stagin_dir": "/x"}, UnknownConfigKeysError, r"\['capcity_bytes', 'stagin_dir'\]"),
        ({"capacity_bytes": -1}, InvalidInputError, "capacity_bytes"),
        ({"checkpoint_blocks": "8"}, InvalidInputError, "checkpoint_blocks"),
        ({"synchronous": "OFF"}, InvalidInputError, "synchronous"),
        ({"cost": {"bandwidth_bytes_per_s": 0}}, InvalidInputError, "cost"),
        ({"dir": ""}, InvalidInputError, "dir"),
    ):
        vc = drv.make_config(model, str(tmp_path / "c"), extra=extra)
        with pytest.raises(err, match=pattern):
            KVConnectorFactory.create_connector(vc, KVConnectorRole.SCHEDULER, kcc)
    try:
        KVConnectorFactory.create_connector(drv.make_config(model, str(tmp_path / "c"), extra={"bogus": 1}),
                                            KVConnectorRole.WORKER, kcc)
    except UnknownConfigKeysError as exc:
        assert exc.keys == ["bogus"]
    else:
        pytest.fail("the worker half accepted an unknown key")
    assert not os.path.exists(tmp_path / "c")  # nothing was created by a refused config


def test_kv_cache_groups_it_does_not_handle_are_refused_at_construction(tmp_path, model):
    vc = drv.make_config(model, str(tmp_path / "c"))
    full = FullAttentionSpec(block_size=BS, num_kv_heads=2, head_size=8, dtype=torch.float16)
    swa = SlidingWindowSpec(block_size=BS, num_kv_heads=2, head_size=8, dtype=torch.float16, sliding_window=64)
    mamba = MambaSpec(block_size=BS, shapes=((4, 8),), dtypes=(torch.float16,))
    for groups, pattern in (
        ([KVCacheGroupSpec(["model.layers.0.self_attn.attn"], swa)], "SlidingWindowSpec"),
        ([KVCacheGroupSpec(["model.layers.0.mixer"], mamba)], "MambaSpec"),
        ([KVCacheGroupSpec(["model.layers.0.self_attn.attn"], full),
          KVCacheGroupSpec(["model.layers.1.mixer"], mamba)], "got 2"),
    ):
        kcc = KVCacheConfig(num_blocks=16, kv_cache_tensors=[], kv_cache_groups=groups)
        for role in (KVConnectorRole.SCHEDULER, KVConnectorRole.WORKER):
            with pytest.raises(LayoutError, match=pattern):
                PrefixStoreConnector(vc, role, kcc)
    vc.cache_config.prefix_caching_hash_algo = "xxhash"
    os.environ.pop("PYTHONHASHSEED", None)
    with pytest.raises(InvalidInputError, match="PYTHONHASHSEED"):
        PrefixStoreConnector(vc, KVConnectorRole.SCHEDULER, drv.kv_cache_config(vc, 16))
    assert not os.path.exists(tmp_path / "c")


@pytest.mark.parametrize("module, package", [("vllm", "vllm==0.33.0"), ("lmcache", "lmcache==0.5.6")])
def test_without_the_serving_package_the_adapter_names_the_install(module, package):
    from test_packaging import _without

    p = _without(module, f"import prefixstore.adapters.{module}")
    assert p.returncode == 1
    assert f"needs {module}: pip install --no-deps {package}" in p.stderr


# ---------------------------------------------------------------------- two processes, SIGKILL


def _first_instance(conn, model: str, cache: str, stage: str, p1: list[int], p2: list[int]) -> None:
    """The first vLLM process: serve p1 to the end and report the KV it saved, then
    start p2 and wait between two steps (the test SIGKILLs it there)."""
    try:
        torch.set_num_threads(1)
        inst = drv.Instance(model, cache, extra={"staging_dir": stage}, max_batched=64)
        inst.add("p1", p1, 2)
        full = (len(p1) // BS) * BS
        while inst.scheduler.requests["p1"].num_computed_tokens < full:
            inst.step()  # 64 tokens a step: the connector stages each step's blocks, the engine stores them
        table = list(inst.scheduler.kv_cache_manager.get_block_ids("p1")[0])
        rows = inst.workers[0].rows_of(table, 0, full)
        inst.run()
        assert inst.connector.flush(30)
        conn.send(("acked", [r.view(torch.int16).numpy().tobytes() for r in rows], inst.connector.stats()))
        inst.add("p2", p2, 2)
        inst.step()
        inst.step()
        conn.send(("between steps",))
    except BaseException as exc:
        conn.send(("error", repr(exc)))
        raise
    conn.recv()  # never answered


def test_second_process_gets_first_ones_blocks_byte_for_byte_after_a_sigkill(tmp_path, model):
    cache, stage = str(tmp_path / "c"), str(tmp_path / "staging")
    p1 = drv.prompt(1, 8 * BS + 5)
    p2 = drv.prompt(2, 20 * BS, shared=p1[: 3 * BS])
    ctx = multiprocessing.get_context("fork")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_first_instance, args=(child, model, cache, stage, p1, p2))
    proc.start()
    try:
        assert parent.poll(300), "the first instance did not answer"
        msg = parent.recv()
        assert msg[0] == "acked", msg
        _, saved, stats = msg
        assert stats["connector"]["stores_stored"] >= 2
        assert parent.poll(300) and parent.recv() == ("between steps",)
        os.kill(proc.pid, signal.SIGKILL)
        proc.join(30)
        assert proc.exitcode == -signal.SIGKILL
    finally:
        if proc.is_alive():
            proc.kill()
    assert os.listdir(stage)  # it died with its staging in place

    second = drv.Instance(model, cache, extra={"staging_dir": stage})
    try:
        rep = engine(second).audit()
        assert rep.ok, rep.violations  # recovered: nothing half-published, no file unaccounted for
        assert staged(second) == []  # the dead instance's staging is gone
        second.add("p1-again", p1 + [7, 7, 7], 2)
        so = second.schedule()
        (job,) = so.kv_connector_metadata.loads
        assert len(job.block_ids) == 8  # every full block of p1, as external tokens
        out = second.execute(so)
        table = list(second.scheduler.kv_cache_manager.get_block_ids("p1-again")[0])
        rows = second.workers[0].rows_of(table, 0, 8 * BS)  # read back out of this process's KV cache
        second.scheduler.update_from_output(so, out)
        second.run()
        assert [r.view(torch.int16).numpy().tobytes() for r in rows] == saved  # byte for byte
        assert second.checked == 8 and second.wrong == 0
        # p2 was in flight at the kill: whatever of it the engine published is served right
        serve(second, "p2-again", p2 + [9])
        assert second.wrong == 0 and engine(second).audit().ok
    finally:
        second.close()


def test_a_cache_directory_belongs_to_the_model_config_and_setup_that_wrote_it(tmp_path, model):
    cache = str(tmp_path / "c")
    tokens = drv.prompt(3, 4 * BS + 1)
    first = drv.Instance(model, cache, extra=staging(tmp_path))
    try:
        serve(first, "a", tokens)
        assert engine(first).stats()["nodes"] >= 1
    finally:
        first.close()
    with open(os.path.join(model, "config.json")) as f:
        config = json.load(f)
    config["rms_norm_eps"] = 1e-6  # same path, same cache layout, another model
    with open(os.path.join(model, "config.json"), "w") as f:
        json.dump(config, f)
    with pytest.raises(IdentityMismatchError, match="config") as err:
        drv.Instance(model, cache, extra=staging(tmp_path))
    assert err.value.differences and all("config" in d for d in err.value.differences)
    config["rms_norm_eps"] = 1e-5
    with open(os.path.join(model, "config.json"), "w") as f:
        json.dump(config, f)
    with pytest.raises(IdentityMismatchError, match="namespace"):  # keys folded with another namespace
        drv.Instance(model, cache, extra={**staging(tmp_path), "namespace": "another"})
    again = drv.Instance(model, cache, extra=staging(tmp_path))
    try:
        assert serve(again, "a-again", tokens + [5]) == 4 * BS  # the same model: every full block back
        assert again.wrong == 0
    finally:
        again.close()


# ---------------------------------------------------------------------- tensor parallel


def test_two_tensor_parallel_workers_in_their_own_processes_share_one_atomic_checkpoint(tmp_path, model):
    cache = str(tmp_path / "c")
    inst = drv.Instance(model, cache, tp=2, processes=True, prefix_caching=False, extra=staging(tmp_path))
    try:
        base = drv.prompt(3, 6 * BS + 3)
        assert serve(inst, "a", base) == 0
        nodes = engine(inst).stats()["nodes"]
        assert nodes == 1
        files = shard_files(cache)
        assert sorted({os.path.basename(os.path.dirname(f)) for f in files}) == ["rank0", "rank1"]
        got = serve(inst, "b", base[: 6 * BS] + drv.prompt(4, 2 * BS))
        assert got == 6 * BS and inst.checked == 2 * 6 and inst.wrong == 0  # each rank its own rows
        assert engine(inst).audit().ok and staged(inst) == [] and drv.finished(inst.scheduler)
    finally:
        inst.close()


def test_a_checkpoint_is_published_only_when_every_ranks_shard_is_staged(tmp_path, model):
    """A real full tmpfs under the staging folder: rank 0's file fits, rank 1's does not."""
    cache = str(tmp_path / "c")
    (tmp_path / "tiny").mkdir()
    with mounted_tmpfs(str(tmp_path / "tiny"), size="4k") as tiny:
        # 4 blocks of 16 tokens, one head of 16 fp16 per layer and rank: 4 KiB a file
        inst = drv.Instance(model, cache, tp=2, processes=True, prefix_caching=False,
                            extra={"staging_dir": tiny}, max_batched=4 * BS)
        try:
            assert serve(inst, "a", drv.prompt(5, 4 * BS + 1), max_tokens=1) == 0
            stats = inst.connector.stats()
            assert stats["connector"].get("saves_failed_staging") == 1
            assert stats["engine"]["nodes"] == 0 and shard_files(cache) == []
            assert engine(inst).audit().ok and staged(inst) == [] and drv.finished(inst.scheduler)
        finally:
            inst.close()


def test_a_staging_file_that_does_not_fit_leaves_nothing_behind(tmp_path):
    from prefixstore.adapters.vllm_staging import Staging
    from prefixstore.base.layout import Layout, TensorSpec

    (tmp_path / "tiny").mkdir()
    with mounted_tmpfs(str(tmp_path / "tiny"), size="4k") as tiny:
        st = Staging(tiny, Layout([TensorSpec("kv", "float16", (1, 16))], block_tokens=BS))
        st.create(st.save_file(1, 0), 4 * BS)  # 4 KiB: the whole tmpfs
        with pytest.raises(OSError):
            st.create(st.save_file(1, 1), 4 * BS)
        assert os.listdir(tiny) == ["s1.r0"]


# ---------------------------------------------------------------------- loads in flight


def no_leaks(inst: drv.Instance) -> None:
    """Nothing of a request outlives it: no job, no staging file, no pin, no block."""
    assert inst.connector.flush(30)
    sched = inst.connector.scheduler
    assert sched.loads == {} and sched.saves == {} and staged(inst) == []
    assert engine(inst).stats()["pinned"] == 0
    assert drv.finished(inst.scheduler)


def test_a_request_aborted_while_its_load_is_in_flight(tmp_path, model):
    """With async scheduling an abort arrives while the step carrying the load runs."""
    inst = drv.Instance(model, str(tmp_path / "c"), prefix_caching=False, async_scheduling=True,
                        extra=staging(tmp_path))
    try:
        base = drv.prompt(6, 10 * BS)
        serve(inst, "seed", base + [1])
        inst.add("r", base + [2, 3], 3)
        so = inst.schedule()  # the load is planned, its restore already running
        (job,) = so.kv_connector_metadata.loads
        assert job.req_id == "r" and len(job.block_ids) == 10
        inst.scheduler.finish_requests("r", drv.RequestStatus.FINISHED_ABORTED)
        inst.scheduler.update_from_output(so, inst.execute(so))  # the step was already on its way
        inst.run()
        no_leaks(inst)
        assert serve(inst, "after", base + [4]) == 10 * BS and inst.wrong == 0 and inst.checked == 10
        no_leaks(inst)
    finally:
        inst.close()


def test_a_request_is_not_preempted_while_its_load_is_in_flight_and_reloads_when_preempted_after(tmp_path, model):
    """Async scheduling, 15 usable blocks: the step after r's load step needs a block
    for g, and vLLM will not free r's blocks while the load step is in flight (g
    waits); one step later it preempts r; r resumes with a new lookup and load."""
    inst = drv.Instance(model, str(tmp_path / "c"), prefix_caching=False, async_scheduling=True, num_blocks=16,
                        extra=staging(tmp_path))
    try:
        base = drv.prompt(8, 10 * BS)
        serve(inst, "seed", base + [1], 1)
        inst.add("g", drv.prompt(9, 4 * BS - 1), 40)
        inst.step()  # g prefilled: 4 blocks; its next decode fills block 4, the one after needs a 5th
        inst.add("r", base + [2, 3], 2)  # 10 blocks from the cache + 1: all 11 left
        so_n = inst.schedule()
        (job,) = so_n.kv_connector_metadata.loads
        assert job.req_id == "r"
        so_next = inst.schedule()  # scheduled while step n (r's load) is in flight
        assert inst.scheduler.requests["r"].status == drv.RequestStatus.RUNNING
        assert "g" not in so_next.num_scheduled_tokens
        inst.scheduler.update_from_output(so_n, inst.execute(so_n))
        inst.scheduler.update_from_output(so_next, inst.execute(so_next))
        assert inst.checked == 10 and inst.wrong == 0  # r's load landed, byte for byte
        preempted = False
        for _ in range(50):
            inst.step()
            preempted = preempted or inst.scheduler.requests.get("r") is not None and \
                inst.scheduler.requests["r"].num_preemptions > 0
            if not inst.scheduler.has_requests():
                break
        assert preempted
        assert inst.external_tokens["r"] == 2 * 10 * BS  # resumed: looked up and loaded again
        assert inst.wrong == 0
        no_leaks(inst)
    finally:
        inst.close()


# ---------------------------------------------------------------------- damage, eviction


def test_a_damaged_shard_is_a_load_error_vllm_recomputes_and_the_next_store_refills(tmp_path, model):
    cache = str(tmp_path / "c")
    inst = drv.Instance(model, cache, prefix_caching=False, max_batched=4 * BS, extra=staging(tmp_path))
    try:
        base = drv.prompt(7, 10 * BS + 3)
        serve(inst, "a", base)  # prefilled 4 blocks a step: checkpoints at blocks 4, 8 and 10
        assert engine(inst).stats()["nodes"] == 3
        opts = inst.connector.options
        req = inst.request("probe", base)
        keys = Prefix([opts.digest(h) for h in req.block_hashes], BS).keys
        (shard,) = [f for f in shard_files(cache) if os.path.basename(f).startswith(keys[7].hex())
                    and "/rank0/" in f]
        with open(shard, "r+b") as f:  # one bit flipped at rest, in the rows of blocks 4..7
            f.seek(os.path.getsize(shard) - 100)
            b = f.read(1)
            f.seek(-1, 1)
            f.write(bytes([b[0] ^ 0x10]))
        inst.add("b", base + [5], 1)
        so = inst.schedule()
        (job,) = so.kv_connector_metadata.loads
        assert len(job.block_ids) == 10  # the catalog promised all ten
        out = inst.execute(so)
        assert out.kv_connector_output.invalid_block_ids == set(job.block_ids[4:])
        inst.scheduler.update_from_output(so, out)
        assert inst.scheduler.requests["b"].num_computed_tokens == 4 * BS  # vLLM recomputes from block 4
        assert inst.checked == 4 and inst.wrong == 0  # the blocks above the damage, byte for byte
        assert engine(inst).stats()["nodes_damaged"] == 1
        inst.run()
        assert inst.connector.flush(30)
        assert engine(inst).stats()["nodes_damaged"] == 0  # b's recomputed blocks refilled it
        assert serve(inst, "c", base + [6]) == 10 * BS
        assert inst.checked == 4 + 10 and inst.wrong == 0 and engine(inst).audit().ok
    finally:
        inst.close()


def test_a_capacity_small_enough_to_evict(tmp_path, model):
    inst = drv.Instance(model, str(tmp_path / "c"), prefix_caching=False,
                        extra={**staging(tmp_path), "capacity_bytes": 48 << 10})
    try:
        prompts = [drv.prompt(100 + i, 5 * BS + 1) for i in range(8)]  # 8 x 5 blocks of 2 KiB
        for i, p in enumerate(prompts):
            serve(inst, f"p{i}", p, 1)
        stats = engine(inst).stats()
        assert any(k.startswith("evict") for k in stats["counters"]), stats["counters"]
        assert stats["nodes"] < 8 and stats["charged_bytes"] <= 48 << 10
        assert serve(inst, "latest", prompts[-1] + [1], 1) == 5 * BS
        assert serve(inst, "oldest", prompts[0] + [1], 1) == 0  # evicted
        assert inst.wrong == 0 and engine(inst).audit().ok
    finally:
        inst.close()


# ---------------------------------------------------------------------- the Mooncake trace

REPLAY_SLICE = 300
FULL = pytest.mark.skipif(
    not os.environ.get("PREFIXSTORE_FULL_REPLAY"),
    reason="the whole trace takes minutes: PREFIXSTORE_FULL_REPLAY=1 (or python tests/vllm_replay.py)")


def load_requests(limit):
    import vllm_replay

    try:
        return vllm_replay.load_trace(vllm_replay.trace_path())[:limit]
    except FileNotFoundError as exc:
        pytest.skip(str(exc))


@pytest.mark.slow
def test_mooncake_slice_through_the_connector_matches_the_engine_replay():
    import vllm_replay

    out = vllm_replay.compare(load_requests(REPLAY_SLICE), "10%")
    assert out["engine_hit_ratio_tokens"] > 0.03  # a slice with real reuse, not a vacuous match
    assert out["connector_wrong_blocks"] == 0 and out["connector_checked_blocks"] > 100 and out["connector_audit_ok"]
    assert vllm_replay.within_1_percent(out), out


@FULL
def test_mooncake_whole_trace_through_the_connector_matches_the_engine_replay():
    import vllm_replay

    out = vllm_replay.compare(load_requests(None), "10%")
    assert out["connector_wrong_blocks"] == 0 and out["connector_audit_ok"]
    assert vllm_replay.within_1_percent(out), out
