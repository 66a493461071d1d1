"""The campaign runner: seeded random runs, VOPR-style, with shrunk reproducers.

One campaign seed derives every run's seed; a run's seed derives its configuration
(ranks, snapshots, synchronous mode, capacity, policy, per-rank fault rates) and its
op list, so ``--seed`` replays a whole campaign. Each run is a fresh cache directory
driven by a ``Driver`` for up to ``Profile.run_ops`` ops. A violation ends the run:
its ops are cut to the failing prefix, shrunk by delta debugging (ddmin over the op
list, then dropping each op's faults and crash details one by one), and saved as a
JSON reproducer that ``prefixstore fuzz --replay FILE`` replays.

Fault rates are per rank (one rank may be flaky while the others are healthy);
faults are attached to the op they hit (a rule counting from that op's start), so a
shrunk op list still means what it meant.
"""

from __future__ import annotations

import faulthandler
import json
import os
import random
import shutil
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

import attrs

from prefixstore.engine.api import Engine
from prefixstore.engine.workdir import ensure_dir
from prefixstore.fuzz import plants as plant_registry
from prefixstore.fuzz.driver import CLUSTER_OPS, Driver, RunConfig, Violation, replay
from prefixstore.fuzz.faultfs import OPS
from prefixstore.statemachine.policy import DEFAULT, registered

FORMAT = "prefixstore-fuzz-reproducer-1"


@attrs.frozen
class Profile:
    """How long runs are, how often faults and crashes come, how long shrinking may take."""

    name: str
    run_ops: int
    steps: int  # default budget when neither --steps nor --minutes is given
    crash_p: float
    power_p: float
    shrink_s: float
    rates: tuple[float, ...] = (0.0, 0.0, 0.03, 0.08, 0.2)


PROFILES: dict[str, Profile] = {
    p.name: p
    for p in (
        Profile("dev", run_ops=60, steps=600, crash_p=0.06, power_p=0.5, shrink_s=20),
        Profile("ci", run_ops=120, steps=3000, crash_p=0.06, power_p=0.5, shrink_s=30),
        Profile("campaign", run_ops=300, steps=10**9, crash_p=0.05, power_p=0.5, shrink_s=120),
    )
}

_OP_WEIGHTS = {
    "store": 30, "store_async": 10, "restore": 20, "evict": 3, "evict_key": 4, "pin": 5, "unpin": 5, "reclaim": 2,
    "retry": 1, "compact": 3, "damage": 3, "reopen": 2, "power": 3, "rank_down": 1,
}
_RANK_SERVER_OPS = {"rank_kill": 2, "rank_power": 2, "rank_stop": 2}
_REMOTE_OPS = {"redis_kill": 2, "redis_stop": 2, "redis_flush": 2, "remote_damage": 3, "evict_key": 6}
"""Added to ``_OP_WEIGHTS`` in a run with rank servers / a remote tier (evicting a
checkpoint locally sends its next restore to the remote tier)."""
_FAULT_OPS = {"write": 3, "fsync": 2, "rename": 1, "fsync_dir": 1, "unlink": 2, "read": 2}
assert set(_FAULT_OPS) == set(OPS)


def policy_weights() -> dict[str, int]:
    """Every eviction policy registered now, with its weight in a run's draw (the
    engine's default three times any other)."""
    return {name: 6 if name == DEFAULT else 2 for name in registered()}


