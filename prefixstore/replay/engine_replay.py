"""Replay a Mooncake-format request trace on the real engine (catalog, journal, files).

Per request (``hash_ids`` of 512-token blocks, ``input_length`` tokens):

1. **Lookup** ``Prefix.from_ids(hash_ids)``: the deepest ready checkpoint. Its blocks
   are the request's hit (tokens: ``min(hit * 512, input_length)``).
2. **Restore** it when it is a hit, and check the restored rows are the bytes stored
   for those blocks (a stale match, evicted meanwhile by another session, counts as a
   miss).
3. **Store** the request's checkpoint(s) past the hit: at its last *full* block (an
   engine cannot checkpoint inside a block; the next turn re-hashes a partial last
   block anyway), and with ``checkpoint_every=K`` also at every multiple of ``K``
   blocks in between. The engine evicts whole nodes, so ``K`` is the eviction
   granularity along a request. A later request diverging inside a node's span makes
   the engine split it (``engine/spans.py``), so the tree follows the trace's branch
   points; but that request itself only hits up to the node's start (a lookup stops
   at a checkpoint), so ``K`` also bounds what such a request loses.

   Measured on the whole Mooncake trace (share of the optimum's block hits, ours /
   leaf-lru; files: stores and nodes left; wall: one replay, loaded 2-core machine):

   =====  ===============  ===============  ===============  ========  ======
   K      5%               10%              25%              files     wall
   =====  ===============  ===============  ===============  ========  ======
   0      0.608 / 0.523    0.776 / 0.737    0.928 / 0.927    1x        1x
   8      0.619 / 0.545    0.795 / 0.763    0.953 / 0.952    ~2.2x     ~2-3x
   4      0.624 / 0.547    .                0.957 / 0.958    ~3.5x     ~4x
   =====  ===============  ===============  ===============  ========  ======

   At 25% with ``K=0`` nearly all the gap to the simulator (0.965) is those
   divergences (leaf-lru: 3,989 of the 4,030 block hits it lacks). ``K=8`` is the default: within 5% of the
   optimum at 25% for about twice the files and time of ``K=0``.

Policies: ``leaf-lru``, ``lru`` and ``prefixstore`` are the engine's
(``statemachine/policy.py``). For ``prefixstore`` the replay also plugs in the
simulator's retention and admission, ported as
``statemachine.admission.RetentionAdmission``: the request is ``observe``d after its
lookup, its checkpoints stop at ``admit_limit`` and the engine's admission hook and
leaf order use the same object (``retention=False`` runs the engine's plain policy).

Scale. Tensor bytes are scaled down so a whole trace fits in a few hundred MiB of
files: a token is ``token_bytes`` (16) file bytes standing for ``token_bytes *
byte_scale`` modeled bytes (64 KiB: 32 MiB per 512-token block, the simulator's
``DEFAULT_BLOCK_BYTES``). Capacities and byte counts are reported in modeled bytes
(file bytes x ``byte_scale``); ``capacity`` is a size in modeled bytes (``64GiB``) or a
share of the trace's unique modeled bytes (``10%``). Each shard file also carries a
~230-byte header (about 3% of a one-block node, 0.2% of a typical one): it is charged
like any byte, so the engine holds slightly fewer blocks than the simulator at the
same capacity.

Modeled time. Nothing runs a model: with the cost model of ``statemachine/cost.py``
(prefill ``a*t + b*t**2``, the simulator's curve; restore bandwidth
``bandwidth_bytes_per_s`` of modeled bytes, a host-RAM tier), a request's time to first
token is the restore's transfer estimate plus the prefill of its uncached tokens; a
hit of ``h`` tokens saves ``prefill_s(h)``.

Concurrency: ``concurrency`` sessions (threads) take requests from one shared queue
in trace order, so up to ``concurrency - 1`` later requests may be served before a
request has stored its checkpoint (a real server's overlap).
"""

from __future__ import annotations

import os
import shutil
import statistics
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from contextlib import ExitStack
from typing import Any

import attrs
import torch

from prefixstore.base.errors import InvalidInputError
from prefixstore.base.keys import Prefix
from prefixstore.base.layout import Layout, TensorSpec
from prefixstore.engine.api import Engine
from prefixstore.engine.results import FAILED, REFUSED, SKIPPED
from prefixstore.replay.sim import PREFILL_A, PREFILL_B
from prefixstore.replay.trace import BLOCK_TOKENS, Request, parse_capacity, unique_blocks
from prefixstore.statemachine.admission import RetentionAdmission
from prefixstore.statemachine.cost import CostModel
from prefixstore.statemachine.policy import DEFAULT, policy_named, takes_retention

