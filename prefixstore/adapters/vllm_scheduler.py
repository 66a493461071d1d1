"""The scheduler half of the vLLM connector: the engine, lookups and the job ledger.

The scheduler process owns the one ``Engine`` of the cache (catalog, journal and every
rank's shard directory, ``DIR/rank{r}``): a checkpoint is one engine store holding a
shard per tensor-parallel rank, published only when every shard is durable, exactly as
everywhere else in prefixstore. Workers never touch the catalog; their bytes arrive
and leave through staging files (``vllm_staging``).

Keys. A block's digest is vLLM's own chained block hash (``request.block_hashes``)
folded with ``namespace`` (default: the model), so two vLLM instances of the same model
and block size that use one cache directory (one after the other, or at once through a
shared ``remote`` tier) find each other's blocks.

Per request:

- ``lookup`` (vLLM's ``get_num_new_matched_tokens``, side-effect free apart from the
  engine's lookup counters): the deepest checkpoint worth restoring past the GPU hit,
  never the request's last token.
- ``allocated`` (``update_state_after_alloc``): the retention rule sees the request
  once; a load pins the match and starts the restore at once on a loader thread, so
  it runs while the step is scheduled and sent to the workers.
- ``build_meta``: the step's loads, and one save job per request whose blocks fill in
  this step (``checkpoint_blocks`` adds checkpoints inside it; the retention rule's
  admission limit cuts it), refused while more than ``staging_bytes`` wait in staging.
- ``worker_report`` (``update_connector_output``): a save every rank staged is stored by
  the store thread (in job order: a request's checkpoints build on each other); a load
  every rank finished has its staging removed.
"""

from __future__ import annotations

import contextlib
import threading
from collections import Counter
from concurrent import futures
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from prefixstore.adapters.vllm_options import ConnectorOptions
from prefixstore.adapters.vllm_staging import LoadJob, SaveJob, Staging
from prefixstore.base.errors import InvalidInputError, PrefixStoreError
from prefixstore.base.keys import Prefix
from prefixstore.base.layout import Layout
from prefixstore.base.log import log
from prefixstore.engine.api import Engine
from prefixstore.engine.results import Match
from prefixstore.statemachine.admission import RetentionAdmission

LOADER_THREADS = 2


