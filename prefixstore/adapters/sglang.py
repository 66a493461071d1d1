"""prefixstore as SGLang's HiCache L3 storage backend (sglang 0.5.23).

SGLang loads it with ``--hicache-storage-backend dynamic`` and an ``extra_config`` naming
this module and ``PrefixStoreHiCache`` (see docs/sglang.md).

Mapping. One SGLang page is one prefixstore block (``block_tokens`` = the KV page size,
digest = blake2b of the page hash). Every pool gets its own engine in its own directory:

- ``ALL_PAGES`` pools (the KV pool, indexers): a page is ``block_tokens`` rows of its flat
  bytes; a ``batch_set*`` stores its pages as one checkpoint (``checkpoint_pages`` > 0
  adds one at every multiple of that many pages), never one per page.
- ``TRAILING_PAGES`` pools (Mamba, SWA): each entry is a snapshot at the page boundary it
  belongs to (a one-byte-per-token marker segment carries the chain), so a trailing hit
  at length L is exactly a ready checkpoint with a snapshot at L.

Chains. A call's pages continue the chain their first page (or, with ``prefix_keys``,
the page before them) is stored on; a run with no stored chain to continue (no
``prefix_keys``, or a prefix that is not stored) is stored as a chain of its own.
``PageChains`` (``sglang_chains.py``) maps every stored page hash to its place, so a
call finds its pages from their hashes alone, in both of SGLang's modes
(``hicache_storage_pass_prefix_keys`` true or false), and a read walks from one stored
chain to the next.

Ranks. Each tensor-parallel rank runs its own backend instance over its own engines
(``DIR/tp{rank}of{size}``). ``batch_exists`` answers the rank's longest ready run (the
caller takes the minimum over ranks); ``batch_exists_v2`` also answers
``restorable_prefix_pages``, the lengths this rank can restore with every trailing pool,
which the caller intersects over ranks.

Verification. Every read goes through ``Engine.restore``: a missing, short or altered
shard reads as a miss, never other bytes; the pages before a damaged checkpoint are
still served. Bad input raises ``InvalidInputError`` naming the argument, with nothing
stored (``sglang_input.py``).
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from prefixstore.adapters import sglang_input as check
from prefixstore.adapters.sglang_chains import PageChains
from prefixstore.adapters.sglang_pages import PageSlots, copy_into
from prefixstore.base.errors import CatalogIOError, InvalidInputError, PrefixStoreError
from prefixstore.base.keys import DIGEST_SIZE, Prefix
from prefixstore.base.layout import Layout, TensorSpec
from prefixstore.engine.api import Engine
from prefixstore.engine.results import Match
from prefixstore.gpu import tiers
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
OWN_KEYS = frozenset({
    "dir", "capacity_bytes", "pool_capacity_bytes", "backing", "ram_bytes", "policy",
    "synchronous", "checkpoint_pages", "retention", "cost",
})
"""The ``extra_config`` keys this backend reads."""
SGLANG_KEYS = frozenset({
    "backend_name", "module_path", "class_name",  # the factory's (storage/backend_factory.py)
    "interface_v1",  # the controller's switch to batch_get_v1/batch_set_v1 (set to 1 if absent)
    "file_storage_path",  # added with --file-storage-path (unified_radix_cache.py): ``dir``'s default
    # parse_storage_backend_extra_config pops these; the decode offload manager passes them on
    "prefetch_threshold", "prefetch_timeout_base", "prefetch_timeout_per_ki_token",
    "hicache_storage_pass_prefix_keys", "tp_lcm_size",
})
"""Keys SGLang itself puts into (or leaves in) ``extra_config``: accepted, not ours to read."""
CONFIG_KEYS = OWN_KEYS | SGLANG_KEYS


def page_digest(key: str) -> bytes:
    """The block digest of one SGLang page hash."""
    return hashlib.blake2b(check.page_key(key, "keys").encode(), digest_size=DIGEST_SIZE).digest()


def digests_of(keys: Sequence[str]) -> list[bytes]:
    return [hashlib.blake2b(k.encode(), digest_size=DIGEST_SIZE).digest() for k in keys]


def gather(pages: Sequence[torch.Tensor]) -> torch.Tensor:
    """The bytes of ``pages`` (1-D uint8 host tensors) end to end in a new tensor, by one
    single-threaded memcpy each (numpy): never through torch's intra-op thread pool,
    whose barrier made copying one 256 KiB page take 4 ms instead of 6 us on a busy host."""
    out = torch.empty(sum(x.numel() for x in pages), dtype=torch.uint8)
    np.concatenate([x.numpy() for x in pages], out=out.numpy())
    return out


def storage_metrics(**lists: list) -> Any:
    """SGLang's own ``StorageMetrics`` (what ``log_storage_metrics`` asserts it gets).

    Imported when first asked for: its module imports the model configs (torchvision among
    them), which a scheduler has imported long before its first step."""
    from sglang.srt.observability.metrics_collector import StorageMetrics

    return StorageMetrics(**lists)


@dataclass
class Run:
    """Pages ``pos..pos+pages`` of a call found on one stored chain: ``prefix`` is that
    chain through the call's pages, ``base`` its length before them, ``match`` the lookup."""

    pos: int
    prefix: Prefix
    base: int
    match: Match

    @property
    def pages(self) -> int:
        return self.match.blocks - self.base


