"""The fuzz driver: one cache directory under faults, driven op by op through the
public API, with every invariant checked after every op and every recovery.

An *op* is a JSON-able dict, so a run is a list that replays exactly (the campaign's
reproducers, the Hypothesis machines and the pinned regressions all feed ``apply``)::

    {"op": "store", "seq": 2, "blocks": 5,            # what
     "faults": [{"op": "write", "err": "EIO", "rank": 1, "at": 1, "persistent": false}],
     "crash": {"lane": "commit", "n": 3,              # process death at effect point n
               "power": "drop", "snap": 0.5,          # then power loss (lost commits: snap)
               "again": {"lane": 0, "n": 2},          # then a crash during recovery
               "rfaults": [...]}}                     # faults armed during recovery

Ops: store, store_async, restore, evict, evict_key, pin, unpin, reclaim, retry,
compact (when the engine has one), damage (at rest), reopen, power (idle power loss),
rank_down (every op of one rank fails for the next ``ops`` ops). Faults and crashes
attach to any op. With ``rank_servers`` or ``remote`` in the config the run has real
servers (``cluster.py``): the highest ranks served by rank server processes, a
``redis-server`` behind the remote tier, and the ops that kill, stop, power off,
flush and damage them (``CLUSTER_OPS``); faults and crash lanes then reach the local
ranks only (a rank server's effects happen in its own process).

``store_async`` overwrites the caller's tensors once the ticket says the copies are
done, then waits for the ticket's result and for the engine's workers to be idle. Its
result is its acknowledgement, with a sync store's meaning: an acknowledged store is
as durable as one ``store`` acknowledged under the same synchronous mode (kept through
any crash, lost only with commits a power loss may take under NORMAL); one whose
result never came (the engine died in its commit worker) may be there or not, and is
then checked like any row the durable catalog holds.

Crash points are counted in one *lane* (the catalog's commits, or one rank's file
effects) so that a run replays exactly although ranks write in parallel threads.

Checks (``Violation.kind`` in brackets):

- after every op: ``engine.audit()`` with checksums is clean, except invariant-1
  findings on nodes whose files this driver damaged at rest [audit:N]; every
  acknowledged store not removed since by a committed eviction is in the catalog
  [lost] and ready unless damaged at rest [damaged]; no commit but an evicting or
  compacting one removed a node [removal]; pinned nodes keep their row and generation
  [pin]; charged bytes <= capacity [capacity]; no public call raised anything but a
  typed error it may raise [exception].
- on every transition of a journaled transaction: the engine driver's per-state
  invariants hold (``PREFIXSTORE_DEBUG_INVARIANTS``, on unless the environment turns
  it off) [invariant].
- on every restore: the bytes are exactly the universe's (stored) bytes [bytes]; a
  checkpoint that must be restorable (acknowledged, ready, undamaged path, no fault
  armed) is restored at its full depth [miss].
- after every recovery: every node the durable catalog held is still there, ready
  unless damaged at rest [lost] / [damaged]; every acknowledged checkpoint restores
  bit-exactly [miss] / [bytes].
"""

from __future__ import annotations

import contextlib
import os
import re
import struct
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

import attrs

from prefixstore.base.errors import InvalidInputError, PinnedError, SimulatedCrash
from prefixstore.engine import journal, lifecycle
from prefixstore.engine.api import Engine
from prefixstore.engine.driver import DEBUG_ENV, InvariantViolation
from prefixstore.engine.remote import SOURCE as remote_source
from prefixstore.engine.results import Match
from prefixstore.engine.store import GROUPED_COMMITS
from prefixstore.fuzz import faultfs
from prefixstore.fuzz.cluster import Cluster
from prefixstore.fuzz.faultfs import OPS, ChainHook, CrashAt, FaultFS, FaultPlan, FaultRule
from prefixstore.fuzz.model import CatalogObserver, NodeRow, Universe, fuzz_layout
from prefixstore.gpu.fileio import FaultHook
from prefixstore.gpu.ranks import LocalRank, rank_dir_name
from prefixstore.statemachine.compaction import CompactionPolicy
from prefixstore.statemachine.policy import DEFAULT as DEFAULT_POLICY

