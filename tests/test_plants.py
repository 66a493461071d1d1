"""Every planted bug is found by the campaign runner within a bounded budget, by the
check meant to catch it; a found failure shrinks to a short reproducer that replays.

Budgets are op counts from campaign seed 0 (runs drawn as in any campaign, with the
settings a plant needs to show at all, e.g. synchronous=NORMAL for lost commits).
"""

from __future__ import annotations

import json
import os

import pytest
from conftest import make_layout, node_at, store_tokens, tokens_for
from test_fuzz_cluster import CAUGHT_BY as CLUSTER_CAUGHT_BY

from prefixstore.cli import main
from prefixstore.engine import health
from prefixstore.engine.api import Engine
from prefixstore.engine.driver import DEBUG_ENV, InvariantViolation
from prefixstore.engine.results import REFILLED, STORED
from prefixstore.fuzz import plants
from prefixstore.fuzz.campaign import load_reproducer, replay_in_tmp, run_campaign
from prefixstore.fuzz.faultfs import FaultFS

BUDGET = 6000  # ops; from seed 0 the slowest plant (skip-restore-checksum) is found after ~350

# The kinds of violation that may catch each plant. "invariant" (the engine driver's
# per-state checks, PREFIXSTORE_DEBUG_INVARIANTS) only with the checks on: with them
# off, every plant must still be caught by the fuzzer's own oracle (the audit, the
# model's comparison of what was acknowledged, what the catalog holds and the bytes).
CAUGHT_BY = {
    "publish-early": {"invariant", "damaged", "miss", "audit:1"},  # invariant: PUBLISHED 2, not durable
    "skip-dir-fsync": {"invariant", "damaged", "miss", "audit:1"},
    "double-count-retire": {"audit:3", "capacity"},
    "evict-pinned": {"pin", "audit:6"},
    "batch-drops-unlink": {"audit:3"},  # a shard file the catalog does not know
    "rename-over-live": {"audit:1", "audit:2", "damaged", "miss"},  # 2: a cached row no longer the catalog's
    "skip-orphan-cleanup": {"audit:3"},
    "skip-restore-checksum": {"bytes"},
    "skip-read-checksum": {"bytes"},
    "skip-barrier": {"damaged", "miss", "audit:1"},
    "skip-retire-output": {"invariant", "audit:3"},  # audit 3: rows owned by an ended transaction
    "async-ack-before-publish": {"lost", "miss"},
    "ack-before-group-sync": {"lost", "miss"},
}


# Plants the campaign finds too late for the CI budget above, each with the reproducer it
# found and shrank (``tests/plant_reproducers/``): that reproducer must catch the plant,
# by one of these kinds, and replay clean against the real engine.
REPRODUCED_BY = {
    "stale-prestaged": ("stale-prestaged.json", {"audit:1", "damaged", "miss"}),  # seed 0: op 1524, ~10 s
}

# Plants shown by a crash test of their own, named here (the campaign's catalog model
# tells grouped commits by label, so it never takes back a removal the plant groups).
CRASH_CAUGHT_BY = {
    "evict-removal-unsynced": "test_crash_evict.py::test_unlinks_before_the_removal_is_durable_are_caught_by_a_power_loss",
    # the campaign never rebuilds a catalog
    "rebuild-quarantine-after-commit": "test_crash_rebuild_remote.py::test_a_rebuild_that_quarantines_after_its_commit_is_caught",
    "rebuild-root-unsynced": "test_crash_rebuild_remote.py::test_a_rebuild_that_leaves_the_root_unsynced_is_caught",
    # the campaign's lost-commits model takes the removal as synced by its label
    "removal-taken-as-synced": "test_crash_evict.py::test_a_removal_taken_as_synced_under_normal_is_caught_by_a_power_loss",
}


def test_every_plant_is_listed_and_has_an_expected_catch():
    # the plants in the rank-server and remote-tier paths are found in test_fuzz_cluster.py
    assert set(plants.PLANTS) == (set(CAUGHT_BY) | set(CLUSTER_CAUGHT_BY) | set(REPRODUCED_BY)
                                  | set(CRASH_CAUGHT_BY))
    for test in CRASH_CAUGHT_BY.values():
        path, _, name = test.partition("::")
        with open(os.path.join(os.path.dirname(__file__), path)) as f:
            assert f"def {name}(" in f.read(), test
    assert len(plants.PLANTS) >= 7