def checkpoint_positions(base: int, limit: int, every: int) -> list[int]:
    """Block positions to checkpoint past ``base`` up to ``limit``: every multiple of
    ``every`` (when > 0) and ``limit`` itself (as ``prefixstore replay`` does)."""
    if limit <= base:
        return []
    out = list(range((base // every + 1) * every, limit, every)) if every else []
    out.append(limit)
    return out


@dataclass
class _Save:
    req_id: str
    prefix: Prefix
    base: int
    positions: list[int]
    nbytes: int
    reported: int = 0
    ok: bool = True


@dataclass
class _Load:
    req_id: str
    first: int
    block_ids: list[int]
    reported: int = 0


class SchedulerSide:
    """The engine and the ledger of jobs in flight (see the module docstring)."""

    def __init__(self, options: ConnectorOptions, layout: Layout, hash_block_size: int,
                 identity: dict[str, str] | None = None) -> None:
        self.options, self.layout = options, layout
        self.bs, self.ranks = layout.block_tokens, layout.ranks
        if self.bs % hash_block_size:
            raise InvalidInputError(f"block size {self.bs} is not a multiple of vLLM's hash block size "
                                    f"{hash_block_size}")
        self.hash_step = self.bs // hash_block_size
        engine_opts = dict(options.engine)
        self.admission: RetentionAdmission | None = None
        if options.retention and engine_opts.get("policy", "prefixstore") == "prefixstore":
            row = layout.ranks * layout.token_bytes * self.bs
            self.admission = RetentionAdmission(max(1, options.capacity_bytes // max(1, row)))
            engine_opts["admission"] = self.admission
        if identity is not None:
            engine_opts["identity"] = identity
        self.engine = Engine.open(options.dir, layout, options.capacity_bytes, **engine_opts)
        self.staging = Staging(options.staging_root, layout)
        self.staging.reset()
        self.loader = ThreadPoolExecutor(max_workers=LOADER_THREADS, thread_name_prefix="prefixstore-restore")
        self.storer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="prefixstore-store")
        self.requests: dict[str, Any] = {}
        self.digests: dict[str, list[bytes]] = {}
        self.memo: dict[str, tuple[int, Match | None]] = {}
        self.saved_upto: dict[str, int] = {}
        self.done_saving: set[str] = set()
        self.observed: set[str] = set()
        self.pending_loads: list[LoadJob] = []
        self.loads: dict[int, _Load] = {}
        self.saves: dict[int, _Save] = {}
        self.staged_bytes = 0
        self.next_job = 1
        self.counters: Counter[str] = Counter()
        self.inflight: set[Future] = set()
        self.lock = threading.Lock()  # staged_bytes, counters, inflight (the store and loader threads)

    # ------------------------------------------------------------------ vLLM's calls

    def lookup(self, request: Any, num_computed_tokens: int) -> int:
        """Tokens past ``num_computed_tokens`` (block-aligned) the cache can load."""
        gpu = num_computed_tokens // self.bs
        digests = self._digests(request)
        blocks = min((request.num_tokens - 1) // self.bs, len(digests))
        if blocks <= gpu:
            self.memo[request.request_id] = (num_computed_tokens, None)
            return 0
        try:
            m = self.engine.lookup(Prefix(digests[:blocks], self.bs), gpu_blocks=gpu,
                                   total_tokens=request.num_tokens)
        except PrefixStoreError as exc:  # the cache is unusable now: a miss, vLLM computes
            log.warning("vllm_lookup_failed", req=request.request_id, error=str(exc))
            m = None
        self.memo[request.request_id] = (num_computed_tokens, m)
        return (m.blocks - gpu) * self.bs if m is not None and m.hit else 0

    def allocated(self, request: Any, block_ids: list[int], num_external_tokens: int) -> None:
        req = request.request_id
        self.requests[req] = request
        local, m = self.memo.pop(req, (0, None))
        gpu = local // self.bs
        digests = self._digests(request)
        if self.admission is not None and req not in self.observed:
            self.observed.add(req)
            self.admission.observe(Prefix(digests, self.bs).keys, (local + num_external_tokens) // self.bs)
        self.saved_upto[req] = self._stored_depth(m, gpu, num_external_tokens)
        if num_external_tokens <= 0:
            return
        n = num_external_tokens // self.bs
        job = self._new_job()
        ids = list(block_ids[gpu:gpu + n])
        self.loads[job] = _Load(req, gpu, ids)
        self.pending_loads.append(LoadJob(job, req, ids))
        try:
            if m is None or not m.hit or m.blocks < gpu + n:
                self.staging.write_status(job, 0, "no match to restore")
                return
            self._count("loads")
            pinned = self.engine.pin(m)
        except (PrefixStoreError, OSError) as exc:  # never into vLLM's scheduler: the workers time out
            log.warning("vllm_load_not_started", job=job, req=req, error=str(exc))
            return
        self._submit(self.loader, self._restore, job, m, pinned, Prefix(digests[:gpu + n], self.bs), gpu, n)

    def build_meta(self, num_scheduled_tokens: dict[str, int], block_ids_of: Any) -> tuple[list[LoadJob], list[SaveJob]]:
        """The step's loads and saves; ``block_ids_of(req_id)`` gives a request's block table."""
        loads, self.pending_loads = self.pending_loads, []
        saves = []
        for req, n in num_scheduled_tokens.items():
            job = self._plan_save(req, n, block_ids_of)
            if job is not None:
                saves.append(job)
        return loads, saves

    def worker_report(self, report: dict[str, dict[int, int]] | None, invalid_block_ids: set[int]) -> None:
        """Counts of ranks that staged (``saved``), failed to stage (``failed``) or
        finished loading (``loaded``) each job, summed over the workers of a step; and
        the blocks the workers could not load (vLLM recomputes them, and the request's
        saves start again at the first, so the checkpoint that failed is stored anew)."""
        if invalid_block_ids:
            self._reload_from(invalid_block_ids)
        if not report:
            return
        for kind in ("saved", "failed"):
            for job, n in report.get(kind, {}).items():
                s = self.saves.get(job)
                if s is None:
                    continue
                s.reported += n
                s.ok = s.ok and kind == "saved"
                if s.reported >= self.ranks:
                    del self.saves[job]
                    self._submit(self.storer, self._store, job, s)
        for job, n in report.get("loaded", {}).items():
            ld = self.loads.get(job)
            if ld is None:
                continue
            ld.reported += n
            if ld.reported >= self.ranks:
                del self.loads[job]
                self.staging.remove(self.staging.status_file(job),
                                    *(self.staging.load_file(job, r) for r in range(self.ranks)))

    def finished(self, req: str) -> None:
        """A request ended (finished or aborted): forget it. Its jobs in flight finish on
        their own (their blocks stay valid until the step that carries them ends)."""
        for d in (self.requests, self.digests, self.memo, self.saved_upto):
            d.pop(req, None)
        self.done_saving.discard(req)
        self.observed.discard(req)

    def stats(self) -> dict[str, Any]:
        """The connector's counters (``connector``) beside the engine's ``stats()``."""
        with self.lock:
            counters = dict(self.counters)
            counters["staged_bytes"] = self.staged_bytes
        return {"connector": counters, "engine": self.engine.stats()}

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every restore and store queued so far has finished; False when
        ``timeout`` seconds passed first."""
        with self.lock:
            pending = list(self.inflight)
        return not futures.wait(pending, timeout).not_done

    def close(self) -> None:
        """Finish queued restores and stores, then close the engine."""
        self.loader.shutdown(wait=True)
        self.storer.shutdown(wait=True)
        self.engine.close()

    # ------------------------------------------------------------------ internals

    def _digests(self, request: Any) -> list[bytes]:
        """The request's block digests so far (one per ``block_size`` tokens)."""
        have = self.digests.setdefault(request.request_id, [])
        hashes = request.block_hashes
        for i in range(len(have), len(hashes) // self.hash_step):
            have.append(self.options.digest(hashes[(i + 1) * self.hash_step - 1]))
        return have

    @staticmethod
    def _stored_depth(m: Match | None, gpu: int, external: int) -> int:
        """Blocks of the request the cache is known to hold: saves start there (a
        local GPU hit the cache lacks is saved again, so later checkpoints can hang on it)."""
        if external > 0 and m is not None:
            return m.blocks
        if m is None:
            return gpu
        if m.outcome == "gpu_resident":
            return min(m.blocks, gpu)
        return gpu if m.outcome == "rejected_cost" else 0

    def _submit(self, pool: ThreadPoolExecutor, fn: Any, *args: Any) -> None:
        fut = pool.submit(fn, *args)
        with self.lock:
            self.inflight.add(fut)
        fut.add_done_callback(self._settled)

    def _settled(self, fut: Future) -> None:
        with self.lock:
            self.inflight.discard(fut)

    def _reload_from(self, invalid: set[int]) -> None:
        for ld in self.loads.values():
            bad = [i for i, b in enumerate(ld.block_ids) if b in invalid]
            if bad and ld.req_id in self.saved_upto:
                self.saved_upto[ld.req_id] = min(self.saved_upto[ld.req_id], ld.first + bad[0])
                self.done_saving.discard(ld.req_id)
                self._count("loads_recomputed_blocks", len(ld.block_ids) - bad[0])

    def _new_job(self) -> int:
        job, self.next_job = self.next_job, self.next_job + 1
        return job

    def _count(self, key: str, n: int = 1) -> None:
        with self.lock:
            self.counters[key] += n

    def _plan_save(self, req: str, scheduled: int, block_ids_of: Any) -> SaveJob | None:
        request = self.requests.get(req)
        if request is None or req in self.done_saving:
            return None
        digests = self._digests(request)
        end = min((request.num_computed_tokens + scheduled) // self.bs, len(digests))
        base = self.saved_upto.get(req, request.num_computed_tokens // self.bs)
        if end <= base:
            return None
        prefix = Prefix(digests[:end], self.bs)
        limit = end if self.admission is None else self.admission.admit_limit(prefix.keys, base, end)
        if limit < end:
            self.done_saving.add(req)  # the retention rule stops this request's checkpoints here
        positions = checkpoint_positions(base, limit, self.options.checkpoint_blocks)
        if not positions:
            return None
        nbytes = self.ranks * self.staging.nbytes((limit - base) * self.bs)
        with self.lock:
            if self.staged_bytes + nbytes > self.options.staging_bytes:
                self.counters["saves_skipped_staging_full"] += 1
                self.done_saving.add(req)  # later blocks could not hang on the ones skipped
                return None
            self.staged_bytes += nbytes
        table = block_ids_of(req)
        job = self._new_job()
        self.saves[job] = _Save(req, prefix[:limit], base, positions, nbytes)
        self.saved_upto[req] = limit
        return SaveJob(job, req, list(table[base:limit]))

    def _store(self, job: int, s: _Save) -> None:
        """Store a save every rank staged: one engine store per checkpoint position."""
        files = [self.staging.save_file(job, r) for r in range(self.ranks)]
        tokens = (s.positions[-1] - s.base) * self.bs
        try:
            if not s.ok:
                self._count("saves_failed_staging")
                return
            staged = [self.staging.views(self.staging.open(f, tokens), tokens) for f in files]
            for p in s.positions:
                rows = (p - s.base) * self.bs
                res = self.engine.store(s.prefix[:p], [{k: v[:rows] for k, v in d.items()} for d in staged],
                                        tokens_from=s.base * self.bs)
                self._count(f"stores_{res.status}")
                if not res.ok and res.reason != "inside_span":
                    break
        except (PrefixStoreError, OSError) as exc:
            self._count("stores_error")
            log.warning("vllm_store_failed", job=job, req=s.req_id, error=str(exc))
        finally:
            self.staging.remove(*files)
            with self.lock:
                self.staged_bytes -= s.nbytes

    def _restore(self, job: int, m: Match, pinned: bool, prefix: Prefix, first: int, n: int) -> None:
        """Restore (verifying every shard of every rank) into the load files, then
        publish the status: how many of the ``n`` blocks from block ``first`` it holds.
        A damaged node makes the engine answer a shallower match, which still serves
        the blocks above the damage."""
        blocks, error = 0, None
        try:
            r = self.engine.restore(m)
            if r is None:
                self._count("loads_damaged_or_stale")
                again = self.engine.lookup(prefix, gpu_blocks=first)
                r = self.engine.restore(again) if again.hit else None
            if r is not None:
                blocks = max(0, min(n, r.match.blocks - first))
                off = first * self.bs - r.start_tokens
                for rank in range(self.ranks):
                    rows = {k: v[off:off + blocks * self.bs] for k, v in r.segments[rank].items()}
                    self.staging.write(self.staging.load_file(job, rank), rows, blocks * self.bs)
            self._count("loads_blocks", blocks)
            self._count("loads_blocks_missing", n - blocks)
        except (PrefixStoreError, OSError) as exc:
            blocks, error = 0, str(exc)
            log.warning("vllm_restore_failed", job=job, error=error)
        finally:
            try:
                self.staging.write_status(job, blocks, error)
            finally:
                if pinned:
                    with contextlib.suppress(PrefixStoreError):  # closed meanwhile: its pins went with it
                        self.engine.unpin(m)