def draw_config(seed: int, ranks: int | None = None, plant: Any = None, *,
                rank_servers: int = 0, remote: str = "", netns: bool = False) -> RunConfig:
    """A run's configuration from its seed (``ranks`` and a plant's needs override).

    ``rank_servers``: that many of the highest ranks (at most all) are served by rank
    server processes; ``remote``: "redis" puts a redis-server behind the remote tier
    (write-through or write-behind, drawn); ``netns``: each rank server on a host of its
    own (network namespaces), whose link the run cuts."""
    rng = random.Random(f"config/{seed}")
    weights = policy_weights()
    r = ranks or rng.choice([1, 2, 4])
    fields: dict[str, Any] = dict(
        ranks=r,
        snapshot=rng.random() < 0.75,
        synchronous=rng.choice(["FULL", "NORMAL"]),
        capacity=r * rng.randrange(2500, 7000),
        policy=rng.choices(list(weights), list(weights.values()))[0],
        seed=seed,
    )
    if rng.random() < 0.5:  # evict ahead of need: room to retire snapshots
        fields["high_watermark"] = round(rng.uniform(0.7, 1.0), 2)
        fields["low_watermark"] = round(rng.uniform(0.4, fields["high_watermark"]), 2)
    if rank_servers or remote:
        fields.update(rank_servers=min(rank_servers, r), remote=remote, write_behind=rng.random() < 0.5,
                      netns=netns and rank_servers > 0)
    if plant is not None:
        fields.update(plant.config)
        if plant.config.get("rank_servers"):  # at least the plant's, at most every rank
            fields["rank_servers"] = min(r, max(rank_servers, plant.config["rank_servers"]))
        fields.setdefault("write_behind", rng.random() < 0.5)
    return RunConfig(**fields)


class OpGen:
    """Draws a run's ops from its seed, independent of the engine's state."""

    def __init__(self, seed: int, cfg: RunConfig, profile: Profile) -> None:
        self.rng = random.Random(f"ops/{seed}")
        self.cfg = cfg
        self.profile = profile
        self.rates = [self.rng.choice(profile.rates) for _ in range(cfg.local_ranks)]
        self.compact = hasattr(Engine, "compact")
        self.weights = dict(_OP_WEIGHTS)
        if cfg.rank_servers:
            self.weights.update(_RANK_SERVER_OPS)
            if cfg.netns:
                self.weights["rank_cut"] = 2
        if cfg.remote:
            self.weights.update(_REMOTE_OPS)
        if not cfg.local_ranks:  # nothing here a fault, a rank's crash lane or rank_down reaches
            self.weights.pop("rank_down")

    def _where(self) -> dict[str, int]:
        rng = self.rng
        return {"seq": rng.randrange(self.cfg.seqs), "blocks": rng.randint(1, self.cfg.max_blocks)}

    def _fault(self, rank: int | None) -> dict[str, Any]:
        rng = self.rng
        op = rng.choices(list(_FAULT_OPS), list(_FAULT_OPS.values()))[0]
        err = "ENOSPC" if op == "write" and rng.random() < 0.5 else "EIO"
        return {"op": op, "err": err, "rank": rank, "at": rng.randint(1, 4),
                "persistent": rng.random() < 0.3}

    def _crash(self, depth: int = 0) -> dict[str, Any]:
        rng = self.rng
        local = self.cfg.local_ranks
        lane: Any = "commit" if rng.random() < 0.5 or not local else rng.randrange(local)
        spec: dict[str, Any] = {"lane": lane, "n": rng.randrange(12 if lane == "commit" else 24)}
        if rng.random() < self.profile.power_p:
            spec["power"] = rng.choice(["drop", "garble"])
            spec["snap"] = round(rng.random(), 4)
        if depth == 0 and rng.random() < 0.2:
            spec["again"] = self._crash(1)
        if depth == 0 and local and rng.random() < 0.1:
            spec["rfaults"] = [self._fault(rng.randrange(local))]
        return spec

    def next(self) -> dict[str, Any]:
        rng = self.rng
        kinds = [k for k in self.weights if k != "compact" or self.compact]
        kind = rng.choices(kinds, [self.weights[k] for k in kinds])[0]
        op: dict[str, Any] = {"op": kind}
        if kind in ("store", "store_async", "restore", "evict_key", "pin"):
            op.update(self._where())
        if kind in ("store", "store_async"):
            if rng.random() < 0.1:
                op["from"] = rng.randrange(op["blocks"])
            if rng.random() < 0.15:
                op["valid"] = rng.randint(1, 4)
        elif kind == "restore":
            op["gpu"] = rng.randrange(op["blocks"]) if rng.random() < 0.3 else 0
        elif kind == "evict":
            op["nbytes"] = rng.randrange(1, self.cfg.capacity // 2)
        elif kind == "compact":
            op["interior"] = rng.random() < 0.3
        elif kind == "unpin":
            op["i"] = rng.randrange(8)
        elif kind == "damage":
            op.update(how=rng.choice(["flip", "flip_data", "flip_data", "truncate", "delete", "zero"]),
                      i=rng.randrange(64), at=round(rng.random(), 4), bit=rng.randrange(8))
        elif kind == "power":
            op.update(mode=rng.choice(["drop", "garble"]), snap=round(rng.random(), 4))
        elif kind == "rank_down":
            op.update(rank=rng.randrange(self.cfg.local_ranks), ops=rng.randint(1, 4))
        elif kind in ("rank_kill", "rank_power", "rank_stop", "rank_cut"):
            op.update(rank=rng.randrange(self.cfg.rank_servers),
                      ops=rng.randint(1, 3 if kind in ("rank_stop", "rank_cut") else 6))
            if kind == "rank_power":
                op["mode"] = rng.choice(["drop", "garble"])
        elif kind in ("redis_kill", "redis_stop"):
            op["ops"] = rng.randint(1, 3 if kind == "redis_stop" else 6)
        elif kind == "remote_damage":
            op.update(i=rng.randrange(64), at=round(rng.random(), 4), bit=rng.randrange(8))
        faults = [self._fault(r) for r in range(self.cfg.local_ranks) if rng.random() < self.rates[r]]
        if self.cfg.local_ranks and rng.random() < 0.01:
            faults.append({"op": "write", "err": "ENOSPC", "rank": None, "at": 1, "persistent": True})
        if faults:
            op["faults"] = faults
        if kind not in ("power", "rank_down", *CLUSTER_OPS) and rng.random() < self.profile.crash_p:
            op["crash"] = self._crash()
        return op


# ------------------------------------------------------------------ shrinking


def _workdir(base: str | None) -> str:
    """A new run directory under ``base`` (created when missing), else /dev/shm or the temp dir."""
    if base is not None:
        ensure_dir("workdir", base)
    elif os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK):
        base = "/dev/shm"
    return tempfile.mkdtemp(prefix="prefixstore-fuzz-", dir=base)