@pytest.mark.parametrize("checks", ["on", "off"])
@pytest.mark.parametrize("name", sorted(CAUGHT_BY))
def test_plant_is_found_within_budget(name, checks, monkeypatch):
    """Each plant is found with the driver's invariant checks on (as in the suite) and
    off (only the fuzzer's oracle), by a check meant to catch it."""
    monkeypatch.setenv(DEBUG_ENV, "1" if checks == "on" else "0")
    res = run_campaign(0, steps=BUDGET, plant=plants.get(name), stop_after=1, shrink_s=0)
    assert res.violations, f"plant {name} not found in {res.steps} ops with the checks {checks}"
    v = res.violations[0]
    assert v["kind"] in (CAUGHT_BY[name] if checks == "on" else CAUGHT_BY[name] - {"invariant"}), v


@pytest.mark.parametrize("name", sorted(REPRODUCED_BY))
def test_plant_is_caught_by_its_reproducer(name):
    """The campaign's shrunk reproducer of the plant catches it, and replays clean
    against the real engine."""
    path, kinds = REPRODUCED_BY[name]
    cfg, ops, plant, doc = load_reproducer(os.path.join(os.path.dirname(__file__), "plant_reproducers", path))
    assert plant.name == name and doc["note"]
    v, _ = replay_in_tmp(ops, cfg, plant)
    assert v is not None and v.kind in kinds, v
    clean, n = replay_in_tmp(ops, cfg, None)
    assert clean is None and n == len(ops), clean


def test_async_plant_is_found_in_the_async_path_and_shrinks(tmp_path):
    """The fuzzer drives ``store_async``: an async store acknowledged before its commit
    is found within a small budget; the shrunk reproducer fails through an async store
    (the same ops with sync stores are clean under the plant), and the same ops are
    clean against the real engine."""
    plant = plants.get("async-ack-before-publish")
    res = run_campaign(0, steps=600, plant=plant, stop_after=1, shrink_s=20, out=str(tmp_path))
    assert res.violations, f"not found in {res.steps} ops"
    (v,) = res.violations
    assert v["kind"] in CAUGHT_BY[plant.name] and "acknowledged" in v["detail"], v
    cfg, ops, _, _ = load_reproducer(v["reproducer"])
    assert ops[-1]["op"] == "store_async", ops
    sync = [{**op, "op": "store"} if op["op"] == "store_async" else op for op in ops]
    assert replay_in_tmp(sync, cfg, plant) == (None, len(ops))
    again, _ = replay_in_tmp(ops, cfg, plant)
    assert again is not None and again.kind == v["kind"]
    clean, n = replay_in_tmp(ops, cfg, None)
    assert clean is None and n == len(ops)


def test_found_failure_shrinks_and_replays(tmp_path, capsys, monkeypatch):
    # Without the driver's invariant checks the plant shows only after a power loss.
    monkeypatch.setenv(DEBUG_ENV, "0")
    out = tmp_path / "repro"
    rc = main(["fuzz", "--plant", "skip-dir-fsync", "--steps", str(BUDGET), "--stop-after", "1",
               "--shrink-seconds", "20", "--out", str(out), "--json", "--quiet"])
    assert rc == 1
    report = json.loads(capsys.readouterr().out)
    (v,) = report["violations"]
    assert v["replayed"] is True
    assert v["shrunk_ops"] <= 4, v  # a store, then power loss, is all it takes
    cfg, ops, plant, doc = load_reproducer(v["reproducer"])
    assert plant.name == "skip-dir-fsync" and doc["replay"] == v["replay"]
    assert any(op["op"] == "power" or op.get("crash", {}).get("power") for op in ops), ops
    assert main(["fuzz", "--replay", v["reproducer"], "--quiet"]) == 1
    again, _ = replay_in_tmp(ops, cfg, plant)
    assert again is not None and again.kind == v["kind"]
    # The same ops against the real engine: clean.
    clean, n = replay_in_tmp(ops, cfg, None)
    assert clean is None and n == len(ops)


