"""prefixstore as an LMCache 0.5.6 remote storage plugin: ``PrefixStoreRemoteConnector``.

LMCache loads it from its config (docs/lmcache.md has the whole config)::

    remote_storage_plugins: ["prefixstore"]
    extra_config:
      remote_storage_plugin.prefixstore.module_path: prefixstore.adapters.lmcache
      remote_storage_plugin.prefixstore.class_name: PrefixStoreRemoteConnector
      remote_storage_plugin.prefixstore.dir: /var/cache/prefixstore-lmcache

Mapping. LMCache hands a remote backend independent chunks: a ``CacheEngineKey`` (model,
world size, worker, the chunk's prefix hash, dtype) and a ``MemoryObj`` (the chunk's KV
bytes, up to ``chunk_size`` tokens). Each chunk is one prefixstore checkpoint of one
block (the digest of the key's string) whose snapshot holds LMCache's own chunk header
(``RemoteMetadata``: length, shapes, dtypes, format), the key string and the bytes,
padded to a full chunk. LMCache walks the chunks of a prefix itself; the engine gives
each one durability (a ``put`` returns once the checkpoint is published), verification
(a shard that fails its checksum is a miss, never other bytes), eviction within
``capacity_bytes`` and ``prefixstore audit``.

Workers. Each LMCache worker (tensor-parallel rank) runs its own plugin over its own
engine in ``DIR/worker{id}of{world}``: keys carry the worker, and an engine directory
has one process.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import os
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from prefixstore.adapters.vllm_options import UnknownConfigKeysError
from prefixstore.base.errors import InvalidInputError, PrefixStoreError
from prefixstore.base.keys import DIGEST_SIZE, Prefix
from prefixstore.base.layout import Layout, TensorSpec
from prefixstore.base.log import log
from prefixstore.engine.api import Engine
from prefixstore.engine.catalog_reader import read_listing

try:
    from lmcache.utils import CacheEngineKey
    from lmcache.v1.memory_management import MemoryObj
    from lmcache.v1.protocol import RemoteMetadata
    from lmcache.v1.storage_backend.connector.base_connector import RemoteConnector
except ImportError as exc:  # pragma: no cover - exercised only where lmcache is absent
    raise ImportError(
        "prefixstore.adapters.lmcache needs lmcache: pip install --no-deps lmcache==0.5.6 and "
        'pip install -e ".[lmcache]" (see docs/lmcache.md)'
    ) from exc

KEY_BYTES = 1024
"""Room for a key's string in a checkpoint (a longer key is refused)."""
DEFAULT_CAPACITY = 64 << 30
OPTIONS = frozenset({"module_path", "class_name", "dir", "capacity_bytes", "synchronous", "policy", "backing",
                     "ram_bytes", "threads"})
"""The ``remote_storage_plugin.<name>.*`` keys this plugin reads (the first two are LMCache's)."""


