"""SGLang's real HiCache controller over the CPU, driving a storage backend (not a test module).

``python tests/sglang_real.py OUT.json ROOT RANK SIZE PORT`` is one tensor-parallel rank,
as one of SGLang's scheduler processes: the launch flags go through SGLang's own argument
parser (``ServerArgs.add_cli_args`` / ``from_cli_args`` / ``resolve_once``) and are
published as the process's server args; the device pool is a real ``MHATokenToKVPool``
on the CPU with its ``PagedTokenToKVPoolAllocator``, the host pool a real
``MHATokenToKVPoolHost`` in a ``HostPoolGroup``, and the controller a real
``HybridCacheController`` (what SGLang 0.5.23 builds for every model), whose storage
backend comes from ``StorageBackendFactory`` and whose own storage threads make every
call to it. With SIZE 2 the two rank processes join a gloo group on loopback, as SGLang's
TP ranks do, and the controller's own MIN reductions agree the hits.

What stands in for what, and why (nothing else is replaced):

- ``torchvision``: SGLang's model configs import it (``multimodal/internvl_utils.py``,
  ``configs/deepseek_ocr.py``) and the only registry wheel for torch 2.13 is a CUDA build
  that cannot load on this machine. ``stand_in_for_torchvision`` puts modules in
  ``sys.modules`` whose every name is a class that raises when used: the storage path
  never uses one (a use would fail the run).
- Pinned host memory: ``MHATokenToKVPoolHost`` pins its buffer with ``cudaHostRegister``
  by default, which needs CUDA; the host pool is built with ``pin_memory=False``, its own
  argument, with the arguments SGLang's ``build_kv_host_pool`` passes otherwise. The
  controller's streams and events are SGLang's own CPU path (``get_device_module()`` is
  ``torch.cpu`` without an accelerator): nothing stands in for them.
- The scheduler's tree (``UnifiedRadixCache``) is not built: ``Scheduler`` below makes
  its calls on the controller in its order (``write_storage`` with the node's hashes and
  ``prefix_keys`` when ``hicache_storage_pass_prefix_keys`` is on; ``prefetch``, the
  drain of ``prefetch_hit_queue``, ``allocate_storage_hit``, ``prefetch_buffer``, the
  acks) and reads page hashes with SGLang's ``get_storage_hash_str``. Host pages are
  written straight into the host pool (the device-to-host copy is not part of L3).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import threading
import time
import types
from array import array
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
PAGE = 4  # tokens per page
LAYERS, HEADS, HEAD_DIM = 2, 2, 8
DEVICE_TOKENS = 4096
WAIT_S = 120.0


def stand_in_for_torchvision() -> None:
    """Modules named ``torchvision*`` whose every attribute is a class that raises when
    called or asked for anything (transformers has already decided it is absent)."""
    import transformers.utils.import_utils as tf_imports

    tf_imports.is_torchvision_available()  # cached: transformers never takes the stand-in for the package

    class Unavailable(type):
        def __getattr__(cls, name: str) -> Any:
            raise RuntimeError(f"torchvision stand-in: {cls.__name__}.{name} used")

        def __call__(cls, *args: Any, **kwargs: Any) -> Any:
            raise RuntimeError(f"torchvision stand-in: {cls.__name__}() called")

    def module(name: str) -> types.ModuleType:
        m = types.ModuleType(name)
        m.__path__ = []

        def attr(a: str) -> Any:
            if a.startswith("__"):
                raise AttributeError(a)
            return Unavailable(a, (), {})

        m.__getattr__ = attr
        return m

    for name in ("torchvision", "torchvision.transforms", "torchvision.transforms.functional"):
        sys.modules.setdefault(name, module(name))


def launch_flags(root: str, pass_prefix_keys: bool, size: int, backend: str = "prefixstore") -> list[str]:
    """The launch flags of docs/sglang.md (less the model), for the prefixstore or SGLang's file
    backend. The prefixstore backend's directory is its ``dir`` without prefix keys, and
    ``--file-storage-path`` (which SGLang adds to the extra config) beside ``dir`` with them."""
    where = ["--file-storage-path", root]
    if backend == "file":
        storage = ["--hicache-storage-backend", "file",
                   "--hicache-storage-backend-extra-config",
                   json.dumps({"hicache_storage_pass_prefix_keys": pass_prefix_keys})]
    else:
        extra = {"backend_name": "prefixstore", "module_path": "prefixstore.adapters.sglang",
                 "class_name": "PrefixStoreHiCache", "dir": root, "capacity_bytes": 1 << 30,
                 "hicache_storage_pass_prefix_keys": pass_prefix_keys}
        storage = ["--hicache-storage-backend", "dynamic", "--hicache-storage-backend-extra-config", json.dumps(extra)]
        where = where if pass_prefix_keys else []
    return ["--model-path", "dummy", "--page-size", str(PAGE), "--tp-size", str(size),
            "--enable-hierarchical-cache", "--hicache-mem-layout", "page_first",
            "--enable-metrics", *storage, *where]


class Scheduler:
    """One rank's controller over a real host pool, and the calls SGLang's tree makes on it."""

    def __init__(self, argv: list[str], rank: int, size: int, group: Any) -> None:
        import torch
        from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator
        from sglang.srt.mem_cache.hicache_storage import PoolName
        from sglang.srt.mem_cache.hybrid_cache.hybrid_cache_controller import HybridCacheController
        from sglang.srt.mem_cache.hybrid_cache.hybrid_pool_assembler import (
            _get_allocator_type,
            build_pool_entry,
        )
        from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool
        from sglang.srt.mem_cache.pool_host import HostPoolGroup
        from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost
        from sglang.srt.runtime_context import get_context, get_memory
        from sglang.srt.server_args import ServerArgs

        parser = argparse.ArgumentParser()
        ServerArgs.add_cli_args(parser)
        server_args = ServerArgs.from_cli_args(parser.parse_args(argv))
        server_args.resolve_once()
        get_context().set_server_args(server_args)
        mem = get_memory()
        self.rank, self.size = rank, size
        kv = MHATokenToKVPool(size=DEVICE_TOKENS, page_size=PAGE, dtype=torch.bfloat16, head_num=HEADS,
                              head_dim=HEAD_DIM, layer_num=LAYERS, device="cpu", enable_memory_saver=False)
        allocator = PagedTokenToKVPoolAllocator(DEVICE_TOKENS, PAGE, torch.bfloat16, "cpu", kv, need_sort=False)
        info = kv.get_device_pool_infos()[0].buffer_info
        self.host = MHATokenToKVPoolHost(
            info, mem.hicache_ratio, mem.hicache_size, PAGE, mem.hicache_mem_layout, pin_memory=False,
            allocator_type=_get_allocator_type(), device_capacity_tokens=kv.size,
            start_layer=kv.start_layer, end_layer=kv.end_layer, write_back_staging=kv.hicache_write_back_staging)
        layers = {i: i for i in range(LAYERS)}
        group_host = HostPoolGroup([build_pool_entry(name=PoolName.KV, host_pool=self.host, device_pool=kv,
                                                     layer_mapping=layers, transfer_layer_id_max=LAYERS,
                                                     is_anchor=True)])
        # As UnifiedRadixCache.init_hicache: SGLang's parse of the extra config, then
        # --file-storage-path added to it.
        extra, threshold, _, _, self.pass_prefix_keys = HybridCacheController.parse_storage_backend_extra_config(
            mem.hicache_storage_backend_extra_config)
        if server_args.file_storage_path:
            extra = dict(extra or {})
            extra.setdefault("file_storage_path", server_args.file_storage_path)
        self.ctl = HybridCacheController(
            allocator, group_host, PAGE, group, load_cache_event=threading.Event(),
            write_policy=mem.hicache_write_policy, io_backend=mem.hicache_io_backend,
            storage_backend=mem.hicache_storage_backend, prefetch_threshold=threshold, model_name="tiny",
            storage_backend_extra_config=extra, transfer_layer_id_max=LAYERS,
            enable_storage_metrics=server_args.enable_metrics, host_memory_mode=mem.hicache_host_memory_mode)
        self.requests = 0

    @property
    def backend(self) -> Any:
        return self.ctl.storage_backend

    def close(self) -> None:
        self.ctl.detach_storage_backend()

    # ------------------------------------------------------------------ what the tree does

    def backup(self, seq: int, hashes: list[str], start: int, end: int) -> int:
        """Back up pages ``start..end`` of sequence ``seq`` from the host pool, as a tree
        node whose parent ends at ``start``: the tokens acknowledged."""
        idx = self.host.alloc((end - start) * PAGE)
        for i in range(start, end):
            self.host.set_from_flat_data_page(idx[(i - start) * PAGE], page_data(self.host, hashes[i], self.rank))
        prefix = hashes[:start] if self.pass_prefix_keys else None
        self.ctl.write_storage(idx, tokens(seq)[start * PAGE:end * PAGE], hashes[start:end], prefix)
        op = self.ctl.ack_backup_queue.get(timeout=WAIT_S)
        self.host.free(idx)
        return op.completed_tokens

    def prefetch(self, seq: int, host_pages: int, pages: int) -> dict[str, Any]:
        """Prefetch pages ``host_pages..pages`` of ``seq`` (the first ``host_pages`` are in
        host memory): the hit the ranks agreed, the pages loaded, and how many of those
        differ from what was backed up."""
        from sglang.srt.mem_cache.base_prefix_cache import CacheRequestHandle

        hashes = page_hashes(seq, pages)
        last_hash = hashes[host_pages - 1] if host_pages else None
        prefix = hashes[:host_pages] if self.pass_prefix_keys else None
        self.requests += 1
        handle = CacheRequestHandle(rid=f"r{self.requests}", attempt_id=0)
        op = self.ctl.prefetch(handle, tokens(seq)[host_pages * PAGE:pages * PAGE], last_hash, prefix)
        got = self.ctl.prefetch_hit_queue.get(timeout=WAIT_S)
        assert got is op
        hit = op.storage_hit_count
        out = {"hit_pages": hit // PAGE, "loaded_pages": 0, "wrong_pages": 0}
        if hit < self.ctl.prefetch_threshold:
            return out  # the tree revokes a hit under the threshold: nothing is read
        indices, alloc = self.ctl.allocate_storage_hit(op, hit, allow_partial=True,
                                                       min_tokens=self.ctl.prefetch_threshold,
                                                       evict_host=lambda n: 0)
        op.storage_hit_count = alloc
        op.hash_value = op.hash_value[: alloc // PAGE]
        op.host_indices = indices
        self.ctl.prefetch_buffer.put(op)
        done = 0
        while True:
            ack = self.ctl.ack_prefetch_queue.get(timeout=WAIT_S)
            if ack.completed_tokens is not None:
                done = ack.completed_tokens
            if ack.completed_req:
                break
        loaded = done // PAGE
        wrong = 0
        for i in range(loaded):
            got_page = self.host.get_data_page(int(indices[i * PAGE]), flat=True)
            wrong += not bool((got_page == page_data(self.host, hashes[host_pages + i], self.rank)).all())
        self.host.free(indices)
        out.update(loaded_pages=loaded, wrong_pages=wrong)
        return out

    def log_metrics(self) -> dict[str, float]:
        """What ``UnifiedRadixCache`` does on every step with --enable-metrics: the backend's
        ``get_stats()`` into SGLang's ``StorageMetricsCollector.log_storage_metrics``;
        the histograms' counts and sums as the collector recorded them."""
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
        from sglang.srt.observability.metrics_collector import (
            StorageMetrics,
            StorageMetricsCollector,
        )

        registry = CollectorRegistry()

        class Collector(StorageMetricsCollector):  # SGLang's own hooks, bound to a private registry
            _counter_cls = functools.partial(Counter, registry=registry)
            _gauge_cls = functools.partial(Gauge, registry=registry)
            _histogram_cls = functools.partial(Histogram, registry=registry)

        labels = {"tp_rank": str(self.rank)}
        collector = Collector(labels)
        metrics = self.backend.get_stats()
        if metrics is None:
            metrics = StorageMetrics()
        if not hasattr(metrics, "prefetch_stats"):
            metrics.prefetch_stats = {}
        collector.log_storage_metrics(metrics)
        out = {}
        for name in ("prefetch_pgs", "backup_pgs", "prefetch_bandwidth", "backup_bandwidth"):
            for part in ("count", "sum"):
                out[f"{name}_{part}"] = registry.get_sample_value(f"sglang:{name}_{part}", labels) or 0.0
        return out


