"""A real LMCacheEngine on the CPU with prefixstore as its remote storage plugin (not a
test module).

Everything LMCache-side is LMCache's own: ``LMCacheEngineConfig`` with ``local_cpu`` on
and ``remote_storage_plugins: ["prefixstore"]``, ``LMCacheMetadata``,
``LMCacheEngineBuilder.get_or_create`` and ``post_init`` (the storage manager, the local
CPU backend, the remote backend that loads the plugin by module path and class name),
``store`` / ``retrieve`` / ``lookup`` over its token database. Only the GPU connector is
replaced: LMCache's own calls CUDA, so ``CPUConnector`` gathers and scatters a chunk's
rows by slot mapping over CPU KV tensors, as LMCache's vLLM connector does on a GPU.

``serve`` is the process a crash test SIGKILLs (forked, or as a script:
``python tests/lmcache_driver.py DIR`` reads prompt seeds on stdin, stores each prompt
and prints ``ACK <seed> 1`` once every one of its chunks is in the plugin).
"""

from __future__ import annotations

import os
import sys
import time
import uuid
from typing import Any

import torch
from lmcache.v1.cache_engine import LMCacheEngineBuilder
from lmcache.v1.config import LMCacheEngineConfig
from lmcache.v1.gpu_connector import GPUConnectorInterface
from lmcache.v1.metadata import LMCacheMetadata

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

LAYERS, HEADS, HEAD, CHUNK = 2, 2, 8, 16
PLUGIN = "prefixstore"


class CPUConnector(GPUConnectorInterface):
    """LMCache's GPU connector over CPU tensors: ``kvcaches`` is one ``[2, slots, heads,
    head]`` tensor per layer; a chunk is ``[2, layers, tokens, heads * head]``."""

    def __init__(self, layers: int = LAYERS, heads: int = HEADS, head: int = HEAD) -> None:
        self.layers, self.hidden = layers, heads * head
        self.kvcaches = None

    def get_shape(self, num_tokens: int) -> torch.Size:
        return torch.Size([2, self.layers, num_tokens, self.hidden])

    def from_gpu(self, memory_obj: Any, start: int, end: int, **kwargs: Any) -> None:
        slots = kwargs["slot_mapping"][start:end]
        out = memory_obj.tensor
        for layer, kv in enumerate(kwargs["kvcaches"]):
            out[:, layer, : end - start].copy_(kv[:, slots].reshape(2, end - start, self.hidden))

    def to_gpu(self, memory_obj: Any, start: int, end: int, **kwargs: Any) -> None:
        slots = kwargs["slot_mapping"][start:end]
        src = memory_obj.tensor
        for layer, kv in enumerate(kwargs["kvcaches"]):
            kv[:, slots] = src[:, layer, : end - start].reshape(2, end - start, *kv.shape[2:])

    def batched_from_gpu(self, memory_objs, starts, ends, **kwargs: Any) -> None:
        for obj, s, e in zip(memory_objs, starts, ends, strict=True):
            self.from_gpu(obj, s, e, **kwargs)

    def batched_to_gpu(self, memory_objs=None, starts=None, ends=None, **kwargs: Any) -> None:
        for obj, s, e in zip(memory_objs or [], starts or [], ends or [], strict=True):
            self.to_gpu(obj, s, e, **kwargs)


def config(root: str, **plugin: Any) -> LMCacheEngineConfig:
    """local_cpu on (LMCache's remote backend buffers through it), the plugin below it."""
    extra = {f"remote_storage_plugin.{PLUGIN}.module_path": "prefixstore.adapters.lmcache",
             f"remote_storage_plugin.{PLUGIN}.class_name": "PrefixStoreRemoteConnector",
             f"remote_storage_plugin.{PLUGIN}.dir": root}
    extra.update({f"remote_storage_plugin.{PLUGIN}.{k}": v for k, v in plugin.items()})
    return LMCacheEngineConfig.from_defaults(
        chunk_size=CHUNK, local_cpu=True, max_local_cpu_size=0.05, remote_storage_plugins=[PLUGIN],
        remote_serde="naive", save_unfull_chunk=True, pre_caching_hash_algorithm="sha256_cbor_64bit",
        extra_config=extra)


