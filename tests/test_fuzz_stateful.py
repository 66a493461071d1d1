"""Stateful fuzzing: Hypothesis state machines over the public API, the reference
model's own checks, pinned regressions, and a CI-sized campaign.

The machines (``prefixstore.fuzz.stateful``) run under the Hypothesis profile that
tests/conftest.py loads (PREFIXSTORE_HYPOTHESIS_PROFILE: dev, ci or campaign; by
default ci under CI, dev elsewhere).
"""

from __future__ import annotations

import functools
import glob
import json
import logging
import os
import traceback
from collections.abc import Callable
from typing import Any

import pytest
from conftest import HYPOTHESIS_PROFILE
from hypothesis import HealthCheck, Phase, settings
from side_by_side import run_side_by_side

from prefixstore.base.log import stderr_logger, using
from prefixstore.engine import replace
from prefixstore.fuzz import plants
from prefixstore.fuzz.campaign import (
    PROFILES,
    CampaignResult,
    load_reproducer,
    merged,
    replay_in_tmp,
    run_campaign,
)
from prefixstore.fuzz.driver import Driver, RunConfig, Violation
from prefixstore.fuzz.stateful import machine

HERE = os.path.dirname(__file__)
STEPS = {"dev": 25, "ci": 40, "campaign": 100}.get(HYPOTHESIS_PROFILE, 25)


def _settings(**kw) -> settings:
    return settings(settings.default, stateful_step_count=STEPS, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much], **kw)


# -- the state machines --------------------------------------------------------------------

MACHINES = {
    "two-ranks-normal": (2, "NORMAL", True),
    "four-ranks-normal": (4, "NORMAL", True),
    "four-ranks-full-no-snapshot": (4, "FULL", False),
    "one-rank-full": (1, "FULL", True),
}
"""The machines CI runs: (ranks, synchronous, snapshot); the longest (measured) first."""


def run_machine(ranks: int, synchronous: str, snapshot: bool) -> str | None:
    """Run one machine as its Hypothesis TestCase does, under this profile's settings:
    None, or what it found (the traceback, with Hypothesis's falsifying steps)."""
    case = machine(ranks, synchronous, snapshot=snapshot).TestCase("runTest")
    case.settings = _settings()
    try:
        case.runTest()
    except Exception:
        return traceback.format_exc()
    return None


@pytest.fixture(scope="module")
def machine_findings() -> dict[str, str | None]:
    """Every machine of MACHINES run, two at a time side by side (tests/side_by_side.py)."""
    return dict(zip(MACHINES, run_side_by_side([(run_machine, m) for m in MACHINES.values()]), strict=True))


@pytest.mark.parametrize("name", MACHINES)
def test_the_state_machine_holds(name, machine_findings):
    assert machine_findings[name] is None, machine_findings[name]


@pytest.mark.parametrize("name", ["evict-pinned", "skip-dir-fsync", "async-ack-before-publish"])
def test_the_state_machine_finds_a_plant(name):
    """The Hypothesis machine, not just the campaign, catches planted bugs."""
    cls = machine(1, plants.get(name).config.get("synchronous", "FULL"), plant=plants.get(name))
    run = cls.TestCase("runTest")
    run.settings = settings(max_examples=200, stateful_step_count=30, deadline=None, database=None,
                            phases=[Phase.generate], suppress_health_check=list(HealthCheck))
    with pytest.raises(Violation):
        run.runTest()


# -- the model catches what it must, and only that ---------------------------------------------


def _driver(tmp_path, **kw) -> Driver:
    cfg = RunConfig(**{"ranks": 2, "capacity": 40_000, "seed": 3, **kw})
    return Driver(cfg, str(tmp_path / "cache"))


def test_lost_commits_lose_only_what_no_barrier_made_durable(tmp_path):
    """Under NORMAL a power loss can take the catalog back to its last barrier, losing
    acknowledged stores since then (and only those); recovery is clean."""
    with _driver(tmp_path, synchronous="NORMAL") as d:
        for seq in range(4):
            d.apply({"op": "store", "seq": seq, "blocks": 2 + seq})
        acked, base = set(d.must), set(d.observer.images[0].nodes)
        assert acked - base, "every store was made durable by a barrier: nothing to lose"
        d.apply({"op": "power", "mode": "drop", "snap": 0.0})  # back to the durable base
        assert set(d.observer.nodes) == base and d.must == acked & base
        d.apply({"op": "store", "seq": 0, "blocks": 5})
        d.apply({"op": "evict", "nbytes": 1})  # an eviction: its barrier makes all durable
        durable = set(d.observer.nodes)
        assert set(d.observer.images[0].nodes) == durable
        d.apply({"op": "store", "seq": 5, "blocks": 7})
        d.apply({"op": "power", "mode": "garble", "snap": 0.0})
        assert set(d.observer.nodes) == durable and d.counts["power_losses"] == 2