def replay_in_tmp(ops: list[dict[str, Any]], cfg: RunConfig, plant: Any = None,
                  workdir: str | None = None) -> tuple[Violation | None, int]:
    """Replay ``ops`` in a fresh directory; (first violation or None, ops applied)."""
    root = _workdir(workdir)
    try:
        v, n, _ = replay(ops, cfg, os.path.join(root, "cache"), plant)
        return v, n
    finally:
        shutil.rmtree(root, ignore_errors=True)


def shrink(ops: list[dict[str, Any]], cfg: RunConfig, kind: str, *, plant: Any = None,
           budget_s: float = 30.0, workdir: str | None = None) -> tuple[list[dict[str, Any]], int]:
    """Delta-debug ``ops`` to a short list that still fails with ``kind``.

    Returns (ops, replays tried). Stops when no single change helps or the budget is spent.
    """
    deadline = time.monotonic() + budget_s
    tries = 0

    def fails(cand: list[dict[str, Any]]) -> list[dict[str, Any]] | None:
        nonlocal tries
        tries += 1
        v, n = replay_in_tmp(cand, cfg, plant, workdir)
        return cand[:n] if v is not None and v.kind == kind else None

    n = 2
    while len(ops) >= 2 and time.monotonic() < deadline:
        chunk = -(-len(ops) // n)
        reduced = False
        for i in range(0, len(ops), chunk):
            if time.monotonic() >= deadline:
                break
            got = fails(ops[:i] + ops[i + chunk:])
            if got is not None:
                ops, n, reduced = got, max(n - 1, 2), True
                break
        if not reduced:
            if n >= len(ops):
                break
            n = min(len(ops), n * 2)
    # Then simplify each op: drop its crash details and faults one at a time.
    i = 0
    while i < len(ops) and time.monotonic() < deadline:
        for cand_op in _simpler(ops[i]):
            if time.monotonic() >= deadline:
                break
            got = fails(ops[:i] + [cand_op] + ops[i + 1:])
            if got is not None and len(got) > i:
                ops = got
                break
        else:
            i += 1
    return ops, tries


def _simpler(op: dict[str, Any]) -> list[dict[str, Any]]:
    out = []
    if "crash" in op:
        out.append({k: v for k, v in op.items() if k != "crash"})
        c = op["crash"]
        for k in ("again", "rfaults", "power"):
            if k in c:
                out.append({**op, "crash": {kk: vv for kk, vv in c.items() if kk != k and (k != "power" or kk != "snap")}})
    for j in range(len(op.get("faults", ()))):
        rest = op["faults"][:j] + op["faults"][j + 1:]
        out.append({**op, "faults": rest} if rest else {k: v for k, v in op.items() if k != "faults"})
    for k in ("valid", "from", "gpu"):
        if op.get(k):
            out.append({kk: vv for kk, vv in op.items() if kk != k})
    return out


# ------------------------------------------------------------------ reproducers


def save_reproducer(out_dir: str, name: str, cfg: RunConfig, ops: list[dict[str, Any]],
                    violation: Violation, plant: Any = None, **extra: Any) -> str:
    """Write a reproducer JSON file; returns its path."""
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, f"{name}.json")
    doc = {
        "format": FORMAT,
        "config": cfg.to_dict(),
        "plant": None if plant is None else plant.name,
        "violation": {"kind": violation.kind, "detail": violation.detail},
        "replay": f"prefixstore fuzz --replay {path}",
        **extra,
        "ops": ops,
    }
    with open(path, "w") as f:
        json.dump(doc, f, indent=1)
        f.write("\n")
    return path


