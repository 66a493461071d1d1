"""Host-pool doubles and a driver issuing SGLang's storage calls (not a test module).

SGLang's real host pools (``sglang.srt.mem_cache.pool_host``) cannot be imported on this
CPU machine (their package imports torchvision through the model configs), so
``HostPool`` is a double of the methods SGLang's storage backends call on them
(``page_size``, ``layout``, ``dtype``, ``get_data_page``, ``get_dummy_flat_data_page``,
``set_from_flat_data_page``), modelled on the ``MockHostKVCache`` of SGLang's own storage
tests, over a real CPU buffer.

The driver issues the calls in the order of SGLang's cache controllers
(``managers/cache_controller.py``, ``mem_cache/hybrid_cache/hybrid_cache_controller.py``):
write-back: the trailing pools' ``batch_set_v2`` first, then KV ``batch_set_v1`` in
batches of ``STORAGE_BATCH_SIZE`` with ``prefix_keys`` advancing, stopping at the first
failed batch; prefetch: one ``batch_exists`` over every page (``batch_exists_v2`` with
trailing pools; in 0.5.23 even KV-only models get the hybrid controller), the ranks' agreement (MIN, or the intersection of ``restorable_prefix_pages``), then KV
``batch_get_v1`` batch by batch, then the trailing pools' ``batch_get_v2``.

Run as a script it is the process a crash test SIGKILLs:
``python tests/sglang_driver.py DIR [hybrid]`` reads batch numbers on stdin, writes each
batch of ``CRASH_BATCH`` pages (and, hybrid, a Mamba state at its end) and prints
``ACK <batch> <ok>`` once ``batch_set_v1`` returned. A line ``<batch> stall`` writes that
batch with the KV engine's fault hook armed: once the batch's shard is renamed into
place (before the checkpoint is published) it prints ``STALL <shard path>`` and blocks,
so the kill lands inside that batch's store, at a known point.
"""

from __future__ import annotations

import hashlib
import sys
import threading
from collections.abc import Sequence

import torch
from sglang.srt.mem_cache.hicache_storage import (
    STORAGE_BATCH_SIZE,
    HiCacheStorageConfig,
    HiCacheStorageExtraInfo,
    PoolHitPolicy,
    PoolName,
    PoolTransfer,
)
from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory

from prefixstore.gpu.fileio import FaultHook

PAGE = 4  # tokens per page in the functional tests
CRASH_BATCH = 16


class HostPool:
    """A page_first host pool over a CPU tensor ``(slots, *token_shape)``."""

    def __init__(self, slots: int, page_size: int, token_shape: Sequence[int], dtype=torch.bfloat16) -> None:
        self.page_size, self.layout, self.dtype = page_size, "page_first", dtype
        self.size = slots  # host slots, as SGLang's pools count them
        self.token_shape = tuple(token_shape)
        self.kv_buffer = torch.zeros((slots, *self.token_shape), dtype=dtype)

    def get_data_page(self, index, flat: bool = True) -> torch.Tensor:
        page = self.kv_buffer[int(index): int(index) + self.page_size]
        return page.flatten() if flat else page

    def get_dummy_flat_data_page(self) -> torch.Tensor:
        return torch.zeros((self.page_size, *self.token_shape), dtype=self.dtype).flatten()

    def set_from_flat_data_page(self, index, data_page: torch.Tensor) -> None:
        i = int(index)
        self.kv_buffer[i: i + self.page_size] = data_page.reshape(self.page_size, *self.token_shape)


def kv_pool(slots: int = 4096, page: int = PAGE) -> HostPool:
    return HostPool(slots, page, (2, 2, 2, 8))  # (k/v, layers, heads, head_dim) per token


def mamba_pool(slots: int = 64) -> HostPool:
    return HostPool(slots, 1, (3, 16), dtype=torch.float32)  # one state per slot


