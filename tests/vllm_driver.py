"""vLLM's real scheduler with the prefixstore connector, and its worker halves driven
step by step as vLLM's model runner drives them (not a test module).

Everything vLLM-side is vLLM's own: ``VllmConfig`` over a tiny model's ``config.json`` on
local disk (``skip_tokenizer_init``), the ``Scheduler`` (``AsyncScheduler`` when the
config asks for async scheduling, as vLLM's engine core picks it), ``Request`` objects
hashed by vLLM's block hasher, the connector built by ``KVConnectorFactory`` from
``kv_connector_module_path``, the KV cache planned by ``get_kv_cache_config_from_groups``
and allocated by the worker's ``allocate_kv_cache`` on the CPU, and the workers' outputs
summed by the executor's ``KVOutputAggregator``.

What stands in for the model: each step a worker binds the connector metadata, calls
``start_load_kv``, then per layer ``wait_for_layer_load``, writes the KV rows of the
step's scheduled tokens ("attention") and calls ``save_kv_layer``; then
``wait_for_save``, ``get_block_ids_with_load_errors``, ``build_connector_worker_meta``
and ``clear_connector_metadata``, as ``KVConnectorModelRunnerMixin`` does. A token's KV
row is a deterministic function of its block's prefix (``expected_rows``), so any row
anywhere can be checked; after each step a worker checks every block it loaded (except
those it reported as load errors) byte for byte.

``Instance(..., processes=True)`` runs each worker in its own forked OS process (the
scheduler stays in this one), as vLLM's multiprocessing executor does.
"""

from __future__ import annotations

import copy
import hashlib
import json
import multiprocessing
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from vllm import SamplingParams  # noqa: E402
from vllm.config import (  # noqa: E402
    CacheConfig,
    DeviceConfig,
    KVTransferConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
    VllmConfig,
)
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.utils import KVOutputAggregator  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole  # noqa: E402
from vllm.utils.hashing import get_hash_fn_by_name  # noqa: E402
from vllm.v1.core.kv_cache_planning import get_kv_cache_config_from_groups  # noqa: E402
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash  # noqa: E402
from vllm.v1.core.sched.async_scheduler import AsyncScheduler  # noqa: E402
from vllm.v1.core.sched.scheduler import Scheduler  # noqa: E402
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheGroupSpec  # noqa: E402
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput  # noqa: E402
from vllm.v1.request import Request, RequestStatus  # noqa: E402
from vllm.v1.structured_output import StructuredOutputManager  # noqa: E402
from vllm.v1.worker.utils import allocate_kv_cache  # noqa: E402

BS = 16
LAYERS = 2
KV_HEADS = 2
HEAD = 8
EOS = 999
PERIOD = 65521
HASH_ALGO = "sha256_cbor"
MODULE = "prefixstore.adapters.vllm"


def layer_names(layers: int = LAYERS) -> tuple[str, ...]:
    return tuple(f"model.layers.{i}.self_attn.attn" for i in range(layers))


@dataclass(frozen=True)
class Model:
    """The attention shape of the tiny model: its layer names, KV heads, head size."""

    layers: tuple[str, ...] = layer_names()
    kv_heads: int = KV_HEADS
    head: int = HEAD


def write_model(root: str, model: Model = Model()) -> str:
    """A tiny Llama's config.json (no weights: nothing here runs the model)."""
    path = os.path.join(root, "tiny-llama")
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump({"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
                   "intermediate_size": 64, "num_attention_heads": 8, "num_key_value_heads": model.kv_heads,
                   "head_dim": model.head, "num_hidden_layers": len(model.layers), "vocab_size": 1000,
                   "max_position_embeddings": 1 << 18, "rms_norm_eps": 1e-5, "torch_dtype": "float16"}, f)
    return path


def make_config(model: str, cache_dir: str, *, tp: int = 1, extra: dict[str, Any] | None = None,
                block_size: int = BS, max_batched: int = 2048, prefix_caching: bool = True,
                async_scheduling: bool | None = None, max_model_len: int = 1 << 16) -> VllmConfig:
    """A VllmConfig with the prefixstore connector loaded by module path."""
    extra = {"dir": cache_dir, "capacity_bytes": 64 << 20, **(extra or {})}
    kv = KVTransferConfig(kv_connector="PrefixStoreConnector", kv_connector_module_path=MODULE, kv_role="kv_both",
                          kv_load_failure_policy="recompute", kv_connector_extra_config=extra)
    cache = CacheConfig(block_size=block_size, enable_prefix_caching=prefix_caching,
                        prefix_caching_hash_algo=HASH_ALGO)
    cache.kv_cache_layout = "LBHNC"
    sched = SchedulerConfig(max_num_seqs=64, max_num_batched_tokens=max_batched, max_model_len=max_model_len,
                            is_encoder_decoder=False, async_scheduling=async_scheduling)
    return VllmConfig(model_config=ModelConfig(model=model, skip_tokenizer_init=True, dtype="float16",
                                               max_model_len=max_model_len),
                      scheduler_config=sched, cache_config=cache, kv_transfer_config=kv,
                      device_config=DeviceConfig("cpu"), parallel_config=ParallelConfig(tensor_parallel_size=tp))