def load_reproducer(path: str) -> tuple[RunConfig, list[dict[str, Any]], Any, dict[str, Any]]:
    """(config, ops, plant or None, the whole document) of a reproducer file."""
    with open(path) as f:
        doc = json.load(f)
    if doc.get("format") != FORMAT:
        raise ValueError(f"{path} is not a prefixstore fuzz reproducer")
    plant = plant_registry.get(doc["plant"]) if doc.get("plant") else None
    return RunConfig.from_dict(doc["config"]), list(doc["ops"]), plant, doc


# ------------------------------------------------------------------ the campaign


@attrs.define
class CampaignResult:
    """What a campaign did, JSON-able via ``to_dict``."""

    seed: int
    profile: str
    plant: str | None
    steps: int = 0
    runs: int = 0
    counts: Counter[str] = attrs.field(factory=Counter)
    faults: Counter[str] = attrs.field(factory=Counter)
    configs: Counter[str] = attrs.field(factory=Counter)
    violations: list[dict[str, Any]] = attrs.field(factory=list)
    elapsed_s: float = 0.0
    interrupted: bool = False

    def to_dict(self) -> dict[str, Any]:
        c = self.counts
        return {
            "seed": self.seed,
            "profile": self.profile,
            "plant": self.plant,
            "steps": self.steps,
            "runs": self.runs,
            "crashes": c["crashes"],
            "crashes_by_op": {k[9:]: v for k, v in sorted(c.items()) if k.startswith("crash_op.")},
            "power_losses": c["power_losses"],
            "recoveries": c["recoveries"],
            "recovery_crashes": c["recovery_crashes"],
            "faults": dict(sorted(self.faults.items())),
            "faults_total": sum(self.faults.values()),
            "ops": {k[3:]: v for k, v in sorted(c.items()) if k.startswith("op.")},
            "outcomes": {k: v for k, v in sorted(c.items())
                         if k.startswith(("store.", "lookup.", "restore.", "compact.", "evict_key."))},
            "cluster": {k[8:]: v for k, v in sorted(c.items()) if k.startswith("cluster.")},
            "configs": dict(sorted(self.configs.items())),
            "violations": self.violations,
            "elapsed_s": round(self.elapsed_s, 1),
            "interrupted": self.interrupted,
            "steps_per_s": round(self.steps / self.elapsed_s, 1) if self.elapsed_s else None,
        }