def metadata() -> LMCacheMetadata:
    return LMCacheMetadata(model_name="tiny-llama", world_size=1, local_world_size=1, worker_id=0,
                           local_worker_id=0, kv_dtype=torch.float16, kv_shape=(LAYERS, 2, CHUNK, HEADS, HEAD),
                           chunk_size=CHUNK)


class Engine:
    """One LMCacheEngine (its own instance id) and a CPU KV cache of ``slots`` token slots."""

    def __init__(self, root: str, slots: int = 512, **plugin: Any) -> None:
        self.id = f"prefixstore-{uuid.uuid4().hex[:8]}"
        self.engine = LMCacheEngineBuilder.get_or_create(self.id, config(root, **plugin), metadata(), CPUConnector(),
                                                         lambda t, r: None, lambda o, r: o)
        self.engine.post_init()
        self.kv = [torch.zeros(2, slots, HEADS, HEAD, dtype=torch.float16) for _ in range(LAYERS)]

    @property
    def plugin(self):
        backends = self.engine.storage_manager.storage_backends
        conn = backends[f"RemoteBackend-{PLUGIN}"].connection
        return getattr(conn, "_connector", conn)  # LMCache wraps it in its InstrumentedRemoteConnector

    def store(self, tokens: list[int], kv_rows: list[torch.Tensor]) -> None:
        """Put ``kv_rows`` (one ``[2, n, heads, head]`` per layer) in slots ``0..n`` and store."""
        n = len(tokens)
        for layer, rows in enumerate(kv_rows):
            self.kv[layer][:, :n] = rows
        self.engine.store(torch.tensor(tokens), kvcaches=self.kv, slot_mapping=torch.arange(n))

    def retrieve(self, tokens: list[int]) -> tuple[int, list[torch.Tensor]]:
        """Tokens retrieved into fresh slots, and those slots' rows per layer."""
        n = len(tokens)
        for kv in self.kv:
            kv.zero_()
        got = self.engine.retrieve(torch.tensor(tokens), kvcaches=self.kv, slot_mapping=torch.arange(n))
        hit = int(got.sum())
        return hit, [kv[:, :hit].clone() for kv in self.kv]

    def wait_stored(self, tokens: list[int], timeout: float = 30.0) -> bool:
        """True once every chunk of ``tokens`` is in the plugin (its put returned)."""
        keys = [key for _s, _e, key in self.engine.token_database.process_tokens(torch.tensor(tokens))]
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if all(self.plugin.exists_sync(k) for k in keys):
                return True
            time.sleep(0.01)
        return False

    def close(self) -> None:
        LMCacheEngineBuilder.destroy(self.id)


def prompt(seed: int, n: int) -> tuple[list[int], list[torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, 30000, (n,), generator=g).tolist()
    rows = [torch.randn(2, n, HEADS, HEAD, generator=g).to(torch.float16) for _ in range(LAYERS)]
    return tokens, rows


def serve(conn: Any, root: str) -> None:
    """A storing process: for each prompt seed received, store its prompt and answer
    ``("ACK", seed, ok)`` once every chunk is in the plugin."""
    torch.set_num_threads(1)
    eng = Engine(root)
    conn.send(("ready",))
    while True:
        seed = conn.recv()
        tokens, rows = prompt(seed, 3 * CHUNK + 5)
        eng.store(tokens, rows)
        conn.send(("ACK", seed, eng.wait_stored(tokens)))


def main() -> None:
    eng = Engine(sys.argv[1])
    for line in sys.stdin:
        seed = int(line)
        tokens, rows = prompt(seed, 3 * CHUNK + 5)
        eng.store(tokens, rows)
        ok = eng.wait_stored(tokens)
        print(f"ACK {seed} {int(ok)}", flush=True)


if __name__ == "__main__":
    main()
