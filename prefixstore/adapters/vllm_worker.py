"""The worker half of the vLLM connector: one per tensor-parallel worker.

It moves its rank's KV rows between vLLM's paged per-layer views and the staging
files (``vllm_staging``), overlapping the forward pass on one background thread:

- ``start_load_kv`` queues the step's loads: wait for each load's status (the
  scheduler's engine restores and verifies while the step is being scheduled and
  sent), then copy layer by layer into the request's blocks, marking each layer
  done; ``wait_for_layer_load(layer)`` blocks only until that layer is in place.
- ``save_kv_layer(layer)`` queues the copy of that layer's rows of the step's save
  jobs as soon as attention has written it; ``wait_for_save`` copies any layer the
  forward did not announce, waits for every copy and reports the jobs done.

Blocks a load could not fill (a shard that failed verification, a restore that found
less than promised, a status that never came within ``load_timeout_s``) are returned by
``load_errors`` (vLLM's ``get_block_ids_with_load_errors``), so vLLM recomputes them.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from prefixstore.adapters.vllm_staging import LoadJob, SaveJob, Staging
from prefixstore.base.errors import LayoutError
from prefixstore.base.layout import Layout
from prefixstore.base.log import log

POLL_S = (0.0002, 0.005)
"""A load's status is polled from the first interval, doubling up to the second."""


