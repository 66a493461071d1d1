"""prefixstore as SGLang's HiCache L3 storage backend (sglang 0.5.23).

SGLang loads it with ``--hicache-storage-backend dynamic`` and an ``extra_config`` naming
this module and ``PrefixStoreHiCache`` (see README, "SGLang HiCache backend").

Mapping. One SGLang page is one prefixstore block (``block_tokens`` = the KV page size).
``prefix_keys + keys`` of a call is one chain from the sequence start: a ``Prefix`` whose
digests are the page hashes. Every pool gets its own engine in its own directory:

- ``ALL_PAGES`` pools (the KV pool, indexers): a page is ``block_tokens`` rows of its flat
  bytes; a ``batch_set*`` stores its pages as one checkpoint (``checkpoint_pages`` > 0
  adds one at every multiple of that many pages), never one per page.
- ``TRAILING_PAGES`` pools (Mamba, SWA): each entry is a snapshot at the page boundary it
  belongs to (a one-byte-per-token marker segment carries the chain), so a trailing hit
  at length L is exactly a ready checkpoint with a snapshot at L.

Ranks. Each tensor-parallel rank runs its own backend instance over its own engines
(``DIR/tp{rank}of{size}``). ``batch_exists`` answers the rank's longest ready prefix (the
caller takes the minimum over ranks: every rank holds every page below its own hit);
``batch_exists_v2`` also answers ``restorable_prefix_pages``, the lengths this rank can
restore with every trailing pool, which the caller intersects over ranks. A rank whose
store failed therefore lowers the agreed length and never makes another rank restore a
boundary it holds from a different checkpoint.

Verification. Every read goes through ``Engine.restore``: a missing, short or altered
shard reads as a miss (``False`` for that page and every later one), never other bytes.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from prefixstore.base.errors import CatalogIOError, InvalidInputError, PrefixStoreError
from prefixstore.base.keys import DIGEST_SIZE, Prefix
from prefixstore.base.layout import Layout, TensorSpec
from prefixstore.engine.api import Engine
from prefixstore.statemachine.admission import RetentionAdmission
from prefixstore.statemachine.cost import CostModel

try:
    from sglang.srt.mem_cache.hicache_storage import (
        HiCacheStorage,
        HiCacheStorageConfig,
        HiCacheStorageExtraInfo,
        PoolHitPolicy,
        PoolName,
        PoolTransfer,
        PoolTransferResult,
    )
except ImportError as exc:  # pragma: no cover - exercised only where sglang is absent
    raise ImportError(
        "prefixstore.adapters.sglang needs sglang: pip install --no-deps sglang==0.5.23 "
        'and pip install -e ".[sglang]"'
    ) from exc

KV = str(PoolName.KV)
CONFIG_KEYS = frozenset({
    "backend_name", "module_path", "class_name", "interface_v1",
    "dir", "capacity_bytes", "pool_capacity_bytes", "backing", "ram_bytes", "policy",
    "synchronous", "checkpoint_pages", "retention", "cost",
})
"""The ``extra_config`` keys this backend reads (the first four are SGLang's own)."""


def page_digest(key: str) -> bytes:
    """The block digest of one SGLang page hash."""
    if not isinstance(key, str) or not key:
        raise InvalidInputError(f"keys: page hashes must be non-empty strings, got {key!r}")
    return hashlib.blake2b(key.encode(), digest_size=DIGEST_SIZE).digest()


def chain_of(keys: Sequence[str], extra_info: HiCacheStorageExtraInfo | None) -> tuple[list[bytes], int]:
    """The digests of ``prefix_keys + keys`` and how many of them precede ``keys``."""
    before = list(extra_info.prefix_keys or []) if extra_info is not None else []
    return [page_digest(k) for k in (*before, *keys)], len(before)


@dataclass
class HiCacheMetrics:
    """What ``get_stats`` hands SGLang's storage metrics collector (the fields of its
    ``StorageMetrics``: pages and GB/s per KV call since the last call), plus
    ``prefixstore``: each pool engine's ``stats()``."""

    prefetch_pgs: list[int] = field(default_factory=list)
    backup_pgs: list[int] = field(default_factory=list)
    prefetch_bandwidth: list[float] = field(default_factory=list)
    backup_bandwidth: list[float] = field(default_factory=list)
    prefixstore: dict[str, Any] = field(default_factory=dict)


class _Pool:
    """One host pool and the engine that persists its pages."""

    def __init__(self, name: str, host: Any, trailing: bool, block_tokens: int, opts: dict[str, Any]) -> None:
        self.name, self.host, self.trailing = name, host, trailing
        dummy = host.get_dummy_flat_data_page()
        self.dtype = dummy.dtype
        self.page_bytes = dummy.numel() * dummy.element_size()
        self.host_page = int(getattr(host, "page_size", 1) or 1)
        self.bt = block_tokens
        if trailing:
            layout = Layout(
                segments=[TensorSpec("pos", "uint8", (1,))],
                snapshots=[TensorSpec("state", "uint8", (self.page_bytes,))],
                block_tokens=block_tokens,
            )
        else:
            if self.page_bytes % block_tokens:
                raise InvalidInputError(
                    f"pool {name!r}: a page of {self.page_bytes} bytes does not split into "
                    f"{block_tokens} token rows"
                )
            layout = Layout(segments=[TensorSpec("page", "uint8", (self.page_bytes // block_tokens,))],
                            block_tokens=block_tokens)
        self.layout = layout
        self.path, self.capacity = opts.pop("path"), opts.pop("capacity_bytes")
        self.opts = opts
        self.broken = False
        self.engine = Engine.open(self.path, layout, self.capacity, **opts)

    def reopen(self) -> None:
        """After a failed catalog write the engine refuses more: reopen it (recovery runs)."""
        with contextlib.suppress(PrefixStoreError):
            self.engine.close()
        self.engine = Engine.open(self.path, self.layout, self.capacity, **self.opts)
        self.broken = False

    def store(self, *args: Any, **kwargs: Any) -> bool:
        """``Engine.store``: True when the checkpoint is stored; False on a refusal or an
        I/O failure (the engine rolled it back); bad input still raises."""
        try:
            res = self.engine.store(*args, **kwargs)
        except InvalidInputError:
            raise
        except CatalogIOError:
            self.broken = True
            return False
        except PrefixStoreError:
            return False
        return res.ok or res.reason == "inside_span"

    def page_bytes_at(self, index: int) -> torch.Tensor:
        page = self.host.get_data_page(index, flat=True)
        return page.contiguous().view(torch.uint8).reshape(-1)

    def put_page(self, index: int, data: torch.Tensor) -> None:
        self.host.set_from_flat_data_page(index, data.contiguous().view(self.dtype))


class PrefixStoreHiCache(HiCacheStorage):
    """A ``HiCacheStorage`` over prefixstore engines, one per pool on this rank."""

    def __init__(self, storage_config: HiCacheStorageConfig, kwargs: Mapping[str, Any] | None = None) -> None:
        extra = storage_config.extra_config
        if extra is None:
            raise InvalidInputError("extra_config: the prefixstore backend needs at least 'dir'")
        unknown = sorted(set(extra) - CONFIG_KEYS)
        if unknown:
            raise InvalidInputError(f"extra_config: unknown keys {unknown}; known: {sorted(CONFIG_KEYS)}")
        if storage_config.is_mla_model and storage_config.tp_size > 1:
            raise InvalidInputError(
                "is_mla_model: SGLang writes replicated MLA pages from one rank only, and "
                "prefixstore keeps one engine per rank; run MLA models with tp_size 1"
            )
        root = extra.get("dir")
        if not isinstance(root, str) or not root:
            raise InvalidInputError(f"extra_config['dir'] must be a directory path, got {root!r}")
        self.capacity = _positive(extra, "capacity_bytes", 64 << 30)
        self.pool_capacity = dict(extra.get("pool_capacity_bytes") or {})
        for name in self.pool_capacity:
            _positive(self.pool_capacity, name, 0)
        self.checkpoint_pages = _non_negative(extra, "checkpoint_pages", 0)
        self.retention = bool(extra.get("retention", False))
        self.opts: dict[str, Any] = {
            "backing": extra.get("backing", "disk"),
            "policy": extra.get("policy", "prefixstore"),
            "synchronous": extra.get("synchronous", "FULL"),
        }
        if extra.get("ram_bytes") is not None:
            self.opts["ram_bytes"] = _positive(extra, "ram_bytes", 0)
        if extra.get("cost") is not None:
            if not isinstance(extra["cost"], Mapping):
                raise InvalidInputError("extra_config['cost'] must be a mapping of CostModel fields")
            try:
                self.opts["cost"] = CostModel(**extra["cost"])
            except (TypeError, ValueError) as exc:
                raise InvalidInputError(f"extra_config['cost']: {exc}") from exc
        self.opts.update(dict((kwargs or {}).get("engine_options", {})))
        # The zero-copy calls carry prefix_keys; the legacy batch_get/batch_set do not.
        extra.setdefault("interface_v1", 1)
        suffix = f"tp{storage_config.tp_rank}of{storage_config.tp_size}"
        if storage_config.pp_size > 1:
            suffix += f"-pp{storage_config.pp_rank}of{storage_config.pp_size}"
        self.root = os.path.join(root, suffix)
        self.config = storage_config
        self.hosts: dict[str, Any] = {}
        self.pools: dict[str, _Pool] = {}
        self.admission: RetentionAdmission | None = None
        self._metrics = HiCacheMetrics()
        self._lock = threading.Lock()
        self._open_lock = threading.Lock()  # the prefetch and backup threads may open a pool at once
        self._held: tuple[list[bytes], int] | None = None  # a request's query not yet observed

    # ------------------------------------------------------------------ registration

    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        super().register_mem_pool_host(mem_pool_host)
        self.hosts[KV] = mem_pool_host

    def register_mem_host_pool_v2(self, host_pool: Any, host_pool_name: Any) -> None:
        super().register_mem_host_pool_v2(host_pool, host_pool_name)
        self.hosts[str(host_pool_name)] = host_pool

    def pool(self, name: Any, trailing: bool = False) -> _Pool:
        """The engine of pool ``name``, opened (and recovered) at its first use."""
        with self._open_lock:
            return self._pool(str(name), trailing)

    def _pool(self, name: str, trailing: bool) -> _Pool:
        p = self.pools.get(name)
        if p is not None:
            if p.trailing != trailing:
                raise InvalidInputError(f"pool {name!r} is used with two hit policies")
            if p.broken:
                p.reopen()
            return p
        host = self.hosts.get(name)
        if host is None:
            raise InvalidInputError(f"pool {name!r} has no registered host pool")
        kv_host = self.hosts.get(KV, host)
        bt = int(getattr(kv_host, "page_size", 1) or 1)
        opts = dict(self.opts)
        opts["path"] = os.path.join(self.root, name)
        opts["capacity_bytes"] = int(self.pool_capacity.get(name, self.capacity))
        if trailing:
            opts.pop("cost", None)  # presence only: the KV pool's cost rule sets the hit
        elif name == KV and self.retention and opts.get("policy") == "prefixstore":
            blocks = max(1, opts["capacity_bytes"] // max(1, self._kv_page_bytes(host)))
            self.admission = RetentionAdmission(blocks)
            opts["admission"] = self.admission
        os.makedirs(self.root, exist_ok=True)
        p = _Pool(name, host, trailing, bt, opts)
        self.pools[name] = p
        return p

    @staticmethod
    def _kv_page_bytes(host: Any) -> int:
        d = host.get_dummy_flat_data_page()
        return d.numel() * d.element_size()

    # ------------------------------------------------------------------ KV: v1 and legacy

    def batch_exists(self, keys: list[str], extra_info: HiCacheStorageExtraInfo | None = None) -> int:
        """The leading run of ``keys`` this rank can restore (after the cost rule)."""
        if not keys:
            return 0
        digests, base = chain_of(keys, extra_info)
        p = self.pool(KV)
        prefix = Prefix(digests)
        m = p.engine.lookup(prefix, gpu_blocks=base)
        hit = max(0, m.blocks - base) if m.hit else 0
        if self.admission is not None:
            self._observe(prefix.keys, base, hit)
        return hit

    def _observe(self, keys: Sequence[bytes], base: int, hit: int) -> None:
        """Tell the retention rule what a request found, once per request: a query that
        SGLang splits into batches (each next batch continues a fully hit one) is held
        until it ends, or until any other call."""
        with self._lock:
            held = self._held
            if not (held is not None and base and len(held[0]) == base and held[1] == base
                    and held[0][-1] == keys[base - 1]):
                self._flush_observe_locked()  # not the next batch of the query held
            self._held = (list(keys), base + hit)
            if base + hit < len(keys):
                self._flush_observe_locked()  # the query ended inside this batch

    def _flush_observe_locked(self) -> None:
        if self._held is not None and self.admission is not None:
            keys, hit = self._held
            self.admission.observe(keys, hit)
        self._held = None

    def _flush_observe(self) -> None:
        if self._held is not None:
            with self._lock:
                self._flush_observe_locked()

    def batch_get_v1(self, keys: list[str], host_indices: torch.Tensor,
                     extra_info: HiCacheStorageExtraInfo | None = None) -> list[bool]:
        p, t0 = self.pool(KV), time.perf_counter()
        out = self._get_pages(p, keys, host_indices, extra_info)
        self._tally(p, "prefetch", sum(out), t0)
        return out

    def batch_set_v1(self, keys: list[str], host_indices: torch.Tensor,
                     extra_info: HiCacheStorageExtraInfo | None = None) -> list[bool]:
        p, t0 = self.pool(KV), time.perf_counter()
        out = self._set_pages(p, keys, host_indices, extra_info)
        self._tally(p, "backup", sum(out), t0)
        return out

    def _tally(self, p: _Pool, kind: str, pages: int, t0: float) -> None:
        if not self.config.enable_storage_metrics:
            return
        gbps = pages * p.page_bytes / max(time.perf_counter() - t0, 1e-9) / 1e9
        with self._lock:
            getattr(self._metrics, f"{kind}_pgs").append(pages)
            getattr(self._metrics, f"{kind}_bandwidth").append(gbps)

    def exists(self, key: str) -> bool:
        """Legacy, no prefix context: ``key`` taken as the first page of a sequence."""
        return self.batch_exists([key]) == 1

    def get(self, key: str, target_location: Any = None, target_sizes: Any = None) -> torch.Tensor | None:
        """Legacy, no prefix context: one page from the sequence start into ``target_location``."""
        out = self.batch_get([key], [target_location] if target_location is not None else None)
        return out[0]

    def batch_get(self, keys: list[str], target_locations: Any = None,
                  target_sizes: Any = None) -> list[torch.Tensor | None]:
        """Legacy, no prefix context: ``keys`` taken as a chain from the sequence start."""
        if not keys:
            return []
        p = self.pool(KV)
        self._flush_observe()
        rows = self._read_rows(p, keys, None)
        out: list[torch.Tensor | None] = []
        for i in range(len(keys)):
            if rows is None or i >= rows.shape[0] // p.bt:
                out.append(None)
                continue
            data = rows[i * p.bt:(i + 1) * p.bt].reshape(-1).view(p.dtype)
            if target_locations is not None and target_locations[i] is not None:
                target_locations[i].view(-1).copy_(data.view(target_locations[i].dtype))
                out.append(target_locations[i])
            else:
                out.append(data.clone())
        return out

    def set(self, key: str, value: Any = None, target_location: Any = None, target_sizes: Any = None) -> bool:
        """Legacy, no prefix context: one page as the first page of a sequence."""
        return self.batch_set([key], [value])

    def batch_set(self, keys: list[str], values: Any = None, target_locations: Any = None,
                  target_sizes: Any = None) -> bool:
        """Legacy, no prefix context: ``keys`` taken as a chain from the sequence start."""
        if not keys:
            return True
        if values is None or len(values) != len(keys):
            raise InvalidInputError(f"values: need one page per key, got {values!r:.60}")
        p = self.pool(KV)
        self._flush_observe()
        pages = [torch.as_tensor(v).contiguous().view(torch.uint8).reshape(-1) for v in values]
        return all(self._store_chain(p, [page_digest(k) for k in keys], 0, pages))

    # ------------------------------------------------------------------ v2: every pool

    def batch_exists_v2(self, keys: list[str], pool_transfers: list[PoolTransfer] | None = None,
                        extra_info: HiCacheStorageExtraInfo | None = None) -> PoolTransferResult:
        kv_pages = self.batch_exists(keys, extra_info)
        hits: dict[str, int] = {KV: kv_pages} if kv_pages else {}
        restorable = set(range(1, kv_pages + 1))
        digests, base = chain_of(keys, extra_info)
        for t in pool_transfers or []:
            if not restorable:
                break
            name = str(t.name)
            if t.hit_policy == PoolHitPolicy.TRAILING_PAGES:
                present = self._boundaries(self.pool(name, trailing=True), digests, base, kv_pages)
                window = max(1, len(t.keys) if t.keys else 1)
                ok = {n for n in range(1, kv_pages + 1)
                      if all(i in present for i in range(max(1, n - window + 1), n + 1))}
            elif t.hit_policy == PoolHitPolicy.ALL_PAGES:
                m = self.pool(name).engine.lookup(Prefix(digests[: base + kv_pages]), gpu_blocks=base)
                ok = set(range(1, (m.blocks - base if m.hit else 0) + 1))
            else:
                raise InvalidInputError(f"pool_transfers: hit policy {t.hit_policy} is not supported")
            if ok:
                hits[name] = max(ok)
            restorable &= ok
        pages = sorted(restorable)
        return PoolTransferResult(pages[-1] if pages else 0, hits, pages)

    def batch_get_v2(self, transfers: list[PoolTransfer],
                     extra_info: HiCacheStorageExtraInfo | None = None) -> dict[str, list[bool]]:
        out: dict[str, list[bool]] = {}
        for t in transfers:
            keys = list(t.keys or [])
            if t.hit_policy == PoolHitPolicy.TRAILING_PAGES:
                out[str(t.name)] = self._get_states(self.pool(t.name, True), keys, t.host_indices, extra_info)
            else:
                out[str(t.name)] = self._get_pages(self.pool(t.name), keys, t.host_indices, extra_info)
        return out

    def batch_set_v2(self, transfers: list[PoolTransfer],
                     extra_info: HiCacheStorageExtraInfo | None = None) -> dict[str, list[bool]]:
        out: dict[str, list[bool]] = {}
        for t in transfers:
            keys = list(t.keys or [])
            if t.hit_policy == PoolHitPolicy.TRAILING_PAGES:
                out[str(t.name)] = self._set_states(self.pool(t.name, True), keys, t.host_indices, extra_info)
            else:
                out[str(t.name)] = self._set_pages(self.pool(t.name), keys, t.host_indices, extra_info)
        return out

    # ------------------------------------------------------------------ metrics and life

    def get_stats(self) -> HiCacheMetrics:
        """The KV calls' pages and bandwidth since the last call (SGLang's storage
        metrics), with every pool engine's ``stats()`` under ``prefixstore``."""
        with self._lock:
            out, self._metrics = self._metrics, HiCacheMetrics()
        out.prefixstore = self.engine_stats()
        return out

    def engine_stats(self) -> dict[str, Any]:
        """``stats()`` of every open pool engine, by pool name (counters included)."""
        return {name: p.engine.stats() for name, p in self.pools.items()}

    def registries(self) -> dict[str, Any]:
        """Each pool engine's Prometheus registry (mount them in the server)."""
        return {name: p.engine.counters.registry for name, p in self.pools.items()}

    def audit(self) -> dict[str, Any]:
        """``Engine.audit()`` of every open pool engine."""
        return {name: p.engine.audit() for name, p in self.pools.items()}

    def clear(self) -> bool:
        """Evict everything this rank stores (pinned nodes excepted)."""
        for p in self.pools.values():
            p.engine.evict(p.engine.capacity)
        return True

    def close(self) -> None:
        self._flush_observe()
        for p in self.pools.values():
            p.engine.close()
        self.pools.clear()

    # ------------------------------------------------------------------ internals

    def _indices(self, p: _Pool, keys: Sequence[str], host_indices: torch.Tensor | None) -> list[int]:
        if host_indices is None or host_indices.numel() != len(keys) * p.host_page:
            got = None if host_indices is None else host_indices.numel()
            raise InvalidInputError(
                f"host_indices: pool {p.name!r} needs {len(keys) * p.host_page} indices for "
                f"{len(keys)} pages, got {got}"
            )
        flat = host_indices.reshape(-1)
        return [int(flat[i * p.host_page]) for i in range(len(keys))]

    def _positions(self, p: _Pool, prefix: Prefix, base: int, n: int) -> list[int]:
        """Where the checkpoints of pages ``base..base+n`` end: every ``checkpoint_pages``
        and at the end, cut at the retention rule's admission limit (as the replay does)."""
        end = base + n
        if p.name == KV and self.admission is not None:
            end = self.admission.admit_limit(prefix.keys, base, end)
            if end <= base:
                return []
        every = self.checkpoint_pages
        out = list(range((base // every + 1) * every, end, every)) if every else []
        out.append(end)
        return out

    def _store_chain(self, p: _Pool, digests: list[bytes], base: int, pages: list[torch.Tensor]) -> list[bool]:
        """Store pages ``base..`` of chain ``digests`` as few checkpoints; per page: stored."""
        n = len(pages)
        rows = torch.cat(pages).view(n * p.bt, -1)
        prefix = Prefix(digests)
        done = base
        for end in self._positions(p, prefix, base, n):
            try:
                ok = p.store(prefix[:end], {"page": rows[: (end - base) * p.bt]}, tokens_from=base * p.bt)
            except InvalidInputError:
                break  # the pages before `base` are not stored: nothing to hang these on
            if not ok:
                break
            done = end
        return [base + i < done for i in range(n)]

    def _set_pages(self, p: _Pool, keys: list[str], host_indices: torch.Tensor,
                   extra_info: HiCacheStorageExtraInfo | None) -> list[bool]:
        self._flush_observe()
        if not keys:
            return []
        digests, base = chain_of(keys, extra_info)
        pages = [p.page_bytes_at(i) for i in self._indices(p, keys, host_indices)]
        return self._store_chain(p, digests, base, pages)

    def _read_rows(self, p: _Pool, keys: Sequence[str], extra_info: HiCacheStorageExtraInfo | None):
        digests, base = chain_of(keys, extra_info)
        m = p.engine.lookup(Prefix(digests), gpu_blocks=base)
        if not m.hit or m.blocks <= base:
            return None
        r = p.engine.restore(m)
        return None if r is None else r.segments[0]["page"]

    def _get_pages(self, p: _Pool, keys: list[str], host_indices: torch.Tensor,
                   extra_info: HiCacheStorageExtraInfo | None) -> list[bool]:
        self._flush_observe()
        if not keys:
            return []
        indices = self._indices(p, keys, host_indices)
        rows = self._read_rows(p, keys, extra_info)
        got = 0 if rows is None else rows.shape[0] // p.bt
        for i in range(got):
            p.put_page(indices[i], rows[i * p.bt:(i + 1) * p.bt].reshape(-1))
        return [i < got for i in range(len(keys))]

    def _boundaries(self, p: _Pool, digests: list[bytes], base: int, pages: int) -> set[int]:
        """Which lengths ``1..pages`` past ``base`` hold a ready snapshot of pool ``p``."""
        out = set()
        for n in range(1, pages + 1):
            end = base + n
            m = p.engine.lookup(Prefix(digests[:end]), gpu_blocks=end - 1)
            if m.hit and m.blocks == end:
                out.add(n)
        return out

    def _set_states(self, p: _Pool, keys: list[str], host_indices: torch.Tensor,
                    extra_info: HiCacheStorageExtraInfo | None) -> list[bool]:
        self._flush_observe()
        if not keys:
            return []
        digests, base = chain_of(keys, extra_info)
        prefix = Prefix(digests)
        out = []
        for i, index in enumerate(self._indices(p, keys, host_indices)):
            end = base + i + 1
            marker = torch.zeros((end * p.bt, 1), dtype=torch.uint8)
            out.append(not p.broken and p.store(prefix[:end], {"pos": marker}, {"state": p.page_bytes_at(index)}))
        return out

    def _get_states(self, p: _Pool, keys: list[str], host_indices: torch.Tensor,
                    extra_info: HiCacheStorageExtraInfo | None) -> list[bool]:
        self._flush_observe()
        if not keys:
            return []
        digests, base = chain_of(keys, extra_info)
        out = []
        for i, index in enumerate(self._indices(p, keys, host_indices)):
            end = base + i + 1
            m = p.engine.lookup(Prefix(digests[:end]), gpu_blocks=end - 1)
            r = p.engine.restore(m) if m.hit and m.blocks == end else None
            if r is None:
                out.append(False)
                continue
            p.put_page(index, r.snapshot[0]["state"])
            out.append(True)
        return out


def _positive(extra: Mapping[str, Any], key: str, default: int) -> int:
    v = extra.get(key, default)
    if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
        raise InvalidInputError(f"extra_config: {key!r} must be a positive integer, got {v!r}")
    return v


def _non_negative(extra: Mapping[str, Any], key: str, default: int) -> int:
    v = extra.get(key, default)
    if isinstance(v, bool) or not isinstance(v, int) or v < 0:
        raise InvalidInputError(f"extra_config: {key!r} must be a non-negative integer, got {v!r}")
    return v