def page_keys(seq: int, n: int, start: int = 0) -> list[str]:
    """SGLang-style chained page hashes of sequence ``seq``."""
    out, prev = [], f"seq{seq}".encode()
    for i in range(start + n):
        prev = hashlib.sha256(prev + i.to_bytes(4, "little")).hexdigest().encode()
        if i >= start:
            out.append(prev.decode())
    return out


def page_data(pool: HostPool, key: str, rank: int) -> torch.Tensor:
    """The deterministic content of page ``key`` on ``rank`` (pure function of both)."""
    g = torch.Generator().manual_seed(int(hashlib.sha256(f"{key}/{rank}".encode()).hexdigest()[:12], 16))
    shape = (pool.page_size, *pool.token_shape)
    return torch.randn(shape, generator=g).to(pool.dtype)


def config(root: str, rank: int = 0, size: int = 1, **extra) -> HiCacheStorageConfig:
    return HiCacheStorageConfig(
        tp_rank=rank, tp_size=size, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1,
        is_mla_model=False, enable_storage_metrics=True, is_page_first_layout=True,
        model_name="tiny", extra_config={
            "backend_name": "prefixstore", "module_path": "prefixstore.adapters.sglang",
            "class_name": "PrefixStoreHiCache", "dir": root, "capacity_bytes": 64 << 20, **extra,
        },
    )


class Rank:
    """One tensor-parallel rank: its backend (made by SGLang's factory) and host pools."""

    def __init__(self, root: str, rank: int = 0, size: int = 1, hybrid: bool = False,
                 kv: HostPool | None = None, engine_options: dict | None = None, **extra) -> None:
        self.rank = rank
        self.kv = kv or kv_pool()
        self.mamba = mamba_pool() if hybrid else None
        self.backend = StorageBackendFactory.create_backend(  # the factory hands **kwargs to the class
            "dynamic", config(root, rank, size, **extra), self.kv, engine_options=engine_options or {})
        self.backend.register_mem_pool_host(self.kv)
        if self.mamba is not None:
            self.backend.register_mem_host_pool_v2(self.mamba, PoolName.MAMBA)
        self.backend.on_host_pools_registered()
        self.next_slot = 0
        self.state_ok = False  # whether the last write-back's state was acknowledged

    def slots(self, pages: int) -> torch.Tensor:
        """Fresh host slots for ``pages`` KV pages (wrapping around the buffer)."""
        n = pages * self.kv.page_size
        if self.next_slot + n > self.kv.kv_buffer.shape[0]:
            self.next_slot = 0
        idx = torch.arange(self.next_slot, self.next_slot + n, dtype=torch.int64)
        self.next_slot += n
        return idx

    def close(self) -> None:
        self.backend.close()


def write_back(rk: Rank, prefix: list[str], keys: list[str], state_at_end: bool = False) -> int:
    """Write pages ``keys`` (after ``prefix``) from host memory; returns pages acknowledged."""
    idx = rk.slots(len(keys))
    for i, k in enumerate(keys):
        rk.kv.set_from_flat_data_page(idx[i * rk.kv.page_size], page_data(rk.kv, k, rk.rank).flatten())
    if state_at_end and rk.mamba is not None:
        slot = torch.tensor([rk.rank % rk.mamba.kv_buffer.shape[0]])
        rk.mamba.set_from_flat_data_page(slot[0], page_data(rk.mamba, keys[-1], rk.rank).flatten())
        t = PoolTransfer(name=PoolName.MAMBA, host_indices=slot, keys=[keys[-1]],
                         hit_policy=PoolHitPolicy.TRAILING_PAGES)
        res = rk.backend.batch_set_v2([t], HiCacheStorageExtraInfo(prefix_keys=prefix + keys[:-1]))
        rk.state_ok = res[str(PoolName.MAMBA)] == [True]
    done = 0
    for s in range(0, len(keys), STORAGE_BATCH_SIZE):
        batch = keys[s: s + STORAGE_BATCH_SIZE]
        sl = idx[s * rk.kv.page_size: (s + len(batch)) * rk.kv.page_size]
        ok = rk.backend.batch_set_v1(batch, sl, HiCacheStorageExtraInfo(prefix_keys=prefix + keys[:s]))
        if not all(ok):
            break
        done += len(batch)
    return done