TOKEN_BYTES = 16
"""File bytes per token (one uint8 segment tensor of width 16, one rank)."""
BYTE_SCALE = 4096
"""Modeled bytes per file byte: 16 x 4096 = 64 KiB per token, 32 MiB per block."""
_PERIOD = 65521  # distinct block contents (a prime): block id -> offset into one buffer


@attrs.frozen
class ReplayConfig:
    """What to replay and how (sizes in modeled bytes unless said otherwise)."""

    policy: str = DEFAULT
    capacity: str | int = "10%"
    concurrency: int = 1
    checkpoint_every: int = 8
    """Also checkpoint at every multiple of this many blocks (0: only the last full block)."""
    retention: bool = True
    """For ``prefixstore``: plug in the ported retention and admission."""
    tuning: tuple[tuple[str, float], ...] = ()
    """Keyword arguments for ``RetentionAdmission`` (e.g. ``(("theta", 2.0),)``)."""
    token_bytes: int = TOKEN_BYTES
    byte_scale: int = BYTE_SCALE
    block_tokens: int = BLOCK_TOKENS
    synchronous: str = "NORMAL"
    bandwidth_bytes_per_s: float = 20e9
    prefill_s_per_token: float = PREFILL_A
    prefill_s_per_token2: float = PREFILL_B
    verify: bool = True
    samples: int = 200
    """Capacity samples taken over the run (for the plots)."""
    instances: int = 1
    """Engine instances the requests go to round-robin (a load balancer without prefix-aware
    routing), each with ``capacity`` of its own, in ``DIR/iK`` when more than one."""
    remote: str | None = None
    """A shared remote tier's URL (``redis://...``, ``mooncake://...``) every instance uses, if any."""
    remote_namespace: str = "replay"

    def __attrs_post_init__(self) -> None:
        policy_named(self.policy)  # InvalidInputError naming the registered ones
        if not 1 <= self.concurrency <= 256:
            raise InvalidInputError(f"concurrency must be 1..256, got {self.concurrency}")
        if self.checkpoint_every < 0:
            raise InvalidInputError(f"checkpoint_every must be >= 0, got {self.checkpoint_every}")
        if self.token_bytes < 1 or self.byte_scale < 1 or self.block_tokens < 1:
            raise InvalidInputError("token_bytes, byte_scale and block_tokens must be positive")
        if self.bandwidth_bytes_per_s <= 0:
            raise InvalidInputError("bandwidth must be positive")
        if not 1 <= self.instances <= 64:
            raise InvalidInputError(f"instances must be 1..64, got {self.instances}")

    @property
    def block_bytes_modeled(self) -> int:
        return self.block_tokens * self.token_bytes * self.byte_scale

    def layout(self) -> Layout:
        return Layout(segments=[TensorSpec("kv", "uint8", (self.token_bytes,))], block_tokens=self.block_tokens)

    def cost(self) -> CostModel:
        """The cost model in file bytes (its estimates: modeled seconds)."""
        return CostModel(
            bandwidth_bytes_per_s=self.bandwidth_bytes_per_s / self.byte_scale,
            prefill_s_per_token=self.prefill_s_per_token,
            prefill_s_per_token2=self.prefill_s_per_token2,
        )


@attrs.define
class Timeline:
    """Per-request records (trace order) and capacity samples, for plots."""

    timestamps_ms: list[int]
    blocks: list[int]
    hit_blocks: list[int]
    tokens: list[int]
    hit_tokens: list[int]
    ttft_s: list[float]
    samples: list[tuple[int, int, int]] = attrs.field(factory=list)
    """(requests done, charged modeled bytes, nodes)."""