class WorkerSide:
    """One rank's transfers (see the module docstring)."""

    def __init__(self, staging: Staging, layout: Layout, rank: int, block_size: int, load_timeout_s: float) -> None:
        self.staging, self.layout, self.rank, self.bs = staging, layout, rank, block_size
        self.load_timeout_s = load_timeout_s
        self.caches: dict[str, torch.Tensor] = {}
        self.kernel_block = block_size
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"prefixstore-kv{rank}")
        self.loads: list[LoadJob] = []
        self.saves: list[SaveJob] = []
        self.layer_ready: dict[str, threading.Event] = {}
        self.load_task: Future | None = None
        self.save_bufs: dict[int, dict[str, torch.Tensor]] = {}
        self.save_tasks: dict[int, dict[str, Future]] = {}
        self.errors: set[int] = set()
        self.report: dict[str, Counter[int]] = {"saved": Counter(), "failed": Counter(), "loaded": Counter()}
        self.lock = threading.Lock()

    def register(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Keep vLLM's per-layer ``[blocks, heads, block_size, content]`` views; a layer
        missing or shaped otherwise than the layout says is a LayoutError."""
        for spec in self.layout.segments:
            view = kv_caches.get(spec.name)
            if view is None:
                raise LayoutError(f"rank {self.rank}: vLLM registered no KV cache for layer {spec.name!r}")
            ok = (view.dim() == 4 and (view.shape[1], view.shape[3]) == spec.shape
                  and view.dtype == spec.torch_dtype and self.bs % view.shape[2] == 0)
            if not ok:
                raise LayoutError(f"rank {self.rank}: layer {spec.name!r} KV view {tuple(view.shape)} {view.dtype} "
                                  f"does not hold rows {spec.shape} {spec.dtype} in blocks of {self.bs} tokens")
            self.kernel_block = int(view.shape[2])
            self.caches[spec.name] = view

    # ------------------------------------------------------------------ a step

    def begin_step(self, loads: list[LoadJob], saves: list[SaveJob]) -> None:
        self.loads, self.saves = list(loads), list(saves)
        self.layer_ready = {}
        self.save_bufs, self.save_tasks = {}, {}

    def start_loads(self) -> None:
        if not self.loads:
            return
        self.layer_ready = {s.name: threading.Event() for s in self.layout.segments}
        self.load_task = self.pool.submit(self._run_loads, self.loads, self.layer_ready)

    def wait_layer(self, layer: str) -> None:
        ev = self.layer_ready.get(layer)
        if ev is not None:
            ev.wait()

    def save_layer(self, layer: str) -> None:
        if not self.saves or layer not in self.caches:
            return
        self._open_saves()
        for job in self.saves:
            if job.job in self.save_bufs and layer not in self.save_tasks[job.job]:
                self.save_tasks[job.job][layer] = self.pool.submit(self._copy_out, job, layer)

    def finish_step(self) -> None:
        """End of the step: loads finished, every save job's layers copied, reported."""
        if self.load_task is not None:
            self.load_task.result()  # never raises: failures become load errors
            self.load_task = None
        if not self.saves:
            return
        self._open_saves()
        for job in self.saves:
            if job.job not in self.save_bufs:
                continue
            for spec in self.layout.segments:
                if spec.name not in self.save_tasks[job.job]:
                    self.save_tasks[job.job][spec.name] = self.pool.submit(self._copy_out, job, spec.name)
        for job in self.saves:
            tasks = self.save_tasks.get(job.job)
            ok = tasks is not None
            for fut in (tasks or {}).values():
                try:
                    fut.result()
                except Exception as exc:  # a save is best effort: the job fails, the step goes on
                    ok = False
                    log.warning("vllm_save_copy_failed", job=job.job, rank=self.rank, error=str(exc))
            with self.lock:
                self.report["saved" if ok else "failed"][job.job] += 1
        self.save_bufs, self.save_tasks, self.saves = {}, {}, []

    def take_errors(self) -> set[int]:
        with self.lock:
            out, self.errors = self.errors, set()
        return out

    def take_report(self) -> dict[str, dict[int, int]] | None:
        with self.lock:
            if not any(self.report.values()):
                return None
            out = {k: dict(v) for k, v in self.report.items()}
            self.report = {k: Counter() for k in self.report}
        return out

    def close(self) -> None:
        self.pool.shutdown(wait=True)

    # ------------------------------------------------------------------ internals

    def _slots(self, block_ids: list[int], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """(kernel block, offset) of every token of ``block_ids``: vLLM may view a block of
        ``block_size`` tokens as several kernel blocks of ``kernel_block`` tokens."""
        ids = torch.tensor(block_ids, dtype=torch.long)
        slots = (ids[:, None] * self.bs + torch.arange(self.bs)[None, :]).reshape(-1)
        return (slots // self.kernel_block).to(device), (slots % self.kernel_block).to(device)

    def _open_saves(self) -> None:
        for job in self.saves:
            if job.job in self.save_tasks:
                continue
            self.save_tasks[job.job] = {}
            try:
                buf = self.staging.create(self.staging.save_file(job.job, self.rank), len(job.block_ids) * self.bs)
            except OSError as exc:  # a full staging tmpfs: this job is dropped, the step goes on
                log.warning("vllm_save_staging_failed", job=job.job, rank=self.rank, error=str(exc))
                self.save_tasks.pop(job.job)
                with self.lock:
                    self.report["failed"][job.job] += 1
                continue
            self.save_bufs[job.job] = self.staging.views(buf, len(job.block_ids) * self.bs)

    def _copy_out(self, job: SaveJob, layer: str) -> None:
        view = self.caches[layer]
        blk, off = self._slots(job.block_ids, view.device)
        self.save_bufs[job.job][layer].copy_(view[blk, :, off, :])

    def _run_loads(self, loads: list[LoadJob], ready: dict[str, threading.Event]) -> None:
        try:
            staged = [got for job in loads if (got := self._await_load(job)) is not None]
            for spec in self.layout.segments:
                view = self.caches[spec.name]
                for job, blocks, rows in staged:
                    blk, off = self._slots(job.block_ids[:blocks], view.device)
                    view[blk, :, off, :] = rows[spec.name].to(view.device)
                ready[spec.name].set()
        except Exception as exc:  # every block not surely in place is reported, never served
            log.warning("vllm_load_failed", rank=self.rank, error=repr(exc))
            with self.lock:
                for job in loads:
                    self.errors.update(job.block_ids)
        finally:
            for ev in ready.values():
                ev.set()
            with self.lock:
                for job in loads:
                    self.report["loaded"][job.job] += 1
            self.staging.remove(*(self.staging.load_file(job.job, self.rank) for job in loads))

    def _await_load(self, job: LoadJob) -> tuple[LoadJob, int, dict[str, torch.Tensor]] | None:
        """Wait for the job's status; (job, blocks restored, rows) or None. Blocks it does
        not cover are load errors."""
        deadline = time.monotonic() + self.load_timeout_s
        pause = POLL_S[0]
        status = self.staging.read_status(job.job)
        while status is None and time.monotonic() < deadline:
            time.sleep(pause)
            pause = min(pause * 2, POLL_S[1])
            status = self.staging.read_status(job.job)
        blocks = 0
        if status is None:
            log.warning("vllm_load_timed_out", job=job.job, rank=self.rank, timeout_s=self.load_timeout_s)
        elif not status.get("error"):
            got = status.get("blocks")
            blocks = min(got, len(job.block_ids)) if isinstance(got, int) and got > 0 else 0
        rows = None
        if blocks:
            try:
                buf = self.staging.open(self.staging.load_file(job.job, self.rank), blocks * self.bs)
                rows = self.staging.views(buf, blocks * self.bs)
            except OSError as exc:
                log.warning("vllm_load_staging_unreadable", job=job.job, rank=self.rank, error=str(exc))
                blocks = 0
        if blocks < len(job.block_ids):
            with self.lock:
                self.errors.update(job.block_ids[blocks:])
        return (job, blocks, rows) if blocks and rows is not None else None