STORE_STATUSES = frozenset({"stored", "refilled", "duplicate", "queued", "refused", "failed", "skipped"})
LOOKUP_OUTCOMES = frozenset({"hit", "gpu_resident", "miss", "rejected_cost", "damaged"})
DAMAGE = ("flip", "flip_data", "truncate", "delete", "zero")
_NODE_RE = re.compile(r"\bnode (\d+)\b")
ASYNC_WAIT_S = 60.0  # an async store's copies and commit: far beyond what a run's take
CLUSTER_OPS = frozenset({"rank_kill", "rank_power", "rank_stop", "rank_cut", "redis_kill", "redis_stop", "redis_flush",
                         "remote_damage"})


class Violation(AssertionError):
    """An invariant the engine broke. ``kind`` groups equal failures (for shrinking)."""

    def __init__(self, kind: str, detail: str) -> None:
        super().__init__(f"[{kind}] {detail}")
        self.kind = kind
        self.detail = detail


@attrs.frozen
class RunConfig:
    """What one fuzz run is made of; everything random derives from ``seed``."""

    ranks: int = 1
    snapshot: bool = True
    synchronous: str = "FULL"
    capacity: int = 6000
    policy: str = DEFAULT_POLICY
    high_watermark: float = 1.0
    low_watermark: float = 1.0
    seed: int = 0
    seqs: int = 6
    max_blocks: int = 8
    rank_servers: int = 0  # the highest ranks served by rank server processes
    remote: str = ""  # "redis": a redis-server behind the remote tier
    write_behind: bool = False  # the remote tier's writes queued (else written through)
    netns: bool = False  # each rank server on a host of its own (network namespaces; root)

    @property
    def local_ranks(self) -> int:
        """The ranks this process writes itself (where faults and crash lanes apply)."""
        return self.ranks - self.rank_servers

    def to_dict(self) -> dict[str, Any]:
        return attrs.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> RunConfig:
        names = {a.name for a in attrs.fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})


class Gate(FaultHook):
    """Forwards to ``inner`` while set: the crash hook of the op in progress."""

    def __init__(self) -> None:
        self.inner: FaultHook | None = None

    def before(self, op: str, target: str, rank: int | None) -> None:
        if self.inner is not None:
            self.inner.before(op, target, rank)

    def after(self, op: str, target: str, rank: int | None) -> None:
        if self.inner is not None:
            self.inner.after(op, target, rank)


def _overwrite(segments: list[dict[str, Any]], snapshot: list[dict[str, Any]] | None) -> None:
    """Scribble over a caller's tensors (reused device blocks): what the engine stores
    must be what it copied before it said the copies were done."""
    for d in [*segments, *(snapshot or ())]:
        for t in d.values():
            t.fill_(-7.0)


def crash_hook(spec: dict[str, Any], ranks: int) -> CrashAt:
    """The CrashAt for a crash spec: lane 'commit' counts commits, lane r rank r's effects."""
    lane = spec.get("lane", "commit")
    if lane == "commit":
        return CrashAt(int(spec["n"]), ops={"commit"})
    return CrashAt(int(spec["n"]), rank=int(lane) % ranks)


def compaction_policy(interior: bool = False) -> CompactionPolicy:
    """A compaction policy that never waits for pins (this driver is single-threaded);
    ``interior``: merge interior checkpoints away too."""
    return CompactionPolicy(pin_wait_s=0.0, keep_interior_checkpoints=not interior)