def merged(parts: list[CampaignResult]) -> CampaignResult:
    """One result of campaign ``parts`` (of one seed and profile, in run order): their
    counts added, their violations in turn, the longest elapsed time (run side by side)."""
    first = parts[0]
    out = CampaignResult(first.seed, first.profile, first.plant, runs=parts[-1].runs,
                         elapsed_s=max(p.elapsed_s for p in parts),
                         interrupted=any(p.interrupted for p in parts))
    for p in parts:
        out.steps += p.steps
        out.counts.update(p.counts)
        out.faults.update(p.faults)
        out.configs.update(p.configs)
        out.violations += p.violations
    return out


def run_campaign(
    seed: int = 0,
    *,
    steps: int | None = None,
    minutes: float | None = None,
    ranks: int | None = None,
    plant: Any = None,
    profile: str = "dev",
    out: str | None = None,
    workdir: str | None = None,
    stop_after: int | None = None,
    shrink_s: float | None = None,
    progress: Callable[[CampaignResult], None] | None = None,
    watchdog_s: float | None = None,
    reproducers_per_kind: int | None = 1,
    rank_servers: int = 0,
    remote: str = "",
    netns: bool = False,
    first_run: int = 0,
) -> CampaignResult:
    """Run fuzz runs until ``steps`` ops or ``minutes`` pass (or ``stop_after`` violations).

    Failures are shrunk and saved under ``out`` (when given) as reproducers, at most
    ``reproducers_per_kind`` per violation kind (None: every one); the others are
    listed without shrinking. With ``watchdog_s``, an op that runs longer prints every
    thread's stack to stderr. ``rank_servers`` / ``remote``: every run with real servers
    (``draw_config``, ``cluster.py``). A KeyboardInterrupt ends the campaign early: the result
    so far comes back with ``interrupted`` set.

    ``first_run``: start at that run of the seed's campaign (a run depends only on its
    seed, drawn in turn from the campaign's): a campaign whose runs all end clean at the
    profile's ``run_ops`` is the ``merged`` parts that start at multiples of it
    (``tests/test_fuzz_stateful.py`` runs its CI campaign so, side by side).
    """
    prof = PROFILES[profile]
    if steps is None and minutes is None:
        steps = prof.steps
    deadline = None if minutes is None else time.monotonic() + minutes * 60
    res = CampaignResult(seed, profile, None if plant is None else plant.name, runs=first_run)
    t0 = time.monotonic()
    master = random.Random(f"campaign/{seed}")
    for _ in range(first_run):
        master.getrandbits(32)

    def budget_left() -> bool:
        if steps is not None and res.steps >= steps:
            return False
        return deadline is None or time.monotonic() < deadline

    saved: Counter[str] = Counter()  # reproducers written, per violation kind
    try:
        while budget_left():
            run_seed = master.getrandbits(32)
            cfg = draw_config(run_seed, ranks, plant, rank_servers=rank_servers, remote=remote, netns=netns)
            gen = OpGen(run_seed, cfg, prof)
            res.runs += 1
            res.configs[f"ranks={cfg.ranks} {cfg.synchronous} {'snap' if cfg.snapshot else 'nosnap'} {cfg.policy}"
                        + _servers(cfg)] += 1
            base = _workdir(workdir)
            ops: list[dict[str, Any]] = []
            violation: Violation | None = None
            d: Driver | None = None
            interrupted = False
            try:
                d = Driver(cfg, os.path.join(base, "cache"), plant)
                last = time.monotonic()
                while len(ops) < prof.run_ops and budget_left():
                    op = gen.next()
                    ops.append(op)
                    res.steps += 1
                    if watchdog_s:
                        watchdog_s = _arm_watchdog(watchdog_s)
                    try:
                        d.apply(op)
                    except Violation as v:
                        violation = v
                        break
                    finally:
                        if watchdog_s:
                            faulthandler.cancel_dump_traceback_later()
                    if progress is not None and time.monotonic() - last > 1.0:
                        last = time.monotonic()
                        progress(_merged(res, d))
            except KeyboardInterrupt:
                interrupted = True
                raise
            finally:
                if d is not None:
                    try:
                        d.close()
                    except Exception as exc:  # a clean close must not fail (unless interrupted)
                        if not interrupted:
                            violation = violation or Violation(
                                "exception", f"close raised {type(exc).__name__}: {exc}")
                    res.counts.update(d.counts)
                    res.faults.update(d.fault_counts())
                shutil.rmtree(base, ignore_errors=True)
            if violation is not None:
                keep = reproducers_per_kind is None or saved[violation.kind] < reproducers_per_kind
                res.violations.append(_report(res, cfg, run_seed, ops, violation, plant,
                                              out if keep else None, workdir,
                                              (prof.shrink_s if shrink_s is None else shrink_s) if keep else 0))
                saved[violation.kind] += keep and out is not None
                if not keep:
                    res.violations[-1]["repeat"] = True  # its kind has a reproducer already
                if stop_after is not None and len(res.violations) >= stop_after:
                    break
            if progress is not None:
                res.elapsed_s = time.monotonic() - t0
                progress(res)
    except KeyboardInterrupt:
        res.interrupted = True
    res.elapsed_s = time.monotonic() - t0
    return res