@attrs.define
class ReplayReport:
    summary: dict[str, Any]
    timeline: Timeline


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (inclusive method; 0 for no values)."""
    if not values:
        return 0.0
    if len(values) == 1:
        return float(values[0])
    return statistics.quantiles(values, n=100, method="inclusive")[int(q) - 1]


def checkpoint_positions(hit: int, limit: int, every: int) -> list[int]:
    """Block positions to checkpoint past ``hit`` up to ``limit``: every multiple of
    ``every`` (when > 0) and ``limit`` itself."""
    if limit <= hit:
        return []
    out = list(range((hit // every + 1) * every, limit, every)) if every else []
    out.append(limit)
    return out


def default_root() -> str:
    """A new temp dir, on tmpfs (/dev/shm) when there is one: fsync is then free and
    the replay measures the engine and its policy, not the disk."""
    shm = "/dev/shm"
    base = shm if os.path.isdir(shm) and os.access(shm, os.W_OK) else None
    return tempfile.mkdtemp(prefix="prefixstore-replay-", dir=base)


class _Blocks:
    """Deterministic rows per block id: a window of one random buffer."""

    def __init__(self, block_tokens: int, width: int) -> None:
        self.bt, self.width = block_tokens, width
        self.n = block_tokens * width
        g = torch.Generator().manual_seed(8)
        self.base = torch.randint(0, 256, (self.n + _PERIOD,), generator=g, dtype=torch.uint8)

    def rows(self, ids: Sequence[int]) -> torch.Tensor:
        if not ids:
            return torch.empty((0, self.width), dtype=torch.uint8)
        parts = [self.base[(h % _PERIOD) : (h % _PERIOD) + self.n] for h in ids]
        return torch.cat(parts).view(len(ids) * self.bt, self.width)


def capacity_of(cfg: ReplayConfig, requests: Sequence[Request], unique: int | None = None) -> dict[str, int]:
    """The capacity in modeled bytes, file bytes and whole blocks, and the trace's unique blocks."""
    if unique is None:
        unique = unique_blocks(requests)
    total = unique * cfg.block_bytes_modeled
    modeled = parse_capacity(cfg.capacity, total)
    return {
        "unique_blocks": unique,
        "unique_bytes_modeled": total,
        "capacity_bytes_modeled": modeled,
        "capacity_bytes_files": modeled // cfg.byte_scale,
        "capacity_blocks": modeled // cfg.block_bytes_modeled,
    }


def replay(
    requests: Sequence[Request],
    cfg: ReplayConfig,
    root: str | None = None,
    *,
    unique: int | None = None,
    progress: Callable[[dict[str, Any]], None] | None = None,
    keep: bool | None = None,
) -> ReplayReport:
    """Replay ``requests`` on a new engine in ``root`` (new or empty; default a temp
    dir, removed afterwards unless ``keep``). ``progress`` is called about twice a
    second from the calling thread with the counts so far."""
    if not requests:
        raise InvalidInputError("no requests to replay")
    cap = capacity_of(cfg, requests, unique)
    if cap["capacity_bytes_files"] <= 0:
        raise InvalidInputError(f"capacity {cfg.capacity!r} is too small")
    made = root is None
    if root is None:
        root = default_root()
    elif os.path.isdir(root) and os.listdir(root):
        raise InvalidInputError(f"{root} is not empty: a replay starts from an empty tier")
    keep = (not made) if keep is None else keep
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # small tensors: intra-op threads only contend on 2 cores
    try:
        return _Run(requests, cfg, root, cap, progress).run()
    finally:
        torch.set_num_threads(threads)
        if not keep:
            shutil.rmtree(root, ignore_errors=True)