class Driver:
    """Runs ops against one cache directory and checks the reference model after each.

    ``plant`` (a ``prefixstore.fuzz.plants.Plant``) swaps in a deliberately broken
    engine. Use as a context manager, or call ``close``.
    """

    def __init__(self, cfg: RunConfig, root: str, plant: Any = None) -> None:
        os.environ.setdefault(DEBUG_ENV, "1")  # the engines it opens check their invariants
        self.cfg = cfg
        self.root = root
        self.plant = plant
        self.layout = fuzz_layout(cfg.ranks, cfg.snapshot)
        self.uni = Universe(self.layout, cfg.seed, cfg.seqs, cfg.max_blocks)
        self.keyinfo = self.uni.keys()
        self.plan = FaultPlan(seed=cfg.seed)
        self.fs = FaultFS(self.plan, seed=cfg.seed)
        self.observer = CatalogObserver(
            root, lost_commits=cfg.synchronous == "NORMAL",
            volatile=frozenset(GROUPED_COMMITS + journal.GROUPED_COMMITS) if cfg.synchronous == "FULL" else frozenset(),
            on_removed=self._removed,
        )
        self.gate = Gate()
        self.hook = ChainHook(self.observer, self.gate)
        self.must: set[bytes] = set()
        self._op_removed: set[bytes] = set()
        # key -> generations whose files were damaged at rest. Kept across evictions: a
        # lost evict commit (synchronous=NORMAL) can bring the damaged row back.
        self.harmed: dict[bytes, set[int]] = {}
        self.pins: list[Match] = []
        self.problems: list[Violation] = []
        self.counts: Counter[str] = Counter()
        self.history: list[dict[str, Any]] = []
        self.windows: list[list[Any]] = []  # [rules, ops left]
        self.eng: Engine | None = None
        self.auto_check = True  # check() after every op (the Hypothesis machines use an invariant)
        self._stack = contextlib.ExitStack()
        self.cluster: Cluster | None = None
        if plant is not None:
            self._stack.enter_context(plant.active())
        try:
            if cfg.rank_servers or cfg.remote:
                self.cluster = Cluster(cfg.ranks, cfg.rank_servers, cfg.remote, root, seed=cfg.seed,
                                       write_behind=cfg.write_behind, plant=plant, netns=cfg.netns)
                self._stack.callback(self.cluster.close)
            self._open()
            self.observer.start()
        except BaseException:
            self.close()
            raise

    # ------------------------------------------------------------------ lifecycle

    def __enter__(self) -> Driver:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Close the engine (cleanly, faults off) and undo a plant's patches."""
        try:
            if self.cluster is not None:
                self.cluster.end_all()
            if self.eng is not None and not self.eng.guard.closed:
                self._absorb(self.eng)
                with self.plan.paused():
                    self.gate.inner = None
                    self.eng.close()
            self.eng = None
            self.observer.detach()
        finally:
            self._stack.close()

    @property
    def engine_cls(self) -> type[Engine]:
        return getattr(self.plant, "engine_cls", None) or Engine

    def _open_once(self) -> None:
        opts: dict[str, Any] = dict(
            synchronous=self.cfg.synchronous, policy=self.cfg.policy, fs=self.fs, hook=self.hook,
            high_watermark=self.cfg.high_watermark, low_watermark=self.cfg.low_watermark,
        )
        if self.plant is not None and getattr(self.plant, "make_ranks", None) is not None:
            if not os.path.exists(self.observer.path):
                Engine.open(self.root, self.layout, self.cfg.capacity, **opts).close()
            opts["ranks"] = self.plant.make_ranks(self.layout, self.root, self.fs, self.hook)
        if self.cluster is not None:
            self._cluster_options(opts)
        self.eng = self.engine_cls.open(self.root, self.layout, self.cfg.capacity, **opts)

    def _cluster_options(self, opts: dict[str, Any]) -> None:
        """The served ranks (up: opening recovers every rank) and the remote tier."""
        cl = self.cluster
        assert cl is not None
        cl.end_rank_outages()
        mine = opts.get("ranks") or [
            LocalRank(r, os.path.join(self.root, rank_dir_name(r)), self.fs, self.hook)
            for r in range(self.cfg.ranks)]
        opts["ranks"] = [cl.rank(r) if cl.is_served(r) else rank for r, rank in enumerate(mine)]
        opts.update(cl.engine_options())

    def _open(self) -> None:
        """Open (recovering); an injected I/O error may fail it: then retry, faults off."""
        try:
            self._open_once()
        except OSError:
            self.counts["open_failed"] += 1
            self.eng = None
            with self.plan.paused():
                self._open_once()

    def _kill(self) -> None:
        """Process death: the engine drops its connection and lock, committing nothing."""
        eng, self.eng = self.eng, None
        if eng is not None:
            self._absorb(eng)
            if not eng.guard.closed:
                lifecycle.abandon(eng.life)
        self.pins.clear()

    def _absorb(self, eng: Engine) -> None:
        """Add an engine's own counters (evictions, retries, faults seen) to ``counts``."""
        for k, v in eng.counters.snapshot().items():
            self.counts[f"engine.{k}"] += v

    def _power_loss(self, mode: str, snap: float) -> None:
        """Rank files lose what was not durable; the catalog its commits since a barrier."""
        self.counts["power_losses"] += 1
        self.counts[f"power_loss:{mode}"] += 1
        self.fs.crash(mode)  # type: ignore[arg-type]
        if self.observer.keeps_images:
            image = self.observer.lose_commits(snap)
            if self.observer.lost_commits:  # under FULL an acknowledged store was durable
                ready = {k for k, row in image.nodes.items() if row.state == "ready"}
                self.must &= ready

    # ------------------------------------------------------------------ ops

    def apply(self, op: dict[str, Any]) -> None:
        """Run one op (with its faults and crash), recover if it crashed, then check."""
        kind = op["op"]
        handler = self._op_cluster if kind in CLUSTER_OPS else getattr(self, f"_op_{kind}", None)
        if handler is None:
            raise ValueError(f"unknown fuzz op {kind!r}")
        self.history.append(op)
        self.counts["steps"] += 1
        self.counts[f"op.{kind}"] += 1
        self._op_removed = set()
        rules = self._arm(op.get("faults", ()))
        crash = op.get("crash")
        self.gate.inner = crash_hook(crash, self.cfg.ranks) if crash else None
        crashed = False
        try:
            handler(op)
        except SimulatedCrash:
            crashed = True
        except Violation:
            raise
        except InvariantViolation as exc:
            raise Violation("invariant", f"{kind}: {exc}") from exc
        except Exception as exc:
            raise Violation("exception", f"{kind} raised {type(exc).__name__}: {exc}") from exc
        finally:
            self.gate.inner = None
            self._disarm(rules)
            self._tick_windows()
            if self.cluster is not None:
                self._tick_cluster()
        if crashed:
            self.counts["crashes"] += 1
            self.counts[f"crash_op.{kind}"] += 1
            self._after_crash(crash)
        if self.auto_check:
            self.check()

    def _store_call(self, op: dict[str, Any]) -> tuple[int, int, dict[str, Any]]:
        """(seq, blocks, the keyword arguments of ``store`` / ``store_async``) of a store op."""
        seq, blocks = int(op["seq"]) % self.uni.count, max(1, min(int(op["blocks"]), self.cfg.max_blocks))
        bt = self.layout.block_tokens
        tf = max(0, min(int(op.get("from", 0)), blocks - 1))
        valid = None
        if op.get("valid"):
            left = [int(op["valid"])]

            def valid() -> bool:
                left[0] -= 1
                return left[0] >= 0

        return seq, blocks, dict(
            prefix=self.uni.prefix(seq, blocks), segments=self.uni.segments(seq, tf * bt, blocks * bt),
            snapshot=self.uni.snapshot(seq, blocks), tokens_from=tf * bt, valid=valid,
        )

    def _op_store(self, op: dict[str, Any]) -> None:
        assert self.eng is not None
        seq, blocks, call = self._store_call(op)
        try:
            res = self.eng.store(**call)
        except InvalidInputError:
            if call["tokens_from"] == 0:
                raise
            self.counts["store.invalid"] += 1
            return
        self._stored(seq, blocks, res)

    def _op_store_async(self, op: dict[str, Any]) -> None:
        """``store_async``: once the ticket says the copies are done, the caller's tensors
        are overwritten (the device blocks are reused); the result is the acknowledgement.
        The op ends when the engine's workers are idle (the commit and the retry it
        schedules), so that no effect of it runs beside the next op."""
        eng = self.eng
        assert eng is not None
        seq, blocks, call = self._store_call(op)
        try:
            ticket = eng.store_async(**call)
        except InvalidInputError:
            if call["tokens_from"] == 0:
                raise
            self.counts["store.invalid"] += 1
            return
        try:
            if not ticket.wait_released(ASYNC_WAIT_S):
                raise Violation("exception", f"store_async: copies not done in {ASYNC_WAIT_S} s")
            _overwrite(call["segments"], call["snapshot"])
            try:
                res = ticket.result(ASYNC_WAIT_S)
            except TimeoutError:
                raise Violation("exception", f"store_async: no result in {ASYNC_WAIT_S} s") from None
        finally:
            eng.transfers.drain(ASYNC_WAIT_S)
        self.counts["store_async.acknowledged"] += 1
        self._stored(seq, blocks, res)
        if eng.guard.closed:  # a worker died after the result (the acknowledgement stands)
            raise SimulatedCrash("the engine died in its commit or retry worker")

    def _stored(self, seq: int, blocks: int, res: Any) -> None:
        """Count a store's result; an acknowledged one joins ``must``."""
        self.counts[f"store.{res.status}"] += 1
        if res.status not in STORE_STATUSES:
            raise Violation("exception", f"store returned unknown status {res.status!r}")
        key = self.uni.key(seq, blocks)
        # A queued store retried inside this call may have evicted it after it published.
        if res.ok and (key not in self._op_removed or key in self.observer.nodes):
            self.must.add(key)
        row = self.observer.nodes.get(key)
        if res.status in ("stored", "refilled") and row is not None:
            # Freshly written under this generation: a name reused after its old files
            # were durably unlinked (the evict behind it is durable: no row comes back).
            self.harmed.get(key, set()).discard(row.generation)

    def _op_restore(self, op: dict[str, Any]) -> None:
        assert self.eng is not None
        seq, blocks = int(op["seq"]) % self.uni.count, max(1, min(int(op["blocks"]), self.cfg.max_blocks))
        gpu = max(0, min(int(op.get("gpu", 0)), blocks))
        strict = not op.get("faults") and not op.get("crash") and self._steady()
        self._restore_check(seq, blocks, gpu, strict)

    def _restore_check(self, seq: int, blocks: int, gpu: int, strict: bool) -> None:
        assert self.eng is not None
        bt = self.layout.block_tokens
        m = self.eng.lookup(self.uni.prefix(seq, blocks), gpu_blocks=gpu)
        self.counts[f"lookup.{m.outcome}"] += 1
        if m.outcome not in LOOKUP_OUTCOMES:
            raise Violation("exception", f"lookup returned unknown outcome {m.outcome!r}")
        got = None
        if m.hit:
            if not gpu < m.blocks <= blocks:
                raise Violation("bytes", f"lookup of {blocks} blocks (gpu {gpu}) matched {m.blocks}")
            got = self.eng.restore(m)
            self.counts["restore.ok" if got is not None else "restore.miss"] += 1
            if got is not None:
                served = self._served(m, got.match)
                why = self.uni.mismatch(seq, got, gpu * bt, served.tokens)
                if why is not None:
                    raise Violation("bytes", f"restore of seq {seq} blocks {served.blocks} (gpu {gpu}): {why}")
                m = served
        key = self.uni.key(seq, blocks)
        required = strict and gpu < blocks and key in self.must and self._restorable(key, gpu)
        if required and not (m.hit and m.blocks == blocks and got is not None):
            raise Violation(
                "miss", f"acknowledged checkpoint seq {seq} blocks {blocks} (gpu {gpu}) "
                f"not restored: lookup {m.outcome} at {m.blocks}, restore {'ok' if got else 'None'}",
            )

    @staticmethod
    def _served(m: Match, restored: Match) -> Match:
        """The match a restore of ``m`` served: ``m``, or for a remote match whose fetch
        missed, the local tiers' shallower hit it fell back to (``Restored.match``)."""
        if restored is m:
            return m
        if m.source != remote_source or restored.source == remote_source or not restored.hit \
                or restored.blocks > m.blocks or restored.gpu_blocks != m.gpu_blocks:
            raise Violation("bytes", f"a restore of a {m.source} match of {m.blocks} blocks served "
                            f"a {restored.source} match of {restored.blocks}")
        return restored

    def _op_evict(self, op: dict[str, Any]) -> None:
        assert self.eng is not None
        freed = self.eng.evict(max(0, int(op.get("nbytes", 0))))
        self.counts["evict.freed_bytes"] += freed

    def _op_evict_key(self, op: dict[str, Any]) -> None:
        assert self.eng is not None
        seq, blocks = int(op["seq"]) % self.uni.count, max(1, min(int(op["blocks"]), self.cfg.max_blocks))
        freed = self.eng.evict(prefix=self.uni.prefix(seq, blocks))
        self.counts["evict_key.freed" if freed else "evict_key.refused"] += 1

    def _op_pin(self, op: dict[str, Any]) -> None:
        assert self.eng is not None
        seq, blocks = int(op["seq"]) % self.uni.count, max(1, min(int(op["blocks"]), self.cfg.max_blocks))
        m = self.eng.lookup(self.uni.prefix(seq, blocks))
        if m.hit and self.eng.pin(m):
            self.pins.append(m)
            self.counts["pin.ok"] += 1

    def _op_unpin(self, op: dict[str, Any]) -> None:
        assert self.eng is not None
        if self.pins:
            m = self.pins.pop(int(op.get("i", 0)) % len(self.pins))
            self.eng.unpin(m)

    def _op_reclaim(self, op: dict[str, Any]) -> None:
        assert self.eng is not None
        self.counts["reclaim.bytes"] += self.eng.reclaim()

    def _op_retry(self, op: dict[str, Any]) -> None:
        assert self.eng is not None
        self.eng.retry_pending()

    def _op_compact(self, op: dict[str, Any]) -> None:
        """One compaction pass, when the engine has ``compact`` (feature-detected)."""
        assert self.eng is not None
        fn = getattr(self.eng, "compact", None)
        if fn is None:
            return
        policy = compaction_policy(bool(op.get("interior")))
        try:
            rep = fn(policy)
        except PinnedError:
            self.counts["compact.pinned"] += 1
            return
        self.counts["compact.ran"] += 1
        self.counts["compact.merges"] += int(getattr(rep, "merges", 0) or 0)

    def _op_damage(self, op: dict[str, Any]) -> None:
        """Damage one live shard of a ready node at rest (durable at once)."""
        assert self.eng is not None
        byid = self.observer.by_id()
        files = [
            (r, name, byid[node]) for r, name, node, status in self.observer.files()
            if status == "live" and node in byid and byid[node].state == "ready"
            and os.path.exists(os.path.join(self.root, rank_dir_name(r), name))
        ]
        if not files:
            return
        r, name, row = files[int(op.get("i", 0)) % len(files)]
        path = os.path.join(self.root, rank_dir_name(r), name)
        how = op.get("how", "flip")
        fs: Any = faultfs if self.cluster is not None and self.cluster.is_served(r) else self.fs
        at = float(op.get("at", 0.5))
        size = os.path.getsize(path)
        if how in ("flip", "flip_data") and size > 0:
            lo = 0
            if how == "flip_data" and size >= 8:
                with open(path, "rb") as f:
                    (hlen,) = struct.unpack("<Q", f.read(8))
                lo = min(size - 1, 8 + hlen)
            fs.flip_bit(path, lo + int(at * (size - lo)) % max(1, size - lo), int(op.get("bit", 0)) % 8)
        elif how == "truncate":
            fs.truncate(path, int(at * size))
        elif how == "delete":
            fs.delete(path)
        elif how == "zero":
            fs.zero_length(path)
        else:
            return
        self.harmed.setdefault(row.key, set()).add(row.generation)
        self.counts[f"damage:{how}"] += 1

    def _op_reopen(self, op: dict[str, Any]) -> None:
        assert self.eng is not None
        committed = dict(self.observer.nodes)
        self._absorb(self.eng)
        self.eng.close()
        self.eng = None
        self.pins.clear()
        self._open()
        self.counts["reopens"] += 1
        self._check_recovered(committed)

    def _op_power(self, op: dict[str, Any]) -> None:
        self.counts["crashes"] += 1
        self._after_crash({"power": op.get("mode", "drop"), "snap": op.get("snap", 0.0),
                           "again": op.get("again")})

    def _op_cluster(self, op: dict[str, Any]) -> None:
        """A fault of the run's servers (``cluster.py``)."""
        if self.cluster is not None:
            held = frozenset(k for k, row in self.observer.nodes.items() if row.state == "ready")
            self.cluster.apply(op, self.counts, held)

    def _tick_cluster(self) -> None:
        """End the server outages whose time is up (a server that cannot be brought
        back is the harness's failure, reported as such)."""
        assert self.cluster is not None
        try:
            self.cluster.tick()
        except (OSError, RuntimeError) as exc:
            raise Violation("cluster", f"a server could not be brought back: {type(exc).__name__}: {exc}") from exc

    def _steady(self) -> bool:
        """No rank-down window and no rank server outage: every requirement applies."""
        return not self.windows and (self.cluster is None or self.cluster.quiet)

    def _op_rank_down(self, op: dict[str, Any]) -> None:
        rank = int(op.get("rank", 0)) % self.cfg.ranks
        rules = [self.plan.add(o, op.get("err", "EIO"), rank=rank, at=1, persistent=True) for o in OPS]
        self.windows.append([rules, max(1, int(op.get("ops", 3)))])
        self.counts["rank_down"] += 1

    # ------------------------------------------------------------------ faults

    def _arm(self, specs) -> list[FaultRule]:
        rules = []
        for s in specs:
            rank = s.get("rank")
            rules.append(self.plan.add(
                s["op"], s.get("err", "EIO"), rank=None if rank is None else int(rank) % self.cfg.ranks,
                at=int(s.get("at", 1)), persistent=bool(s.get("persistent", False)),
            ))
        return rules

    def _disarm(self, rules: list[FaultRule]) -> None:
        """Remove exactly these rule objects (rules compare equal by value)."""
        gone = {id(r) for r in rules}
        self.plan.rules[:] = [r for r in self.plan.rules if id(r) not in gone]

    def _tick_windows(self) -> None:
        for w in list(self.windows):
            w[1] -= 1
            if w[1] <= 0:
                self._disarm(w[0])
                self.windows.remove(w)

    # ------------------------------------------------------------------ crash and recovery

    def _after_crash(self, spec: dict[str, Any]) -> None:
        """The process died: maybe lose power, recover (maybe crashing again), check."""
        self._kill()
        if spec.get("power"):
            self._power_loss(spec["power"], float(spec.get("snap", 0.0)))
        committed = dict(self.observer.nodes)
        again = spec.get("again")
        rules = self._arm(spec.get("rfaults", ()))
        try:
            if again:
                self.gate.inner = crash_hook(again, self.cfg.ranks)
                try:
                    self._open_once()
                except SimulatedCrash:
                    self.counts["recovery_crashes"] += 1
                    self._kill()
                    if again.get("power"):
                        self._power_loss(again["power"], float(again.get("snap", 0.0)))
                        committed = self._still_committed(committed)
                except OSError:
                    self.counts["open_failed"] += 1
                    self.eng = None
                finally:
                    self.gate.inner = None
            if self.eng is None:
                self._open()
        finally:
            self._disarm(rules)
        self.counts["recoveries"] += 1
        self._check_recovered(committed)

    def _still_committed(self, committed: dict[bytes, NodeRow]) -> dict[bytes, NodeRow]:
        """After a second power loss: what of ``committed`` the durable catalog still has.

        Lost commits may take rows (or a row's newer generation) committed before the
        first crash; a row kept at its generation keeps its state from before recovery,
        so an invalidation by recovery is still checked.
        """
        now = self.observer.nodes
        out = {}
        for key, row in committed.items():
            cur = now.get(key)
            if cur is not None:
                out[key] = row if cur.generation == row.generation else cur
        return out

    def _check_recovered(self, committed: dict[bytes, NodeRow]) -> None:
        """Every node of the durable catalog survived recovery; acknowledged ones restore."""
        self.gate.inner = None
        now = self.observer.nodes
        for key, row in committed.items():
            cur = now.get(key)
            if cur is None:
                raise Violation("lost", f"node {row.id} ({self._name(key)}) vanished in recovery")
            if row.state == "ready" and cur.state != "ready" and not self._harmed(key, row.generation):
                raise Violation(
                    "damaged", f"committed node {row.id} ({self._name(key)}) came back damaged, "
                    "but none of its files was damaged at rest",
                )
        if not self._steady():
            return
        with self.plan.paused():
            for key in sorted(self.must):
                seq, blocks = self.keyinfo[key]
                self._restore_check(seq, blocks, 0, strict=True)

    # ------------------------------------------------------------------ checks

    def _removed(self, key: bytes, row: NodeRow, label: str, legit: bool) -> None:
        self._op_removed.add(key)
        if legit:
            self.must.discard(key)
        else:
            self.problems.append(
                Violation("removal", f"commit {label!r} removed node {row.id} ({self._name(key)})")
            )

    def _harmed(self, key: bytes, generation: int) -> bool:
        return generation in self.harmed.get(key, ())

    def _restorable(self, key: bytes, gpu: int) -> bool:
        """Whether the model requires ``key`` to restore: ready, undamaged path, snapshot."""
        byid = self.observer.by_id()
        row = self.observer.nodes.get(key)
        if row is None or (self.layout.has_snapshot and not row.has_snapshot):
            return False
        while row is not None and row.end > gpu:
            if row.state != "ready" or self._harmed(row.key, row.generation):
                return False
            row = byid.get(row.parent) if row.parent is not None else None
        return True

    def _name(self, key: bytes) -> str:
        seq, blocks = self.keyinfo.get(key, (-1, -1))
        return f"seq {seq} blocks {blocks}"

    def _excused(self, invariant: int, detail: str) -> bool:
        """Audit findings on shards this driver damaged at rest (not yet detected)."""
        if invariant != 1:
            return False
        m = _NODE_RE.search(detail)
        if m is None:
            return False
        row = self.observer.by_id().get(int(m.group(1)))
        return row is not None and self._harmed(row.key, row.generation)

    def check(self) -> None:
        """Every invariant of the module doc; raises the first Violation found."""
        if self.problems:
            raise self.problems[0]
        eng = self.eng
        assert eng is not None
        with self.plan.paused():
            if self.cluster is None or self.cluster.quiet:  # a rank that is down cannot be audited
                rep = eng.audit(checksums=True)
                for v in rep.violations:
                    if not self._excused(v.invariant, v.detail):
                        raise Violation(f"audit:{v.invariant}", v.detail)
            nodes = self.observer.nodes
            for key in sorted(self.must):
                row = nodes.get(key)
                if row is None:
                    raise Violation("lost", f"acknowledged {self._name(key)} is not in the catalog")
                if row.state != "ready" and not self._harmed(key, row.generation):
                    raise Violation("damaged", f"acknowledged {self._name(key)} is damaged, "
                                    "but none of its files was damaged at rest")
            byid = self.observer.by_id()
            for m in self.pins:
                for nid, gen in m.path:
                    row = byid.get(nid)
                    if row is None or row.generation != gen:
                        raise Violation("pin", f"pinned node {nid} generation {gen} was "
                                        f"{'evicted' if row is None else 'replaced'}")
            charged = eng.stats()["charged_bytes"]
            if charged > self.cfg.capacity:
                raise Violation("capacity", f"charged {charged} > capacity {self.cfg.capacity}")

    # ------------------------------------------------------------------ reporting

    def fault_counts(self) -> dict[str, int]:
        """Injected faults by kind: 'write:EIO', 'damage:flip', 'crash', 'power_loss:drop'..."""
        out: Counter[str] = Counter(self.plan.injected)
        for k, v in self.counts.items():
            if k.startswith(("damage:", "power_loss:")):
                out[k] += v
        out["crash"] = self.counts["crashes"]
        out["recovery_crash"] = self.counts["recovery_crashes"]
        return {k: v for k, v in sorted(out.items()) if v}


@contextlib.contextmanager
def driver_in(cfg: RunConfig, root: str, plant: Any = None) -> Iterator[Driver]:
    """A Driver in ``root``, closed afterwards."""
    d = Driver(cfg, root, plant)
    try:
        yield d
    finally:
        d.close()


def replay(ops: list[dict[str, Any]], cfg: RunConfig, root: str, plant: Any = None,
           on_step: Callable[[int, Driver], None] | None = None) -> tuple[Violation | None, int, Driver]:
    """Apply ``ops`` in order; return (first violation or None, ops applied, the driver).

    The driver is closed before returning.
    """
    d = Driver(cfg, root, plant)
    done = 0
    try:
        for i, op in enumerate(ops):
            try:
                d.apply(op)
            except Violation as v:
                return v, i + 1, d
            done = i + 1
            if on_step is not None:
                on_step(i, d)
        return None, done, d
    finally:
        with contextlib.suppress(Exception):
            d.close()