def tokens(seq: int) -> list[int]:
    """Sequence ``seq``'s token ids (1,600 tokens: 400 pages)."""
    return [(seq * 7919 + i * 104729) % 50000 for i in range(400 * PAGE)]


def page_hashes(seq: int, pages: int) -> list[str]:
    """SGLang's storage page hashes of the first ``pages`` pages of ``seq``."""
    from sglang.srt.mem_cache.utils import get_storage_hash_str

    return list(get_storage_hash_str(array("q", tokens(seq)[: pages * PAGE]), None, page_size=PAGE))


def page_data(host: Any, key: str, rank: int) -> Any:
    """The content of page ``key`` on ``rank``: a pure function of both, in the pool's page shape."""
    import hashlib

    import torch

    g = torch.Generator().manual_seed(int(hashlib.sha256(f"{key}/{rank}".encode()).hexdigest()[:12], 16))
    dummy = host.get_dummy_flat_data_page()
    return torch.randn(dummy.shape, generator=g).to(dummy.dtype)


# ---------------------------------------------------------------------- the scenario

SEQ_A, SEQ_B = 1, 2


def scenario(sched: Scheduler) -> dict[str, Any]:
    """The calls of three requests, as SGLang's tree makes them, and what came of them.

    Sequence A: a node of pages 0..100, then its child 100..300 (two 128-page backup
    batches), then (rank 0 only, so two ranks disagree) 300..340; a request with pages
    0..100 in host memory prefetches 100..340. Sequence B: only its pages 50..150 are
    backed up (the parent 0..50 never was); a request with 0..50 in host memory
    prefetches 50..150."""
    out: dict[str, Any] = {}
    a = page_hashes(SEQ_A, 340)
    acks = [sched.backup(SEQ_A, a, 0, 100), sched.backup(SEQ_A, a, 100, 300)]
    if sched.rank == 0:
        acks.append(sched.backup(SEQ_A, a, 300, 340))
    b = page_hashes(SEQ_B, 150)
    acks.append(sched.backup(SEQ_B, b, 50, 150))
    out["acked_tokens"] = acks
    out["after_host_prefix"] = sched.prefetch(SEQ_A, 100, 340)
    out["unstored_parent"] = sched.prefetch(SEQ_B, 50, 150)
    out["from_start"] = sched.prefetch(SEQ_A, 0, 340)
    try:
        out["metrics"] = sched.log_metrics()
    except Exception as exc:  # what the scheduler's step would die of
        out["metrics"] = {"error": f"{type(exc).__name__}: {exc}"}
    return out