class _Pool:
    """One host pool, the engine that persists its pages, and where its pages sit."""

    def __init__(self, name: str, host: Any, trailing: bool, block_tokens: int, opts: dict[str, Any]) -> None:
        self.name, self.host, self.trailing = name, host, trailing
        dummy = host.get_dummy_flat_data_page()
        self.dtype = dummy.dtype
        self.page_numel = dummy.numel()
        self.page_bytes = dummy.numel() * dummy.element_size()
        self.host_page = int(getattr(host, "page_size", 1) or 1)
        size = getattr(host, "size", None)
        self.capacity_slots = int(size) if isinstance(size, int) and not isinstance(size, bool) else None
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
        self.chains = PageChains(self.path)
        self.slots = PageSlots(host, self.page_bytes, self.engine.executor.host_outputs)

    def reopen(self) -> None:
        """After a failed catalog write the engine refuses more: reopen it (recovery runs)."""
        with contextlib.suppress(PrefixStoreError):
            self.engine.close()
        self.engine = Engine.open(self.path, self.layout, self.capacity, **self.opts)
        self.chains.rebuild()
        self.broken = False

    def store(self, *args: Any, **kwargs: Any) -> bool:
        """``Engine.store``: True when the checkpoint is stored; False on a refusal or an
        I/O failure (the engine rolled it back). InvalidInputError (the chain's start is
        not stored: nothing to hang the rows on) is the caller's to handle."""
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

    def indices(self, keys: Sequence[str], host_indices: Any) -> list[int]:
        return check.host_indices(host_indices, len(keys), self.host_page, self.capacity_slots, self.name)

    def page_bytes_at(self, index: int) -> torch.Tensor:
        page = self.host.get_data_page(index, flat=True)
        return page.contiguous().view(torch.uint8).reshape(-1)

    def put_page(self, index: int, data: torch.Tensor) -> None:
        self.slots.put(index, data, self.dtype)

    def base_for(self, digests: Sequence[bytes], before: list[str] | None) -> list[bytes]:
        """The stored chain a run of new pages continues: the one its first page is on,
        else the one ``prefix_keys`` end on, else ``prefix_keys`` themselves (a chain not
        stored yet), else none (the run starts a chain of its own)."""
        chain = self.chains.chain_to(digests[0])
        if chain is not None:
            return chain[:-1]
        if before:
            last = digests_of(before[-1:])[0]
            return self.chains.chain_to(last) or digests_of(before)
        return []

    def run_at(self, digests: Sequence[bytes], pos: int) -> Run | None:
        """The stored run of ``digests[pos:]`` that starts at ``pos``, or None."""
        chain = self.chains.chain_to(digests[pos])
        if chain is None:
            return None
        base = len(chain) - 1
        prefix = Prefix([*chain[:-1], *digests[pos:]])
        m = self.engine.lookup(prefix, gpu_blocks=base)
        if not m.hit or m.blocks <= base:
            return None
        return Run(pos, prefix, base, m)

    def runs(self, digests: Sequence[bytes]) -> Iterator[Run]:
        """The stored runs of ``digests`` from the first page on, one per stored chain."""
        pos = 0
        while pos < len(digests):
            run = self.run_at(digests, pos)
            if run is None:
                return
            yield run
            pos += run.pages
            if pos < len(digests) and self.chains.continues(digests[pos], digests[pos - 1]):
                return  # the same chain goes on, and its engine said no further

    def hit_pages(self, digests: Sequence[bytes]) -> int:
        return sum(r.pages for r in self.runs(digests))

    def rows_of(self, run: Run) -> torch.Tensor | None:
        """The segment rows of ``run``'s pages, verified; after a damaged checkpoint, those
        of the pages before it (each failed restore marks one node damaged, so each
        lookup after one is shorter)."""
        m = run.match
        for _ in range(run.pages + 1):
            r = self.engine.restore(m)
            if r is not None:
                rows = r.segments[0]["page"]
                return rows[run.base * self.bt - r.start_tokens:]
            m = self.engine.lookup(run.prefix, gpu_blocks=run.base)
            if not m.hit or m.blocks <= run.base:
                return None
        return None

    def read(self, digests: Sequence[bytes]) -> Iterator[tuple[int, torch.Tensor]]:
        """(page position, one page's rows) for the verified leading pages of ``digests``."""
        pos = 0
        while pos < len(digests):
            run = self.run_at(digests, pos)
            rows = None if run is None else self.rows_of(run)
            if rows is None:
                return
            got = min(rows.shape[0] // self.bt, run.pages)
            for i in range(got):
                yield pos + i, rows[i * self.bt:(i + 1) * self.bt].reshape(-1)
            pos += got
            if got < run.pages or (pos < len(digests) and self.chains.continues(digests[pos], digests[pos - 1])):
                return

    def read_into(self, digests: Sequence[bytes], indices: Sequence[int]) -> int:
        """Restore the verified leading pages of ``digests`` into the host slots at
        ``indices`` (one per page): how many. Only pages of a restore that verified are
        counted; after a failed one, the slots it was writing hold unspecified bytes."""
        pos = 0
        while pos < len(digests):
            run = self.run_at(digests, pos)
            got = 0 if run is None else self.restore_run(run, indices[pos:pos + run.pages])
            pos += got
            if run is None or got < run.pages or (
                    pos < len(digests) and self.chains.continues(digests[pos], digests[pos - 1])):
                return pos
        return pos

    def restore_run(self, run: Run, indices: Sequence[int]) -> int:
        """``run``'s pages into the slots at ``indices``: how many; after a damaged
        checkpoint, those of the pages before it (as ``rows_of``)."""
        m = run.match
        for _ in range(run.pages + 1):
            got = self.restore_pages(m, run.base, indices)
            if got is not None:
                return got
            m = self.engine.lookup(run.prefix, gpu_blocks=run.base)
            if not m.hit or m.blocks <= run.base:
                return 0
        return 0

    def restore_pages(self, m: Match, base: int, indices: Sequence[int]) -> int | None:
        """Restore ``m`` (pages ``base..m.blocks``) into the slots at ``indices``: the
        pages written, or None when the restore missed. Straight into the slots
        (``PageSlots.destination``: one tensor when they lie end to end, else the pieces
        of memory they are in), else through the pool's staging buffer and one memcpy
        per page."""
        rows, skip = m.tokens - m.gpu_tokens, base * self.bt - m.gpu_tokens
        n = min((rows - skip) // self.bt, len(indices))
        rb = self.page_bytes // self.bt
        direct = self.slots.destination(indices[:n]) if skip == 0 and rows == n * self.bt else None
        if direct is not None:
            into = {"page": direct.view(rows, rb) if isinstance(direct, torch.Tensor) else direct}
            return n if self.engine.restore(m, into=into) is not None else None
        with self.slots.staging(rows * rb) as stage:
            r = self.engine.restore(m, into=None if stage is None else {"page": stage.view(rows, rb)})
            if r is None:
                return None
            src = r.segments[0]["page"][skip:]
            for i in range(n):
                self.put_page(indices[i], src[i * self.bt:(i + 1) * self.bt])
        return n

    def state_chains(self, digests: Sequence[bytes]) -> list[list[bytes] | None]:
        """For each page, the stored chain through it in this (trailing) pool, or None."""
        out: list[list[bytes] | None] = []
        prev: list[bytes] | None = None
        for i, d in enumerate(digests):
            if prev is not None and self.chains.continues(d, digests[i - 1]):
                prev = [*prev, d]
            else:
                prev = self.chains.chain_to(d)
            out.append(prev)
        return out

    def state_match(self, chain: list[bytes] | None) -> Match | None:
        """The ready checkpoint with a snapshot exactly at the end of ``chain``."""
        if chain is None:
            return None
        m = self.engine.lookup(Prefix(chain), gpu_blocks=len(chain) - 1)
        return m if m.hit and m.blocks == len(chain) else None


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
        root = extra.get("dir", extra.get("file_storage_path"))
        if not isinstance(root, str) or not root:
            raise InvalidInputError(f"extra_config['dir'] must be a directory path, got {root!r}")
        self.capacity = _positive(extra, "capacity_bytes", 64 << 30)
        self.pool_capacity = dict(extra.get("pool_capacity_bytes") or {})
        for name in self.pool_capacity:
            _positive(self.pool_capacity, name, 0)
        self.checkpoint_pages = _non_negative(extra, "checkpoint_pages", 0)
        self.retention = bool(extra.get("retention", False))
        self.opts: dict[str, Any] = {
            "backing": extra.get("backing", tiers.DEFAULT),
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
        # The controller reads this after building the backend: the zero-copy calls.
        extra.setdefault("interface_v1", 1)
        suffix = f"tp{storage_config.tp_rank}of{storage_config.tp_size}"
        if storage_config.pp_size > 1:
            suffix += f"-pp{storage_config.pp_rank}of{storage_config.pp_size}"
        self.root = os.path.join(root, suffix)
        self.config = storage_config
        self.hosts: dict[str, Any] = {}
        self.pools: dict[str, _Pool] = {}
        self.admission: RetentionAdmission | None = None
        self._metrics: dict[str, list] = _no_metrics()
        self._lock = threading.Lock()
        self._open_lock = threading.Lock()  # the prefetch and backup threads may open a pool at once
        self._held: tuple[list[bytes], int] | None = None  # a request's query not yet observed

    # ------------------------------------------------------------------ registration

    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        super().register_mem_pool_host(check.host_pool(mem_pool_host, "mem_pool_host"))
        self.hosts[KV] = mem_pool_host

    def register_mem_host_pool_v2(self, host_pool: Any, host_pool_name: Any) -> None:
        check.host_pool(host_pool, "host_pool")
        if not isinstance(host_pool_name, str) or not host_pool_name:
            raise InvalidInputError(f"host_pool_name: need a pool name, got {host_pool_name!r:.60}")
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
        opts["identity"] = self._identity(name, host, bt)
        os.makedirs(self.root, exist_ok=True)
        p = _Pool(name, host, trailing, bt, opts)
        self.pools[name] = p
        return p

    def _identity(self, name: str, host: Any, page_tokens: int) -> dict[str, str]:
        """What pool ``name``'s rows mean: the model SGLang serves, this rank's place in
        the parallel groups, the pool and its page format (``Engine.open(identity=...)``
        refuses a directory another model, rank or page format wrote)."""
        c = self.config
        return {
            "adapter": "sglang",
            "model": str(c.model_name or ""),
            "pool": name,
            "tp": f"{c.tp_rank}/{c.tp_size}",
            "pp": f"{c.pp_rank}/{c.pp_size}",
            "mla": str(bool(c.is_mla_model)),
            "page_first_layout": str(bool(c.is_page_first_layout)),
            "dtype": str(host.get_dummy_flat_data_page().dtype).removeprefix("torch."),
            "page_tokens": str(page_tokens),
        }

    @staticmethod
    def _kv_page_bytes(host: Any) -> int:
        d = host.get_dummy_flat_data_page()
        return d.numel() * d.element_size()

    # ------------------------------------------------------------------ KV: v1 and legacy

    def batch_exists(self, keys: list[str], extra_info: HiCacheStorageExtraInfo | None = None) -> int:
        """The leading run of ``keys`` this rank can restore (after the cost rule)."""
        keys = check.page_keys(keys)
        before = check.prefix_keys(extra_info, keys) or []
        if not keys:
            return 0
        p = self.pool(KV)
        digests = digests_of(keys)
        runs = list(p.runs(digests))
        if self.admission is not None:
            if runs:
                self._observe(runs[0].prefix.keys, runs[0].base, runs[0].pages)
            else:
                self._observe(Prefix([*digests_of(before), *digests]).keys, len(before), 0)
        return sum(r.pages for r in runs)

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
        keys = check.page_keys(keys)
        check.prefix_keys(extra_info, keys)
        if not keys:
            return []
        p, t0 = self.pool(KV), time.perf_counter()
        out = self._get_pages(p, keys, host_indices)
        self._tally(p, "prefetch", sum(out), t0)
        return out

    def batch_set_v1(self, keys: list[str], host_indices: torch.Tensor,
                     extra_info: HiCacheStorageExtraInfo | None = None) -> list[bool]:
        keys = check.page_keys(keys)
        before = check.prefix_keys(extra_info, keys)
        if not keys:
            return []
        p, t0 = self.pool(KV), time.perf_counter()
        out = self._set_pages(p, keys, host_indices, before)
        self._tally(p, "backup", sum(out), t0)
        return out

    def _tally(self, p: _Pool, kind: str, pages: int, t0: float) -> None:
        if not self.config.enable_storage_metrics:
            return
        gbps = pages * p.page_bytes / max(time.perf_counter() - t0, 1e-9) / 1e9
        with self._lock:
            self._metrics[f"{kind}_pgs"].append(pages)
            self._metrics[f"{kind}_bandwidth"].append(gbps)

    def exists(self, key: str) -> bool:
        """Legacy, no prefix context: whether page ``key`` is stored (on any chain)."""
        return self.batch_exists([check.page_key(key)]) == 1

    def get(self, key: str, target_location: Any = None, target_sizes: Any = None) -> torch.Tensor | None:
        """Legacy, no prefix context: page ``key`` into ``target_location`` (or a new tensor)."""
        key = check.page_key(key)
        if target_location is not None:
            p = self.pool(KV)
            check.page_value(target_location, p.dtype, p.page_numel, "target_location")
        return self.batch_get([key], None if target_location is None else [target_location])[0]

    def batch_get(self, keys: list[str], target_locations: Any = None,
                  target_sizes: Any = None) -> list[torch.Tensor | None]:
        """Legacy, no prefix context: the leading stored pages of ``keys`` (None from the
        first page not served on)."""
        keys = check.page_keys(keys)
        if not keys:
            return []
        p = self.pool(KV)
        targets = check.page_values(target_locations, len(keys), p.dtype, p.page_numel,
                                    "target_locations", optional=True)
        self._flush_observe()
        t0 = time.perf_counter()
        out: list[torch.Tensor | None] = [None] * len(keys)
        for i, data in p.read(digests_of(keys)):
            page = data.view(p.dtype)
            target = targets[i]
            if target is None:
                target = torch.empty(page.shape, dtype=page.dtype, device=page.device)
            copy_into(target, page)
            out[i] = target
        self._tally(p, "prefetch", sum(o is not None for o in out), t0)
        return out

    def set(self, key: str, value: Any = None, target_location: Any = None, target_sizes: Any = None) -> bool:
        """Legacy, no prefix context: one page."""
        key = check.page_key(key)
        p = self.pool(KV)
        return self.batch_set([key], [check.page_value(value, p.dtype, p.page_numel, "value")])

    def batch_set(self, keys: list[str], values: Any = None, target_locations: Any = None,
                  target_sizes: Any = None) -> bool:
        """Legacy, no prefix context: ``keys`` continue the chain their first page is on,
        or start one of their own. True when every page is stored."""
        keys = check.page_keys(keys)
        if not keys:
            return True
        p = self.pool(KV)
        vals = check.page_values(values, len(keys), p.dtype, p.page_numel, "values")
        self._flush_observe()
        t0 = time.perf_counter()
        pages = [v.contiguous().view(torch.uint8).reshape(-1) for v in vals]
        out = self._store_run(p, digests_of(keys), None, pages)
        self._tally(p, "backup", sum(out), t0)
        return all(out)

    # ------------------------------------------------------------------ v2: every pool

    def batch_exists_v2(self, keys: list[str], pool_transfers: list[PoolTransfer] | None = None,
                        extra_info: HiCacheStorageExtraInfo | None = None) -> PoolTransferResult:
        transfers = check.transfers(pool_transfers, "pool_transfers")
        for i, t in enumerate(transfers):
            self._policy(t, f"pool_transfers[{i}]")
            check.page_keys([] if t.keys is None else t.keys, f"pool_transfers[{i}].keys")
        kv_pages = self.batch_exists(keys, extra_info)
        hits: dict[str, int] = {KV: kv_pages} if kv_pages else {}
        restorable = set(range(1, kv_pages + 1))
        digests = digests_of(keys)[:kv_pages]
        for t in transfers:
            if not restorable:
                break
            name = str(t.name)
            if t.hit_policy == PoolHitPolicy.TRAILING_PAGES:
                p = self.pool(name, trailing=True)
                present = {i + 1 for i, c in enumerate(p.state_chains(digests)) if p.state_match(c) is not None}
                window = max(1, len(t.keys) if t.keys else 1)
                ok = {n for n in range(1, kv_pages + 1)
                      if all(i in present for i in range(max(1, n - window + 1), n + 1))}
            else:
                ok = set(range(1, self.pool(name).hit_pages(digests) + 1))
            if ok:
                hits[name] = max(ok)
            restorable &= ok
        pages = sorted(restorable)
        return PoolTransferResult(pages[-1] if pages else 0, hits, pages)

    def _policy(self, t: Any, name: str) -> bool:
        """Whether transfer ``t`` is a trailing one (its pool registered, its policy known)."""
        if str(t.name) not in self.hosts:
            raise InvalidInputError(f"{name}.name: pool {str(t.name)!r} has no registered host pool")
        if t.hit_policy not in (PoolHitPolicy.TRAILING_PAGES, PoolHitPolicy.ALL_PAGES):
            raise InvalidInputError(f"{name}.hit_policy: {t.hit_policy!r} is not supported")
        return t.hit_policy == PoolHitPolicy.TRAILING_PAGES

    def _checked(self, transfers: Any, extra_info: Any) -> list[tuple[_Pool, list[str], list[int]]]:
        """Every transfer checked (pool, keys, host indices) before any is carried out."""
        out = []
        for i, t in enumerate(check.transfers(transfers, "transfers")):
            trailing = self._policy(t, f"transfers[{i}]")
            keys = check.page_keys([] if t.keys is None else t.keys, f"transfers[{i}].keys")
            check.prefix_keys(extra_info, keys)
            p = self.pool(t.name, trailing)
            out.append((p, keys, p.indices(keys, t.host_indices) if keys else []))
        return out

    def batch_get_v2(self, transfers: list[PoolTransfer],
                     extra_info: HiCacheStorageExtraInfo | None = None) -> dict[str, list[bool]]:
        self._flush_observe()
        out: dict[str, list[bool]] = {}
        for p, keys, indices in self._checked(transfers, extra_info):
            if p.trailing:
                out[p.name] = self._get_states(p, keys, indices)
            else:
                out[p.name] = self._read_into(p, keys, indices)
        return out

    def batch_set_v2(self, transfers: list[PoolTransfer],
                     extra_info: HiCacheStorageExtraInfo | None = None) -> dict[str, list[bool]]:
        self._flush_observe()
        before = check.prefix_keys(extra_info, [])
        out: dict[str, list[bool]] = {}
        for p, keys, indices in self._checked(transfers, extra_info):
            if not keys:
                out[p.name] = []
            elif p.trailing:
                out[p.name] = self._set_states(p, keys, indices, before)
            else:
                pages = [p.page_bytes_at(i) for i in indices]
                out[p.name] = self._store_run(p, digests_of(keys), before, pages)
        return out

    # ------------------------------------------------------------------ metrics and life

    def get_stats(self) -> Any:
        """SGLang's ``StorageMetrics`` for the KV calls since the last call: pages and GB/s
        per ``batch_get*`` (prefetch) and ``batch_set*`` (backup). SGLang's scheduler logs
        it on every step with ``--enable-metrics``; ``engine_stats()`` gives the engines'."""
        return storage_metrics(**self.take_metrics())

    def take_metrics(self) -> dict[str, list]:
        """``get_stats``' lists as a dict (``prefetch_pgs``, ``backup_pgs``,
        ``prefetch_bandwidth``, ``backup_bandwidth``), emptied."""
        with self._lock:
            out, self._metrics = self._metrics, _no_metrics()
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
            p.chains.rebuild()
        return True

    def close(self) -> None:
        self._flush_observe()
        for p in self.pools.values():
            p.engine.close()
        self.pools.clear()

    # ------------------------------------------------------------------ internals

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

    def _store_chain(self, p: _Pool, chain: list[bytes], base: int, pages: list[torch.Tensor]) -> int | None:
        """Store pages ``base..`` of ``chain`` as few checkpoints: how many are stored, or
        None when the chain before ``base`` is not stored (nothing to hang them on)."""
        n = len(pages)
        rows = gather(pages).view(n * p.bt, -1)
        prefix = Prefix(chain)
        done = base
        for end in self._positions(p, prefix, base, n):
            try:
                ok = p.store(prefix[:end], {"page": rows[: (end - base) * p.bt]}, tokens_from=base * p.bt)
            except InvalidInputError:
                if done == base:
                    return None
                break
            if not ok:
                break
            done = end
        p.chains.learn(chain[:done], base)
        return done - base

    def _store_run(self, p: _Pool, digests: list[bytes], before: list[str] | None,
                   pages: list[torch.Tensor]) -> list[bool]:
        """Store a run of pages on the chain it continues, else as a chain of its own."""
        base = p.base_for(digests, before)
        stored = self._store_chain(p, [*base, *digests], len(base), pages)
        if stored is None and base:
            stored = self._store_chain(p, list(digests), 0, pages)
        stored = stored or 0
        return [i < stored for i in range(len(digests))]

    def _set_pages(self, p: _Pool, keys: list[str], host_indices: Any, before: list[str] | None) -> list[bool]:
        indices = p.indices(keys, host_indices)
        self._flush_observe()
        pages = [p.page_bytes_at(i) for i in indices]
        return self._store_run(p, digests_of(keys), before, pages)

    def _get_pages(self, p: _Pool, keys: list[str], host_indices: Any) -> list[bool]:
        indices = p.indices(keys, host_indices)
        self._flush_observe()
        return self._read_into(p, keys, indices)

    def _read_into(self, p: _Pool, keys: list[str], indices: list[int]) -> list[bool]:
        got = p.read_into(digests_of(keys), indices)
        return [i < got for i in range(len(keys))]

    def _set_states(self, p: _Pool, keys: list[str], indices: list[int], before: list[str] | None) -> list[bool]:
        digests = digests_of(keys)
        base = p.base_for(digests, before)
        out = []
        for i, index in enumerate(indices):
            chain = [*base, *digests[: i + 1]]
            marker = torch.zeros((len(chain) * p.bt, 1), dtype=torch.uint8)
            ok = not p.broken and p.store(Prefix(chain), {"pos": marker}, {"state": p.page_bytes_at(index)})
            if ok:
                p.chains.learn(chain, 0)
            out.append(ok)
        return out

    def _get_states(self, p: _Pool, keys: list[str], indices: list[int]) -> list[bool]:
        out = []
        for chain, index in zip(p.state_chains(digests_of(keys)), indices, strict=True):
            m = p.state_match(chain)
            r = p.engine.restore(m) if m is not None else None
            if r is None:
                out.append(False)
                continue
            p.put_page(index, r.snapshot[0]["state"])
            out.append(True)
        return out


def _no_metrics() -> dict[str, list]:
    return {"prefetch_pgs": [], "backup_pgs": [], "prefetch_bandwidth": [], "backup_bandwidth": []}


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