def query(rk: Rank, prefix: list[str], keys: list[str]):
    """The rank's answer to the prefetch query: (pages, restorable set or None)."""
    info = HiCacheStorageExtraInfo(prefix_keys=list(prefix))
    if rk.mamba is None:  # the hybrid controller (every model's in 0.5.23) asks in one call
        return rk.backend.batch_exists(keys, info), None
    t = PoolTransfer(name=PoolName.MAMBA, keys=keys[-1:], hit_policy=PoolHitPolicy.TRAILING_PAGES)
    res = rk.backend.batch_exists_v2(keys, [t], info)
    return res.kv_hit_pages, set(res.restorable_prefix_pages or [])


def agree(answers: list[tuple[int, set | None]]) -> int:
    """What SGLang's rank reduction makes of the ranks' answers."""
    if answers[0][1] is None:
        return min(a[0] for a in answers)
    common = set.intersection(*(a[1] for a in answers))
    return max(common, default=0)


def fetch(rk: Rank, prefix: list[str], keys: list[str], pages: int):
    """Load ``pages`` pages of ``keys`` (and the state at their end): (pages read, KV tensors, state)."""
    keys = keys[:pages]
    idx = rk.slots(len(keys))
    got = 0
    for s in range(0, len(keys), STORAGE_BATCH_SIZE):
        batch = keys[s: s + STORAGE_BATCH_SIZE]
        sl = idx[s * rk.kv.page_size: (s + len(batch)) * rk.kv.page_size]
        ok = rk.backend.batch_get_v1(batch, sl, HiCacheStorageExtraInfo(prefix_keys=prefix + keys[:s]))
        n = ok.index(False) if False in ok else len(ok)
        got += n
        if n < len(batch):
            break
    rows = [rk.kv.get_data_page(idx[i * rk.kv.page_size], flat=False).clone() for i in range(got)]
    state = None
    if rk.mamba is not None and got == len(keys) and keys:
        slot = torch.tensor([rk.mamba.kv_buffer.shape[0] - 1])
        t = PoolTransfer(name=PoolName.MAMBA, host_indices=slot, keys=keys[-1:],
                         hit_policy=PoolHitPolicy.TRAILING_PAGES)
        res = rk.backend.batch_get_v2([t], HiCacheStorageExtraInfo(prefix_keys=prefix + keys[:-1]))
        if res[str(PoolName.MAMBA)] == [True]:
            state = rk.mamba.get_data_page(slot[0], flat=False).clone()
    return got, rows, state


class StallHook(FaultHook):
    """When armed: after a KV shard is renamed into place, say so and block forever."""

    def __init__(self) -> None:
        self.armed = False

    def after(self, op: str, target: str, rank: int | None) -> None:
        if self.armed and op == "rename" and f"{PoolName.KV.value}/rank" in target:
            print(f"STALL {target}", flush=True)
            threading.Event().wait()


def main(root: str, hybrid: bool) -> None:
    hook = StallHook()
    rk = Rank(root, hybrid=hybrid, engine_options={"hook": hook})
    keys = page_keys(7, 64 * CRASH_BATCH)
    for line in sys.stdin:
        b, *how = line.split()
        b = int(b)
        hook.armed = how == ["stall"]
        s = b * CRASH_BATCH
        ok = write_back(rk, keys[:s], keys[s: s + CRASH_BATCH], state_at_end=hybrid) == CRASH_BATCH
        print(f"ACK {b} {int(ok and (rk.state_ok or not hybrid))}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:] == ["hybrid"])