def run(out_path: str, root: str, rank: int, size: int, port: int) -> None:
    stand_in_for_torchvision()
    import torch
    from sglang.srt.runtime_context import get_parallel

    group = None
    if size > 1:
        torch.distributed.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}",
                                             rank=rank, world_size=size)
        group = torch.distributed.group.WORLD
    get_parallel().override_permanently(tp_rank=rank, tp_size=size, pp_rank=0, pp_size=1, attn_dcp_rank=0)
    results: dict[str, Any] = {}
    backends = [("prefixstore", True), ("prefixstore", False)] + (
        [("file", True), ("file", False)] if size == 1 else [])
    for backend, keys in backends:
        name = f"{backend}-{'prefix_keys' if keys else 'no_prefix_keys'}"
        where = os.path.join(root, name)
        t0 = time.monotonic()
        try:
            sched = Scheduler(launch_flags(where, keys, size, backend), rank, size, group)
        except Exception as exc:  # a backend SGLang cannot attach: the run says why
            results[name] = {"attach_error": f"{type(exc).__name__}: {exc}"}
            continue
        try:
            results[name] = scenario(sched)
            results[name]["backend_type"] = type(sched.backend).__name__
        except Exception as exc:
            results[name] = {"error": f"{type(exc).__name__}: {exc}"}
        finally:
            sched.close()
        if backend == "prefixstore" and "error" not in results[name]:
            again = Scheduler(launch_flags(where, keys, size, backend), rank, size, group)
            try:  # a new process's backend over the same directory: its map is the catalog's
                results[name]["after_restart"] = again.prefetch(SEQ_A, 100, 340)
            finally:
                again.close()
        results[name]["seconds"] = round(time.monotonic() - t0, 1)
    with open(out_path, "w") as f:
        json.dump(results, f, indent=1)
    if group is not None:
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    sys.path[:0] = [HERE, os.path.dirname(HERE)]  # this checkout's prefixstore
    o, r, rk, sz, pt = sys.argv[1:6]
    run(o, r, int(rk), int(sz), int(pt))