class _Run:
    """One replay: the engine, the worker sessions and the tallies."""

    def __init__(self, requests, cfg: ReplayConfig, root: str, cap: dict[str, int], progress) -> None:
        self.requests = requests
        self.cfg = cfg
        self.root = root
        self.cap = cap
        self.progress = progress
        self.model = cfg.cost()
        self.blocks = _Blocks(cfg.block_tokens, cfg.token_bytes)
        n = len(requests)
        self.timeline = Timeline(
            [r.timestamp_ms for r in requests], [r.blocks for r in requests], [0] * n,
            [r.input_length for r in requests], [0] * n, [0.0] * n,
        )
        self.lock = threading.Lock()
        self.next = 0
        self.done = 0
        self.hit_blocks = 0
        self.seen_blocks = 0
        self.stores: Counter[str] = Counter()
        self.tally: Counter[str] = Counter()
        self.error: BaseException | None = None
        self.sample_every = max(1, n // max(1, cfg.samples))
        self.adm: RetentionAdmission | None = None
        self.adms: list[RetentionAdmission | None] = [None] * cfg.instances
        self.engines: list[Engine] = []

    # ------------------------------------------------------------------ driver

    def open_engines(self, stack: ExitStack) -> None:
        """The engine instances (each with its admission, if any) and their shared remote."""
        cfg = self.cfg
        for k in range(cfg.instances):
            if takes_retention(cfg.policy) and cfg.retention:
                self.adms[k] = RetentionAdmission(max(1, self.cap["capacity_blocks"]), **dict(cfg.tuning))
            root = self.root if cfg.instances == 1 else os.path.join(self.root, f"i{k}")
            remote = {} if cfg.remote is None else {
                "remote": cfg.remote, "remote_options": {"namespace": cfg.remote_namespace}}
            eng = stack.enter_context(Engine.open(
                root, cfg.layout(), self.cap["capacity_bytes_files"], synchronous=cfg.synchronous,
                policy=cfg.policy, cost=self.model, admission=self.adms[k], **remote,
            ))
            self.engines.append(eng)
        self.adm = self.adms[0]
        self.eng = self.engines[0]

    def run(self) -> ReplayReport:
        cfg = self.cfg
        t0 = time.perf_counter()
        with ExitStack() as stack:
            self.open_engines(stack)
            workers = [
                threading.Thread(target=self._worker, name=f"session-{i}", daemon=True)
                for i in range(cfg.concurrency)
            ]
            for w in workers:
                w.start()
            while alive := [w for w in workers if w.is_alive()]:
                alive[0].join(0.5)
                if self.progress is not None:
                    self.progress(self._snapshot(t0))
            if self.error is not None:
                raise self.error
            wall = time.perf_counter() - t0
            stats = [e.stats() for e in self.engines]
            audit = [e.audit() for e in self.engines]
        if self.progress is not None:
            self.progress({**self._snapshot(t0), "final": True})
        return ReplayReport(self._summary(wall, stats, audit), self.timeline)

    def _snapshot(self, t0: float) -> dict[str, Any]:
        with self.lock:
            return {
                "policy": self.cfg.policy, "done": self.done, "total": len(self.requests),
                "hit_blocks": self.hit_blocks, "blocks": self.seen_blocks,
                "elapsed_s": time.perf_counter() - t0,
                "charged_bytes_modeled": self._gauge("charged_bytes") * self.cfg.byte_scale,
                "capacity_bytes_modeled": self.cap["capacity_bytes_modeled"],
            }

    def _gauge(self, kind: str) -> int:
        """The engines' ``prefixstore_state{kind}``, summed (read from the watched values:
        a registry lookup collects every metric, ~1 ms a sample)."""
        return sum(int(e.counters.live(kind)) for e in self.engines)

    def _worker(self) -> None:
        try:
            while self.error is None:
                with self.lock:
                    i = self.next
                    if i >= len(self.requests):
                        return
                    self.next += 1
                self._serve(i)
        except BaseException as exc:  # surfaced by run()
            with self.lock:
                self.error = self.error or exc

    # ------------------------------------------------------------------ one request

    def _serve(self, i: int) -> None:
        cfg, eng, adm = self.cfg, self.engines[i % self.cfg.instances], self.adms[i % self.cfg.instances]
        bt = cfg.block_tokens
        req = self.requests[i]
        prefix = Prefix.from_ids(req.hash_ids, bt)
        full = min(req.input_length // bt, len(prefix))
        m = eng.lookup(prefix, total_tokens=req.input_length)
        hit = m.blocks if m.hit else 0
        limit = full
        if adm is not None:
            adm.observe(prefix.keys, hit)
            limit = adm.admit_limit(prefix.keys, hit, full)
        positions = checkpoint_positions(hit, limit, cfg.checkpoint_every)
        rows = self.blocks.rows(req.hash_ids[: max(hit, limit)])
        transfer = 0.0
        tally: Counter[str] = Counter()
        tally[f"lookup.{m.outcome}"] += 1
        if m.hit:
            r = eng.restore(m)
            if r is None:
                tally["restore.stale"] += 1
                hit = 0
            else:
                hit = r.match.blocks  # a remote miss falls back to the local tiers' shallower hit
                tally["restore.ok"] += 1
                tally[f"restore.from_{r.match.source}"] += 1
                if cfg.verify and not torch.equal(r.segments[0]["kv"], rows[: hit * bt]):
                    tally["restore.wrong_bytes"] += 1
                transfer = m.transfer_s or 0.0
        if limit < full:
            tally["admission.limited"] += 1
        for p in positions:
            res = eng.store(prefix if p == len(prefix) else prefix[:p], {"kv": rows[: p * bt]})
            key = res.status if res.status not in (SKIPPED, REFUSED) else f"{res.status}.{res.reason}"
            tally[f"store.{key}"] += 1
            if res.status in (REFUSED, FAILED) or (res.status == SKIPPED and res.reason == "admission"):
                break
        hit_tokens = min(hit * bt, req.input_length)
        ttft = transfer + self.model.prefill_cost_between(hit_tokens, req.input_length)
        tl = self.timeline
        tl.hit_blocks[i], tl.hit_tokens[i], tl.ttft_s[i] = hit, hit_tokens, ttft
        with self.lock:
            self.tally.update(tally)
            self.hit_blocks += hit
            self.seen_blocks += req.blocks
            self.done += 1
            sample = self.done % self.sample_every == 0 or self.done == len(self.requests)
            done = self.done
        if sample:
            charged = self._gauge("charged_bytes") * cfg.byte_scale
            with self.lock:
                tl.samples.append((done, charged, self._gauge("nodes")))

    # ------------------------------------------------------------------ report

    def _summary(self, wall: float, each: list[dict[str, Any]], audits: list) -> dict[str, Any]:
        cfg, tl = self.cfg, self.timeline
        counters: Counter[str] = Counter()
        for s in each:
            counters.update(s["counters"])
        stats = {"nodes": sum(s["nodes"] for s in each), "charged_bytes": sum(s["charged_bytes"] for s in each),
                 "counters": dict(counters)}
        violations = [v for a in audits for v in a.violations]
        blocks_total, tokens_total = sum(tl.blocks), sum(tl.tokens)
        blocks_hit, tokens_hit = sum(tl.hit_blocks), sum(tl.hit_tokens)
        pf = self.model.prefill_s
        prefill_total = sum(pf(t) for t in tl.tokens)
        prefill_saved = sum(pf(t) for t in tl.hit_tokens)
        tl.samples.sort()
        t = self.tally
        out: dict[str, Any] = {
            "policy": cfg.policy,
            "engine": True,
            "retention": bool(self.adm is not None),
            "requests": len(self.requests),
            "concurrency": cfg.concurrency,
            "checkpoint_every": cfg.checkpoint_every,
            "capacity": str(cfg.capacity),
            **self.cap,
            "byte_scale": cfg.byte_scale,
            "token_bytes_files": cfg.token_bytes,
            "blocks_total": blocks_total,
            "blocks_hit": blocks_hit,
            "hit_ratio_blocks": blocks_hit / blocks_total if blocks_total else 0.0,
            "tokens_total": tokens_total,
            "tokens_hit": tokens_hit,
            "hit_ratio_tokens": tokens_hit / tokens_total if tokens_total else 0.0,
            "prefill_s_total": prefill_total,
            "prefill_s_saved": prefill_saved,
            "ttft_s_p50": percentile(tl.ttft_s, 50),
            "ttft_s_p99": percentile(tl.ttft_s, 99),
            "ttft_s_mean": sum(tl.ttft_s) / len(tl.ttft_s),
            "restores": t["restore.ok"],
            "restores_stale": t["restore.stale"],
            "wrong_bytes": t["restore.wrong_bytes"],
            "stores": {k.removeprefix("store."): v for k, v in sorted(t.items()) if k.startswith("store.")},
            "lookups": {k.removeprefix("lookup."): v for k, v in sorted(t.items()) if k.startswith("lookup.")},
            "admission_limited": t["admission.limited"],
            "nodes": stats["nodes"],
            "charged_bytes_modeled": stats["charged_bytes"] * cfg.byte_scale,
            "charged_bytes_files": stats["charged_bytes"],
            "audit_ok": all(a.ok for a in audits),
            "audit_violations": [v.to_dict() for v in violations][:20],
            "instances": cfg.instances,
            "restores_remote": t["restore.from_remote"],
            "remote": each[0]["remote"] and {
                k: sum(s["remote"][k] for s in each) for k in each[0]["remote"] if k != "url"},
            "wall_s": wall,
            "requests_per_s": len(self.requests) / wall if wall > 0 else 0.0,
            "directory": self.root,
            "counters": stats["counters"],
        }
        if self.adm is not None:
            out["admission"] = self.adm.stats()
        return out