class PrefixStoreRemoteConnector(RemoteConnector):
    """An LMCache ``RemoteConnector`` over one prefixstore engine per worker."""

    def __init__(self, loop: asyncio.AbstractEventLoop, local_cpu_backend: Any, config: Any) -> None:
        super().__init__(local_cpu_backend.config, local_cpu_backend.metadata)
        self.loop = loop
        self.local_cpu_backend = local_cpu_backend
        self.name, opts = plugin_options(config, type(self))
        root = opts.get("dir")
        if not isinstance(root, str) or not root:
            raise InvalidInputError(f"remote_storage_plugin.{self.name}.dir must be a directory path, got {root!r}")
        md = local_cpu_backend.metadata
        self.path = os.path.join(root, f"worker{md.worker_id}of{md.world_size}")
        self.chunk_bytes = int(self.full_chunk_size_bytes)
        self.layout = Layout(
            segments=[TensorSpec("mark", "uint8", (1,))],
            snapshots=[TensorSpec("header", "uint8", (int(self.remote_metadata_bytes),)),
                       TensorSpec("key", "uint8", (KEY_BYTES,)), TensorSpec("chunk", "uint8", (self.chunk_bytes,))],
            block_tokens=1,
        )
        engine_opts: dict[str, Any] = {"synchronous": opts.get("synchronous", "FULL")}
        for k in ("policy", "backing", "ram_bytes"):
            if k in opts:
                engine_opts[k] = opts[k]
        capacity = _positive(opts, "capacity_bytes", DEFAULT_CAPACITY, self.name)
        threads = _positive(opts, "threads", 4, self.name)
        os.makedirs(self.path, exist_ok=True)
        self.engine = Engine.open(self.path, self.layout, capacity, **engine_opts)
        self.pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="prefixstore-lmcache")
        self.closed = False

    # ------------------------------------------------------------------ LMCache's calls

    async def exists(self, key: CacheEngineKey) -> bool:
        return await self.loop.run_in_executor(self.pool, self.exists_sync, key)

    def exists_sync(self, key: CacheEngineKey) -> bool:
        try:
            return self.engine.lookup(self.prefix_of(key)).hit
        except PrefixStoreError as exc:
            log.warning("lmcache_exists_failed", key=key.to_string(), error=str(exc))
            return False

    async def get(self, key: CacheEngineKey) -> MemoryObj | None:
        return await self.loop.run_in_executor(self.pool, self.get_sync, key)

    async def put(self, key: CacheEngineKey, memory_obj: MemoryObj) -> None:
        """Store the chunk; returns once it is durably published (or was refused)."""
        await self.loop.run_in_executor(self.pool, self.put_sync, key, memory_obj)

    async def list(self) -> list[str]:
        return await self.loop.run_in_executor(self.pool, self.list_sync)

    async def close(self) -> None:
        await self.loop.run_in_executor(None, self.close_sync)

    # ------------------------------------------------------------------ blocking halves

    def get_sync(self, key: CacheEngineKey) -> MemoryObj | None:
        """The chunk of ``key``, verified; None on a miss, a damaged shard or no memory."""
        name = key.to_string()
        try:
            m = self.engine.lookup(self.prefix_of(key))
            restored = self.engine.restore(m) if m.hit else None
        except PrefixStoreError as exc:
            log.warning("lmcache_get_failed", key=name, error=str(exc))
            return None
        if restored is None:
            return None
        snap = restored.snapshot[0]
        if _text(snap["key"]) != name:  # another key with the same digest: never its bytes
            return None
        header = RemoteMetadata.deserialize(snap["header"].numpy().tobytes())
        if not 0 < header.length <= self.chunk_bytes:
            return None
        obj = self.local_cpu_backend.allocate(header.shapes, header.dtypes, header.fmt)
        if obj is None:
            return None
        try:
            out = torch.frombuffer(obj.byte_array, dtype=torch.uint8)
            out[: header.length].copy_(snap["chunk"][: header.length])
            return self.reshape_partial_chunk(obj, header.length) if header.length < len(out) else obj
        except (ValueError, RuntimeError) as exc:  # a header LMCache's allocation does not match
            obj.ref_count_down()
            log.warning("lmcache_get_unusable", key=name, error=str(exc))
            return None

    def put_sync(self, key: CacheEngineKey, memory_obj: MemoryObj) -> bool:
        """Store one chunk; True when it is (now or already) durably stored."""
        name = key.to_string().encode()
        if len(name) > KEY_BYTES:
            raise InvalidInputError(f"key {name[:64]!r}... is longer than {KEY_BYTES} bytes")
        data = memory_obj.byte_array
        length = len(data)
        if not 0 < length <= self.chunk_bytes:
            raise InvalidInputError(f"a chunk of {length} bytes does not fit a full chunk of {self.chunk_bytes}")
        header = RemoteMetadata(length, memory_obj.get_shapes(), memory_obj.get_dtypes(),
                                memory_obj.get_memory_format()).serialize()
        chunk = torch.zeros(self.chunk_bytes, dtype=torch.uint8)
        chunk[:length].copy_(torch.frombuffer(bytearray(data) if isinstance(data, bytes) else data,
                                              dtype=torch.uint8))
        key_field = torch.zeros(KEY_BYTES, dtype=torch.uint8)
        key_field[: len(name)].copy_(torch.frombuffer(bytearray(name), dtype=torch.uint8))
        snapshot = {"header": torch.frombuffer(bytearray(header), dtype=torch.uint8), "key": key_field,
                    "chunk": chunk}
        try:
            res = self.engine.store(self.prefix_of(key), {"mark": torch.zeros((1, 1), dtype=torch.uint8)}, snapshot)
        except PrefixStoreError as exc:
            log.warning("lmcache_put_failed", key=key.to_string(), error=str(exc))
            return False
        return res.ok

    def list_sync(self) -> list[str]:
        """Every stored key (each checkpoint is read and verified: O(chunks), for tools)."""
        out = []
        listing = read_listing(self.path, ("nodes",))
        for row in listing.tables[0].rows:
            if row.get("state") != "ready" or len(row.get("digests") or b"") != DIGEST_SIZE:
                continue
            with contextlib.suppress(PrefixStoreError):
                m = self.engine.lookup(Prefix([bytes(row["digests"])]))
                r = self.engine.restore(m) if m.hit else None
                if r is not None:
                    out.append(_text(r.snapshot[0]["key"]))
        return out

    def close_sync(self) -> None:
        """Finish the calls in flight and close the engine (again: nothing)."""
        if self.closed:
            return
        self.closed = True
        self.pool.shutdown(wait=True)
        self.engine.close()

    def stats(self) -> dict[str, Any]:
        """The engine's ``stats()``."""
        return self.engine.stats()

    @staticmethod
    def prefix_of(key: CacheEngineKey) -> Prefix:
        """The one-block Prefix a key is stored under (its string's digest)."""
        return Prefix([hashlib.blake2b(key.to_string().encode(), digest_size=DIGEST_SIZE).digest()])


def plugin_options(config: Any, cls: type) -> tuple[str, dict[str, Any]]:
    """The plugin's name (the one of ``remote_storage_plugins`` naming ``cls``) and its
    ``remote_storage_plugin.<name>.*`` options; unknown option keys are refused."""
    extra: Mapping[str, Any] = getattr(config, "extra_config", None) or {}
    names = [n for n in (getattr(config, "remote_storage_plugins", None) or [])
             if extra.get(f"remote_storage_plugin.{n}.module_path") == cls.__module__
             and extra.get(f"remote_storage_plugin.{n}.class_name") == cls.__name__]
    if len(names) != 1:
        raise InvalidInputError(f"remote_storage_plugins: expected one plugin naming {cls.__module__}."
                                f"{cls.__name__}, found {names}")
    head = f"remote_storage_plugin.{names[0]}."
    opts = {k[len(head):]: v for k, v in extra.items() if k.startswith(head)}
    unknown = sorted(set(opts) - OPTIONS)
    if unknown:
        raise UnknownConfigKeysError([head + k for k in unknown], OPTIONS, "extra_config")
    return names[0], opts


def _positive(opts: Mapping[str, Any], key: str, default: int, name: str) -> int:
    v = opts.get(key, default)
    if isinstance(v, str) and v.isdigit():
        v = int(v)
    if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
        raise InvalidInputError(f"remote_storage_plugin.{name}.{key} must be a positive integer, got {v!r}")
    return v


def _text(field: torch.Tensor) -> str:
    raw = field.numpy().tobytes()
    return raw.split(b"\0", 1)[0].decode(errors="replace")