def test_invariant_check_finds_skip_dir_fsync_in_one_store(tmp_path, capsys):
    out = tmp_path / "repro"
    rc = main(["fuzz", "--plant", "skip-dir-fsync", "--steps", str(BUDGET), "--stop-after", "1",
               "--shrink-seconds", "20", "--out", str(out), "--json", "--quiet"])
    assert rc == 1
    (v,) = json.loads(capsys.readouterr().out)["violations"]
    assert v["kind"] == "invariant" and "not durable on rank" in v["detail"], v
    _cfg, ops, _plant, _doc = load_reproducer(v["reproducer"])
    assert not any(op["op"] == "power" or op.get("crash", {}).get("power") for op in ops), ops


def _planted_engine(root: str, fs: FaultFS | None) -> Engine:
    layout = make_layout(ranks=2)
    Engine.open(root, layout, 1 << 24, fs=fs).close()  # the cache exists; its ranks are planted
    ranks = plants.get("skip-dir-fsync").make_ranks(layout, root, fs, None)
    return Engine.open(root, layout, 1 << 24, fs=fs, ranks=ranks)


@pytest.mark.parametrize("fault_fs", [True, False], ids=["faultfs", "osfs"])
def test_publish_without_dir_fsync_is_refused_by_the_invariant_check(tmp_path, monkeypatch, fault_fs):
    """With the checks on, the store whose rename is not durable fails at its publish
    (PUBLISHED invariant 2), before the publish commits: nothing is published and the
    journal is empty. Durability is the fault file system's answer, or (real file
    system) what the rank's own fsync, rename and directory fsync completed."""
    monkeypatch.setenv(DEBUG_ENV, "1")
    root = str(tmp_path / "c")
    tokens = tokens_for(1, 2)
    eng = _planted_engine(root, FaultFS() if fault_fs else None)
    try:
        with pytest.raises(InvariantViolation, match=r"store PUBLISHED 2: .* not durable on rank0"):
            store_tokens(eng, tokens)
        assert node_at(eng, tokens) is None
        assert eng.catalog.journal() == []
        assert eng.catalog.query("SELECT count(*) FROM files")[0][0] == 0
        assert eng.audit().ok
    finally:
        eng.close()


def test_publish_without_dir_fsync_with_checks_off_shows_only_after_power_loss(tmp_path, monkeypatch):
    """The same plant with the checks off: the store is acknowledged and the audit is
    clean; only a power loss (the fuzzer's later check) shows the node damaged."""
    monkeypatch.setenv(DEBUG_ENV, "0")
    root = str(tmp_path / "c")
    tokens = tokens_for(1, 2)
    fs = FaultFS()
    eng = _planted_engine(root, fs)
    try:
        assert store_tokens(eng, tokens).status == STORED
        assert node_at(eng, tokens).state == "ready"
        assert eng.audit().ok
    finally:
        eng.close()
    fs.crash("drop")
    eng = Engine.open(root, make_layout(ranks=2), 1 << 24, fs=fs)
    try:
        assert node_at(eng, tokens).state == "damaged"
    finally:
        eng.close()


@pytest.mark.parametrize("checks", ["1", "0"])
def test_refill_ending_without_its_retire_output(tmp_path, monkeypatch, checks):
    """A refill whose ``retire_old`` output is skipped reaches DONE still owning the
    old generation: the invariant check raises at that transition (DONE 2); with the
    checks off the store is acknowledged and only the audit finds the old generation's
    rows, still owned by the ended transaction (invariant 3)."""
    monkeypatch.setenv(DEBUG_ENV, checks)
    plant = plants.get("skip-retire-output")
    tokens = tokens_for(2, 2)
    with plant.active():
        eng = plant.engine_cls.open(str(tmp_path / "c"), make_layout(ranks=2), 1 << 24)
        try:
            assert store_tokens(eng, tokens).status == STORED
            health.invalidate(eng.flows.health, node_at(eng, tokens), "test")
            if checks == "1":
                with pytest.raises(InvariantViolation, match=r"store DONE 2: still owns rank0/"):
                    store_tokens(eng, tokens)
            else:
                assert store_tokens(eng, tokens).status == REFILLED
                rep = eng.audit()
                assert not rep.ok and any(
                    v.invariant == 3 and "owned by transaction" in v.detail for v in rep.violations
                ), rep.violations
        finally:
            eng.close()
