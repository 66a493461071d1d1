"""prefixstore as a vLLM KV connector (vllm 0.33): ``PrefixStoreConnector``.

vLLM loads it by module path (docs/vllm.md has the launch command and every option)::

    --kv-transfer-config '{"kv_connector": "PrefixStoreConnector",
      "kv_connector_module_path": "prefixstore.adapters.vllm", "kv_role": "kv_both",
      "kv_load_failure_policy": "recompute",
      "kv_connector_extra_config": {"dir": "/var/cache/prefixstore", "capacity_bytes": 68719476736}}'

Where things live. The scheduler half (``vllm_scheduler.SchedulerSide``) holds the one
``Engine`` of the cache: catalog, journal and every rank's shard directory; a checkpoint
is one engine store with one shard per tensor-parallel rank, published only once every
rank's shard is durable. Each worker half (``vllm_worker.WorkerSide``) moves its rank's
rows between vLLM's paged KV views and staging files on tmpfs (``vllm_staging``), layer by
layer while the forward pass runs. The workers never see one another or the catalog.

Keys are vLLM's own chained block hashes (``request.block_hashes``), folded with a
namespace (default: the model). Restores verify every shard; blocks that could not be
restored are reported through ``get_block_ids_with_load_errors``, so vLLM recomputes
them and never computes on other bytes. One full-attention KV cache group is handled;
anything else (hybrid Mamba groups, sliding-window groups, packed pages, pipeline or
context parallelism) is refused when the connector is built.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from prefixstore.adapters.vllm_options import (
    ConnectorOptions,
    UnknownConfigKeysError,
    kv_layout,
    model_identity,
)
from prefixstore.adapters.vllm_scheduler import SchedulerSide
from prefixstore.adapters.vllm_staging import LoadJob, SaveJob, Staging
from prefixstore.adapters.vllm_worker import WorkerSide
from prefixstore.base.errors import InvalidInputError
from prefixstore.base.log import log

try:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import (
        KVConnectorBase_V1,
        KVConnectorMetadata,
        KVConnectorRole,
        KVConnectorWorkerMetadata,
    )
except ImportError as exc:  # pragma: no cover - exercised only where vllm is absent
    raise ImportError(
        "prefixstore.adapters.vllm needs vllm: pip install --no-deps vllm==0.33.0 and "
        'pip install -e ".[vllm]" (see docs/vllm.md)'
    ) from exc

if TYPE_CHECKING:
    import torch

__all__ = ["PrefixStoreConnector", "PrefixStoreConnectorMetadata", "PrefixStoreWorkerMetadata",
           "UnknownConfigKeysError"]

UNREPRODUCIBLE_HASHES = ("xxhash", "xxhash_cbor")


@dataclass
class PrefixStoreConnectorMetadata(KVConnectorMetadata):
    """Scheduler -> workers, once per step: the loads and saves of the step."""

    loads: list[LoadJob] = field(default_factory=list)
    saves: list[SaveJob] = field(default_factory=list)


@dataclass
class PrefixStoreWorkerMetadata(KVConnectorWorkerMetadata):
    """Workers -> scheduler, once per step: per job, how many ranks staged a save
    (``saved``), failed to (``failed``) or finished a load (``loaded``). vLLM sums the
    workers' reports with ``aggregate``."""

    saved: dict[int, int] = field(default_factory=dict)
    failed: dict[int, int] = field(default_factory=dict)
    loaded: dict[int, int] = field(default_factory=dict)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        if not isinstance(other, PrefixStoreWorkerMetadata):
            raise InvalidInputError(f"cannot aggregate {type(other).__name__} with PrefixStoreWorkerMetadata")
        out = PrefixStoreWorkerMetadata()
        for name in ("saved", "failed", "loaded"):
            merged = dict(getattr(self, name))
            for job, n in getattr(other, name).items():
                merged[job] = merged.get(job, 0) + n
            setattr(out, name, merged)
        return out

    def as_report(self) -> dict[str, dict[int, int]]:
        return {"saved": self.saved, "failed": self.failed, "loaded": self.loaded}