def _servers(cfg: RunConfig) -> str:
    """A run's servers, for the configs summary ("" without)."""
    out = f" rank_servers={cfg.rank_servers}{' netns' if cfg.netns else ''}" if cfg.rank_servers else ""
    if cfg.remote:
        out += f" remote={cfg.remote}{' write-behind' if cfg.write_behind else ''}"
    return out


def _arm_watchdog(seconds: float) -> float | None:
    """Dump every thread's stack to the real stderr if the next op outlasts ``seconds``;
    None (watchdog off) where stderr has no file descriptor."""
    try:
        faulthandler.dump_traceback_later(seconds, file=sys.__stderr__)
    except (AttributeError, ValueError, OSError):
        return None
    return seconds


def _merged(res: CampaignResult, d: Driver) -> CampaignResult:
    """The campaign's counts with the current run's added (for progress lines)."""
    view = attrs.evolve(res, counts=res.counts + d.counts, faults=res.faults + Counter(d.fault_counts()))
    return view


def _report(res: CampaignResult, cfg: RunConfig, run_seed: int, ops: list[dict[str, Any]],
            v: Violation, plant: Any, out: str | None, workdir: str | None,
            shrink_s: float) -> dict[str, Any]:
    entry: dict[str, Any] = {
        "kind": v.kind, "detail": v.detail, "run": res.runs, "run_seed": run_seed,
        "config": cfg.to_dict(), "step": len(ops),
    }
    small, tries, replayed = ops, 0, None
    if shrink_s > 0:
        rv, n = replay_in_tmp(ops, cfg, plant, workdir)
        replayed = rv is not None and rv.kind == v.kind
        if replayed:
            small, tries = shrink(ops[:n], cfg, v.kind, plant=plant, budget_s=shrink_s, workdir=workdir)
    entry.update(replayed=replayed, shrunk_ops=len(small), shrink_replays=tries)
    if small is not ops:
        sv, sn = replay_in_tmp(small, cfg, plant, workdir)
        if sv is not None:
            v, small = sv, small[:sn]
            entry.update(shrunk_detail=sv.detail)
    if out is not None:
        tag = "" if plant is None else f"{plant.name}-"
        path = save_reproducer(out, f"fuzz-{tag}{res.seed}-run{res.runs}-{v.kind.replace(':', '')}",
                               cfg, small, v, plant, campaign_seed=res.seed, run=res.runs,
                               original_ops=len(ops))
        entry.update(reproducer=path, replay=f"prefixstore fuzz --replay {path}")
    return entry