def test_full_power_loss_keeps_every_acknowledged_store(tmp_path):
    with _driver(tmp_path) as d:
        for seq in range(3):
            d.apply({"op": "store", "seq": seq, "blocks": 2})
        d.apply({"op": "power", "mode": "garble", "snap": 0.0})
        assert d.must == {d.uni.key(seq, 2) for seq in range(3)}
        assert d.must <= set(d.observer.nodes)
        for seq in range(3):
            d.apply({"op": "restore", "seq": seq, "blocks": 2})
        assert d.counts["restore.ok"] >= 2 * len(d.must)  # once after recovery, once here


def test_model_flags_bytes_that_differ_from_the_stored_ones(tmp_path):
    with _driver(tmp_path) as d:
        d.apply({"op": "store", "seq": 1, "blocks": 3})
        m = d.eng.lookup(d.uni.prefix(1, 3))
        got = d.eng.restore(m)
        assert d.uni.mismatch(1, got, 0, m.tokens) is None
        got.segments[1]["k"][5, 0, 1] += 1
        assert "rank 1: segment 'k'" in d.uni.mismatch(1, got, 0, m.tokens)


def test_model_flags_an_acknowledged_store_that_vanishes(tmp_path):
    with _driver(tmp_path) as d:
        d.apply({"op": "store", "seq": 2, "blocks": 2})
        with d.eng.guard.lock, d.eng.catalog.txn("store.bogus") as c:  # a row removed by a store
            c.execute("UPDATE files SET node=NULL, status='garbage' WHERE node IS NOT NULL")
            c.execute("DELETE FROM nodes")
        with pytest.raises(Violation) as e:
            d.check()
        assert e.value.kind == "removal"


def test_bit_rot_is_detected_not_served(tmp_path):
    with _driver(tmp_path, ranks=1) as d:
        d.apply({"op": "store", "seq": 0, "blocks": 4})
        d.apply({"op": "damage", "how": "flip_data", "i": 0, "at": 0.5, "bit": 3})
        assert d.harmed
        d.apply({"op": "restore", "seq": 0, "blocks": 4})  # a miss, never other bytes
        assert d.counts["restore.miss"] == 1
        assert d.observer.nodes[d.uni.key(0, 4)].state == "damaged"
        d.apply({"op": "store", "seq": 0, "blocks": 4})  # refilled
        d.apply({"op": "restore", "seq": 0, "blocks": 4})
        assert d.counts["store.refilled"] == 1 and d.counts["restore.ok"] == 1