class PrefixStoreConnector(KVConnectorBase_V1):
    """A vLLM v1 KV connector over one prefixstore cache (see the module docstring)."""

    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        model = vllm_config.model_config
        self.options = ConnectorOptions.parse(self._kv_transfer_config.kv_connector_extra_config,
                                              model=str(getattr(model, "served_model_name", None) or model.model))
        par = vllm_config.parallel_config
        for name in ("pipeline_parallel_size", "decode_context_parallel_size", "prefill_context_parallel_size"):
            if int(getattr(par, name, 1) or 1) != 1:
                raise InvalidInputError(f"{name} = {getattr(par, name)}: the prefixstore connector handles "
                                        f"tensor parallelism only")
        tp = int(par.tensor_parallel_size)
        self.layout = kv_layout(kv_cache_config, tp)
        self.scheduler: SchedulerSide | None = None
        self.worker: WorkerSide | None = None
        if role == KVConnectorRole.SCHEDULER:
            algo = vllm_config.cache_config.prefix_caching_hash_algo
            if algo in UNREPRODUCIBLE_HASHES and os.environ.get("PYTHONHASHSEED") is None:
                raise InvalidInputError(f"prefix_caching_hash_algo {algo!r} seeds vLLM's block hashes randomly per "
                                        f"process unless PYTHONHASHSEED is set: stored blocks would never be found "
                                        f"again; use sha256 or sha256_cbor, or set PYTHONHASHSEED")
            if self._kv_transfer_config.kv_load_failure_policy != "recompute":
                log.warning("vllm_load_failure_policy", policy=self._kv_transfer_config.kv_load_failure_policy,
                            hint="a block that fails verification fails its request; 'recompute' recomputes it")
            hash_bs = getattr(vllm_config.cache_config, "hash_block_size", None) or self.layout.block_tokens
            self.scheduler = SchedulerSide(self.options, self.layout, int(hash_bs),
                                           model_identity(vllm_config, self.options.namespace, tp))
        else:
            rank = int(par.rank) % tp
            self.worker = WorkerSide(Staging(self.options.staging_root, self.layout), self.layout, rank,
                                     self.layout.block_tokens, self.options.load_timeout_s)

    @property
    def requires_kv_delivery(self) -> bool:
        return False  # a cache: a save dropped is a later miss, never a lost hand-off

    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config: dict[str, Any]) -> bool:
        return True  # loads and saves are layer by layer (wait_for_layer_load / save_kv_layer)

    # ------------------------------------------------------------------ worker side

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self._worker().register(kv_caches)

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        if not isinstance(connector_metadata, PrefixStoreConnectorMetadata):
            raise InvalidInputError(f"expected PrefixStoreConnectorMetadata, got {type(connector_metadata).__name__}")
        self._worker().begin_step(connector_metadata.loads, connector_metadata.saves)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        self._worker().start_loads()

    def wait_for_layer_load(self, layer_name: str) -> None:
        self._worker().wait_layer(layer_name)

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        self._worker().save_layer(layer_name)

    def wait_for_save(self) -> None:
        self._worker().finish_step()

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._worker().take_errors()

    def build_connector_worker_meta(self) -> PrefixStoreWorkerMetadata | None:
        report = self._worker().take_report()
        return None if report is None else PrefixStoreWorkerMetadata(**report)

    # ------------------------------------------------------------------ scheduler side

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        return self._scheduler().lookup(request, num_computed_tokens), False

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        ids = blocks.get_block_ids()[0] if num_external_tokens > 0 else []
        self._scheduler().allocated(request, ids, num_external_tokens)

    def build_connector_meta(self, scheduler_output: Any) -> PrefixStoreConnectorMetadata:
        state = scheduler_output.kv_connector_block_state

        def block_ids_of(req_id: str) -> list[int]:
            got = state.get_block_ids(req_id) if state is not None else None
            return list(got[0]) if got else []

        loads, saves = self._scheduler().build_meta(dict(scheduler_output.num_scheduled_tokens), block_ids_of)
        return PrefixStoreConnectorMetadata(loads=loads, saves=saves)

    def update_connector_output(self, connector_output: Any) -> None:
        meta = connector_output.kv_connector_worker_meta
        report = meta.as_report() if isinstance(meta, PrefixStoreWorkerMetadata) else None
        self._scheduler().worker_report(report, set(connector_output.invalid_block_ids or ()))

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        self._scheduler().finished(request.request_id)
        return False, None

    # ------------------------------------------------------------------ both

    def stats(self) -> dict[str, Any]:
        """The scheduler half's counters and engine ``stats()``."""
        return self._scheduler().stats()

    def flush(self, timeout: float | None = None) -> bool:
        """Wait for the scheduler half's queued restores and stores (False: timed out)."""
        return self._scheduler().flush(timeout)

    def shutdown(self) -> None:
        if self.scheduler is not None:
            self.scheduler.close()
        if self.worker is not None:
            self.worker.close()

    def _worker(self) -> WorkerSide:
        if self.worker is None:
            raise InvalidInputError("a worker-side call on the scheduler's connector")
        return self.worker

    def _scheduler(self) -> SchedulerSide:
        if self.scheduler is None:
            raise InvalidInputError("a scheduler-side call on a worker's connector")
        return self.scheduler