def kv_cache_config(vc: VllmConfig, num_blocks: int, model: Model = Model()):
    """vLLM's plan for ``num_blocks`` blocks of one full-attention group (per rank)."""
    tp = vc.parallel_config.tensor_parallel_size
    spec = FullAttentionSpec(block_size=vc.cache_config.block_size, num_kv_heads=model.kv_heads // tp,
                             head_size=model.head, dtype=torch.float16)
    groups = [KVCacheGroupSpec(list(model.layers), spec)]
    return get_kv_cache_config_from_groups(vc, groups, num_blocks * len(model.layers) * spec.page_size_bytes)


def rank_config(vc: VllmConfig, rank: int) -> VllmConfig:
    """The config a worker of tensor-parallel rank ``rank`` sees (vLLM sets the rank)."""
    out = copy.copy(vc)
    out.parallel_config = copy.copy(vc.parallel_config)
    out.parallel_config.rank = rank
    return out


# ---------------------------------------------------------------------- KV contents

_BASE: dict[int, torch.Tensor] = {}


def _base(width: int) -> torch.Tensor:
    if width not in _BASE:
        g = torch.Generator().manual_seed(26)
        _BASE[width] = torch.randn(PERIOD + width, generator=g).to(torch.float16)
    return _BASE[width]


def block_keys(tokens: Sequence[int], bs: int) -> list[int]:
    """One key per full block of ``tokens``, chained over the prefix."""
    out, prev = [], b""
    t = torch.tensor(list(tokens[: (len(tokens) // bs) * bs]), dtype=torch.int32).numpy()
    for b in range(len(tokens) // bs):
        prev = hashlib.blake2b(prev + t[b * bs:(b + 1) * bs].tobytes(), digest_size=8).digest()
        out.append(int.from_bytes(prev, "little") % PERIOD)
    return out


def expected_rows(tokens: Sequence[int], start: int, end: int, layer: int, rank: int, heads: int, head: int,
                  bs: int) -> torch.Tensor:
    """The KV rows of positions ``[start, end)``: row ``p`` depends on the key of the
    blocks before its own, its token and its offset (so on nothing after ``p``)."""
    width = heads * 2 * head
    keys = torch.tensor([0, *block_keys(tokens[: (end // bs) * bs], bs)], dtype=torch.long)
    pos = torch.arange(start, end)
    tok = torch.tensor(list(tokens[start:end]), dtype=torch.long)
    off = (keys[pos // bs] + tok * 1009 + (pos % bs) * 31 + layer * 7 + rank * 13) % PERIOD
    rows = _base(width)[off[:, None] + torch.arange(width)[None, :]]
    return rows.view(end - start, heads, 2 * head)


def sampled_token(position: int) -> int:
    """The token the stand-in model samples for ``position``."""
    return (position * 31 + 7) % 998


def prompt(seed: int, tokens: int, shared: Sequence[int] = ()) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return list(shared) + torch.randint(0, 998, (tokens - len(shared),), generator=g).tolist()


# ---------------------------------------------------------------------- a worker


class Worker:
    """One tensor-parallel worker: its connector half and its CPU KV cache."""

    def __init__(self, vc: VllmConfig, kcc: Any, rank: int, model: Model = Model()) -> None:
        self.rank = rank
        self.tp = vc.parallel_config.tensor_parallel_size
        self.heads, self.head, self.bs = model.kv_heads // self.tp, model.head, vc.cache_config.block_size
        self.connector = KVConnectorFactory.create_connector(rank_config(vc, rank), KVConnectorRole.WORKER, kcc)
        self.caches = allocate_kv_cache(kcc, torch.device("cpu"), vc.cache_config.get_resolved_kv_cache_layout())
        self.layers = [g for group in kcc.kv_cache_groups for g in group.layer_names]
        self.connector.register_kv_caches(self.caches)

    def step(self, meta: Any, work: list[tuple[str, list[int], int, int, list[int]]]) -> dict[str, Any]:
        """One forward pass over ``work``: (req, block table, start, end, tokens to end)."""
        c = self.connector
        c.bind_connector_metadata(meta)
        c.start_load_kv(None)
        for li, name in enumerate(self.layers):
            c.wait_for_layer_load(name)
            view = self.caches[name]
            for _req, table, start, end, tokens in work:
                if end > start:
                    blk, off = _slots(table, start, end, self.bs, view.shape[2])
                    view[blk, :, off, :] = expected_rows(tokens, start, end, li, self.rank, self.heads, self.head,
                                                         self.bs)
            c.save_kv_layer(name, view, None)
        c.wait_for_save()
        errors = c.get_block_ids_with_load_errors()
        report = c.build_connector_worker_meta()
        checked, wrong = self._check_loads(meta, work, errors)
        c.clear_connector_metadata()
        return {"invalid": errors, "meta": report, "checked": checked, "wrong": wrong}

    def rows_of(self, table: list[int], start: int, end: int) -> list[torch.Tensor]:
        out = []
        for name in self.layers:
            view = self.caches[name]
            blk, off = _slots(table, start, end, self.bs, view.shape[2])
            out.append(view[blk, :, off, :].clone())
        return out

    def _check_loads(self, meta: Any, work, errors: set[int]) -> tuple[int, int]:
        tables = {req: (table, tokens) for req, table, _s, _e, tokens in work}
        checked = wrong = 0
        for job in meta.loads:
            if job.req_id not in tables:
                continue  # aborted or preempted: not in the forward pass
            table, tokens = tables[job.req_id]
            for bid in job.block_ids:
                if bid in errors or bid not in table:
                    continue
                b = table.index(bid)
                for li, name in enumerate(self.layers):
                    view = self.caches[name]
                    bs = self.bs
                    blk, off = _slots(table, b * bs, (b + 1) * bs, bs, view.shape[2])
                    want = expected_rows(tokens, b * bs, (b + 1) * bs, li, self.rank, self.heads, self.head, bs)
                    wrong += not torch.equal(view[blk, :, off, :].view(torch.int16), want.view(torch.int16))
                checked += 1
        return checked, wrong

    def close(self) -> None:
        self.connector.shutdown()


def _slots(table: list[int], start: int, end: int, bs: int, kernel_block: int) -> tuple[torch.Tensor, torch.Tensor]:
    pos = torch.arange(start, end)
    slots = torch.tensor(table, dtype=torch.long)[pos // bs] * bs + pos % bs
    return slots // kernel_block, slots % kernel_block


def _serve(conn, vc, kcc, rank, model) -> None:
    """A worker process's loop: ("step", meta, work) -> the step's result; ("close",)."""
    torch.set_num_threads(1)
    w = Worker(vc, kcc, rank, model)
    conn.send("ready")
    while True:
        msg = conn.recv()
        if msg[0] == "close":
            w.close()
            conn.send("closed")
            return
        conn.send(w.step(*msg[1:]))


class WorkerProcess:
    """A Worker in its own forked process, called through a pipe (as vLLM's executor
    sends each worker the step's scheduler output)."""

    def __init__(self, vc: VllmConfig, kcc: Any, rank: int, model: Model = Model()) -> None:
        ctx = multiprocessing.get_context("fork")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_serve, args=(child, vc, kcc, rank, model), daemon=True)
        self.proc.start()
        if not self.conn.poll(120) or self.conn.recv() != "ready":
            raise RuntimeError(f"worker {rank} did not start")

    def step(self, meta, work) -> dict[str, Any]:
        self.conn.send(("step", meta, work))
        return self.conn.recv()

    def close(self) -> None:
        if self.proc.is_alive():
            self.conn.send(("close",))
            self.conn.poll(60)
        self.proc.join(30)


# ---------------------------------------------------------------------- an instance


class Instance:
    """One vLLM instance: the real scheduler (its connector half holds the engine) and
    ``tp`` workers, stepped as vLLM's engine core steps them."""

    def __init__(self, model_dir: str, cache_dir: str, *, tp: int = 1, num_blocks: int = 256,
                 processes: bool = False, model: Model = Model(), **config: Any) -> None:
        self.vc = make_config(model_dir, cache_dir, tp=tp, **config)
        self.bs = self.vc.cache_config.block_size
        self.kcc = kv_cache_config(self.vc, num_blocks, model)
        self.vc.cache_config.num_gpu_blocks = self.kcc.num_blocks
        hash_fn = get_hash_fn_by_name(HASH_ALGO)
        init_none_hash(hash_fn)
        self.hasher = get_request_block_hasher(self.vc.cache_config.block_size, hash_fn)
        cls = AsyncScheduler if self.vc.scheduler_config.async_scheduling else Scheduler
        self.scheduler = cls(vllm_config=self.vc, kv_cache_config=self.kcc, log_stats=True,
                             structured_output_manager=StructuredOutputManager(self.vc),
                             block_size=self.vc.cache_config.block_size)
        self.connector = self.scheduler.connector
        self.workers = [(WorkerProcess if processes else Worker)(self.vc, self.kcc, r, model) for r in range(tp)]
        self.aggregator = KVOutputAggregator(tp)
        self.checked = self.wrong = 0
        self.external_tokens: dict[str, int] = {}
        self.tables: dict[int, list[tuple[str, list[int], int, int]]] = {}

    def request(self, req_id: str, tokens: list[int], max_tokens: int = 1) -> Request:
        """A vLLM Request, hashed by vLLM's block hasher."""
        sp = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
        sp.update_from_generation_config({}, EOS)
        return Request(request_id=req_id, prompt_token_ids=list(tokens), sampling_params=sp, pooling_params=None,
                       mm_features=None, block_hasher=self.hasher)

    def add(self, req_id: str, tokens: list[int], max_tokens: int = 1) -> Request:
        req = self.request(req_id, tokens, max_tokens)
        self.scheduler.add_request(req)
        return req

    def schedule(self):
        """``Scheduler.schedule``; the step's block tables are taken now, as the model
        runner receives them with the scheduler output."""
        so = self.scheduler.schedule()
        for job in so.kv_connector_metadata.loads:
            self.external_tokens[job.req_id] = self.external_tokens.get(job.req_id, 0) + len(job.block_ids) * self.bs
        self.tables[id(so)] = [
            (req_id, list(self.scheduler.kv_cache_manager.get_block_ids(req_id)[0]), start, start + n)
            for req_id, n in so.num_scheduled_tokens.items() if (start := self._start_of(so, req_id)) is not None]
        return so

    def execute(self, so) -> ModelRunnerOutput:
        """The workers' forward pass over ``so`` and the executor's aggregation."""
        work = []
        for req_id, table, start, end in self.tables.pop(id(so)):
            req = self.scheduler.requests.get(req_id)
            if req is None or req.is_finished():
                continue  # aborted since it was scheduled: its rows are never read
            tokens = list(req.all_token_ids[:end])
            tokens += [sampled_token(p) for p in range(len(tokens), end)]  # async: sampled, not yet returned
            work.append((req_id, table, start, end, tokens))
        results = [w.step(so.kv_connector_metadata, work) for w in self.workers]
        for r in results:
            self.checked += r["checked"]
            self.wrong += r["wrong"]
        outs = []
        for r in results:
            kv = KVConnectorOutput(invalid_block_ids=set(r["invalid"]), kv_connector_worker_meta=r["meta"])
            outs.append(self._runner_output(so, work, kv))
        return self.aggregator.aggregate(outs, output_rank=0)

    def step(self):
        so = self.schedule()
        out = self.execute(so)
        self.scheduler.update_from_output(so, out)
        return so

    def run(self, max_steps: int = 10_000) -> int:
        steps = 0
        while self.scheduler.has_requests() and steps < max_steps:
            self.step()
            steps += 1
        return steps

    def close(self) -> None:
        for w in self.workers:
            w.close()
        self.connector.shutdown()

    @staticmethod
    def _start_of(so, req_id: str) -> int | None:
        for nr in so.scheduled_new_reqs:
            if nr.req_id == req_id:
                return nr.num_computed_tokens
        cached = so.scheduled_cached_reqs
        return cached.num_computed_tokens[cached.req_ids.index(req_id)] if req_id in cached.req_ids else None

    def _runner_output(self, so, work, kv: KVConnectorOutput) -> ModelRunnerOutput:
        ids = list(so.num_scheduled_tokens)
        sampled = []
        for req_id in ids:
            req = self.scheduler.requests.get(req_id)
            done = next((e for r, _t, _s, e, _k in work if r == req_id), 0)
            sampled.append([sampled_token(done)] if req is not None and done >= req.num_tokens else [])
        return ModelRunnerOutput(req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)},
                                 sampled_token_ids=sampled, kv_connector_output=kv)


def finished(scheduler) -> bool:
    """No request, no held block: vLLM's own "scheduler is empty" checks."""
    pool = scheduler.kv_cache_manager.block_pool
    return (not scheduler.requests and not scheduler.waiting and not scheduler.running
            and pool.get_num_free_blocks() == pool.num_gpu_blocks - 1)


__all__ = ["BS", "Instance", "Model", "RequestStatus", "Worker", "expected_rows", "finished", "prompt", "write_model"]