def campaign_parts(seed: int, steps: int, profile: str, run: Callable[..., CampaignResult] = run_campaign,
                   **kw) -> list[tuple[Callable[..., Any], tuple]]:
    """The ``steps`` of campaign ``seed`` as two parts of whole runs for side_by_side, each
    ``run`` (a clean campaign is the ``merged`` parts: see ``run_campaign``'s ``first_run``)."""
    run_ops = PROFILES[profile].run_ops
    half = -(-steps // run_ops) // 2 * run_ops  # the first half of the runs, in steps
    starts = [(0, half), (half // run_ops, steps - half)] if half else [(0, steps)]
    return [(functools.partial(run, seed, steps=n, profile=profile, first_run=first, **kw), ())
            for first, n in starts]


def test_a_campaign_seed_replays_the_whole_campaign():
    """The same seed, the same campaign: again, as the two parts that test_ci_campaign_is_clean
    runs side by side (here one after the other)."""
    a = run_campaign(5, steps=300, shrink_s=0).to_dict()
    b = merged([part() for part, _ in campaign_parts(5, 300, "dev", shrink_s=0)]).to_dict()
    for d in (a, b):
        d.pop("elapsed_s")
        d.pop("steps_per_s")
    assert a == b
    assert a["crashes"] > 0 and a["faults_total"] > 0 and a["runs"] == 5


# -- regressions found by fuzzing, pinned ----------------------------------------------------------

REGRESSIONS = sorted(glob.glob(os.path.join(HERE, "fuzz_regressions", "*.json")))


def test_regressions_are_pinned():
    assert len(REGRESSIONS) >= 4


@pytest.mark.parametrize("path", REGRESSIONS, ids=lambda p: os.path.basename(p)[:-5])
def test_pinned_regression_replays_clean(path):
    cfg, ops, plant, doc = load_reproducer(path)
    assert doc["note"]
    v, n = replay_in_tmp(ops, cfg, plant)
    assert v is None, f"{os.path.basename(path)}: {v}"
    assert n == len(ops)


def test_generation_regression_still_catches_the_bug(monkeypatch):
    """The pinned IntegrityError reproducer fails again if generations are reused."""
    cfg, ops, _, _ = load_reproducer(os.path.join(HERE, "fuzz_regressions", "restore-after-failed-unlink.json"))
    monkeypatch.setattr(replace, "next_generation", lambda catalog, ranks, key, floor: floor + 1)
    v, _ = replay_in_tmp(ops, cfg)
    assert v is not None and v.kind == "exception" and "IntegrityError" in v.detail


# -- the CI-sized campaign ------------------------------------------------------------------------------


def quiet_campaign(*args, **kw) -> CampaignResult:
    """``run_campaign`` with the engine's warnings silenced, as ``prefixstore fuzz`` runs it."""
    with using(stderr_logger(logging.CRITICAL)):
        return run_campaign(*args, **kw)


def test_ci_campaign_is_clean(tmp_path):
    """The campaign ``prefixstore fuzz --profile ci --steps 8000 --seed 2026`` runs, in two
    parts side by side (the same runs, each from its own seed; campaign_parts)."""
    seed = int(os.environ.get("PREFIXSTORE_FUZZ_SEED", "2026"))
    steps = int(os.environ.get("PREFIXSTORE_FUZZ_STEPS", "8000"))
    res = merged(run_side_by_side(campaign_parts(seed, steps, "ci", quiet_campaign,
                                                 out=str(tmp_path / "failures"), watchdog_s=300)))
    d = res.to_dict()
    assert not res.interrupted and d["violations"] == [], json.dumps(d["violations"], indent=1)
    assert d["steps"] == steps
    assert d["crashes"] > 50 and d["power_losses"] > 20 and d["recoveries"] == d["crashes"]
    assert d["ops"]["store_async"] > 500 and d["crashes_by_op"]["store_async"] > 5, d["crashes_by_op"]
    kinds = {k.split(":")[0] for k in d["faults"]}
    assert {"write", "fsync", "unlink", "read", "damage", "power_loss", "crash"} <= kinds, d["faults"]
    assert {"ranks=1", "ranks=2", "ranks=4"} <= {c.split()[0] for c in d["configs"]}


# -- async stores: the result is the acknowledgement ---------------------------------------------------


def test_an_async_store_is_required_once_its_result_came_back(tmp_path):
    """A crash in the commit worker (at each commit point of the async store) leaves it
    unacknowledged: the model does not require it, and recovery keeps it if it had
    published. Once its result came back it is required, through a later crash and
    power loss, as a sync store would be."""
    published = set()
    for n in range(4):
        with Driver(RunConfig(ranks=2, capacity=40_000, seed=3), str(tmp_path / f"c{n}")) as d:
            d.apply({"op": "store", "seq": 1, "blocks": 2})
            d.apply({"op": "store_async", "seq": 1, "blocks": 3, "crash": {"lane": "commit", "n": n}})
            key = d.uni.key(1, 3)
            assert d.counts["crashes"] == d.counts["recoveries"] == 1 and key not in d.must
            published.add(key in d.observer.nodes)
    assert published == {False, True}  # before and after its publish commit
    with _driver(tmp_path) as d:
        d.apply({"op": "store_async", "seq": 1, "blocks": 3})
        key = d.uni.key(1, 3)
        assert key in d.must and d.counts["store.stored"] == 1
        d.apply({"op": "store", "seq": 2, "blocks": 2,
                 "crash": {"lane": 0, "n": 1, "power": "garble", "snap": 0.0}})
        assert d.counts["recoveries"] == 1 and key in d.must and d.counts["restore.ok"] >= 1


def test_an_async_store_acknowledged_before_its_commit_is_lost(tmp_path):
    """The same crash in the commit worker, against an engine whose ticket says "stored"
    before the commit: the acknowledged store is not in the catalog after recovery."""
    plant = plants.get("async-ack-before-publish")
    with Driver(RunConfig(ranks=2, capacity=40_000, seed=3), str(tmp_path / "c"), plant) as d:
        d.apply({"op": "store", "seq": 1, "blocks": 2})
        with pytest.raises(Violation) as e:
            d.apply({"op": "store_async", "seq": 1, "blocks": 3, "crash": {"lane": "commit", "n": 0}})
        assert e.value.kind == "lost" and "acknowledged seq 1 blocks 3" in e.value.detail
        assert d.counts["crashes"] == 1
